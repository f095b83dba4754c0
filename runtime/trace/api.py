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
  (slice or result, event, meta): it only launches.  The publisher thread
  (publisher.py) takes the queue in batches and hands them to the hub.  Full queues
  drop and count; nothing blocks.
* Failures are counted, logged once per kind, and never raised into training, except
  a call site's own programming error (a value that is not a tensor).

This module is the capability's ground floor: the call sites, the hot path and all the
state the other parts share.  Those (control.py, lifecycle.py, publisher.py, device.py,
plan.py) import it; it imports none of them but device.py and plan.py, which read none
of its state.  What the hot path reads stays this module's private globals (no attribute
lookup on a call site's path; native_launch.cpp reads them from this module's dict);
what the others read or change is public here: a few globals (``hub``, ``hub_key``,
``subscribed``) and the functions under "the state, for the capability's other modules".
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from ..core import events as core_events, ranks, tags as ambient
from ..core.adapters import graph_stage
from ..core.failures import Counters
from . import device, graphs, plan  # (plan: see _make_plan)
from .device import (capturing as _capturing, current_stream as _current_stream, event_record as _event_record,
                     know_stream as _know_stream, stage as _device_stage, stage_failed as _compress_failed,
                     stream_of as _stream_of)
from .plan import Plan as _Plan

__all__ = ["trace", "trace_step", "set_subscriptions", "current_step", "names", "snapshot", "due_call_us", "fail"]

# -- The trace state, in one place.  The hot path reads it as globals of this module
# (no attribute lookup); the capability's other modules import this one and read and
# change it through it (its public globals and functions), never through a copy: clear,
# stop_publisher and _after_fork_in_child rebind parts of it.

# The one thing a disabled call site reads.
_enabled = False

_step = 0
_config: dict = {}
MAX_NAMES = 1 << 14  # (name, layer) pairs remembered; more are traced but not listed
BATCH = 64            # results that wake the publisher before the step ends
FLUSH_SECONDS = 0.2   # ... or this long after the batch's first result (see take_batch)
DURATIONS = 4096      # due calls' durations kept unfolded at most (see _durations), where no batch goes out


class _Table:
    """The subscriptions of all clients, and which of them each (name, layer) hits.
    Replaced as a whole when subscriptions change, so the training thread never
    sees a half-built one."""

    __slots__ = ("subs", "routes", "plans")

    def __init__(self, subs: tuple = ()):
        self.subs = subs
        self.routes: dict = {}
        self.plans: dict = {}  # (name, layer) -> _Plan, or False where none applies (see _fast)


class Result:
    """One traced result on its way to the hub: queued by the training thread (_compress,
    or _seal from a planned call's record), handed over by the publisher (publisher.py)."""

    __slots__ = ("subs", "name", "tags", "step", "time", "host", "event", "start", "shape", "dtype", "slot",
                 "stream")

    def __init__(self, subs, name, tags, step, stamp, result, event, start, shape, dtype, slot=None):
        self.subs, self.name, self.tags, self.step, self.time = subs, name, tags, step, stamp
        self.host, self.event, self.start = result, event, start  # host: on the device until fetched
        self.shape, self.dtype = shape, dtype  # the traced tensor's (torch.Size, torch.dtype), which the hub writes out
        self.slot = slot  # (offset, end, dtype, shape) in the shared ring: the bytes are there, not in host
        self.stream = None  # where the batch's event goes, while the result waits for it (_seal)


_table = _Table()
_seen: dict = {}             # (name, layer) -> (shape, dtype) at first sight
subscribed = threading.Event()  # set while a client subscribes to anything (lifecycle's `wait`)

