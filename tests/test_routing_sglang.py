"""SGLang routing capture / replay (patches/moe_sglang.yaml, runtime/routing/sglang.py)
against real sglang 0.5.23 modules on CPU: a patched copy of
sglang.srt.layers.moe.topk (select_experts with the torch-native top-k) and of
sglang.srt.model_executor.model_runner (ModelRunner._forward_raw's entry, with a
real ForwardBatch)."""

import importlib.util
import types

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from source_patch.runtime.routing import sglang as rs  # noqa: E402
from source_patch.runtime.routing.record import RoutingRecord, RoutingRecordError  # noqa: E402

E, K = 8, 2


@pytest.fixture(scope="module")
def topk_mod(sglang_topk):
    return sglang_topk  # tests/conftest.py: a patched copy of sglang.srt.layers.moe.topk


@pytest.fixture(autouse=True)
def _fresh():
    rs.reset()
    yield
    rs.reset()


def _select(topk_mod, logits, layer=0, renormalize=True, scoring_func="softmax"):
    cfg = topk_mod.TopKConfig(top_k=K, renormalize=renormalize, torch_native=True, scoring_func=scoring_func)
    out = topk_mod.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                                  layer_id=layer, topk_config=cfg)
    return out.topk_weights, out.topk_ids


def test_spec_checks_without_importing_sglang(check_sglang_spec):
    out = check_sglang_spec("moe_sglang")
    assert "ok   sglang.srt.layers.moe.topk" in out and "ok   sglang.srt.model_executor.model_runner" in out
    assert "sglang 0.5.23" in out


def test_off_by_default_changes_nothing(topk_mod):
    torch.manual_seed(0)
    logits = torch.randn(6, E)
    rs.set_batch(["a"], [6])
    w, ids = _select(topk_mod, logits)
    assert rs.records() == {}
    assert torch.equal(ids.long(), torch.topk(torch.softmax(logits, -1), K).indices)


@pytest.mark.parametrize("renormalize", [True, False])
def test_capture_per_request_in_generation_order(topk_mod, renormalize):
    """Prefill of two requests (3 + 2 tokens), then two decode steps; two layers.
    Captured ids equal torch.topk(softmax(logits)).indices *in order* (SGLang's
    torch-native top-k is torch.topk, sorted)."""
    rs.configure("capture")
    torch.manual_seed(1)
    steps = [(["a", "b"], [3, 2], [0, 0]), (["a", "b"], [1, 1], [3, 2]), (["a", "b"], [1, 1], [4, 3])]
    expected = {"a": {0: [], 1: []}, "b": {0: [], 1: []}}
    for rids, lens, starts in steps:
        rs.set_batch(rids, lens, starts)
        for layer in (0, 1):
            logits = torch.randn(sum(lens) + 1, E)  # + one padding row, not attributed
            _select(topk_mod, logits, layer=layer, renormalize=renormalize)
            want = torch.topk(torch.softmax(logits, -1), K).indices
            off = 0
            for rid, n in zip(rids, lens):
                expected[rid][layer].append(want[off:off + n])
                off += n
    recs = rs.records()
    assert sorted(recs) == ["a", "b"]
    for rid, n in (("a", 5), ("b", 4)):
        rec = recs[rid]
        assert rec.token_order == "requests" and rec.sample_ids == [rid] and rec.seq_lens == [n]
        assert rec.num_experts == E and rec.topk == K and rec.layers == [0, 1] and rec.source == "sglang"
        for layer in (0, 1):
            assert torch.equal(rec.indices[layer], torch.cat(expected[rid][layer]))


def test_capture_gap_is_an_error(topk_mod):
    rs.configure("capture")
    for starts in ([0], [5]):
        rs.set_batch(["a"], [2], starts)
        _select(topk_mod, torch.randn(2, E))
    with pytest.raises(RoutingRecordError, match="resume at position 5, expected 2"):
        rs.records()


