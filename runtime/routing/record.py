"""Routing records: which experts each token was routed to, per MoE layer.

The data layer under routing capture and replay (docs/routing.md)::

    import source_patch.runtime.routing.record as record   # RoutingRecord, load, slice_for_rank

    rec = RoutingRecord(indices={1: idx1, 2: idx2}, num_experts=64, topk=8,
                        seq_lens=[4096] * 2, sample_ids=["a", "b"])
    rec.save("routes/step-0.safetensors")          # atomic; one safetensors file
    rec = load("routes/step-0.safetensors")        # checks format/version, validates
    mine = slice_for_rank(rec, batch=2, cp_size=2, cp_rank=1,
                          tp_size=2, tp_rank=0, sequence_parallel=True)

A record holds, per layer, a ``[tokens, topk]`` tensor of expert ids (optionally
the matching probabilities) plus the layout metadata needed to line tokens up
between SGLang (per-request generation order) and Megatron (tokens flattened from
``[seq, batch]``, seq-major, then sliced for context and sequence parallelism).

On disk (format version 1): one safetensors file, tensors ``layer.<L>.indices``
(uint8 / int16 / int32 by ``num_experts``) and ``layer.<L>.probs``; the metadata
is JSON under the ``__metadata__`` key ``source_patch.routing``.  Nothing is
unpickled.  Loaded indices are ``torch.int64`` (what ``torch.topk`` returns and
what Megatron's ``RouterReplay`` gathers with).

CLI::

    python -m source_patch.runtime.routing.record FILE

The record is one contract (model, file format, CP/SP slicing checked against
Megatron's helpers, RouterReplay interop, inspect CLI) whose changes must be read
together, so it is one module.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

FORMAT = "source-patch-routing"
VERSION = 1
METADATA_KEY = "source_patch.routing"
MAX_HEADER_BYTES = 16 << 20       # a larger safetensors header is refused as corrupt
TOKEN_ORDERS = ("megatron-sbh", "requests")
INDEX_DTYPE = torch.int64          # the dtype indices have once loaded
PARALLEL_KEYS = ("cp", "sp", "tp", "ep", "cp_rank", "tp_rank")

_DISK_DTYPES = {"U8": torch.uint8, "I16": torch.int16, "I32": torch.int32}
_DTYPE_NAMES = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
_FLOAT_CODES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class RoutingRecordError(ValueError):
    """A routing record, or a file holding one, is malformed."""


def index_dtype_for(num_experts: int) -> torch.dtype:
    """The dtype expert ids are stored with on disk: the smallest that holds them."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(eq=False)  # tensors: compare with .equals()