# -- results on their way to the hub (guarded by _lock; the hot path takes the lock
# itself, a C call, where the condition's own __enter__ is a Python frame)
_lock = threading.Lock()
_cond = threading.Condition(_lock)
_pending: deque = deque()
_busy = 0                    # results the publisher has taken but not yet handed over
_publisher: threading.Thread | None = None  # started with the hub (start_publisher: lifecycle.py)
_stop = False
# The publisher sleeps without a timeout while it has nothing to hand over (take_batch):
# _idle says so.  _wakes counts the wake-ups that ask it to take what waits now (a step's
# end, a full batch, a due call FLUSH_SECONDS after the batch's first result, a flush:
# _wake_publisher); a result that waits for no event of its batch (one on the host, with
# device_timing, before the first trace_step), queued while it sleeps, nudges it instead,
# and it gives that result's batch FLUSH_SECONDS.
_idle = False
_wakes = 0
_taken_at = 0  # _wakes when the publisher last took what waited
_ring = None                 # ring.Ring the forwarder reads results from (hub: process)
# The hub (hub.Hub, or forwarder.Forwarder) while serving, and the configuration it serves
# (its host, port, ...): set by serve and unserve (lifecycle.py), read by the others.
hub = None
hub_key: tuple | None = None

COUNTERS = ("results", "dropped", "skipped", "errors", "compress_errors", "too_large", "records",
            "records_dropped")
_counters = Counters(COUNTERS, "source_patch.trace", "trace", lock=_cond)
_counts = _counters.counts  # written under _cond, like the queue
# What tracing costs the process, in seconds: the training thread's time inside due
# trace() calls (compressor launches, an event), the publisher's CPU time, and (with
# the device_timing setting) the device time of the reductions, from CUDA events.
_cost = {"trace_calls": 0.0, "publisher_cpu": 0.0, "device_reduce": 0.0}
# Due trace() calls by duration: _call_us[i] counts those of 2**(i-1) to 2**i us (i = 0:
# under 1 us): whether a mean is many slow calls or a few long waits (for the GIL, for
# the launch queue).  Indexed by the bit length itself, so that no min() runs per call;
# due_call_us() gives CALL_BUCKETS of them, the last counting everything longer.
CALL_BUCKETS = 20
_call_us = [0] * 64  # a 64-bit count of microseconds has at most 64 bits
# Due calls' durations (seconds) not yet in _cost and _call_us: a due call appends one,
# the publisher folds them in (_fold_durations) at each wake-up, state() before reading.
_durations: list = []
# Records: small JSON objects other capabilities hand to core/events.emit under the names in
# RECORD_NAMES (the sentinels' metric and event lines), forwarded to the clients that follow
# them.  Subscribed to only while a client follows (set_following: the hub says so), so with
# nobody following an emit stays core/events' one truthiness test and nothing is queued or
# woken.  Each is queued as (number, name, value), numbered from 1 for the process's life
# (a client asks for those after a number it has), and JSON-encoded by the publisher.
RECORD_NAMES = frozenset({"sentinels.metric", "sentinels.event"})
RECORD_QUEUE = 4096           # records waiting for the publisher; more are dropped (records_dropped)
RECORD_BYTES = 1 << 16        # a record's JSON at most; a longer one is dropped (records_dropped)
_posts: deque = deque()       # (number, name, value) waiting for the publisher (under _lock)
_posted = 0                   # the last record's number
_following = False            # a client follows records
_unfollow = None              # core/events' unsubscribe while subscribed
_events: dict = {}   # (device index, timing) -> deque of CUDA events the publisher is done with
# A process that calls trace_step gets one event per stream per batch, recorded when the
# batch is handed over (step end, a full batch, FLUSH_SECONDS), not one per result: the
# event record was the largest part of a due call in training (docs/benchmarks.md).
# The publisher never records on the training thread's stream (it might be capturing a
# CUDA graph): results without their event wait in _pending for the tracing thread.
PER_BATCH_EVENTS = True
_stepping = False            # trace_step has been called: batches end
_unsealed: list = []         # results in _pending waiting for their batch's event
# Planned results (api._fast) waiting for their batch's event, as records: (plan, name,
# tags, step, time, ring offset, slice end, stream); _seal makes them results and
# queues them (a result object per due call cost it ~2 us cold).
_records: list = []
_tracer: int | None = None   # the thread that traced them (the one that may record it)
# What the planned due call (_fast) would check at every call and can check once a step
# (_arm: at each trace_step and wherever one of them changes): the ring it writes to where
# every condition for it holds (None: the general path), Triton's launch hooks as the
# lists _fast tests at each call (_hook_lists: a profiler adds a hook at any time) and the
# offset that turns its one clock's reading into a result's time.
_fast_ring = None
_hook_calls: tuple | None = None
_clock_offset = 0.0
# device's stream cache, read by _fast.  Assigned, not imported: CPython calls a
# method of an imported name through a bound method (LOAD_ATTR), of any other through LOAD_METHOD.
_known_streams = device.known_streams
_get_ident = threading.get_ident


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
    plan = table.plans.get(key)  # made only where routes are: the planned call needs no other lookup
    if plan and (plan.due or _fast)(plan, key, tensor, tags):  # due: the compiled call (plan.py), else _fast
        return tensor
    routes = table.routes.get(key)
    if routes is None:
        routes = _first_sight(table, key, tensor)
    if routes:
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
        _arm()
        if _pending or _records:
            with _lock:
                _seal()
                _wake_publisher()  # the step's results go out together, between steps
        elif len(_durations) > DURATIONS:  # due calls whose results were all dropped: no batch folds them
            _fold_durations()
    except Exception as exc:  # noqa: BLE001
        fail("trace_step", exc)
    return success


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


