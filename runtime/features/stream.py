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
consumer per control db (``flock`` on ``<db>.consumer.lock``); one db per stream.
The end marker is final: a reader stops at the first one, and a producer refuses
a stream that has one.  Keep ``high_watermark`` above the consumer's ack batch, or
the producer waits for acks that wait for refs (the reader then reports idle).

CLI: ``python -m source_patch.runtime.features.stream status --db PATH [--stream PATH] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import sqlite3
import sys
import time
from contextlib import contextmanager
from typing import Iterable, Iterator, NamedTuple

from .ref import FeatureRef, RefError

MAX_LINE = 1 << 20  # bytes per stream line; a valid ref is well under it (ref.py's limits)
END = {"end": True}


class StreamError(RuntimeError):
    """The stream or the control plane cannot be used as asked."""


class StreamCorrupt(StreamError):
    """A stream line that is not a valid record (the message names its byte offset)."""


class StreamIdle(StreamError):
    """No new line and no end marker for ``idle_timeout`` seconds."""


class Backpressure(StreamError):
    """The producer waited longer than its timeout for in-flight samples to be acked."""


class Record(NamedTuple):
    seq: int
    ref: FeatureRef
    offset: int  # byte offset where the line starts


def _line(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _lock(fd: int, what: str) -> None:
    """An exclusive lock the kernel drops when the holder dies (a restart just works)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StreamError(f"{what} is held by another live process") from None


# ---- the stream: writer and reader ------------------------------------------------

class RefWriter:
    """Appends records to the stream.  A line goes out in one ``os.write``; a reader
    only parses lines that end in a newline, so it never takes a partial line for a
    record.  A torn tail (a writer killed mid-line, a failed write) is cut off before
    the next append: no reader has consumed it, since it had no newline."""

    def __init__(self, path, fsync: bool = False, max_line: int = MAX_LINE):
        self.path, self.fsync, self.max_line = os.fspath(path), fsync, max_line
        self._torn = False
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        _lock(self._fd, f"stream {self.path}")
        try:
            self._cut_torn_tail()
            self.last_seq, self.ended = _last_record(self.path, max_line)
        except BaseException:
            self.abandon()
            raise

    def append(self, ref: FeatureRef, seq: int) -> int:
        """Append ``ref`` as record ``seq``; returns the stream size after it."""
        return self._write(_line({"seq": seq, "ref": ref.to_json()}))

    def close(self) -> None:
        """Append the end marker and close."""
        if self._fd is not None:
            self._write(_line(END))
            self.ended = True
            self.abandon()

    def abandon(self) -> None:
        """Close without an end marker (readers will report idle: the producer is gone)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, line: bytes) -> int:
        if self._fd is None:
            raise StreamError(f"stream {self.path} is closed")
        if len(line) - 1 > self.max_line:
            raise StreamError(f"a line of {len(line) - 1} bytes is over the {self.max_line}-byte limit")
        if self._torn:
            self._cut_torn_tail()
            self._torn = False
        view, start = memoryview(line), os.fstat(self._fd).st_size
        try:
            while view:  # a regular file takes it whole; the loop only covers a short write
                view = view[os.write(self._fd, view):]
        except BaseException:  # a part of the line may be out: no reader takes it, cut it
            try:
                self._cut_torn_tail(start)
            except OSError:
                self._torn = True  # the next write cuts it first
            raise
        if self.fsync:  # the line is complete and may be read already: never cut it
            os.fsync(self._fd)
        return start + len(line)

    def _cut_torn_tail(self, size: int | None = None) -> None:
        """Truncate to the end of the last complete line (or to ``size``)."""
        if size is None:
            size = _complete_size(self._fd)
        if os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, size)


