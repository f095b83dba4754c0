"""A Megatron-Core twin of a Hugging Face Qwen3-MoE checkpoint (the model SGLang serves).

    import source_patch.runtime.verdict.twin as twin
    model = twin.build("path/to/checkpoint")         # parallel state initialised, tp = ep = 1
    logits = twin.logits(model, [[1, 2, 3, 4]])      # [batch, tokens, vocab]

Same architecture as transformers' ``Qwen3MoeForCausalLM``: RMSNorm, per-head q/k
RMSNorm before RoPE (non-interleaved, base ``rope_theta``), grouped-query attention,
SwiGLU experts, softmax top-k routing with the chosen probabilities renormalised
(Megatron's softmax over the top-k logits is exactly that), untied embeddings.  The
weights go through :func:`names.from_hf`, the inverse of the mapping weight sync uses
in the other direction, so a round trip is tested by construction.

Under expert parallelism each rank builds its share of the experts and loads its own
(local expert i of EP rank r is the checkpoint's expert ``r * local + i``).

On CPU it needs the ``megatron_cpu`` spec, as any Megatron model there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..weight_sync.names import Layout, from_hf


def hf_config(checkpoint) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def transformer_config(hf: dict, **overrides):
    """Megatron's TransformerConfig for a Qwen3-MoE ``config.json``."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"a Megatron twin is built for model_type qwen3_moe, not {hf.get('model_type')!r}")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("every layer must be an MoE layer (mlp_only_layers empty, decoder_sparse_step 1)")
    if not hf.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=False (unnormalised top-k weights) has no Megatron twin here")
    heads = hf["num_attention_heads"]
    fields = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True, add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        num_moe_experts=hf.get("num_experts") or hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_router_score_function="softmax", moe_router_pre_softmax=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bf16=False, apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope scaling {params.get('rope_type')!r} has no Megatron twin here")
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def build(checkpoint, *, load: bool = True, **overrides):
    """A GPTModel with the checkpoint's architecture (and weights, unless ``load=False``).
    Megatron's parallel state must be initialised (tensor parallel size 1; expert
    parallel size as initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    hf = hf_config(checkpoint)
    overrides.setdefault("expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size())
    config = transformer_config(hf, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf["vocab_size"],
                     max_sequence_length=hf.get("max_position_embeddings", 4096), position_embedding_type="rope",
                     rotary_base=_rope_theta(hf), share_embeddings_and_output_weights=False)
    if load:
        load_checkpoint(model, checkpoint)
    return model.eval()


def load_checkpoint(model, checkpoint) -> None:
    """Every parameter of ``model`` from the checkpoint's safetensors files."""
    from safetensors.torch import load_file

    hf = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        hf.update(load_file(path))
    load_state(model, hf)


def load_state(model, hf: dict) -> None:
    """Every parameter from Hugging Face-named tensors; every checkpoint tensor must be used."""
    layout = Layout.from_config(model.config)
    first, count = _local_experts(model.config)
    used = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{first + int(m[2])}.", name)  # its global expert
            tensor = from_hf(name, tuple(param.shape), hf, layout)
            param.copy_(tensor)
            used.update(n for n in hf if n.startswith(_prefix_of(name)))
    elsewhere = {n for n in hf if (m := _HF_EXPERT.search(n)) and not first <= int(m[1]) < first + count}
    unused = sorted(n for n in hf if n not in used and n not in elsewhere and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint tensors with no Megatron parameter: {', '.join(unused[:8])}"
                         f"{' ...' if len(unused) > 8 else ''}")


_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)\.")
_HF_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def _local_experts(config) -> tuple:
    """(first global expert of this rank, how many it holds): all of them without EP."""
    experts = config.num_moe_experts or 0
    if (config.expert_model_parallel_size or 1) == 1:
        return 0, experts
    from megatron.core import parallel_state

    count = experts // config.expert_model_parallel_size
    return parallel_state.get_expert_model_parallel_rank() * count, count


def _prefix_of(name: str) -> str:
    from ..weight_sync.names import _rule

    return _rule(name, 0)[0]


def logits(model, tokens) -> torch.Tensor:
    """Forward only, no cache: ``[batch, tokens, vocab]`` logits of equal-length ``tokens``
    (on the model's device)."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=next(model.parameters()).device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, attention_mask=None)
