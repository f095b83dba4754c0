"""SGLang routing capture and replay (issue 4, SGLang side).

Two call sites (``patches/routing.yaml``) reach this module through ``__sp__``:

* ``ModelRunner._forward_raw`` (entry): :func:`routing_sglang_batch` reads the
  ``ForwardBatch`` and makes it the *ambient batch*: which request each row of the
  flat token batch belongs to, and at which position of that request it is
  (``rids``; extend: ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu``; decode: one
  token per request at ``seq_lens_cpu - 1``).
* ``select_experts`` (just before ``_post_process_topk_ids``, where SGLang's own
  ``apply_routing_simulation`` rewrites ``topk_ids``): :func:`routing_sglang_topk`
  sees the *logical* expert ids (before the EPLB logical-to-physical remap) and
  captures them per layer, or overrides them in place from a replay record and
  recomputes the weights.

Capture is keyed by KV slot, as SGLang's own capturer is (:mod:`.slot_store`): each
forward's rows go to the slots of ``forward_batch.out_cache_loc``; a finished request's
rows are read back through its ``req_to_token`` row, so a prompt prefix served from
the radix cache (or recomputed after a retraction, or prefilled in chunks) reads the
rows its first computation wrote: every record covers positions ``[0, prompt +
generated - 1)``, as ``meta_info["routed_experts"]`` does.  Without KV slots (rows
attributed in process with :func:`set_batch`) each request gets private slots and its
record starts where its first row did (``extra["start_pos"]``).

Records use :mod:`source_patch.runtime.routing.record`: one ``RoutingRecord`` per
request (``token_order="requests"``, ``sample_ids=[rid]``, ``source="sglang"``,
``extra={"rank", "start_pos"}``), written to ``<dir>/rank<R>/<rid>.safetensors`` when
the request finishes (:func:`routing_sglang_release`, at ``release_kv_cache``) and by
:func:`flush` (at exit: what is left); :func:`merge_rank_files` merges a directory of
rank folders by request.

Settings: the ``sglang_routing`` component (docs/settings.md), read on first use:
``SOURCE_PATCH_SGLANG_ROUTING_MODE`` / ``_DIR`` / ``_REPLAY`` over a spec's
``runtime: sglang_routing:`` over the defaults (off; no dir; no replay source).

Replay weights: ``scores = f(router_logits.float())`` with ``f`` the config's
``scoring_func`` (softmax / sigmoid / sqrtsoftplus), ``w = scores.gather(1, ids)``;
with ``renormalize`` ``w / (w.sum(-1) + 1e-20)`` as SGLang's torch-native top-k does;
then times ``routed_scaling_factor`` when ``apply_routed_scaling_factor_on_output``
is set. Any ``correction_bias`` only changes *which* experts are chosen, never the
weights (as in SGLang's biased top-k), so it plays no part. Only the routed columns
(the first ``top_k - num_shared_topk_slots``) are captured or replaced; fused shared
expert columns keep what the router gave them.

Over 500 lines on purpose: capture, replay and the per-request records share the
ambient batch and its row bookkeeping, which must be read together.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
import warnings
from pathlib import Path

import torch

from ..core import graph_stage, settings, sglang_graphs
from ..core.sglang_batch import DRAFT, BatchRows, Unattributed, batch_rows, is_probe
from .record_file import RoutingRecordError
from .record_type import RoutingRecord, load
from .slot_store import SlotStore

SETTINGS = "sglang_routing"  # its settings component (the capability contract: core/capability.py)
_RENORM_EPS = 1e-20  # sglang.srt.layers.moe.topk._RENORMALIZE_SUM_EPSILON


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.config = None  # None: read the settings on first use
        self.mode = None
        self.dir = None
        self.last_error = None
        self.written = 0  # records written by capture
        self.rank = None
        self.batch = None  # (rids, lens, starts) of the current forward
        self.batch_slots = None  # (space, slots): the KV slot of each row of that forward
        self.skip = False  # the current forward is a draft model's or cannot be attributed: not routed here
        self.forward_id = -1
        self.current = None  # {"id", "layers": {layer: (ids, weights)}} the forward being captured
        self.stores = {"kv": SlotStore(), "virtual": SlotStore()}  # engine slots / private ones
        self.live = {}  # rid -> {"space", "start", "end", "gap", "vslots", "pool", "idx", "reach"}
        self.next_virtual = 0
        self.num_experts = None
        self.replay = None  # {rid: RoutingRecord}
        self.graph_ids = self.graph_experts = None  # a drained graph's ids of a layer, awaiting its weights
        self.warned = set()


_S = _State()


def _warn_once(key, message):
    if key not in _S.warned:
        _S.warned.add(key)
        warnings.warn(f"source-patch sglang routing: {message}", RuntimeWarning, stacklevel=3)


def configure(**changes) -> dict:
    """Change settings (keys of the ``sglang_routing`` schema: ``mode``, ``dir``,
    ``replay``) and apply them; returns the effective settings.  Two more inputs:
    ``replay`` may also be a RoutingRecord or a ``{rid: record}`` mapping, and ``rank``
    names the rank folder capture writes to (default: the process's rank)."""
    rank = changes.pop("rank", _S.rank)
    objects = changes.pop("replay") if not isinstance(changes.get("replay", ""), (str, os.PathLike)) else None
    parsed = settings.check_all(SETTINGS, {key: os.fspath(v) if isinstance(v, os.PathLike) else v
                                           for key, v in changes.items()})
    config = {**(_S.config or settings.resolve(SETTINGS)), **parsed}
    src = None
    if config["mode"] == "replay":  # read before any state is set: a bad source fails every call alike
        src = _replay_source(objects if objects is not None else config["replay"])
    _S.mode, _S.replay, _S.rank, _S.config = config["mode"], src, rank, config
    _S.dir = config["dir"] or None
    graph_stage.use(SETTINGS, _unstaged, on=_S.mode != "off")  # SGLang's decode graphs stage / feed for us
    return dict(config)


def configure_from_settings() -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    _S.config = None
    return configure()


def _replay_source(src) -> dict:
    if isinstance(src, RoutingRecord):
        return {src.sample_ids[0] if src.sample_ids and len(src.sample_ids) == 1 else None: src}
    if isinstance(src, dict):
        return src
    if not src:
        raise ValueError("replay mode needs a record (SOURCE_PATCH_SGLANG_ROUTING_REPLAY)")
    p = Path(src)
    if p.is_dir() and not any(p.rglob("*.safetensors")):
        # as for a request without a record: the router's own routes, said once
        _warn_once("emptydir", f"replay: no routing files under {p}: every request keeps the router's own routes")
        return {}
    return merge_rank_files(p) if p.is_dir() else _by_request([load(p)])


def enabled() -> bool:
    return _mode() != "off"


def state() -> dict:
    with _S.lock:
        rows = sum(e["end"] - e["start"] for e in _S.live.values())
        requests = len(_S.live)
        kv = _S.stores["kv"]
    # Settings not read yet stay unread: the first call site reads them (state() must not).
    return {"enabled": _S.mode not in (None, "off"), "config": dict(_S.config or {}), "last_error": _S.last_error,
            "counters": {"requests_held": requests, "rows_held": rows, "records_written": _S.written,
                         "replay_records": len(_S.replay or {}), "warnings": len(_S.warned),
                         "slot_store_slots": kv.capacity, "slot_store_bytes": kv.nbytes()}}


def reset() -> dict:
    """Forget everything (settings, ambient batch, captured rows, replay source); returns
    state(), whose settings are read again on first use."""
    with _S.lock:
        _S.reset()
    graph_stage.use(SETTINGS, on=False)  # until the settings are read again
    return state()


def close(timeout: float | None = None) -> bool:
    """Write what is still held (capture with a dir); True when that succeeded.
    Registered with atexit."""
    if _S.mode == "capture" and _S.dir and _S.live:
        try:
            flush()
        except Exception as exc:  # never fail interpreter exit
            _S.last_error = f"flush: {type(exc).__name__}: {exc}"
            warnings.warn(f"source-patch sglang routing: flush at exit failed: {exc}", RuntimeWarning)
            return False
    return True


def _mode():
    if _S.mode is None:
        configure()
    return _S.mode


def _rank():
    if _S.rank is not None:
        return _S.rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------- the ambient batch


def set_batch(rids, lens, starts=None, *, slots=None, pool=None, pool_indices=None, verify=False) -> None:
    """Make ``rids`` / ``lens`` (tokens of each request in this forward, in row
    order) / ``starts`` (position of each request's first row in that request;
    default: right after what was captured for it so far) the ambient batch.

    Capture only: ``slots`` (one KV slot per row, ``out_cache_loc``), ``pool``
    (``req_to_token``) and ``pool_indices`` (each request's row of it) key the rows by
    KV slot; without ``slots`` each request gets private slots.  ``verify``: the rows
    are a speculative verify pass's draft tokens (``slots`` required); only the accepted
    ones stay in ``req_to_token``, so a request's settled length does not move."""
    rids, lens = list(rids), [int(n) for n in lens]
    if len(rids) != len(lens):
        raise ValueError(f"{len(rids)} request ids for {len(lens)} lengths")
    if starts is None:
        starts = [_S.live[r]["end"] if r in _S.live else 0 for r in rids]
    starts = [int(s) for s in starts]
    _S.batch, _S.batch_slots, _S.skip = (rids, lens, starts), None, False
    _S.forward_id += 1
    if _S.mode != "capture":
        return
    space = "kv" if slots is not None else "virtual"
    if slots is None:
        slots = torch.arange(_S.next_virtual, _S.next_virtual + sum(lens))
        _S.next_virtual += sum(lens)
    _S.batch_slots = (space, slots)
    with _S.lock:
        _track(rids, lens, starts, space, slots, pool, pool_indices, verify)
        # forwards older than the previous one are done even under the overlap schedule:
        # to the host now, so at most two forwards stay on the device
        _S.stores[space].settle(keep=lambda tag: tag[0] >= _S.forward_id - 1)


def _track(rids, lens, starts, space, slots, pool, pool_indices, verify=False) -> None:
    """Where each request of this forward has got to (and, in private slots, which
    slot each of its positions has); a verify pass only says how far it may reach."""
    off = 0
    for i, (rid, n, start) in enumerate(zip(rids, lens, starts)):
        e = _S.live.get(rid)
        if e is None or e["space"] != space:
            e = _S.live[rid] = {"space": space, "start": start if space == "virtual" else 0, "end": start,
                                "gap": None, "vslots": [], "pool": None, "idx": None, "reach": 0}
        if space == "virtual":
            if start != e["end"] and e["gap"] is None:
                e["gap"] = f"rows resume at position {start}, expected {e['end']} (retracted or re-prefilled request?)"
            e["vslots"].append(slots[off:off + n])
        else:
            e["pool"], e["idx"] = pool, (pool_indices[i] if pool_indices is not None else None)
        if verify:
            e["reach"] = max(e["reach"], start + n)
        else:
            e["end"] = start + n
        off += n


def clear_batch(skip: bool = False) -> None:
    """No ambient batch; ``skip``: the forward is a draft model's (SGLang opts its
    routers out of its own capture too) or one whose rows cannot be attributed, so its
    routers are neither captured nor replayed."""
    _S.batch = _S.batch_slots = None
    _S.skip = skip


def _kv_slots(forward_batch, runner):
    """(out_cache_loc, req_to_token, [req_pool_idx]) of an engine forward; SGLang's own
    capturer prefers ``out_cache_loc_virtual`` (the ids ``req_to_token`` holds)."""
    slots = getattr(forward_batch, "out_cache_loc_virtual", None)
    if slots is None:
        slots = getattr(forward_batch, "out_cache_loc", None)
    pool = getattr(getattr(runner, "req_to_token_pool", None), "req_to_token", None)
    idx = getattr(forward_batch, "req_pool_indices_cpu", None)
    if idx is None:
        idx = getattr(forward_batch, "req_pool_indices", None)
    return slots, pool, None if idx is None else [int(i) for i in idx.tolist()]


def routing_sglang_batch(forward_batch, runner=None) -> None:
    """Call site at ``ModelRunner._forward_raw`` entry (``runner``: that ModelRunner):
    the ambient batch from an SGLang ``ForwardBatch``. Does nothing when the mode is off."""
    if _mode() == "off":
        return
    capture = _S.mode == "capture"
    rows = batch_rows(forward_batch, runner, verify=capture)  # a verify pass: rows keyed by KV slot
    if isinstance(rows, Unattributed):
        _warn_once(rows.key, rows.reason)
    if not isinstance(rows, BatchRows):
        clear_batch(skip=rows is DRAFT or isinstance(rows, Unattributed))
        return
    if not capture:
        set_batch(rows.rids, rows.lens, rows.starts)
        return
    slots, pool, idx = _kv_slots(forward_batch, runner)
    if slots is None and rows.mode == "verify":
        _warn_once("verify-slots", "a verify pass without KV slots is not attributed; its rows are skipped")
        clear_batch(skip=True)
        return
    if slots is not None:
        slots = slots[:sum(rows.lens)]
    set_batch(rows.rids, rows.lens, rows.starts, slots=slots, pool=pool, pool_indices=idx,
              verify=rows.mode == "verify")


# ---------------------------------------------------------------- select_experts


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = logits.float()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise RoutingRecordError(f"cannot recompute weights for scoring function {scoring_func!r}")


def replay_weights(router_logits: torch.Tensor, ids: torch.Tensor, topk_config) -> torch.Tensor:
    """The weights SGLang's top-k gives experts ``ids`` (``[tokens, k]``) of these
    logits under ``topk_config`` (see the module docstring)."""
    w = _scores(router_logits, topk_config.scoring_func).gather(1, ids.long())
    if topk_config.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True, dtype=torch.float32) + _RENORM_EPS)
    if topk_config.apply_routed_scaling_factor_on_output and topk_config.routed_scaling_factor is not None:
        w = w * topk_config.routed_scaling_factor
    return w


