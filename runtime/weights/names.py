"""Megatron-Core parameter names and layouts -> the Hugging Face names SGLang's
``load_weights`` expects.

    layout = Layout.from_config(model.config)
    for hf_name, tensor in to_hf("decoder.layers.0.self_attention.linear_qkv.weight", full, layout):
        ...   # model.layers.0.self_attn.q_proj.weight, ...k_proj..., ...v_proj...

The input is a *full* parameter (tensor-parallel shards gathered, expert index
global; see megatron.py) under its Megatron name, with any ``module.``
prefixes of the DDP / Float16Module wrappers.  The outputs are views or copies
in the engine's layout.  Called with a ``meta`` tensor, it gives the output
shapes without touching data, which is how the sender plans its buckets.

Two families, chosen by the model's config:

* gated MLP (``gated_linear_unit``, SwiGLU): Llama / Qwen3 / Qwen3-MoE names,
  ``linear_fc1`` split into ``gate_proj`` and ``up_proj`` (Megatron keeps
  ``[gate; up]``, SGLang's SiluAndMul takes gate first);
* plain MLP (GPT: LayerNorm, GeLU): StarCoder2's names, ``c_fc`` / ``c_proj``.

Every parameter must match a rule: an unknown name raises UnmappedParameter
rather than being dropped, because SGLang's ``load_weights`` silently skips
names it does not know and the engine would keep serving a stale tensor.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


class UnmappedParameter(KeyError):
    """A Megatron parameter with no engine name (unsupported module or layout)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Layout:
    """What the mapping needs to know about the model."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    gated: bool
    vocab_size: int = 0  # > 0: cut padded embedding / output rows down to this

    @classmethod
    def from_config(cls, config, vocab_size: int = 0) -> "Layout":
        """From a Megatron TransformerConfig."""
        if getattr(config, "attention_output_gate", False):
            raise UnmappedParameter("attention_output_gate (gated attention) has no mapping")
        heads = config.num_attention_heads
        return cls(num_attention_heads=heads,
                   num_query_groups=config.num_query_groups or heads,
                   head_dim=config.kv_channels or config.hidden_size // heads,
                   gated=bool(config.gated_linear_unit),
                   vocab_size=vocab_size)


def strip_wrappers(name: str) -> str:
    """``module.module.decoder...`` (DDP, Float16Module) -> ``decoder...``."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


# ----------------------------------------------------------------- layout conversions
# Each takes the full Megatron tensor and returns [(suffix, tensor)]; a suffix is
# appended to the engine prefix the rule gives.


