"""Capture under SGLang's decode CUDA graphs (issue 31, build item 2;
runtime/core/adapters/sglang_graphs.py, the decode-graph-* patches of routing.yaml, dump.yaml
and trace.yaml).

No machine here runs SGLang's DecodeCudaGraphRunner: SGLang 0.5.23 needs torch 2.14
and sgl-kernel, which the GPU machines do not have, and its CPU graph path cannot start
on the CPU machines (tests/test_sglang_cpu_graph.py says why).  So the proof is in
parts: the patches apply to the real runner of every supported release (the spec
checks of test_routing_sglang.py, test_dump_sglang.py and test_trace_sglang.py, and
docs/compat.md); the hooks drive the stages as the runner calls them, with staged
buffers put in by hand (CPU); and on a GPU the SGLang routing and dump call sites,
captured in a real torch.cuda.graph between the build hooks and replayed through the
replay hooks with new batches of fewer real rows, write exactly what eager calls on
the same rows write.
``Runner`` holds only what the hooks read of a DecodeCudaGraphRunner."""

import types

import pytest

torch = pytest.importorskip("torch")

from source_patch.runtime.core.adapters import graph_stage, sglang_graphs  # noqa: E402
from source_patch.runtime.dump import sglang as dump_sglang  # noqa: E402
from source_patch.runtime.dump.reader import load  # noqa: E402
from source_patch.runtime.routing.sglang import batch as rs_batch, call_sites as rs_sites  # noqa: E402
from source_patch.runtime.routing.sglang import capture as rs_capture, control as rs  # noqa: E402
from source_patch.runtime.routing.sglang import graphs as rs_graphs, state as rs_state  # noqa: E402

PAD, E, K, H = 8, 8, 2, 16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the fields of SGLang's TopKConfig that routing replay reads (sglang is not on the GPU machines)
TOPK = types.SimpleNamespace(scoring_func="softmax", renormalize=True, apply_routed_scaling_factor_on_output=False,
                             routed_scaling_factor=None, allow_routed_experts_capture=True)


class Runner:
    """What the hooks read of SGLang's DecodeCudaGraphRunner."""

    def __init__(self):
        self.raw_num_token = None
        self._replay_graph_key = None


@pytest.fixture(autouse=True)
def _fresh():
    rs.reset()
    yield
    rs.configure(mode="off")
    rs.reset()
    graph_stage._set_local(stage=None, building=None)


def _router(x, w):
    """A router as SGLang's torch-native top-k computes it: (ids, weights, logits).  Row by
    row elementwise, so bitwise the same in a batch of 8 rows or of 3 (a matmul's kernel
    may change with the row count)."""
    logits = torch.tanh(x[:, :E] * w)
    weights, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True), logits


def _route(x, w, layers=(0, 1)):
    """Two MoE layers' routers with routing's call site, as patched select_experts calls it."""
    out = []
    for layer in layers:
        ids, weights, logits = _router(x, w[layer])
        rs_sites.routing_sglang_topk(ids, weights, logits, TOPK, layer, K)
        out.append((ids, weights))
    return out


def _replay(runner, key, rows):
    """What execute() does around backend.replay, each hook twice (two specs active)."""
    runner._replay_graph_key, runner.raw_num_token = key, rows
    sglang_graphs.sglang_graph_replay(runner)
    sglang_graphs.sglang_graph_replay(runner)


def _replayed(runner):
    sglang_graphs.sglang_graph_replayed(runner)
    sglang_graphs.sglang_graph_replayed(runner)


# --------------------------------------------------------------------------- CPU