def check_ids(ids: torch.Tensor, *, rows: int, topk: int, num_experts: int, what: str = "replay ids") -> None:
    """Clear errors for a wrong row count, out-of-range or duplicate expert ids."""
    if ids.dim() != 2 or ids.shape[1] != topk:
        raise RoutingRecordError(f"{what}: shape {list(ids.shape)}, expected [{rows}, {topk}]")
    if ids.shape[0] != rows:
        raise RoutingRecordError(f"{what}: {ids.shape[0]} rows for {rows} tokens of this batch")
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        r = int(bad.any(1).nonzero()[0])
        raise RoutingRecordError(f"{what}: row {r}: expert id out of range [0, {num_experts}) "
                                 f"(row {ids[r].tolist()})")
    s = ids.sort(1).values
    dup = (s[:, 1:] == s[:, :-1]).any(1)
    if bool(dup.any()):
        r = int(dup.nonzero()[0])
        raise RoutingRecordError(f"{what}: row {r}: an expert is chosen twice (row {ids[r].tolist()})")


def _replay_rows(layer: int, live: torch.Tensor) -> torch.Tensor | None:
    """The ids to route the ambient batch's rows with: each request's recorded rows;
    a request without a record (SGLang's own health checks, a request nobody
    captured) or rows past its record's end keep the router's choice (``live``),
    with a warning: a serving engine must not die for a missing route."""
    if _S.batch is None:
        if len(_S.replay) == 1:  # one record, no attribution: the batch is that record
            (rec,) = _S.replay.values()
            if layer not in rec.indices:
                raise RoutingRecordError(f"replay record has no layer {layer} (it has {rec.layers})")
            return rec.indices[layer].to(live.device)
        _warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): replay skipped")
        return None
    rids, lens, starts = _S.batch
    parts, row = [], 0
    for rid, n, start in zip(rids, lens, starts):
        rec = _S.replay.get(rid)
        recorded = _recorded(rec, rid, layer, start, n)
        parts.append(live[row:row + n] if recorded is None else recorded.to(live.device))
        row += n
    return torch.cat(parts) if parts else live[:0]


