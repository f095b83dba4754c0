"""Graph-safe call sites (runtime/core/adapters/graph_stage.py, issue 31 build item 1): a call site
under CUDA graph capture stages its tensor in the graph; every replay is drained into the
same writer an eager call uses, padding rows excluded, tagged cuda_graph; an undrained
replay is an error.  Captured in torch.cuda.graph and replayed with new inputs (gpu);
on CPU only what needs no graph."""

import pytest

torch = pytest.importorskip("torch")

from source_patch.runtime.core.adapters import graph_stage  # noqa: E402
from source_patch.runtime.core.adapters.graph_stage import GraphStage, GraphStageError  # noqa: E402
from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing  # noqa: E402
from source_patch.runtime.routing.megatron import replay as routing_replay  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PAD, E, K = 8, 8, 2


def test_eager_call_sites_are_not_staged():
    """Off a capturing stream a call site writes as it always did (stage() says False)."""
    seen = []
    assert graph_stage.stage(lambda *a, **k: seen.append(a), "x", torch.ones(3)) is False
    assert seen == [] and not graph_stage.capturing() and graph_stage.active() is None
    stage = GraphStage("g")
    with pytest.raises(GraphStageError, match="graph 'g': nothing to drain"):
        stage.drain()


class Writer:
    """What an eager call site writes: (key, rows, tags) in call order."""

    def __init__(self):
        self.rows = []

    def __call__(self, key, tensor, **tags):
        self.rows.append((key, tensor.detach().cpu(), tags))


def _site(writer, key, tensor):
    """A call site: staged under capture, written directly otherwise."""
    if not graph_stage.stage(writer, key, tensor):
        writer(key, tensor.detach().clone(), cuda_graph=False)


def _model(writer, x, w):
    h = torch.tanh(x * w)  # row by row: bitwise the same in a batch of 8 or of 3
    _site(writer, "hidden", h)
    ids = torch.topk(h.softmax(-1), K, dim=-1).indices
    _site(writer, "topk", ids)
    return h.relu().sum(-1)


