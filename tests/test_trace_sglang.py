"""patches/trace_sglang.yaml against real sglang 0.5.23 modules on CPU: the spec checks
without importing sglang; a patched copy of sglang.srt.models.qwen3_moe runs the real
Qwen3MoeDecoderLayer.forward (its attention, MLP and boundaries stubbed: building the
real ones needs a distributed, CUDA-backed model runner) and streams both outputs to a
real client; the real ModelRunner.forward numbers the step by its forward pass id."""

import asyncio
import importlib.util
import socket
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from source_patch.patcher import import_patched_copy  # noqa: E402
from source_patch.runtime.trace import compress as tc  # noqa: E402
from source_patch.runtime.trace import close, configure, reset, state, url  # noqa: E402
from source_patch.runtime.trace.client import connect  # noqa: E402


def test_spec_checks_without_importing_sglang(check_sglang_spec):
    out = check_sglang_spec("trace_sglang")
    assert "ok   sglang.srt.models.qwen3_moe" in out and "ok   sglang.srt.model_executor.model_runner" in out
    assert "qwen3-moe-layer: at after 'hidden_states = self.self_attn(...)'" in out


@pytest.fixture(scope="module")
def qwen3(sglang_cpu, tmp_path_factory):
    return import_patched_copy("sglang.srt.models.qwen3_moe", "trace_sglang",
                               cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def hub(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configure(enable=True, port=port, token="t", dir=str(tmp_path), ranks=[0], wait=0)
    reset()
    yield port
    close()
    configure(enable=False, port=0)


class _Boundary:
    """Stands in for SGLang's stage boundaries: hands the tensor on."""

    def prepare(self, hidden_states, forward_batch, **kwargs):
        return hidden_states

    def finish(self, hidden_states, forward_batch):
        return hidden_states


def _layer(layer_id: int, attn_scale: float, mlp_shift: float):
    return types.SimpleNamespace(
        layer_id=layer_id, attn_boundary=_Boundary(), ffn_boundary=_Boundary(),
        self_attn=lambda positions, hidden_states, forward_batch: hidden_states * attn_scale,
        mlp=lambda hidden_states, forward_batch: hidden_states + mlp_shift)


def test_decoder_layer_streams_attention_and_mlp_outputs(qwen3, hub):
    forward = qwen3.Qwen3MoeDecoderLayer.forward
    torch.manual_seed(0)
    hidden = torch.randn(5, 32)  # SGLang's [tokens, hidden]
    layers = [_layer(0, 2.0, 1.0), _layer(1, -1.0, 0.5)]
    tiles = {"kind": "tiles", "tiles": 4}

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["attention_output", "mlp_output"], compressor=tiles)
            outputs = []
            for layer in layers:
                outputs.append(forward(layer, torch.arange(5), hidden, forward_batch=None))
            frames = [await c.next_frame(10) for _ in range(4)]
            return outputs, frames

    outputs, frames = run(main())
    assert [(f.name, f.layer) for f in frames] == [("attention_output", 0), ("mlp_output", 0),
                                                   ("attention_output", 1), ("mlp_output", 1)]
    compress = tc.parse(tiles)
    for f, layer in zip(frames, [layers[0], layers[0], layers[1], layers[1]]):
        expected_attn = layer.self_attn(None, hidden, None)
        expected = expected_attn if f.name == "attention_output" else layer.mlp(expected_attn, None)
        assert f.meta["source_shape"] == [5, 32]
        assert np.array_equal(f.array, compress(expected).numpy())
    assert torch.equal(outputs[1], layers[1].mlp(layers[1].self_attn(None, hidden, None), None))


def test_an_empty_batch_is_skipped_not_traced(qwen3, hub):

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["mlp_output"])
            qwen3.Qwen3MoeDecoderLayer.forward(_layer(0, 1.0, 0.0), torch.arange(0), torch.zeros(0, 8),
                                               forward_batch=None)
            return await c.stats()

    stats = run(main())
    assert stats["skipped"] == 1 and stats["results"] == 0  # an idle DP rank's zero tokens


def test_the_step_is_the_model_runners_forward_pass_id(sglang_cpu, tmp_path):
    runner = import_patched_copy("sglang.srt.model_executor.model_runner", "trace_sglang",
                                 cache_dir=tmp_path / "cache")
    fake = types.SimpleNamespace(forward_pass_id=41, msprobe_debugger=None, is_draft_worker=False)
    batch = types.SimpleNamespace(apply_deprecated_skip_attn_backend_init=lambda _: None)
    # The real forward runs up to its step span, which needs a real batch and fails there.
    with pytest.raises(AttributeError, match="forward_mode"):
        runner.ModelRunner.forward(fake, batch)
    assert fake.forward_pass_id == 42 and state()["step"] == 42


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))
