"""The RoutingRecord type: which experts each token was routed to, per MoE layer.

A record holds, per layer, a ``[tokens, topk]`` tensor of expert ids (optionally
the matching probabilities) plus the layout metadata needed to line tokens up
between SGLang (per-request generation order) and Megatron (tokens flattened from
``[seq, batch]``, seq-major, then sliced for context and sequence parallelism).

Here: the fields and every check on them, copies and comparison, and the record
read from and written to its two wire forms: our file (``file.py``) and
SGLang's ``routed_experts`` field (``sglang_field.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import file, sglang_field
from .file import (DTYPE_NAMES, FORMAT, INDEX_DTYPE, VERSION, RoutingRecordError, is_int,
                          index_dtype_for)

TOKEN_ORDERS = ("megatron-sbh", "requests")
PARALLEL_KEYS = ("cp", "sp", "tp", "ep", "cp_rank", "tp_rank")


@dataclass(eq=False)  # tensors: compare with .equals()
class RoutingRecord:
    """Top-k expert ids per MoE layer for one sequence of tokens (see the module doc).

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
        if isinstance(self.indices, dict) and self.indices and all(is_int(k) for k in self.indices):
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
        if not is_int(self.num_experts) or self.num_experts < 1:
            raise err(f"num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.indices, dict) or not self.indices:
            raise err("indices must be a non-empty dict {layer: [tokens, topk] tensor}")
        bad = [k for k in self.indices if not is_int(k) or k < 0]
        if bad:
            raise err(f"layer ids must be non-negative ints, got {bad[0]!r}")
        if not is_int(self.topk) or not 1 <= self.topk <= self.num_experts:
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
            if not isinstance(self.seq_lens, (list, tuple)) or not all(is_int(n) and n >= 0 for n in self.seq_lens):
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
                if not (isinstance(sid, str) or is_int(sid)):
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
                if not is_int(pad) or not 0 <= pad <= n:
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
            if not is_int(p[size]) or p[size] < 1:
                raise err(f"parallel[{size!r}] must be a positive int, got {p[size]!r}")
            if rank is not None and (not is_int(p[rank]) or not 0 <= p[rank] < p[size]):
                raise err(f"parallel[{rank!r}] = {p[rank]!r} not in [0, {size} = {p[size]})")

    # ------------------------------------------------------------ helpers

    def metadata(self) -> dict:
        """Everything but the tensors, as written to the file's JSON."""
        return {"format": FORMAT, "version": self.version, "num_experts": self.num_experts,
                "topk": self.topk, "layers": list(self.layers), "num_tokens": self.num_tokens,
                "token_order": self.token_order, "sample_ids": self.sample_ids,
                "seq_lens": self.seq_lens, "padding": self.padding, "parallel": self.parallel,
                "source": self.source, "has_probs": self.probs is not None,
                "index_dtype": DTYPE_NAMES[index_dtype_for(self.num_experts)], "extra": self.extra}

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

    def encode(self, *, check: bool = True) -> bytes:
        """The bytes of this record's file (what :meth:`save` writes).  ``check=False``
        skips :meth:`validate`: only for a record built by :meth:`trusted`."""
        if check:
            self.validate()
        disk = index_dtype_for(self.num_experts)
        tensors = {}
        for layer in self.layers:
            ids = self.indices[layer]
            tensors[f"layer.{layer}.indices"] = ids if ids.dtype == disk else ids.detach().to(disk)
            if self.probs is not None:
                tensors[f"layer.{layer}.probs"] = self.probs[layer]
        return file.encode(tensors, self.metadata())  # (on the CPU, contiguous: file.encode)

    def save(self, path: str | os.PathLike) -> Path:
        """Write to ``path`` atomically (a temp file in the same directory, then rename)."""
        return file.write_bytes(Path(path), self.encode())

    @classmethod
    def trusted(cls, **fields) -> "RoutingRecord":
        """A record of ``fields`` as :class:`RoutingRecord` takes them, not validated: for
        a record its builder makes from ids it just copied off the router (routing
        capture's saver, which writes it as it is: ``encode(check=False)``).  Validating
        took about half the saver's CPU (two validations a record, a dozen tensor ops a
        layer each, every op giving the GIL up; 2026-12-07).  Records read from a file,
        or given by a caller, are validated."""
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"RoutingRecord has no field(s) {sorted(unknown)}")
        record = cls.__new__(cls)
        for name, spec in cls.__dataclass_fields__.items():
            if name in fields:
                value = fields[name]
            elif spec.default is not dataclasses.MISSING:
                value = spec.default
            else:
                value = spec.default_factory()
            setattr(record, name, value)
        if record.layers is None:
            record.layers = sorted(record.indices)
        if record.topk is None:
            record.topk = int(record.indices[record.layers[0]].shape[1])
        return record

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


def load(path: str | os.PathLike) -> RoutingRecord:
    """Read a routing file written by :meth:`RoutingRecord.save`; validate it.

    Indices come back as ``torch.int64``; probabilities in their stored dtype."""
    path = Path(path)
    fields, meta = file.read(path)
    try:
        record = RoutingRecord(**fields)
    except RoutingRecordError as exc:
        raise RoutingRecordError(f"{path}: {exc}") from None
    if record.num_tokens != meta.get("num_tokens", record.num_tokens):
        raise RoutingRecordError(f"{path}: metadata says {meta['num_tokens']} tokens, tensors hold "
                                 f"{record.num_tokens}")
    return record


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
    ids, rid = sglang_field.decode(meta, num_layers=num_layers, topk=topk, rid=rid, start_len=start_len)
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
    if record.token_order != "requests" or (record.sample_ids is not None and len(record.sample_ids) != 1):
        raise RoutingRecordError("to_sglang_meta: needs a one-request record (token_order 'requests'), got "
                                 f"{record.token_order!r} with sample_ids {record.sample_ids}")
    num_layers = max(record.layers) + 1 if num_layers is None else num_layers
    if max(record.layers) >= num_layers:
        raise RoutingRecordError(f"to_sglang_meta: layer {max(record.layers)} does not fit {num_layers} layers")
    out = torch.zeros(record.num_tokens, num_layers, record.topk, dtype=torch.int32)
    for k in record.layers:
        out[:, k] = record.indices[k].to(torch.int32)
    return sglang_field.encode(out)
