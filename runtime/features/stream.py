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

CLI: ``python -m source_patch.runtime.features.stream status --db PATH [--stream PATH] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import sqlite3
import stat
import sys
import time
from contextlib import contextmanager
from typing import Iterable, Iterator, NamedTuple

from ..core import bounded
from .ref import MAX_TENSORS, FeatureRef, RefError

MAX_LINE = 1 << 20  # bytes per stream line; a valid ref is well under it (ref.py's limits)
END = {"end": True}
# a line {"seq", "ref": {"tensors": [{"shape": []}]}} nests 5 deep; a db row (the ref) 4;
# each tensor opens 2 containers
LINE_DEPTH, ROW_DEPTH, MAX_CONTAINERS = 5, 4, 2 * MAX_TENSORS + 3
SQLITE_MAGIC = b"SQLite format 3\x00"


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


def _open_rw(path: str, what: str, append: bool = False) -> tuple[int, bool]:
    """(fd, created): ``path`` opened read-write, created if absent.  Only a regular
    file is opened: a symlink, folder, FIFO or device is refused, checked before the
    open (opening a device can act) and again on the fd; nothing blocks."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    except OSError as e:
        raise StreamError(f"cannot create {what} {path}: {e.strerror or e}") from None
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            fd = os.open(path, flags)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd, False
            os.close(fd)
    except OSError as e:
        raise StreamError(f"cannot open {what} {path}: {e.strerror or e}") from None
    raise StreamError(f"{what} {path} is not a regular file (a symlink, folder, FIFO or device): refused")


# ---- the stream: writer and reader ------------------------------------------------

class RefWriter:
    """Appends records to the stream.  A line goes out in one ``os.write``; a reader
    only parses lines that end in a newline, so it never takes a partial line for a
    record.  A torn tail (a writer killed mid-line, a failed write) is cut off before
    the next append: no reader has consumed it, since it had no newline.

    An existing file is checked first, read only (``_check_stream``): one that is not
    a ref stream is refused untouched.  ``bind(stat, fresh)``, if given, runs after that
    check and before any cut (the producer binds its db there, and may refuse)."""

    def __init__(self, path, fsync: bool = False, max_line: int = MAX_LINE, bind=None):
        self.path, self.fsync, self.max_line = os.fspath(path), fsync, max_line
        self._torn = False
        self._fd, created = _open_rw(self.path, "stream", append=True)
        _lock(self._fd, f"stream {self.path}")
        st = os.fstat(self._fd)
        try:
            self.last_seq, self.ended, complete = _check_stream(self._fd, self.path, max_line)
            if bind is not None:
                bind(st, created or st.st_size == 0)
            self._cut_torn_tail(complete)
        except BaseException:
            self.abandon()
            if created:
                _remove_if_empty(self.path, st)
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


def _remove_if_empty(path: str, st: os.stat_result) -> None:
    """Remove the file this process created at ``path`` (still empty, same inode)."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) and now.st_size == 0:
            os.unlink(path)
    except OSError:
        pass


def _torn_append(tail: bytes) -> bool:
    """Whether bytes after the last newline can be a torn append of ours: the start of
    a record line or of the end marker (anything else is not a stream's tail)."""
    head = b'{"seq":'
    return tail[:len(head)] == head[:len(tail)] or b'{"end":true}'.startswith(tail)


def _check_stream(fd: int, path: str, max_line: int) -> tuple[int | None, bool, int]:
    """(seq of the last record or None, whether the stream has ended, size of its
    complete lines) of an open file, read only.  StreamCorrupt, naming the file as
    not a stream, unless its first and last complete lines are records and what
    follows the last newline can be a torn append."""
    size, complete = os.fstat(fd).st_size, _complete_size(fd)
    try:
        if size - complete > max_line or not _torn_append(os.pread(fd, size - complete, complete)):
            raise StreamCorrupt(f"{path}: the {size - complete} bytes after the last newline "
                                f"(byte offset {complete}) are not the start of a record")
        if complete == 0:
            return None, False, 0
        first = os.pread(fd, min(complete, max_line + 1), 0)
        if b"\n" not in first:
            raise StreamCorrupt(f"{path}: line at byte offset 0 is over the {max_line}-byte limit")
        _parse(first[:first.index(b"\n")], 0, path)
        return (*_last_record(fd, complete, path, max_line), complete)
    except StreamCorrupt as e:
        raise StreamCorrupt(f"{e} -- not a ref stream: refused, the file is left untouched") from None


