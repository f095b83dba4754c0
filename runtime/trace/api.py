"""The trace runtime: watch chosen tensors live while a model trains or serves.

Call sites (inserted by a spec, reached through ``__sp__``)::

    __sp__.trace("layer_output", hidden_states, layer=self.layer_number)   # returns it unchanged
    __sp__.trace_step(optimizer.step())                                   # after each optimizer step

Clients connect to the process's hub (a WebSocket server in a daemon thread, see
trace/hub.py), subscribe to names and layers with a compressor, and receive one small
binary frame (trace/frame.py) per traced result.  Scripts and tools::

    import source_patch.runtime.trace as trace   # configure, url, state, close
    trace.configure(enable=True, port=8765)   # validated as a whole, then applied
    print(trace.url())                        # http://127.0.0.1:8765/#token=...

Design (see docs/trace.md):

* Disabled, or enabled with no subscription for ``(name, layer)``, ``trace()`` is a
  flag test, or a flag test and one dict lookup (the table is rebuilt only when
  subscriptions change).
* A due subscription runs its compressor's device stage (compress.py, fused.py) on
  the tensor's device, nothing that waits for the GPU.  With the hub in a forwarder
  process (forwarder.py) the result lands in a page-locked ring both processes map
  (ring.py): the fused kernel writes it there, other results are copied there
  asynchronously.  The training thread records one pooled CUDA event and queues
  (slice or result, event, meta): it only launches.  A publisher thread waits for
  the events (never the training thread) and sends the forwarder a header naming
  the slices; the forwarder runs the host stage, encodes frames and serves them.
  With the hub in a thread, the publisher copies the batch to pinned memory on its
  own stream and does all of that itself.  Full queues drop and count; nothing blocks.
* Failures are counted, logged once per kind, and never raised into training, except
  a call site's own programming error (a value that is not a tensor).

The hot path, the publisher thread and their shared queue and locks are one
concurrency unit, so they live in one module.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from ..core import graph_stage, ranks, settings, tags as ambient
from ..core.failures import Counters
from . import graphs
from .ring import ALIGN, Slice

SETTINGS = "trace"  # its settings component (the capability contract: core/capability.py)

# The one thing a disabled call site reads.
_enabled = False

_step = 0
_config: dict = {}
_config_lock = threading.RLock()
MAX_NAMES = 1 << 14  # (name, layer) pairs remembered; more are traced but not listed
BATCH = 64            # results that wake the publisher before the step ends
FLUSH_SECONDS = 0.2   # ... or this long after the last publication (no trace_step, e.g. SGLang)


class _Table:
    """The subscriptions of all clients, and which of them each (name, layer) hits.
    Replaced as a whole when subscriptions change, so the training thread never
    sees a half-built one."""

    __slots__ = ("subs", "routes", "plans")

    def __init__(self, subs: tuple = ()):
        self.subs = subs
        self.routes: dict = {}
        self.plans: dict = {}  # (name, layer) -> _Plan, or False where none applies (see _fast)


_table = _Table()
_seen: dict = {}             # (name, layer) -> (shape, dtype) at first sight
_subscribed = threading.Event()

# -- results on their way to the hub (guarded by _lock; the hot path takes the lock
# itself, a C call, where the condition's own __enter__ is a Python frame)
_lock = threading.Lock()
_cond = threading.Condition(_lock)
_pending: deque = deque()
_busy = 0                    # results the publisher has taken but not yet handed over
_publisher: threading.Thread | None = None
_stop = False
_hub = None                  # hub.Hub while serving
_ring = None                 # ring.Ring the forwarder reads results from (hub: process)
_hub_key: tuple | None = None

_COUNTERS = ("results", "dropped", "skipped", "errors", "compress_errors", "too_large")
_counters = Counters(_COUNTERS, "source_patch.trace", "trace", lock=_cond)
_counts = _counters.counts  # written under _cond, like the queue
# What tracing costs the process, in seconds: the training thread's time inside due
# trace() calls (compressor launches, an event), the publisher's CPU time, and (with
# the device_timing setting) the device time of the reductions, from CUDA events.
_cost = {"trace_calls": 0.0, "publisher_cpu": 0.0, "device_reduce": 0.0}
# Due trace() calls by duration: _call_us[i] counts those of 2**(i-1) to 2**i us (i = 0:
# under 1 us; the last also counts everything longer): whether a mean is many slow
# calls or a few long waits (for the GIL, for the launch queue).
CALL_BUCKETS = 20
_call_us = [0] * CALL_BUCKETS
_events: dict = {}   # (device index, timing) -> deque of CUDA events the publisher is done with
# A process that calls trace_step gets one event per stream per batch, recorded when the
# batch is handed over (step end, a full batch, FLUSH_SECONDS), not one per result: the
# event record was the largest part of a due call in training (docs/benchmarks.md).
# The publisher never records on the training thread's stream (it might be capturing a
# CUDA graph): results without their event wait in _pending for the tracing thread.
PER_BATCH_EVENTS = True
_stepping = False            # trace_step has been called: batches end
_unsealed: list = []         # results in _pending waiting for their batch's event
_tracer: int | None = None   # the thread that traced them (the one that may record it)
_streams: dict = {}  # device index -> the publisher's copy stream


# ---------------------------------------------------------------- call-site API


def trace(name: str, tensor, /, **tags):
    """Offer ``tensor`` under ``name`` (with ``tags``, e.g. ``layer=3``) to the
    subscribed clients; return it unchanged.  Raises TypeError only for a value that
    is not a tensor (the call site's bug); runtime failures are counted, not raised."""
    if not _enabled:
        return tensor
    if graph_stage.busy and graphs.intercept(name, tensor, tags):  # a CUDA graph being built (graphs.py)
        return tensor
    table = _table
    key = (name, tags.get("layer"))
    routes = table.routes.get(key)
    if routes is None:
        routes = _first_sight(table, key, tensor)
    if routes:
        plan = table.plans.get(key)
        if not plan or not _fast(plan, key, tensor, tags):
            _emit(routes, key, tensor, tags)
            if plan is None or (plan and plan.stale):  # a plan that failed is not made again
                table.plans[key] = False if plan and plan.failed else _make_plan(routes, tensor)
    return tensor


def trace_step(success: Any = True, *, step: int | None = None) -> Any:
    """Advance the step counter after an optimizer step; return ``success`` unchanged.
    Megatron's ``(ok, grad_norm, num_zeros)`` counts only when ok; ``step=N`` sets it."""
    global _step, _stepping
    try:
        if step is not None:
            _step = int(step)
        else:
            ok = success[0] if isinstance(success, tuple) and success else success
            if ok:
                _step += 1
        _stepping = True
        if _pending:
            with _lock:
                _seal()
                _wake_publisher()  # the step's results go out together, between steps
    except Exception as exc:  # noqa: BLE001
        _fail("trace_step", exc)
    return success


# ---------------------------------------------------------------- control API


def enabled() -> bool:
    return _enabled


def configure(**changes) -> dict:
    """Change settings (keys of the ``trace`` schema); all are validated before any
    is applied (KeyError names the valid keys).  Returns the effective configuration."""
    with _config_lock:
        parsed = settings.check_all("trace", changes)
        _apply({**_config, **parsed})
        return public_config()


def configure_from_settings(environ=None) -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    with _config_lock:
        _apply(settings.resolve("trace", os.environ if environ is None else environ))
        return public_config()


def public_config() -> dict:
    return settings.redacted(_config)


def url() -> str | None:
    """The page of this process's hub with its token in the fragment, or None."""
    hub = _hub
    return hub.page_url if hub is not None else None


def state(with_hub: bool = True) -> dict:
    """Counters, hub and configuration (also the hub's ``stats`` reply)."""
    with _cond:
        counts = dict(_counts)
        queued = len(_pending) + _busy
        cost = dict(_cost)
        calls = list(_call_us)
    hub = _hub
    hub_stats = hub.stats() if hub is not None and with_hub else None
    cost["hub_cpu"] = hub.cpu_seconds() if hub is not None else 0.0
    return {
        "enabled": _enabled,
        "step": _step,
        "rank": ranks.global_rank(),
        **counts,
        "counters": counts,
        "queued": queued,
        "last_error": _counters.last_error,
        "series": len(_seen),
        "subscriptions": len(_table.subs),
        "cost_seconds": cost,
        "due_call_us": calls,
        "hub": hub_stats,
        "ring": _ring.state() if _ring is not None else None,
        "url": hub.url if hub is not None else None,
        "config": public_config(),
    }


def names() -> list[dict]:
    """The names traced so far: ``{"name", "layers", "shape", "dtype"}`` each."""
    grouped: dict = {}
    for (name, layer), (shape, dtype) in dict(_seen).items():
        entry = grouped.setdefault(name, {"name": name, "layers": [], "shape": shape, "dtype": dtype})
        if layer is not None:
            entry["layers"].append(layer)
    for entry in grouped.values():
        entry["layers"] = sorted(entry["layers"], key=lambda v: (not isinstance(v, int), str(v)))
    return sorted(grouped.values(), key=lambda e: e["name"])


def reset() -> dict:
    """Zero the counters, the step and the names seen (not the subscriptions)."""
    global _step, _table
    _counters.reset()
    with _cond:
        for key in _cost:
            _cost[key] = 0.0
        _call_us[:] = [0] * CALL_BUCKETS
    _step = 0
    _seen.clear()
    _table = _Table(_table.subs)
    return state()


def flush(timeout: float = 5.0) -> bool:
    """Wait until traced results have reached the clients' queues and those are sent."""
    deadline = time.monotonic() + timeout
    with _cond:
        _seal()  # on the tracing thread; any other waits for that thread to seal them
        _cond.notify_all()
        while _pending or _busy:
            if not (_publisher and _publisher.is_alive()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _cond.wait(min(remaining, 0.1))
    hub = _hub
    return hub.drain(max(0.0, deadline - time.monotonic())) if hub is not None else True


def close(timeout: float | None = None) -> bool:
    """Send what is queued (up to ``timeout``, default 2 s), close the clients (1001) and
    the hub, stop the publisher; True when everything queued went out.  Registered with
    atexit; configuring again restarts them."""
    global _enabled, _publisher, _stop, _unsealed
    _enabled = False
    sent = False
    try:
        sent = flush(2.0 if timeout is None else timeout)
    except Exception as exc:  # noqa: BLE001
        _fail("flush at close", exc)
    _stop_hub()
    with _cond:
        publisher, _stop = _publisher, True
        _cond.notify_all()
    if publisher is not None and publisher is not threading.current_thread():
        publisher.join(5)
    with _cond:
        _publisher, _stop = None, False
        _pending.clear()
        _unsealed = []
    return sent


# Names under which the handle exports these (runtime/facade.py).
trace_state = state


# ---------------------------------------------------------------- hot path


def _first_sight(table: _Table, key: tuple, tensor) -> tuple:
    """A (name, layer) not in the table yet: remember it for ``list``, find the
    subscriptions it matches and cache them in this table."""
    name, layer = key
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"trace({name!r}, ...) takes a tensor, got {type(tensor).__name__}")
    if key not in _seen and len(_seen) < MAX_NAMES:
        _seen[key] = (list(tensor.shape), str(tensor.dtype))
    routes = tuple(sub for sub in table.subs if sub.matches(name, layer))
    if len(table.routes) < MAX_NAMES:
        table.routes[key] = routes
    return routes


class _Plan:
    """The common due call worked out once per (name, layer) and tensor layout: one
    subscription whose tiles go through the fused kernel straight into the forwarder's
    ring (hub: process), launched through Triton's compiled launcher with the grid and
    arguments fused.py computed for the layout.  ``_fast`` runs it in one frame (and
    the launcher's) where the general path takes ~12; ``stale``: the tensor's layout
    changed, plan again; ``failed``: its launch raised, the general path from now on."""

    __slots__ = ("sub", "layout", "device", "launch", "nbytes", "padded", "stale", "failed", "fused", "compress")

    def __init__(self, sub, tensor: torch.Tensor, launch, fused, compress):
        self.sub, self.launch, self.stale, self.failed = sub, launch, False, False
        self.fused, self.compress = fused, compress  # the modules (their settings are read at each call)
        self.device = tensor.get_device()
        self.layout = (tensor.shape, tensor.dtype, self.device, tensor.data_ptr() & 15 == 0)
        self.nbytes = 4 * launch.shape[0] * launch.shape[1] * launch.shape[2]  # float32 [splits, stats, cols]
        self.padded = -(-self.nbytes // ALIGN) * ALIGN  # what a slice of it takes in the ring


def _make_plan(routes: tuple, tensor) -> "_Plan | bool | None":
    """(after a general due call) A plan for this (name, layer), False where none can
    apply (several subscriptions, another compressor, no ring the device writes to),
    None where one may later (the kernel is not compiled yet)."""
    ring = _ring
    fused_spec = getattr(routes[0].compressor, "fused", None)
    if len(routes) != 1 or fused_spec is None or ring is None or not isinstance(tensor, torch.Tensor) \
            or not tensor.is_cuda:
        return False
    if not (ring.direct and ring.pinned and ring.device_address is not None):
        return None
    from . import compress

    fused = compress.fused_kernel()
    launch = fused.planned(tensor, *fused_spec) if fused is not None else None
    return None if launch is None else _Plan(routes[0], tensor, launch, fused, compress)


def _fast(plan: _Plan, key: tuple, tensor, tags: dict) -> bool:
    """The planned due call (see _Plan); False (nothing done) where its conditions do not
    hold now: the general path (_emit) then does the call.  What it does is what
    _compress, _device_stage, fused.column_stats (and _no_hooks), ring.claim (and
    _take), _defer and the queueing do for this case, inline, in one function: a due call's host time grows with its
    Python frames, most of all between a training step's layers, where their code is
    out of the caches (docs/bench-notes/trace.md)."""
    global _tracer
    sub = plan.sub
    step = _step
    following = sub.next_step.get(key)
    if following is not None and following - sub.every <= step < following:
        return True  # not due
    ring, launch, fused, compress = _ring, plan.launch, plan.fused, plan.compress
    if ring is None or not ring.direct or not _stepping or not PER_BATCH_EVENTS or _config["device_timing"] \
            or not isinstance(tensor, torch.Tensor):
        return False  # (a value that is not a tensor: _emit raises TypeError)
    address = tensor.data_ptr()
    device = plan.device
    if (tensor.shape, tensor.dtype, tensor.get_device(), address & 15 == 0) != plan.layout \
            or not tensor.is_contiguous():
        plan.stale = True
        return False
    base, hooks = ring.device_address, fused._hooks
    if base is None or hooks is None or not fused._direct_ok or not compress.DIRECT_LAUNCH \
            or not compress.USE_TRITON or _capturing() or fused._current_device() != device:
        return False
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook  # fused._no_hooks, inline
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
        return False  # a profiler's launch hook wants Triton's dispatch
    start = time.perf_counter()
    sub.next_step[key] = step + sub.every
    stamp = time.time()
    context = ambient.context()
    if context:  # copied now: published later, the microbatch will have moved on
        tags = {**context, **tags}
    try:
        if len(_pending) >= _config["queue"]:  # the publisher is behind: drop, never wait
            _count("dropped")
        else:
            with ring._lock:  # ring._take, inline: the next slice, never wrapping; None when full
                head = ring.head
                offset = head % ring.size
                if offset + plan.nbytes > ring.size:
                    head += ring.size - offset
                    offset = 0
                end = head + plan.padded
                if end - ring.tail > ring.size:
                    offset = None
                else:
                    ring.head = end
            if offset is None:
                _count("dropped")  # the forwarder is behind: its ring is full
            else:
                run, function, metadata = launch.compiled
                run(*launch.grid, 1, fused._current_raw_stream(device), function, metadata, None, None, None,
                    address, base + offset, *launch.args)
                item = _Result([sub], key[0], tags, step, stamp, None, None, None, tensor,
                               (offset, end, "<f4", list(launch.shape)))
                sid, index, _ = _stream_of(device)  # its batch's event goes on this stream (_seal)
                stream = _stream_objects.get((index, sid))
                item.stream = stream if stream is not None else _current_stream(device)
                with _lock:
                    _pending.append(item)
                    _counts["results"] += 1
                    _unsealed.append(item)
                    _tracer = threading.get_ident()
                    if _publisher is None or len(_pending) >= BATCH or stamp - _unsealed[0].time > FLUSH_SECONDS:
                        _seal()
                        _wake_publisher()
    except Exception as exc:  # noqa: BLE001 - tracing must never break the step
        plan.stale = plan.failed = True  # the general path from now on
        _fail(f"trace({key[0]!r})", exc)
    elapsed = time.perf_counter() - start
    _cost["trace_calls"] += elapsed  # statistics: a rare lost update is fine
    _call_us[min(int(elapsed * 1e6).bit_length(), CALL_BUCKETS - 1)] += 1
    return True


def _emit(routes: tuple, key: tuple, tensor, tags: dict) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"trace({key[0]!r}, ...) takes a tensor, got {type(tensor).__name__}")
    step = _step
    due = []
    for sub in routes:
        following = sub.next_step.get(key)
        # Due once per `every` steps; a step counter set backwards starts over.
        if following is None or step >= following or step < following - sub.every:
            due.append(sub)
    if not due:
        return
    start = time.perf_counter()
    try:
        _compress(due, key, tensor, tags, step)
    except Exception as exc:  # noqa: BLE001 - tracing must never break the step
        _fail(f"trace({key[0]!r})", exc)
    elapsed = time.perf_counter() - start
    _cost["trace_calls"] += elapsed  # statistics: a rare lost update is fine
    _call_us[min(int(elapsed * 1e6).bit_length(), CALL_BUCKETS - 1)] += 1


def _compress(due: list, key: tuple, tensor: torch.Tensor, tags: dict, step: int) -> None:
    # A due call's host time is the training thread's cost of tracing (docs/benchmarks.md
    # times each part): the common case, one compressor on a CUDA tensor into the ring,
    # takes the fewest calls; each torch or Python call here costs ~0.2-2 us.
    cuda = tensor.is_cuda
    if tensor.numel() == 0 or (cuda and _capturing()):
        _count("skipped")  # nothing to reduce / no Python runs at graph replay anyway
        return
    for sub in due:
        sub.next_step[key] = step + sub.every
    groups = (due,) if len(due) == 1 else _by_compressor(due)
    stamp = time.time()
    context = ambient.context()
    if context:  # copied now: published later, the microbatch will have moved on
        tags = {**context, **tags}
    device = tensor.get_device() if cuda else None
    timing = cuda and _config["device_timing"]
    deferred = cuda and not timing and _stepping and PER_BATCH_EVENTS
    for subs in groups:
        if len(_pending) >= _config["queue"]:  # the publisher is behind: drop, never wait
            _count("dropped")
            continue
        start = _record(device, True) if timing else None
        try:
            result, slot = _device_stage(subs[0].compressor, tensor, _ring)
        except Exception as exc:  # noqa: BLE001 - a client's parameters that do not fit
            _compress_failed(subs, key[0], exc)
            continue
        if result is None:
            _count("dropped")  # the forwarder is behind: its ring is full
            continue
        if slot is not None and cuda:  # in the ring, or on its way there
            result = None
            event = None if deferred else _record(device, timing)
        elif deferred and result.is_cuda:
            event = None
        else:
            result, event = _mark(result, timing)
        item = _Result(subs, key[0], tags, step, stamp, result, event, start, tensor, slot)
        if event is None and deferred:
            item.stream = _current_stream(device)
        with _lock:
            _pending.append(item)
            _counts["results"] += 1
            if item.stream is not None:
                _defer(item)
            if _publisher is None or len(_pending) >= BATCH or (_unsealed and stamp - _unsealed[0].time > FLUSH_SECONDS):
                _seal()
                _wake_publisher()


def _by_compressor(due: list) -> tuple:
    """Subscriptions with equal compressors share one reduction."""
    groups: dict = {}
    for sub in due:
        groups.setdefault(sub.compressor.key, []).append(sub)
    return tuple(groups.values())


# Whether the current CUDA stream is capturing a graph: torch's own test without its
# Python wrapper (the public one where a build lacks it).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _defer(item) -> None:
    """(caller holds _lock) ``item`` waits for its batch's event (see _seal)."""
    global _tracer
    _unsealed.append(item)
    _tracer = threading.get_ident()


def _seal() -> None:
    """(caller holds _lock) Record the event the unsealed results wait for, one per
    stream, behind their kernels: only on the thread that launched them (another
    thread's stream may be capturing a CUDA graph), and not while capturing."""
    global _unsealed
    if not _unsealed or _tracer != threading.get_ident() or _capturing():
        return
    events: dict = {}
    for item in _unsealed:
        event = events.get(item.stream)
        if event is None:
            event = events[item.stream] = _record(item.stream.device_index, False, item.stream)
        item.event = event
    _unsealed = []


def _take() -> list:
    """(caller holds _lock) The pending results the publisher may take: all of them, or
    those ahead of the first that still waits for its event (order is kept)."""
    if not _unsealed:
        items = list(_pending)
        _pending.clear()
        return items
    first, items = _unsealed[0], []
    while _pending[0] is not first:
        items.append(_pending.popleft())
    return items


def _wake_publisher() -> None:
    """(caller holds _cond) Start the publisher where it is not running, and wake it."""
    if _publisher is None or not _publisher.is_alive():
        _start_publisher()
    _cond.notify_all()


def _device_stage(compressor, tensor: torch.Tensor, ring) -> tuple:
    """(result, slot): the compressor's device stage and, with a forwarder's ring, the
    slice of it the result goes to: written there by the kernel itself (fused tiles),
    or copied there asynchronously; (None, None) when the ring is full."""
    if ring is None:
        return compressor.reduce(tensor), None
    if ring.direct and tensor.is_cuda and (ring.pinned or ring.pin()):
        head = ring.head
        try:
            result = compressor.reduce(tensor, ring.claim)
        except Exception:  # noqa: BLE001
            if ring.head == head:
                raise  # nothing was claimed: the compressor's own error
            ring.direct = False  # a kernel that cannot write host memory here: copy from now on
            _fail("a trace kernel writing to the ring (copying instead)", sys.exc_info()[1])
            result = compressor.reduce(tensor)
        if type(result) is Slice:
            return result, result.slot
    else:
        result = compressor.reduce(tensor)
    if not ring.takes(result):
        return result, None
    slot = ring.put(result)
    return (result, slot) if slot is not None else (None, None)


def _mark(result: torch.Tensor, timing: bool = False):
    """(training thread) The result and an event recorded after its device stage, which
    the publisher's host copy waits for (None off CUDA: a CPU result is ready, another
    accelerator's is copied here, synchronously)."""
    if result.is_cuda:
        return result, _record(result.get_device(), timing)
    return (result if result.device.type == "cpu" else result.to("cpu")), None


def _record(index: int, timing: bool, stream=None):
    """An event from the pool, recorded on ``stream`` (device ``index``'s current one by
    default): a few microseconds, where creating one per call (and a pinned buffer and
    a copy) cost ~25.  Blocking: the publisher sleeps on it, where a spinning wait would
    take a core (maybe the training thread's sibling) until the GPU gets there."""
    pool = _events.get((index, timing))
    if pool is None:
        pool = _events[(index, timing)] = deque()
    try:
        event = pool.pop()
    except IndexError:
        event = torch.cuda.Event(enable_timing=timing, blocking=True)
    _event_record(event, stream or _current_stream(index))
    return event


# torch.cuda.Event.record(stream) without its Python wrapper, where torch has the C method.
_event_record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None) or torch.cuda.Event.record