def _recorded(rec, rid, layer: int, start: int, n: int) -> torch.Tensor | None:
    """Rows [start, start + n) of ``rid``'s record at ``layer``, or None (warned)."""
    if rec is None:
        if not is_probe(rid):
            _warn_once(("norecord", len(_S.warned) // 64), f"replay: no record for request {rid!r} "
                       "(it keeps the router's own routes; later ones are not reported)")
        return None
    if layer not in rec.indices:
        raise RoutingRecordError(f"replay: request {rid!r} has no layer {layer} (it has {rec.layers})")
    off = start - int((rec.extra or {}).get("start_pos", 0))
    if off < 0 or off + n > rec.num_tokens:
        _warn_once(("short", rid), f"replay: request {rid!r} needs rows [{off}, {off + n}) of layer {layer}, "
                   f"its record has {rec.num_tokens}: those rows keep the router's own routes")
        return None
    return rec.indices[layer][off:off + n]


def routing_sglang_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor, router_logits: torch.Tensor,
                        topk_config, layer_id, num_routed_topk: int) -> None:
    """Call site before ``_post_process_topk_ids`` in ``select_experts``: capture the
    logical ids of the routed columns, or overwrite them (and their weights) in
    place from the replay record. Rows past the ambient batch's tokens (padding)
    are left alone."""
    mode = _mode()
    if mode == "off" or layer_id is None or not getattr(topk_config, "allow_routed_experts_capture", True):
        return
    if graph_stage.busy and _in_graph(topk_ids, topk_weights, router_logits, topk_config, int(layer_id),
                                      num_routed_topk, mode):
        return
    if _S.skip:
        return
    routed = topk_ids[:, :num_routed_topk]
    if mode == "capture":
        _capture(int(layer_id), routed, topk_weights[:, :num_routed_topk], router_logits.shape[-1])
        return
    rows = _rows(routed.shape[0])
    if rows is None:
        return
    ids = _replay_rows(int(layer_id), routed[:rows])
    if ids is None:
        return
    check_ids(ids, rows=rows, topk=num_routed_topk, num_experts=router_logits.shape[-1],
              what=f"layer {layer_id} replay ids")
    routed[:rows] = ids.to(routed.dtype)
    w = replay_weights(router_logits[:rows], ids, topk_config)
    topk_weights[:rows, :num_routed_topk] = w.to(topk_weights.dtype)