@pytest.mark.parametrize("renormalize,scoring_func", [(True, "softmax"), (False, "softmax"), (True, "sigmoid")])
def test_replay_overrides_ids_and_weights(topk_mod, renormalize, scoring_func):
    torch.manual_seed(2)
    logits = torch.randn(5, E)
    forced = torch.tensor([[7, 0], [1, 2], [3, 6], [5, 4], [0, 1]])
    rec = RoutingRecord(indices={3: forced}, num_experts=E, token_order="requests", sample_ids=["r"],
                        seq_lens=[5], source="sglang", extra={"start_pos": 0})
    rs.configure("replay", replay={"r": rec})
    rs.set_batch(["r"], [5], [0])
    w, ids = _select(topk_mod, logits, layer=3, renormalize=renormalize, scoring_func=scoring_func)
    assert torch.equal(ids.long(), forced)
    scores = torch.softmax(logits, -1) if scoring_func == "softmax" else torch.sigmoid(logits)
    want = scores.gather(1, forced)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
        assert torch.allclose(w.sum(-1), torch.ones(5))
    assert torch.allclose(w, want, atol=1e-6)
    # Replaying what the router chose anyway gives exactly the router's own weights.
    rs.reset()
    w0, ids0 = _select(topk_mod, logits, layer=3, renormalize=renormalize, scoring_func=scoring_func)
    rec0 = rec.replace(indices={3: ids0.long()})
    rs.configure("replay", replay={"r": rec0})
    rs.set_batch(["r"], [5], [0])
    w1, ids1 = _select(topk_mod, logits, layer=3, renormalize=renormalize, scoring_func=scoring_func)
    assert torch.equal(ids1, ids0) and torch.allclose(w1, w0, atol=1e-6)


def test_capture_then_replay_by_request_and_position(topk_mod, tmp_path):
    """Record two requests, then replay them in another batch order (b first, then
    a's decode token at position 3) with other logits: the recorded ids come back."""
    rs.configure("capture", dir=tmp_path)
    torch.manual_seed(3)
    rs.set_batch(["a", "b"], [3, 2], [0, 0])
    _, ids_p = _select(topk_mod, torch.randn(5, E), layer=0)
    rs.set_batch(["a"], [1], [3])
    _, ids_d = _select(topk_mod, torch.randn(1, E), layer=0)
    rs.flush()
    rs.reset()
    rs.configure("replay", replay=tmp_path)
    rs.set_batch(["b", "a"], [2, 1], [0, 3])
    _, ids = _select(topk_mod, torch.randn(3, E), layer=0)
    assert torch.equal(ids.long(), torch.cat([ids_p[3:5], ids_d]).long())


def _bad(topk_mod, indices, num_experts=E):
    # a stand-in with the record's fields, unvalidated: a record that got corrupted
    rec = types.SimpleNamespace(indices={0: indices}, extra={"start_pos": 0}, layers=[0],
                                num_tokens=indices.shape[0])
    rs.configure("replay", replay={"r": rec})
    rs.set_batch(["r"], [4], [0])
    _select(topk_mod, torch.randn(4, E), layer=0)


