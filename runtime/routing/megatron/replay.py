"""Routing replay's record side in Megatron: the records to replay, each sliced for
this rank once and staged on the device once, and the checks of a router call
against its record.

``control.py`` decides which (step, microbatch, layer) a router call is (and feeds a
graphed router's buffer before each replay); ``ids`` returns that call's recorded
ids, ``probs`` its recorded combine weights.

Records keyed by request id (SGLang's, ``token_order="requests"``: :func:`set_requests`,
or :func:`set_replay` of such records or of a folder of them) are aligned to the
micro-batch that ``source_patch.batch`` named (core/rows.py), at its first router call
(:func:`arm`): the aligned record, this rank's part of it, becomes that call's record.

The state below is this side's alone (``control.py`` reads it through the functions
here and clears it through ``clear``): one copy, in this module.
"""

from __future__ import annotations

import os

import torch

from ...core import ranks
from ..records.file import RoutingRecordError
from ..records.record import RoutingRecord
from ..records.slicing import slice_for_rank
from .files import RoutingReplayError, load_dir

_replay: dict = {}   # (step, microbatch) -> RoutingRecord (as loaded)
_sliced: dict = {}   # (step, microbatch) -> RoutingRecord (sliced for this rank)
_staged: dict = {}   # (step, microbatch) -> (device, {layer: int64 indices on that device})
_used: dict = {}     # (step, microbatch) -> set of layers replayed
_last_replay = None  # (key, layer, indices) of the latest replayed top-k: where its weights go
_requests: dict = {}  # request id -> RoutingRecord ("requests" order): aligned to each named micro-batch
_align = {"layer_offset": 1, "missing_tail": 1, "filler": "spread"}
_armed: dict = {}    # (step, microbatch) -> (Rows version, sequence parallel) its record was aligned for


def set_replay(source) -> None:
    """Records to replay: a directory, a list of records tagged ``extra={"step", "microbatch"}``,
    or a dict ``{(step, microbatch): record}``; or request records (SGLang's: a folder of
    them without an index.json, a list, or a dict by request id), which go to
    :func:`set_requests`."""
    if isinstance(source, (str, os.PathLike)):
        if _is_request_folder(source):
            set_requests(source)
            return
        source = load_dir(source)
    elif _all_requests(source):
        set_requests(source)
        return
    elif not isinstance(source, dict):
        items = {}
        for rec in source:
            try:
                key = (int(rec.extra["step"]), int(rec.extra["microbatch"]))
            except (KeyError, TypeError, ValueError):
                raise RoutingReplayError(f"record without extra step/microbatch tags: {rec.extra}") from None
            items[key] = rec
        source = items
    for key, rec in source.items():
        try:
            rec.validate()
        except RoutingRecordError as exc:
            raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: {exc}") from None
    clear()
    _replay.update(source)


def clear() -> None:
    """Forget the records to replay and what was sliced, staged and used of them."""
    _replay.clear(); _sliced.clear(); _staged.clear(); _used.clear(); _requests.clear(); _armed.clear()


# ---------------------------------------------------------------- records by request id


def _all_requests(source) -> bool:
    values = list(source.values() if isinstance(source, dict) else source) if source is not None else []
    return bool(values) and all(isinstance(r, RoutingRecord) and r.token_order == "requests" for r in values)


def _is_request_folder(dir) -> bool:
    """A folder SGLang's capture wrote (``rank<R>/<rid>.safetensors``), not Megatron's (index.json)."""
    from pathlib import Path

    root, rank = Path(dir), ranks.global_rank()
    if any((folder / "index.json").is_file() for folder in (root / f"rank-{rank}", root / "rank-0", root)):
        return False
    return root.is_dir() and next(root.rglob("*.safetensors"), None) is not None


