"""Focused runs of SGLang's own code at the functions our specs patch (issue 30).

bench/upstream_tests.py --framework sglang runs this file beside SGLang's exported tests,
plain and under every configuration, and reports it apart ("ours"): on CPU few of
SGLang's own unit tests reach ``select_experts``, the runner's and the scheduler's weight
updaters, ``ModelRunner.forward`` / ``_forward_raw``, ``release_kv_cache`` or the Qwen3-MoE
forward. These tests call those functions as SGLang calls them and assert SGLang's own
answers: its torch-native reference top-k, its return values and messages, and (with
``--engine``, SP_UPSTREAM_ENGINE=1) a real server started by SGLang's own
``popen_launch_server`` generating transformers' greedy tokens.
"""

import os
import socket
from types import SimpleNamespace

import pytest
import requests
import sglang  # noqa: F401  (first: sglang_cpu defines torchvision's operators before transformers)
import torch

ENGINE = os.environ.get("SP_UPSTREAM_ENGINE") == "1"


@pytest.fixture(scope="module")
def published():
    """SGLang's process-wide config (as a scheduler publishes it) and a gloo world of one."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0, dp_rank=None))
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
    reset_context()


class _Model(torch.nn.Module):
    weight_cache_mode = "off"

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 2))
        self.v = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))

    def load_weights(self, named_tensors):
        params = dict(self.named_parameters())
        for name, tensor in named_tensors:
            params[name].data.copy_(tensor)


def _updater(model, **groups):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=lambda **kwargs: None,
                         recapture_cuda_graph=lambda: None, get_model_runner=lambda: None,
                         _model_update_group=groups)


# ---------------------------------------------------------------- top-k (select_experts)


@pytest.mark.parametrize("layer_id", [None, 0])
def test_select_experts_softmax_is_the_torch_native_top_k(layer_id):
    from sglang.srt.layers.moe.topk import TopKConfig, fused_topk_torch_native, select_experts

    torch.manual_seed(0)
    hidden, logits = torch.randn(6, 16), torch.randn(6, 8)
    out = select_experts(hidden, logits, TopKConfig(top_k=2, renormalize=True, torch_native=True),
                         layer_id=layer_id)
    weights, ids = fused_topk_torch_native(hidden, logits, 2, True)
    assert torch.equal(out.topk_ids, ids)
    assert torch.equal(out.topk_weights, weights)


def test_select_experts_sigmoid_with_correction_bias():
    from sglang.srt.layers.moe.topk import TopKConfig, fused_topk_torch_native, select_experts

    torch.manual_seed(1)
    hidden, logits, bias = torch.randn(5, 16), torch.randn(5, 8), torch.randn(8)
    config = TopKConfig(top_k=3, renormalize=True, torch_native=True, scoring_func="sigmoid", correction_bias=bias)
    out = select_experts(hidden, logits, config, layer_id=1)
    weights, ids = fused_topk_torch_native(hidden, logits, 3, True, correction_bias=bias, scoring_func="sigmoid")
    assert torch.equal(out.topk_ids, ids)
    assert torch.equal(out.topk_weights, weights)


# ---------------------------------------------------------------- the runner's weight updater


def test_runner_loads_distributed_weights(published):
    model = _Model()
    ok, message = _updater(model).load_weights_from_distributed([("w", torch.ones(2, 2))])
    assert (ok, message) == (True, "Succeeded to update parameter online.")
    assert torch.equal(model.w.detach(), torch.ones(2, 2))


def test_runner_reports_a_failed_load(published):
    ok, message = _updater(_Model()).load_weights_from_distributed([("missing", torch.ones(2, 2))])
    assert not ok and message.startswith("Failed to update parameter online: 'missing'.")


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_runner_receives_a_broadcast(published, load_format):
    updater = _updater(_Model(), g=torch.distributed.group.WORLD)
    weights = updater.receive_weights_from_distributed(names=["w", "v"], dtypes=["float32", "bfloat16"],
                                                       shapes=[[2, 2], [3]], group_name="g", load_format=load_format)
    assert [(n, tuple(t.shape), t.dtype) for n, t in weights] == [("w", (2, 2), torch.float32),
                                                                  ("v", (3,), torch.bfloat16)]


def test_runner_refuses_an_unknown_group(published):
    with pytest.raises(AssertionError, match="Please call `init_weights_update_group` first"):
        _updater(_Model()).receive_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[2, 2]],
                                                            group_name="nope")


# ---------------------------------------------------------------- the scheduler's weight-update endpoint


def _manager(model, versions):
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    runner = SimpleNamespace(weight_updater=_updater(model, g=torch.distributed.group.WORLD))
    worker = SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
    scheduler = SimpleNamespace(record_weight_version_change=lambda new_version: versions.append(new_version))
    return SchedulerWeightUpdaterManager(tp_worker=worker, draft_worker=None, memory_saver_adapter=None,
                                         flush_cache=lambda empty_cache=False: True, is_fully_idle=lambda: True,
                                         scheduler=scheduler)


def test_scheduler_updates_weights_from_distributed_in_a_session(published):
    from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                               UpdateWeightsFromDistributedReqInput)

    from sglang.srt.runtime_context import get_parallel

    versions = []
    with get_parallel().override(tp_group=SimpleNamespace(cpu_group=torch.distributed.group.WORLD)):
        manager = _manager(_Model(), versions)
    req = UpdateWeightsFromDistributedReqInput(names=["w"], dtypes=["float32"], shapes=[[2, 2]], group_name="g",
                                               weight_version="v7")
    refused = manager.update_weights_from_distributed(req)
    assert not refused.success and "between begin_weight_update() and end_weight_update()" in refused.message
    assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
    out = manager.update_weights_from_distributed(req)
    assert (out.success, out.message) == (True, "Succeeded to update parameter online.")
    assert manager.end_weight_update(EndWeightUpdateReqInput()).success
    assert versions == ["v7"]


# ---------------------------------------------------------------- a real server (--engine)

PROMPTS = [[11, 12, 13, 14, 15], [101, 7, 300, 2]]
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--dtype", "float32", "--mem-fraction-static", "0.5",
            "--max-total-tokens", "4096", "--skip-server-warmup"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(model_path, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    out = []
    for ids in PROMPTS:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def _generate(url, rids, new_tokens):
    body = {"input_ids": PROMPTS, "rid": rids,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    reply = requests.post(f"{url}/generate", json=body, timeout=120)
    reply.raise_for_status()
    return [r["output_ids"] for r in reply.json()]


@pytest.mark.skipif(not ENGINE, reason="a real server runs with --engine only")
def test_server_generates_transformers_greedy_tokens_and_reloads_its_weights():
    """SGLang's popen_launch_server on the tiny Qwen3-MoE: every patched call site on the
    serving path runs (top-k, the runner's forward, the decoder layers, release_kv_cache, the
    scheduler's weight update from disk)."""
    from sglang.srt.utils import kill_process_tree
    from sglang.test.test_utils import popen_launch_server
    from source_patch.testing.sglang import tiny_checkpoint

    model = str(tiny_checkpoint())
    expected = _reference(model, 6)
    url = f"http://127.0.0.1:{_free_port()}"
    process = popen_launch_server(model, url, timeout=600, other_args=CPU_ARGS, device="cpu")
    try:
        assert _generate(url, ["focus-0", "focus-1"], 6) == expected
        reload = requests.post(f"{url}/update_weights_from_disk", json={"model_path": model}, timeout=120).json()
        assert reload["success"], reload
        assert _generate(url, ["focus-2", "focus-3"], 6) == expected
    finally:
        kill_process_tree(process.pid)