_stream_objects: dict = {}  # (device index, stream id) -> torch.cuda.Stream
_stream_of = getattr(torch._C, "_cuda_getCurrentStream", None) or (
    lambda index: (torch.cuda.current_stream(index).stream_id, index, 1))  # a torch without the C function


def _current_stream(index: int):
    """torch.cuda.current_stream(index) without its device-index resolution and a new
    Stream object per call (most of an event record's host time, profiled on an H100)."""
    try:
        sid, device, kind = torch._C._cuda_getCurrentStream(index)
    except AttributeError:  # a torch without it: the public way
        return torch.cuda.current_stream(index)
    stream = _stream_objects.get((device, sid))
    if stream is None:
        stream = _stream_objects[(device, sid)] = torch.cuda.Stream(stream_id=sid, device_index=device,
                                                                    device_type=kind)
    return stream


class _Result:
    __slots__ = ("subs", "name", "tags", "step", "time", "host", "event", "start", "shape", "dtype", "slot",
                 "stream")

    def __init__(self, subs, name, tags, step, stamp, result, event, start, tensor, slot=None):
        self.subs, self.name, self.tags, self.step, self.time = subs, name, tags, step, stamp
        self.host, self.event, self.start = result, event, start  # host: on the device until fetched
        self.shape, self.dtype = tensor.shape, tensor.dtype  # (torch.Size, torch.dtype) the hub writes out
        self.slot = slot  # (offset, end, dtype, shape) in the shared ring: the bytes are there, not in host
        self.stream = None  # where the batch's event goes, while the result waits for it (_seal)


