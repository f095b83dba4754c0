"""Megatron -> SGLang names and layouts (runtime/weight_sync/names.py), checked against
the real upstreams: Megatron-Core's GPTModel parameters and its own QKV / SwiGLU
semantics, SGLang's Qwen3MoeForCausalLM / Starcoder2ForCausalLM load_weights."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from source_patch.runtime.weight_sync import names as wn

sys.path.insert(0, str(Path(__file__).parent / "e2e"))
import weight_sync_models as models  # noqa: E402


def layout(**kw):
    base = dict(num_attention_heads=4, num_query_groups=2, head_dim=3, gated=True)
    return wn.Layout(**{**base, **kw})


def names(name, shape, lay=None):
    return [(n, tuple(t.shape)) for n, t in wn.to_hf(name, torch.empty(shape, device="meta"), lay or layout())]


# ------------------------------------------------------------------ unit


def test_qkv_split_follows_the_per_group_interleaving():
    lay = layout()
    rows = [f"g{g}{part}{d}" for g in range(2) for part in ("q0", "q1", "k", "v") for d in range(3)]
    index = torch.arange(len(rows)).float().unsqueeze(1).expand(-1, 5)
    out = dict(wn.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", index, lay))
    pick = {key: [rows[int(i)] for i in out[key][:, 0]] for key in out}
    assert pick["model.layers.0.self_attn.q_proj.weight"] == [f"g{g}q{h}{d}" for g in range(2) for h in range(2) for d in range(3)]
    assert pick["model.layers.0.self_attn.k_proj.weight"] == [f"g{g}k{d}" for g in range(2) for d in range(3)]
    assert pick["model.layers.0.self_attn.v_proj.weight"] == [f"g{g}v{d}" for g in range(2) for d in range(3)]
    bias = dict(wn.to_hf("decoder.layers.0.self_attention.linear_qkv.bias", index[:, 0], lay))
    assert torch.equal(bias["model.layers.0.self_attn.k_proj.bias"], out["model.layers.0.self_attn.k_proj.weight"][:, 0])


def test_names_of_te_fused_norms_and_grouped_experts():
    assert names("module.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", (8,)) == [
        ("model.layers.3.input_layernorm.weight", (8,))]
    assert names("decoder.layers.3.mlp.linear_fc1.layer_norm_bias", (8,)) == [
        ("model.layers.3.post_attention_layernorm.bias", (8,))]
    assert names("decoder.layers.1.mlp.experts.linear_fc1.weight7", (10, 8)) == [
        ("model.layers.1.mlp.experts.7.gate_proj.weight", (5, 8)), ("model.layers.1.mlp.experts.7.up_proj.weight", (5, 8))]
    assert names("decoder.layers.1.mlp.experts.linear_fc2.weight7", (8, 5)) == [
        ("model.layers.1.mlp.experts.7.down_proj.weight", (8, 5))]
    assert names("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", (10, 8), layout(gated=False)) == [
        ("model.layers.1.mlp.experts.2.c_fc.weight", (10, 8))]
    assert names("decoder.layers.0.mlp.router.weight", (4, 8)) == [("model.layers.0.mlp.gate.weight", (4, 8))]


def test_padded_vocabulary_is_cut_and_layer_offset_applies():
    lay = layout(vocab_size=100)
    assert names("embedding.word_embeddings.weight", (128, 8), lay) == [("model.embed_tokens.weight", (100, 8))]
    assert names("output_layer.weight", (128, 8), lay) == [("lm_head.weight", (100, 8))]
    out = wn.to_hf("decoder.layers.1.input_layernorm.weight", torch.ones(8), lay, layer_offset=4)
    assert [n for n, _ in out] == ["model.layers.5.input_layernorm.weight"]


@pytest.mark.parametrize("name", [
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",           # shared experts
    "decoder.layers.0.self_attention.linear_q_down_proj.weight",        # MLA
    "decoder.layers.0.mlp.experts.weight1",                             # legacy GroupedMLP
])
def test_an_unmapped_parameter_is_an_error_not_a_silent_skip(name):
    with pytest.raises(wn.UnmappedParameter, match="no engine name for Megatron parameter"):
        wn.to_hf(name, torch.ones(4, 4), layout())


def test_qkv_rows_must_fit_the_layout():
    with pytest.raises(wn.UnmappedParameter, match="linear_qkv has 10 rows"):
        wn.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", torch.ones(10, 4), layout())


# ------------------------------------------------------------------ the real upstreams


@pytest.fixture(scope="module")
def upstreams(sglang_cpu):
    """Megatron's and SGLang's parallel state on a gloo world of one, torn down after."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from sglang.srt.distributed import parallel_state as sglang_state
    from sglang.srt.runtime_context import reset_context

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    models.sglang_on_cpu()
    try:
        yield
    finally:
        sglang_state.destroy_model_parallel()
        sglang_state.destroy_distributed_environment()
        parallel_state.destroy_model_parallel()
        reset_context()
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def megatron(style):
    torch.manual_seed(0)
    model = models.megatron_model(style)
    return model, {n: p.detach() for n, p in model.named_parameters()}


