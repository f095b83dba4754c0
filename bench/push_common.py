"""push_bench.py's pieces that its --engine mode (push_engine.py) uses too: the model
(a Megatron-Core MoE in DDP's buffers), the bucket setting, push()'s backend over the
bench's links, the mapped parameters a check compares against, and a cProfile of
pushes.  Both scripts import this module and it imports neither, so the arrows go one
way: push_bench -> push_engine (for --engine) -> push_common."""

from __future__ import annotations

import torch


def backend(link):
    """push()'s backend over one of the bench's links (push() itself is unchanged)."""
    from source_patch.runtime.weight_sync.broadcast import Broadcast

    return Broadcast(link)


def bucket(args) -> dict:
    return {"bucket_bytes": args.bucket_kib << 10} if args.bucket_kib else {}


def build(args, device: torch.device, rank: int = 0, world: int = 1, store=None):
    """A GPTModel in Megatron's DDP (distributed optimizer's buffers): a world of one,
    or ``world`` processes of tensor parallelism ``args.tp`` and expert parallelism
    ``args.ep`` over ``store``."""
    if device.type == "cpu":
        from source_patch.patcher import activate

        activate(["megatron_cpu"])  # before Megatron's first import
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         store=store or torch.distributed.HashStore(), rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)  # GPU initialisation draws from Megatron's RNG tracker
    h = args.hidden
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=h, num_attention_heads=4, num_query_groups=2, kv_channels=h // 4,
        ffn_hidden_size=2 * h, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        qk_layernorm=True, add_bias_linear=False, num_moe_experts=args.experts, moe_router_topk=2,
        moe_ffn_hidden_size=h // 2, moe_token_dispatcher_type="allgather", use_cpu_initialization=device.type == "cpu",
        params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=args.tp)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=64,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).to(device)
    return DistributedDataParallel(config=config, module=model,
                                   ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))


def profile(push, sync, sort: str = "tottime") -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        push()
    sync()
    profiler.disable()
    pstats.Stats(profiler).sort_stats(sort).print_stats(25)


def mapped(ddp, layout) -> list:
    """[(engine name, tensor)]: every parameter through the name and layout mapping."""
    from source_patch.runtime.weight_sync import names as weight_names

    return [(n, t) for name, p in ddp.named_parameters()
            for n, t in weight_names.to_hf(weight_names.strip_wrappers(name), p.detach(), layout)]


_PACKED = {}  # planning.Plan.packed as shipped, kept while the old path is measured


def plan_packing(planned: bool) -> None:
    """The packed push planned once (the shipped path), or, off, packed tensor by tensor
    as before issue 32's item 2: the bench's own copy of that path, a Plan that never
    plans (sync.py then maps and packs each tensor)."""
    from source_patch.runtime.weight_sync import planning

    shipped = _PACKED.setdefault("packed", planning.Plan.packed)
    planning.Plan.packed = shipped if planned else (lambda self, params, layout: None)
