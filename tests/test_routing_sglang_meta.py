"""R3 from SGLang's own capturer (issue 31, build item 4): ``RoutingRecord.from_sglang_meta``
reads ``meta_info["routed_experts"]`` (base64 int32 ``[len - 1, layers, top-k]``) with the
record's validation, ``to_sglang_meta`` writes our records in that layout; against a real
SGLang server (CPU) they equal our own capture of the same requests, and a record built
from SGLang's meta routes the Megatron twin (``source-patch replay --routes``)."""

import base64
import importlib.util

import pytest

torch = pytest.importorskip("torch")

from source_patch.runtime.routing.records.file import RoutingRecordError  # noqa: E402
from source_patch.runtime.routing.records.record import RoutingRecord, to_sglang_meta  # noqa: E402
from source_patch.runtime.routing.sglang.files import wait_record  # noqa: E402

E, L, K = 8, 2, 2


def _rec(rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = {k: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows)]) for k in range(L)}
    return RoutingRecord(indices=ids, num_experts=E, token_order="requests", sample_ids=["r"], seq_lens=[rows],
                         source="sglang", extra={"start_pos": 0})


def _b64(array: torch.Tensor) -> str:
    return base64.b64encode(array.to(torch.int32).numpy().tobytes()).decode()


def test_round_trip_and_layout():
    rec = _rec()
    text = to_sglang_meta(rec)
    # SGLang's layout: row-major int32 [tokens, layers, topk]
    raw = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.int32).reshape(5, L, K)
    assert all(torch.equal(raw[:, k].long(), rec.indices[k]) for k in range(L))
    back = RoutingRecord.from_sglang_meta({"meta_info": {"id": "r", "routed_experts": text, "prompt_tokens": 4,
                                                         "completion_tokens": 2}},
                                          num_experts=E, num_layers=L, topk=K)
    assert back.sample_ids == ["r"] and back.extra["start_pos"] == 0 and back.token_order == "requests"
    assert back.equals(rec.replace(extra=back.extra))
    assert to_sglang_meta(back) == text
    # only the MoE layers of a model with a dense layer 0 (SGLang leaves its rows zero)
    dense = to_sglang_meta(rec.replace(indices={1: rec.indices[1]}), num_layers=2)
    only = RoutingRecord.from_sglang_meta(dense, num_experts=E, num_layers=2, topk=K, layers=[1], rid="r")
    assert only.layers == [1] and torch.equal(only.indices[1], rec.indices[1])
    with pytest.raises(RoutingRecordError, match="chosen twice"):  # the dense layer's zero rows
        RoutingRecord.from_sglang_meta(dense, num_experts=E, num_layers=2, topk=K, rid="r")


@pytest.mark.parametrize("meta,message", [
    ({"meta_info": {"id": "x"}}, "meta_info has no routed_experts"),
    ("not base64!", "not valid base64"),
    (_b64(torch.zeros(3)), r"holds 12 bytes: not whole rows of int32 \[layers=2, topk=2\] \(16 bytes\)"),
    (_b64(torch.tensor([[[0, 9], [1, 2]]])), r"expert id|out of range"),
    ({"id": "x", "routed_experts": _b64(torch.tensor([[[0, 1], [1, 2]]])), "prompt_tokens": 3,
      "completion_tokens": 2}, r"has 1 rows; request 'x' has 3 prompt \+ 2 completion tokens: expected 4"),
])
def test_validation_is_the_records(meta, message):
    with pytest.raises(RoutingRecordError, match=message):
        RoutingRecord.from_sglang_meta(meta, num_experts=E, num_layers=L, topk=K, rid="x")


def test_export_needs_one_request():
    rec = _rec().replace(token_order="megatron-sbh", sample_ids=None, seq_lens=None)
    with pytest.raises(RoutingRecordError, match="needs a one-request record"):
        to_sglang_meta(rec)


# ---------------------------------------------------------------- a real engine

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")


@needs_sglang
@pytest.mark.slow
def test_sglang_meta_equals_our_capture_and_routes_the_twin(instrumented_sglang, sglang_checkpoint, tmp_path):
    from source_patch.runtime.verdict import replay
    from source_patch.runtime.dump import reader

    server = instrumented_sglang.server
    prompts = {"meta-a": [5, 9, 2, 7, 33, 12, 8], "meta-b": [70, 71, 72]}
    out = server.generate(input_ids=list(prompts.values()), max_new_tokens=4, rid=list(prompts),
                          return_routed_experts=True, sampling={"ignore_eos": True})
    routes = tmp_path / "routes"
    for result in out:
        rid = result["meta_info"]["id"]
        theirs = RoutingRecord.from_sglang_meta(result, num_experts=E, num_layers=L, topk=K)
        ours = wait_record(instrumented_sglang.routes, rid)
        assert theirs.sample_ids == [rid] and theirs.num_tokens == len(prompts[rid]) + 4 - 1
        assert theirs.equals(ours.replace(probs=None, extra=theirs.extra))
        assert to_sglang_meta(ours) == result["meta_info"]["routed_experts"]  # the inverse, byte for byte
        if rid == "meta-b":  # routes the model would not take: the replay must follow them
            moved = theirs.replace(indices={k: (v + 3) % E for k, v in theirs.indices.items()})
            theirs = RoutingRecord.from_sglang_meta(to_sglang_meta(moved), num_experts=E, num_layers=L, topk=K,
                                                    rid=rid)
            assert not theirs.equals(ours.replace(probs=None, extra=theirs.extra))
        theirs.save(routes / "rank0" / f"{rid}.safetensors")
    server.post("/flush_cache")  # a scheduler round trip: the dump writer has queued the last pass
    run = replay.replay(instrumented_sglang.dumps, sglang_checkpoint, out=tmp_path / "replay", routes=routes)
    records = reader.load(run)
    for rid, prompt in prompts.items():
        (rows,) = [r for r in records if r.name == "row_request" and r.tags["rids"] == [rid]]
        maps = {r.tags["layer"]: r.tensor for r in records
                if r.name == "routing_map" and r.tags["step"] == rows.tags["step"]}
        rec = wait_record(routes, rid)
        assert sorted(maps) == [1, 2]  # Megatron's layer_number = SGLang's layer_id + 1
        for layer, routing_map in maps.items():
            chosen = routing_map.reshape(-1, E)[:rec.num_tokens].nonzero()[:, 1].reshape(-1, K)
            assert torch.equal(chosen, rec.indices[layer - 1].sort(1).values)
