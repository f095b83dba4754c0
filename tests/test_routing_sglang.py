"""SGLang routing capture / replay (patches/routing.yaml, runtime/routing/sglang/)
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

from source_patch.runtime.routing.sglang import batch as rs_batch, capture as rs_capture  # noqa: E402
from source_patch.runtime.routing.sglang import control as rs, files as rs_files  # noqa: E402
from source_patch.runtime.routing.records.file import RoutingRecordError  # noqa: E402
from source_patch.runtime.routing.records.record import RoutingRecord  # noqa: E402

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
    out = check_sglang_spec("routing")
    assert "ok   sglang.srt.layers.moe.topk" in out and "ok   sglang.srt.model_executor.model_runner" in out
    assert "sglang 0.5.23" in out
    assert "ok   sglang.srt.model_executor.runner.decode_cuda_graph_runner" in out  # decode graphs (test_sglang_graphs.py)
    assert "decode-graph-build: at before 'self.backend.capture_one(...)'" in out
    assert "decode-graph-replay: at after 'output = self.backend.replay(...)'" in out


def test_off_by_default_changes_nothing(topk_mod):
    torch.manual_seed(0)
    logits = torch.randn(6, E)
    rs_batch.set_batch(["a"], [6])
    w, ids = _select(topk_mod, logits)
    assert rs_capture.records() == {}
    assert torch.equal(ids.long(), torch.topk(torch.softmax(logits, -1), K).indices)


@pytest.mark.parametrize("renormalize", [True, False])
def test_capture_per_request_in_generation_order(topk_mod, renormalize):
    """Prefill of two requests (3 + 2 tokens), then two decode steps; two layers.
    Captured ids equal torch.topk(softmax(logits)).indices *in order* (SGLang's
    torch-native top-k is torch.topk, sorted)."""
    rs.configure(mode="capture")
    torch.manual_seed(1)
    steps = [(["a", "b"], [3, 2], [0, 0]), (["a", "b"], [1, 1], [3, 2]), (["a", "b"], [1, 1], [4, 3])]
    expected = {"a": {0: [], 1: []}, "b": {0: [], 1: []}}
    for rids, lens, starts in steps:
        rs_batch.set_batch(rids, lens, starts)
        for layer in (0, 1):
            logits = torch.randn(sum(lens) + 1, E)  # + one padding row, not attributed
            _select(topk_mod, logits, layer=layer, renormalize=renormalize)
            want = torch.topk(torch.softmax(logits, -1), K).indices
            off = 0
            for rid, n in zip(rids, lens):
                expected[rid][layer].append(want[off:off + n])
                off += n
    recs = rs_capture.records()
    assert sorted(recs) == ["a", "b"]
    for rid, n in (("a", 5), ("b", 4)):
        rec = recs[rid]
        assert rec.token_order == "requests" and rec.sample_ids == [rid] and rec.seq_lens == [n]
        assert rec.num_experts == E and rec.topk == K and rec.layers == [0, 1] and rec.source == "sglang"
        for layer in (0, 1):
            assert torch.equal(rec.indices[layer], torch.cat(expected[rid][layer]))


def test_capture_gap_is_an_error(topk_mod):
    rs.configure(mode="capture")
    for starts in ([0], [5]):
        rs_batch.set_batch(["a"], [2], starts)
        _select(topk_mod, torch.randn(2, E))
    with pytest.raises(RoutingRecordError, match="resume at position 5, expected 2"):
        rs_capture.records()


@pytest.mark.parametrize("renormalize,scoring_func", [(True, "softmax"), (False, "softmax"), (True, "sigmoid")])
def test_replay_overrides_ids_and_weights(topk_mod, renormalize, scoring_func):
    torch.manual_seed(2)
    logits = torch.randn(5, E)
    forced = torch.tensor([[7, 0], [1, 2], [3, 6], [5, 4], [0, 1]])
    rec = RoutingRecord(indices={3: forced}, num_experts=E, token_order="requests", sample_ids=["r"],
                        seq_lens=[5], source="sglang", extra={"start_pos": 0})
    rs.configure(mode="replay", replay={"r": rec})
    rs_batch.set_batch(["r"], [5], [0])
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
    rs.configure(mode="replay", replay={"r": rec0})
    rs_batch.set_batch(["r"], [5], [0])
    w1, ids1 = _select(topk_mod, logits, layer=3, renormalize=renormalize, scoring_func=scoring_func)
    assert torch.equal(ids1, ids0) and torch.allclose(w1, w0, atol=1e-6)


def test_capture_then_replay_by_request_and_position(topk_mod, tmp_path):
    """Record two requests, then replay them in another batch order (b first, then
    a's decode token at position 3) with other logits: the recorded ids come back."""
    rs.configure(mode="capture", dir=tmp_path)
    torch.manual_seed(3)
    rs_batch.set_batch(["a", "b"], [3, 2], [0, 0])
    _, ids_p = _select(topk_mod, torch.randn(5, E), layer=0)
    rs_batch.set_batch(["a"], [1], [3])
    _, ids_d = _select(topk_mod, torch.randn(1, E), layer=0)
    rs_files.write_held()
    rs.reset()
    rs.configure(mode="replay", replay=tmp_path)
    rs_batch.set_batch(["b", "a"], [2, 1], [0, 3])
    _, ids = _select(topk_mod, torch.randn(3, E), layer=0)
    assert torch.equal(ids.long(), torch.cat([ids_p[3:5], ids_d]).long())


def _bad(topk_mod, indices, num_experts=E):
    # an object with a record's fields that skipped validation, as a corrupted record would
    rec = types.SimpleNamespace(indices={0: indices}, extra={"start_pos": 0}, layers=[0],
                                num_tokens=indices.shape[0])
    rs.configure(mode="replay", replay={"r": rec})
    rs_batch.set_batch(["r"], [4], [0])
    _select(topk_mod, torch.randn(4, E), layer=0)


def test_replay_errors_are_clear(topk_mod):
    good = dict(num_experts=E, token_order="requests", sample_ids=["r"], source="sglang", extra={"start_pos": 0})
    # too few rows for the batch: those rows keep the router's own routes (a serving
    # engine must not die), with a warning
    rs.configure(mode="replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 3)}, **good)})
    rs_batch.set_batch(["r"], [4], [0])
    logits = torch.randn(4, E)
    with pytest.warns(RuntimeWarning, match=r"request 'r' needs rows \[0, 4\) of layer 0, its record has 3"):
        _, ids = _select(topk_mod, logits, layer=0)
    assert torch.equal(ids.long(), torch.topk(logits.softmax(-1), K).indices)
    # a single record replayed without attribution: wrong row count
    rs.reset()
    rs.configure(mode="replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 3)}, **good)})
    with pytest.raises(RoutingRecordError, match="layer 0 replay ids: 3 rows for 4 tokens"):
        _select(topk_mod, torch.randn(4, E), layer=0)
    # missing layer, missing request
    rs.reset()
    rs.configure(mode="replay", replay={"r": RoutingRecord(indices={0: torch.tensor([[0, 1]] * 4)}, **good)})
    rs_batch.set_batch(["r"], [4], [0])
    with pytest.raises(RoutingRecordError, match="request 'r' has no layer 5"):
        _select(topk_mod, torch.randn(4, E), layer=5)
    rs_batch.set_batch(["zz", "r"], [4, 4], [0, 0])  # a request nobody recorded keeps its live routes
    logits = torch.randn(8, E)
    with pytest.warns(RuntimeWarning, match="no record for request 'zz'"):
        _, ids = _select(topk_mod, logits, layer=0)
    assert torch.equal(ids[:4].long(), torch.topk(logits[:4].softmax(-1), K).indices)
    assert ids[4:].tolist() == [[0, 1]] * 4
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


def test_replay_of_an_empty_capture_folder_routes_unchanged(topk_mod, tmp_path, monkeypatch):
    """Issue 30: SGLang's own tests under capture write no record (no request finishes), so
    replay reads an empty folder: upstream's routes, one warning, never an exception."""
    monkeypatch.setenv("SOURCE_PATCH_ROUTING_SGLANG_MODE", "replay")
    monkeypatch.setenv("SOURCE_PATCH_ROUTING_SGLANG_REPLAY", str(tmp_path))
    logits = torch.randn(4, E)
    with pytest.warns(RuntimeWarning, match="no routing files under"):
        _, ids = _select(topk_mod, logits, layer=0)
    rs_batch.set_batch(["r"], [4], [0])
    _, again = _select(topk_mod, logits, layer=1)
    assert torch.equal(ids.long(), torch.topk(logits.softmax(-1), K).indices) and torch.equal(again, ids)


def test_a_bad_replay_source_fails_every_call_alike(topk_mod, monkeypatch):
    """A missing source stays a clear error, at every call (it once left the mode set and
    the records unset: a TypeError from the second call on)."""
    monkeypatch.setenv("SOURCE_PATCH_ROUTING_SGLANG_MODE", "replay")
    monkeypatch.delenv("SOURCE_PATCH_ROUTING_SGLANG_REPLAY", raising=False)
    for _ in range(2):
        with pytest.raises(ValueError, match="replay mode needs a record"):
            _select(topk_mod, torch.randn(4, E), layer=0)


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
    merged = rs_files.merge_rank_files(tmp_path)
    assert sorted(merged) == ["a", "b", "c"]
    assert merged["a"].extra["rank"] == 0 and torch.equal(merged["a"].indices[0], a)
    assert torch.equal(merged["c"].indices[0], c) and merged["c"].extra["rank"] == 1
    # TP replicas that disagree
    _rec("b", torch.tensor([[4, 6]]), 1).save(tmp_path / "rank1" / "b.safetensors")
    with pytest.raises(RoutingRecordError, match="request 'b': ranks 0 and 1 captured different routes"):
        rs_files.merge_rank_files(tmp_path)
    with pytest.raises(RoutingRecordError, match="no routing files"):
        rs_files.merge_rank_files(tmp_path / "nothing")


def test_write_held_writes_per_rank_files(topk_mod, tmp_path):
    rs.configure(mode="capture", dir=tmp_path, rank=3)
    rs_batch.set_batch(["req/1", "b"], [2, 1], [0, 0])
    _select(topk_mod, torch.randn(3, E))
    paths = rs_files.write_held()
    assert sorted(p.name for p in paths) == ["b.safetensors", "req_1.safetensors"]
    assert {p.parent.name for p in paths} == {"rank3"}
    merged = rs_files.merge_rank_files(tmp_path)
    assert sorted(merged) == ["b", "req/1"] and merged["req/1"].num_tokens == 2
    assert rs_capture.records() == {}


# ---------------------------------------------------------------- a real engine


def _routed_experts(meta, layers=2, topk=2):
    """SGLang's own capture (return_routed_experts): base64 int32 [tokens, layers, topk]."""
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return torch.from_numpy(raw.copy()).reshape(-1, layers, topk).long()


@pytest.mark.slow
def test_captured_routes_equal_sglangs_own_capture(instrumented_sglang):
    """Independent check: for the same requests, the routing record equals what
    SGLang's own enable_return_routed_experts returns, row for row (logical ids)."""
    prompts = {"cap-a": [1, 2, 3, 4, 5, 6], "cap-b": [40, 41, 42]}
    out = instrumented_sglang.server.generate(input_ids=list(prompts.values()), max_new_tokens=5,
                                              rid=list(prompts), return_routed_experts=True,
                                              sampling={"ignore_eos": True})
    for (rid, prompt), result in zip(prompts.items(), out):
        theirs = _routed_experts(result["meta_info"])
        rec = rs_files.wait_record(instrumented_sglang.routes, rid)
        assert rec.sample_ids == [rid] and rec.extra["start_pos"] == 0 and rec.layers == [0, 1]
        assert rec.num_tokens == len(prompt) + 5 - 1 == theirs.shape[0]  # the last token is never routed
        ours = torch.stack([rec.indices[layer] for layer in rec.layers], dim=1)
        assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def replay_server(instrumented_sglang, sglang_server, tmp_path_factory):
    """A captured request, replayed twice in a second real server: as recorded
    ("same"), and with every route moved to the next experts ("moved")."""
    prompt, new = [7, 3, 9, 1, 12, 5], 5
    captured = instrumented_sglang.server.generate(input_ids=prompt, max_new_tokens=new, rid="replay-src",
                                                   sampling={"ignore_eos": True})
    rec = rs_files.wait_record(instrumented_sglang.routes, "replay-src")
    folder = tmp_path_factory.mktemp("replay")
    moved = {layer: (ids + 3) % rec.num_experts for layer, ids in rec.indices.items()}
    rec.replace(sample_ids=["same"]).save(folder / "same.safetensors")
    rec.replace(sample_ids=["moved"], indices=moved).save(folder / "moved.safetensors")
    dumps = tmp_path_factory.mktemp("replay-dumps")
    server = sglang_server(specs=["routing", "dump"], args=["--disable-radix-cache", "--skip-server-warmup"],
                           env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "replay",
                                "SOURCE_PATCH_ROUTING_SGLANG_REPLAY": str(folder),
                                "SOURCE_PATCH_DUMP_DIR": str(dumps), "SOURCE_PATCH_DUMP_NAMES": "topk_ids,row_request"})
    return server, prompt, new, captured["output_ids"], moved, dumps / "default"


@pytest.mark.slow
def test_replay_of_the_recorded_routes_generates_the_same_tokens(replay_server):
    server, prompt, new, captured, _, _ = replay_server
    out = server.generate(input_ids=prompt, max_new_tokens=new, rid="same", sampling={"ignore_eos": True})
    assert out["output_ids"] == captured


@pytest.mark.slow
def test_replay_forces_the_recorded_routes_and_changes_generation(replay_server):
    from source_patch.runtime.dump import reader

    server, prompt, new, captured, moved, dumps = replay_server
    out = server.generate(input_ids=prompt, max_new_tokens=new, rid="moved", sampling={"ignore_eos": True})
    assert out["output_ids"] != captured  # other experts, other tokens
    server.post("/flush_cache")  # a scheduler round trip: the last pass's records are queued by now
    records = reader.load(dumps)
    maps = {r.tags["step"]: r for r in records if r.name == "row_request" and "moved" in r.tags["rids"]}
    routed = {layer: [] for layer in moved}
    for r in records:
        if r.name == "topk_ids" and r.tags["step"] in maps:
            rows = maps[r.tags["step"]]
            routed[r.tags["layer"]].append(r.tensor[rows.tensor == rows.tags["rids"].index("moved")])
    for layer, ids in moved.items():
        assert torch.equal(torch.cat(routed[layer]), ids)  # every row took the record's experts


@pytest.mark.slow
def test_tensor_parallel_ranks_capture_and_dump_the_same_routes(instrumented_sglang, sglang_server, tmp_path_factory):
    """tp=2 on CPU (one core per rank): every rank captures every request with the same
    routes, equal to the tp=1 server's, and dumps into its own engine_<rank> folder."""
    prompt = [8, 6, 7, 5, 3, 0, 9]
    single = instrumented_sglang.server.generate(input_ids=prompt, max_new_tokens=4, rid="tp1-ref",
                                                 sampling={"ignore_eos": True})
    root = tmp_path_factory.mktemp("tp2")
    server = sglang_server(specs=["routing", "dump"],
                           args=["--tp-size", "2", "--disable-radix-cache", "--skip-server-warmup"],
                           env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture",
                                "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(root / "routes"),
                                "SOURCE_PATCH_DUMP_DIR": str(root / "dumps"),
                                "SOURCE_PATCH_DUMP_NAMES": "mlp_output,row_request"})
    try:
        _check_tensor_parallel(server, root, prompt, single, instrumented_sglang)
    finally:
        server.close()  # its TP rank 1 scheduler polls even when idle: do not leave it running


def _check_tensor_parallel(server, root, prompt, single, instrumented_sglang):
    from source_patch.runtime.dump import reader

    out = server.generate(input_ids=prompt, max_new_tokens=4, rid="tp2-a", sampling={"ignore_eos": True})
    assert out["output_ids"] == single["output_ids"]
    ranks = [rs_files.wait_record(root / "routes", "tp2-a", rank=rank) for rank in (0, 1)]
    reference = rs_files.wait_record(instrumented_sglang.routes, "tp1-ref")
    assert [r.extra["rank"] for r in ranks] == [0, 1]
    for rec in ranks:
        assert all(torch.equal(rec.indices[layer], reference.indices[layer]) for layer in reference.layers)
    assert sorted(rs_files.merge_rank_files(root / "routes")) == ["tp2-a"]  # no health-check records
    server.post("/flush_cache")
    instrumented_sglang.server.post("/flush_cache")
    dumps = {d.name: reader.load(d) for d in reader.rank_dirs(root / "dumps" / "default")}
    assert sorted(dumps) == ["engine_0", "engine_1"]
    assert {r.tags["tp"] for r in dumps["engine_1"]} == {1}
    # Each rank's MoE output is its partial sum (SGLang all-reduces in the layer boundary
    # after the dump point): the two add up to the tp=1 server's output for the same tokens.
    partial = [_rows_of(records, "tp2-a", "mlp_output") for records in dumps.values()]
    whole = _rows_of(reader.load(instrumented_sglang.dumps), "tp1-ref", "mlp_output")
    assert sorted(whole) == sorted(partial[0]) == [0, 1]
    for layer in whole:
        torch.testing.assert_close(partial[0][layer] + partial[1][layer], whole[layer], rtol=1e-4, atol=1e-6)


def _rows_of(records, rid, name):
    """{layer: rows of ``rid`` in its prefill pass} of the dumped ``name``."""
    (rows,) = [r for r in records if r.name == "row_request" and rid in r.tags["rids"]
               and r.tags["forward_mode"] == "extend"]
    mine = rows.tensor == rows.tags["rids"].index(rid)
    return {r.tags["layer"]: r.tensor[mine] for r in records
            if r.name == name and r.tags["step"] == rows.tags["step"]}
