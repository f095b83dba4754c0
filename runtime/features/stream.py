"""The ref stream and its SQLite control plane: how a rollout engine hands feature
refs to a trainer, each sample trained exactly once across crashes of either side.

    stream file   append-only JSON lines ``{"seq": n, "ref": {...}}``, then ``{"end": true}``
    control db    SQLite (WAL): every sample's state, committed -> acked, and its ref

    with Producer("refs.jsonl", "control.db", high_watermark=64) as producer:
        producer.publish(ref)            # False: this sample was published before
    with Consumer("refs.jsonl", "control.db") as consumer:
        for ref in consumer:             # unacked refs from SQLite first, then the stream
            ...train...; consumer.ack([ref])   # after the optimizer step

Exactly once.  The producer commits a sample in SQLite *before* it appends the
line, so every ref a consumer could ever see is in SQLite, and every committed,
unacked sample can be re-read from SQLite (``ControlPlane.unacked``) whatever
happened to its line.  A consumer yields the unacked samples first, then stream
lines, skipping samples acked (trained) or already yielded in this run; an ack is
a durable transaction after the optimizer step.  So a crash before the ack means
the sample is yielded again by the restarted consumer, one after it means never
again, and a restarted producer's duplicates are refused by the commit (dedup by
sample id).  Nothing depends on the saved stream offset: it only skips re-reading.

One producer per stream (an exclusive ``flock`` on the stream file) and one
consumer per control db (``flock`` on ``<db>.consumer.lock``); one db per stream:
the db records the stream file it was first used with (device, inode) and refuses
another.  A producer only ever changes a file it created as a stream: an existing
file must be a valid stream bound to its db, checked before anything is cut.
The end marker is final: a reader stops at the first one, and a producer refuses
a stream that has one.  Keep ``high_watermark`` above the consumer's ack batch, or
the producer waits for acks that wait for refs (the reader then reports idle).

CLI: ``source-patch stream-status --db PATH [--stream PATH] [--json]`` (also ``python -m
source_patch.runtime.features.stream status ...``): exit 1 when the stream is corrupt, 2 when
the db or the stream cannot be read (one line ``source-patch: error: ...``; JSON under --json).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from typing import Iterable, Iterator

from ..core import commands
from .control_plane import _DUPLICATE, _FULL, ControlPlane
from .ref import FeatureRef
from .stream_format import StreamCorrupt, StreamError
from .stream_io import RefReader, RefWriter, _lock, _open_rw

# The stream in modules: stream_format.py (lines, records, checks, StreamError and
# StreamCorrupt), stream_io.py (RefWriter, RefReader, StreamIdle), control_plane.py
# (SQLite, ControlPlane), this one (Producer, Consumer, status).  Each name is imported
# from the module that defines it.
__all__ = ["Backpressure", "Consumer", "Producer", "main", "status"]


# ---- producer and consumer -------------------------------------------------------

class Backpressure(StreamError):
    """The producer waited longer than its timeout for in-flight samples to be acked."""


class Producer:
    """Publishes refs: commit in SQLite, then append to the stream.  Opening it appends
    the lines a previous producer committed but did not write (it died in between), so
    the stream again holds every committed, unacked sample.

    The stream is checked before the db is opened, and the db bound to it (or checked
    to be bound to it) before any torn tail is cut: a file that is not this db's
    stream is refused untouched, and a refused new stream file is removed."""

    def __init__(self, stream_path, db_path, high_watermark: int = 64, poll: float = 0.05,
                 timeout: float | None = None, fsync: bool = False):
        if high_watermark < 1:
            raise ValueError("high_watermark must be at least 1")
        self.high_watermark, self.poll, self.timeout = high_watermark, poll, timeout
        self.plane = None

        def bind(st, fresh):
            self.plane = ControlPlane(db_path)
            self.plane.bind_stream(os.fspath(stream_path), st, fresh)

        try:
            self.writer = RefWriter(stream_path, fsync=fsync, bind=bind)
        except BaseException:
            if self.plane is not None:
                self.plane.close()
            raise
        if self.writer.ended:
            self.writer.abandon()
            self.plane.close()
            raise StreamError(f"stream {self.writer.path} has ended (end marker): a new run needs a new stream")
        self._last_seq = -1 if self.writer.last_seq is None else self.writer.last_seq
        try:
            self._catch_up()
        except BaseException:
            self.abandon()
            raise

    def publish(self, ref: FeatureRef, timeout: float | None = None) -> bool:
        """Publish one ref; False if its sample was committed before (not re-published).
        Waits while ``high_watermark`` samples are in flight; Backpressure after
        ``timeout`` seconds (default: the producer's; None waits for ever)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while (seq := self.plane._commit(ref, self.high_watermark)) is _FULL:
            if deadline is not None and time.monotonic() >= deadline:
                raise Backpressure(f"{self.plane.in_flight()} samples in flight (high watermark "
                                   f"{self.high_watermark}) for {timeout} s: the consumer is not acking")
            time.sleep(self.poll)
        if seq is _DUPLICATE:
            return False
        if self._behind:
            self._catch_up()  # appends this ref too, after the ones missing before it
        else:
            self._append(seq, ref)
        return True

    def _append(self, seq: int, ref: FeatureRef) -> None:
        try:
            self.writer.append(ref, seq)
        except BaseException:
            self._behind = True  # committed, so unacked() still has it; re-appended next time
            raise
        self._last_seq = seq

    def _catch_up(self) -> None:
        """Append, in seq order, the committed unacked samples past the last line written."""
        self._behind = True
        for seq, ref in self.plane._unacked_rows(self._last_seq):
            self._append(seq, self.plane._ref(seq, ref))
        self._behind = False

    def in_flight(self) -> int:
        return self.plane.in_flight()

    def close(self) -> None:
        """Write the end marker (after any line still missing) and close."""
        if self.writer._fd is None:
            return
        if self._behind:
            self._catch_up()
        self.writer.close()
        self.plane.close()

    def abandon(self) -> None:
        """Close without the end marker."""
        self.writer.abandon()
        self.plane.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if kind is None:
            self.close()
        else:  # no end marker after a failure: the consumer should not think all was sent
            self.abandon()


class Consumer:
    """Yields the refs to train on, each sample once across restarts, given that the
    caller acks a sample only after the optimizer step that trained on it."""

    def __init__(self, stream_path, db_path, idle_timeout: float = 30.0, poll: float = 0.05):
        self.stream_path, self.idle_timeout, self.poll = os.fspath(stream_path), idle_timeout, poll
        self.reader: RefReader | None = None
        self._yielded: set[str] = set()
        self._lock_fd, _ = _open_rw(os.fspath(db_path) + ".consumer.lock", "consumer lock")
        _lock(self._lock_fd, f"consumer lock of {os.fspath(db_path)}")
        try:
            self.plane = ControlPlane(db_path)
            self.plane.check_stream(self.stream_path)
            self.resumed_from = self.plane.saved_offset(self.stream_path)
        except BaseException:
            if hasattr(self, "plane"):
                self.plane.close()
            os.close(self._lock_fd)
            raise

    def __iter__(self) -> Iterator[FeatureRef]:
        # 1. what a previous run took but did not ack (and lines that never made it out)
        yield from self._sweep()
        # 2. the stream; a line is always committed first, so an unknown sample means
        #    the stream and the db do not belong together (checked again: the producer
        #    may have bound the db since)
        self.plane.check_stream(self.stream_path)
        self.reader = RefReader(self.stream_path, self.resumed_from, self.idle_timeout, self.poll)
        for record in self.reader:
            sample = record.ref.sample_id
            if sample in self._yielded:
                continue
            state = self.plane.state(sample)
            if state is None:
                raise StreamCorrupt(f"{self.stream_path}: sample {sample!r} at byte offset {record.offset} "
                                    f"is not in the control plane {self.plane.path}")
            if state == "acked":
                continue
            self._yielded.add(sample)
            yield record.ref
        # 3. the end marker: anything committed and neither acked nor yielded yet
        yield from self._sweep()

    def _sweep(self) -> Iterator[FeatureRef]:
        for ref in self.plane.unacked():
            if ref.sample_id not in self._yielded:
                self._yielded.add(ref.sample_id)
                yield ref

    def ack(self, refs: Iterable[FeatureRef | str]) -> int:
        """Ack trained samples (after the optimizer step), saving the stream offset with them."""
        ids = [r.sample_id if isinstance(r, FeatureRef) else r for r in refs]
        position = None
        if self.reader is not None and self.reader.offset > 0:
            position = (self.stream_path, self.reader.offset)
        return self.plane.ack(ids, stream_offset=position)

    def close(self) -> None:
        """Save the stream offset (a shortcut for the next run only) and release the lock."""
        if self.reader is not None:
            self.reader.close()
            if self.reader.offset > 0:
                try:
                    with self.plane._tx() as db:
                        self.plane._save_offset(db, self.stream_path, self.reader.offset)
                except (sqlite3.Error, OSError, StreamError):
                    pass
        self.plane.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- status CLI ------------------------------------------------------------------

def status(db_path, stream_path=None) -> dict:
    """Counts from the control plane, and with the stream:

    lost        stream records whose sample is not in the control plane: no consumer
                can ack them (the stream and the db do not belong together).  Must be 0.
    unstreamed  in-flight samples with no line in the stream (a producer died between
                commit and append): not lost, a restarted consumer re-reads them from
                SQLite and a restarted producer re-appends them.
    """
    if not os.path.exists(db_path):
        raise StreamError(f"no control db at {db_path}")
    with ControlPlane(db_path) as plane:
        out = plane.stats()
        oldest = plane.oldest_in_flight()
        out["oldest_in_flight_s"] = None if oldest is None else round(oldest, 3)
        if stream_path is None:
            return out
        known = {sid: state for sid, state in plane._read("SELECT sample_id, state FROM samples")}
        out["consumer_offset"] = plane.saved_offset(stream_path)
    streamed, corrupt = set(), None
    with RefReader(stream_path, idle_timeout=0) as reader:
        try:
            streamed.update(r.ref.sample_id for r in reader.read_available())
        except StreamCorrupt as e:
            corrupt = str(e)
    out.update(lost=len(streamed - known.keys()),
               unstreamed=sum(1 for sid, state in known.items() if state == "committed" and sid not in streamed),
               stream_bytes=os.path.getsize(stream_path) if os.path.exists(stream_path) else 0,
               stream_refs=len(streamed), stream_read_to=reader.offset, stream_ended=reader.ended,
               corrupt=corrupt)
    return out


def parser(prog: str = "python -m source_patch.runtime.features.stream"):
    p = commands.Parser(prog=prog, description="the feature ref stream and its control plane")
    sub = p.add_subparsers(dest="command", required=True)
    # `source-patch stream-status` hides the word `status`: its usage line says what the user typed
    st = sub.add_parser("status", help="counts: committed, in flight, acked, lost; stream size and offset",
                        prog=prog if prog.endswith("stream-status") else None)
    st.add_argument("--db", required=True, help="the control plane's SQLite file")
    st.add_argument("--stream", help="the ref stream file (adds lost, unstreamed, stream size)")
    st.add_argument("--json", action="store_true", help="one JSON object instead of lines (an error too)")
    return p


def main(argv=None, prog: str = "python -m source_patch.runtime.features.stream") -> int:
    args = parser(prog).parse_args(argv)
    try:
        out = status(args.db, args.stream)
    except (StreamError, OSError, sqlite3.Error) as e:  # unusable input: one line, never a traceback
        return commands.error(commands.first_line(e), as_json=args.json)
    code = commands.FINDINGS if out.get("corrupt") else commands.OK
    if args.json:
        print(json.dumps({**out, "exit": code}))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return code


if __name__ == "__main__":
    sys.exit(main())
