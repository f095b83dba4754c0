"""Routing capture's host side in Megatron: the ids' copies off the device, the
records pending per (step, microbatch), and the background saver with its index.

``control.py`` decides which (step, microbatch, layer) a router call is and hands
the ids here (``add``); a finished step is written off the training thread
(``save_in_background``) into the layout of ``files.py``.

The state below is this side's alone (``control.py`` reads it through the functions
here and clears it through ``reset``): one copy, in this module.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from ...core import ranks
from ..records.file import index_dtype_for, write_bytes
from ..records.record import RoutingRecord
from .files import RoutingReplayError, record_name, write_index

_lock = threading.Lock()
# (step, microbatch) -> {layer: (indices _Pending, probs _Pending or None, None)}
_pending: dict = {}
_meta: dict = {}     # (step, microbatch) -> {"batch", "num_experts", "sp", "cuda_graph"}
_saved: dict = {}   # (step, microbatch) -> its index.json entry, for every record written
_index_written = 0.0  # time.monotonic() of the last index.json write
_index_every = 1.0    # seconds until the background writer rewrites it again (see _write_index)
_index_dirty = False  # records on disk the index does not list yet (flush() and close() write it)
_index_folder: list = [None]  # where the last save wrote (the index that flush() completes)
# page-locked host buffers, (shape, dtype) -> free tensors: reused across steps once their
# record is on disk (an allocation a router call costs ~10 us and the caching host
# allocator's lock; the capture makes the same shapes every step)
_host_pool: dict = {}
_POOL_SHAPES = 32  # more distinct (shape, dtype) than this (token counts that vary): start the pool afresh
_saver = None        # the background thread that writes captured steps (ThreadPoolExecutor)
_last_error: str | None = None  # the latest failure to save captured routes
_folders: dict = {}  # (root, rank) -> its rank folder, made once (see _folder)


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


def _recycle(layers: dict) -> None:
    """A saved record's page-locked buffers back to the pool (their copies are done: read)."""
    if len(_host_pool) > _POOL_SHAPES:
        _host_pool.clear()  # bounded: a varying token count would otherwise keep every shape's buffers
    for idx, prob, _ in layers.values():
        for pending in (idx, prob):
            if isinstance(pending, _Pending) and pending.event is None and pending.host.is_pinned():
                _host_pool.setdefault((pending.host.shape, pending.host.dtype), []).append(pending.host)


def add(key, layer, indices: torch.Tensor, batch, num_experts, sp: bool, cuda_graph: bool) -> None:
    """Keep ``layer``'s ids of (step, microbatch) ``key``: a host copy, maybe in flight.
    The first layer of a key sets its record's layout; a drained graph's tags it."""
    layers = _pending.get(key)
    if layers is None:
        layers = _pending[key] = {}
        _meta[key] = {"batch": batch, "num_experts": num_experts, "sp": sp, "cuda_graph": cuda_graph}
    elif cuda_graph:
        _meta[key]["cuda_graph"] = True
    layers[layer] = (_Pending(*_to_host(indices)), None, None)


def add_probs(key, layer, routing_probs: torch.Tensor, indices: torch.Tensor) -> None:
    """The combine weights at the captured ids ``indices`` of ``layer``, once per call."""
    entry = _pending.get(key, {}).get(layer)
    if entry is not None and entry[1] is None:
        probs = routing_probs.detach().gather(1, indices)
        _pending[key][layer] = (entry[0], _Pending(*_to_host(probs)), None)


def _build(key) -> RoutingRecord:
    """The record of (step, microbatch) ``key``: copies of its ids (int64) and probs, validated."""
    layers = _pending[key]
    indices = {layer: _resolve(idx).to(torch.int64, copy=True) for layer, (idx, _, _) in sorted(layers.items())}
    probs = {layer: _resolve(prob).clone() for layer, (_, prob, _) in sorted(layers.items()) if prob is not None}
    return RoutingRecord(indices=indices, probs=probs if len(probs) == len(indices) else None,
                         **_fields(key, indices))