def _rows(total: int) -> int | None:
    """How many of the router's ``total`` rows are the ambient batch's tokens (the rest:
    padding); None (warned) when the batch has more than the router sees."""
    if _S.batch is None:
        return total
    rows = sum(_S.batch[1])
    if rows > total:
        _warn_once(("rows", rows, total), f"ambient batch has {rows} tokens but the router sees {total} "
                   "(attention-DP / sequence-sharded MoE input is not attributed): skipped")
        return None
    return rows


def _capture(layer: int, routed: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
    """Hold this forward's rows of ``layer`` (still on the device; scattered into the slot
    store by KV slot when read)."""
    rows = _rows(routed.shape[0])
    if rows is None:
        return
    if _S.batch_slots is None:
        _warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): capture skipped")
        return
    with _S.lock:
        if _S.current is None or _S.current["id"] != _S.forward_id:
            _S.current = {"id": _S.forward_id, "layers": {}}
            space, slots = _S.batch_slots
            _S.stores[space].pending(slots, _S.current["layers"], (_S.forward_id, _S.batch))  # scattered when read
        _S.current["layers"][layer] = (routed[:rows].detach().clone(), weights[:rows].detach().clone())
        _S.num_experts = num_experts


# ---------------------------------------------------------------- under SGLang's decode CUDA graphs


