"""Dump and trace call sites under CUDA graphs (issue 31, build item 1): the same
GraphStage mechanism routing uses (runtime/core/adapters/graph_stage.py).  Under capture a
call site stages a copy in the graph; the drain after each replay writes the rows
(padding excluded) through the eager writer, tagged cuda_graph, with the step as it is
then; a Megatron graph's warm-up passes record nothing.  The GPU test captures dump,
trace and routing call sites in a plain torch.cuda.graph; on CPU what needs no graph
(Megatron's build / replay hooks, with staged buffers put in by hand)."""

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from source_patch.runtime.core.adapters import graph_stage  # noqa: E402
from source_patch.runtime.core.endpoint import free_port  # noqa: E402
from source_patch.runtime.core.adapters.graph_stage import GraphStage, GraphStageError  # noqa: E402
from source_patch.runtime.dump.reader import load  # noqa: E402
from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing  # noqa: E402
from source_patch.runtime.trace import api, control, graphs  # noqa: E402
from source_patch.runtime.trace import compress as tc  # noqa: E402
from source_patch.runtime.trace.client import connect  # noqa: E402

PAD, E, K = 8, 8, 2
TILES = {"kind": "tiles", "tiles": 4}


class Runner:
    """What the hooks read of megatron-core's _CudaGraphRunner."""

    def __init__(self, layer=3):
        self.base_module = type("MoETransformerLayer", (), {"layer_number": layer})()
        self.func = None


@pytest.fixture
def tracer(tmp_path):
    """Tracing on, its hub in a thread on a free port; off again afterwards."""
    control.configure(enable=True, port=free_port(), token="t", dir=str(tmp_path / "sp-trace"), ranks=[0],
                      hub="thread", wait=0, client_queue=256)
    control.reset()
    yield api
    control.close()
    control.configure(enable=False, port=0)


def _frames(subscribe_then, n: int) -> list:
    """Subscribe to everything (tiles), run ``subscribe_then()``, return ``n`` frames."""

    async def main():
        async with connect(control.url()) as client:
            await client.subscribe(["*"], compressor=TILES, id="all")
            subscribe_then()
            control.flush()
            return [await client.next_frame(10) for _ in range(n)]

    return asyncio.run(asyncio.wait_for(main(), 60))


def _records(folder) -> dict:
    """(step, name, layer) -> (tensor, tags) of every dump record under ``folder``."""
    return {(r.step, r.name, r.layer): (r.tensor, r.tags) for r in load(folder)}


# --------------------------------------------------------------------------- CPU


def test_off_and_eager_cost_one_flag_and_warmup_passes_record_nothing(dumper, tmp_path):
    """No build or capture anywhere: ``busy`` is 0 and a call site goes its eager way.
    Between a Megatron graph's build and its capture (the eager warm-up passes, zeros in)
    dump and trace record nothing; after the capture they record again."""
    assert graph_stage.busy == 0 and "dump" in graph_stage._users
    x = torch.arange(6.0).view(3, 2)
    runner = Runner()
    graph_stage.graph_build(runner)
    graph_stage.graph_build(runner)  # another spec's copy of the hook: the same build
    assert graph_stage.busy == 1 and graph_stage.warming_up()
    assert dumper.dump("warm", x, layer=3) is x and api.trace("warm", x, layer=3) is x
    graph_stage.graph_capture(runner)
    graph_stage.graph_capture(runner)
    assert graph_stage.busy == 1 and graph_stage.active() is graph_stage._stages[runner]
    graph_stage.graph_captured(runner)
    graph_stage.graph_captured(runner)
    assert graph_stage.busy == 0 and not graph_stage.warming_up()
    dumper.dump("eager", x, layer=3)
    dumper.flush()
    assert [r.name for r in load(tmp_path / "dumps" / "t")] == ["eager"]


