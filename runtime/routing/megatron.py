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

Python API (``source_patch.runtime.routing.megatron``)::

    configure(mode="capture", dir="routes", probs=False)   # or settings component "routing"
    records()            # captured RoutingRecords, one per (step, microbatch), in order
    save(dir=None)       # write pending records + index.json; returns the index
    load_dir(dir)        # {(step, microbatch): RoutingRecord} from a directory
    set_replay(records)  # dir, list of records (extra step/microbatch) or {(s, m): record}
    set_position(step=None, microbatch=None)

On disk: ``<dir>/rank-<r>/step-<S>-mb-<M>.safetensors`` (one RoutingRecord, token_order
``megatron-sbh``, ``extra={"step", "microbatch"}``) and ``<dir>/rank-<r>/index.json``.

Capture and replay observe upstream: a call no record can address (a router without a
``layer_number``, a routing function called outside ``TopKRouter.routing``, capture
during CUDA graph capture outside a GraphStage, the fused router under capture) is
routed by upstream unchanged, with one ``RuntimeWarning`` per process and cause.
Outside any schedule each forward is its own microbatch (``_free_key``), so a bare
model's forwards are recorded one record each and replayed in the same order.

Under CUDA graphs (``core/graph_stage.py``; megatron-core's own graphs through the
spec's ``graph-build`` / ``graph-replay`` patches) capture stages the ids inside the
graph and ``_drained`` records them after each replay, tagged ``cuda_graph``; replay
returns a fed static buffer that ``_fill`` refills before each replay; the eager
warm-up passes of a graph being built are neither captured nor replayed.

Capture and replay live together: they share the per-step state machine
(schedule, microbatch, recompute bookkeeping) that both must agree on.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
from collections import deque
from pathlib import Path

import torch

from ..core import graph_stage
from .record import RoutingRecord, RoutingRecordError, load, slice_for_rank
from ..core.settings import check_all, resolve

SETTINGS = "routing"  # its settings component (the capability contract: core/capability.py)


class RoutingReplayError(RuntimeError):
    """Replay cannot route as recorded (names step, microbatch and layer)."""


# ------------------------------------------------------------------ state

_OFF = True          # the one flag every call site tests
_config: dict = {}
_lock = threading.Lock()

_step = 0
_microbatch = 0
_in_forward = False  # inside a schedule's forward_step
_draining = False    # a replayed CUDA graph's rows are being drained (runtime/core/graph_stage.py)
_layer = None        # ambient MoE layer (TopKRouter.routing); None: no record can address the call
_in_router = False   # inside TopKRouter.routing (its router may still have no layer_number)
_shape = None        # (seq, batch) of the router's logits
_seq_parallel = False
_num_experts = None

# capture: (step, microbatch) -> {layer: (indices_host, probs_host_or_None, event_or_None)}
_pending: dict = {}
_meta: dict = {}     # (step, microbatch) -> {"batch", "num_experts", "sp"}
_saved_index: list = []
_index_written = 0.0  # time.monotonic() of the last index.json write
_index_every = 1.0    # seconds until the background writer rewrites it again (see _write_index)
_index_dirty = False  # records on disk the index does not list yet (flush() and close() write it)
# capture's page-locked host buffers, (shape, dtype) -> free tensors: reused across steps once
# their record is on disk (an allocation a router call costs ~10 us and the caching host
# allocator's lock; the capture makes the same shapes every step)
_host_pool: dict = {}
_last_idx = None     # device indices of the last capture (for routing_probs)

# replay
_replay: dict = {}   # (step, microbatch) -> RoutingRecord (as loaded)
_sliced: dict = {}   # (step, microbatch) -> RoutingRecord (sliced for this rank)
_staged: dict = {}   # (step, microbatch) -> (device, {layer: int64 indices on that device})
_saver = None        # the background thread that writes captured steps (ThreadPoolExecutor)
_used: dict = {}     # (step, microbatch) -> set of layers replayed
# layer -> (step, microbatch) of its forwards in this schedule, oldest first: an activation
# recompute in backward takes the oldest (backward visits microbatches in forward order,
# in 1F1B as without pipelining; Megatron's own RouterReplay makes the same assumption).
_forwards: dict = {}
# outside any schedule: the layers routed in the current microbatch and its token count
_free_layers: set = set()
_free_tokens = None
_warned: set = set()  # causes already warned about (one RuntimeWarning per process and cause)
_last_error: str | None = None  # the latest failure to save captured routes


def configure(**changes) -> dict:
    """Set settings (mode, dir, probs), all validated before any is applied; returns the
    effective settings."""
    global _OFF
    _config.update(check_all(SETTINGS, changes))
    _OFF = _config["mode"] == "off"
    graph_stage.use("routing", _unstaged, on=not _OFF)  # Megatron's own CUDA graphs stage / feed for us
    if _config["mode"] == "replay" and not _replay and _config.get("dir"):
        set_replay(_config["dir"])
    return dict(_config)


def configure_from_settings() -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    _config.update(resolve("routing"))
    return configure()


def enabled() -> bool:
    return not _OFF


def reset() -> dict:
    """Forget all captured / replay state and positions (tests); returns state()."""
    global _step, _microbatch, _in_forward, _layer, _shape, _last_idx, _in_router
    flush()
    _step = _microbatch = 0
    _in_forward = _in_router = False
    _layer = _shape = _last_idx = None
    _free_reset()
    _pending.clear(); _meta.clear(); _saved_index.clear(); _forwards.clear(); _host_pool.clear()
    _replay.clear(); _sliced.clear(); _staged.clear(); _used.clear()
    global _last_error
    _last_error = None
    return state()


def state() -> dict:
    counters = {"records_saved": len(_saved_index), "pending": len(_pending),
                "replay_records": len(_replay), "warnings": len(_warned)}
    return {"enabled": not _OFF, "mode": _config["mode"], "step": _step, "microbatch": _microbatch,
            "layer": _layer, "pending": sorted(_pending), "replay": sorted(_replay),
            "config": dict(_config), "counters": counters, "last_error": _last_error}


def close(timeout: float | None = None) -> bool:
    """Save what was captured (capture with a dir) and stop the background writer; True
    when nothing failed.  Registered with atexit."""
    global _saver, _last_error
    flush()
    if _config.get("mode") == "capture" and _config.get("dir") and _pending:
        try:
            save()
        except Exception as exc:  # noqa: BLE001 - at exit: report, do not mask the real exit
            import sys

            _last_error = f"saving: {type(exc).__name__}: {exc}"
            print(f"source-patch routing: could not save captured routes: {exc}", file=sys.stderr)
    saver, _saver = _saver, None
    if saver is not None:
        saver.shutdown(wait=True)
    return _last_error is None


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
    global _layer, _last_idx, _in_router
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
    global _microbatch, _in_forward
    if _OFF:
        return
    _microbatch = 0
    _in_forward = False
    _forwards.clear()
    _free_reset()


def routing_schedule_end() -> None:
    global _in_forward
    if _OFF:
        return
    _in_forward = False
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
    key = (_step, _microbatch)
    if _config["mode"] == "replay" and key in _used:
        rec = _replay.get(key)
        if rec is not None and _used[key] != set(rec.layers):
            missing = sorted(set(rec.layers) - _used[key])
            raise RoutingReplayError(
                f"step {_step}, microbatch {_microbatch}: the record has layers {rec.layers} but the model "
                f"routed through {sorted(_used[key])} (layer count mismatch; never used: {missing})")
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
    if _config["mode"] == "capture" and _config.get("dir"):
        _save_in_background({finished})
    elif _config["mode"] == "replay":
        for key in [k for k in _sliced if k[0] <= finished]:
            _sliced.pop(key, None)
            _staged.pop(key, None)


def _save_in_background(steps: set) -> None:
    """Write a finished step's records off the training thread (waiting on their copies'
    events and writing files would stall the step); failures are reported, not raised."""
    global _saver
    if _saver is None:
        from concurrent.futures import ThreadPoolExecutor

        _saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sp-routing-save")
    _saver.submit(_save_reporting, steps)


def _save_reporting(steps) -> None:
    global _last_error
    try:
        # the index is rewritten whole, so not at every step (flush() and close() write it too)
        save(steps=steps, index=time.monotonic() - _index_written >= _index_every)
    except Exception as exc:  # noqa: BLE001 - never raise into training
        import sys

        _last_error = f"saving step(s) {sorted(steps)}: {type(exc).__name__}: {exc}"
        print(f"source-patch routing: could not save captured routes of step(s) {sorted(steps)}: {exc}",
              file=sys.stderr)


def flush() -> None:
    """Wait until every step handed to the background writer is on disk, its index too."""
    if _saver is not None:
        try:
            _saver.submit(_write_index_if_dirty).result()
        except RuntimeError:  # at interpreter exit: the executor was shut down, its work done
            _write_index_if_dirty()


def routing_topk(scores, result):
    if _OFF:
        return result
    if _config["mode"] == "capture":
        _capture(result[1])
        return result
    return _replay_topk(scores, result)


def routing_probs(routing_probs):
    """The final combine weights: kept (capture with probs), replaced by the record's
    (replay with replay_probs), else returned as they are."""
    if not _OFF and _config["mode"] == "replay" and _config.get("replay_probs"):
        return routing_probs if _layer is None else _replay_probs(routing_probs)
    if _OFF or not _config.get("probs") or _config["mode"] != "capture" or _last_idx is None:
        return routing_probs
    key = (_step, _microbatch)
    entry = _pending.get(key, {}).get(_layer)
    if entry is not None and entry[1] is None:
        probs = routing_probs.detach().gather(1, _last_idx)
        _pending[key][_layer] = (entry[0], _Pending(*_to_host(probs)), None)
    return routing_probs


# ------------------------------------------------------------------ capture


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


def _to_host(t: torch.Tensor):
    """``(host copy, event or None)``.  On CUDA: a non-blocking copy on the current stream
    into a pooled page-locked buffer, and an event the reader waits on.  The current
    stream, not a side stream: the ids are a few KiB (microseconds of copy engine) and a
    side stream costs the host more (stream switch, wait_stream, record_stream: ~20 us a
    call) than the copy costs the device."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.clone(), None
    free = _host_pool.get((t.shape, t.dtype))
    host = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))  # the stream the copy ran on (t's device)
    return host, event


_POOL_SHAPES = 32  # more distinct (shape, dtype) than this (token counts that vary): start the pool afresh


def _recycle(layers: dict) -> None:
    """A saved record's page-locked buffers back to the pool (their copies are done: read)."""
    if len(_host_pool) > _POOL_SHAPES:
        _host_pool.clear()  # bounded: a varying token count would otherwise keep every shape's buffers
    for idx, prob, _ in layers.values():
        for pending in (idx, prob):
            if isinstance(pending, _Pending) and pending.event is None and pending.host.is_pinned():
                _host_pool.setdefault((pending.host.shape, pending.host.dtype), []).append(pending.host)


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
    layers = _pending.get(key)
    if layers is None:
        layers = _pending[key] = {}
        _meta[key] = {"batch": _shape[1] if _shape else None, "num_experts": _num_experts, "sp": _seq_parallel,
                      "cuda_graph": _draining}
    elif _draining:
        _meta[key]["cuda_graph"] = True
    layers[_layer] = (_Pending(*_to_host(indices)), None, None)
    if _config.get("probs"):
        _last_idx = indices.detach()


def _drained(key, indices, *, layer, cuda_graph, replay, **_):
    """A replayed graph's router rows (runtime/core/graph_stage.py): captured as the eager
    call of this layer would have been, and the record tagged ``cuda_graph``."""
    global _layer, _draining
    saved, _layer, _draining = _layer, layer, cuda_graph
    try:
        _capture(indices)
    finally:
        _layer, _draining = saved, False


def _unstaged(name, runner) -> None:
    """A Megatron CUDA graph built while routing was off is replayed (core/graph_stage.py)."""
    why = ("was built (at the end of the first step) while routing was off, so its routers are not "
           f"{'captured' if _config['mode'] == 'capture' else 'replayed'} ({graph_stage.describe(runner)}); "
           "turn routing on "
           "before the first step")
    if _config["mode"] == "replay":
        raise RoutingReplayError(f"routing replay: a CUDA graph {why}: it would route as at its capture")
    _warn_once("capture-unstaged-graph", f"capture: a CUDA graph {why}")


class _Pending:
    """A host tensor whose D2H copy may still be in flight; resolved when read."""

    __slots__ = ("host", "event")

    def __init__(self, host, event):
        self.host, self.event = host, event

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def _resolve(value):
    if isinstance(value, _Pending):
        return value.get()
    return value


def _parallel():
    """(cp_size, cp_rank, tp_size, tp_rank, rank) from parallel_state when initialised."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                    ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                    torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    except ImportError:
        pass
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return 1, 0, 1, 0, rank


def _build(key, copy: bool = True) -> RoutingRecord:
    """The record of (step, microbatch) ``key``; ``copy=False`` (save(), which recycles the
    pooled buffers after writing) lets it hold the pending host tensors themselves."""
    layers = _pending[key]
    meta = _meta.get(key, {})
    indices, probs = {}, {}
    for layer, (idx, prob, _) in sorted(layers.items()):
        indices[layer] = _resolve(idx).to(torch.int64, copy=copy)
        if prob is not None:
            probs[layer] = _resolve(prob).clone() if copy else _resolve(prob)
    num_experts = meta.get("num_experts") or int(max(int(t.max()) for t in indices.values()) + 1)
    batch = meta.get("batch")
    tokens = next(iter(indices.values())).shape[0]
    cp, cp_rank, tp, tp_rank, _ = _parallel()
    sp = bool(meta.get("sp")) and tp > 1
    parallel = None
    if cp > 1 or sp:
        parallel = {"cp": cp, "sp": sp, "tp": tp, "ep": 1, "cp_rank": cp_rank, "tp_rank": tp_rank}
    seq_lens = [tokens // batch] * batch if batch and tokens % batch == 0 else None
    return RoutingRecord(indices=indices, probs=probs if len(probs) == len(indices) else None,
                         num_experts=int(num_experts), token_order="megatron-sbh", seq_lens=seq_lens,
                         parallel=parallel, source="megatron",
                         extra={"step": key[0], "microbatch": key[1], **({"cuda_graph": True} if meta.get("cuda_graph")
                                                                          else {})})


def records(steps=None) -> list:
    """Captured records not yet saved, one per (step, microbatch), sorted."""
    return [_build(k) for k in sorted(_pending) if steps is None or k[0] in steps]


def save(dir: str | os.PathLike | None = None, steps=None, index: bool = True) -> list:
    """Write pending records (of ``steps``, default all) under ``<dir>/rank-<r>/`` and update
    ``index.json`` (``index=False``: later, by flush() or close()); returns the index
    entries written so far by this process."""
    global _index_written, _index_dirty
    root = dir or _config.get("dir")
    if not root:
        raise RoutingReplayError("routing save: no directory (set routing dir or pass dir=)")
    rank = _parallel()[4]
    folder = Path(root) / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    with _lock:
        # list(): the training thread may add keys of later steps meanwhile.
        for key in sorted(k for k in list(_pending) if steps is None or k[0] in steps):
            rec = _build(key, copy=False)
            name = f"step-{key[0]}-mb-{key[1]}.safetensors"
            rec.save(folder / name)
            _recycle(_pending[key])
            _saved_index[:] = [e for e in _saved_index if (e["step"], e["microbatch"]) != key]
            _saved_index.append({"step": key[0], "microbatch": key[1], "file": name, "layers": rec.layers,
                                 "tokens": rec.num_tokens, "num_experts": rec.num_experts, "topk": rec.topk})
            del _pending[key]
            _meta.pop(key, None)
        _saved_index.sort(key=lambda e: (e["step"], e["microbatch"]))
        _index_dirty = True
        _index_folder[0] = folder
        if index:
            _write_index(folder, rank)
    return list(_saved_index)


_index_folder: list = [None]  # where the last save wrote (the index that flush() completes)


def _write_index(folder: Path, rank: int) -> None:
    """Rewrite index.json whole.  Compact JSON (json's C encoder; ``indent`` takes the pure-
    Python one, 7x slower), and the background writer waits at least 50 times this write's
    time before the next (at least a second): a growing index then takes under 2% of a core,
    and of the GIL, where rewriting it every step took 16 ms a step at 1,000 records and
    260 ms at 10,000 (CPU, 2026-11-26)."""
    global _index_written, _index_dirty, _index_every
    start = time.monotonic()
    tmp = folder / "index.json.tmp"
    tmp.write_text(json.dumps({"format": "source-patch-routing-index", "version": 1, "rank": rank,
                               "records": _saved_index}, separators=(",", ":")))
    os.replace(tmp, folder / "index.json")
    _index_written, _index_dirty = time.monotonic(), False
    _index_every = max(1.0, 50 * (_index_written - start))


def _write_index_if_dirty() -> None:
    with _lock:
        if _index_dirty and _index_folder[0] is not None:
            _write_index(_index_folder[0], _parallel()[4])


atexit.register(close)


# ------------------------------------------------------------------ replay


def load_dir(dir: str | os.PathLike) -> dict:
    """``{(step, microbatch): RoutingRecord}`` from ``dir`` (its ``rank-<r>/index.json`` for this
    rank, else ``rank-0``, else ``dir/index.json``)."""
    root = Path(dir)
    rank = _parallel()[4]
    for folder in (root / f"rank-{rank}", root / "rank-0", root):
        if (folder / "index.json").is_file():
            break
    else:
        raise RoutingReplayError(f"routing replay: no index.json under {root} (rank-{rank}/, rank-0/ or .)")
    index = json.loads((folder / "index.json").read_text())
    out = {}
    for entry in index["records"]:
        key = (int(entry["step"]), int(entry["microbatch"]))
        try:
            out[key] = load(folder / entry["file"])
        except RoutingRecordError as exc:
            raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: bad record {entry['file']}: {exc}") from None
    return out


def set_replay(source) -> None:
    """Records to replay: a directory, a list of records tagged ``extra={"step", "microbatch"}``,
    or a dict ``{(step, microbatch): record}``."""
    if isinstance(source, (str, os.PathLike)):
        source = load_dir(source)
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
    _replay.clear(); _sliced.clear(); _staged.clear(); _used.clear()
    _replay.update(source)


def _for_rank(key) -> RoutingRecord:
    rec = _sliced.get(key)
    if rec is not None:
        return rec
    rec = _replay.get(key)
    if rec is None:
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: no routing record to replay "
                                 f"(records for {sorted(_replay)[:8]}{'...' if len(_replay) > 8 else ''})")
    cp, cp_rank, tp, tp_rank, _ = _parallel()
    if rec.parallel is None and _shape is not None:
        try:
            rec = slice_for_rank(rec, batch=_shape[1], cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                                 sequence_parallel=_seq_parallel)
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


def _replay_topk(scores, result):
    if graph_stage.warming_up():
        return result  # an eager warm-up pass of a Megatron graph being built: its results are thrown away
    if _unaddressable("replay"):
        return result
    if scores.is_cuda and torch.cuda.is_current_stream_capturing() and graph_stage.active() is not None:
        # a graphed router reads its ids from a static buffer, refilled before each replay
        idx = graph_stage.feed(_fill, ("routing", _layer), result[1], layer=_layer, experts=int(scores.shape[1]))
        return scores.gather(1, idx), idx
    idx = _replay_ids(int(scores.shape[0]), int(scores.shape[1]), int(result[1].shape[1]), scores.device)
    return scores.gather(1, idx), idx


def _fill(key, buffer, *, layer, experts, **_):
    """Before a graph replay: this layer's recorded ids for the current micro-batch into
    the buffer its router reads (runtime/core/graph_stage.py)."""
    global _layer
    saved, _layer = _layer, layer
    try:
        buffer.copy_(_replay_ids(int(buffer.shape[0]), experts, int(buffer.shape[1]), buffer.device))
    finally:
        _layer = saved


def _replay_ids(live_tokens: int, live_experts: int, live_topk: int, device):
    """The recorded ids of this call (step, micro-batch, layer) on ``device``, checked
    against the router's token count, top-k and expert count."""
    key, _ = _call_key(live_tokens)
    rec = _for_rank(key)
    where = f"step {key[0]}, microbatch {key[1]}, layer {_layer}"
    if _layer not in rec.indices:
        raise RoutingReplayError(f"{where}: the record has no layer {_layer} (it has {rec.layers}; "
                                 "layer mismatch)")
    if rec.num_tokens != live_tokens:
        raise RoutingReplayError(f"{where}: the record has {rec.num_tokens} rows, the router has {live_tokens} "
                                 "tokens (row-count mismatch)")
    if rec.topk != live_topk:
        raise RoutingReplayError(f"{where}: the record has topk {rec.topk}, the router {live_topk}")
    idx = rec.indices[_layer]
    if rec.num_experts > live_experts:
        bad = idx >= live_experts
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0, 0])
            raise RoutingReplayError(f"{where}, row {row}: expert id out of range [0, {live_experts}) "
                                     f"(row {idx[row].tolist()})")
    idx = _on_device(key, rec, device)[_layer]
    _used.setdefault(key, set()).add(_layer)
    global _last_replay
    _last_replay = (key, _layer, idx)
    return idx


_last_replay = None  # (key, layer, indices) of the latest replayed top-k: where its weights go


def _replay_probs(routing_probs):
    """``routing_probs`` [tokens, experts] rebuilt from the record: its weights at its ids."""
    if routing_probs.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RoutingReplayError(f"replay_probs under CUDA graph capture is not supported: the graph would keep the "
                                 f"capture's weights ({_where()}); replay ids only")
    if _last_replay is None or _last_replay[1] != _layer:
        raise RoutingReplayError(f"replay_probs: no replayed top-k for this router call ({_where()})")
    key, layer, idx = _last_replay
    rec = _for_rank(key)
    if rec.probs is None or layer not in rec.probs:
        raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}, layer {layer}: replay_probs is on but "
                                 "the record has no combine weights (capture them: SGLang records them; "
                                 "Megatron with probs: true)")
    weights = rec.probs[layer].to(routing_probs.device, routing_probs.dtype)
    return torch.zeros_like(routing_probs).scatter(1, idx, weights)


configure_from_settings()  # environment over the specs' runtime: section over defaults