def _fast(plan: _Plan, key: tuple, tensor, tags: dict) -> bool:
    """The planned due call (see _Plan); False (nothing done) where its conditions do not
    hold now: the general path (_emit) then does the call.  What it does is what
    _compress, _device_stage, fused.column_stats (and _no_hooks), ring.claim (and
    _take) and the queueing do for this case, inline, in one function, with what holds
    for a whole step checked once a step (_arm) and the result queued as a record
    (_seal makes it one): a due call between a training step's layers runs cold, and
    each object it touches is a cache miss (docs/bench-notes/overhead.md)."""
    global _tracer
    start = time.perf_counter()  # the due call's duration (state()'s due_call_us) covers all of it
    sub = plan.sub
    step = _step
    following = sub.next_step.get(key)
    if following is not None and following - sub.every <= step < following:
        return True  # not due
    ring = _fast_ring
    if ring is None:
        return False  # (_arm: not every condition for the planned call holds)
    native = plan.native  # its launch checks the layout itself, in C++ (native.py)
    if native is None:
        if not isinstance(tensor, torch.Tensor):
            return False  # (a value that is not a tensor: _emit raises TypeError)
        address = tensor.data_ptr()
        if not (tensor.shape == plan.shape and tensor.dtype is plan.dtype and tensor.get_device() == plan.device
                and (address & 15 == 0) == plan.aligned and tensor.is_contiguous()):
            plan.stale = True  # plan again
            return False
    enter, leave = _hook_calls  # fused._no_hooks, from the chains' own lists (_arm)
    if enter or leave:
        return False  # a profiler's launch hook wants Triton's dispatch
    if native is None:  # (_stream_for, inline; the native launch reads the stream itself: below)
        sid, index, _ = _stream_of(-1)  # the current device and its stream, in one torch call
        if index != plan.device or (sid and _capturing()):  # (stream 0, the default one, is never captured)
            return False  # no Python runs at a graph's replay
    context = ambient._context  # ambient.context(), inline
    if context:  # copied now: published later, the microbatch will have moved on
        tags = {**context, **tags}
    lock = _lock  # taken and given back by hand: `with` costs ~0.8 µs more, cold (two special-method lookups)
    try:
        lock.acquire()  # the ring's claims take it too (lifecycle): one lock for the slice and the queue
        try:
            if len(_pending) >= _config["queue"]:  # the publisher is behind: drop, never wait
                _counts["dropped"] += 1
            else:  # ring._take, inline: the next slice, never wrapping
                head = ring.head
                offset = head % ring.size
                if offset + plan.nbytes > ring.size:
                    head += ring.size - offset
                    offset = 0
                end = head + plan.padded
                if end - ring.tail > ring.size:
                    _counts["dropped"] += 1  # the forwarder is behind: its ring is full
                else:
                    output = ring.device_address + offset
                    if native is None:
                        stream, raw = _known_streams.get((index, sid)) or _know_stream(index, sid)
                        args, at = plan.args, plan.at_input
                        args[plan.at_stream], args[at], args[at + 1] = raw, address, output
                        plan.call(*args)
                    else:
                        stream = plan.stream
                        status = plan.native_launch(native, tensor, output)  # on the default stream, if current
                        if status == 2:  # another stream (or device) is current
                            current = _stream_for(plan)
                            if current is None:
                                return False
                            stream, raw = current
                            status = plan.native_launch(native, tensor, output, raw)
                        if status:
                            if status == 1:  # another layout (or not a plain tensor): nothing launched
                                plan.stale = True
                                return False
                            raise RuntimeError(f"cuLaunchKernel: CUDA error {-status}")
                    ring.head = end
                    stamp = start + _clock_offset
                    _records.append((plan, key[0], tags, step, stamp, offset, end, stream))
                    _tracer = _get_ident()
                    if _publisher is None or len(_records) >= BATCH or stamp - _records[0][4] > FLUSH_SECONDS:
                        _seal_and_wake()
        finally:
            lock.release()
    except Exception as exc:  # noqa: BLE001 - tracing must never break the step
        _fast_failed(plan, key, exc)
    sub.next_step[key] = step + sub.every  # (not before: a call _emit takes over is still due)
    _durations.append(time.perf_counter() - start)
    return True