def test_warmups_record_nothing_and_a_replay_drains_only_the_real_rows():
    """Between build and built (the backend's two eager warm-up passes on the placeholder
    batch) the router's call site records nothing.  A replay drains the staged ids and
    weights of its real rows into the record an eager forward of those rows writes; a
    draft model's replay (speculative decoding) is not routed here."""
    torch.manual_seed(0)
    rs.configure(mode="capture")
    runner, w = Runner(), torch.randn(2, E)
    rs_sites.routing_sglang_graph_build(runner, PAD)
    rs_sites.routing_sglang_graph_build(runner, PAD)  # dump.yaml's copy of the hook: the same build
    assert graph_stage.warming_up() and graph_stage.busy == 1
    _route(torch.randn(PAD, H), w)  # a warm-up pass
    assert rs_capture.records() == {} and not rs_state.S.warned
    stage = sglang_graphs._stages[runner][PAD]
    stage.begin()  # on a GPU the first call site under the capture does this (the GPU test below)
    parts = list(_route_parts(torch.zeros(PAD, H), w))
    for layer in (0, 1):  # what the call sites under the capture stage
        stage.put(rs_graphs._drained, (layer, "ids"), parts[2 * layer], experts=E)
        stage.put(rs_graphs._drained, (layer, "weights"), parts[2 * layer + 1])
    sglang_graphs.sglang_graph_built(runner, PAD)
    sglang_graphs.sglang_graph_built(runner, PAD)
    assert graph_stage.busy == 0 and len(stage.entries) == 4
    rs.reset()
    rs.configure(mode="capture")
    batches = [(["a", "b", "c"], torch.randn(3, H)), (["a", "b"], torch.randn(2, H))]
    for rids, x in batches:
        rs_batch.set_batch(rids, [1] * len(rids))  # what ModelRunner._forward_raw's call site does
        _replay(runner, PAD, len(rids))
        padded = torch.cat([x, 100 * torch.randn(PAD - len(x), H)])
        for (_, _, buffer, _), part in zip(stage.entries, _route_parts(padded, w)):
            buffer.copy_(part)  # what the graph's replay computes into its staging buffers
        _replayed(runner)
    rs_batch.clear_batch(skip=True)  # a draft model's forward
    _replay(runner, PAD, 2)
    _replayed(runner)
    graphed = rs_capture.records()
    rs.reset()
    rs.configure(mode="capture")
    for rids, x in batches:
        rs_batch.set_batch(rids, [1] * len(rids))
        _route(x, w)
    eager = rs_capture.records()
    assert sorted(graphed) == sorted(eager) == ["a", "b", "c"]
    for rid in eager:
        assert graphed[rid].num_tokens == eager[rid].num_tokens == (2 if rid != "c" else 1)
        assert all(torch.equal(graphed[rid].indices[k], eager[rid].indices[k]) for k in (0, 1))
    assert stage.replays == 3 and not stage.undrained


def _route_parts(x, w):
    """The staged tensors of one forward, in staging order: per layer ids, then weights."""
    for layer in (0, 1):
        ids, weights, _ = _router(x, w[layer])
        yield ids
        yield weights


def test_replay_feeds_each_graph_the_recorded_rows_and_keeps_the_rest():
    """Routing replay under a decode graph: the buffer the capture feeds is allocated in
    a warm-up pass (outside the graph's memory pool, where an earlier kernel's scratch
    memory would overwrite each fill); before each replay it holds the recorded ids of
    each request's rows and a keep flag; rows of a request without a record, and the
    padding, keep the router's choice (flag 0)."""
    rec = {"a": _record([[1, 2], [3, 4], [5, 6]])}
    rs.configure(mode="replay", replay=rec)
    runner = Runner()
    rs_sites.routing_sglang_graph_build(runner, PAD)
    _route(torch.randn(PAD, H), torch.randn(2, E), layers=(0,))  # a warm-up pass: the feed's buffer, reserved
    reserved = sglang_graphs._stages[runner][PAD].reserved[0]
    fed = graph_stage.feed(rs_graphs._fill, 0, torch.empty(PAD, K + 1, dtype=torch.int64), experts=E)
    assert fed is reserved  # allocated before the capture: no kernel of the graph can use its memory
    sglang_graphs.sglang_graph_built(runner, PAD)
    rs_batch.set_batch(["zz", "a"], [1, 1], [0, 2])  # zz: no record; a: its third row
    with pytest.warns(RuntimeWarning, match="no record for request 'zz'"):
        _replay(runner, PAD, 2)
    assert fed.tolist() == [[0, 0, 0], [5, 6, 1]] + [[0, 0, 0]] * (PAD - 2)
    _replayed(runner)
    rs_batch.set_batch(["a"], [1], [9])  # past the record's end: the router's own, warned
    with pytest.warns(RuntimeWarning, match="needs rows"):
        _replay(runner, PAD, 1)
    assert fed.sum() == 0


def _record(rows):
    from source_patch.runtime.routing.records.record import RoutingRecord

    ids = torch.tensor(rows)
    return RoutingRecord(indices={0: ids}, num_experts=E, topk=K, layers=[0], token_order="requests",
                         sample_ids=["a"], source="sglang", extra={"start_pos": 0})


def test_a_graph_captured_while_routing_was_off_says_so():
    runner = Runner()
    graph_stage.use("test", on=True)
    try:
        sglang_graphs.sglang_graph_build(runner, 4)
        sglang_graphs.sglang_graph_built(runner, 4)
    finally:
        graph_stage.use("test", on=False)
    rs.configure(mode="capture")
    with pytest.warns(RuntimeWarning, match="sglang Runner 4: its CUDA graph was captured while routing was off"):
        _replay(runner, 4, 1)
    _replayed(runner)


