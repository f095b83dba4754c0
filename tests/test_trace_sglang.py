"""patches/trace.yaml: the spec checks without importing sglang; a real SGLang
server on CPU (the instrumented_sglang fixture) streams its decoder layers' outputs
from its scheduler process to a real client, one step per forward pass."""

import asyncio
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from source_patch.runtime.trace.client import connect  # noqa: E402


def test_spec_checks_without_importing_sglang(check_sglang_spec):
    out = check_sglang_spec("trace")
    assert "ok   sglang.srt.models.qwen3_moe" in out and "ok   sglang.srt.model_executor.model_runner" in out
    assert "qwen3-moe-layer: at after 'hidden_states = self.self_attn(...)'" in out
    assert "ok   sglang.srt.model_executor.runner.decode_cuda_graph_runner" in out  # decode graphs (test_sglang_graphs.py)
    assert "decode-graph-build: at before 'self.backend.capture_one(...)'" in out
    assert "decode-graph-replay: at after 'output = self.backend.replay(...)'" in out


@pytest.mark.slow
def test_a_client_sees_the_schedulers_layers_as_they_run(instrumented_sglang):
    """A real server with trace: the hub runs in the scheduler process (where
    the model runs), and every frame is exactly what the model computed (the raw
    compressor's values equal the same pass's dump spec records)."""
    from source_patch.runtime.dump import reader

    server = instrumented_sglang.server
    server.generate(input_ids=[1], max_new_tokens=1)  # the hub starts with the first traced pass

    async def main():
        async with connect(instrumented_sglang.trace_url, retry=30) as c:
            await c.subscribe(["attention_output", "mlp_output"], compressor={"kind": "raw"})
            loop = asyncio.get_running_loop()
            reply = loop.run_in_executor(None, lambda: server.generate(input_ids=[5, 6, 7, 8], max_new_tokens=3))
            frames = [await c.next_frame(60) for _ in range(3 * 2 * 2)]  # passes x layers x names
            await reply
            return frames, await c.stats()

    frames, stats = run(main())
    assert [(f.name, f.layer) for f in frames[:4]] == [("attention_output", 0), ("mlp_output", 0),
                                                       ("attention_output", 1), ("mlp_output", 1)]
    steps = sorted({f.step for f in frames})
    assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3))  # ModelRunner's forward pass ids
    assert [f.meta["source_shape"] for f in frames[:4]] == [[4, 64]] * 4  # the extend pass: 4 prompt tokens
    assert stats["results"] >= 12 and stats["errors"] == 0
    server.post("/flush_cache")  # a scheduler round trip: this pass's dumps are queued
    dumped = [r for r in reader.load(instrumented_sglang.dumps) if r.name in ("attention_output", "mlp_output")]
    for f in frames:
        same = [r for r in dumped if r.name == f.name and r.tags["layer"] == f.layer
                and tuple(r.tensor.shape) == f.array.shape and np.array_equal(r.tensor.numpy(), f.array)]
        assert same, f"no dumped {f.name} of layer {f.layer} equals frame {f.seq}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))
