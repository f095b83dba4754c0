"""Graph-safe call sites under SGLang's decode CUDA graphs (issue 31, build item 2).

The mechanism is core/adapters/graph_stage.py's; this module drives it from SGLang's
``DecodeCudaGraphRunner`` (sglang 0.5.23, ``model_executor/runner/``), whose hooks
``patches/dump.yaml``, ``routing.yaml`` and ``trace.yaml`` each carry (every spec
works alone; with several active the repeats do nothing):

* ``capture_one_shape`` builds one graph per shape key through its backend's
  ``capture_one``: two eager warm-up passes on the shape's placeholder batch, then the
  capture.  :func:`sglang_graph_build` before it gives that graph a ``GraphStage`` (the
  warm-ups record nothing; the first call site under the capture begins the stage),
  :func:`sglang_graph_built` after it ends the build.
* ``execute`` replays the graph of ``_replay_graph_key``: :func:`sglang_graph_replay`
  before ``backend.replay`` refills what the graph reads (routing replay's ids),
  :func:`sglang_graph_replayed` after it hands the rows of the batch's real tokens
  (``raw_num_token``; the rest of the graph's batch is padding) to the writers an
  eager forward uses.  They attribute rows with the ambient batch that
  ``ModelRunner._forward_raw`` set for this forward, exactly as for an eager one.

With no capability registered (``graph_stage.use``) each hook is one truthiness test.
A graph captured while a capability was off stays without its call sites: the
capability says so at the graph's replays (turn it on before the engine starts).
"""

from __future__ import annotations

import weakref

from . import graph_stage

_stages: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runner -> {shape key: GraphStage}


def _describe(runner, key) -> str:
    return f"sglang {type(runner).__name__} {key}"


def sglang_graph_build(runner, key) -> None:
    """Before ``self.backend.capture_one(shape_key, ...)``: a new stage for that graph."""
    if not graph_stage._users:
        return
    stages = _stages.setdefault(runner, {})
    stages[key] = graph_stage.begin_build(stages.get(key), _describe(runner, key))


def sglang_graph_built(runner, key) -> None:
    """After ``capture_one``: the build is over (the graph keeps its stage)."""
    graph_stage.end_build()


def _replayed_stage(runner):
    stages = _stages.get(runner)
    return stages.get(getattr(runner, "_replay_graph_key", None)) if stages else None


def sglang_graph_replay(runner) -> None:
    """Before ``self.backend.replay(...)`` in ``execute``."""
    if graph_stage._users:
        graph_stage.before_replay(_replayed_stage(runner),
                                  lambda: _describe(runner, getattr(runner, "_replay_graph_key", None)))


def sglang_graph_replayed(runner) -> None:
    """After ``self.backend.replay(...)``: the real tokens' rows go to their writers."""
    if graph_stage._users:
        graph_stage.after_replay(_replayed_stage(runner), rows=int(runner.raw_num_token))