def _fetch(items: list) -> None:
    """(publisher) Replace the CUDA results by pinned host copies: on this thread's own
    stream, behind each result's event, results of one device and dtype are joined on
    the device and copied in one piece; one wait covers the batch.  The device results
    stay referenced until the copies are done, so their memory is not reused under them."""
    waiting = [item for item in items if item.event is not None]
    groups: dict = {}
    done: dict = {}  # events to wait for, each once (a batch's results share one)
    for item in waiting:
        if item.slot is None:
            groups.setdefault((item.host.device.index, item.host.dtype), []).append(item)
        else:
            done[item.event] = None  # copied into the forwarder's ring already: only wait
    for (index, dtype), group in groups.items():
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        with torch.cuda.stream(stream):
            for event in dict.fromkeys(item.event for item in group):
                stream.wait_event(event)
            flat = torch.cat([item.host.reshape(-1) for item in group]) if len(group) > 1 \
                else group[0].host.reshape(-1)
            host = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # sleep on it, do not spin
            event.record(stream)
        done[event] = None
        offset = 0
        for item in group:
            n = item.host.numel()
            item.host, offset = host[offset: offset + n].view(item.host.shape), offset + n
    for event in done:
        event.synchronize()
    pooled = {}  # each event back to its pool once
    for item in waiting:
        if item.slot is not None:
            item.host = None
        if item.start is not None:
            with _lock:
                _cost["device_reduce"] += item.start.elapsed_time(item.event) / 1e3
            _events[(item.event.device.index, True)].append(item.start)
        pooled[item.event] = item.start is not None
        item.event = item.start = None
    for event, timing in pooled.items():
        _events[(event.device.index, timing)].append(event)