def test_qkv_split_equals_megatrons_own_attention_split(upstreams):
    model, params = megatron("qwen3_moe")
    attention = model.decoder.layers[0].self_attention
    attention.q_layernorm = attention.k_layernorm = None  # normed after the split; compare before
    eye = torch.eye(models.HIDDEN).unsqueeze(1)  # [s=hidden, b=1, hidden]: row s picks column s
    query, key, value = attention.get_query_key_value_tensors(eye, None)
    mapped = dict(wn.to_hf("decoder.layers.0.self_attention.linear_qkv.weight",
                           params["decoder.layers.0.self_attention.linear_qkv.weight"],
                           wn.Layout.from_config(model.config)))
    for part, tensor in (("q", query), ("k", key), ("v", value)):
        expected = tensor.reshape(models.HIDDEN, -1).t()  # [heads * head_dim, hidden]
        assert torch.equal(mapped[f"model.layers.0.self_attn.{part}_proj.weight"], expected), part


def test_gated_fc1_split_computes_megatrons_swiglu(upstreams):
    model, params = megatron("qwen3_moe")
    expert = model.decoder.layers[1].mlp.experts.local_experts[2]
    prefix = "decoder.layers.1.mlp.experts.local_experts.2."
    lay = wn.Layout.from_config(model.config)
    hf = dict(wn.to_hf(prefix + "linear_fc1.weight", params[prefix + "linear_fc1.weight"], lay))
    hf.update(wn.to_hf(prefix + "linear_fc2.weight", params[prefix + "linear_fc2.weight"], lay))
    x = torch.randn(5, models.HIDDEN)
    e = "model.layers.1.mlp.experts.2."
    ours = (F.silu(x @ hf[e + "gate_proj.weight"].t()) * (x @ hf[e + "up_proj.weight"].t())) @ hf[e + "down_proj.weight"].t()
    theirs, _ = expert(x)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("style", ["qwen3_moe", "gpt"])
def test_every_parameter_loads_into_sglang_bitwise(upstreams, style):
    """Megatron's parameters, mapped, through SGLang's own load_weights: every SGLang
    parameter is written (NaN before) and equals the expected re-cut, bit for bit."""
    model, params = megatron(style)
    lay = wn.Layout.from_config(model.config)
    mapped = [item for name, tensor in params.items() for item in wn.to_hf(name, tensor, lay)]
    engine = models.sglang_model(style)
    with torch.no_grad():
        for p in engine.parameters():
            p.fill_(math.nan)
    engine.load_weights(mapped)
    expected = models.expected_engine_weights(params, style)
    got = dict(engine.named_parameters())
    assert sorted(got) == sorted(expected)
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


def test_names_are_exactly_what_sglang_qwen3_moe_expects(upstreams):
    """Expand SGLang's parameters into checkpoint names with the model's own
    packed_modules_mapping and FusedMoE.make_expert_params_mapping."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    model, params = megatron("qwen3_moe")
    engine = models.sglang_model("qwen3_moe")
    expert_map = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", models.EXPERTS)
    wanted = set()
    for name, _ in engine.named_parameters():
        packed = [k for k in type(engine).packed_modules_mapping if f".{k}." in name]
        if packed:
            wanted |= {name.replace(packed[0], m) for m in type(engine).packed_modules_mapping[packed[0]]}
        elif ".experts.w" in name:
            wanted |= {name.replace(param + name.rsplit("_", 1)[1], ckpt + name.rsplit("_", 1)[1])
                       for param, ckpt, _, _ in expert_map if param in name}
        else:
            wanted.add(name)
    lay = wn.Layout.from_config(model.config)
    ours = [n for name, tensor in params.items() for n, _ in wn.to_hf(name, tensor, lay)]
    assert len(ours) == len(set(ours))
    assert set(ours) == wanted


def test_plan_gives_the_converted_shapes_without_data(upstreams):
    model, params = megatron("qwen3_moe")
    lay = wn.Layout.from_config(model.config)
    planned = list(wn.plan(((n, tuple(p.shape), p.dtype) for n, p in params.items()), lay))
    real = [(n, tuple(t.shape), t.dtype) for name, p in params.items() for n, t in wn.to_hf(name, p, lay)]
    assert planned == real
