"""Routing capture and replay for Megatron-Core, called from patches/routing.yaml.

Call sites (``__sp__.<name>``, all cost one flag test when the mode is ``off``):

- ``routing_enter(router, logits)`` / ``routing_exit()``: ``TopKRouter.routing`` entry and
  return; sets the ambient MoE layer (``router.layer_number``), the ``[seq, batch]``
  shape and the sequence-parallel flag.
- ``routing_topk(scores, result)``: each return of ``compute_topk`` inside
  ``topk_routing_with_score_function``; ``result`` is ``(values, indices)``.  Capture
  copies the indices off the device (non-blocking D2H into pinned memory on a side
  stream + event; a clone on CPU).  Replay returns the recorded indices for
  (step, microbatch, layer) and ``scores.gather(1, indices)`` as values, so the router
  keeps its gradient.
- ``routing_probs(routing_probs)``: the final return of ``topk_routing_with_score_function``;
  with ``probs: true`` keeps the combine weights of the captured experts.
- ``routing_fused(fused)``: the fused router (``moe_router_fusion``) bypasses
  ``compute_topk``: replay raises for a router a record addresses; capture warns once.
- ``routing_schedule(forward_only)`` / ``routing_schedule_end()``: the
  forward_backward_* schedules (microbatch back to 0).
- ``routing_microbatch_begin()`` / ``routing_microbatch_end()``: schedule's forward_step
  entry / returns.
- ``routing_step(success)``: optimizer step returns; a successful step advances the step.

Watched (``core/watch.py``'s ``routes_hook``, set by the sentinels' routing health): each
router call, whatever the mode, hands the hook the router's own top-k ids, its logits
and the ids replayed in their place (ours, or Megatron-Core's ``RouterReplay``, whose
ids reach ``routing_topk`` already in place of the router's own: those are then
recomputed from the scores).  Unwatched: one ``is None`` test at ``routing_enter``,
``routing_exit`` and ``routing_topk``.

Python API (``from source_patch.runtime.routing.megatron import capture, control, files, replay``)::

    control.configure(mode="capture", dir="routes", probs=False)   # or settings component "routing"
    control.save(dir=None)       # write pending records + index.json; returns the index
    control.set_position(step=None, microbatch=None)
    capture.records()            # captured RoutingRecords, one per (step, microbatch), in order
    files.load_dir(dir)          # {(step, microbatch): RoutingRecord} from a directory
    replay.set_replay(records)   # dir, list of records (extra step/microbatch) or {(s, m): record}

On disk: ``<dir>/rank-<r>/step-<S>-mb-<M>.safetensors`` (one RoutingRecord, token_order
``megatron-sbh``, ``extra={"step", "microbatch"}``) and ``<dir>/rank-<r>/index.json``.

Capture and replay observe upstream: a call no record can address (a router without a
``layer_number``, a routing function called outside ``TopKRouter.routing``, capture
during CUDA graph capture outside a GraphStage, the fused router under capture) is
routed by upstream unchanged, with one ``RuntimeWarning`` per process and cause.
Outside any schedule each forward is its own microbatch (``_free_key``), so a bare
model's forwards are recorded one record each and replayed in the same order.

Under CUDA graphs (``core/adapters/graph_stage.py``; megatron-core's own graphs through the
spec's ``graph-build`` / ``graph-replay`` patches) capture stages the ids inside the
graph and ``_drained`` records them after each replay, tagged ``cuda_graph``; replay
returns a fed static buffer that ``_fill`` refills before each replay; the eager
warm-up passes of a graph being built are neither captured nor replayed.

This module is the control surface, the call sites and the per-step state machine
(schedule, microbatch, layer, recompute bookkeeping) that capture and replay must
agree on: that state lives here only, in module globals the call sites test without
an attribute lookup.  What each side keeps lives in a module of its own:

    capture.py  host copies (pooled page-locked buffers), pending records, background saver, index
    replay.py   the records to replay, sliced for this rank and staged on the device; their checks
    files.py    the on-disk layout both sides share (rank folders, index.json), RoutingReplayError
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections import deque

import torch

from ...core import rows as batch_rows
from ...core import watch
from ...core.adapters import graph_stage
from ...core.control import Control
from . import capture, replay
from .files import RoutingReplayError

SETTINGS = "routing"  # its settings component (the capability contract: core/capability.py)
__all__ = ["SETTINGS", "close", "configure", "configure_from_settings", "enabled", "flush", "reset", "save",
           "set_position",
           "state",  # the Python API (records: capture.py; set_replay: replay.py; load_dir: files.py)
           "routing_enter", "routing_exit", "routing_fused", "routing_microbatch_begin", "routing_microbatch_end",
           "routing_probs", "routing_schedule", "routing_schedule_end", "routing_step", "routing_topk"]  # call sites


# ------------------------------------------------------------------ state (here only: see the module doc)

_OFF = True          # the one flag every call site tests
_config: dict = {}

_step = 0
_microbatch = 0
_in_forward = False  # inside a schedule's forward_step
_draining = False    # a replayed CUDA graph's rows are being drained (runtime/core/adapters/graph_stage.py)
_layer = None        # ambient MoE layer (TopKRouter.routing); None: no record can address the call
_in_router = False   # inside TopKRouter.routing (its router may still have no layer_number)
_shape = None        # (seq, batch) of the router's logits
_seq_parallel = False
_num_experts = None
_last_idx = None     # device indices of the last capture (for routing_probs)
_phase = None        # the schedule's pass ("fwd_only" / "fwd_bwd", as the dump spec tags it): which Rows
_watched = None      # (layer, logits, RouterReplay or None, num_groups, group_topk) while a hook watches

# layer -> (step, microbatch) of its forwards in this schedule, oldest first: an activation
# recompute in backward takes the oldest (backward visits microbatches in forward order,
# in 1F1B as without pipelining; Megatron's own RouterReplay makes the same assumption).
_forwards: dict = {}
# outside any schedule: the layers routed in the current microbatch and its token count
_free_layers: set = set()
_free_tokens = None
_warned: set = set()  # causes already warned about (one RuntimeWarning per process and cause)


def _apply(config: dict) -> dict:
    global _OFF
    _config.clear()
    _config.update(config)
    _OFF = config["mode"] == "off"
    graph_stage.use("routing", _unstaged, on=not _OFF)  # Megatron's own CUDA graphs stage / feed for us
    if config["mode"] == "replay" and not replay.keys() and not replay.has_requests() and config.get("dir"):
        replay.set_replay(config["dir"])
    return _config


def enabled() -> bool:
    return not _OFF


def _clear() -> None:
    """reset(): forget all captured / replay state and positions (tests)."""
    global _step, _microbatch, _in_forward, _layer, _shape, _last_idx, _in_router, _phase, _watched
    capture.flush()
    _phase = _watched = None
    _step = _microbatch = 0
    _in_forward = _in_router = False
    _layer = _shape = _last_idx = None
    _free_reset()
    _forwards.clear()
    capture.reset()
    replay.clear()


def _counters() -> dict:
    return {"records_saved": capture.saved_count(), "pending": len(capture.pending_keys()),
            "replay_records": len(replay.keys()), "warnings": len(_warned)}


def _details() -> dict:
    return {"mode": _config.get("mode", "off"), "step": _step, "microbatch": _microbatch, "layer": _layer,
            "pending": capture.pending_keys(), "replay": replay.keys()}


_control = Control(SETTINGS, apply=_apply, enabled=enabled, counters=_counters, last_error=capture.last_error,
                   details=_details, clear=_clear, drain=capture.flush,
                   # close: what was captured saved (capture with a dir), the background writer stopped
                   stop=lambda timeout: capture.close(_config.get("dir") if _config.get("mode") == "capture"
                                                      else None, timeout))
configure, configure_from_settings, state, reset, flush, close = _control.surface()


atexit.register(close)


def save(dir: str | os.PathLike | None = None, steps=None, index: bool = True) -> list:
    """Write pending records (of ``steps``, default all) under ``<dir>/rank-<r>/`` (default
    the setting ``dir``) and update ``index.json`` (``index=False``: later, by flush() or
    close()); returns the index entries written so far by this process."""
    return capture.save(dir or _config.get("dir"), steps, index)


def set_position(step: int | None = None, microbatch: int | None = None) -> None:
    """Set the step / microbatch by hand (when no patched schedule drives them)."""
    global _step, _microbatch
    if step is not None:
        _step = int(step)
    if microbatch is not None:
        _microbatch = int(microbatch)
    _free_reset()


def _free_reset() -> None:
    global _free_tokens
    _free_layers.clear()
    _free_tokens = None


def _warn_once(cause: str, message: str) -> None:
    """One RuntimeWarning per process and cause: an observer reports, it never raises."""
    if cause in _warned:
        return
    _warned.add(cause)
    warnings.warn(f"source-patch routing: {message}", RuntimeWarning, stacklevel=3)


def _unaddressable(what: str) -> bool:
    """True (after one warning) when no record can address this call: upstream routes it."""
    if _layer is not None:
        return False
    if _in_router:
        _warn_once(f"{what}-no-layer", f"{what}: a TopKRouter without a layer_number (built outside a "
                   "TransformerLayer) is routed by upstream unchanged, not recorded or replayed")
    else:
        _warn_once(f"{what}-outside", f"{what}: a routing function called outside TopKRouter.routing "
                   "(e.g. topk_routing_with_score_function directly) is routed by upstream unchanged")
    return True


# ------------------------------------------------------------------ call sites


def routing_enter(router, logits) -> None:
    global _layer, _shape, _seq_parallel, _num_experts, _in_router
    if watch.routes_hook is not None:
        _watch_enter(router, logits)
    if _OFF:
        return
    _in_router = True
    number = getattr(router, "layer_number", None)  # None: a router built outside a TransformerLayer
    _layer = None if number is None else int(number)
    _shape = (int(logits.shape[0]), int(logits.shape[1])) if logits.dim() == 3 else None
    config = getattr(router, "config", None)
    _seq_parallel = bool(getattr(config, "sequence_parallel", False))
    _num_experts = getattr(config, "num_moe_experts", None)


def routing_exit() -> None:
    global _layer, _last_idx, _in_router, _watched
    if _watched is not None:
        _watched = None
    if _OFF:
        return
    _layer = None
    _in_router = False
    _last_idx = None


def routing_fused(fused) -> None:
    if _OFF or not fused:
        return
    if _config["mode"] == "capture":  # an observer: the fused router is simply not captured
        _warn_once("capture-fused", "capture: the fused router (moe_router_fusion=True) bypasses compute_topk: "
                   "not captured")
        return
    if _unaddressable("replay"):
        return
    raise RoutingReplayError(
        f"routing {_config['mode']} is on but the router is fused (moe_router_fusion=True), which bypasses "
        f"compute_topk: set moe_router_fusion=False ({_where()})")


def routing_schedule(forward_only=False) -> None:
    global _microbatch, _in_forward, _phase
    if _OFF:
        return
    _microbatch = 0
    _in_forward = False
    _phase = batch_rows.phase_of(forward_only)
    batch_rows.schedule_begin()
    _forwards.clear()
    _free_reset()


def routing_schedule_end() -> None:
    global _in_forward, _phase
    if _OFF:
        return
    _in_forward = False
    _phase = None
    _forwards.clear()


def routing_microbatch_begin() -> None:
    global _in_forward
    if _OFF:
        return
    _in_forward = True


def routing_microbatch_end() -> None:
    global _microbatch, _in_forward
    if _OFF:
        return
    if _config["mode"] == "replay":
        replay.check_microbatch((_step, _microbatch))
    _in_forward = False
    _microbatch += 1


def routing_step(success=True) -> None:
    global _step, _microbatch
    if _OFF:
        return
    if not success:
        return
    finished = _step
    _step += 1
    _microbatch = 0
    _free_reset()
    batch_rows.step_end()
    if _config["mode"] == "capture" and _config.get("dir"):
        capture.save_in_background(_config["dir"], {finished})
    elif _config["mode"] == "replay":
        replay.step_done(finished)


def routing_topk(scores, result):
    if _OFF:
        if watch.routes_hook is not None:
            _watch_topk(scores, result, None)
        return result
    if _config["mode"] == "capture":
        _capture(result[1])
        if watch.routes_hook is not None:
            _watch_topk(scores, result, None)
        return result
    out = _replay_topk(scores, result)
    if watch.routes_hook is not None:
        _watch_topk(scores, result, None if out is result else out[1])
    return out


def routing_probs(routing_probs):
    """The final combine weights: kept (capture with probs), replaced by the record's
    (replay with replay_probs), else returned as they are."""
    if not _OFF and _config["mode"] == "replay" and _config.get("replay_probs"):
        return routing_probs if _layer is None else replay.probs(routing_probs, _layer, _where, _shape, _seq_parallel)
    if _OFF or not _config.get("probs") or _config["mode"] != "capture" or _last_idx is None:
        return routing_probs
    capture.add_probs((_step, _microbatch), _layer, routing_probs, _last_idx)
    return routing_probs


# ------------------------------------------------------------------ watched (core/watch.py's routes_hook)


def _watch_enter(router, logits) -> None:
    """TopKRouter.routing's entry while a hook watches: its layer, its logits (the
    router's softmax over all experts is theirs), its RouterReplay and group top-k."""
    global _watched
    number = getattr(router, "layer_number", None)
    if number is None:
        _watched = None  # built outside a TransformerLayer: no layer to report it under
        return
    config = getattr(router, "config", None)
    _watched = (int(number), logits, getattr(router, "router_replay", None),
                getattr(config, "moe_router_num_groups", None), getattr(config, "moe_router_group_topk", None))