def _fields(key, indices: dict) -> dict:
    """The record's fields of (step, microbatch) ``key`` but its tensors."""
    meta = _meta.get(key, {})
    num_experts = meta.get("num_experts") or int(max(int(t.max()) for t in indices.values()) + 1)
    batch = meta.get("batch")
    tokens = next(iter(indices.values())).shape[0]
    cp, cp_rank, tp, tp_rank = ranks.cp_tp()
    sp = bool(meta.get("sp")) and tp > 1
    parallel_ = None
    if cp > 1 or sp:
        parallel_ = {"cp": cp, "sp": sp, "tp": tp, "ep": 1, "cp_rank": cp_rank, "tp_rank": tp_rank}
    seq_lens = [tokens // batch] * batch if batch and tokens % batch == 0 else None
    return dict(num_experts=int(num_experts), token_order="megatron-sbh", seq_lens=seq_lens, parallel=parallel_,
                source="megatron", extra={"step": key[0], "microbatch": key[1],
                                          **({"cuda_graph": True} if meta.get("cuda_graph") else {})})


def _to_save(key) -> RoutingRecord:
    """(saver) The record of ``key`` as its file holds it: each layer's ids converted once,
    from the pending host copy straight to the dtype stored on disk, and its probs the
    pending host tensors themselves (written before save() recycles them).  Not validated:
    built here from the router's own top-k (RoutingRecord.trusted)."""
    layers = _pending[key]
    ids = {layer: _resolve(idx) for layer, (idx, _, _) in sorted(layers.items())}
    fields = _fields(key, ids)
    disk = index_dtype_for(fields["num_experts"])
    probs = {layer: _resolve(prob) for layer, (_, prob, _) in sorted(layers.items()) if prob is not None}
    return RoutingRecord.trusted(indices={layer: t.to(disk) for layer, t in ids.items()},
                                 probs=probs if len(probs) == len(ids) else None, **fields)


def records(steps=None) -> list:
    """Captured records not yet saved, one per (step, microbatch), sorted."""
    return [_build(k) for k in sorted(_pending) if steps is None or k[0] in steps]


def save(root, steps=None, index: bool = True) -> list:
    """Write pending records (of ``steps``, default all) under ``<root>/rank-<r>/`` and update
    ``index.json`` (``index=False``: later, by flush() or close()); returns the index
    entries written so far by this process."""
    _save(root, steps, index)
    with _lock:
        return _index_entries()


def _save(root, steps, index: bool) -> None:
    global _index_dirty
    if not root:
        raise RoutingReplayError("routing save: no directory (set routing dir or pass dir=)")
    rank = ranks.global_rank()
    folder = _folder(root, rank)
    with _lock:
        # list(): the training thread may add keys of later steps meanwhile.
        for key in sorted(k for k in list(_pending) if steps is None or k[0] in steps):
            rec = _to_save(key)
            name = record_name(key)
            write_bytes(folder / name, rec.encode(check=False))  # one write, through core/private.py
            _recycle(_pending[key])
            _saved[key] = {"step": key[0], "microbatch": key[1], "file": name, "layers": rec.layers,
                           "tokens": rec.num_tokens, "num_experts": rec.num_experts, "topk": rec.topk}
            del _pending[key]
            _meta.pop(key, None)
        _index_dirty = True
        _index_folder[0] = folder
        if index:
            _write_index(folder, rank)


def _folder(root, rank: int) -> Path:
    """``<root>/rank-<rank>``, made the first time it is asked for (then remembered: one
    mkdir a folder, not two a record; a record written after it went missing makes it
    again: records/file.py)."""
    folder = _folders.get((root, rank))
    if folder is None:
        folder = Path(root) / f"rank-{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        if len(_folders) > 64:
            _folders.clear()
        _folders[root, rank] = folder
    return folder


def _index_entries() -> list:
    """(caller holds _lock) The index's entries, sorted by (step, microbatch)."""
    return [_saved[key] for key in sorted(_saved)]


def _write_index(folder, rank: int) -> None:
    """Rewrite index.json whole; the background writer waits at least 50 times this write's
    CPU time before the next (at least a second): a growing index then takes under 2% of a
    core, and of the GIL, where rewriting it every step took 16 ms a step at 1,000 records
    and 260 ms at 10,000 (CPU, 2026-11-26).  Its CPU time, not its wall time: the write is
    synced to disk (core/private.py), a wait that holds neither a core nor the GIL."""
    global _index_written, _index_dirty, _index_every
    start = time.thread_time()
    write_index(folder, rank, _index_entries())
    _index_written, _index_dirty = time.monotonic(), False
    _index_every = max(1.0, 50 * (time.thread_time() - start))


def _write_index_if_dirty() -> None:
    with _lock:
        if _index_dirty and _index_folder[0] is not None:
            _write_index(_index_folder[0], ranks.global_rank())


def save_in_background(root, steps: set) -> None:
    """Write a finished step's records off the training thread (waiting on their copies'
    events and writing files would stall the step); failures are reported, not raised."""
    global _saver
    if _saver is None:
        from concurrent.futures import ThreadPoolExecutor

        _saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sp-routing-save")
    _saver.submit(_save_reporting, root, steps)


def _save_reporting(root, steps) -> None:
    global _last_error
    try:
        # the index is rewritten whole, so not at every step (flush() and close() write it too)
        _save(root, steps, index=time.monotonic() - _index_written >= _index_every)
    except Exception as exc:  # noqa: BLE001 - never raise into training
        _last_error = f"saving step(s) {sorted(steps)}: {type(exc).__name__}: {exc}"
        print(f"source-patch routing: could not save captured routes of step(s) {sorted(steps)}: {exc}",
              file=sys.stderr)


def flush(timeout: float | None = None) -> bool:
    """Wait until every step handed to the background writer is on disk, its index too;
    False when that did not finish in ``timeout`` seconds (None: as long as it takes)."""
    if _saver is None:
        return True
    try:
        future = _saver.submit(_write_index_if_dirty)
    except RuntimeError:  # at interpreter exit: the executor was shut down, its work done
        _write_index_if_dirty()
        return True
    try:
        future.result(timeout)
    except TimeoutError:
        return False
    return True


def close(root, timeout: float | None = None) -> bool:
    """Save what is pending under ``root`` (None: nothing to save) and stop the background
    writer; True when no save failed and everything finished in ``timeout`` seconds."""
    global _saver, _last_error
    finished = flush(timeout)
    if root and _pending:
        try:
            save(root)
        except Exception as exc:  # noqa: BLE001 - at exit: report, do not mask the real exit
            _last_error = f"saving: {type(exc).__name__}: {exc}"
            print(f"source-patch routing: could not save captured routes: {exc}", file=sys.stderr)
    saver, _saver = _saver, None
    if saver is not None:
        done = saver.submit(lambda: None)  # after every save handed over
        saver.shutdown(wait=False)
        try:
            done.result(timeout)
        except TimeoutError:
            finished = False  # its thread finishes the saves by itself; the process does not wait here
    return finished and _last_error is None


def reset() -> None:
    """Forget what was captured and saved (the index's timing and folder are kept)."""
    global _last_error
    _pending.clear(); _meta.clear(); _saved.clear(); _host_pool.clear(); _folders.clear()
    _last_error = None


def pending_keys() -> list:
    return sorted(_pending)


def saved_count() -> int:
    return len(_saved)


def last_error() -> str | None:
    return _last_error
