"""A record's slices for Megatron's context- and sequence-parallel ranks, and back.

``slice_for_rank`` cuts a full-length ``megatron-sbh`` record into the rows one
rank's routers see; ``gather_slices`` joins the slices again.  The positions are
core/slicing.py's (the split the dump's comparison uses too), after Megatron's own
helpers (``get_batch_on_this_cp_rank``, ``scatter_to_sequence_parallel_region``);
tests/test_routing_record.py checks them against those helpers.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ...core import slicing
from .file import RoutingRecordError, is_int
from .record import RoutingRecord


def local_seq_positions(seq_len: int, *, cp_size: int, cp_rank: int, tp_size: int = 1,
                        tp_rank: int = 0, sequence_parallel: bool = False) -> torch.Tensor:
    """Positions along the sequence that a rank's router sees, in its local order:
    core/slicing.py's ``local_seq_positions`` (Megatron's zigzag context-parallel chunks,
    then with ``sequence_parallel`` a contiguous ``1 / tp_size`` of them), its errors
    raised as :class:`RoutingRecordError`."""
    try:
        return slicing.local_seq_positions(seq_len, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size,
                                           tp_rank=tp_rank, sequence_parallel=sequence_parallel)
    except ValueError as exc:
        raise RoutingRecordError(str(exc)) from None


def token_rows(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of an ``[s, b]``-flattened (seq-major) token list for sequence ``positions``,
    all ``batch`` samples each: ``position * batch + b``."""
    return (positions[:, None] * batch + torch.arange(batch)[None, :]).reshape(-1)


def _uniform_seq_len(record: RoutingRecord, batch: int) -> int:
    err = RoutingRecordError
    if record.token_order != "megatron-sbh":
        raise err(f"only a 'megatron-sbh' record can be sliced for a Megatron rank, this one is "
                  f"{record.token_order!r} (align SGLang requests into [seq, batch] first)")
    if not is_int(batch) or batch < 1:
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
    if not is_int(ep_size) or ep_size < 1:
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