def test_a_drained_dump_is_the_eager_record_tagged_cuda_graph(dumper, tmp_path):
    """Megatron's replay hooks (each spec's copy) drain a staged dump once, as the record
    an eager call would write now: the step and microbatch of the replay, not of the
    capture; the call site's own tags; a tuple's elements by their names."""
    runner, h = Runner(), torch.randn(4, 3)
    dumper.dump_step(step=0)
    graph_stage.graph_build(runner)
    graph_stage.graph_capture(runner)
    stage = graph_stage.active()
    stage.put(dumper._drained, ("hidden", "hidden"), h, tags={"layer": 3})
    stage.put(dumper._drained, ("pair", "pair.1"), h * 2, tags={"layer": 3})
    graph_stage.graph_captured(runner)
    dumper.dump_step(step=7)
    dumper.dump_context(phase="fwd_bwd", microbatch=1)
    for _ in range(2):  # routing.yaml's and dump.yaml's copies of each hook
        graph_stage.graph_replay(runner)
    for _ in range(2):
        graph_stage.graph_replayed(runner)
    dumper.dump("hidden", h, layer=3)
    dumper.dump("pair", (h, h * 2), layer=3)
    dumper.flush()
    got = load(tmp_path / "dumps" / "t")
    assert [(r.name, r.step, r.microbatch, r.phase, r.tags.get("cuda_graph")) for r in got] == [
        ("hidden", 7, 1, "fwd_bwd", True), ("pair.1", 7, 1, "fwd_bwd", True),
        ("hidden", 7, 1, "fwd_bwd", None), ("pair.0", 7, 1, "fwd_bwd", None), ("pair.1", 7, 1, "fwd_bwd", None)]
    assert torch.equal(got[0].tensor, got[2].tensor) and torch.equal(got[1].tensor, got[4].tensor)
    assert {k: v for k, v in got[0].tags.items() if k != "cuda_graph"} == got[2].tags
    assert stage.replays == 1 and not stage.undrained


def test_a_graph_built_while_dumping_was_off_says_so_once(dumper, caplog):
    graph_stage.use("dump", on=False)
    graph_stage.use("test", on=True)
    try:
        runner = Runner(5)
        graph_stage.graph_build(runner)
        graph_stage.graph_capture(runner)
        graph_stage.graph_captured(runner)
    finally:
        graph_stage.use("test", on=False)
        graph_stage.use("dump", dumper._unstaged)
    before = dumper.state()["counters"]["errors"]
    for _ in range(3):
        graph_stage.graph_replay(runner)
        graph_stage.graph_replayed(runner)
    assert dumper.state()["counters"]["errors"] == before + 1
    assert "MoETransformerLayer 5: its CUDA graph was built while dumping was off" in dumper.state()["last_error"]


def test_a_drained_trace_is_offered_as_an_eager_call_tagged_cuda_graph(tracer):
    runner, h = Runner(), torch.randn(4, 16)
    graph_stage.graph_build(runner)
    graph_stage.graph_capture(runner)
    graph_stage.active().put(graphs._drained, ("hidden", 3), h, tags={"layer": 3})
    graph_stage.graph_captured(runner)

    def steps():
        api.trace_step(step=4)
        graph_stage.graph_replay(runner)
        graph_stage.graph_replayed(runner)
        api.trace_step(step=5)  # once per step and (name, layer) with every: 1
        api.trace("hidden", h, layer=3)

    graphed, eager = _frames(steps, 2)
    assert graphed.meta["cuda_graph"] is True and "cuda_graph" not in eager.meta
    assert [(f.step, f.layer, f.meta["name"]) for f in (graphed, eager)] == [(4, 3, "hidden"), (5, 3, "hidden")]
    assert np.array_equal(graphed.array, eager.array)


# --------------------------------------------------------------------------- GPU: torch.cuda.graph

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Router:
    def __init__(self, layer):
        self.layer_number = layer
        self.config = type("C", (), {"sequence_parallel": False, "num_moe_experts": E})()


def _forward(dump, x, w, sites=True):
    """A toy two-layer MoE forward with the runtime's three kinds of call site, called as
    patched modules call them (patches/dump.yaml, trace.yaml, routing.yaml)."""
    h = x
    for layer in (1, 2):
        h = torch.tanh(h * w[layer - 1])  # row by row: bitwise the same in a batch of 8 or of 3
        if sites:
            dump.dump("hidden", h, layer=layer)
            api.trace("hidden", h, layer=layer)
            routing.routing_enter(Router(layer), h.view(h.shape[0], 1, -1))
        scores = h.softmax(-1)
        if sites:
            routing.routing_topk(scores, torch.topk(scores, K, dim=1))
            routing.routing_exit()
    return h