def _watch_topk(scores, result, replayed) -> None:
    """Hand the hook this router call: its own top-k ids, its logits, the ids replayed
    in their place (None: not replayed).  Not for a call outside TopKRouter.routing,
    an activation recompute in backward (its forward was seen), a warm-up pass or a CUDA
    graph capture (a replay would not run this Python)."""
    watched, hook = _watched, watch.routes_hook
    if watched is None or hook is None or torch._C._current_graph_task_id() != -1:
        return
    if graph_stage.warming_up() or (scores.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    layer, logits, router_replay, num_groups, group_topk = watched
    own = result[1]
    action = getattr(getattr(router_replay, "router_replay_action", None), "value", None)
    if action in ("replay_forward", "replay_backward"):
        # Megatron-Core's RouterReplay put its target ids in the router's place before this
        # call site: the router's own choice is recomputed from the scores it ranks.
        replayed = own if replayed is None else replayed
        own = _own_topk(scores, int(own.shape[1]), num_groups, group_topk)
    if logits is None or logits.numel() != scores.numel():
        logits = scores
    hook(layer, own, logits.reshape(scores.shape), replayed)


def _own_topk(scores, topk: int, num_groups, group_topk):
    with torch.no_grad():
        if group_topk:
            from megatron.core.transformer.moe.moe_utils import group_limited_topk
            return group_limited_topk(scores=scores, topk=topk, num_tokens=int(scores.shape[0]),
                                      num_experts=int(scores.shape[1]), num_groups=num_groups,
                                      group_topk=group_topk)[1]
        return torch.topk(scores, k=topk, dim=1)[1]


# ------------------------------------------------------------------ which (step, microbatch) a router call is


def _call_key(tokens: int) -> tuple[tuple, bool]:
    """((step, microbatch), recompute) of this router call.  In a forward_step: the
    current microbatch.  Outside one, while this layer has forwards not yet recomputed:
    an activation recompute in backward, of the oldest of them.  Else a plain forward
    outside any schedule (``_free_key``)."""
    if _in_forward:
        key = (_step, _microbatch)
        _forwards.setdefault(_layer, deque()).append(key)
        return key, False
    pending = _forwards.get(_layer)
    if pending:
        return pending.popleft(), True
    return _free_key(tokens), False


def _free_key(tokens: int) -> tuple:
    """Outside any schedule nothing counts microbatches, so each forward is its own: a
    layer routed again, or a different token count, starts the next microbatch.  A bare
    model's (or upstream's unit tests') forwards then get one record each, (step, 0),
    (step, 1), ..., which a replay of the same forwards in the same order finds again."""
    global _microbatch, _free_tokens
    if _layer in _free_layers or (_free_tokens is not None and tokens != _free_tokens):
        _microbatch += 1
        _free_layers.clear()
    _free_layers.add(_layer)
    _free_tokens = tokens
    return _step, _microbatch


def _where() -> str:
    return f"step {_step}, microbatch {_microbatch}, layer {_layer}"


# ------------------------------------------------------------------ capture (the host side: capture.py)


def _capture(indices: torch.Tensor) -> None:
    global _last_idx
    if graph_stage.warming_up():
        return  # an eager warm-up pass of a Megatron graph being built: zeros in, nothing routed
    if _unaddressable("capture"):
        return
    if indices.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # a graph replays without this Python: stage the ids in the graph (drained after each replay)
        if graph_stage.active() is not None:
            graph_stage.stage(_drained, ("routing", _layer), indices, layer=_layer)
            return
        _warn_once("capture-graph", "capture: a router call during CUDA graph capture outside a GraphStage "
                   "is not captured")
        return
    key, recompute = _call_key(int(indices.shape[0]))
    if recompute:
        return  # activation recompute in backward: captured in its forward
    capture.add(key, _layer, indices, _shape[1] if _shape else None, _num_experts, _seq_parallel, _draining)
    if _config.get("probs"):
        _last_idx = indices.detach()


def _drained(key, indices, *, layer, cuda_graph, replay, **_):
    """A replayed graph's router rows (runtime/core/adapters/graph_stage.py): captured as the eager
    call of this layer would have been, and the record tagged ``cuda_graph``."""
    global _layer, _draining
    saved, _layer, _draining = _layer, layer, cuda_graph
    try:
        _capture(indices)
    finally:
        _layer, _draining = saved, False


def _unstaged(name, what) -> None:
    """A Megatron CUDA graph built while routing was off is replayed (core/adapters/graph_stage.py)."""
    why = ("was built (at the end of the first step) while routing was off, so its routers are not "
           f"{'captured' if _config['mode'] == 'capture' else 'replayed'} ({what}); "
           "turn routing on "
           "before the first step")
    if _config["mode"] == "replay":
        raise RoutingReplayError(f"routing replay: a CUDA graph {why}: it would route as at its capture")
    _warn_once("capture-unstaged-graph", f"capture: a CUDA graph {why}")


# ------------------------------------------------------------------ replay (the record side: replay.py)


def _replay_topk(scores, result):
    if graph_stage.warming_up():
        # an eager warm-up pass of a Megatron graph being built: its results are thrown away;
        # the buffer the capture will feed is allocated now, outside the graph's memory pool
        graph_stage.reserve(("routing", _layer), result[1])
        return result
    if _unaddressable("replay"):
        return result
    if scores.is_cuda and torch.cuda.is_current_stream_capturing() and graph_stage.active() is not None:
        # a graphed router reads its ids from a static buffer, refilled before each replay
        idx = graph_stage.feed(_fill, ("routing", _layer), result[1], layer=_layer, experts=int(scores.shape[1]))
        return scores.gather(1, idx), idx
    tokens = int(scores.shape[0])
    scheduled = _in_forward
    key, recompute = _call_key(tokens)
    if replay.has_requests():
        _arm(key, scheduled or recompute)
    idx = replay.ids(key, _layer, tokens, int(scores.shape[1]), int(result[1].shape[1]), scores.device, _shape,
                     _seq_parallel)
    return scores.gather(1, idx), idx


def _arm(key, scheduled: bool) -> None:
    """Request records given (replay.set_requests): the micro-batch ``source_patch.batch``
    named for this call (core/rows.py: in a schedule, this pass's micro-batch ``key[1]``;
    outside one, the latest) becomes ``key``'s record.  None named: ``key``'s own record."""
    rows = batch_rows.current(_phase, key[1]) if scheduled else batch_rows.current()
    if rows is not None:
        replay.arm(key, rows, _seq_parallel)


def _fill(key, buffer, *, layer, experts, **_):
    """Before a graph replay: this layer's recorded ids for the current micro-batch into
    the buffer its router reads (runtime/core/adapters/graph_stage.py)."""
    global _layer
    saved, _layer = _layer, layer
    try:
        tokens = int(buffer.shape[0])
        scheduled = _in_forward
        call, recompute = _call_key(tokens)
        if replay.has_requests():
            _arm(call, scheduled or recompute)
        buffer.copy_(replay.ids(call, layer, tokens, experts, int(buffer.shape[1]), buffer.device, _shape,
                                _seq_parallel))
    finally:
        _layer = saved


configure_from_settings()  # environment over the specs' runtime: section over defaults