def _seal_and_wake() -> None:
    """(caller holds _cond) A planned call's batch is full, or due out: queue it (also
    called by the compiled due call, native_launch.cpp)."""
    _seal()
    _wake_publisher()


def _fast_failed(plan: _Plan, key: tuple, exc: BaseException) -> None:
    """A planned call raised (_fast, or the compiled due call): counted, and the general
    path takes this (name, layer) from now on (False: no plan, none made again)."""
    plan.stale = plan.failed = True
    _table.plans[key] = False
    fail(f"trace({key[0]!r})", exc)


def _stream_for(plan: _Plan) -> tuple | None:
    """(Stream, raw handle) of the current stream where a planned launch may go on it, else
    None: another device is current, or the stream is capturing a CUDA graph (stream 0, the
    default one, never is), whose replays run no Python."""
    sid, index, _ = _stream_of(-1)
    if index != plan.device or (sid and _capturing()):
        return None
    return _known_streams.get((index, sid)) or _know_stream(index, sid)


def _arm() -> None:
    """Work out what _fast reads instead of checking each call (see _fast_ring)."""
    global _fast_ring, _hook_calls, _clock_offset
    ring, compress = _ring, sys.modules.get(__package__ + ".compress")
    fused = sys.modules.get(__package__ + ".fused")
    hooks = getattr(fused, "_hooks", None)
    ready = (ring is not None and ring.direct and ring.device_address is not None and _stepping and PER_BATCH_EVENTS
             and not _config.get("device_timing") and hooks is not None and fused._direct_ok
             and compress.DIRECT_LAUNCH and compress.USE_TRITON)
    _fast_ring, _hook_calls = (ring, _hook_lists(hooks)) if ready else (None, None)
    _clock_offset = time.time() - time.perf_counter()
    _arm_compiled(_fast_ring)


def _arm_compiled(ring) -> None:
    """Hand the compiled due call (native_launch.cpp, where loaded) what it reads of the
    state besides api's globals: the ring it claims slices of, or None: it hands every
    call to _fast."""
    native = sys.modules.get(__package__ + ".native")
    module = native._loaded[0] if native is not None and native._loaded else None
    if module is None:
        return
    if ring is None:
        module.arm(globals(), ambient.__dict__, None)
    else:
        module.arm(globals(), ambient.__dict__, ring, ring.cursor_address, ring.size, ring.device_address, BATCH,
                   FLUSH_SECONDS, _clock_offset)