def _in_graph(topk_ids, topk_weights, router_logits, topk_config, layer: int, k: int, mode: str) -> bool:
    """(a graph is being built: core/sglang_graphs.py) True when this call must do
    nothing more now: a warm-up pass; or the capture, where capture stages the routed
    columns in the graph (:func:`_drained` after each replay) and replay routes by ids
    fed before each replay (:func:`_fill`): recorded rows replaced, the others (no
    record, padding) keep the router's choice, as in an eager forward."""
    routed, weights = topk_ids[:, :k], topk_weights[:, :k]
    if graph_stage.warming_up():
        if mode == "replay":  # the buffer the capture feeds, allocated now: outside the graph's pool
            graph_stage.reserve(layer, routed.new_empty((routed.shape[0], k + 1)))
        return True
    if not graph_stage.capturing():
        return False
    if mode == "capture":
        graph_stage.stage(_drained, (layer, "ids"), routed, experts=int(router_logits.shape[-1]))
        graph_stage.stage(_drained, (layer, "weights"), weights)
        return True
    # one static buffer the graph reads: k recorded ids and a keep flag per row
    fed = graph_stage.feed(_fill, layer, routed.new_empty((routed.shape[0], k + 1)),
                           experts=int(router_logits.shape[-1]))
    ids, keep = fed[:, :k], fed[:, k:] != 0
    w = replay_weights(router_logits, ids, topk_config)
    routed.copy_(torch.where(keep, ids, routed))
    weights.copy_(torch.where(keep, w.to(weights.dtype), weights))
    return True


