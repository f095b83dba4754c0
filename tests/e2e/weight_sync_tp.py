"""Tensor-parallel gathering (weight_megatron.MegatronParams) against Megatron's own
tensor-parallel modules: two ranks, TP 2, on CPU under SOURCE_PATCH=megatron_cpu.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/e2e/weight_sync_tp.py OUT.json

Builds a dense gated model (column-parallel QKV and SwiGLU fc1, row-parallel
projections, vocab-parallel embedding and output layer), gathers and maps its
parameters, and checks on rank 0 that plain torch with the mapped full weights
computes what Megatron's sharded modules compute: the embedding, the query/key/value
heads (Megatron's own split, all-gathered over TP), the attention output projection
and the MLP.  Writes OUT.json: check -> max abs difference.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weight_sync_models as models  # tests/e2e/

from megatron.core import parallel_state  # noqa: E402


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from source_patch.runtime.weight_sync import megatron as weight_megatron
    from source_patch.runtime.weight_sync import names as weight_names

    torch.manual_seed(0)
    model = models.megatron_model("llama")
    params = weight_megatron.MegatronParams([model])
    layout = weight_names.Layout.from_config(model.config)
    full = {n: t for name, tensor in params.tensors() for n, t in weight_names.to_hf(name, tensor, layout)}
    planned = {n: shape for n, shape, _ in weight_names.plan(params.shapes(), layout)}
    rank, tp = dist.get_rank(), 2
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, models.VOCAB, (3, 5), generator=gen)
    x = torch.randn(4, 1, models.HIDDEN, generator=gen)
    layer = model.decoder.layers[0]
    checks = {}
    with torch.no_grad():
        # vocab-parallel embedding: reduced over TP inside
        emb = model.embedding.word_embeddings(tokens)
        checks["embedding"] = (emb, F.embedding(tokens, full["model.embed_tokens.weight"]))
        # column-parallel QKV: this rank's heads, split by Megatron, gathered over TP
        attention = layer.self_attention
        attention.q_layernorm = attention.k_layernorm = None  # normed after the split; compare before
        q, k, v = attention.get_query_key_value_tensors(x, None)
        for part, local in (("q", q), ("k", k), ("v", v)):
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous())
            heads = torch.cat(shards, dim=2).reshape(4, 1, -1)
            checks[f"{part}_proj"] = (heads, x @ full[f"model.layers.0.self_attn.{part}_proj.weight"].t())
        # row-parallel output projection: input split over TP, output reduced
        width = models.HEADS * models.HEAD_DIM
        y = torch.randn(4, 1, width, generator=gen)
        out, _ = attention.linear_proj(y[..., rank * width // tp:(rank + 1) * width // tp])
        checks["o_proj"] = (out, y @ full["model.layers.0.self_attn.o_proj.weight"].t())
        # SwiGLU MLP: column-parallel fc1 ([gate_r; up_r] per rank), row-parallel fc2
        mlp, _ = layer.mlp(x)
        p = "model.layers.0.mlp."
        checks["mlp"] = (mlp, (F.silu(x @ full[p + "gate_proj.weight"].t()) * (x @ full[p + "up_proj.weight"].t()))
                         @ full[p + "down_proj.weight"].t())
    if rank == 0:
        result = {name: (got - want).abs().max().item() for name, (got, want) in checks.items()}
        result["shapes_planned_as_gathered"] = all(tuple(full[n].shape) == s for n, s in planned.items())
        result["names"] = sorted(full)
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