def _make_plan(routes: tuple, tensor) -> "_Plan | bool | None":
    """plan.make for this state's ring; a compiled due call in the plan learns where the
    state is (it reads this module's dict: _arm_compiled), once made.  (The module is
    imported as a name, ``plan``, which is also _fast's local: CPython compiles a call of
    an attribute of a name the module imports, ``plan.native_launch(...)`` there, as an
    attribute load, not LOAD_METHOD, and _fast's bytecode stays what it was measured as.)"""
    made = plan.make(routes, tensor, _ring)
    if made and made.due is not None:
        _arm_compiled(_fast_ring)
    return made


def _copying(exc: BaseException) -> None:
    """(device.stage) A kernel could not write to the ring: copied there from now on
    (ring.direct is off), said once; the planned call no longer applies (_arm)."""
    _arm()
    fail("a trace kernel writing to the ring (copying instead)", exc)


def _hook_lists(hooks) -> tuple:
    """Triton's launch hooks (enter, exit) as lists: a chain's own list, so that a hook a
    profiler adds to it later is seen at the next call (reading the chains from Triton's
    knobs at each call cost ~1-2 µs cold); a hook set in a chain's place, as a list of
    it, seen from the next _arm (trace_step)."""
    return tuple(getattr(hook, "calls", [hook] if hook else [])
                 for hook in (getattr(hooks, "launch_enter_hook", None), getattr(hooks, "launch_exit_hook", None)))


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
        fail(f"trace({key[0]!r})", exc)
    _durations.append(time.perf_counter() - start)
    if len(_durations) > DURATIONS:  # results all dropped, and no trace_step: no batch folds them
        _fold_durations()


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
            result, slot = _device_stage(subs[0].compressor, tensor, _ring, _copying)
        except Exception as exc:  # noqa: BLE001 - a client's parameters that do not fit
            _count(_compress_failed(subs, key[0], exc, hub))
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
        item = Result(subs, key[0], tags, step, stamp, result, event, start, tensor.shape, tensor.dtype, slot)
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
            elif _idle and item.stream is None and not _unsealed:  # ready now (a host result, device_timing, no
                _cond.notify_all()  # trace_step yet), the publisher asleep: a nudge, it gives the batch FLUSH_SECONDS


def _by_compressor(due: list) -> tuple:
    """Subscriptions with equal compressors share one reduction."""
    groups: dict = {}
    for sub in due:
        groups.setdefault(sub.compressor.key, []).append(sub)
    return tuple(groups.values())


def _defer(item) -> None:
    """(caller holds _lock) ``item`` waits for its batch's event (see _seal)."""
    global _tracer
    _unsealed.append(item)
    _tracer = threading.get_ident()


def _seal() -> None:
    """(caller holds _lock) Record the event the unsealed results wait for, one per
    stream, behind their kernels: only on the thread that launched them (another
    thread's stream may be capturing a CUDA graph), and not while capturing.  The
    planned call's records become results here, queued behind the general path's."""
    global _unsealed
    if not (_unsealed or _records) or _tracer != threading.get_ident() or _capturing():
        return
    for plan, name, tags, step, stamp, offset, end, stream in _records:
        item = Result(plan.subs, name, tags, step, stamp, None, None, None, plan.shape, plan.dtype,
                      (offset, end, "<f4", plan.dims))
        item.stream = stream
        _pending.append(item)
        _unsealed.append(item)
    _counts["results"] += len(_records)
    _records.clear()
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


def _take_all() -> list:
    """(caller holds _lock) _take's results, then the records queued (tuples: publisher.loop
    tells them apart)."""
    items = _take()
    if _posts:
        items += _posts
        _posts.clear()
    return items


