"""trace() under CUDA graphs (core/adapters/graph_stage.py, issue 31).

A replayed graph runs no Python, so a trace call site captured in it would never be
offered to a client again.  While a graph is being built or captured somewhere
(``graph_stage.busy``, the one flag api.trace tests for this), :func:`intercept`
decides: a Megatron graph's warm-up pass traces nothing; under capture the tensor is
staged in the graph (a copy into a buffer of its own, whether or not a client
subscribes now: subscriptions change while the graph lives), and the drain after every
replay offers the replay's rows to ``api.trace`` as an eager call would be offered
them, tagged ``cuda_graph``.  Subscriptions, ``every`` and the step are applied then.
"""

from __future__ import annotations

import torch

from ..core.adapters import graph_stage


_offer = _fail = None  # api.trace and api.fail (given by use(): api imports this module, not this one api)


def use(on: bool, offer, fail) -> None:
    """Register tracing with Megatron's graph hooks while it is enabled; ``offer``: what a
    drained tensor is offered to (api.trace), ``fail``: where a failure is counted."""
    global _offer, _fail
    _offer, _fail = offer, fail
    graph_stage.use("trace", _unstaged, on=on)


def intercept(name: str, tensor, tags: dict) -> bool:
    """True when ``trace(name, tensor, **tags)`` must do nothing more now."""
    if not isinstance(tensor, torch.Tensor):
        return False  # the call site's error: api.trace raises it
    try:
        return graph_stage.site(_drained, (name, tags.get("layer")), tensor, tags=tags)
    except graph_stage.GraphStageError:
        return False  # a capture outside any GraphStage: the general path skips it (counted)


def _drained(key: tuple, tensor: torch.Tensor, *, cuda_graph: bool, replay: int, tags: dict, **drain_tags) -> None:
    _offer(key[0], tensor, **{**tags, **drain_tags, "cuda_graph": cuda_graph})


# a Megatron graph built while tracing was off is replayed: its call sites are not traced
_unstaged = graph_stage.reported_once("tracing", lambda where, exc: _fail(where, exc))