def _last_record(fd: int, size: int, path: str, max_line: int) -> tuple[int | None, bool]:
    """(seq of the last ref line or None, whether the stream has ended), read from the
    tail of the ``size`` bytes of complete lines."""
    start = max(0, size - max_line - 2)
    tail = os.pread(fd, size - start, start)
    head = tail.rfind(b"\n", 0, len(tail) - 1) + 1
    if head == 0 and start > 0:
        raise StreamCorrupt(f"{path}: the last line is over the {max_line}-byte limit")
    record = _parse(tail[head:-1], start + head, path)
    return (None, True) if record is None else (record.seq, False)


def _parse(line: bytes, offset: int, path: str) -> Record | None:
    """One line -> a Record, or None for the end marker; StreamCorrupt names the offset."""
    where = f"{path}: line at byte offset {offset}"
    doc = bounded.load_json(line, what=f"{where} is not JSON", error=StreamCorrupt, max_bytes=MAX_LINE,
                            max_depth=LINE_DEPTH, max_items=MAX_CONTAINERS)
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
        self._file = None
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
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> bool:
        """Open the stream (a regular file only: a FIFO or folder is a StreamError, never
        a hang); False while it does not exist (the producer has not started: idle)."""
        try:
            self._file = bounded.open_regular(self.path, what="stream", error=StreamError)
        except StreamError:
            if not os.path.exists(self.path):
                return False
            raise
        return True

    def _fill(self) -> bool:
        """Read the complete lines after ``offset``; a partial last line is left for the
        next poll (only complete lines are kept, so a cut torn tail never lingers here)."""
        if self._file is None and not self._open():
            return False
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        if size < self.offset:
            raise StreamCorrupt(f"{self.path} shrank to {size} bytes, below offset {self.offset}: "
                                f"it was truncated or replaced")
        if size == self.offset:
            return False
        chunk = os.pread(fd, min(size - self.offset, self.max_line + 1), self.offset)
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
CREATE TABLE IF NOT EXISTS stream (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    path TEXT NOT NULL, dev INTEGER NOT NULL, ino INTEGER NOT NULL, bound_at REAL NOT NULL
);
"""
_DUPLICATE, _FULL = object(), object()


class ControlPlane:
    """Sample states in SQLite, shared by the producer and consumer processes: WAL (readers
    never block the writer), a busy timeout (writers queue instead of failing), every write
    one ``BEGIN IMMEDIATE`` transaction, ``synchronous=FULL`` (an ack survives power loss).
    One connection per process: open a ControlPlane in each process, never share one.
    Every SQLite error is a StreamError naming the db (a db that is not SQLite, a
    folder, a FIFO or a device is refused before SQLite opens it)."""

    def __init__(self, path, busy_timeout: float = 30.0):
        self.path = os.fspath(path)
        self._pid = os.getpid()
        _check_db_file(self.path)
        with self._sql():
            self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        try:
            with self._sql():
                self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
                self._wal(busy_timeout)
                self._db.execute("PRAGMA synchronous = FULL")
            with self._tx() as db:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    db.execute(statement)
        except BaseException:
            self._db.close()
            raise

    @contextmanager
    def _sql(self):
        """SQLite's errors as StreamError naming the db (a clean error, not sqlite3's)."""
        try:
            yield
        except sqlite3.Error as e:
            raise StreamError(f"control db {self.path}: {e}") from e

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
        with self._sql():
            self._db.execute("BEGIN IMMEDIATE")
        try:
            with self._sql():
                yield self._db
        except BaseException:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite rolled back already (e.g. a full disk)
            raise
        with self._sql():
            self._db.execute("COMMIT")

    def _read(self, sql: str, args=()) -> list:
        if os.getpid() != self._pid:
            raise StreamError(f"ControlPlane {self.path} opened in process {self._pid} is used in "
                              f"process {os.getpid()}: open one in each process")
        with self._sql():
            return self._db.execute(sql, args).fetchall()

    def _ref(self, seq: int, text) -> FeatureRef:
        """The ref of a db row, read as untrusted as a stream line (bounded, checked)."""
        where = f"control db {self.path}: the ref of seq {seq}"
        if not isinstance(text, (str, bytes)):
            raise StreamCorrupt(f"{where} is a {type(text).__name__}, not JSON text")
        doc = bounded.load_json(text, what=where, error=StreamCorrupt, max_bytes=MAX_LINE,
                                max_depth=ROW_DEPTH, max_items=MAX_CONTAINERS)
        try:
            return FeatureRef.from_json(doc)
        except RefError as e:
            raise StreamCorrupt(f"{where}: {e}") from None

    def bind_stream(self, path: str, st: os.stat_result, fresh: bool) -> None:
        """Bind this db to the stream file ``st`` (device, inode) on first use; after
        that, refuse any other file.  A file with records (not ``fresh``) is only
        accepted by the db it was bound to: a stream and its db are made together."""
        with self._tx() as db:
            row = db.execute("SELECT path, dev, ino FROM stream").fetchone()
            if row is None and fresh:
                db.execute("INSERT INTO stream VALUES (0, ?, ?, ?, ?)",
                           (os.path.realpath(path), st.st_dev, st.st_ino, time.time()))
            elif row is None:
                raise StreamError(f"stream {path} already holds records, but control db {self.path} was "
                                  f"never bound to it: a stream and its db are made together")
            elif (row[1], row[2]) != (st.st_dev, st.st_ino):
                raise StreamError(_other_stream(self.path, row, path))

    def check_stream(self, path: str) -> None:
        """StreamError if this db is bound to a stream file other than ``path``'s."""
        rows = self._read("SELECT path, dev, ino FROM stream")
        if not rows:
            return
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != (rows[0][1], rows[0][2]):
            raise StreamError(_other_stream(self.path, rows[0], path))

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
        return [self._ref(seq, ref) for seq, ref in self._unacked_rows()]

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
            with bounded.open_regular(stream, what="stream") as f:  # a FIFO must not hang this
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