def _compress_failed(subs: list, name: str, exc: Exception) -> None:
    from .compress import TooLarge

    _count("too_large" if isinstance(exc, TooLarge) else "compress_errors")
    message = f"{name}: {exc}" if isinstance(exc, (ValueError, TypeError, IndexError, RuntimeError)) \
        else f"{name}: {type(exc).__name__}: {exc}"
    for sub in subs:
        if not sub.reported:  # once per subscription
            sub.reported = True
            hub = _hub
            if hub is not None:
                hub.report(sub, message)


# ---------------------------------------------------------------- publisher


def _start_publisher() -> None:
    """(caller holds _cond)"""
    global _publisher
    _publisher = threading.Thread(target=_publish_loop, name="source-patch-trace-publisher", daemon=True)
    _publisher.start()


def _publish_loop() -> None:
    """Publish in batches: at each step end (trace_step), when BATCH results wait, or
    every FLUSH_SECONDS.  A wake-up per result would contend for the GIL with the
    training thread at every layer, right when it returns from a device sync."""
    global _busy
    while True:
        with _cond:
            items = _take()
            if not items:
                if _stop:
                    return
                _cond.wait(FLUSH_SECONDS)
                items = _take()
            _busy += len(items)
        if not items:
            _share_state()
            continue
        cpu = time.thread_time()
        try:
            _fetch(items)  # this thread waits for the copies, never the trainer
            _share_state()  # before the frames: a client that got them and asks sees them counted
            hub = _hub
            if hub is not None:
                hub.publish(items, ranks.global_rank())  # frames here, or sent to the forwarder
        except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
            _fail("publishing", exc)
        finally:
            items = None
            with _cond:
                _busy = 0
                _cost["publisher_cpu"] += time.thread_time() - cpu
                _cond.notify_all()


