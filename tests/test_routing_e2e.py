"""Rollout routing replay end to end, with the real upstreams on CPU.

SGLang 0.5.23's select_experts (a patched copy, torch-native top-k, under
patches/routing.yaml) captures the routing of rollout requests; the records are
aligned to Megatron's training batch layout and replayed in Megatron-Core 0.16.1's
routers (tiny GPT-MoE under megatron_cpu + routing, real training steps in a
subprocess). The routes Megatron takes must be exactly SGLang's, and the report says
how many tokens and layers would have routed differently without replay.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from source_patch.runtime.routing.sglang import batch as routing_sglang_batch  # noqa: E402
from source_patch.runtime.routing.sglang import capture as routing_sglang_capture, control as routing_sglang  # noqa: E402
from source_patch.runtime.routing.align import BatchLayout, align_to_megatron, routing_diff  # noqa: E402
from source_patch.runtime.routing.records.record import RoutingRecord  # noqa: E402

RUN = Path(__file__).parent / "e2e" / "routing_run.py"
# tests/e2e/routing_run.py's model: 2 MoE layers, 8 experts, top-2, seq 16 x micro-batch 4.
STEPS, MICROBATCHES, LAYERS, EXPERTS, TOPK, SEQ, BATCH = 2, 2, 2, 8, 2, 16, 4


def rollout(sglang_topk, rids):
    """One SGLang forward over these requests (prefill of SEQ tokens each), every layer."""
    routing_sglang.reset()
    routing_sglang.configure(mode="capture")
    routing_sglang_batch.set_batch(rids, [SEQ] * len(rids), [0] * len(rids))
    config = sglang_topk.TopKConfig(top_k=TOPK, renormalize=True, torch_native=True)
    for layer_id in range(LAYERS):  # SGLang numbers layers from 0
        logits = torch.randn(SEQ * len(rids), EXPERTS)
        sglang_topk.select_experts(hidden_states=torch.zeros(len(logits), 4), router_logits=logits,
                                   layer_id=layer_id, topk_config=config)
    records = routing_sglang_capture.records()
    routing_sglang.configure(mode="off")
    return records




def test_sglang_routes_replayed_in_megatron(sglang_topk, tmp_path, shared_code_cache):
    torch.manual_seed(0)
    folder = tmp_path / "replay" / "rank-0"
    folder.mkdir(parents=True)
    aligned, index = {}, []
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            rids = [f"req-{step}-{mb}-{b}" for b in range(BATCH)]
            captured = rollout(sglang_topk, rids)
            assert sorted(captured) == sorted(rids)
            layout = BatchLayout.padded([(rid, SEQ) for rid in rids], seq_len=SEQ)
            # SGLang's layer_id L is Megatron's layer_number L + 1.
            record = align_to_megatron(captured, layout, layer_offset=1,
                                       extra={"step": step, "microbatch": mb})
            aligned[step, mb] = record
            name = f"step-{step}-mb-{mb}.safetensors"
            record.save(folder / name)
            index.append({"step": step, "microbatch": mb, "file": name})
    (folder / "index.json").write_text(json.dumps(
        {"format": "source-patch-routing-index", "version": 1, "rank": 0, "records": index}))

    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,routing", "SOURCE_PATCH_CACHE": str(shared_code_cache)}
    result = subprocess.run([sys.executable, str(RUN), str(tmp_path / "out"), "off",
                             f"replay:{tmp_path / 'replay'}"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "out.json").read_text()) == [{"ok": True}, {"ok": True}]
    routes = load_file(tmp_path / "out.safetensors")

    for (step, mb), record in aligned.items():
        own = {}
        for layer in range(1, LAYERS + 1):
            replayed = routes[f"1/route/{step}/{mb}/{layer}"]  # sorted expert ids per token
            assert torch.equal(replayed, record.indices[layer].sort(dim=1).values), (step, mb, layer)
            own[layer] = routes[f"0/route/{step}/{mb}/{layer}"]
        # What Megatron would have routed on its own, against SGLang's routing.
        unreplayed = RoutingRecord(indices=own, num_experts=EXPERTS, token_order="megatron-sbh",
                                   seq_lens=[SEQ] * BATCH, source="megatron")
        diff = routing_diff(record, unreplayed)
        print(f"step {step} microbatch {mb}:\n{diff}")
        assert diff.tokens == SEQ * BATCH
        for layer in range(1, LAYERS + 1):
            differ = (record.indices[layer].sort(dim=1).values != own[layer]).any(dim=1).sum().item()
            assert diff.per_layer[layer] == differ
        assert diff.tokens_differing > 0  # random rollout logits: the model alone routes otherwise
