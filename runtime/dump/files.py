"""The dump's on-disk format: one safetensors file per batch of records, then their
lines in ``rank-<r>/manifest.jsonl`` (a file is complete before any line names it).

The safetensors files are written here rather than with safetensors' own save
functions, which build the whole file in memory first (one more copy of every byte);
readers use the safetensors library, which checks the format.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections import deque
from pathlib import Path

import torch

MANIFEST = "manifest.jsonl"
FORMAT_VERSION = 1

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code


def write_records(rank_dir: Path, file_name: str, items: list, session: str, fsync: bool) -> None:
    """One safetensors file holding ``items`` (host tensors), then their manifest lines;
    if the manifest append fails the file is removed (no file without its lines)."""
    entries, lines = [], []
    for item in items:
        key = f"{item.seq:08d}:{item.name}"
        entries.append((key, item.host))
        lines.append({
            "seq": item.seq, "name": item.name, "tags": item.tags, "file": file_name, "key": key,
            "shape": list(item.host.shape), "dtype": str(item.host.dtype).removeprefix("torch."),
            "bytes": item.nbytes, "time": round(item.time, 6), "session": session,
        })
    metadata = {"format": "pt", "source_patch.dump": str(FORMAT_VERSION),
                "records": json.dumps([{k: line[k] for k in ("seq", "name", "tags")} for line in lines])}
    path = rank_dir / file_name
    write_safetensors(path, entries, metadata, fsync)
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    try:
        append_manifest(rank_dir / MANIFEST, data, fsync)
    except BaseException:
        remove_quietly(path)
        raise


def write_safetensors(path: Path, entries: list, metadata: dict, fsync: bool = False) -> None:
    """Write a safetensors file atomically: a temp file in the same directory, renamed
    into place.  The tensor bytes go straight from the host copies to the file."""
    header: dict = {}
    offset = 0
    for key, tensor in entries:
        end = offset + tensor.numel() * tensor.element_size()
        header[key] = {"dtype": ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as out:
            write_bytes(out, struct.pack("<Q", len(blob)) + blob)
            for _, tensor in entries:
                if tensor.numel():
                    write_bytes(out, tensor.reshape(-1).view(torch.uint8).numpy())
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def write_bytes(out, data) -> None:
    """Every write of the dump files goes through here (tests make it fail)."""
    out.write(data)


def append_manifest(path: Path, data: bytes, fsync: bool = False) -> None:
    """Append whole lines; on a failed or short write, cut the file back so no partial
    line is left for the next append to run into."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "short write to the manifest")
                view = view[written:]
            if fsync:
                os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


class DropBehind:
    """Files older than the newest ``window`` bytes of the dump leave the page cache
    behind the writer: each is advised away once that much was written after it (the
    kernel starts writing it back now) and again after each of the next ``again``
    files (its pages written back by then are dropped; dirty ones are left).  The page
    cache then holds the dump's last ``window`` bytes and what is still being written,
    not every byte of it: a dump smaller than the window is never touched, a large one
    does not evict what training reads, and the cache does not grow into memory the
    machine never used (on a VM that first touch is the first-run cliff).
    ``posix_fadvise`` only advises: where it is missing or refused nothing changes."""

    def __init__(self, window: int = 0, again: int = 8):
        self.window = window
        self.kept: deque = deque()  # (path, bytes) of the newest files, within the window
        self.kept_bytes = 0
        self.leaving: deque = deque(maxlen=again)  # advised away, and again after each later file

    def written(self, path: Path, nbytes: int = 0) -> None:
        self.kept.append((path, nbytes))
        self.kept_bytes += nbytes
        while self.kept and (self.kept_bytes > self.window or not self.window):
            old, size = self.kept.popleft()
            self.kept_bytes -= size
            self.leaving.append(old)
        for old in self.leaving:
            _advise_dontneed(old)


def _advise_dontneed(path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # deleted or moved meanwhile: nothing of it to drop
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