@gpu
@pytest.mark.gpu
def test_dump_trace_and_routing_call_sites_in_a_plain_cuda_graph(dumper, tracer, tmp_path):
    """Captured once in an 8-row torch.cuda.graph, replayed with new inputs of 8, 5 and 3
    real rows (junk in the padding): each drain gives exactly the dump records, trace
    frames and routing record that eager calls on the same rows give, tagged cuda_graph,
    with the step of its replay.  A replay whose stage was not drained raises."""
    torch.manual_seed(0)
    w = torch.randn(2, E, device="cuda")
    inputs = [torch.randn(rows, E, device="cuda") for rows in (8, 5, 3)]
    static = torch.zeros(PAD, E, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks (no call sites: not a forward)
        _forward(dumper, static, w, sites=False)
    torch.cuda.current_stream().wait_stream(side)
    routing.reset()
    routing.configure(mode="capture", dir="", probs=False)
    graph, stage = torch.cuda.CUDAGraph(), GraphStage("toy")
    try:
        with stage.capture(), torch.cuda.graph(graph):
            out = _forward(dumper, static, w)
        assert len(stage.entries) == 6 and graph_stage.busy == 0  # 2 layers x (dump, trace, routing)

        def graphed_steps():
            for step, x in enumerate(inputs):
                dumper.dump_step(step=step)
                api.trace_step(step=step)
                static.copy_(torch.cat([x, 100 * torch.randn(PAD - len(x), E, device="cuda")]))
                routing.routing_microbatch_begin()
                stage.replay(graph)
                stage.drain(rows=len(x))
                routing.routing_microbatch_end()
                assert torch.equal(out[:len(x)], _forward(dumper, x, w, sites=False))

        graphed_frames = _frames(graphed_steps, 6)
        graphed_routes = routing_capture.records()
        dumper.flush()
        graphed = _records(tmp_path / "dumps" / "t")
        dumper.configure(exp_name="eager")
        routing.reset()
        routing.configure(mode="capture", dir="", probs=False)

        def eager_steps():
            for step, x in enumerate(inputs):
                dumper.dump_step(step=step)
                api.trace_step(step=step)
                routing.routing_microbatch_begin()
                _forward(dumper, x, w)
                routing.routing_microbatch_end()

        eager_frames = _frames(eager_steps, 6)
        eager_routes = routing_capture.records()
        dumper.flush()
        eager = _records(tmp_path / "dumps" / "eager")

        stage.replay(graph)  # undrained: the next replay would overwrite its rows
        with pytest.raises(GraphStageError, match="never drained"):
            stage.replay(graph)
    finally:
        routing.configure(mode="off")
        routing.reset()
    # dumps: record for record, bitwise, padding rows excluded
    assert sorted(graphed) == sorted(eager) and len(eager) == 6
    for key, (tensor, tags) in eager.items():
        g_tensor, g_tags = graphed[key]
        assert g_tensor.shape == tensor.shape == (len(inputs[key[0]]), E)
        assert torch.equal(g_tensor, tensor), key
        assert g_tags == {**tags, "cuda_graph": True}
    # traces: the same frames (tiles of the real rows only), tagged
    assert [(f.step, f.layer) for f in graphed_frames] == [(f.step, f.layer) for f in eager_frames]
    for g, e in zip(graphed_frames, eager_frames):
        assert g.meta["cuda_graph"] is True and g.meta["source_shape"] == e.meta["source_shape"]
        assert np.array_equal(g.array, e.array)
        want = tc.parse(TILES)(eager[(g.step, "hidden", g.layer)][0]).numpy()  # on the CPU: its own rounding
        assert np.allclose(g.array, want, rtol=1e-5, atol=1e-6)
    # routing: the records of the eager forwards
    assert len(graphed_routes) == len(eager_routes) == 3
    for g, e, x in zip(graphed_routes, eager_routes, inputs):
        assert g.extra == {**e.extra, "cuda_graph": True} and g.num_tokens == len(x)
        assert all(torch.equal(g.indices[k], e.indices[k]) for k in (1, 2))


def test_routing_replay_refuses_a_graph_built_with_only_dump_on(dumper):
    """A Megatron graph built while only dumping staged (routing off) has no routing feeds:
    replaying it with routing replay on would route as at its capture, so it raises."""
    from source_patch.runtime.routing.megatron.files import RoutingReplayError

    routing.configure(mode="off")
    runner = Runner(7)
    graph_stage.graph_build(runner)
    graph_stage.graph_capture(runner)
    graph_stage.graph_captured(runner)
    assert graph_stage._stages[runner].users == frozenset({"dump"})
    try:
        routing.configure(mode="replay")
        with pytest.raises(RoutingReplayError, match="MoETransformerLayer 7"):
            graph_stage.graph_replay(runner)
    finally:
        routing.configure(mode="off")
        routing.reset()
