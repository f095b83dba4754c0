"""Routing capture on vs off in a Megatron training step whose routers are Megatron's own
CUDA graphs (``cuda_graph_impl="local"``, ``cuda_graph_scope=["moe_router"]``), one process.

The graphs are built at the end of the first step with capture on (patches/routing.yaml
gives each one a GraphStage: the top-k ids are copied into a static buffer inside the
graph and drained after every replay).  Then the process alternates ``--phase`` steps
with capture on (drain, device-to-host copy on a side stream, the records written to
disk by the background writer at each step end) and ``--phase`` steps with routing off
(the hooks return after one test; the graphs still run their in-graph copy of the ids,
a few KiB a layer: that part of the cost is in both phases).  Each on/off cycle gives
one paired ratio of medians; the table gives its median with a 90% interval, and the
same for an A/A process part (both phases off: what the protocol itself reads).

    python bench/graph_bench.py                      # GPU: a mid-size GPT-MoE
    python bench/graph_bench.py --cycles 4 --phase 2 # a short run
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import statistics
import sys
import tempfile
import time
from pathlib import Path

import stats


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=6, help="steps before timing (the first builds the graphs)")
    p.add_argument("--phase", type=int, default=4, help="steps per phase")
    p.add_argument("--cycles", type=int, default=16, help="on/off cycles (and as many A/A cycles)")
    p.add_argument("--no-aa", action="store_true", help="skip the A/A cycles")
    return p.parse_args()


def activate(specs=("routing",)) -> None:
    """The routing spec (or ``specs``), before Megatron imports (megatron_cpu: before 0.17
    the router gemm is unbound without Transformer Engine)."""
    from source_patch.patcher.activation import activate as _activate

    major, minor = (int(x) for x in md.version("megatron-core").split(".")[:2])
    _activate(list(specs) + (["megatron_cpu"] if (major, minor) < (0, 17) else []))


def _unwrapping(layer_class):
    """megatron-core 0.16.1 returns the one output of the MoE postprocess graph as a
    1-tuple on replay, which the next layer cannot take (0.19 unwraps it in
    CudaGraphManager's wrapper, "to match the original function's return type"): the
    same unwrap here, a no-op where Megatron does it."""

    class Layer(layer_class):
        def _forward_mlp(self, *args, **kwargs):
            out = super()._forward_mlp(*args, **kwargs)
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out

    return Layer


def graphed_model(train_moe, args, graphs: bool = True):
    """examples/train_moe.py's GPT-MoE with Megatron's own router graphs (``graphs``), in
    DDP; tests/test_megatron_graphs.py builds its model here too."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    extra = {"cuda_graph_impl": "local", "cuda_graph_scope": ["moe_router"]} if graphs else {}
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=2 * args.hidden, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=2 * args.hidden,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        params_dtype=torch.float32, bf16=False, **extra)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    # MoETransformerLayer: the layer class whose router Megatron graphs alone (the GPT specs
    # build a TransformerLayer, which graphs either the whole layer or nothing of an MoE)
    spec.module = _unwrapping(MoETransformerLayer)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
        max_sequence_length=args.seq_len, position_embedding_type="rope").cuda()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp, module=model)


def build(train_moe, args):
    model = graphed_model(train_moe, args)
    return model, train_moe.build_optimizer(model, args)


def cycle_ratios(train, routing, folder, cycles: int, phase: int, on_mode: str) -> tuple[list, list, list]:
    """``cycles`` x (``phase`` steps in ``on_mode``, ``phase`` steps off): step times and ratios."""
    on, off, ratios = [], [], []
    for _ in range(cycles):
        phases = []
        for mode in (on_mode, "off"):
            routing.configure(mode=mode, **({"dir": folder} if mode == "capture" else {}))
            phases.append([train() for _ in range(phase)])
        on += phases[0]
        off += phases[1]
        ratios.append(statistics.median(phases[0]) / statistics.median(phases[1]))
    routing.configure(mode="off")
    return on, off, ratios


def main() -> None:
    cli = parse()
    activate()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import torch
    import train_moe
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing

    args = train_moe.parse_args(["--layers", str(cli.layers), "--hidden", str(cli.hidden), "--heads", str(cli.heads),
                                 "--experts", str(cli.experts), "--topk", str(cli.topk), "--seq-len",
                                 str(cli.seq_len), "--micro-batch", str(cli.micro_batch), "--micro-batches",
                                 str(cli.micro_batches)])
    train_moe.init_distributed(torch.device("cuda"), 1)
    folder = tempfile.mkdtemp(prefix="sp-graph-bench-")
    routing.configure(mode="capture", dir=folder)  # on when the graphs are built: they stage the ids
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=True)
    model, optimizer = build(train_moe, args)
    data = train_moe.make_dataset(args, torch.device("cuda"))
    count = [0]

    def train() -> float:
        batches = [train_moe.make_batch(data, count[0] * args.micro_batches + m, args) for m in range(args.micro_batches)]
        count[0] += 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_moe.train_step(model, optimizer, batches, args)  # ends with loss.item(): synced
        return time.perf_counter() - start

    for _ in range(cli.warmup):
        train()
    graphed = sum(r.fwd_graph is not None for m in model.modules() if hasattr(m, "cudagraph_manager_router")
                  for r in m.cudagraph_manager_router.cudagraph_runners)
    print(f"megatron-core {md.version('megatron-core')}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"{cli.layers} MoE layers, hidden {cli.hidden}, {cli.experts} experts top-{cli.topk}, "
          f"{cli.micro_batches} x {cli.micro_batch} x {cli.seq_len} tokens a step; {graphed} router graphs")
    on, off, ratios = cycle_ratios(train, routing, folder, cli.cycles, cli.phase, "capture")
    routing_capture.flush()
    rows = [("capture on", on), ("routing off", off)]
    aa = None
    if not cli.no_aa:
        _, aa_off, aa = cycle_ratios(train, routing, folder, cli.cycles, cli.phase, "off")
    print(f"\nstep time, ms ({stats.HEADER}), {cli.cycles} cycles of {cli.phase} + {cli.phase} steps")
    for name, values in rows:
        print(f"  {name:<12} {stats.cells(values, 1e3)}")
    for name, r in (("capture / off", ratios), ("A/A (off / off)", aa)):
        if r:
            med, low, high = stats.bootstrap(statistics.median, r)
            print(f"  {name:<16} ratio {med:.4f} [{low:.4f}..{high:.4f}]  ({100 * (med - 1):+.2f}%, "
                  f"90% upper end {100 * (high - 1):+.2f}%)")
    from source_patch.runtime.core.adapters import graph_stage

    replays = sum(st.replays for st in (graph_stage._stages or {}).values() if st.entries)
    saved = routing.state()["counters"]["records_saved"]
    print(f"  router graph replays drained: {replays}")
    print(f"  records saved while capturing: {saved} (last error: {routing.state()['last_error']})")
    routing.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