def test_replay_errors_are_clear(topk_mod):
    good = dict(num_experts=E, token_order="requests", sample_ids=["r"], source="sglang", extra={"start_pos": 0})
    # too few rows for the batch
    rs.configure("replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 3)}, **good)})
    rs.set_batch(["r"], [4], [0])
    with pytest.raises(RoutingRecordError, match=r"request 'r' needs rows \[0, 4\) of layer 0, its record has 3"):
        _select(topk_mod, torch.randn(4, E), layer=0)
    # a single record replayed without attribution: wrong row count
    rs.reset()
    rs.configure("replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 3)}, **good)})
    with pytest.raises(RoutingRecordError, match="layer 0 replay ids: 3 rows for 4 tokens"):
        _select(topk_mod, torch.randn(4, E), layer=0)
    # missing layer, missing request
    rs.reset()
    rs.configure("replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 4)}, **good)})
    rs.set_batch(["r"], [4], [0])
    with pytest.raises(RoutingRecordError, match="request 'r' has no layer 5"):
        _select(topk_mod, torch.randn(4, E), layer=5)
    rs.set_batch(["zz"], [4], [0])
    with pytest.raises(RoutingRecordError, match="no record for request 'zz'"):
        _select(topk_mod, torch.randn(4, E), layer=0)
    # out of range / duplicate ids (a record built for more experts; a corrupted one)
    rs.reset()
    with pytest.raises(RoutingRecordError, match=r"row 2: expert id out of range \[0, 8\) \(row \[9, 1\]\)"):
        _bad(topk_mod, torch.tensor([[0, 1], [2, 3], [9, 1], [4, 5]]))
    rs.reset()
    with pytest.raises(RoutingRecordError, match=r"row 1: an expert is chosen twice \(row \[3, 3\]\)"):
        _bad(topk_mod, torch.tensor([[0, 1], [3, 3], [2, 1], [4, 5]]))
    # the record layer itself refuses such rows when built normally
    with pytest.raises(RoutingRecordError, match="chosen twice"):
        RoutingRecord(indices={0: torch.tensor([[3, 3]])}, **good)


def _rec(rid, ids, rank):
    return RoutingRecord(indices={0: ids}, num_experts=E, token_order="requests", sample_ids=[rid],
                         seq_lens=[ids.shape[0]], source="sglang", extra={"rank": rank, "start_pos": 0})


def test_merge_rank_files(tmp_path):
    a, b, c = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[4, 5]]), torch.tensor([[6, 7], [1, 0], [2, 5]])
    for rank, recs in ((0, [_rec("a", a, 0), _rec("b", b, 0)]), (1, [_rec("a", a, 1), _rec("b", b, 1),
                                                                     _rec("c", c, 1)])):
        (tmp_path / f"rank{rank}").mkdir()
        for r in recs:
            r.save(tmp_path / f"rank{rank}" / f"{r.sample_ids[0]}.safetensors")
    merged = rs.merge_rank_files(tmp_path)
    assert sorted(merged) == ["a", "b", "c"]
    assert merged["a"].extra["rank"] == 0 and torch.equal(merged["a"].indices[0], a)
    assert torch.equal(merged["c"].indices[0], c) and merged["c"].extra["rank"] == 1
    # TP replicas that disagree
    _rec("b", torch.tensor([[4, 6]]), 1).save(tmp_path / "rank1" / "b.safetensors")
    with pytest.raises(RoutingRecordError, match="request 'b': ranks 0 and 1 captured different routes"):
        rs.merge_rank_files(tmp_path)
    with pytest.raises(RoutingRecordError, match="no routing files"):
        rs.merge_rank_files(tmp_path / "nothing")


def test_flush_writes_per_rank_files(topk_mod, tmp_path):
    rs.configure("capture", dir=tmp_path, rank=3)
    rs.set_batch(["req/1", "b"], [2, 1], [0, 0])
    _select(topk_mod, torch.randn(3, E))
    paths = rs.flush()
    assert sorted(p.name for p in paths) == ["b.safetensors", "req_1.safetensors"]
    assert {p.parent.name for p in paths} == {"rank3"}
    merged = rs.merge_rank_files(tmp_path)
    assert sorted(merged) == ["b", "req/1"] and merged["req/1"].num_tokens == 2
    assert rs.records() == {}


def test_forward_raw_sets_the_ambient_batch(sglang_cpu, tmp_path):
    """The real ModelRunner._forward_raw entry with a real ForwardBatch (extend, then
    decode); the rest of _forward_raw cannot run on CPU and fails right after."""
    from source_patch.patcher import import_patched_copy
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    mr = import_patched_copy("sglang.srt.model_executor.model_runner", "moe_sglang", cache_dir=tmp_path)
    rs.configure("capture")

    def run(fb):
        with pytest.raises(AttributeError):  # self.model: the runner is a bare object
            mr.ModelRunner._forward_raw(object(), fb, None)

    z = torch.zeros(1, dtype=torch.long)
    run(ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(5), req_pool_indices=z,
                     seq_lens=torch.tensor([3, 4]), out_cache_loc=z, seq_lens_sum=7, rids=["a", "b"],
                     extend_seq_lens_cpu=[3, 2], extend_prefix_lens_cpu=[0, 2]))
    assert rs._S.batch == (["a", "b"], [3, 2], [0, 2])
    run(ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.zeros(2), req_pool_indices=z,
                     seq_lens=torch.tensor([4, 5]), out_cache_loc=z, seq_lens_sum=9, rids=["a", "b"],
                     seq_lens_cpu=torch.tensor([4, 5])))
    assert rs._S.batch == (["a", "b"], [1, 1], [3, 4])
