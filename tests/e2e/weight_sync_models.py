"""Tiny models for the weight-sync tests, built from the real upstreams on CPU.

Megatron-Core: GPTModel with its local layer spec, Qwen3-MoE style (RMSNorm,
SwiGLU, q/k layernorm, grouped-query attention, MoE in every layer), its dense
variant ("llama") or GPT style (LayerNorm, GeLU, biases, dense).  SGLang: the matching Qwen3MoeForCausalLM and
Starcoder2ForCausalLM, constructed on CPU (see ``sglang_on_cpu`` for what that takes).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from source_patch.runtime.core.endpoint import free_port  # noqa: F401 - the tests take it from here

# One shape for both sides.
VOCAB, HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, EXPERTS, MOE_FFN, FFN, SEQ = 128, 64, 2, 4, 2, 16, 4, 32, 96, 16
PROMPTS, NEW = [[3, 1, 4, 1, 5], [9, 2, 6]], 5  # what the engine tests generate after each update


def megatron_config(style: str, ep: int = 1):
    from megatron.core.transformer import TransformerConfig

    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                  kv_channels=HEAD_DIM, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True, params_dtype=torch.float32, bf16=False)
    if style == "gpt":
        return TransformerConfig(**common, ffn_hidden_size=FFN, normalization="LayerNorm",
                                 add_bias_linear=True, activation_func=F.gelu)
    if style == "llama":  # dense, gated: the Qwen3 attention with a SwiGLU MLP
        return TransformerConfig(**common, ffn_hidden_size=FFN, normalization="RMSNorm",
                                 gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True,
                                 add_bias_linear=False)
    return TransformerConfig(
        **common, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=MOE_FFN,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep)


def megatron_model(style: str, ep: int = 1):
    """A GPTModel (parallel state must be initialised)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = megatron_config(style, ep)
    if style == "gpt":
        spec = get_gpt_layer_local_spec()
    elif style == "llama":
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=True,
                                        normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


# ------------------------------------------------------------------ SGLang on CPU


def define_torchvision_ops() -> None:
    """The only torchvision on the index is a CUDA build; its import needs these
    operator schemas on a CPU torch (the shared notes, sglang.md)."""
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}",
                                 "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass


@contextlib.contextmanager
def native_rotary():
    """What patches/sglang_cpu.yaml does in an engine process, for SGLang models built
    in this one: RotaryEmbedding takes its native path (no compiled kernel) without
    CUDA.  The module is already imported here, so its flag is set, then restored."""
    from sglang.srt.layers.rotary_embedding import base

    before = base._is_cpu
    base._is_cpu = before or not torch.cuda.is_available()
    try:
        yield
    finally:
        base._is_cpu = before


def sglang_on_cpu() -> None:
    """Publish SGLang's server config and build its parallel groups (TP 1) over gloo,
    on the default group if one exists, else a world of one."""
    define_torchvision_ops()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    ps.initialize_model_parallel(backend="gloo")


def sglang_model(style: str):
    """SGLang's Qwen3MoeForCausalLM or Starcoder2ForCausalLM with the shape above."""
    torch.set_default_dtype(torch.float32)
    with native_rotary():
        if style == "gpt":
            from sglang.srt.models.starcoder2 import Starcoder2ForCausalLM
            from transformers import Starcoder2Config

            config = Starcoder2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=GROUPS, use_bias=True, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
            return Starcoder2ForCausalLM(config)
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                moe_intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                                num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=SEQ,
                                tie_word_embeddings=False, rms_norm_eps=1e-6)
        return Qwen3MoeForCausalLM(config)


# ------------------------------------------------------------------ the expected engine weights