_shared: tuple = ()


def _share_state() -> None:
    """(publisher thread) A hub in its own process answers stats, list and hello from a
    snapshot of this process's counters: sent when they changed (the names only when
    new ones were seen), at most once per wake-up."""
    global _shared
    hub = _hub
    if hub is None or not hasattr(hub, "share_state"):
        return
    try:
        with _cond:
            snapshot = {**_counts, "cost_seconds": dict(_cost), "due_call_us": list(_call_us)}
        snapshot.update(step=_step, rank=ranks.global_rank(), series=len(_seen),
                        ring=_ring.state() if _ring is not None else None)
        key = tuple(snapshot[k] for k in ("step", "series", *_COUNTERS))
        if key != _shared:
            series_changed = not _shared or _shared[1] != key[1]
            _shared = key
            hub.share_state(snapshot, names() if series_changed else None)
    except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
        _fail("sharing state with the trace forwarder", exc)


# ---------------------------------------------------------------- subscriptions (from the hub)


def set_subscriptions(subs) -> None:
    """Install the subscriptions of all clients (the hub calls this on every change)."""
    global _table
    _table = _Table(tuple(subs))
    if subs:
        _subscribed.set()
    else:
        _subscribed.clear()


def current_step() -> int:
    return _step


# ---------------------------------------------------------------- failures