def _drained(key, tensor, *, cuda_graph, replay, experts=None, **_) -> None:
    """A replayed decode graph's staged rows (the real tokens' only): captured as the
    eager call of this layer would have been (ids first, then their weights)."""
    layer, part = key
    if part == "ids":
        _S.graph_ids, _S.graph_experts = tensor, experts
        return
    ids, _S.graph_ids = _S.graph_ids, None
    if _S.mode == "capture" and not _S.skip and ids is not None:
        _capture(layer, ids, tensor, _S.graph_experts)


def _fill(layer, buffer, *, experts, **_) -> None:
    """Before a decode graph's replay: each recorded row's ids and a keep flag into the
    buffer its router reads (validated here, on the host); other rows keep theirs."""
    k = buffer.shape[1] - 1
    plan = torch.zeros(buffer.shape, dtype=buffer.dtype)
    rows = _rows(buffer.shape[0]) if not _S.skip and _S.mode == "replay" else None
    if rows is not None and _S.batch is None:
        _warn_once("nobatch-graph", "no ambient batch under a CUDA graph replay: its rows keep the router's routes")
    elif rows is not None:
        row = 0
        for rid, n, start in zip(*_S.batch):
            recorded = _recorded(_S.replay.get(rid), rid, layer, start, n)
            if recorded is not None:
                check_ids(recorded, rows=n, topk=k, num_experts=experts, what=f"layer {layer} replay ids")
                plan[row:row + n, :k], plan[row:row + n, k] = recorded, 1
            row += n
    buffer.copy_(plan)


def routing_sglang_graph_build(runner, key) -> None:
    """Before a decode graph's capture (``capture_one_shape``): the settings are read now
    (SGLang captures before its first forward), so with routing on the graph gets a
    stage (core/sglang_graphs.py)."""
    _mode()
    sglang_graphs.sglang_graph_build(runner, key)


