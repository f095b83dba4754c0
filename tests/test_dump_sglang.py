"""Inference-phase dumps from SGLang (patches/dump.yaml, runtime/dump/sglang.py).

Without an engine: the process folder setting, the reader over engine folders, and
the handler behind SGLang's /dumper/{method}.  With a real engine: see the
engine-marked tests below."""

import pytest
import torch

from source_patch.runtime.dump import reader
from source_patch.runtime.dump import sglang as dump_sglang
from sglang_reference import request_records, wait_for


def test_spec_checks_without_importing_sglang(check_sglang_spec):
    out = check_sglang_spec("dump")
    assert out.count("ok   sglang.srt.") == 4 and "dumper-control: at entry" in out  # models x2, scheduler, decode graph runner
    assert "ok   sglang.srt.model_executor.runner.decode_cuda_graph_runner" in out  # decode graphs (test_sglang_graphs.py)
    assert "decode-graph-build: at before 'self.backend.capture_one(...)'" in out
    assert "decode-graph-replay: at after 'output = self.backend.replay(...)'" in out


def test_records_go_to_the_folder_the_rank_dir_setting_names(dumper):
    dumper.configure(rank_dir="engine_{rank}")
    dumper.dump("x", torch.arange(3))
    dumper.flush(10)
    exp = dumper.state()["exp_dir"]
    (record,) = reader.load(exp)
    assert record.file.parent.name == "engine_0" and record.tensor.tolist() == [0, 1, 2]
    assert [d.name for d in reader.rank_dirs(exp)] == ["engine_0"]


@pytest.mark.parametrize("bad", ["engine", "a/{rank}", "{rank}{rank}", "{step}-{rank}", ".."])
def test_a_rank_dir_without_exactly_one_rank_is_refused(dumper, bad):
    with pytest.raises(ValueError, match="one {rank}"):
        dumper.configure(rank_dir=bad)
    assert dumper.public_config()["rank_dir"] == "rank-{rank}"


def test_dumper_control_speaks_sglangs_names_and_validates_as_a_whole(dumper):
    reply = dump_sglang.handle_control("configure", {"enable": False, "exp_name": "ctl"})
    assert reply["rank"] == 0 and reply["ok"] and reply["config"]["enable"] is False
    assert dumper.public_config()["exp_name"] == "ctl"
    with pytest.raises(ValueError, match="'filter' is not supported"):
        dump_sglang.handle_control("configure", {"filter": "layer_id == 0"})  # SGLang evals it; we never do
    with pytest.raises(Exception, match="unknown key 'layerz'"):
        dump_sglang.handle_control("configure", {"enable": True, "layerz": "0"})
    assert dumper.public_config()["enable"] is False  # nothing applied from a bad request
    dump_sglang.handle_control("configure", {"enable": True, "layers": "1"})
    dumper.dump("a", torch.ones(1), layer=0)
    dumper.dump("b", torch.ones(1), layer=1)
    dumper.flush(10)
    state = dump_sglang.handle_control("get_state", {})
    assert (state["counters"]["records"], state["counters"]["filtered"]) == (1, 1)
    assert dump_sglang.handle_control("reset", {})["counters"]["records"] == 0
    with pytest.raises(ValueError, match="unknown method"):
        dump_sglang.handle_control("explode", {})


# ---------------------------------------------------------------- a real engine




@pytest.mark.slow
def test_dumped_layers_equal_transformers_on_the_same_tokens(instrumented_sglang, hf_qwen3):
    from sglang_reference import activations

    prompt, new = [5, 6, 7, 8, 9, 10], 3
    out = instrumented_sglang.server.generate(input_ids=prompt, max_new_tokens=new, rid="dump-check",
                                              sampling={"ignore_eos": True})
    tokens = prompt + out["output_ids"]
    passes = wait_for(lambda: request_records(instrumented_sglang.dumps, "dump-check"),
                       lambda p: len(p) == new and all(("logits", None) in v for _, _, v in p.values()))
    assert [mode for mode, _, _ in passes.values()] == ["extend"] + ["decode"] * (new - 1)
    reference = activations(hf_qwen3, tokens)
    seen = 0
    for mode, mask, values in passes.values():
        positions = values[("positions", None)][mask]
        assert values[("input_ids", None)][mask].tolist() == [tokens[p] for p in positions.tolist()]
        for (name, layer), expected in reference.items():
            if name == "logits":  # SGLang computes the logits of each request's last row only
                got, expected = values[(name, layer)][_request_index(values, mask)], expected[positions[-1]]
            else:
                got, expected = values[(name, layer)][mask], expected[positions]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"{mode} {name} layer {layer}")
            seen += 1
    assert seen == new * len(reference)


