"""The publisher thread: traced results from the device to the hub.

The training thread only launches: it queues a :class:`Result` (the device result, or
the ring slice it goes to) with the event its copy waits for (api.py).  This thread
takes the queue in batches, waits for the events (:func:`fetch`: never the training
thread), and hands the batch to the hub: in a forwarder process (forwarder.py) it sends
a header naming the ring's slices and this process's counters (:func:`share_state`);
in a thread here it copies the results to pinned memory on its own stream first.

The queue, its lock and the counters live in api.py, where the hot path reads them as
module globals; api hands itself over at import (``api`` below), so this module never
imports it and holds no copy of them.
"""

from __future__ import annotations

import time

import torch

from ..core import ranks

api = None  # runtime/trace/api.py, set by it at import: the one place the trace state lives


class Result:
    """One traced result on its way to the hub."""

    __slots__ = ("subs", "name", "tags", "step", "time", "host", "event", "start", "shape", "dtype", "slot",
                 "stream")

    def __init__(self, subs, name, tags, step, stamp, result, event, start, shape, dtype, slot=None):
        self.subs, self.name, self.tags, self.step, self.time = subs, name, tags, step, stamp
        self.host, self.event, self.start = result, event, start  # host: on the device until fetched
        self.shape, self.dtype = shape, dtype  # the traced tensor's (torch.Size, torch.dtype), which the hub writes out
        self.slot = slot  # (offset, end, dtype, shape) in the shared ring: the bytes are there, not in host
        self.stream = None  # where the batch's event goes, while the result waits for it (api._seal)


def loop() -> None:
    """Publish in batches: at each step end (trace_step), when api.BATCH results wait,
    or every api.FLUSH_SECONDS.  A wake-up per result would contend for the GIL with the
    training thread at every layer, right when it returns from a device sync."""
    while True:
        with api._cond:
            items = api._take()
            if not items:
                if api._stop:
                    return
                api._cond.wait(api.FLUSH_SECONDS)
                items = api._take()
            api._busy += len(items)
        api._fold_durations()  # bounded however long nobody asks for the state
        if not items:
            share_state()
            continue
        cpu = time.thread_time()
        try:
            fetch(items)  # this thread waits for the copies, never the trainer
            share_state()  # before the frames: a client that got them and asks sees them counted
            hub = api._hub
            if hub is not None:
                hub.publish(items, ranks.global_rank())  # frames here, or sent to the forwarder
        except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
            api._fail("publishing", exc)
        finally:
            items = None
            with api._cond:
                api._busy = 0
                api._cost["publisher_cpu"] += time.thread_time() - cpu
                api._cond.notify_all()


def fetch(items: list) -> None:
    """Replace the CUDA results by pinned host copies: on this thread's own stream,
    behind each result's event, results of one device and dtype are joined on the
    device and copied in one piece; one wait covers the batch.  The device results stay
    referenced until the copies are done, so their memory is not reused under them."""
    waiting = [item for item in items if item.event is not None]
    groups: dict = {}
    done: dict = {}  # events to wait for, each once (a batch's results share one)
    for item in waiting:
        if item.slot is None:
            groups.setdefault((item.host.device.index, item.host.dtype), []).append(item)
        else:
            done[item.event] = None  # copied into the forwarder's ring already: only wait
    for (index, dtype), group in groups.items():
        event, flat = _copy_to_host(index, dtype, group)
        done[event] = flat  # the copy's source, referenced until the wait below
    for event in done:
        event.synchronize()
    _return_events(waiting)


def _copy_to_host(index: int, dtype, group: list) -> tuple:
    """Queue one pinned host copy of ``group``'s results (device ``index``, ``dtype``)
    on the publisher's stream and point each result at its part; (the copy's event,
    the device tensor it copies from)."""
    streams = api._streams
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    with torch.cuda.stream(stream):
        for event in dict.fromkeys(item.event for item in group):
            stream.wait_event(event)
        flat = torch.cat([item.host.reshape(-1) for item in group]) if len(group) > 1 \
            else group[0].host.reshape(-1)
        host = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # sleep on it, do not spin
        event.record(stream)
    offset = 0
    for item in group:
        n = item.host.numel()
        item.host, offset = host[offset: offset + n].view(item.host.shape), offset + n
    return event, flat


def _return_events(waiting: list) -> None:
    """(after the waits) Count the device time of timed results and give each event back
    to its pool once."""
    events = api._events
    pooled = {}
    for item in waiting:
        if item.slot is not None:
            item.host = None
        if item.start is not None:
            with api._lock:
                api._cost["device_reduce"] += item.start.elapsed_time(item.event) / 1e3
            events[(item.event.device.index, True)].append(item.start)
        pooled[item.event] = item.start is not None
        item.event = item.start = None
    for event, timing in pooled.items():
        events[(event.device.index, timing)].append(event)


def share_state() -> None:
    """A hub in its own process answers stats, list and hello from a snapshot of this
    process's counters: sent when they changed (the names only when new ones were seen),
    at most once per wake-up."""
    hub = api._hub
    if hub is None or not hasattr(hub, "share_state"):
        return
    try:
        with api._cond:
            calls = api.due_call_us()
            snapshot = {**api._counts, "cost_seconds": dict(api._cost), "due_call_us": calls}
        ring = api._ring
        snapshot.update(step=api._step, rank=ranks.global_rank(), series=len(api._seen),
                        ring=ring.state() if ring is not None else None)
        key = tuple(snapshot[k] for k in ("step", "series", *api._COUNTERS))
        shared = api._shared
        if key != shared:
            series_changed = not shared or shared[1] != key[1]
            api._shared = key
            hub.share_state(snapshot, api.names() if series_changed else None)
    except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
        api._fail("sharing state with the trace forwarder", exc)