def _unstaged(name, what) -> None:
    """A decode graph captured while routing was off is replayed: its routers are not in it."""
    _warn_once(("unstaged", what), f"{what}: its CUDA graph was captured while routing was off, so its "
               f"replays are not {'captured' if _S.mode == 'capture' else 'replayed'} (set the routing mode "
               "before the engine starts)")


# ---------------------------------------------------------------- records and files


def records(only=None) -> dict:
    """What was captured so far: ``{rid: RoutingRecord}`` (one per request, rows in
    generation order: prefill tokens then each decode token); ``only``: that request."""
    with _S.lock:
        live = [(rid, e) for rid, e in _S.live.items() if only is None or rid == only]
    out = {}
    for rid, e in live:
        rec = _record(rid, e, e["end"], e["pool"], e["idx"])
        if rec is not None:
            out[rid] = rec
    return out


def _record(rid, e, end, pool, idx, *, lazy: bool = False) -> RoutingRecord | None:
    """Rows ``[start, end)`` of ``rid`` read from the slot store (KV slots through
    ``pool[idx]``); None when nothing was captured.  ``lazy``: leave the latest forward
    on its device unless it holds rows of ``rid`` before ``end`` (a finished request's
    rows are all in earlier forwards under SGLang's overlap schedule, which has launched
    the next batch already: waiting for it would stall the overlap)."""
    if e["gap"]:
        raise RoutingRecordError(f"request {rid!r}: {e['gap']}")
    store = _S.stores[e["space"]]
    latest = _S.forward_id

    def keep(tag):
        fid, (rids, _, starts) = tag
        return fid == latest and not any(r == rid and s < end for r, s in zip(rids, starts))

    with _S.lock:
        store.settle(keep if lazy else None)
        if not store.ids or end <= e["start"]:
            return None
        if e["space"] == "virtual":
            slots = torch.cat(e["vslots"])[:end - e["start"]]
        elif pool is None or idx is None:
            raise RoutingRecordError(f"request {rid!r}: its KV slots are unknown (the ModelRunner._forward_raw "
                                     "call site passes no runner: an older cached spec?)")
        else:
            slots = pool[idx, :end]
        try:
            layers, probs = store.read(slots, f"request {rid!r}")
        except LookupError as exc:
            raise RoutingRecordError(str(exc)) from None
    return RoutingRecord(indices=layers, probs=probs, num_experts=_S.num_experts, token_order="requests",
                         sample_ids=[rid], seq_lens=[end - e["start"]], source="sglang",
                         extra={"rank": _rank(), "start_pos": e["start"]})


def wait_record(dir, rid, *, rank: int = 0, timeout: float = 20.0) -> RoutingRecord:
    """The record capture writes for request ``rid`` under ``dir`` (in the scheduler
    process, when the request releases its KV cache: shortly after its response), once
    it is there; FileNotFoundError naming the file after ``timeout`` seconds."""
    path = Path(dir) / f"rank{rank}" / f"{_safe_name(rid)}.safetensors"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no routing record of request {rid!r} at {path} after {timeout:.0f} s")
        time.sleep(0.05)
    return load(path)


def _safe_name(rid) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(rid))[:128] or "_"


def flush(dir=None, *, clear: bool = True) -> list:
    """Write each captured request to ``<dir>/rank<R>/<rid>.safetensors``; returns the paths."""
    dir = dir if dir is not None else _S.dir
    if dir is None:
        raise ValueError("no directory to write to (SOURCE_PATCH_SGLANG_ROUTING_DIR)")
    recs = records()
    folder = Path(dir) / f"rank{_rank()}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rid, rec in recs.items():
        path = folder / f"{_safe_name(rid)}.safetensors"
        rec.save(path)
        paths.append(path)
        _S.written += 1
    if clear:
        with _S.lock:
            _S.live = {}
            _S.stores["virtual"], _S.next_virtual = SlotStore(), 0  # engine slots stay: the radix cache keeps them
    return paths