def set_requests(source, *, layer_offset: int = 1, missing_tail: int = 1, filler: str = "spread") -> None:
    """Request records to align to each micro-batch ``source_patch.batch`` names: a folder
    (SGLang's ``rank<R>/<rid>.safetensors``, merged over ranks), a list of records, or
    ``{rid: record}``.  ``layer_offset``: added to their layer ids (SGLang's 0-based
    ``layer_id`` -> Megatron's ``layer_number``); ``missing_tail``: tokens a record may lack
    at its end (SGLang never forwards the last sampled token); ``filler``: padding's experts
    (routing/align.py).  Records for (step, microbatch) keys stay as they are."""
    if isinstance(source, (str, os.PathLike)):
        from ..sglang.files import merge_rank_files

        try:
            source = merge_rank_files(source)
        except RoutingRecordError as exc:
            raise RoutingReplayError(f"routing replay: request records in {source}: {exc}") from None
    records = list(source.values() if isinstance(source, dict) else source)
    table = {}
    for rec in records:
        if not isinstance(rec, RoutingRecord) or rec.token_order != "requests" or not rec.sample_ids:
            raise RoutingReplayError(f"a request record must be a RoutingRecord of token_order 'requests' with its "
                                     f"sample_ids, got {rec!r:.120}")
        for rid in rec.sample_ids:
            table[rid] = rec
    _requests.clear()
    _requests.update(table)
    _align.update(layer_offset=layer_offset, missing_tail=missing_tail, filler=filler)
    for key in list(_armed):
        _forget(key)


def has_requests() -> bool:
    return bool(_requests)


def _forget(key) -> None:
    _armed.pop(key, None)
    _replay.pop(key, None); _sliced.pop(key, None); _staged.pop(key, None); _used.pop(key, None)


def arm(key, rows, seq_parallel: bool) -> None:
    """(step, microbatch) ``key`` replays the request records of ``rows`` (a core/rows.py
    Rows) as laid out there: aligned once per Rows, this rank's part of it (its CP and SP
    slice, as ``rows`` computed it) installed as the key's record."""
    sp = bool(rows.sequence_parallel if rows.sequence_parallel is not None else seq_parallel)
    if _armed.get(key) == (rows.version, sp):
        return
    from ..align import BatchLayout, RoutingAlignError, align_to_megatron

    missing = [rid for rid in rows.request_ids if rid not in _requests]
    if missing:
        have = sorted(map(str, _requests))
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: no routing record for request(s) "
                                 f"{missing[:8]} (records for {have[:8]}{'...' if len(have) > 8 else ''})")
    try:
        layout = BatchLayout(rows.seq_len, tuple(tuple(row) for row in rows.by_row()))
        full = align_to_megatron(list({id(r): r for r in (_requests[rid] for rid in rows.request_ids)}.values()),
                                 layout, layer_offset=_align["layer_offset"], missing_tail=_align["missing_tail"],
                                 filler=_align["filler"])
        view = rows.view(sp)
        index = view["local_index"]
        local = full.replace(
            indices={k: full.indices[k][index] for k in full.layers},
            probs=None if full.probs is None else {k: full.probs[k][index] for k in full.layers},
            seq_lens=[int(view["seq_positions"].numel())] * rows.batch, padding=None,
            parallel={"cp": rows.cp_size, "sp": sp, "tp": rows.tp_size, "ep": 1, "cp_rank": rows.cp_rank,
                      "tp_rank": rows.tp_rank},
            extra={**full.extra, "step": key[0], "microbatch": key[1]})
    except (RoutingAlignError, RoutingRecordError, ValueError) as exc:
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: the request records do not fit the "
                                 f"micro-batch {rows!r}: {exc}") from None
    _forget(key)
    _replay[key] = _sliced[key] = local
    _armed[key] = (rows.version, sp)


def keys() -> list:
    """The (step, microbatch) keys of the records to replay, sorted."""
    return sorted(_replay)


def check_microbatch(key) -> None:
    """At a microbatch's end: every layer of its record was routed, none left over."""
    if key not in _used:
        return
    rec = _replay.get(key)
    if rec is not None and _used[key] != set(rec.layers):
        missing = sorted(set(rec.layers) - _used[key])
        raise RoutingReplayError(
            f"step {key[0]}, microbatch {key[1]}: the record has layers {rec.layers} but the model "
            f"routed through {sorted(_used[key])} (layer count mismatch; never used: {missing})")


def step_done(finished: int) -> None:
    """A step finished: its slices and staged tensors are not read again."""
    for key in [k for k in _armed if k[0] <= finished]:
        _forget(key)  # aligned for a micro-batch of that step: named again, aligned again
    for key in [k for k in _sliced if k[0] <= finished]:
        _sliced.pop(key, None)
        _staged.pop(key, None)


