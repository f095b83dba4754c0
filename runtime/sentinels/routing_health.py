"""Routing health: per step and MoE layer, how the router spreads tokens over experts.

Armed by the setting ``routing_health`` (apply(config) sets core/watch.py's
``routes_hook``; off: unset, so the router call site costs one ``is None`` test).  The
routing capability's router call site (routing/megatron/control.py's ``routing_topk``,
whatever the routing mode) hands the hook each call: the router's own top-k ids, its
logits over all experts and the ids replayed in their place (ours, or Megatron-Core's
``RouterReplay``), or None.

On the device, per layer, into tensors allocated once (on the layer's first call, again
only if its expert count or device changes): tokens per expert of the routes taken (the
replayed ids where replayed) by ``scatter_add_``, the sum over tokens of the entropy of
softmax(logits) (float64), and the number of tokens whose own expert set equals the
replayed one.  Nothing is read back per call (token counts are shapes, known on the
host).  At ``step_end(step)`` (the sentinels' ``sentinels_step`` call site after the
optimizer step) one copy per device brings every layer's figures back, a metrics line
is written per (step, layer) that routed tokens, and the accumulators are zeroed:

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
from . import events

_on = False
_layers: dict = {}   # layer -> _Layer
_next_step = 0       # the step a step_end(None) reports
_counts = {"routing_health_calls": 0, "routing_health_lines": 0, "routing_health_errors": 0}
_error: str | None = None


class _Layer:
    """One layer's device accumulators: ``ints`` = [tokens per expert..., agreeing tokens]
    (int64), ``entropy`` = [sum over tokens of the entropy] (float64); on the host the
    tokens and replayed tokens seen (shapes) and the top-k."""

    __slots__ = ("experts", "device", "ints", "counts", "agree", "entropy", "ones", "tokens", "replayed", "topk")

    def __init__(self, experts: int, device: torch.device):
        self.experts, self.device = experts, device
        self.ints = torch.zeros(experts + 1, dtype=torch.int64, device=device)
        self.counts, self.agree = self.ints[:experts], self.ints[experts:]
        self.entropy = torch.zeros(1, dtype=torch.float64, device=device)
        self.ones = torch.ones(1, dtype=torch.int64, device=device)  # expanded: no allocation a call
        self.tokens = self.replayed = 0
        self.topk = None

    def zero(self) -> None:
        self.ints.zero_()
        self.entropy.zero_()
        self.tokens = self.replayed = 0


def apply(config: dict) -> None:
    global _on
    _on = bool(config.get("routing_health"))
    if _on:
        watch.routes_hook = routes
    elif watch.routes_hook is routes:
        watch.routes_hook = None
    if not _on:
        _layers.clear()


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
        flat = taken.reshape(-1)
        acc.counts.scatter_add_(0, flat, acc.ones.expand(flat.numel()))
        logits = scores.detach().reshape(tokens, experts).to(torch.float64)
        acc.entropy.add_(torch.special.entr(torch.softmax(logits, dim=-1)).sum())
        if replayed is not None:
            if tuple(replayed.shape) != tuple(topk_ids.shape):
                raise ValueError(f"replayed ids {tuple(replayed.shape)} against the router's "
                                 f"{tuple(topk_ids.shape)}")
            same = (topk_ids.sort(dim=1).values == replayed.to(topk_ids.device).sort(dim=1).values).all(dim=1)
            acc.agree.add_(same.sum())
            acc.replayed += tokens
        acc.tokens += tokens
        acc.topk = topk


def step_end(step) -> None:
    """Read back what the step's router calls gathered (one copy per device), write one
    metrics line per layer that routed tokens, zero the accumulators."""
    global _next_step, _error
    if step is None:
        step = _next_step
    _next_step = int(step) + 1
    if not _on:
        return
    live = sorted((layer, acc) for layer, acc in _layers.items() if acc.tokens)
    if not live:
        return
    try:
        by_device: dict = {}
        for layer, acc in live:
            by_device.setdefault(acc.device, []).append(acc)
        host = {}
        for accs in by_device.values():
            ints = torch.cat([a.ints for a in accs]).cpu().tolist()
            floats = torch.cat([a.entropy for a in accs]).cpu().tolist()
            at = 0
            for i, a in enumerate(accs):
                host[id(a)] = (ints[at:at + a.experts + 1], floats[i])
                at += a.experts + 1
        for layer, acc in live:
            ints, entropy_sum = host[id(acc)]
            per_expert, agree = ints[:acc.experts], ints[acc.experts]
            mean = sum(per_expert) / acc.experts
            events.metric("routing_health", step=int(step), layer=layer, tokens=acc.tokens, topk=acc.topk,
                          per_expert=per_expert, imbalance=max(per_expert) / mean if mean else None,
                          dead=[e for e, n in enumerate(per_expert) if n == 0],
                          entropy=entropy_sum / acc.tokens, replayed=acc.replayed,
                          agreement=agree / acc.replayed if acc.replayed else None)
            _counts["routing_health_lines"] += 1
    except Exception as exc:
        _counts["routing_health_errors"] += 1
        _error = f"routing_health: step {step}: {type(exc).__name__}: {exc}"
    finally:
        for _, acc in live:
            acc.zero()


def counters() -> dict:
    return dict(_counts)


def last_error():
    return _error


def clear() -> None:
    global _next_step, _error
    for acc in _layers.values():
        acc.zero()
    _next_step = 0
    _error = None
    for key in _counts:
        _counts[key] = 0
