"""Under SGLang's decode CUDA graphs (core/adapters/sglang_graphs.py, core/adapters/graph_stage.py): capture
stages the routed columns in the graph and records them after each replay; replay
feeds the recorded ids into a static buffer before each replay.
"""

from __future__ import annotations

import torch

from ...core.adapters import graph_stage
from .batch import ambient_rows
from .capture import capture_layer
from .replay import check_ids, recorded_rows, replay_weights
from .state import S, warn_once


def in_graph(topk_ids, topk_weights, router_logits, topk_config, layer: int, k: int, mode: str) -> bool:
    """(a graph is being built: core/adapters/sglang_graphs.py) True when this call must do
    nothing more now: a warm-up pass; or the capture, where capture stages the routed
    columns in the graph (:func:`_drained` after each replay) and replay routes by ids
    fed before each replay (:func:`_fill`): recorded rows replaced, the others (no
    record, padding) keep the router's choice, as in an eager forward."""
    routed, weights = topk_ids[:, :k], topk_weights[:, :k]
    if graph_stage.warming_up():
        if mode == "replay":  # the buffer the capture feeds, allocated now: outside the graph's pool
            graph_stage.reserve(layer, routed.new_empty((routed.shape[0], k + 1)))
        return True
    if not graph_stage.capturing():
        return False
    if mode == "capture":
        graph_stage.stage(_drained, (layer, "ids"), routed, experts=int(router_logits.shape[-1]))
        graph_stage.stage(_drained, (layer, "weights"), weights)
        return True
    # one static buffer the graph reads: k recorded ids and a keep flag per row
    fed = graph_stage.feed(_fill, layer, routed.new_empty((routed.shape[0], k + 1)),
                           experts=int(router_logits.shape[-1]))
    ids, keep = fed[:, :k], fed[:, k:] != 0
    w = replay_weights(router_logits, ids, topk_config)
    routed.copy_(torch.where(keep, ids, routed))
    weights.copy_(torch.where(keep, w.to(weights.dtype), weights))
    return True


def _drained(key, tensor, *, cuda_graph, replay, experts=None, **_) -> None:
    """A replayed decode graph's staged rows (the real tokens' only): captured as the
    eager call of this layer would have been (ids first, then their weights)."""
    layer, part = key
    if part == "ids":
        S.graph_ids, S.graph_experts = tensor, experts
        return
    ids, S.graph_ids = S.graph_ids, None
    if S.mode == "capture" and not S.skip and ids is not None:
        capture_layer(layer, ids, tensor, S.graph_experts)


def _fill(layer, buffer, *, experts, **_) -> None:
    """Before a decode graph's replay: each recorded row's ids and a keep flag into the
    buffer its router reads (validated here, on the host); other rows keep theirs."""
    k = buffer.shape[1] - 1
    plan = torch.zeros(buffer.shape, dtype=buffer.dtype)
    rows = ambient_rows(buffer.shape[0]) if not S.skip and S.mode == "replay" else None
    if rows is not None and S.batch is None:
        warn_once("nobatch-graph", "no ambient batch under a CUDA graph replay: its rows keep the router's routes")
    elif rows is not None:
        row = 0
        for rid, n, start in zip(*S.batch):
            recorded = recorded_rows(S.replay.get(rid), rid, layer, start, n)
            if recorded is not None:
                check_ids(recorded, rows=n, topk=k, num_experts=experts, what=f"layer {layer} replay ids")
                plan[row:row + n, :k], plan[row:row + n, k] = recorded, 1
            row += n
    buffer.copy_(plan)


def unstaged(name, what) -> None:
    """A decode graph captured while routing was off is replayed: its routers are not in it."""
    warn_once(("unstaged", what), f"{what}: its CUDA graph was captured while routing was off, so its "
              f"replays are not {'captured' if S.mode == 'capture' else 'replayed'} (set the routing mode "
              "before the engine starts)")
