"""The publisher thread: traced results from the device to the hub.

The training thread only launches: it queues an ``api.Result`` (the device result, or
the ring slice it goes to) with the event its copy waits for (api.py).  This thread
(started with the hub: lifecycle.py) takes the queue in batches, waits for the events
(:func:`fetch`: never the training thread), and hands the batch to the hub: in a
forwarder process (forwarder.py) it sends a header naming the ring's slices; in a
thread here it copies the results to pinned memory on its own stream first.  With
nothing to hand over it sleeps without a timeout (api.take_batch): a process with no
client, or between its steps, does not wake it.  A forwarder asks for this process's
counters when a client wants them (forwarder.Forwarder._share_state).

The queue, its lock and the counters are api.py's (the trace state): this module takes
its batches through api.take_batch and api.batch_done, and holds only its own copy
streams.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from ..core import ranks
from . import api

_streams: dict = {}  # device index -> this thread's copy stream (fetch)


def loop() -> None:
    """Publish in batches: at each step end (trace_step), when api.BATCH results wait,
    or api.FLUSH_SECONDS after a result that waits for no event (api.take_batch).  A
    wake-up per result would contend for the GIL with the training thread at every
    layer, right when it returns from a device sync."""
    while True:
        items = api.take_batch()
        if items is None:
            return
        if not items:
            continue
        cpu = time.thread_time()
        try:
            records = [item for item in items if type(item) is tuple]  # api.post's, behind the results
            if records:
                items = [item for item in items if type(item) is not tuple]
            hub = api.hub
            if items:
                fetch(items)  # this thread waits for the copies, never the trainer
                if hub is not None:
                    hub.publish(items, ranks.global_rank())  # frames here, or sent to the forwarder
            if records and hub is not None:
                hub.post(encode_records(records))
        except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
            api.fail("publishing", exc)
        finally:
            items = records = None
            api.batch_done(time.thread_time() - cpu)


def encode_records(records: list) -> list:
    """[(number, name, JSON text)] of api.post's records: ``{"n", "name", "value"}`` each,
    strict JSON (a non-finite number is null; anything else JSON cannot hold, its str()).
    One longer than api.RECORD_BYTES is dropped and counted (records_dropped)."""
    out, dropped = [], 0
    for number, name, value in records:
        record = {"n": number, "name": name, "value": value}
        try:
            text = _JSON.encode(record)
        except ValueError:  # NaN or an infinity somewhere: null, as the run folder writes it
            text = _JSON.encode(_finite(record))
        if len(text) > api.RECORD_BYTES:
            dropped += 1
            continue
        out.append((number, name, text))
    if dropped:
        api._count("records_dropped", dropped)
    return out


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=str)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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
    for item in waiting:
        if item.slot is not None:
            item.host = None
    api.return_events(waiting)


def _copy_to_host(index: int, dtype, group: list) -> tuple:
    """Queue one pinned host copy of ``group``'s results (device ``index``, ``dtype``)
    on the publisher's stream and point each result at its part; (the copy's event,
    the device tensor it copies from)."""
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
    offset = 0
    for item in group:
        n = item.host.numel()
        item.host, offset = host[offset: offset + n].view(item.host.shape), offset + n
    return event, flat


def _forget() -> None:
    """(a forked child) The parent's copy streams are not this process's."""
    _streams.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
