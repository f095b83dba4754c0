"""The feature store: put a sample's tensors, get them back from another process by
their ``FeatureRef``, release them once trained.

    with open_store("mooncake://127.0.0.1:50051?store=feat") as store:   # or dir:///path
        ref = store.put("sample-17", {"hidden": h, "ids": ids})         # producer
        tensors = store.get(ref)                                        # consumer
        store.release(ref)                                              # after training

Backends: ``SharedDirStore`` (one safetensors file per sample in a shared folder) and
``MooncakeStore`` (mooncake.py: one Mooncake object per tensor, zero-copy over the
transfer engine).  Nothing is pickled: the ref names every tensor's shape and dtype,
the reader allocates each tensor from it and reads the raw bytes straight in, and a
read that comes up short is an error (``StoreError``), never a tensor with an
uninitialised tail.

Generations.  A re-put of a sample id gets a new, larger generation, and the ref
carries it, so a reader holding an older ref fails cleanly (``RefError`` "stale
ref: ...") instead of reading the new data.  Generations also grow across a
release (the next one is at least the wall clock in microseconds), so a ref kept
past a release never matches a later re-put of the same sample id.  One producer
per sample id at a time: two concurrent puts of one sample race on the generation.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import time
from urllib.parse import parse_qsl, unquote, urlsplit

import torch

from ..core import bounded
from ..core.settings import boolean
from .base import FeatureStore, StoreError, byte_view, next_generation, stale
from .ref import DTYPES, MAX_DIMS, MAX_TENSORS

__all__ = ["FeatureStore", "SharedDirStore", "StoreError", "open_store"]

# -- shared directory ---------------------------------------------------------------

# safetensors dtype names (the file format of https://github.com/huggingface/safetensors)
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
assert set(ST_DTYPES) == set(DTYPES)
MAX_HEADER = 100 << 20  # the safetensors library's own limit
# a header is {name: {"dtype", "shape": [...], "data_offsets": [...]}, "__metadata__": {...}}:
# 3 levels deep, 3 containers per tensor
HEADER_DEPTH, MAX_HEADER_CONTAINERS = 3, 3 * MAX_TENSORS + 2
CHUNK = 64 << 20  # largest single read/write call


class SharedDirStore(FeatureStore):
    """One safetensors file per sample, ``{folder}/{sample}.g{generation}.safetensors``.

    put writes a temporary file in the folder and renames it in (atomic; with
    ``fsync=True`` the file and the folder are synced first), then removes the
    sample's older generations.  get opens the ref's generation, checks that the
    file's header names exactly the ref's tensors with the same dtypes and shapes,
    and reads each tensor's bytes straight into its output (``readinto``; no
    intermediate copy, no pickle).  The files are plain safetensors (the writer is
    this module's, so tensors go from their own memory to the file without the
    extra whole-sample copy ``safetensors.torch.save_file`` makes), readable with
    ``safetensors.torch.load_file``; files that library writes are read here too.
    """

    def __init__(self, folder, store: str = "features", fsync: bool = False):
        super().__init__(store)
        self.folder = os.path.abspath(os.fspath(folder))
        self.fsync = bool(fsync)
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot use {self.folder} as a feature store folder: {exc.strerror or exc}") from None

    def path(self, sample_id: str, generation: int) -> str:
        return os.path.join(self.folder, f"{sample_id}.g{generation}.safetensors")

    def generations(self, sample_id: str) -> list:
        """The generations of ``sample_id`` present in the folder, sorted."""
        pattern = re.compile(re.escape(sample_id) + r"\.g(\d+)\.safetensors\Z")
        found = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                match = pattern.match(entry.name)
                if match:
                    found.append(int(match.group(1)))
        return sorted(found)

    def _put(self, sample_id, items):
        older = self.generations(sample_id)
        generation = next_generation(older[-1] if older else None)
        ref = self._make_ref(sample_id, generation, items)
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for meta, _ in items:
            header[meta.name] = {"dtype": ST_DTYPES[meta.dtype], "shape": list(meta.shape),
                                 "data_offsets": [offset, offset + meta.nbytes]}
            offset += meta.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-aligned
        final = self.path(sample_id, generation)
        temp = os.path.join(self.folder, f".{sample_id}.g{generation}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        start = time.perf_counter()
        try:
            with open(temp, "wb", buffering=0) as f:
                write_all(f, struct.pack("<Q", len(head)) + head)
                for meta, tensor in items:
                    if meta.nbytes:
                        write_all(f, byte_view(tensor).numpy().data)
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(temp, final)
            if self.fsync:
                sync_dir(self.folder)
        except OSError as exc:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise StoreError(f"writing sample {sample_id} to {final} failed: {exc}") from exc
        self._add(transfer_seconds=time.perf_counter() - start)
        for old in older:
            try:
                os.unlink(self.path(sample_id, old))
            except FileNotFoundError:
                pass
            except OSError:
                self._add(cleanup_errors=1)
        return ref

    def _get(self, ref, out):
        path = self.path(ref.sample_id, ref.generation)
        start = time.perf_counter()
        try:  # a regular file only: a FIFO or device planted here is refused, never read
            f = bounded.open_regular(path, what="feature file", error=StoreError, follow_symlinks=False)
        except StoreError:
            if os.path.lexists(path):
                raise
            present = self.generations(ref.sample_id)
            if present and present[-1] != ref.generation:
                raise stale(ref, present[-1]) from None
            raise StoreError(f"missing object {path}: sample {ref.sample_id} generation {ref.generation} "
                             f"was released (or never written to this folder)") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            entries, base = read_header(f, size, path)
            if set(entries) != {m.name for m in ref.tensors}:
                raise StoreError(f"{path} holds tensors {sorted(entries)[:20]}, the ref names "
                                 f"{[m.name for m in ref.tensors][:20]}")
            for meta in ref.tensors:
                key, entry = ref.key(meta.name), entries[meta.name]
                begin, end = entry["data_offsets"]
                if entry["dtype"] != ST_DTYPES[meta.dtype]:
                    raise StoreError(f"{key}: {path} holds dtype {entry['dtype']}, the ref says {meta.dtype}")
                if end - begin < meta.nbytes:
                    raise StoreError(f"short read of {key}: rc={end - begin}, expected {meta.nbytes} bytes "
                                     f"({path} holds shape {entry['shape']}, the ref says {list(meta.shape)})")
                if entry["shape"] != list(meta.shape) or end - begin != meta.nbytes:
                    raise StoreError(f"{key}: {path} holds shape {entry['shape']} ({end - begin} bytes), "
                                     f"the ref says {list(meta.shape)} ({meta.nbytes} bytes)")
                if meta.nbytes:
                    f.seek(base + begin)
                    got = read_into(f, byte_view(out[meta.name]).numpy().data)
                    if got != meta.nbytes:
                        raise StoreError(f"short read of {key}: rc={got}, expected {meta.nbytes} bytes "
                                         f"({path} is {size} bytes, truncated)")
        self._add(transfer_seconds=time.perf_counter() - start)

    def _release(self, ref):
        try:
            os.unlink(self.path(ref.sample_id, ref.generation))
        except FileNotFoundError:
            pass  # released before: idempotent
        except OSError as exc:
            raise StoreError(f"release of sample {ref.sample_id} generation {ref.generation} failed: {exc}") from exc


def write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view[:CHUNK])
        view = view[n:]


def read_into(f, data) -> int:
    """Bytes read into ``data`` until it is full or the file ends."""
    view, total = memoryview(data).cast("B"), 0
    while total < len(view):
        n = f.readinto(view[total:total + CHUNK])
        if not n:
            break
        total += n
    return total


def read_header(f, size: int, path: str):
    """(tensor name -> {dtype, shape, data_offsets}, offset of the data) of an open
    safetensors file; every field checked (the file is as untrusted as a ref): the
    header through the bounded JSON reader, each tensor's bytes inside the file."""
    raw = f.read(8)
    if len(raw) < 8:
        raise StoreError(f"short read of {path}: rc={len(raw)}, expected an 8-byte safetensors header length")
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_HEADER, size - 8):
        raise StoreError(f"{path}: header length {length} is beyond the file ({size} bytes) or the limit")
    header = bounded.load_json(read_exactly(f, length, path), what=f"{path}: the safetensors header",
                               error=StoreError, max_bytes=MAX_HEADER, max_depth=HEADER_DEPTH,
                               max_items=MAX_HEADER_CONTAINERS, kind=dict)
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not _entry_ok(entry, size - 8 - length):
            raise StoreError(f"{path}: malformed header entry for tensor {str(name)[:80]!r} (a dtype, a shape "
                             f"of at most {MAX_DIMS} sizes, data_offsets starting inside the file's {size} bytes)")
    return header, 8 + length