def routing_sglang_release(req, tree_cache=None) -> None:
    """Call site at ``release_kv_cache`` entry: a finished request's record is written
    now (a scheduler is killed at shutdown, so waiting for exit would lose it), read
    through its ``req_to_token`` row (``tree_cache.req_to_token_pool``) over
    ``[0, prompt + output through stop - 1)``, the rows SGLang's ``routed_experts``
    returns.  A retracted request (not finished) keeps its place."""
    if _S.mode != "capture" or not _S.dir:
        return
    try:
        if not req.finished():
            return
        rid = req.rid
        e = _S.live.get(rid)
        if e is not None and not is_probe(rid):
            rec = _record(rid, e, *_finished_rows(req, e, tree_cache), lazy=True)
            if rec is not None:
                folder = Path(_S.dir) / f"rank{_rank()}"
                folder.mkdir(parents=True, exist_ok=True)
                rec.save(folder / f"{_safe_name(rid)}.safetensors")
                _S.written += 1
        _drop(rid)
    except Exception as exc:  # noqa: BLE001 - capture must never break serving
        _S.last_error = f"release: {type(exc).__name__}: {exc}"
        _warn_once(("release", type(exc).__name__), f"writing a finished request's routes failed: {exc}")


def _finished_rows(req, e, tree_cache) -> tuple:
    """(end, req_to_token, row) of a finished request: SGLang's own count of routed
    tokens; capture that stopped short of it is an error, not a short record."""
    if e["space"] != "kv":
        return e["end"], e["pool"], e["idx"]
    end = len(req.origin_input_ids) + len(req.output_ids_through_stop) - 1
    if max(e["end"], e["reach"]) < end:
        raise RoutingRecordError(f"request {req.rid!r}: routes captured up to position {e['end']}, "
                                 f"it has {end} routed tokens")
    pool = getattr(getattr(tree_cache, "req_to_token_pool", None), "req_to_token", None)
    return end, pool if pool is not None else e["pool"], req.kv.req_pool_idx


def _drop(rid) -> None:
    """Forget ``rid``'s place (its slots' rows stay: the radix cache may serve them again)."""
    with _S.lock:
        _S.live.pop(rid, None)


def _by_request(recs, rank_of=None) -> dict:
    out, owner = {}, {}
    for rec in recs:
        if rec.sample_ids is None or len(rec.sample_ids) != 1:
            raise RoutingRecordError(f"an SGLang routing file holds one request, this one has sample_ids "
                                     f"{rec.sample_ids}")
        rid = rec.sample_ids[0]
        rank = (rec.extra or {}).get("rank", 0)
        if type(rank) is not int:  # metadata a file brought: compared below
            raise RoutingRecordError(f"request {rid!r}: its record's rank is {str(rank)[:40]!r}, not an integer")
        if rid in out:
            other = out[rid]
            if not other.equals(rec.replace(extra=other.extra)):
                raise RoutingRecordError(f"request {rid!r}: ranks {owner[rid]} and {rank} captured different "
                                         "routes (TP ranks should see the same tokens)")
            if rank >= owner[rid]:
                continue
        out[rid], owner[rid] = rec, rank
    return out


def merge_rank_files(dir) -> dict:
    """``{rid: RoutingRecord}`` from every ``*.safetensors`` under ``dir`` (the
    ``rank<R>`` folders :func:`flush` writes). A request seen by several ranks (TP
    replicas) must be identical on all of them; the lowest rank's record is kept."""
    files = sorted(Path(dir).rglob("*.safetensors"))
    if not files:
        raise RoutingRecordError(f"no routing files under {dir}")
    return _by_request([load(f) for f in files])


atexit.register(close)