def split_qkv(t: torch.Tensor, layout: Layout, kind: str) -> list:
    """Megatron's fused QKV -> q, k, v.  Megatron interleaves by query group:
    [num_query_groups, (heads_per_group + 2) * head_dim, ...] holds each group's
    query heads, then its key head, then its value head.  Weights and biases
    alike (dim 0 is the output dim)."""
    groups, head_dim = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    rest = t.shape[1:]
    if t.shape[0] != groups * (per_group + 2) * head_dim:
        raise UnmappedParameter(f"linear_qkv has {t.shape[0]} rows, expected num_query_groups * "
                                f"(heads_per_group + 2) * head_dim = {groups * (per_group + 2) * head_dim}")
    grouped = t.view(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(groups * per_group * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return [(f"q_proj.{kind}", q), (f"k_proj.{kind}", k), (f"v_proj.{kind}", v)]


def split_fc1(t: torch.Tensor, layout: Layout, kind: str) -> list:
    """linear_fc1: gated -> gate_proj (first half), up_proj (second half); else c_fc."""
    if not layout.gated:
        return [(f"c_fc.{kind}", t)]
    gate, up = t.chunk(2, dim=0)
    return [(f"gate_proj.{kind}", gate), (f"up_proj.{kind}", up)]


def fc2(t: torch.Tensor, layout: Layout, kind: str) -> list:
    return [(f"{'down_proj' if layout.gated else 'c_proj'}.{kind}", t)]


def vocab_rows(t: torch.Tensor, layout: Layout, kind: str) -> list:
    return [(kind, t[: layout.vocab_size] if layout.vocab_size else t)]


def same(t: torch.Tensor, layout: Layout, kind: str) -> list:
    return [(kind, t)]


# ----------------------------------------------------------------- rules
# (Megatron name pattern, engine prefix template, conversion).  Groups: L = layer,
# E = expert, K = weight|bias.  The conversion's suffix completes the engine name.

_L = r"decoder\.layers\.(?P<L>\d+)\."
_K = r"(?P<K>weight|bias)"
_E_LOCAL = r"mlp\.experts\.local_experts\.(?P<E>\d+)\."   # SequentialMLP
_LAYER = "model.layers.{L}."

RULES: list[tuple[re.Pattern, str, Callable]] = [(re.compile(p + r"\Z"), t, f) for p, t, f in [
    (r"embedding\.word_embeddings\.(?P<K>weight)", "model.embed_tokens.", vocab_rows),
    (r"output_layer\.(?P<K>weight)", "lm_head.", vocab_rows),
    (r"decoder\.final_layernorm\." + _K, "model.norm.", same),
    # attention
    (_L + r"input_layernorm\." + _K, _LAYER + "input_layernorm.", same),
    (_L + r"self_attention\.linear_qkv\.layer_norm_" + _K, _LAYER + "input_layernorm.", same),  # TE fused
    (_L + r"self_attention\.linear_qkv\." + _K, _LAYER + "self_attn.", split_qkv),
    (_L + r"self_attention\.linear_proj\." + _K, _LAYER + "self_attn.o_proj.", same),
    (_L + r"self_attention\.q_layernorm\." + _K, _LAYER + "self_attn.q_norm.", same),
    (_L + r"self_attention\.k_layernorm\." + _K, _LAYER + "self_attn.k_norm.", same),
    # MLP input norm: a separate module (local spec, MoE layers) or fused into fc1 (TE dense)
    (_L + r"pre_mlp_layernorm\." + _K, _LAYER + "post_attention_layernorm.", same),
    (_L + r"mlp\.linear_fc1\.layer_norm_" + _K, _LAYER + "post_attention_layernorm.", same),
    # dense MLP
    (_L + r"mlp\.linear_fc1\." + _K, _LAYER + "mlp.", split_fc1),
    (_L + r"mlp\.linear_fc2\." + _K, _LAYER + "mlp.", fc2),
    # MoE: router and experts (SequentialMLP local_experts.E, TEGroupedMLP weightE)
    (_L + r"mlp\.router\.(?P<K>weight)", _LAYER + "mlp.gate.", same),
    (_L + _E_LOCAL + r"linear_fc1\." + _K, _LAYER + "mlp.experts.{E}.", split_fc1),
    (_L + _E_LOCAL + r"linear_fc2\." + _K, _LAYER + "mlp.experts.{E}.", fc2),
    (_L + r"mlp\.experts\.linear_fc1\.(?P<K>weight|bias)(?P<E>\d+)", _LAYER + "mlp.experts.{E}.", split_fc1),
    (_L + r"mlp\.experts\.linear_fc2\.(?P<K>weight|bias)(?P<E>\d+)", _LAYER + "mlp.experts.{E}.", fc2),
]]


def to_hf(name: str, tensor: torch.Tensor, layout: Layout, layer_offset: int = 0) -> list:
    """[(engine name, tensor)] for one full Megatron parameter; UnmappedParameter if none."""
    prefix, convert, kind = _rule(name, layer_offset)
    return [(prefix + suffix, out) for suffix, out in convert(tensor, layout, kind)]


@functools.lru_cache(maxsize=1 << 16)
def _rule(name: str, layer_offset: int) -> tuple:
    """(engine prefix, conversion, weight|bias) for a name (the same names come every step)."""
    bare = strip_wrappers(name)
    for pattern, template, convert in RULES:
        match = pattern.match(bare)
        if match is None:
            continue
        fields = match.groupdict()
        if "L" in fields:
            fields["L"] = int(fields["L"]) + layer_offset
        return template.format(**fields), convert, fields["K"]
    raise UnmappedParameter(
        f"no engine name for Megatron parameter {name!r} (supported: GPT / Qwen3-MoE style "
        "embedding, attention with fused QKV, q/k layernorm, dense or gated MLP, router, "
        "SequentialMLP / TEGroupedMLP experts; see docs/weight_sync.md)")


def plan(named_shapes, layout: Layout, layer_offset: int = 0) -> Iterator[tuple[str, tuple, torch.dtype]]:
    """(engine name, shape, dtype) for each of ``(megatron name, shape, dtype)``,
    computed on meta tensors: no data is touched or allocated."""
    for name, shape, dtype in named_shapes:
        for hf_name, out in to_hf(name, torch.empty(shape, dtype=dtype, device="meta"), layout, layer_offset):
            yield hf_name, tuple(out.shape), out.dtype


# ----------------------------------------------------------------- the other way: engine -> Megatron


def join_qkv(parts: dict, layout: Layout, kind: str) -> torch.Tensor:
    """q, k, v (Hugging Face layout) -> Megatron's fused, group-interleaved linear_qkv."""
    groups, head_dim = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    q, k, v = (parts[f"{p}_proj.{kind}"] for p in "qkv")
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                      v.reshape(groups, 1, head_dim, *rest)], dim=1).reshape(-1, *rest)


def _inverse(convert, parts: dict, layout: Layout, kind: str, shape) -> torch.Tensor:
    if convert is split_qkv:
        return join_qkv(parts, layout, kind)
    if convert is split_fc1 and layout.gated:
        return torch.cat([parts[f"gate_proj.{kind}"], parts[f"up_proj.{kind}"]], dim=0)
    (tensor,) = parts.values()
    if convert is vocab_rows and tensor.shape[0] < shape[0]:  # Megatron pads the vocabulary
        tensor = torch.cat([tensor, tensor.new_zeros(shape[0] - tensor.shape[0], *tensor.shape[1:])])
    return tensor


def from_hf(name: str, shape, hf: dict, layout: Layout, layer_offset: int = 0) -> torch.Tensor:
    """The full Megatron parameter ``name`` (of ``shape``) from Hugging Face / SGLang
    tensors ``hf`` (name -> tensor): the inverse of :func:`to_hf`.  KeyError names a
    missing engine tensor."""
    prefix, convert, kind = _rule(name, layer_offset)
    wanted = [n for n, _ in to_hf(name, torch.empty(shape, device="meta"), layout, layer_offset)]
    missing = [n for n in wanted if n not in hf]
    if missing:
        raise KeyError(f"{name}: the checkpoint has no {', '.join(missing)}")
    tensor = _inverse(convert, {n[len(prefix):]: hf[n] for n in wanted}, layout, kind, shape)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: the checkpoint gives shape {list(tensor.shape)}, the model has {list(shape)}")
    return tensor
