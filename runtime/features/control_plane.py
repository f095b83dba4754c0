"""The ref stream's control plane: every sample's state (committed -> acked) and its
ref in SQLite, shared by the producer and consumer processes; the stream file it is
bound to (device, inode), and the consumer's saved offset.

Part of the ref stream (stream.py: Producer, Consumer, status).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from contextlib import contextmanager
from typing import Iterable

from ..core import bounded
from .ref import FeatureRef, RefError
from .stream_format import MAX_CONTAINERS, MAX_LINE, ROW_DEPTH, StreamCorrupt, StreamError

SQLITE_MAGIC = b"SQLite format 3\x00"

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
# Sentinels of ``_commit``, compared by identity in stream.py's Producer: defined
# here once and imported there, never copied.
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
