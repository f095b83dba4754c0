"""The routing file format: one safetensors file, JSON metadata under one key.

Format version 1: tensors ``layer.<L>.indices`` (uint8 / int16 / int32 by
``num_experts``) and ``layer.<L>.probs``; the metadata is JSON under the
``__metadata__`` key ``source_patch.routing``.  Nothing is unpickled; a file is read
once, a regular file only (a FIFO or a folder is refused, not waited on); its header is
size-checked before it is parsed, parsed bounded in depth (core/bounded.py), and every
tensor's offsets are checked against its shape and the file's size.  Loaded indices are ``torch.int64`` (what
``torch.topk`` returns and what Megatron's ``RouterReplay`` gathers with).

This module knows files, not the RoutingRecord type (``record.py`` maps its
fields to and from what is here), so the type can call it without an import cycle.
It also holds the error every part of the record raises.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from pathlib import Path

import torch

from ...core import bounded, private

FORMAT = "source-patch-routing"
VERSION = 1
METADATA_KEY = "source_patch.routing"
MAX_HEADER_BYTES = 16 << 20       # a larger safetensors header is refused as corrupt
INDEX_DTYPE = torch.int64          # the dtype indices have once loaded

_DISK_DTYPES = {"U8": torch.uint8, "I16": torch.int16, "I32": torch.int32}
DTYPE_NAMES = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
_FLOAT_CODES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# bytes per element of the safetensors dtypes, to check each entry's offsets against its shape
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_HEADER_DEPTH = 3                  # {key: {"shape": [...]}}: a deeper header is not safetensors
_META_LIMITS = {"max_depth": 16, "max_items": 10_000}  # the routing metadata (extra nests a little)
_MAX_DIMS = 8
# The safetensors dtype code of each torch dtype this module encodes itself, in the order of the
# safetensors library's Dtype enum: the library writes tensors by that order, descending, then by
# name (the files stay byte for byte what safetensors.torch.save writes: tests/test_cost_capture_and_dump.py).
_ENCODED = [(getattr(torch, name, None), code) for name, code in (
    ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fn", "F8_E4M3"),
    ("int16", "I16"), ("uint16", "U16"), ("float16", "F16"), ("bfloat16", "BF16"), ("int32", "I32"),
    ("uint32", "U32"), ("float32", "F32"), ("float64", "F64"), ("int64", "I64"), ("uint64", "U64"))]
_CODES = {dtype: (code, rank) for rank, (dtype, code) in enumerate(_ENCODED) if dtype is not None}
# the record's fields its metadata carries as they are
FIELDS = ("num_experts", "topk", "token_order", "sample_ids", "seq_lens", "padding", "parallel", "source",
          "version")


class RoutingRecordError(ValueError):
    """A routing record, or a file holding one, is malformed."""


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_dtype_for(num_experts: int) -> torch.dtype:
    """The dtype expert ids are stored with on disk: the smallest that holds them."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def encode(tensors: dict, metadata: dict) -> bytes:
    """The bytes of a routing file holding ``tensors`` (name -> tensor) and ``metadata``:
    safetensors, byte for byte as ``safetensors.torch.save`` writes it, built here in one
    go: the library's Python side (its checks for shared storage, a numpy view of each
    tensor) took ~0.2 ms of routing capture's saver a record, this ~0.035 ms (CPU,
    2026-12-07).  A dtype not in ``_CODES`` is handed to the library."""
    meta = json.dumps(metadata, separators=(",", ":"))
    if len(meta) > MAX_HEADER_BYTES // 2:
        raise RoutingRecordError(f"metadata is {len(meta)} bytes: too large for a routing file "
                                 f"(limit {MAX_HEADER_BYTES // 2}); keep sample_ids/extra small")
    if any(t.dtype not in _CODES for t in tensors.values()):
        from safetensors.torch import save

        return save({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
                    metadata={METADATA_KEY: meta})
    header: dict = {"__metadata__": {METADATA_KEY: meta}}
    blobs, offset = [], 0
    for key, t in sorted(tensors.items(), key=lambda item: (-_CODES[item[1].dtype][1], item[0])):
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _CODES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        blobs.append(ctypes.string_at(t.data_ptr(), size) if size else b"")
        offset += size
    # ASCII throughout (the metadata is json's ASCII, the names ours), so json's escapes of
    # non-ASCII never apply, and ensure_ascii=False would take json's slower path (6x here)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library pads it
    return b"".join((struct.pack("<Q", len(text)), text, *blobs))


def write(path: Path, tensors: dict, metadata: dict) -> Path:
    """Write ``tensors`` and ``metadata`` to ``path`` atomically (``write_bytes``)."""
    return write_bytes(Path(path), encode(tensors, metadata))


def write_bytes(path: Path, data: bytes) -> Path:
    """Write a routing file's bytes to ``path`` through core/private.py, the one writer of
    our files: a temporary file ``O_EXCL|O_NOFOLLOW`` in the same folder, written in one
    go and renamed over ``path`` (a reader sees the old file or the new one); mode 0600
    (what it was when tempfile made it); the folder and its parents made where missing,
    in the usual modes.  Not synced to disk (a file per microbatch: capture's pace)."""
    path = Path(path)
    private.write_private(os.fspath(path.parent), (path.name,), data, check_root=False, sync=False)
    return path


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(metadata, tensor_entries)`` of a routing file, checked but without reading tensors.

    ``tensor_entries`` maps each key to its safetensors header entry (``dtype``,
    ``shape``, ``data_offsets``).  Raises :class:`RoutingRecordError` when the file
    is not a routing file, is truncated, corrupt, or from a newer format version."""
    return _load(Path(path), with_data=False)[:2]


def _load(path: Path, with_data: bool) -> tuple[dict, dict, bytes | None]:
    """(metadata, tensor entries, the file's bytes up to its last tensor or None), from
    one open of a regular file: a FIFO or a folder is refused, never waited on."""
    err = RoutingRecordError
    with bounded.open_regular(path, what="cannot read the routing file", error=err) as handle:
        size = os.fstat(handle.fileno()).st_size
        n, raw = _raw_header(path, handle, size)
        meta, header, data_end = _checked_header(path, raw)
        if 8 + n + data_end > size:
            raise err(f"{path}: truncated: tensors need {8 + n + data_end} bytes, file has {size}")
        if not with_data:
            return meta, header, None
        try:
            data = handle.read(data_end)
        except OSError as exc:
            raise err(f"{path}: cannot read: {exc}") from None
    if len(data) != data_end:  # shrunk since its size was taken
        raise err(f"{path}: truncated: tensors need {8 + n + data_end} bytes, read {8 + n + len(data)}")
    return meta, header, struct.pack("<Q", n) + raw + data


def _raw_header(path: Path, handle, size: int) -> tuple[int, bytes]:
    """(header length, header bytes); the length is checked before it is read."""
    err = RoutingRecordError
    try:
        head = handle.read(8)
        if len(head) < 8:
            raise err(f"{path}: truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise err(f"{path}: safetensors header claims {n} bytes (limit {MAX_HEADER_BYTES}): "
                      "corrupt or not a routing file")
        if 8 + n > size:
            raise err(f"{path}: truncated: header needs {8 + n} bytes, file has {size}")
        raw = handle.read(n)
    except OSError as exc:
        raise err(f"{path}: cannot read: {exc}") from None
    if len(raw) != n:
        raise err(f"{path}: truncated: header needs {8 + n} bytes, read {8 + len(raw)}")
    return n, raw


def _checked_header(path: Path, raw: bytes) -> tuple[dict, dict, int]:
    """(routing metadata, tensor entries, end of the last tensor's data): the header
    parsed bounded (a deep one is an error, not a RecursionError), every entry checked."""
    err = RoutingRecordError
    header = bounded.load_json(raw, what=f"{path}: corrupt safetensors header", error=err,
                               max_bytes=MAX_HEADER_BYTES, max_depth=_HEADER_DEPTH, kind=dict)
    file_meta = header.pop("__metadata__", None) or {}
    text = file_meta.get(METADATA_KEY) if isinstance(file_meta, dict) else None
    if not isinstance(text, str):
        raise err(f"{path}: not a routing record (no {METADATA_KEY!r} in the safetensors metadata)")
    meta = _checked_metadata(path, text)
    data_end = 0
    for key, entry in header.items():
        if not safetensors_entry_ok(entry):
            raise err(f"{path}: corrupt safetensors entry {key[:80]!r} (a dtype, a shape of sizes, "
                      "data_offsets [begin, end] its bytes apart)")
        data_end = max(data_end, entry["data_offsets"][1])
    return meta, header, data_end


def safetensors_entry_ok(entry) -> bool:
    """Whether a safetensors header entry is {dtype, shape: [int >= 0], data_offsets:
    [begin, end]} with 0 <= begin <= end, as many bytes apart as the shape needs (a
    known dtype).  Replay's checkpoint check uses it too."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(is_int(d) and d >= 0 for d in shape)):
        return False
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(x) for x in offsets)):
        return False
    begin, end = offsets
    size = _ITEM_BYTES.get(entry["dtype"])
    return 0 <= begin <= end and (size is None or math.prod(shape) * size == end - begin)


def _checked_metadata(path: Path, text: str) -> dict:
    """The routing metadata's JSON, its format and version checked."""
    err = RoutingRecordError
    meta = bounded.load_json(text, what=f"{path}: corrupt routing metadata", error=err,
                             max_bytes=MAX_HEADER_BYTES, **_META_LIMITS)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise err(f"{path}: routing metadata format is {got!r}, expected {FORMAT!r}")
    version = meta.get("version")
    if not is_int(version) or version < 1:
        raise err(f"{path}: corrupt routing metadata (version {version!r})")
    if version > VERSION:
        raise err(f"{path}: written by a newer source-patch (routing format version {version}); "
                  f"this one reads version {VERSION}: upgrade source-patch")
    return meta


def read(path: Path) -> tuple[dict, dict]:
    """``(fields, metadata)`` of a routing file: ``fields`` the keyword arguments of a
    RoutingRecord (indices as ``INDEX_DTYPE``, probs in their stored dtype), every tensor
    the metadata names present and stored as it says."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    meta, entries, blob = _load(path, with_data=True)
    err = RoutingRecordError
    try:
        layers = meta["layers"]
        if not isinstance(layers, list) or not all(is_int(layer) and layer >= 0 for layer in layers):
            raise ValueError("'layers'")  # JSON's 1.0 or Infinity is no layer id
        has_probs = bool(meta["has_probs"])
        fields = {k: meta[k] for k in FIELDS}
        extra = meta.get("extra") or {}
    except (KeyError, TypeError, ValueError) as exc:
        raise err(f"{path}: routing metadata lacks or mangles {exc}") from None
    expected = {f"layer.{layer}.indices" for layer in layers}
    if has_probs:
        expected |= {f"layer.{layer}.probs" for layer in layers}
    if set(entries) != expected:
        missing, unknown = sorted(expected - set(entries)), sorted(set(entries) - expected)
        raise err(f"{path}: tensors do not match the metadata (missing {missing}, unexpected {unknown})")
    for layer in layers:
        code = entries[f"layer.{layer}.indices"].get("dtype")
        if code not in _DISK_DTYPES:
            raise err(f"{path}: layer {layer}: indices stored as {code!r}, expected one of {list(_DISK_DTYPES)}")
    try:
        tensors = load(blob)  # the bytes already read: the file is opened once
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise err(f"{path}: corrupt safetensors data ({exc})") from None
    fields.update(indices={layer: tensors[f"layer.{layer}.indices"].to(INDEX_DTYPE) for layer in layers},
                  probs={layer: tensors[f"layer.{layer}.probs"] for layer in layers} if has_probs else None,
                  layers=layers, extra=extra)
    return fields, meta


def disk_dtypes(entries: dict) -> dict:
    """Tensor key -> the dtype it is stored with, by name (for ``describe``)."""
    names = {"U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", **{
        k: str(v).replace("torch.", "") for k, v in _FLOAT_CODES.items()}}
    return {key: names.get(e.get("dtype"), e.get("dtype")) for key, e in entries.items()}