def expected_engine_weights(megatron: dict, style: str) -> dict:
    """What SGLang's parameters must hold, computed from Megatron's full parameters
    without weight_names: its fused tensors re-cut by the head/expert arithmetic."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    norm = "model.norm"
    out[f"{norm}.weight"] = megatron["decoder.final_layernorm.weight"]
    per_group = HEADS // GROUPS
    for layer in range(LAYERS):
        m, s = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        kinds = ("weight", "bias") if style == "gpt" else ("weight",)
        for kind in kinds:
            qkv = megatron[m + f"self_attention.linear_qkv.{kind}"]
            g = qkv.reshape(GROUPS, per_group + 2, HEAD_DIM, *qkv.shape[1:])
            out[s + f"self_attn.qkv_proj.{kind}"] = torch.cat([
                g[:, :per_group].reshape(-1, *qkv.shape[1:]), g[:, per_group].reshape(-1, *qkv.shape[1:]),
                g[:, per_group + 1].reshape(-1, *qkv.shape[1:])])
            out[s + f"self_attn.o_proj.{kind}"] = megatron[m + f"self_attention.linear_proj.{kind}"]
            out[s + f"input_layernorm.{kind}"] = megatron[m + f"input_layernorm.{kind}"]
            out[s + f"post_attention_layernorm.{kind}"] = megatron[m + f"pre_mlp_layernorm.{kind}"]
        if style == "gpt":
            out[f"{norm}.bias"] = megatron["decoder.final_layernorm.bias"]
            for kind in kinds:
                out[s + f"mlp.c_fc.{kind}"] = megatron[m + f"mlp.linear_fc1.{kind}"]
                out[s + f"mlp.c_proj.{kind}"] = megatron[m + f"mlp.linear_fc2.{kind}"]
            continue
        out[s + "self_attn.q_norm.weight"] = megatron[m + "self_attention.q_layernorm.weight"]
        out[s + "self_attn.k_norm.weight"] = megatron[m + "self_attention.k_layernorm.weight"]
        out[s + "mlp.gate.weight"] = megatron[m + "mlp.router.weight"]
        # FusedMoE: w13 = [gate; up] per expert (Megatron's fc1 as it is), w2 = down.
        experts = m + "mlp.experts.local_experts.{}.linear_fc{}.weight"
        out[s + "mlp.experts.w13_weight"] = torch.stack([megatron[experts.format(e, 1)] for e in range(EXPERTS)])
        out[s + "mlp.experts.w2_weight"] = torch.stack([megatron[experts.format(e, 2)] for e in range(EXPERTS)])
    return out


# ------------------------------------------------------------------ engine tests


def checkpoint_config() -> dict:
    """The Qwen3-MoE config of the trainer's model (tests/e2e/weight_sync_models.py)."""
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE_FFN,
                intermediate_size=FFN, rms_norm_eps=1e-6)


def reference(model_dir: Path, tmp: Path, step: int) -> list:
    """transformers' greedy tokens with the trainer's full weights after ``step``."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    from source_patch.runtime.weight_sync import names

    full = {}
    for rank in range(2):  # expert parallel: rank r holds experts r*2, r*2+1 as local 0, 1
        for key, value in load_file(tmp / f"trainer.rank{rank}.safetensors").items():
            s, name = key.split("/", 1)
            if int(s) == step:
                local = name.split("local_experts.")
                if len(local) == 2:
                    index, rest = local[1].split(".", 1)
                    name = f"{local[0]}local_experts.{rank * EXPERTS // 2 + int(index)}.{rest}"
                full[name] = value
    layout = names.Layout(num_attention_heads=HEADS, num_query_groups=GROUPS,
                          head_dim=HEAD_DIM, gated=True, vocab_size=VOCAB)
    hf = dict(pair for name, t in full.items() for pair in names.to_hf(name, t, layout))
    folder = tmp / f"reference-step{step}"  # transformers converts per-expert names as it loads
    folder.mkdir(exist_ok=True)
    shutil.copy(model_dir / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    reference_model = Qwen3MoeForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    from sglang_reference import greedy  # tests/fixtures/

    return [greedy(reference_model, p, NEW) for p in PROMPTS]


def exit_codes(procs: list, timeout: float = 300) -> list:
    """The exit codes of ``procs``, each waited for up to ``timeout`` s; whatever still
    runs then (or when waiting fails) is killed."""
    try:
        return [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