class RoutingRecord:
    """Top-k expert ids per MoE layer for one sequence of tokens (see module doc).

    ``indices``: layer -> ``[tokens, topk]`` integer tensor; ``probs``: layer ->
    ``[tokens, topk]`` float tensor, or None.  ``layers`` defaults to the sorted
    layer ids of ``indices``; ``topk`` to the width of the first layer's tensor.

    ``token_order``: ``"megatron-sbh"`` (token ``t = s * batch + b``, as Megatron's
    router sees ``[seq, batch]`` flattened) or ``"requests"`` (SGLang: request after
    request, each in generation order).  ``sample_ids`` / ``seq_lens``: one per
    sequence or request; the token count equals ``sum(seq_lens)``.  ``padding``: per
    sample, how many of its tokens are right padding (the last ones of its
    sequence).  ``parallel``: None for a full-length record; for a per-rank slice
    ``{"cp", "sp", "tp", "ep", "cp_rank", "tp_rank"}``.  ``extra``: free JSON-able
    tags (step, microbatch, ...).  Validated on construction: each problem raises
    :class:`RoutingRecordError` naming the layer, the row and the value.
    """

    indices: dict
    num_experts: int
    topk: int | None = None
    probs: dict | None = None
    layers: list | None = None
    token_order: str = "megatron-sbh"
    sample_ids: list | None = None
    seq_lens: list | None = None
    padding: list | None = None
    parallel: dict | None = None
    source: str = "megatron"
    version: int = VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.indices, dict) and self.indices and all(_is_int(k) for k in self.indices):
            if self.layers is None:
                self.layers = sorted(self.indices)
            first = self.indices[min(self.indices)]
            if self.topk is None and isinstance(first, torch.Tensor) and first.dim() == 2:
                self.topk = int(first.shape[1])
        self.validate()

    # ------------------------------------------------------------ validation

    @property
    def num_tokens(self) -> int:
        return int(self.indices[self.layers[0]].shape[0])

    def validate(self) -> "RoutingRecord":
        """Check every invariant; raise :class:`RoutingRecordError` on the first problem."""
        err = RoutingRecordError
        if self.version != VERSION:
            raise err(f"routing record version {self.version!r}: this source-patch handles version {VERSION}")
        if not _is_int(self.num_experts) or self.num_experts < 1:
            raise err(f"num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.indices, dict) or not self.indices:
            raise err("indices must be a non-empty dict {layer: [tokens, topk] tensor}")
        bad = [k for k in self.indices if not _is_int(k) or k < 0]
        if bad:
            raise err(f"layer ids must be non-negative ints, got {bad[0]!r}")
        if not _is_int(self.topk) or not 1 <= self.topk <= self.num_experts:
            raise err(f"topk must be an int in [1, num_experts={self.num_experts}], got {self.topk!r}")
        if not isinstance(self.layers, (list, tuple)) or list(self.layers) != sorted(self.indices):
            raise err(f"layers {self.layers!r} do not match the layers of indices {sorted(self.indices)}")
        self.layers = list(self.layers)
        if self.token_order not in TOKEN_ORDERS:
            raise err(f"token_order must be one of {TOKEN_ORDERS}, got {self.token_order!r}")
        if not isinstance(self.source, str) or not self.source:
            raise err(f"source must be a non-empty string, got {self.source!r}")
        if not isinstance(self.extra, dict):
            raise err(f"extra must be a dict, got {type(self.extra).__name__}")

        tokens = None
        for layer in self.layers:
            t = self.indices[layer]
            if not isinstance(t, torch.Tensor):
                raise err(f"layer {layer}: indices must be a tensor, got {type(t).__name__}")
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise err(f"layer {layer}: indices must be an integer tensor, got {t.dtype}")
            if t.dim() != 2 or t.shape[1] != self.topk:
                raise err(f"layer {layer}: indices must have shape [tokens, topk={self.topk}], "
                          f"got {list(t.shape)}")
            if tokens is None:
                tokens = t.shape[0]
            elif t.shape[0] != tokens:
                raise err(f"layer {layer}: {t.shape[0]} tokens, but layer {self.layers[0]} has {tokens}")
            self._check_ids(layer, t)
        if self.probs is not None:
            if not isinstance(self.probs, dict) or sorted(self.probs) != list(self.layers):
                got = sorted(self.probs) if isinstance(self.probs, dict) else type(self.probs).__name__
                raise err(f"probs must have the same layers as indices {self.layers}, got {got}")
            for layer in self.layers:
                p = self.probs[layer]
                if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                    raise err(f"layer {layer}: probs must be a floating-point tensor, "
                              f"got {getattr(p, 'dtype', type(p).__name__)}")
                if tuple(p.shape) != (tokens, self.topk):
                    raise err(f"layer {layer}: probs shape {list(p.shape)} != indices shape "
                              f"{[tokens, self.topk]}")
                finite = torch.isfinite(p)
                if not bool(finite.all()):
                    row = int((~finite).any(dim=1).nonzero()[0, 0])
                    raise err(f"layer {layer}, row {row}: non-finite probability {p[row].tolist()}")

        self._check_samples(tokens)
        self._check_parallel()
        try:
            json.dumps(self.extra)
        except (TypeError, ValueError) as exc:
            raise err(f"extra must be JSON-serialisable: {exc}") from None
        return self

    def _check_ids(self, layer, t: torch.Tensor):
        if t.numel() == 0:
            return
        low, high = torch.aminmax(t)  # one reduction: a capture saves a record per microbatch
        if int(low) < 0 or int(high) >= self.num_experts:
            out = (t < 0) | (t >= self.num_experts)
            row, col = (int(v) for v in out.nonzero()[0])
            raise RoutingRecordError(f"layer {layer}, row {row}: expert id {int(t[row, col])} out of range "
                                     f"[0, {self.num_experts}) (row {t[row].tolist()})")
        if self.topk == 2 and not bool((t[:, 0] == t[:, 1]).any()):
            return  # the common top-2 without sorting (5x cheaper on a 4096-token record)
        if self.topk > 1:
            ordered = t.sort(dim=1).values
            dup = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
            if bool(dup.any()):
                row = int(dup.nonzero()[0, 0])
                same = ordered[row][1:][ordered[row][1:] == ordered[row][:-1]]
                raise RoutingRecordError(f"layer {layer}, row {row}: expert {int(same[0])} chosen twice "
                                         f"(row {t[row].tolist()})")

    def _check_samples(self, tokens: int):
        err = RoutingRecordError
        if self.seq_lens is not None:
            if not isinstance(self.seq_lens, (list, tuple)) or not all(_is_int(n) and n >= 0 for n in self.seq_lens):
                raise err(f"seq_lens must be a list of non-negative ints, got {self.seq_lens!r}")
            self.seq_lens = list(self.seq_lens)
            if sum(self.seq_lens) != tokens:
                raise err(f"indices hold {tokens} tokens but sum(seq_lens) = {sum(self.seq_lens)} "
                          f"({len(self.seq_lens)} samples)")
        if self.sample_ids is not None:
            if not isinstance(self.sample_ids, (list, tuple)):
                raise err(f"sample_ids must be a list, got {type(self.sample_ids).__name__}")
            self.sample_ids = list(self.sample_ids)
            for i, sid in enumerate(self.sample_ids):
                if not (isinstance(sid, str) or _is_int(sid)):
                    raise err(f"sample_ids[{i}] must be a str or int, got {sid!r}")
            if self.seq_lens is not None and len(self.sample_ids) != len(self.seq_lens):
                raise err(f"{len(self.sample_ids)} sample_ids but {len(self.seq_lens)} seq_lens")
        if self.padding is not None:
            if self.seq_lens is None:
                raise err("padding needs seq_lens (padding counts are per sample)")
            if not isinstance(self.padding, (list, tuple)) or len(self.padding) != len(self.seq_lens):
                raise err(f"padding must be a list of {len(self.seq_lens)} ints (one per sample), "
                          f"got {self.padding!r}")
            self.padding = list(self.padding)
            for i, (pad, n) in enumerate(zip(self.padding, self.seq_lens)):
                if not _is_int(pad) or not 0 <= pad <= n:
                    raise err(f"padding[{i}] = {pad!r} not in [0, seq_lens[{i}] = {n}]")

    def _check_parallel(self):
        p = self.parallel
        if p is None:
            return
        err = RoutingRecordError
        if not isinstance(p, dict) or set(p) != set(PARALLEL_KEYS):
            raise err(f"parallel must be None or a dict with keys {list(PARALLEL_KEYS)}, got {p!r}")
        if not isinstance(p["sp"], bool):
            raise err(f"parallel['sp'] must be a bool, got {p['sp']!r}")
        for size, rank in (("cp", "cp_rank"), ("tp", "tp_rank"), ("ep", None)):
            if not _is_int(p[size]) or p[size] < 1:
                raise err(f"parallel[{size!r}] must be a positive int, got {p[size]!r}")
            if rank is not None and (not _is_int(p[rank]) or not 0 <= p[rank] < p[size]):
                raise err(f"parallel[{rank!r}] = {p[rank]!r} not in [0, {size} = {p[size]})")

    # ------------------------------------------------------------ helpers

    def metadata(self) -> dict:
        """Everything but the tensors, as written to the file's JSON."""
        return {"format": FORMAT, "version": self.version, "num_experts": self.num_experts,
                "topk": self.topk, "layers": list(self.layers), "num_tokens": self.num_tokens,
                "token_order": self.token_order, "sample_ids": self.sample_ids,
                "seq_lens": self.seq_lens, "padding": self.padding, "parallel": self.parallel,
                "source": self.source, "has_probs": self.probs is not None,
                "index_dtype": _DTYPE_NAMES[index_dtype_for(self.num_experts)], "extra": self.extra}

    def replace(self, **changes) -> "RoutingRecord":
        """A copy with some fields changed (tensors shared), validated."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if "indices" in changes and "layers" not in changes:
            fields["layers"] = None
        fields.update(changes)
        return RoutingRecord(**fields)

    def equals(self, other: "RoutingRecord") -> bool:
        """Same metadata and same tensor values (indices compared as integers)."""
        if not isinstance(other, RoutingRecord) or self.metadata() != other.metadata():
            return False
        same = all(torch.equal(self.indices[k].long(), other.indices[k].long()) for k in self.layers)
        if self.probs is not None:
            same = same and all(torch.equal(self.probs[k], other.probs[k]) for k in self.layers)
        return same

    def save(self, path: str | os.PathLike) -> Path:
        """Write to ``path`` atomically (a temp file in the same directory, then rename)."""
        from safetensors.torch import save_file

        self.validate()
        path = Path(path)
        disk = index_dtype_for(self.num_experts)
        tensors = {}
        for layer in self.layers:
            tensors[f"layer.{layer}.indices"] = self.indices[layer].detach().to("cpu", disk).contiguous()
            if self.probs is not None:
                tensors[f"layer.{layer}.probs"] = self.probs[layer].detach().to("cpu").contiguous()
        meta = json.dumps(self.metadata(), separators=(",", ":"))
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

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingRecord":
        return load(path)

    @classmethod
    def from_sglang_meta(cls, meta, *, num_experts: int, num_layers: int, topk: int, layers=None,
                         rid=None, start_len: int = 0) -> "RoutingRecord":
        """The record of what SGLang's own capturer returned for one request (see
        :func:`from_sglang_meta`)."""
        return from_sglang_meta(meta, num_experts=num_experts, num_layers=num_layers, topk=topk, layers=layers,
                                rid=rid, start_len=start_len)


# ---------------------------------------------------------------- SGLang's own capturer (R3)

MAX_META_BYTES = 1 << 30  # a larger base64 routed_experts field is refused


def _meta_field(meta, rid):
    """(base64 text, meta_info or None, rid) of a /generate result, its meta_info, or the text."""
    if isinstance(meta, dict) and "meta_info" in meta:
        meta = meta["meta_info"]
    if isinstance(meta, dict):
        text = meta.get("routed_experts")
        if text is None:
            raise RoutingRecordError("meta_info has no routed_experts (start the engine with "
                                     "--enable-return-routed-experts and send return_routed_experts=True)")
        return text, meta, rid if rid is not None else meta.get("id")
    return meta, None, rid


def from_sglang_meta(meta, *, num_experts: int, num_layers: int, topk: int, layers=None, rid=None,
                     start_len: int = 0) -> RoutingRecord:
    """A ``token_order="requests"`` record from ``meta_info["routed_experts"]`` of an
    SGLang engine started with ``--enable-return-routed-experts``: base64 of int32
    ``[seqlen - 1 - start_len, num_layers, topk]`` (logical expert ids, layer ``i`` is
    SGLang's ``layer_id`` ``i``).  ``meta`` is a /generate result, its ``meta_info``,
    or the base64 text.  ``layers``: the MoE layers to keep (a model with dense layers
    leaves their rows zero: keep only the MoE ones); ``rid``: default ``meta_info["id"]``;
    ``start_len``: the request's ``routed_experts_start_len``.  Validated as every record
    is (expert range, duplicates); with a ``meta_info`` the row count must be
    ``prompt_tokens + completion_tokens - 1 - start_len``."""
    import base64
    import binascii

    text, info, rid = _meta_field(meta, rid)
    if not isinstance(text, (str, bytes)) or len(text) > MAX_META_BYTES:
        raise RoutingRecordError(f"routed_experts must be base64 text (at most {MAX_META_BYTES} bytes), "
                                 f"got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingRecordError(f"routed_experts is not valid base64: {exc}") from None
    row = 4 * num_layers * topk
    if num_layers < 1 or topk < 1 or len(raw) % row:
        raise RoutingRecordError(f"routed_experts holds {len(raw)} bytes: not whole rows of int32 "
                                 f"[layers={num_layers}, topk={topk}] ({row} bytes)")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, num_layers, topk)
    if info is not None and "prompt_tokens" in info and "completion_tokens" in info:
        want = int(info["prompt_tokens"]) + int(info["completion_tokens"]) - 1 - start_len
        if ids.shape[0] != want:
            raise RoutingRecordError(f"routed_experts has {ids.shape[0]} rows; request {rid!r} has "
                                     f"{info['prompt_tokens']} prompt + {info['completion_tokens']} completion "
                                     f"tokens: expected {want} (the last token is never routed)")
    layers = list(range(num_layers)) if layers is None else [int(k) for k in layers]
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise RoutingRecordError(f"layers {bad} are outside the {num_layers} layers of routed_experts")
    return RoutingRecord(indices={k: ids[:, k].to(INDEX_DTYPE) for k in layers}, num_experts=num_experts,
                         token_order="requests", sample_ids=None if rid is None else [rid],
                         seq_lens=[int(ids.shape[0])], source="sglang",
                         extra={"start_pos": int(start_len), "from": "routed_experts"})


def to_sglang_meta(record: RoutingRecord, *, num_layers: int | None = None) -> str:
    """The inverse: base64 of int32 ``[tokens, num_layers, topk]`` as SGLang returns
    ``routed_experts`` (layer ``k`` in column ``k``; ``num_layers`` default the largest
    layer id + 1; layers the record lacks are zero, as SGLang leaves dense layers)."""
    import base64

    if record.token_order != "requests" or (record.sample_ids is not None and len(record.sample_ids) != 1):
        raise RoutingRecordError("to_sglang_meta: needs a one-request record (token_order 'requests'), got "
                                 f"{record.token_order!r} with sample_ids {record.sample_ids}")
    num_layers = max(record.layers) + 1 if num_layers is None else num_layers
    if max(record.layers) >= num_layers:
        raise RoutingRecordError(f"to_sglang_meta: layer {max(record.layers)} does not fit {num_layers} layers")
    out = torch.zeros(record.num_tokens, num_layers, record.topk, dtype=torch.int32)
    for k in record.layers:
        out[:, k] = record.indices[k].to(torch.int32)
    return base64.b64encode(out.numpy().tobytes()).decode("ascii")


# ---------------------------------------------------------------- file format


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(metadata, tensor_entries)`` of a routing file, checked but without reading tensors.

    ``tensor_entries`` maps each key to its safetensors header entry (``dtype``,
    ``shape``, ``data_offsets``).  Raises :class:`RoutingRecordError` when the file
    is not a routing file, is truncated, corrupt, or from a newer format version."""
    path = Path(path)
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
            raw = handle.read(n)
    except OSError as exc:
        raise err(f"{path}: cannot read: {exc}") from None
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


def load(path: str | os.PathLike) -> RoutingRecord:
    """Read a routing file written by :meth:`RoutingRecord.save`; validate it.

    Indices come back as ``torch.int64``; probabilities in their stored dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    meta, entries = read_header(path)
    err = RoutingRecordError
    try:
        layers = [int(layer) for layer in meta["layers"]]
        has_probs = bool(meta["has_probs"])
        fields = {k: meta[k] for k in ("num_experts", "topk", "token_order", "sample_ids", "seq_lens",
                                       "padding", "parallel", "source", "version")}
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
    indices = {layer: tensors[f"layer.{layer}.indices"].to(INDEX_DTYPE) for layer in layers}
    probs = {layer: tensors[f"layer.{layer}.probs"] for layer in layers} if has_probs else None
    try:
        record = RoutingRecord(indices=indices, probs=probs, layers=layers, extra=extra, **fields)
    except RoutingRecordError as exc:
        raise err(f"{path}: {exc}") from None
    if record.num_tokens != meta.get("num_tokens", record.num_tokens):
        raise err(f"{path}: metadata says {meta['num_tokens']} tokens, tensors hold {record.num_tokens}")
    return record


# ---------------------------------------------------------------- CP / SP slicing


def local_seq_positions(seq_len: int, *, cp_size: int, cp_rank: int, tp_size: int = 1,
                        tp_rank: int = 0, sequence_parallel: bool = False) -> torch.Tensor:
    """Positions along the sequence that a rank's router sees, in its local order.

    Context parallel (as ``megatron.core.utils.get_batch_on_this_cp_rank``): the
    sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunks
    ``r`` and ``2 * cp_size - 1 - r``, in that order.  Sequence parallel (as
    ``scatter_to_sequence_parallel_region``): the CP-local sequence is then cut
    contiguously into ``tp_size`` parts; TP rank ``t`` holds part ``t``.  Without
    sequence parallel every TP rank sees the whole CP-local sequence."""
    err = RoutingRecordError
    for name, size, rank in (("cp", cp_size, cp_rank), ("tp", tp_size, tp_rank)):
        if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
            raise err(f"{name}_rank {rank!r} not in [0, {name}_size = {size!r})")
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise err(f"sequence length {seq_len} is not divisible by 2 * cp_size = {2 * cp_size}")
    positions = torch.arange(seq_len)
    if cp_size > 1:
        chunks = positions.view(2 * cp_size, seq_len // (2 * cp_size))
        positions = chunks[[cp_rank, 2 * cp_size - 1 - cp_rank]].reshape(-1)
    if sequence_parallel and tp_size > 1:
        if positions.numel() % tp_size:
            raise err(f"CP-local sequence length {positions.numel()} is not divisible by tp_size = {tp_size} "
                      "(sequence parallel)")
        positions = positions.view(tp_size, -1)[tp_rank]
    return positions


def token_rows(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of an ``[s, b]``-flattened (seq-major) token list for sequence ``positions``,
    all ``batch`` samples each: ``position * batch + b``."""
    return (positions[:, None] * batch + torch.arange(batch)[None, :]).reshape(-1)


def _uniform_seq_len(record: RoutingRecord, batch: int) -> int:
    err = RoutingRecordError
    if record.token_order != "megatron-sbh":
        raise err(f"only a 'megatron-sbh' record can be sliced for a Megatron rank, this one is "
                  f"{record.token_order!r} (align SGLang requests into [seq, batch] first)")
    if not _is_int(batch) or batch < 1:
        raise err(f"batch must be a positive int, got {batch!r}")
    if record.num_tokens % batch:
        raise err(f"{record.num_tokens} tokens are not a whole number of [seq, batch={batch}] rows")
    seq_len = record.num_tokens // batch
    if record.seq_lens is not None and (len(record.seq_lens) != batch or set(record.seq_lens) != {seq_len}):
        raise err(f"seq_lens {record.seq_lens} do not describe {batch} sequences of {seq_len} tokens "
                  "(Megatron's [seq, batch] layout needs equal lengths)")
    return seq_len


def slice_for_rank(record: RoutingRecord, *, batch: int, cp_size: int, cp_rank: int, tp_size: int = 1,
                   tp_rank: int = 0, sequence_parallel: bool = False, ep_size: int = 1) -> RoutingRecord:
    """The part of a full-length ``megatron-sbh`` record that one rank's routers see.

    ``record`` holds ``seq * batch`` tokens flattened seq-major; the result holds
    the rows of :func:`local_seq_positions` for every sample, seq-major again, with
    ``seq_lens`` / ``padding`` per sample for the slice and ``parallel`` set.
    ``ep_size`` is only recorded (expert parallelism does not change which tokens a
    router sees)."""
    if record.parallel is not None:
        raise RoutingRecordError(f"record is already a slice (parallel={record.parallel}); slice the full record")
    seq_len = _uniform_seq_len(record, batch)
    positions = local_seq_positions(seq_len, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size,
                                    tp_rank=tp_rank, sequence_parallel=sequence_parallel)
    rows = token_rows(positions, batch)
    padding = None
    if record.padding is not None:  # right padding: sample b's pad positions are >= seq_len - pad_b
        padding = [int((positions >= seq_len - pad).sum()) for pad in record.padding]
    if not _is_int(ep_size) or ep_size < 1:
        raise RoutingRecordError(f"ep_size must be a positive int, got {ep_size!r}")
    return record.replace(
        indices={k: record.indices[k][rows] for k in record.layers},
        probs=None if record.probs is None else {k: record.probs[k][rows] for k in record.layers},
        seq_lens=[positions.numel()] * batch, padding=padding,
        parallel={"cp": cp_size, "sp": bool(sequence_parallel), "tp": tp_size, "ep": ep_size,
                  "cp_rank": cp_rank, "tp_rank": tp_rank})


def gather_slices(slices: Iterable[RoutingRecord]) -> RoutingRecord:
    """Reassemble the full-length record from per-rank slices (inverse of :func:`slice_for_rank`).

    Needs one slice per CP rank, and with sequence parallel one per (CP, TP) rank.
    Without sequence parallel, TP ranks hold the same tokens: extra TP slices are
    checked to be identical.  The result has ``parallel=None`` and ``seq_lens`` set."""
    slices = list(slices)
    err = RoutingRecordError
    if not slices:
        raise err("gather_slices needs at least one slice")
    first = slices[0]
    for i, s in enumerate(slices):
        if not isinstance(s, RoutingRecord) or s.parallel is None:
            raise err(f"slice {i} is not a per-rank slice (parallel is None)")
        for name in ("num_experts", "topk", "layers", "token_order", "source", "sample_ids"):
            if getattr(s, name) != getattr(first, name):
                raise err(f"slice {i} has {name}={getattr(s, name)!r}, slice 0 has {getattr(first, name)!r}")
        for name in ("cp", "sp", "tp", "ep"):
            if s.parallel[name] != first.parallel[name]:
                raise err(f"slice {i} has parallel[{name!r}]={s.parallel[name]!r}, slice 0 has "
                          f"{first.parallel[name]!r}")
        if (s.probs is None) != (first.probs is None):
            raise err(f"slice {i} {'lacks' if s.probs is None else 'has'} probs, slice 0 does not")
        if s.seq_lens != first.seq_lens:
            raise err(f"slice {i} has seq_lens {s.seq_lens}, slice 0 has {first.seq_lens}")
    cp, tp, sp = first.parallel["cp"], first.parallel["tp"], first.parallel["sp"]
    split_tp = sp and tp > 1
    by_rank: dict = {}
    for i, s in enumerate(slices):
        key = (s.parallel["cp_rank"], s.parallel["tp_rank"] if split_tp else 0)
        if key in by_rank:
            j, other = by_rank[key]
            if split_tp or not other.equals(s.replace(parallel=other.parallel)):
                raise err(f"slices {j} and {i} are both for cp_rank {key[0]}, tp_rank {s.parallel['tp_rank']}"
                          + ("" if split_tp else " and differ"))
            continue
        by_rank[key] = (i, s)
    wanted = {(c, t) for c in range(cp) for t in range(tp if split_tp else 1)}
    missing = sorted(wanted - set(by_rank))
    if missing:
        names = ", ".join(f"cp_rank {c}" + (f"/tp_rank {t}" if split_tp else "") for c, t in missing)
        raise err(f"cannot gather: no slice for {names}")
    if first.seq_lens is None:
        raise err("slices lack seq_lens: cannot tell the batch size")
    batch, local = len(first.seq_lens), first.seq_lens[0] if first.seq_lens else 0
    seq_len = local * cp * (tp if split_tp else 1)
    total = seq_len * batch
    indices = {k: torch.empty((total, first.topk), dtype=first.indices[k].dtype) for k in first.layers}
    probs = None if first.probs is None else {
        k: torch.empty((total, first.topk), dtype=first.probs[k].dtype) for k in first.layers}
    padding = None if first.padding is None else [0] * batch
    for (c, t), (_, s) in sorted(by_rank.items()):
        rows = token_rows(local_seq_positions(seq_len, cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t,
                                              sequence_parallel=split_tp), batch)
        for k in first.layers:
            indices[k][rows] = s.indices[k].to(indices[k].dtype)
            if probs is not None:
                probs[k][rows] = s.probs[k].to(probs[k].dtype)
        if padding is not None:
            if s.padding is None:
                raise err(f"slice for cp_rank {c} lacks padding, others have it")
            padding = [a + b for a, b in zip(padding, s.padding)]
    return first.replace(indices=indices, probs=probs, seq_lens=[seq_len] * batch, padding=padding,
                         parallel=None)


# ---------------------------------------------------------------- Megatron's RouterReplay


def _router_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def to_megatron_native(record: RoutingRecord, *, layers: Sequence[int] | None = None, device=None,
                       install: bool = False) -> list:
    """The list Megatron's ``RouterReplay.set_replay_data`` takes: one ``[tokens, topk]``
    int64 tensor per router instance, in the registry's (instantiation) order.

    ``layers``: the record layer for each registry position (default: the record's
    layers, sorted; see :func:`megatron_replay_layers`).  ``install=True`` also
    calls ``RouterReplay.set_replay_data`` with it (each call also queues the
    tensors for ``REPLAY_BACKWARD`` recompute)."""
    layers = list(record.layers if layers is None else layers)
    missing = [layer for layer in layers if layer not in record.indices]
    if missing:
        raise RoutingRecordError(f"record has no layer {missing[0]} (it has {record.layers})")
    out = [record.indices[layer].to(device=device, dtype=torch.int64) for layer in layers]
    if install:
        replay = _router_replay_class()
        count = len(replay.global_router_replay_instances)
        if count != len(out):
            raise RoutingRecordError(f"{len(out)} layers for {count} RouterReplay instances "
                                     "(enable moe_enable_routing_replay and pass layers=)")
        replay.set_replay_data(out)
    return out


def from_megatron_native(data: Sequence | None = None, *, num_experts: int, layers: Sequence[int] | None = None,
                         **fields) -> RoutingRecord:
    """A record from ``RouterReplay.get_recorded_data()`` (the default ``data``): per
    router instance, the ``[tokens, topk]`` indices of its last recorded call.

    ``layers``: the layer id of each registry position (default ``0 .. n-1``).
    Other keyword arguments are :class:`RoutingRecord` fields (``seq_lens``,
    ``sample_ids``, ``parallel``, ...).  An instance that recorded nothing is an
    error, never an empty layer."""
    if data is None:
        data = _router_replay_class().get_recorded_data()
    data = list(data)
    layers = list(range(len(data)) if layers is None else layers)
    if len(layers) != len(data):
        raise RoutingRecordError(f"{len(data)} recorded tensors but {len(layers)} layer ids")
    if len(set(layers)) != len(layers):
        raise RoutingRecordError(f"duplicate layer ids {layers}")
    for pos, (layer, t) in enumerate(zip(layers, data)):
        if t is None:
            raise RoutingRecordError(f"RouterReplay instance {pos} (layer {layer}) recorded nothing: set "
                                     "RouterReplayAction.RECORD and run a forward first")
    return RoutingRecord(indices={layer: t.detach().to("cpu", torch.int64) for layer, t in zip(layers, data)},
                         num_experts=num_experts, **fields)


def megatron_replay_layers(*models) -> list:
    """The Megatron layer number of each ``RouterReplay`` instance, in registry order.

    Found through the routers (``router.router_replay``, ``router.layer_number``) in
    ``models`` (several for virtual pipeline chunks); every registered instance must
    belong to one of them."""
    owner = {}
    for model in models:
        for module in model.modules():
            replay = getattr(module, "router_replay", None)
            if replay is not None and hasattr(module, "layer_number"):
                owner[id(replay)] = module.layer_number
    out = []
    for pos, replay in enumerate(_router_replay_class().global_router_replay_instances):
        if id(replay) not in owner:
            raise RoutingRecordError(f"RouterReplay instance {pos} belongs to no router of the given models")
        out.append(owner[id(replay)])
    return out


# ---------------------------------------------------------------- CLI


def _disk_dtypes(entries: dict) -> dict:
    names = {"U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", **{
        k: str(v).replace("torch.", "") for k, v in _FLOAT_CODES.items()}}
    return {key: names.get(e.get("dtype"), e.get("dtype")) for key, e in entries.items()}


def describe(path: str | os.PathLike) -> str:
    """Metadata and a per-layer table (tokens, topk, dtype on disk, expert load)."""
    meta, entries = read_header(path)
    record = load(path)
    dtypes = _disk_dtypes(entries)
    lines = [f"{path}: {FORMAT} v{meta['version']}"]
    for key in ("source", "num_experts", "topk", "num_tokens", "token_order", "parallel", "seq_lens",
                "padding", "sample_ids", "extra"):
        value = meta.get(key)
        if isinstance(value, list) and len(value) > 8:
            value = f"{value[:8]}... ({len(value)} entries)"
        lines.append(f"  {key}: {value}")
    table = [("layer", "tokens", "topk", "dtype", "probs", "load min", "load max", "load mean")]
    for layer in record.layers:
        counts = torch.bincount(record.indices[layer].reshape(-1), minlength=record.num_experts)
        table.append((str(layer), str(record.num_tokens), str(record.topk), dtypes[f"layer.{layer}.indices"],
                      dtypes.get(f"layer.{layer}.probs", "-"), str(int(counts.min())), str(int(counts.max())),
                      f"{counts.float().mean().item():.2f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.routing.record",
                                     description="Show a routing record file.")
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        print(describe(args.file))
    except RoutingRecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
