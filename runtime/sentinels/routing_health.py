"""Routing health: per step and MoE layer, how the router spreads tokens over experts.

Armed by the setting ``routing_health`` (apply(config) sets core/watch.py's
``routes_hook``; off: unset, so the router call site costs one ``is None`` test).  The
routing capability's router call site (routing/megatron/control.py's ``routing_topk``,
whatever the routing mode) hands the hook each call: the router's own top-k ids, its
logits over all experts and the ids replayed in their place (ours, or Megatron-Core's
``RouterReplay``), or None.

The calls are held (references to their ids and logits, a few hundred KiB a call) and
accumulated together at the step's end, or sooner at 64 calls or 64 MiB held: a small
op costs the launching thread ~20 us of host time whatever its size, so the ops run per
batch of calls of one shape, not per call.  On the device, per (device, expert count),
one float64 table with a row per layer, allocated once (grown when a new layer comes):
tokens per expert of the routes taken (the replayed ids where replayed) by one
``scatter_add_``, the number of tokens whose own expert set equals the replayed one, and
the sum over tokens of the entropy of softmax(logits) (computed in float32, summed in
float64), added to their rows by ``index_add_``: about ten ops a batch, whatever the
number of calls in it.  Nothing is read back per call (token counts are shapes, known
on the host).  At ``step_end(step)`` (the sentinels' ``sentinels_step`` call site after
the optimizer step) each table goes to the host in one copy and is zeroed; on CUDA the
copy is asynchronous (pinned memory, an event): the lines are written once it is done,
at the latest at the next step's end or at flush (``drain``), so the training thread
never waits for the device.  A held tensor changed in place before the batch ran (its
``_version`` moved) is counted (``routing_health_changed``): its figures are those of
the tensor as it was then.  One metrics line per (step, layer) that routed tokens:

    {"kind": "routing_health", "time", "rank", "step", "layer", "tokens", "topk",
     "per_expert": [...], "imbalance": max/mean, "dead": [expert ids with no token],
     "entropy": mean nats, "replayed": tokens replayed, "agreement": fraction or null}

Not seen: a router call under CUDA graph capture (a graph replay runs no Python), an
activation recompute in backward (its forward was counted), the fused router, Sinkhorn
routing (neither reaches the call site), a router without a layer_number.
"""

from __future__ import annotations

import torch

from ..core import watch
from ..core.adapters.readback import Readback
from . import events

HELD_CALLS = 64         # calls held before they are accumulated (else at the step's end)
HELD_BYTES = 64 << 20   # ... or bytes of their tensors

_on = False
_held: list = []     # calls not accumulated yet: (layer, own ids, logits, replayed ids or None, their _versions)
_held_bytes = 0
_tables: dict = {}   # (device, experts) -> _Table
_layers: dict = {}   # layer -> _Seen: this step's figures known on the host
_next_step = 0       # the step a step_end(None) reports
_pending: list = []  # reads not written yet: (reader, host values, [(layer, experts, row, tokens, replayed,
                     # topk)], step)
_readers: dict = {}  # (device, experts) -> its Readback (one read a step per table)
_counts = {"routing_health_calls": 0, "routing_health_lines": 0, "routing_health_errors": 0,
           "routing_health_changed": 0}
_error: str | None = None


