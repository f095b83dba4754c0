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

On the engine, :func:`check_model` holds a received manifest against the SGLang
model it is for (names, full shapes, dtypes) before anything is loaded.
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


def split_qkv(t: torch.Tensor, layout: Layout, kind: str, views: bool = False) -> list:
    """Megatron's fused QKV -> q, k, v.  Megatron interleaves by query group:
    [num_query_groups, (heads_per_group + 2) * head_dim, ...] holds each group's
    query heads, then its key head, then its value head.  Weights and biases
    alike (dim 0 is the output dim).  ``views``: the strided views, not reshaped
    (no copy; the packed push copies them straight into its buckets)."""
    groups, head_dim = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    rest = t.shape[1:]
    if t.shape[0] != groups * (per_group + 2) * head_dim:
        raise UnmappedParameter(f"linear_qkv has {t.shape[0]} rows, expected num_query_groups * "
                                f"(heads_per_group + 2) * head_dim = {groups * (per_group + 2) * head_dim}")
    grouped = t.view(groups, per_group + 2, head_dim, *rest)
    if views:
        return [(f"q_proj.{kind}", grouped[:, :per_group]), (f"k_proj.{kind}", grouped[:, per_group]),
                (f"v_proj.{kind}", grouped[:, per_group + 1])]
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


def to_hf_views(name: str, tensor: torch.Tensor, layout: Layout, layer_offset: int = 0) -> list:
    """``to_hf`` as views of ``tensor`` only, never copies: each holds the engine
    tensor's elements in order, in a shape of its own where the engine's would need
    a copy (q, k, v: [groups, heads, head_dim, ...]).  The packed push's program
    (program.py) copies them into its buckets, viewed in that shape."""
    prefix, convert, kind = _rule(name, layer_offset)
    outs = convert(tensor, layout, kind, views=True) if convert is split_qkv else convert(tensor, layout, kind)
    return [(prefix + suffix, out) for suffix, out in outs]


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
        "SequentialMLP / TEGroupedMLP experts; see docs/weight_sync_trainer.md)")


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


# ----------------------------------------------------------------- the engine's side: what its model loads
# SGLang's load_weights skips a name it does not know, and its loaders narrow or pad
# a tensor of another size: an update it "loaded" may have changed nothing.  So a
# receiver checks the manifest against its model before the manifest vote.

# The stacked names of SGLang's Llama-style load_weights (Starcoder2 declares no
# packed_modules_mapping); a model's own packed_modules_mapping comes first.
STACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_CASTS = {torch.float32, torch.bfloat16, torch.float16}  # SGLang's loaders cast between these
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def check_model(model, tensors) -> None:
    """ValueError unless ``tensors``, [(checkpoint name, shape, dtype)], are exactly
    what SGLang's ``model.load_weights`` loads: every name known, none missing, each
    full (unsharded) shape and dtype its parameter's (float32, bfloat16 and float16
    cast into each other, as SGLang's loaders do)."""
    expected = engine_tensors(model)
    unknown, shapes, dtypes, seen = [], [], [], set()
    for name, shape, dtype in tensors:
        want = expected.get(name)
        if want is None:
            if not _elsewhere(model, name):
                unknown.append(name)
            continue
        seen.add(name)
        full, held, padded = want
        if not _fits(tuple(shape), full, padded):
            shapes.append(f"{name} {list(shape)}, loads {list(full)}")
        if dtype != held and not (dtype in _CASTS and held in _CASTS):
            dtypes.append(f"{name} {str(dtype).removeprefix('torch.')}, holds {str(held).removeprefix('torch.')}")
    missing = [name for name in expected if name not in seen]
    found = [(what, items) for what, items in (("not in the model", unknown), ("missing", missing),
                                                ("wrong shape", shapes), ("wrong dtype", dtypes)) if items]
    if found:
        raise ValueError("the update does not match the model: " + "; ".join(
            f"{len(items)} {what} ({', '.join(item[:200] for item in items[:3])}{', ...' if len(items) > 3 else ''})"
            for what, items in found))


def _elsewhere(model, name: str) -> bool:
    """Whether another pipeline stage loads ``name`` (load_weights skips it here)."""
    if getattr(getattr(model, "pp_group", None), "world_size", 1) <= 1:
        return False
    layer, inner = _LAYER.search(name), model.model
    return layer is None or not inner.start_layer <= int(layer.group(1)) < inner.end_layer


def _fits(shape: tuple, full: tuple, padded: int | None) -> bool:
    """``padded``: a dim the engine pads to a larger size, so a smaller one fits."""
    return len(shape) == len(full) and all(
        got == want or (dim == padded and got <= want) for dim, (got, want) in enumerate(zip(shape, full)))


def engine_tensors(model) -> dict:
    """{checkpoint name: (full shape, dtype, padded dim or None)} of every tensor
    ``model.load_weights`` takes, from the model's parameters and the full sizes
    their SGLang layers keep (a parameter holds this rank's shard)."""
    from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    stacked = {**STACKED, **(getattr(type(model), "packed_modules_mapping", None) or {})}
    out = {}
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, FusedMoE):
            items = _experts(module, name)
        elif isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            items = _stacked(module, owner, kind, stacked)
        elif isinstance(module, LinearBase):  # weight (out, in), bias (out,)
            items = [(name, (module.output_size, module.input_size)[: param.dim()], None)]
        elif isinstance(module, VocabParallelEmbedding):
            items = [(name, (module.org_vocab_size, module.embedding_dim), None)]
        else:
            items = [(name, tuple(param.shape), None)]
        out.update((hf, (tuple(shape), param.dtype, padded)) for hf, shape, padded in items)
    return out


def _stacked(module, owner: str, kind: str, stacked: dict) -> list:
    """The q/k/v or gate/up parts of a fused linear layer's weight or bias."""
    prefix, _, fused = owner.rpartition(".")
    parts = stacked.get(fused)
    if parts is None:
        raise ValueError(f"{owner}: a fused layer whose checkpoint names are not known")
    if hasattr(module, "total_num_heads"):  # QKV: rows from the head counts
        rows = [module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size,
                module.total_num_kv_heads * module.v_head_size]
    else:
        rows = list(module.output_sizes)
    dims = 2 if kind == "weight" else 1
    return [(f"{prefix}.{part}.{kind}", (size, module.input_size)[:dims], None) for part, size in zip(parts, rows)]


def _experts(module, name: str) -> list:
    """Every expert's gate/up (w13) or down (w2) part under FusedMoE's own names
    (make_expert_params_mapping; expert ids global: each rank's loader keeps its own)."""
    inter = module.intermediate_size_per_partition * module.moe_tp_size
    hidden = getattr(module, "hidden_size_unpadded", module.hidden_size)
    # flashinfer's TRT-LLM MoE rounds the per-rank intermediate size up to 128.
    pads = getattr(module, "use_flashinfer_trtllm_moe", False)
    count = module.num_experts - getattr(module, "num_fused_shared_experts", 0)
    out = []
    for param_prefix, ckpt_prefix, _, shard in type(module).make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", count):
        if param_prefix in name:
            shape, dim = ((hidden, inter), 1) if shard == "w2" else ((inter, hidden), 0)
            bias = not name.endswith("weight")
            out.append((name.replace(param_prefix, ckpt_prefix, 1), shape[:1] if bias else shape,
                        dim if pads and not bias else None))
    return out