def test_a_dumped_forward_start_is_not_a_warmup(dumper):
    """The model's forward entry (dump_sglang_forward) during a decode graph's warm-ups
    or capture records nothing and counts no step: a replay's start is recorded by
    dump_sglang_replay instead."""
    runner, before = Runner(), dump_sglang._forward_pass
    dump_sglang.dump_sglang_graph_build(runner, PAD)
    dump_sglang.dump_sglang_forward(None, None, None, None)  # would fail on None if it ran
    sglang_graphs.sglang_graph_built(runner, PAD)
    assert dump_sglang._forward_pass == before and dumper.state()["counters"]["errors"] == 0


# --------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
def test_routing_and_dumps_under_a_decode_graph_equal_eager(dumper, tmp_path):
    """The SGLang routing call site and dump call sites captured in an 8-row
    torch.cuda.graph between the build hooks (after two warm-up passes), replayed through
    the replay hooks with 3, 8 and 5 real rows (junk in the padding): the routing records
    and dumps are those of eager calls on the same rows, the dumps tagged cuda_graph.
    Then routing replay: the graph routes the recorded rows as recorded."""
    torch.manual_seed(0)
    w = torch.randn(2, E, device="cuda")
    static = torch.zeros(PAD, H, device="cuda")
    batches = [(["a", "b", "c"], torch.randn(3, H, device="cuda")),
               ([f"r{i}" for i in range(PAD)], torch.randn(PAD, H, device="cuda")),
               (["a", "b", "c", "r1", "r2"], torch.randn(5, H, device="cuda"))]

    def forward(x):
        dumper.dump("layer_input", x, layer=0)
        out = _route(x, w)
        dumper.dump("topk_ids", out[1][0], layer=1)
        return out

    def build(runner):
        rs_sites.routing_sglang_graph_build(runner, PAD)
        dump_sglang.dump_sglang_graph_build(runner, PAD)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the backend's warm-ups
                forward(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(static)
        sglang_graphs.sglang_graph_built(runner, PAD)
        return graph, out

    def graphed(runner, graph, out):
        for step, (rids, x) in enumerate(batches):
            dumper.dump_step(step=step)
            rs_batch.set_batch(rids, [1] * len(rids))
            static.copy_(torch.cat([x, 100 * torch.randn(PAD - len(x), H, device="cuda")]))
            _replay(runner, PAD, len(rids))
            graph.replay()
            _replayed(runner)
            yield [(ids[:len(rids)].clone(), weights[:len(rids)].clone()) for ids, weights in out]

    def eager():
        for step, (rids, x) in enumerate(batches):
            dumper.dump_step(step=step)
            rs_batch.set_batch(rids, [1] * len(rids))
            yield forward(x)

    rs.configure(mode="capture")
    runner = Runner()
    graph, out = build(runner)
    assert rs_capture.records() == {} and len(sglang_graphs._stages[runner][PAD].entries) == 6
    list(graphed(runner, graph, out))
    graph_routes = rs_capture.records()
    dumper.flush()
    graph_dumps = {(r.step, r.name, r.layer): r for r in load(tmp_path / "dumps" / "t")}
    rs.reset()
    rs.configure(mode="capture")
    dumper.configure(exp_name="eager")
    list(eager())
    eager_routes = rs_capture.records()
    dumper.flush()
    eager_dumps = {(r.step, r.name, r.layer): r for r in load(tmp_path / "dumps" / "eager")}
    assert sorted(graph_routes) == sorted(eager_routes) and len(eager_routes) == 3 + PAD  # a, b, c, r0..r7
    for rid, rec in eager_routes.items():
        assert graph_routes[rid].num_tokens == rec.num_tokens
        assert all(torch.equal(graph_routes[rid].indices[k], rec.indices[k]) for k in (0, 1)), rid
    assert sorted(graph_dumps) == sorted(eager_dumps) and len(eager_dumps) == 6
    for key, rec in eager_dumps.items():
        assert torch.equal(graph_dumps[key].tensor, rec.tensor), key
        assert graph_dumps[key].tags == {**rec.tags, "cuda_graph": True}

    # replay: records of other inputs, so that the router's own choice differs
    rs.reset()
    rs.configure(mode="replay", replay=eager_routes)
    dumper.configure(enable=False)
    shuffled = [(rids, x.flip(1)) for rids, x in batches]
    batches[:] = shuffled
    runner = Runner()
    graph, out = build(runner)
    replayed = list(graphed(runner, graph, out))
    eager_replayed = list(eager())
    for got, want in zip(replayed, eager_replayed):
        for (g_ids, g_w), (e_ids, e_w) in zip(got, want):
            assert torch.equal(g_ids, e_ids) and torch.allclose(g_w, e_w, rtol=1e-6, atol=1e-7)
    first = eager_routes["a"].indices[0][0]
    assert torch.equal(replayed[0][0][0][0].long().cpu(), first.long())