def _other_stream(db: str, row, path: str) -> str:
    return (f"control db {db} belongs to stream {row[0]} (device {row[1]}, inode {row[2]}), and {path} "
            f"is another file: one db per stream (a new stream needs a new db)")


def _check_db_file(path: str) -> None:
    """Refuse, before SQLite opens it, a db path that is not a regular file (a folder,
    a FIFO: SQLite would block on it, a device) or a non-empty file that is not SQLite."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # SQLite creates it
    except OSError as e:
        raise StreamError(f"control db {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StreamError(f"control db {path} is not a regular file (a folder, FIFO or device): refused")
    if st.st_size:
        with bounded.open_regular(path, what="control db", error=StreamError) as f:
            magic = f.read(len(SQLITE_MAGIC))
        if magic != SQLITE_MAGIC:
            raise StreamError(f"control db {path} is not an SQLite database: refused, left untouched")


# ---- producer and consumer -------------------------------------------------------

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


def main(argv=None, prog: str = "python -m source_patch.runtime.features.stream") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="the feature ref stream and its control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="counts: committed, in flight, acked, lost; stream size and offset")
    st.add_argument("--db", required=True, help="the control plane's SQLite file")
    st.add_argument("--stream", help="the ref stream file (adds lost, unstreamed, stream size)")
    st.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    try:
        out = status(args.db, args.stream)
    except (StreamError, OSError, sqlite3.Error) as e:  # bad input: a message, never a traceback
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