def _count(key: str, n: int = 1) -> None:
    _counters.add(key, n)


def _fail(where: str, exc: BaseException) -> None:
    """Count; log the first failure of each kind at WARNING; keep the latest."""
    _counters.fail(where, exc)


# ---------------------------------------------------------------- configuration and hub


def _apply(config: dict) -> None:
    global _config, _enabled
    _enabled = False
    _config = dict(config, dir=os.path.abspath(os.path.expanduser(config["dir"])))
    from . import compress

    compress.USE_TRITON = _config["triton"]
    compress.DIRECT_LAUNCH = _config["triton_launch"] == "direct"
    serve = bool(_config["enable"] and _config["port"])
    if serve and _config["ranks"] is not None:
        serve = ranks.global_rank() in settings.IntSet(_config["ranks"])
    started = _sync_hub(serve)
    _enabled = _hub is not None
    graphs.use(_enabled, trace, _fail)
    if started and _config["wait"] and not _table.subs:
        print(f"source-patch trace: waiting up to {_config['wait']:g} s for a client to subscribe",
              file=sys.stderr, flush=True)
        _subscribed.wait(_config["wait"])


def _sync_hub(serve: bool) -> bool:
    """Start, restart or stop the hub to match the configuration; True if one started."""
    global _hub, _hub_key, _ring
    key = (_config["host"], _config["port"], _config["token"], _config["max_message"], _config["dir"],
           _config["hub"]) if serve else None
    if key == _hub_key:
        if _hub is not None:
            _hub.config = _config  # queue sizes and timeouts apply at once
        return False
    _stop_hub()
    if key is None:
        return False
    _hub_key = key
    try:
        _hub = _new_hub()
    except Exception as exc:  # noqa: BLE001 - no hub: nothing traced, training goes on
        _fail("starting the trace hub", exc)
        return False
    _ring = getattr(_hub, "ring", None)
    if _publisher is None and hasattr(_hub, "share_state"):
        with _cond:
            _start_publisher()  # it sends the forwarder this process's state, traced or not
    return True