def _wake_publisher() -> None:
    """(caller holds _cond) Wake the publisher (started with the hub: start_publisher) to
    take what waits now."""
    global _wakes
    _wakes += 1
    _cond.notify_all()


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


# ---------------------------------------------------------------- records (core/events -> the clients that follow them)


def set_following(on: bool) -> None:
    """(the hub, or the forwarder's reader thread, as clients follow records or stop; unserve)
    Subscribe to core/events while a client follows records, and only then."""
    global _following, _unfollow
    with _lock:
        _following = bool(on)
        if on and _unfollow is None:
            _unfollow = core_events.subscribe(_on_record)
        elif not on and _unfollow is not None:
            _unfollow, unfollow = None, _unfollow
            unfollow()


def _on_record(event) -> None:
    """(any thread that emits; core/events' subscriber while a client follows) Queue a
    record: never waits, drops and counts when the queue is full."""
    if event.name in RECORD_NAMES and _following:
        post(event.name, event.value)


def post(name: str, value) -> bool:
    """Queue ``value`` (a JSON-able dict) under ``name`` for the clients that follow records:
    one append under the queue's lock, a nudge where the publisher sleeps (it gives the
    batch FLUSH_SECONDS, or a step's end takes it sooner).  False when dropped: nobody
    follows, no publisher, or the queue is full (counted)."""
    global _posted
    if not _following:
        return False
    with _lock:
        if _publisher is None or len(_posts) >= RECORD_QUEUE:
            _counts["records_dropped"] += 1
            return False
        _posted += 1
        _posts.append((_posted, name, value))
        _counts["records"] += 1
        if _idle:
            _cond.notify_all()
    return True


def following() -> bool:
    return _following


# ---------------------------------------------------------------- subscriptions (from the hub)


def set_subscriptions(subs) -> None:
    """Install the subscriptions of all clients (the hub calls this on every change)."""
    global _table
    _table = _Table(tuple(subs))
    if subs:
        subscribed.set()
    else:
        subscribed.clear()


def _fold_durations() -> None:
    """Count the due calls' durations into _cost and _call_us (a rare lost update, two
    threads folding at once or a call appending as the list is swapped, is fine)."""
    global _durations
    taken, _durations = _durations, []
    for elapsed in taken:
        _call_us[int(elapsed * 1e6).bit_length()] += 1
    _cost["trace_calls"] += sum(taken)


def due_call_us() -> list:
    """(caller holds _cond) The due calls by duration, CALL_BUCKETS buckets (the
    durations not yet counted folded in first: call it before reading _cost)."""
    _fold_durations()
    return _call_us[:CALL_BUCKETS - 1] + [sum(_call_us[CALL_BUCKETS - 1:])]


def current_step() -> int:
    return _step


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


def snapshot() -> dict:
    """What tracing has done in this process: whether it is on, the step, the rank, the
    counters, the results queued, the latest failure, the series seen, the subscriptions,
    the cost (the hub's too), the due calls by duration and the ring.  control.state()
    adds the hub and the configuration; a forwarder's hub answers from it (asked for
    when a client wants it: forwarder.Forwarder._share_state)."""
    with _cond:
        counts = dict(_counts)
        queued = len(_pending) + len(_records) + _busy
        records_queued = len(_posts)
        calls = due_call_us()
        cost = dict(_cost)
    serving, ring = hub, _ring
    cost["hub_cpu"] = serving.cpu_seconds() if serving is not None else 0.0
    return {"enabled": _enabled, "step": _step, "rank": ranks.global_rank(), **counts, "counters": counts,
            "queued": queued, "last_error": _counters.last_error, "series": len(_seen),
            "subscriptions": len(_table.subs), "following": _following, "records_queued": records_queued,
            "cost_seconds": cost, "due_call_us": calls,
            "ring": ring.state() if ring is not None else None}