class _Table:
    """One (device, expert count)'s figures, a row per layer: [tokens per expert...,
    agreeing tokens, entropy sum] (float64: counts are exact to 2**53)."""

    __slots__ = ("experts", "device", "values", "rows", "ones", "offsets")

    def __init__(self, experts: int, device: torch.device):
        self.experts, self.device = experts, device
        self.values = torch.zeros(0, experts + 2, dtype=torch.float64, device=device)
        self.rows: dict = {}  # layer -> row
        self.ones = torch.ones(1, dtype=torch.float64, device=device)  # expanded: no allocation a batch
        self.offsets: dict = {}  # a batch's rows (tuple) -> (rows, rows * (experts + 2)) on the device, made once

    def row(self, layer: int) -> int:
        row = self.rows.get(layer)
        if row is None:
            row = self.rows[layer] = len(self.rows)
            if row >= self.values.shape[0]:  # grown (rare: a layer seen for the first time)
                grown = torch.zeros(2 * row + 1, self.experts + 2, dtype=torch.float64, device=self.device)
                grown[:row].copy_(self.values[:row])
                self.values = grown
        return row

    def index(self, rows: tuple):
        found = self.offsets.get(rows)
        if found is None:
            if len(self.offsets) >= 64:  # batches that split differently each step: kept bounded
                self.offsets.clear()
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            found = self.offsets[rows] = (index, (index * (self.experts + 2)).view(-1, 1, 1))
        return found


class _Seen:
    """A layer's step on the host: tokens and replayed tokens seen (shapes), the top-k,
    its table."""

    __slots__ = ("table", "tokens", "replayed", "topk")

    def __init__(self, table: _Table):
        self.table, self.tokens, self.replayed, self.topk = table, 0, 0, None


def apply(config: dict) -> None:
    global _on
    _on = bool(config.get("routing_health"))
    if _on:
        watch.routes_hook = routes
    elif watch.routes_hook is routes:
        watch.routes_hook = None
    if not _on:
        drain()
        _held.clear()
        _layers.clear()
        _tables.clear()
        _readers.clear()


def routes(layer, topk_ids, scores, replayed) -> None:
    """core/watch.py's ``routes_hook``: one router call, held for its batch."""
    global _error, _held_bytes
    try:
        layer = int(layer)
        if replayed is not None and tuple(replayed.shape) != tuple(topk_ids.shape):
            raise ValueError(f"replayed ids {tuple(replayed.shape)} against the router's {tuple(topk_ids.shape)}")
        taken = topk_ids if replayed is None else replayed
        experts = int(scores.shape[-1])
        seen = _layers.get(layer)
        if seen is None or seen.table.experts != experts or seen.table.device != taken.device:
            if seen is not None and seen.tokens:
                raise ValueError(f"layer {layer} changed from {seen.table.experts} experts on {seen.table.device} "
                                 f"to {experts} on {taken.device} within a step")
            table = _tables.get((taken.device, experts))
            if table is None:
                table = _tables[(taken.device, experts)] = _Table(experts, taken.device)
            seen = _layers[layer] = _Seen(table)
        tokens = int(taken.shape[0])
        seen.tokens += tokens
        seen.topk = int(taken.shape[1])
        if replayed is not None:
            seen.replayed += tokens
            replayed = replayed.detach().to(topk_ids.device)
        scores = scores.detach().reshape(tokens, experts)
        _held.append((layer, topk_ids.detach(), scores, replayed,
                      (topk_ids._version, scores._version, None if replayed is None else replayed._version)))
        _held_bytes += scores.numel() * scores.element_size() + 2 * topk_ids.numel() * 8
        _counts["routing_health_calls"] += 1
        if len(_held) >= HELD_CALLS or _held_bytes >= HELD_BYTES:
            _accumulate()
    except Exception as exc:  # an observer: it never raises into training
        _counts["routing_health_errors"] += 1
        _error = f"routing_health: layer {layer}: {type(exc).__name__}: {exc}"


def _accumulate() -> None:
    """The held calls into their tables: one batch per (table, shape, replayed or not)."""
    global _held, _held_bytes
    held, _held, _held_bytes = _held, [], 0
    groups: dict = {}
    for call in held:
        layer, own, scores, replayed, versions = call
        if (own._version, scores._version, None if replayed is None else replayed._version) != versions:
            _counts["routing_health_changed"] += 1
        key = (_layers[layer].table, tuple(own.shape), scores.dtype, replayed is None)
        groups.setdefault(key, []).append(call)
    with torch.no_grad():
        for (table, _, _, _), calls in groups.items():
            _batch(table, calls)