def _request_index(values, mask) -> int:
    """The request's index in the batch (logits have one row per request)."""
    return int(values[("row_request", None)][mask][0])


@pytest.mark.slow
def test_dumped_topk_ids_are_the_topk_of_the_dumped_router_logits(instrumented_sglang):
    instrumented_sglang.server.generate(input_ids=[[3, 1, 4, 1, 5], [9, 2, 6]], max_new_tokens=3)
    records = wait_for(lambda: reader.load(instrumented_sglang.dumps),
                        lambda rs: any(r.name == "topk_ids" for r in rs))
    logits = {(r.tags["step"], r.tags["layer"]): r.tensor for r in records if r.name == "router_logits"}
    checked = 0
    for r in records:
        if r.name == "topk_ids" and (r.tags["step"], r.tags["layer"]) in logits:
            expected = torch.topk(logits[(r.tags["step"], r.tags["layer"])].softmax(-1), 2).indices
            assert torch.equal(r.tensor, expected)
            checked += 1
    assert checked >= 4


@pytest.mark.slow
def test_the_model_summary_and_the_engine_folder(instrumented_sglang):
    import json

    instrumented_sglang.server.generate(input_ids=[1, 2], max_new_tokens=1)
    summary = json.loads(wait_for(lambda: instrumented_sglang.dumps / "engine_0" / "model.json",
                                   lambda p: p.exists()).read_text())
    names = {p["name"]: p for p in summary["parameters"]}
    assert summary["model"] == "Qwen3MoeForCausalLM" and summary["layers"] == 2
    assert names["model.layers.1.mlp.gate.weight"]["shape"] == [8, 64]
    assert summary["cuda_graph"] is False and summary["ranks"]["tp"] == 0
    assert [d.name for d in reader.rank_dirs(instrumented_sglang.dumps)] == ["engine_0"]


@pytest.mark.slow
def test_dumper_endpoints_on_sglangs_own_server_control_every_scheduler(instrumented_sglang):
    server, dumps = instrumented_sglang.server, instrumented_sglang.dumps

    def count():
        server.post("/dumper/get_state")  # a round trip through the scheduler: its writes are queued
        return len(reader.load(dumps))

    status, reply = server.post("/dumper/configure", {"enable": False})
    assert status == 200 and [r["rank"] for r in reply] == [0] and reply[0]["config"]["enable"] is False
    try:
        before = count()
        server.generate(input_ids=[4, 4, 4], max_new_tokens=2)
        assert count() == before  # disabled: nothing dumped
        status, reply = server.post("/dumper/configure", {"filter": "layer_id == 0"})
        assert status == 400 and "not supported" in str(reply)  # SGLang evals it; never here
        status, reply = server.post("/dumper/configure", {"enable": True, "names": ["router_logits"]})
        assert status == 200 and reply[0]["config"]["names"] == ["router_logits"]
        server.generate(input_ids=[4, 4, 4], max_new_tokens=2)
        new = wait_for(lambda: reader.load(dumps)[before:], lambda rs: len(rs) >= 4)
        assert {r.name for r in new} == {"router_logits"} and len(new) == 4  # 2 passes x 2 layers
        status, state = server.post("/dumper/get_state")
        assert status == 200 and state[0]["enabled"] and state[0]["counters"]["filtered"] > 0
    finally:
        server.post("/dumper/configure", {"enable": True, "names": []})