# ---------------------------------------------------------------- the state, for the capability's other modules
# control.py, lifecycle.py and publisher.py change the state through these (each under
# the state's lock where the hot path's readers need one), never by assigning to it.


def counts() -> dict:
    """(control.state) The counters alone, under the state's lock: not a whole snapshot."""
    return _counters.snapshot()


def last_error() -> str | None:
    return _counters.last_error


def config() -> dict:
    """The configuration applied (lifecycle.apply's): read, never changed in place."""
    return _config


def set_config(applied: dict) -> None:
    """(lifecycle, under control's lock) Call sites stop tracing while ``applied`` is put in
    place (set_enabled turns them on again); plans are made again, for the launch it asks for."""
    global _enabled, _config
    _enabled = False
    _config = applied
    _table.plans.clear()


def is_enabled() -> bool:
    """Whether call sites trace now."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Call sites trace (or not) from now on; the planned due call armed for it (_arm)."""
    global _enabled
    _enabled = on
    _arm()


def serve(started, key: tuple) -> None:
    """(lifecycle) The hub ``started`` serves the configuration ``key`` (None: it did not
    start, and is not tried again for that configuration).  Where it reads a ring (a
    forwarder's), claims of the ring's slices take the queue's lock: the planned due call
    takes one lock for its slice and its place in the queue."""
    global hub, hub_key, _ring
    hub, hub_key = started, key
    _ring = getattr(started, "ring", None)
    if _ring is not None:
        _ring.lock = _lock


def unserve():
    """(lifecycle) Forget the hub, its ring and its clients' subscriptions; the hub (to
    stop), or None."""
    global hub, hub_key, _ring
    stopping, hub, hub_key, _ring = hub, None, None, None
    _arm()
    set_subscriptions(())
    set_following(False)
    return stopping


def start_publisher(loop) -> None:
    """(lifecycle, with a hub) Run ``loop`` (publisher.loop) as the publisher thread where
    none is alive: what is queued from now on reaches the hub."""
    global _publisher
    with _cond:
        if _publisher is None or not _publisher.is_alive():
            _publisher = threading.Thread(target=loop, name="source-patch-trace-publisher", daemon=True)
            _publisher.start()


def take_batch() -> list | None:
    """(the publisher thread) The next results to hand over; None once stop_publisher
    ends it.  What waits is taken when the tracing thread hands a batch over (a step's
    end, a full batch, a due call FLUSH_SECONDS after the batch's first result: _wakes),
    or at a flush or a stop.  Results that wait for no event of their batch (_seal: a
    host result, device_timing, no trace_step yet) are taken FLUSH_SECONDS after the
    publisher finds them, or at the step's end if sooner; queued while it sleeps, they
    nudge it.  With nothing to take it sleeps without a timeout: no client, or no
    results, and it never wakes (issue 59: a timed wait woke it 5 times a second to
    find nothing)."""
    global _busy, _idle, _taken_at
    with _cond:
        while True:
            if _wakes != _taken_at or _stop:  # handed over, a flush, a stop: take what waits now
                _taken_at = _wakes
                items = _take_all()
                if items or _stop:
                    break
            elif _posts or (_pending and not (_unsealed and _pending[0] is _unsealed[0])):  # ready, not handed over
                _cond.wait(FLUSH_SECONDS)  # the rest of their batch (a step's end cuts it short)
                _taken_at = _wakes
                items = _take_all()
                if items:
                    break
                continue
            _idle = True
            try:
                _cond.wait()  # until a batch is handed over, a result nudges it, a flush or a stop
            finally:
                _idle = False
        if not items:
            return None  # stopped
        _busy += len(items)
    _fold_durations()  # bounded: each batch folds its due calls' durations (trace_step, _emit: where none goes out)
    return items


def batch_done(cpu: float) -> None:
    """(the publisher thread) take_batch's batch is handed over (or failed) in ``cpu``
    seconds of the thread's time: drain's wait goes on."""
    global _busy
    with _cond:
        _busy = 0
        _cost["publisher_cpu"] += cpu
        _cond.notify_all()


