"""The ref stream's file, written (``RefWriter``: one ``os.write`` a line, a torn tail
cut before the next append) and followed (``RefReader``: complete lines only, until
the end marker); files opened without following links and locked with ``flock``.

Part of the ref stream (stream.py: Producer, Consumer, status).
"""

from __future__ import annotations

import collections
import fcntl
import os
import stat
import time
from typing import Iterator

from ..core import bounded
from .ref import FeatureRef
from .stream_format import (END, MAX_LINE, Record, StreamCorrupt, StreamError, _check_stream, _complete_size,
                            _line, _parse)


class StreamIdle(StreamError):
    """No new line and no end marker for ``idle_timeout`` seconds."""


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


def _remove_if_empty(path: str, st: os.stat_result) -> None:
    """Remove the file this process created at ``path`` (still empty, same inode)."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) and now.st_size == 0:
            os.unlink(path)
    except OSError:
        pass


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
        self._file = bounded.open_regular(self.path, what="stream", error=StreamError, missing_ok=True)
        return self._file is not None

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
