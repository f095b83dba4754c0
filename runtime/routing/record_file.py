"""The routing file format: one safetensors file, JSON metadata under one key.

Format version 1: tensors ``layer.<L>.indices`` (uint8 / int16 / int32 by
``num_experts``) and ``layer.<L>.probs``; the metadata is JSON under the
``__metadata__`` key ``source_patch.routing``.  Nothing is unpickled; a header is
size-checked before it is parsed.  Loaded indices are ``torch.int64`` (what
``torch.topk`` returns and what Megatron's ``RouterReplay`` gathers with).

This module knows files, not the RoutingRecord type (``record_type.py`` maps its
fields to and from what is here), so the type can call it without an import cycle.
It also holds the error every part of the record raises.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch

FORMAT = "source-patch-routing"
VERSION = 1
METADATA_KEY = "source_patch.routing"
MAX_HEADER_BYTES = 16 << 20       # a larger safetensors header is refused as corrupt
INDEX_DTYPE = torch.int64          # the dtype indices have once loaded

_DISK_DTYPES = {"U8": torch.uint8, "I16": torch.int16, "I32": torch.int32}
DTYPE_NAMES = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
_FLOAT_CODES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# the record's fields its metadata carries as they are
FIELDS = ("num_experts", "topk", "token_order", "sample_ids", "seq_lens", "padding", "parallel", "source",
          "version")


class RoutingRecordError(ValueError):
    """A routing record, or a file holding one, is malformed."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_dtype_for(num_experts: int) -> torch.dtype:
    """The dtype expert ids are stored with on disk: the smallest that holds them."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def write(path: Path, tensors: dict, metadata: dict) -> Path:
    """Write ``tensors`` and ``metadata`` to ``path`` atomically (a temp file in the same
    directory, then rename)."""
    from safetensors.torch import save_file

    meta = json.dumps(metadata, separators=(",", ":"))
    if len(meta) > MAX_HEADER_BYTES // 2:
        raise RoutingRecordError(f"metadata is {len(meta)} bytes: too large for a routing file "
                                 f"(limit {MAX_HEADER_BYTES // 2}); keep sample_ids/extra small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={METADATA_KEY: meta})
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(metadata, tensor_entries)`` of a routing file, checked but without reading tensors.

    ``tensor_entries`` maps each key to its safetensors header entry (``dtype``,
    ``shape``, ``data_offsets``).  Raises :class:`RoutingRecordError` when the file
    is not a routing file, is truncated, corrupt, or from a newer format version."""
    path = Path(path)
    n, raw, size = _raw_header(path)
    err = RoutingRecordError
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise err(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise err(f"{path}: corrupt safetensors header (not a JSON object)")
    file_meta = header.pop("__metadata__", None) or {}
    text = file_meta.get(METADATA_KEY) if isinstance(file_meta, dict) else None
    if text is None:
        raise err(f"{path}: not a routing record (no {METADATA_KEY!r} in the safetensors metadata)")
    meta = _checked_metadata(path, text)
    data_end = 0
    for key, entry in header.items():
        try:
            start, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise err(f"{path}: corrupt safetensors entry {key!r}") from None
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise err(f"{path}: truncated: tensors need {8 + n + data_end} bytes, file has {size}")
    return meta, header


def _raw_header(path: Path) -> tuple[int, bytes, int]:
    """(header length, header bytes, file size); the length is checked before it is read."""
    err = RoutingRecordError
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise err(f"{path}: truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise err(f"{path}: safetensors header claims {n} bytes (limit {MAX_HEADER_BYTES}): "
                          "corrupt or not a routing file")
            if 8 + n > size:
                raise err(f"{path}: truncated: header needs {8 + n} bytes, file has {size}")
            return n, handle.read(n), size
    except OSError as exc:
        raise err(f"{path}: cannot read: {exc}") from None


def _checked_metadata(path: Path, text: str) -> dict:
    """The routing metadata's JSON, its format and version checked."""
    err = RoutingRecordError
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise err(f"{path}: corrupt routing metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise err(f"{path}: routing metadata format is {got!r}, expected {FORMAT!r}")
    version = meta.get("version")
    if not _is_int(version) or version < 1:
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
    from safetensors.torch import load_file

    meta, entries = read_header(path)
    err = RoutingRecordError
    try:
        layers = [int(layer) for layer in meta["layers"]]
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
        tensors = load_file(str(path))
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
