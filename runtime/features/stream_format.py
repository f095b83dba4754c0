"""The ref stream's file format: append-only JSON lines ``{"seq": n, "ref": {...}}``,
then ``{"end": true}``; a line parsed as untrusted input (bounded, checked), and an
existing file checked read only to be a stream, its torn tail allowed.

Part of the ref stream (stream.py: Producer, Consumer, status).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from ..core import bounded
from .ref import MAX_TENSORS, FeatureRef, RefError

MAX_LINE = 1 << 20  # bytes per stream line; a valid ref is well under it (ref.py's limits)
END = {"end": True}
# a line {"seq", "ref": {"tensors": [{"shape": []}]}} nests 5 deep; a db row (the ref) 4;
# each tensor opens 2 containers
LINE_DEPTH, ROW_DEPTH, MAX_CONTAINERS = 5, 4, 2 * MAX_TENSORS + 3


class StreamError(RuntimeError):
    """The stream or the control plane cannot be used as asked."""


class StreamCorrupt(StreamError):
    """A stream line that is not a valid record (the message names its byte offset)."""


class Record(NamedTuple):
    seq: int
    ref: FeatureRef
    offset: int  # byte offset where the line starts


def _line(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


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