def _entry_ok(entry, data_bytes: int) -> bool:
    """Whether a header entry is {dtype: str, shape: [int], data_offsets: [begin, end]}
    with 0 <= begin <= end and begin inside the data (no seek past the file's end: an
    end past it is a truncated file, reported as a short read)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
            and 0 <= offsets[0] <= min(offsets[1], data_bytes))


def read_exactly(f, n: int, path: str) -> bytes:
    data = bytearray(n)
    got = read_into(f, data)
    if got != n:
        raise StoreError(f"short read of {path}: rc={got}, expected {n} header bytes")
    return bytes(data)


def sync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the factory ------------------------------------------------------------------

DIR_OPTIONS = {"store": str, "fsync": boolean}
MOONCAKE_OPTIONS = {"store": str, "segment_mb": int, "buffer_mb": int, "pool_mb": int, "direct_kb": int,
                    "local_hostname": str, "metadata_server": str, "protocol": str, "device_name": str,
                    "hard_pin": boolean}


def _options(url: str, query: str, given: dict, schema: dict) -> dict:
    merged = dict(parse_qsl(query, keep_blank_values=True))
    merged.update(given)  # keyword options win over the URL's query
    unknown = sorted(set(merged) - set(schema))
    if unknown:
        raise ValueError(f"{url}: unknown option(s) {', '.join(unknown)} (known: {', '.join(schema)})")
    try:
        return {key: schema[key](value) for key, value in merged.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{url}: bad option value: {exc}") from None


def open_store(url: str, **options) -> FeatureStore:
    """A store from its URL (keyword options override the URL's query):

    ``dir:///path/to/folder[?store=NAME&fsync=1]``
        SharedDirStore: one safetensors file per sample in the folder (created).
    ``mooncake://HOST:PORT[?store=NAME&segment_mb=512&buffer_mb=64&...]``
        MooncakeStore: a client of the Mooncake master at HOST:PORT (metadata
        "P2PHANDSHAKE", protocol "tcp", local hostname 127.0.0.1 unless told);
        see mooncake.py for ``pool_mb``, ``direct_kb``, ``hard_pin``.
    """
    parts = urlsplit(url)
    if parts.scheme == "dir":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"{url}: a dir store URL is dir:///absolute/path")
        opts = _options(url, parts.query, options, DIR_OPTIONS)
        return SharedDirStore(unquote(parts.path), **opts)
    if parts.scheme == "mooncake":
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host = port = None
        if not host or not port or parts.path not in ("", "/"):
            raise ValueError(f"{url}: a Mooncake store URL is mooncake://MASTER_HOST:PORT?store=NAME")
        opts = _options(url, parts.query, options, MOONCAKE_OPTIONS)
        from .mooncake import MooncakeStore

        return MooncakeStore(f"{host}:{port}", **opts)
    raise ValueError(f"{str(url)[:200]}: unknown feature store URL (dir:///path or mooncake://host:port)")