def _batch(table: _Table, calls: list) -> None:
    """Calls of one shape: their counts, entropies and agreements added to their rows."""
    rows, offsets = table.index(tuple(table.row(call[0]) for call in calls))
    replayed = None if calls[0][3] is None else torch.stack([call[3] for call in calls])
    own = torch.stack([call[1] for call in calls])  # [calls, tokens, topk]
    taken = (own if replayed is None else replayed) + offsets
    table.values.view(-1).scatter_add_(0, taken.view(-1), table.ones.expand(taken.numel()))
    probs = torch.softmax(torch.stack([call[2] for call in calls]), dim=-1, dtype=torch.float32)
    experts = table.experts
    table.values[:, experts + 1].index_add_(0, rows, torch.special.entr(probs).sum(dim=(1, 2), dtype=torch.float64))
    if replayed is not None:
        same = (own.sort(dim=2).values == replayed.sort(dim=2).values).all(dim=2).sum(dim=1, dtype=torch.float64)
        table.values[:, experts].index_add_(0, rows, same)


def step_end(step) -> None:
    """Accumulate the held calls, bring each table back (one copy, asynchronous on CUDA),
    zero it; write the lines of every read that is done."""
    global _next_step, _error
    if step is None:
        step = _next_step
    _next_step = int(step) + 1
    if not (_on or _pending):
        return
    drain()  # the previous step's copy: recorded a step ago, done or nearly
    live = sorted((layer, seen) for layer, seen in _layers.items() if seen.tokens)
    if not live:
        return
    try:
        _accumulate()
        for key, table in _tables.items():
            layout = [(layer, table.experts, table.rows[layer], seen.tokens, seen.replayed, seen.topk)
                      for layer, seen in live if seen.table is table]
            if not layout:
                continue
            used = table.values[:len(table.rows)]
            reader = _readers.setdefault(key, Readback())
            _pending.append((reader, reader.start(used), layout, int(step)))
            used.zero_()
        if all(p[0].done() for p in _pending):
            drain()  # CPU, or already landed: written now, not a step late
    except Exception as exc:
        _counts["routing_health_errors"] += 1
        _error = f"routing_health: step {step}: {type(exc).__name__}: {exc}"
    finally:
        for _, seen in live:
            seen.tokens = seen.replayed = 0


def drain() -> None:
    """Wait for the reads in flight and write their lines (flush, close, the next step's end)."""
    global _error
    while _pending:
        reader, host, layout, step = _pending.pop(0)
        try:
            reader.wait()
            _write(host.tolist(), layout, step)
        except Exception as exc:
            _counts["routing_health_errors"] += 1
            _error = f"routing_health: step {step}: {type(exc).__name__}: {exc}"


def _write(values: list, layout: list, step: int) -> None:
    rows = []
    for layer, experts, row, tokens, replayed, topk in layout:
        at = row * (experts + 2)
        per_expert = [int(n) for n in values[at:at + experts]]
        agree, entropy_sum = values[at + experts], values[at + experts + 1]
        mean = sum(per_expert) / experts
        rows.append(dict(step=step, layer=layer, tokens=tokens, topk=topk,
                         per_expert=per_expert, imbalance=max(per_expert) / mean if mean else None,
                         dead=[e for e, n in enumerate(per_expert) if n == 0],
                         entropy=entropy_sum / tokens, replayed=replayed,
                         agreement=agree / replayed if replayed else None))
    events.metrics("routing_health", rows)
    _counts["routing_health_lines"] += len(rows)


def counters() -> dict:
    return dict(_counts)


def last_error():
    return _error


def clear() -> None:
    global _next_step, _error, _held_bytes
    _pending.clear()
    _held.clear()
    _held_bytes = 0
    for table in _tables.values():
        table.values.zero_()
    for seen in _layers.values():
        seen.tokens = seen.replayed = 0
    _next_step = 0
    _error = None
    for key in _counts:
        _counts[key] = 0