def _complete_size(fd: int) -> int:
    """Bytes up to and including the last newline of the file."""
    pos = os.fstat(fd).st_size
    while pos > 0:
        start = max(0, pos - 65536)
        cut = os.pread(fd, pos - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0


def _last_record(path: str, max_line: int) -> tuple[int | None, bool]:
    """(seq of the last ref line or None, whether the stream has ended), read from the tail."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = _complete_size(fd)
        if size == 0:
            return None, False
        start = max(0, size - max_line - 2)
        tail = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    head = tail.rfind(b"\n", 0, len(tail) - 1) + 1
    if head == 0 and start > 0:
        raise StreamCorrupt(f"{path}: the last line is over the {max_line}-byte limit")
    record = _parse(tail[head:-1], start + head, path)
    return (None, True) if record is None else (record.seq, False)


def _parse(line: bytes, offset: int, path: str) -> Record | None:
    """One line -> a Record, or None for the end marker; StreamCorrupt names the offset."""
    where = f"{path}: line at byte offset {offset}"
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise StreamCorrupt(f"{where} is not JSON: {str(e)[:120]}") from None
    if doc == END and doc["end"] is True:  # not 1 or 1.0, which compare equal to True
        return None
    if not isinstance(doc, dict) or set(doc) != {"seq", "ref"}:
        raise StreamCorrupt(f'{where} is neither {{"seq": n, "ref": {{...}}}} nor {{"end": true}}')
    seq = doc["seq"]
    if type(seq) is not int or not 0 <= seq < 2**62:
        raise StreamCorrupt(f"{where}: seq must be a non-negative integer, got {str(seq)[:40]}")
    try:
        return Record(seq, FeatureRef.from_json(doc["ref"]), offset)
    except RefError as e:
        raise StreamCorrupt(f"{where}: {e}") from None


class RefReader:
    """Iterates the records of a stream from byte ``offset``, waiting for new lines,
    until the end marker.  ``offset`` is always the start of the next unread line (at
    the end: the end marker's, so a reader resumed there stops at once)."""

    def __init__(self, path, offset: int = 0, idle_timeout: float = 30.0, poll: float = 0.05,
                 max_line: int = MAX_LINE):
        self.path, self.offset = os.fspath(path), offset
        self.idle_timeout, self.poll, self.max_line = float(idle_timeout), poll, max_line
        self.ended = False
        self._fd = None
        self._lines: collections.deque[bytes] = collections.deque()  # complete lines read ahead

    def __iter__(self) -> Iterator[Record]:
        idle_since = time.monotonic()
        while not self.ended:
            record = self.next_record()
            if record is not None:
                yield record
                idle_since = time.monotonic()  # time spent by the caller is not idleness
            elif not self.ended:
                if time.monotonic() - idle_since >= self.idle_timeout:
                    raise StreamIdle(f"no new ref for {self.idle_timeout} s and no end marker: the "
                                     f"producer may have died (last offset {self.offset}) [{self.path}]")
                time.sleep(self.poll)

    def read_available(self) -> list[Record]:
        """The records complete now, without waiting."""
        out = []
        while (record := self.next_record()) is not None:
            out.append(record)
        return out

    def next_record(self) -> Record | None:
        """The next complete record, or None (nothing complete yet, or the end marker)."""
        if self.ended or (not self._lines and not self._fill()):
            return None
        line = self._lines[0]
        record = _parse(line, self.offset, self.path)  # raises before consuming: offset stays
        self._lines.popleft()
        if record is None:
            self.ended = True
            self._lines.clear()
            return None
        self.offset += len(line) + 1
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _fill(self) -> bool:
        """Read the complete lines after ``offset``; a partial last line is left for the
        next poll (only complete lines are kept, so a cut torn tail never lingers here)."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False  # the producer has not started yet: idle
        size = os.fstat(self._fd).st_size
        if size < self.offset:
            raise StreamCorrupt(f"{self.path} shrank to {size} bytes, below offset {self.offset}: "
                                f"it was truncated or replaced")
        if size == self.offset:
            return False
        chunk = os.pread(self._fd, min(size - self.offset, self.max_line + 1), self.offset)
        cut = chunk.rfind(b"\n")
        if cut < 0:
            if len(chunk) > self.max_line:
                raise StreamCorrupt(f"{self.path}: line at byte offset {self.offset} is over the "
                                    f"{self.max_line}-byte limit")
            return False
        self._lines.extend(chunk[:cut].split(b"\n"))
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- the control plane -----------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('committed', 'acked')),
    seq INTEGER NOT NULL UNIQUE,
    committed_at REAL NOT NULL,
    acked_at REAL,
    ref TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_state_seq ON samples (state, seq);
CREATE TABLE IF NOT EXISTS consumer_offsets (
    stream TEXT PRIMARY KEY,
    dev INTEGER NOT NULL, ino INTEGER NOT NULL, offset INTEGER NOT NULL, updated_at REAL NOT NULL
);
"""
_DUPLICATE, _FULL = object(), object()


class ControlPlane:
    """Sample states in SQLite, shared by the producer and consumer processes: WAL (readers
    never block the writer), a busy timeout (writers queue instead of failing), every write
    one ``BEGIN IMMEDIATE`` transaction, ``synchronous=FULL`` (an ack survives power loss).
    One connection per process: open a ControlPlane in each process, never share one."""

    def __init__(self, path, busy_timeout: float = 30.0):
        self.path = os.fspath(path)
        self._pid = os.getpid()
        self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        self._wal(busy_timeout)
        self._db.execute("PRAGMA synchronous = FULL")
        with self._tx() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)

    def _wal(self, busy_timeout: float) -> None:
        """Switch to WAL.  Two processes opening a new db at once race on it, and SQLite
        answers "locked" at once there instead of waiting: retry up to the busy timeout."""
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        if mode.lower() != "wal":
            raise StreamError(f"{self.path}: SQLite cannot use WAL here (journal mode {mode}); "
                              f"use a local filesystem")

    @contextmanager
    def _tx(self):
        """One write transaction; IMMEDIATE takes the write lock first, so two writers
        queue on the busy timeout instead of failing on a read-to-write upgrade."""
        if os.getpid() != self._pid:
            raise StreamError(f"ControlPlane {self.path} opened in process {self._pid} is used in "
                              f"process {os.getpid()}: open one in each process")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _read(self, sql: str, args=()) -> list:
        if os.getpid() != self._pid:
            raise StreamError(f"ControlPlane {self.path} opened in process {self._pid} is used in "
                              f"process {os.getpid()}: open one in each process")
        return self._db.execute(sql, args).fetchall()

    def commit(self, ref: FeatureRef) -> bool:
        """Record ``ref`` as committed; False if its sample was committed or acked before."""
        return isinstance(self._commit(ref), int)

    def _commit(self, ref: FeatureRef, limit: int | None = None):
        """The new seq, _DUPLICATE, or _FULL (``limit`` samples in flight).  The
        backpressure check shares the insert's transaction, so it cannot be raced."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM samples WHERE sample_id = ?", (ref.sample_id,)).fetchone():
                return _DUPLICATE
            if limit is not None and db.execute(
                    "SELECT COUNT(*) FROM samples WHERE state = 'committed'").fetchone()[0] >= limit:
                return _FULL
            seq = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM samples").fetchone()[0]
            db.execute("INSERT INTO samples VALUES (?, ?, 'committed', ?, ?, NULL, ?)",
                       (ref.sample_id, ref.generation, seq, time.time(),
                        json.dumps(ref.to_json(), separators=(",", ":"))))
            return seq

    def ack(self, sample_ids: Iterable[str], *, stream_offset: tuple[str, int] | None = None) -> int:
        """Mark samples trained (after the optimizer step), durably, in one transaction;
        returns how many were newly acked.  ``stream_offset`` = (stream path, offset)
        saves the consumer's position in the same transaction.  An id never committed
        is an error (KeyError), and nothing is acked then."""
        now, newly = time.time(), 0
        with self._tx() as db:
            for sample_id in sample_ids:
                row = db.execute("SELECT state FROM samples WHERE sample_id = ?", (sample_id,)).fetchone()
                if row is None:
                    raise KeyError(f"sample {sample_id!r} was never committed")
                if row[0] == "committed":
                    db.execute("UPDATE samples SET state = 'acked', acked_at = ? WHERE sample_id = ?",
                               (now, sample_id))
                    newly += 1
            if stream_offset is not None:
                self._save_offset(db, *stream_offset)
        return newly

    def state(self, sample_id: str) -> str | None:
        """'committed', 'acked', or None (unknown sample)."""
        rows = self._read("SELECT state FROM samples WHERE sample_id = ?", (sample_id,))
        return rows[0][0] if rows else None

    def is_done(self, sample_id: str) -> bool:
        """Whether the sample is acked (trained, durably)."""
        return self.state(sample_id) == "acked"

    def in_flight(self) -> int:
        return self._read("SELECT COUNT(*) FROM samples WHERE state = 'committed'")[0][0]

    def unacked(self) -> list[FeatureRef]:
        """Committed, not acked, in seq order: what a restarted consumer must re-read."""
        return [FeatureRef.from_json(json.loads(ref)) for _, ref in self._unacked_rows()]

    def _unacked_rows(self, after_seq: int = -1) -> list:
        return self._read("SELECT seq, ref FROM samples WHERE state = 'committed' AND seq > ? "
                          "ORDER BY seq", (after_seq,))

    def stats(self) -> dict:
        """committed: samples ever committed (in flight + acked)."""
        total, acked = self._read("SELECT COUNT(*), COALESCE(SUM(state = 'acked'), 0) FROM samples")[0]
        return {"committed": total, "in_flight": total - acked, "acked": acked}

    def oldest_in_flight(self) -> float | None:
        """Seconds since the oldest unacked sample was committed (None: nothing in flight)."""
        at = self._read("SELECT MIN(committed_at) FROM samples WHERE state = 'committed'")[0][0]
        return None if at is None else max(0.0, time.time() - at)

    @staticmethod
    def _save_offset(db, stream: str, offset: int) -> None:
        st = os.stat(stream)
        db.execute("INSERT OR REPLACE INTO consumer_offsets VALUES (?, ?, ?, ?, ?)",
                   (os.path.realpath(stream), st.st_dev, st.st_ino, offset, time.time()))

    def saved_offset(self, stream) -> int:
        """Where a consumer of ``stream`` may resume: the saved offset if it still fits
        this very file (same inode, inside it, at a line start), else 0."""
        stream = os.fspath(stream)
        rows = self._read("SELECT dev, ino, offset FROM consumer_offsets WHERE stream = ?",
                          (os.path.realpath(stream),))
        if not rows:
            return 0
        dev, ino, offset = rows[0]
        try:
            with open(stream, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != (dev, ino) or not 0 < offset <= st.st_size:
                    return 0
                f.seek(offset - 1)
                return offset if f.read(1) == b"\n" else 0
        except OSError:
            return 0

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- producer and consumer -------------------------------------------------------

class Producer:
    """Publishes refs: commit in SQLite, then append to the stream.  Opening it appends
    the lines a previous producer committed but did not write (it died in between), so
    the stream again holds every committed, unacked sample."""

    def __init__(self, stream_path, db_path, high_watermark: int = 64, poll: float = 0.05,
                 timeout: float | None = None, fsync: bool = False):
        if high_watermark < 1:
            raise ValueError("high_watermark must be at least 1")
        self.high_watermark, self.poll, self.timeout = high_watermark, poll, timeout
        self.plane = ControlPlane(db_path)
        try:
            self.writer = RefWriter(stream_path, fsync=fsync)
        except BaseException:
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
            self._append(seq, FeatureRef.from_json(json.loads(ref)))
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
        self._lock_fd = os.open(os.fspath(db_path) + ".consumer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        _lock(self._lock_fd, f"consumer lock of {os.fspath(db_path)}")
        self.plane = ControlPlane(db_path)
        self.resumed_from = self.plane.saved_offset(self.stream_path)
        self.reader: RefReader | None = None
        self._yielded: set[str] = set()

    def __iter__(self) -> Iterator[FeatureRef]:
        # 1. what a previous run took but did not ack (and lines that never made it out)
        yield from self._sweep()
        # 2. the stream; a line is always committed first, so an unknown sample means
        #    the stream and the db do not belong together
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.features.stream",
                                     description="the feature ref stream and its control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="counts: committed, in flight, acked, lost; stream size and offset")
    st.add_argument("--db", required=True, help="the control plane's SQLite file")
    st.add_argument("--stream", help="the ref stream file (adds lost, unstreamed, stream size)")
    st.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    try:
        out = status(args.db, args.stream)
    except StreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 1 if out.get("corrupt") else 0


if __name__ == "__main__":
    sys.exit(main())
