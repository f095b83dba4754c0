"""Routing health: per step and MoE layer, how the router spreads tokens over experts.

Armed by the setting ``routing_health`` (apply(config) sets core/watch.py's
``routes_hook``; off: unset, so the router call site costs one ``is None`` test).  The
routing capability's router call site (routing/megatron/control.py's ``routing_topk``,
whatever the routing mode) hands the hook each call: the router's own top-k ids, its
logits over all experts and the ids replayed in their place (ours, or Megatron-Core's
``RouterReplay``), or None.

On the device, per layer, into one float64 tensor allocated once (on the layer's first
call, again only if its expert count or device changes): tokens per expert of the routes
taken (the replayed ids where replayed) by ``scatter_add_``, the number of tokens whose
own expert set equals the replayed one, and the sum over tokens of the entropy of
softmax(logits) (computed in float32, summed in float64): four small kernels a call, five
where replayed.  Nothing is read back per call (token counts are shapes, known on the
host).  At ``step_end(step)`` (the sentinels' ``sentinels_step`` call site after the
optimizer step) every layer's figures go to the host in one copy per device and the
accumulators are zeroed; on CUDA the copy is asynchronous (pinned memory, an event): the
lines are written once it is done, at the latest at the next step's end or at flush
(``drain``), so the training thread never waits for the device.  One metrics line per
(step, layer) that routed tokens:

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

_on = False
_layers: dict = {}   # layer -> _Layer
_next_step = 0       # the step a step_end(None) reports
_pending: list = []  # reads not written yet: (reader, host values, [(layer, experts, tokens, replayed, topk)], step)
_readers: dict = {}  # device -> its Readback (one read a step per device)
_counts = {"routing_health_calls": 0, "routing_health_lines": 0, "routing_health_errors": 0}
_error: str | None = None


class _Layer:
    """One layer's device accumulator ``values`` = [tokens per expert..., agreeing tokens,
    entropy sum] (float64: counts are exact to 2**53); on the host the tokens and replayed
    tokens seen (shapes) and the top-k."""

    __slots__ = ("experts", "device", "values", "counts", "agree", "entropy", "ones", "tokens", "replayed", "topk")

    def __init__(self, experts: int, device: torch.device):
        self.experts, self.device = experts, device
        self.values = torch.zeros(experts + 2, dtype=torch.float64, device=device)
        self.counts, self.agree, self.entropy = self.values[:experts], self.values[experts:experts + 1], \
            self.values[experts + 1:]
        self.ones = torch.ones(1, dtype=torch.float64, device=device)  # expanded: no allocation a call
        self.tokens = self.replayed = 0
        self.topk = None


def apply(config: dict) -> None:
    global _on
    _on = bool(config.get("routing_health"))
    if _on:
        watch.routes_hook = routes
    elif watch.routes_hook is routes:
        watch.routes_hook = None
    if not _on:
        drain()
        _layers.clear()
        _readers.clear()


def routes(layer, topk_ids, scores, replayed) -> None:
    """core/watch.py's ``routes_hook``: one router call, accumulated on the device."""
    global _error
    try:
        _accumulate(int(layer), topk_ids, scores, replayed)
        _counts["routing_health_calls"] += 1
    except Exception as exc:  # an observer: it never raises into training
        _counts["routing_health_errors"] += 1
        _error = f"routing_health: layer {layer}: {type(exc).__name__}: {exc}"


def _accumulate(layer: int, topk_ids, scores, replayed) -> None:
    with torch.no_grad():
        taken = topk_ids if replayed is None else replayed
        tokens, topk = int(taken.shape[0]), int(taken.shape[1])
        experts = int(scores.shape[-1])
        acc = _layers.get(layer)
        if acc is None or acc.experts != experts or acc.device != taken.device:
            if acc is not None and acc.tokens:
                raise ValueError(f"layer {layer} changed from {acc.experts} experts on {acc.device} to "
                                 f"{experts} on {taken.device} within a step")
            acc = _layers[layer] = _Layer(experts, taken.device)
        if replayed is not None and tuple(replayed.shape) != tuple(topk_ids.shape):
            raise ValueError(f"replayed ids {tuple(replayed.shape)} against the router's {tuple(topk_ids.shape)}")
        flat = taken.reshape(-1)
        acc.counts.scatter_add_(0, flat, acc.ones.expand(flat.numel()))
        probs = torch.softmax(scores.detach().reshape(tokens, experts), dim=-1, dtype=torch.float32)
        acc.entropy.add_(torch.special.entr(probs).sum(dtype=torch.float64))
        if replayed is not None:
            same = (topk_ids.sort(dim=1).values == replayed.to(topk_ids.device).sort(dim=1).values).all(dim=1)
            acc.agree.add_(same.sum())
            acc.replayed += tokens
        acc.tokens += tokens
        acc.topk = topk


def step_end(step) -> None:
    """Bring back what the step's router calls gathered (one copy per device, asynchronous
    on CUDA), zero the accumulators; write the lines of every read that is done."""
    global _next_step, _error
    if step is None:
        step = _next_step
    _next_step = int(step) + 1
    if not (_on or _pending):
        return
    drain()  # the previous step's copy: recorded a step ago, done or nearly
    live = sorted((layer, acc) for layer, acc in _layers.items() if acc.tokens)
    if not live:
        return
    try:
        by_device: dict = {}
        for layer, acc in live:
            by_device.setdefault(acc.device, []).append((layer, acc))
        for device, pairs in by_device.items():
            values = [acc.values for _, acc in pairs]
            flat = torch.cat(values)
            torch._foreach_zero_(values)
            layout = [(layer, acc.experts, acc.tokens, acc.replayed, acc.topk) for layer, acc in pairs]
            reader = _readers.setdefault(device, Readback())
            _pending.append((reader, reader.start(flat), layout, int(step)))
        if all(p[0].done() for p in _pending):
            drain()  # CPU, or already landed: written now, not a step late
    except Exception as exc:
        _counts["routing_health_errors"] += 1
        _error = f"routing_health: step {step}: {type(exc).__name__}: {exc}"
    finally:
        for _, acc in live:
            acc.tokens = acc.replayed = 0


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
    at = 0
    for layer, experts, tokens, replayed, topk in layout:
        per_expert = [int(n) for n in values[at:at + experts]]
        agree, entropy_sum = values[at + experts], values[at + experts + 1]
        at += experts + 2
        mean = sum(per_expert) / experts
        events.metric("routing_health", step=step, layer=layer, tokens=tokens, topk=topk,
                      per_expert=per_expert, imbalance=max(per_expert) / mean if mean else None,
                      dead=[e for e, n in enumerate(per_expert) if n == 0],
                      entropy=entropy_sum / tokens, replayed=replayed,
                      agreement=agree / replayed if replayed else None)
        _counts["routing_health_lines"] += 1


def counters() -> dict:
    return dict(_counts)


def last_error():
    return _error


def clear() -> None:
    global _next_step, _error
    _pending.clear()
    for acc in _layers.values():
        acc.values.zero_()
        acc.tokens = acc.replayed = 0
    _next_step = 0
    _error = None
    for key in _counts:
        _counts[key] = 0
