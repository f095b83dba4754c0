"""The binary frame of the trace protocol (frame version 1, used by protocol v2): one
trace result, server to client.

Little-endian; the data starts at a multiple of 8 bytes so a reader can view it in
place (``numpy.frombuffer``)::

    offset  size      field
    0       4         magic b"SPTF"
    4       u8        version (1)
    5       u8        dtype code: 0 float32, 1 float64, 2 int64, 3 int32, 4 uint8, 5 float16
    6       u8        ndim
    7       u8        flags (bit 0: truncated; others 0)
    8       u32       meta_len: bytes of the JSON metadata
    12      u32       reserved (0)
    16      u64       seq: per-connection frame counter from 0 (a gap = frames dropped)
    24      i64       step (-1 = unknown)
    32      f64       time: Unix seconds when the tensor was traced
    40      u32*ndim  shape
    then    meta_len  UTF-8 JSON object (sub, name, layer, rank, kind, params, ...)
    then              zero padding to a multiple of 8 bytes from the frame start
    then              prod(shape) elements, C order

A WebSocket message (protocol v2) carries one or more frames back to back, each
starting at a multiple of 8 bytes (zero padding between them): ``split`` cuts a
message into frames.  Needs numpy only (no torch): clients and plotting scripts
decode frames anywhere.
"""

from __future__ import annotations

import json
import math
import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"SPTF"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIIQqd")  # up to and including `time`
SEQ_OFFSET = 16
FLAG_TRUNCATED = 1
MAX_NDIM = 32

DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f8"), 2: np.dtype("<i8"), 3: np.dtype("<i4"),
          4: np.dtype("u1"), 5: np.dtype("<f2")}
CODES = {dtype: code for code, dtype in DTYPES.items()}


# Built once: json.dumps with options builds an encoder per call.
_META = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=str)


class FrameError(ValueError):
    """Bytes that are not a valid v1 frame."""


class Header(NamedTuple):
    version: int
    dtype: np.dtype
    flags: int
    seq: int
    step: int
    time: float
    shape: tuple


class Frame(NamedTuple):
    """A decoded frame: ``header`` fields, the ``meta`` dict and the data ``array``."""

    header: Header
    meta: dict
    array: np.ndarray

    @property
    def name(self) -> str | None:
        return self.meta.get("name")

    @property
    def layer(self):
        return self.meta.get("layer")

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def truncated(self) -> bool:
        return bool(self.header.flags & FLAG_TRUNCATED)


def encode(array, meta: dict, *, seq: int = 0, step: int = -1, time: float = 0.0, flags: int = 0) -> bytes:
    """One frame holding ``array`` (a numpy array of a supported dtype) and ``meta``."""
    array = np.asarray(array)
    code = CODES.get(array.dtype.newbyteorder("<"))
    if code is None:
        raise FrameError(f"unsupported dtype {array.dtype} (supported: "
                         f"{', '.join(str(d) for d in DTYPES.values())})")
    if array.ndim > MAX_NDIM or any(n >= 1 << 32 for n in array.shape):
        raise FrameError(f"shape {array.shape} does not fit a frame")
    meta_bytes = _META.encode(meta).encode()
    head = HEADER.pack(MAGIC, VERSION, code, array.ndim, flags, len(meta_bytes), 0, seq, step, time)
    head += struct.pack(f"<{array.ndim}I", *array.shape) + meta_bytes
    head += b"\0" * (-len(head) % 8)
    return head + np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes()


def set_seq(frame: bytearray, seq: int) -> None:
    """Stamp a connection's frame counter into an encoded frame, in place."""
    struct.pack_into("<Q", frame, SEQ_OFFSET, seq)


def join(frames) -> bytes:
    """One message of several frames: each padded with zeros to a multiple of 8 bytes."""
    parts = []
    for frame in frames:
        parts.append(frame)
        if len(frame) % 8:
            parts.append(bytes(-len(frame) % 8))
    return b"".join(parts)


def split(data) -> list[memoryview]:
    """The frames of one message (see ``join``), as views; FrameError if it does not
    parse (a truncated frame, bad magic)."""
    view, frames, at = memoryview(data), [], 0
    while at < len(view):
        if len(view) - at < HEADER.size:
            raise FrameError(f"{len(view) - at} bytes at offset {at} are shorter than a frame header")
        magic, _, code, ndim, _, meta_len = HEADER.unpack_from(view, at)[:6]
        if magic != MAGIC or code not in DTYPES:
            raise FrameError(f"no frame at offset {at} (magic {bytes(magic)!r}, dtype code {code})")
        if len(view) - at < HEADER.size + 4 * ndim:
            raise FrameError(f"frame at offset {at} ends inside its shape")
        shape = struct.unpack_from(f"<{ndim}I", view, at + HEADER.size)
        start = HEADER.size + 4 * ndim + meta_len
        end = at + start + (-start % 8) + math.prod(shape) * DTYPES[code].itemsize
        if end > len(view):
            raise FrameError(f"frame at offset {at} needs {end - at} bytes, {len(view) - at} left")
        frames.append(view[at:end])
        at = end + (-end % 8)
    return frames


def decode(data) -> Frame:
    """Parse a frame (bytes-like); FrameError says what is wrong.  The array is a
    read-only view of ``data`` when ``data`` is bytes."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, code, ndim, flags, meta_len, _, seq, step, time = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise FrameError(f"frame version {version} (this reader knows {VERSION})")
    if code not in DTYPES:
        raise FrameError(f"unknown dtype code {code}")
    offset = HEADER.size + 4 * ndim
    if len(view) < offset + meta_len:
        raise FrameError("frame ends inside its shape or metadata")
    shape = struct.unpack_from(f"<{ndim}I", view, HEADER.size)
    try:
        meta = json.loads(bytes(view[offset:offset + meta_len]))
    except ValueError as exc:
        raise FrameError(f"metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise FrameError("metadata is not a JSON object")
    start = offset + meta_len + (-(offset + meta_len) % 8)
    dtype = DTYPES[code]
    count = math.prod(shape)
    if len(view) != start + count * dtype.itemsize:
        raise FrameError(f"frame of {len(view)} bytes; its header says {start + count * dtype.itemsize}")
    array = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
    return Frame(Header(version, dtype, flags, seq, step, time, tuple(shape)), meta, array)