def _for_rank(key, shape, seq_parallel: bool) -> RoutingRecord:
    rec = _sliced.get(key)
    if rec is not None:
        return rec
    rec = _replay.get(key)
    if rec is None:
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: no routing record to replay "
                                 f"(records for {sorted(_replay)[:8]}{'...' if len(_replay) > 8 else ''})")
    cp, cp_rank, tp, tp_rank = ranks.cp_tp()
    if rec.parallel is None and shape is not None:
        try:
            rec = slice_for_rank(rec, batch=shape[1], cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                                 sequence_parallel=seq_parallel)
        except RoutingRecordError as exc:
            raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: cannot slice the record for this rank "
                                     f"(cp {cp_rank}/{cp}, tp {tp_rank}/{tp}): {exc}") from None
    elif rec.parallel is not None:
        p = rec.parallel
        want_tp = tp_rank if (p["sp"] and p["tp"] > 1) else p["tp_rank"]
        if (p["cp"], p["cp_rank"]) != (cp, cp_rank) or p["tp_rank"] != want_tp:
            raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: record is a slice for {p}, this rank is "
                                     f"cp {cp_rank}/{cp}, tp {tp_rank}/{tp}")
    _sliced[key] = rec
    return rec


def _on_device(key, rec: RoutingRecord, device: torch.device) -> dict:
    """All layers of a microbatch's record on the device, copied once from pinned memory:
    a copy from pageable memory would block the host at every layer."""
    staged = _staged.get(key)
    if staged is None or staged[0] != device:
        pin = device.type == "cuda"
        staged = _staged[key] = (device, {
            layer: (t.to(torch.int64).pin_memory() if pin else t.to(torch.int64)).to(device, non_blocking=True)
            for layer, t in rec.indices.items()})
    return staged[1]


def ids(key, layer, live_tokens: int, live_experts: int, live_topk: int, device, shape, seq_parallel: bool):
    """The recorded ids of (step, microbatch) ``key``, ``layer`` on ``device``, checked
    against the router's token count, top-k and expert count; ``shape`` / ``seq_parallel``:
    the router's ``[seq, batch]`` and sequence-parallel flag (to slice a full record)."""
    global _last_replay
    rec = _for_rank(key, shape, seq_parallel)
    where = f"step {key[0]}, microbatch {key[1]}, layer {layer}"
    if layer not in rec.indices:
        raise RoutingReplayError(f"{where}: the record has no layer {layer} (it has {rec.layers}; "
                                 "layer mismatch)")
    if rec.num_tokens != live_tokens:
        raise RoutingReplayError(f"{where}: the record has {rec.num_tokens} rows, the router has {live_tokens} "
                                 "tokens (row-count mismatch)")
    if rec.topk != live_topk:
        raise RoutingReplayError(f"{where}: the record has topk {rec.topk}, the router {live_topk}")
    idx = rec.indices[layer]
    if rec.num_experts > live_experts:
        bad = idx >= live_experts
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0, 0])
            raise RoutingReplayError(f"{where}, row {row}: expert id out of range [0, {live_experts}) "
                                     f"(row {idx[row].tolist()})")
    idx = _on_device(key, rec, device)[layer]
    _used.setdefault(key, set()).add(layer)
    _last_replay = (key, layer, idx)
    return idx


def probs(routing_probs, layer, where, shape, seq_parallel: bool):
    """``routing_probs`` [tokens, experts] rebuilt from the record: its weights at its ids.
    ``where()``: the call's position, for the errors."""
    if routing_probs.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RoutingReplayError(f"replay_probs under CUDA graph capture is not supported: the graph would keep the "
                                 f"capture's weights ({where()}); replay ids only")
    if _last_replay is None or _last_replay[1] != layer:
        raise RoutingReplayError(f"replay_probs: no replayed top-k for this router call ({where()})")
    key, layer, idx = _last_replay
    rec = _for_rank(key, shape, seq_parallel)
    if rec.probs is None or layer not in rec.probs:
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}, layer {layer}: replay_probs is on but "
                                 "the record has no combine weights (capture them: SGLang records them; "
                                 "Megatron with probs: true)")
    weights = rec.probs[layer].to(routing_probs.device, routing_probs.dtype)
    return torch.zeros_like(routing_probs).scatter(1, idx, weights)