def return_events(waiting: list) -> None:
    """(the publisher thread, after the waits) Count the device time of timed results and
    give each event back to its pool (which _record takes from) once."""
    pooled = {}
    for item in waiting:
        if item.start is not None:
            with _lock:
                _cost["device_reduce"] += item.start.elapsed_time(item.event) / 1e3
            _events[(item.event.device.index, True)].append(item.start)
        pooled[item.event] = item.start is not None
        item.event = item.start = None
    for event, timing in pooled.items():
        _events[(event.device.index, timing)].append(event)


def drain(deadline: float) -> bool:
    """(control.flush) Wait until the queued results are handed to the hub (those waiting
    for their batch's event sealed first, on the tracing thread; another thread waits for
    that one to seal them), or no publisher runs; False at ``deadline`` (time.monotonic)."""
    with _cond:
        _seal()
        _wake_publisher()
        while _pending or _records or _posts or _busy:
            if not (_publisher and _publisher.is_alive()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _cond.wait(min(remaining, 0.1))
    return True


def stop_publisher() -> None:
    """(control.close) End the publisher thread (waiting 5 s at most) and drop what is still
    queued; start_publisher starts one again."""
    global _publisher, _stop, _unsealed
    with _cond:
        thread, _stop = _publisher, True
        _wake_publisher()
    if thread is not None and thread is not threading.current_thread():
        thread.join(5)
    with _cond:
        _publisher, _stop = None, False
        _pending.clear()
        _unsealed = []
        _records.clear()
        _posts.clear()


def clear() -> None:
    """(control.reset) Zero the counters, the costs, the step and the names seen; the
    subscriptions stay (their routes and plans made again)."""
    global _durations, _step, _table
    _counters.reset()
    with _cond:
        for key in _cost:
            _cost[key] = 0.0
        _call_us[:] = [0] * len(_call_us)
        _durations = []
    _step = 0
    _seen.clear()
    _table = _Table(_table.subs)


# ---------------------------------------------------------------- failures


def _count(key: str, n: int = 1) -> None:
    _counters.add(key, n)


def fail(where: str, exc: BaseException) -> None:
    """Count; log the first failure of each kind at WARNING; keep the latest."""
    _counters.fail(where, exc)


# ---------------------------------------------------------------- fork


def _after_fork_in_child() -> None:
    """A forked child (a data loader worker) inherits no threads: it does not trace."""
    global _enabled, _lock, _cond, _pending, _busy, _publisher, _stop, hub, hub_key, _table, _counters, _counts, \
        _ring, _unsealed, _records, _tracer, _fast_ring, _idle, _posts, _following, _unfollow
    _enabled = False
    _fast_ring = None
    _arm_compiled(None)
    _lock = threading.Lock()
    _cond = threading.Condition(_lock)
    _unsealed, _records, _tracer = [], [], None
    _counters = Counters(COUNTERS, "source_patch.trace", "trace", lock=_cond)
    _counts = _counters.counts
    _pending, _busy, _publisher, _stop, _idle = deque(), 0, None, False, False
    _posts, _following = deque(), False
    if _unfollow is not None:
        _unfollow, unfollow = None, _unfollow
        unfollow()
    for parents in (_events, _known_streams):
        parents.clear()  # CUDA objects of the parent: unusable here
    if hub is not None:
        try:
            hub.close_sockets()
        except Exception:  # noqa: BLE001
            pass
    hub = hub_key = _ring = None
    ring_module = sys.modules.get(__package__ + ".ring")
    if ring_module is not None:
        ring_module.forget()  # the parent's: writing to it would reach the parent's forwarder
    ranks.forget()
    _table = _Table()


# ``__sp__.trace`` is the function; it also carries the rest of the call-site API, and
# control.py gives it the control API (``__sp__.trace.configure(...)``), so that a script
# holding only the handle reaches all of it.
trace.trace, trace.trace_step, trace.names = trace, trace_step, names
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