def _new_hub():
    """A hub in a forwarder process (hub: process), or in a thread here (hub: thread,
    or when the forwarder cannot start: said once, then served from a thread)."""
    from . import hub

    runtime = sys.modules[__name__]
    if _config["hub"] == "process":
        from .forwarder import Forwarder, ForwarderUnavailable

        try:
            return Forwarder(runtime, _config)
        except ForwarderUnavailable as exc:
            _fail("starting the trace forwarder (serving from a thread instead)", exc)
    return hub.Hub(runtime, _config)


def _stop_hub() -> None:
    global _hub, _hub_key, _shared, _ring
    hub, _hub, _hub_key, _shared, _ring = _hub, None, None, (), None
    set_subscriptions(())
    if hub is not None:
        try:
            hub.stop()
        except Exception as exc:  # noqa: BLE001
            _fail("stopping the trace hub", exc)


def _after_fork_in_child() -> None:
    """A forked child (a data loader worker) inherits no threads: it does not trace."""
    global _enabled, _lock, _cond, _pending, _busy, _publisher, _stop, _hub, _hub_key, _table, _counters, _counts, \
        _ring, _unsealed, _tracer
    _enabled = False
    _lock = threading.Lock()
    _cond = threading.Condition(_lock)
    _unsealed, _tracer = [], None
    _counters = Counters(_COUNTERS, "source_patch.trace", "trace", lock=_cond)
    _counts = _counters.counts
    _pending, _busy, _publisher, _stop = deque(), 0, None, False
    _events.clear()  # CUDA objects of the parent: unusable here
    _streams.clear()
    if _hub is not None:
        try:
            _hub.close_sockets()
        except Exception:  # noqa: BLE001
            pass
    _hub = _hub_key = _ring = None
    ring_module = sys.modules.get(__package__ + ".ring")
    if ring_module is not None:
        ring_module.forget()  # the parent's: writing to it would reach the parent's forwarder
    ranks.forget()
    _table = _Table()


# ``__sp__.trace`` is the function; it also carries the control API, so a script that
# holds only the handle can configure tracing (``__sp__.trace.configure(...)``).
for _api in (configure, configure_from_settings, public_config, url, state, names, reset, flush, close,
             trace_step):
    setattr(trace, _api.__name__, _api)
trace.trace, trace.trace_state = trace, state
configure_from_settings()
atexit.register(close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