def _captured(writer, w):
    static = torch.zeros(PAD, E, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks: eager, into a throwaway writer
        _model(Writer(), static, w)
    torch.cuda.current_stream().wait_stream(side)
    graph, stage = torch.cuda.CUDAGraph(), GraphStage("toy")
    with stage.capture(), torch.cuda.graph(graph):
        out = _model(writer, static, w)
    return graph, stage, static, out


@gpu
@pytest.mark.gpu
def test_replays_drain_exactly_what_eager_calls_record():
    torch.manual_seed(0)
    w = torch.randn(E, device="cuda")
    graphed, eager = Writer(), Writer()
    graph, stage, static, out = _captured(graphed, w)
    assert graphed.rows == [] and len(stage.entries) == 2  # capture staged, wrote nothing
    for step, rows in enumerate((8, 5, 3)):
        x = torch.randn(rows, E, device="cuda")
        static.copy_(torch.cat([x, 100 * torch.randn(PAD - rows, E, device="cuda")]))  # padding: junk
        stage.replay(graph)
        assert stage.drain(rows=rows, step=step) == 2
        _model(eager, x, w)
        assert torch.equal(out[:rows], _model(Writer(), x, w))
    assert len(graphed.rows) == len(eager.rows) == 6
    for (gk, g, gtags), (ek, e, _) in zip(graphed.rows, eager.rows):
        assert gk == ek and g.shape == e.shape  # padding rows never reach the writer
        assert torch.equal(g, e)
        assert gtags["cuda_graph"] is True
    assert [t["replay"] for _, _, t in graphed.rows] == [1, 1, 2, 2, 3, 3]
    assert [t["step"] for _, _, t in graphed.rows] == [0, 0, 1, 1, 2, 2]


@gpu
@pytest.mark.gpu
def test_nothing_stale_is_ever_written():
    w = torch.randn(E, device="cuda")
    writer = Writer()
    graph, stage, static, _ = _captured(writer, w)
    stage.replay(graph)
    with pytest.raises(GraphStageError, match="replay 2 would overwrite the staged rows of replay 1"):
        stage.replay(graph)
    stage.drain(rows=4)
    with pytest.raises(GraphStageError, match="nothing to drain"):
        stage.drain(rows=4)
    with pytest.raises(GraphStageError, match="4 rows asked of|9 rows asked of"):
        stage.replay(graph)
        stage.drain(rows=9)
    # a call site under capture with no GraphStage: an error at capture, not a silent loss
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(GraphStageError, match="outside GraphStage.capture"):
        with torch.cuda.graph(g2):
            _model(writer, static, w)


class Router:
    def __init__(self, layer):
        self.layer_number = layer
        self.config = type("C", (), {"sequence_parallel": False, "num_moe_experts": E})()


def _moe(rt, scores):
    """Two routers, as a Megatron MoE forward calls our call sites (patches/routing.yaml)."""
    for layer in (1, 2):
        s = scores * layer
        rt.routing_enter(Router(layer), s.view(s.shape[0] // 2, 2, -1))
        rt.routing_topk(s, torch.topk(s, K, dim=1))
        rt.routing_exit()


@gpu
@pytest.mark.gpu
def test_megatron_routing_capture_through_the_drain():
    """runtime/routing/megatron/control.py's capture under torch.cuda.graph: each replay, drained
    inside its microbatch, gives the record an eager forward of the same rows gives,
    tagged cuda_graph; the padding rows of the graph's batch are not in it."""
    routing.reset()
    try:
        routing.configure(mode="capture", dir="", probs=False)
        static = torch.zeros(PAD, E, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside any microbatch: nothing recorded for it
            routing.configure(mode="off")
            _moe(routing, static)
            routing.configure(mode="capture", dir="", probs=False)
        torch.cuda.current_stream().wait_stream(side)
        graph, stage = torch.cuda.CUDAGraph(), GraphStage("moe")
        with stage.capture(), torch.cuda.graph(graph):
            _moe(routing, static)
        torch.manual_seed(1)
        inputs = [torch.randn(rows, E, device="cuda") for rows in (8, 6, 4)]
        for x in inputs:  # replayed: microbatches 0..2
            static.copy_(torch.cat([x, torch.randn(PAD - len(x), E, device="cuda")]))
            routing.routing_microbatch_begin()
            stage.replay(graph)
            stage.drain(rows=len(x))
            routing.routing_microbatch_end()
        graphed = routing_capture.records()
        routing.reset()
        routing.configure(mode="capture", dir="", probs=False)
        for x in inputs:  # eager: the same rows
            routing.routing_microbatch_begin()
            _moe(routing, x)
            routing.routing_microbatch_end()
        eager = routing_capture.records()
    finally:
        routing.configure(mode="off")
        routing.reset()
    assert len(graphed) == len(eager) == 3
    for g, e, x in zip(graphed, eager, inputs):
        assert g.extra == {**e.extra, "cuda_graph": True} and g.layers == e.layers == [1, 2]
        assert g.num_tokens == len(x) and g.seq_lens == e.seq_lens
        assert all(torch.equal(g.indices[k], e.indices[k]) for k in g.layers)


def _moe_ids(rt, scores):
    """_moe, returning each router's (values, ids): what the graphed forward computes."""
    out = []
    for layer in (1, 2):
        s = scores * layer
        rt.routing_enter(Router(layer), s.view(s.shape[0] // 2, 2, -1))
        out.append(rt.routing_topk(s, torch.topk(s, K, dim=1)))
        rt.routing_exit()
    return out


@gpu
@pytest.mark.gpu
def test_megatron_routing_replay_feeds_each_replay_its_own_record():
    """Replay under torch.cuda.graph: the graphed router reads its ids from a static buffer
    that GraphStage.replay refills from the record of the current micro-batch, so three
    replays follow three different records (never the capture's); values are the live
    scores gathered at the recorded ids, as in eager replay. No record: a clear error."""
    from source_patch.runtime.routing.megatron.files import RoutingReplayError
    from source_patch.runtime.routing.records.record import RoutingRecord

    torch.manual_seed(2)
    records = []
    for mb in range(3):
        ids = {k: torch.stack([torch.randperm(E)[:K] for _ in range(PAD)]) for k in (1, 2)}
        records.append(RoutingRecord(indices=ids, num_experts=E, seq_lens=[PAD // 2] * 2,
                                     extra={"step": 0, "microbatch": mb}))
    routing.reset()
    try:
        routing.configure(mode="off")
        static = torch.randn(PAD, E, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _moe_ids(routing, static)
        torch.cuda.current_stream().wait_stream(side)
        routing.configure(mode="replay")
        routing_replay.set_replay(records)
        graph, stage = torch.cuda.CUDAGraph(), GraphStage("moe-replay")
        with stage.capture(), torch.cuda.graph(graph):
            outs = _moe_ids(routing, static)
        assert [key for _, key, _, _ in stage.feeds] == [("routing", 1), ("routing", 2)]
        for rec in records:
            static.copy_(torch.randn(PAD, E, device="cuda"))
            routing.routing_microbatch_begin()
            stage.replay(graph)
            routing.routing_microbatch_end()  # checks every recorded layer was routed
            for layer, (values, ids) in zip((1, 2), outs):
                assert torch.equal(ids.cpu(), rec.indices[layer])
                assert torch.equal(values, (static * layer).gather(1, ids))
        routing.routing_microbatch_begin()  # microbatch 3: no record
        with pytest.raises(RoutingReplayError, match="step 0, microbatch 3: no routing record to replay"):
            stage.replay(graph)
    finally:
        routing.configure(mode="off")
        routing.reset()


# --------------------------------------------------------------------------- Megatron's runners (CPU)
# patches/routing.yaml calls graph_build / graph_capture / graph_captured around a
# _CudaGraphRunner's create_fwd_graph and graph_replay / graph_replayed around each
# fwd_graph.replay(); the capture itself needs CUDA (tests/test_megatron_graphs.py), the
# bookkeeping around it does not: staged and fed buffers are put in by hand here.


class Runner:
    """What the hooks read of megatron-core's _CudaGraphRunner."""

    def __init__(self, layer=3):
        self.base_module = type("MoETransformerLayer", (), {"layer_number": layer})()
        self.func = None


def test_runner_hooks_cost_one_test_without_a_user():
    graph_stage.use("routing", on=False)
    runner = Runner()
    graph_stage.graph_build(runner)
    assert not graph_stage.warming_up() and graph_stage.active() is None
    graph_stage.graph_capture(runner)
    assert graph_stage.active() is None
    graph_stage.graph_captured(runner)
    graph_stage.graph_replay(runner)
    graph_stage.graph_replayed(runner)  # nothing staged, nothing drained, nothing raised


def test_runner_build_warmup_capture_replay_drain():
    """Warm-up passes (between build and capture) are flagged; call sites in the capture
    stage into the runner's stage; each replay is fed before and drained after."""
    graph_stage.use("test", on=True)
    try:
        runner, writer, fills = Runner(), Writer(), []
        graph_stage.graph_build(runner)
        assert graph_stage.warming_up() and graph_stage.active() is None
        graph_stage.graph_capture(runner)
        stage = graph_stage.active()
        assert stage is not None and not graph_stage.warming_up() and stage.name == "megatron MoETransformerLayer 3"
        stage.put(writer, "ids", torch.tensor([[1, 2], [3, 4]]))
        buffer = graph_stage.feed(lambda key, buf, **t: fills.append((key, t["replay"])) or buf.fill_(7), "in",
                                  torch.zeros(2))
        graph_stage.graph_captured(runner)
        assert graph_stage.active() is None and not graph_stage.warming_up()
        for n in (1, 2):
            graph_stage.graph_replay(runner)
            assert torch.equal(buffer, torch.full((2,), 7.0)) and fills[-1] == ("in", n)
            graph_stage.graph_replayed(runner)
        assert [(k, t["replay"], t["cuda_graph"]) for k, _, t in writer.rows] == [("ids", 1, True), ("ids", 2, True)]
        assert torch.equal(writer.rows[0][1], torch.tensor([[1, 2], [3, 4]]))
        stage.after_replay()  # a replay the hooks did not drain: the next one refuses
        with pytest.raises(GraphStageError, match="never drained"):
            graph_stage.graph_replay(runner)
    finally:
        graph_stage.use("test", on=False)


def test_megatron_routing_skips_warmup_and_refuses_unstaged_replay():
    """Routing capture records nothing from a graph's warm-up passes; a graph built while
    routing was off: capture warns, replay raises (it would route as at its capture)."""
    from source_patch.runtime.routing.megatron.files import RoutingReplayError

    routing.reset()
    try:
        routing.configure(mode="capture", dir="", probs=False)
        runner = Runner()
        graph_stage.graph_build(runner)
        _moe(routing, torch.randn(PAD, E))  # a warm-up pass
        graph_stage.graph_captured(runner)
        assert routing_capture.records() == []
        _moe(routing, torch.randn(PAD, E))  # eager, after the build: recorded
        assert [r.layers for r in routing_capture.records()] == [[1, 2]]
        unbuilt = Runner(5)
        with pytest.warns(RuntimeWarning, match="built .* while routing was off"):
            graph_stage.graph_replay(unbuilt)
        routing.configure(mode="replay")
        with pytest.raises(RoutingReplayError, match="MoETransformerLayer 5"):
            graph_stage.graph_replay(unbuilt)
        routing.configure(mode="off")
        graph_stage.graph_replay(unbuilt)  # off: one test, nothing else
    finally:
        routing.configure(mode="off")
        routing.reset()
