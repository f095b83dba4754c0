"""Train a small GPT-MoE with Megatron-Core's own model, schedule and optimizer.

    SOURCE_PATCH=megatron_cpu python examples/train_moe.py --steps 5     # CPU, gloo
    SOURCE_PATCH=megatron_cpu torchrun --nproc-per-node 2 examples/train_moe.py --ep 2
    SOURCE_PATCH=megatron_cpu python examples/train_moe.py               # GPU, nccl
    SOURCE_PATCH=megatron_cpu,dump python examples/train_moe.py          # + activation dumps
    SOURCE_PATCH=patches/moe.yaml,megatron_cpu SOURCE_PATCH_ROUTING_MODE=capture \\
        SOURCE_PATCH_ROUTING_DIR=routes python examples/train_moe.py     # + MoE routes (docs/routing.md)

Megatron-Core (0.16 - 0.19) assumes CUDA in a few places, and before 0.17 its router
gemm is unbound without Transformer Engine (on GPU too). The bundled spec
`megatron_cpu` fixes each at its source as the modules import (see
patches/megatron_cpu.yaml), so this script neither forks nor monkey-patches
Megatron. Where CUDA is available its device edits change nothing, so the spec may
stay active on GPU machines; from 0.17 a GPU run needs no spec at all.

The task is a synthetic "ramp": every sequence counts up by one from a random
start (modulo the vocabulary), so the next token is always the current one
plus one and the loss drops within a few steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch

# Expected without Transformer Engine / Apex (always so on CPU): keep the output readable.
for _message in (".*Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "`torch.distributed.(all_gather|reduce_scatter)"):
    warnings.filterwarnings("ignore", message=_message)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

CPU_SPEC = "megatron_cpu"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (all MoE)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides the world)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when available, else CPU")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- set-up


def init_distributed(device: torch.device, ep: int) -> None:
    """torch.distributed (nccl on GPU, gloo on CPU) and Megatron's parallel groups."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(backend)
    else:  # a plain `python train_moe.py`: a world of one, no port needed
        if device.type == "cuda":
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep)


def check_cpu_spec(device: torch.device) -> None:
    """Fail early and clearly where Megatron-Core needs the megatron_cpu source patch:
    on CPU, and on GPU where the router gemm is unbound without Transformer Engine
    (before 0.17; from 0.17 Megatron binds it to None itself)."""
    if device.type == "cuda" and (moe_utils.HAVE_TE or hasattr(moe_utils, "te_general_gemm")):
        return
    # The active specs (which of megatron_cpu's patches apply depends on the release).
    from source_patch.patcher.activation import installed_finder

    finder = installed_finder()
    if not any(s.name == CPU_SPEC for s in (finder.specs if finder else ())):
        why = "on CPU" if device.type == "cpu" else "without Transformer Engine"
        current = os.environ.get("SOURCE_PATCH")
        sys.exit(f"error: {why}, Megatron-Core needs the {CPU_SPEC!r} source patch: run "
                 f"with SOURCE_PATCH={CPU_SPEC} (SOURCE_PATCH is {current!r})")
    if device.type == "cpu" and torch.cuda.is_available():
        # The spec changes nothing where CUDA is available, so Megatron's buffers would
        # still go to the GPU.
        sys.exit("error: CUDA is available, so Megatron-Core keeps its buffers on the GPU; "
                 "to train on CPU here, hide the GPUs: CUDA_VISIBLE_DEVICES= ...")


def build_model(args, device: torch.device) -> DistributedDataParallel:
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=2 * args.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,  # as MoE models do (biased experts trip an in-place view error)
        # MoE: every layer routes each token to `topk` of `experts` MLPs.
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=2 * args.hidden,
        moe_token_dispatcher_type="allgather",  # alltoall creates a CUDA stream
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=args.ep,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=torch.float32,
        bf16=False,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq_len,
        position_embedding_type="rope",
    )
    model.to(device)
    # Megatron's own data-parallel wrapper: its contiguous grad buffers are what
    # the Megatron optimizer steps on, and it all-reduces grads across ranks.
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(model: DistributedDataParallel, args):
    """Megatron's optimizer (Adam, grad clipping) over the DDP model's grad buffers."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, clip_grad=1.0,
                        bf16=False, fp16=False, params_dtype=torch.float32),
        [model],
    )
    # What Megatron's training loop wires up: grad all-reduce after the backward
    # passes, and the optimizer's loss scale applied to each micro-batch loss.
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.grad_scale_func = optimizer.scale_loss
    return optimizer


def make_dataset(args, device: torch.device, size: int = 64) -> torch.Tensor:
    """A fixed-seed set of ramps: row i is start_i, start_i + 1, ... (mod vocab)."""
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, args.vocab, (size, 1), generator=gen)
    tokens = (starts + torch.arange(args.seq_len + 1)) % args.vocab
    return tokens.to(device)


def make_batch(dataset: torch.Tensor, step: int, args) -> dict[str, torch.Tensor]:
    """Micro-batch `step` of this data-parallel rank: inputs, next-token labels, mask."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    index = (step * dp_size + dp_rank) * args.micro_batch
    rows = torch.arange(index, index + args.micro_batch, device=dataset.device) % len(dataset)
    seq = dataset[rows]
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    positions = torch.arange(args.seq_len, device=dataset.device).expand_as(tokens)
    return {"tokens": tokens, "labels": labels, "position_ids": positions,
            "loss_mask": torch.ones_like(tokens, dtype=torch.float)}


# --------------------------------------------------------------------------- training


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token cross entropy GPTModel returns when given labels."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    # attention_mask=None: the local attention builds its own causal mask.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(model, optimizer, batches, args) -> tuple[float, float]:
    """One optimizer step over `args.micro_batches` micro-batches: (loss, grad norm)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=args.micro_batches,
        seq_length=args.seq_len,
        micro_batch_size=args.micro_batch,
        forward_only=False,
    )
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise RuntimeError("the optimizer skipped the step (non-finite gradients)")
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    # Average over data-parallel ranks so rank 0 prints the global loss.
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size(), float(grad_norm or 0.0)


def progress(steps: int, enabled: bool):
    """A tqdm bar on stderr when tqdm is installed (the per-step lines go to stdout)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, unit="step", file=sys.stderr, leave=False,
                disable=not (enabled and sys.stderr.isatty()))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    check_cpu_spec(device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # One intra-op thread, as torchrun sets: a model this small gains nothing from
        # more, and they stall badly (seconds per step) when another process holds a core.
        torch.set_num_threads(1)
    init_distributed(device, args.ep)
    rank0 = torch.distributed.get_rank() == 0

    torch.manual_seed(args.seed)
    if device.type == "cuda":  # Megatron's CUDA RNG states (on CPU: the default generator)
        model_parallel_cuda_manual_seed(args.seed)
    model = build_model(args, device)
    optimizer = build_optimizer(model, args)
    dataset = make_dataset(args, device)

    if rank0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
              f"top-{args.topk}, {n_params / 1e6:.2f}M params on {device} "
              f"(world {torch.distributed.get_world_size()}, ep {args.ep})", flush=True)
    dump_run = dumping()
    if dump_run:
        name_dump_run(device)
    bar = progress(args.steps, rank0)
    times = []
    for step in range(args.steps):
        batches = [make_batch(dataset, step * args.micro_batches + m, args)
                   for m in range(args.micro_batches)]
        start = time.perf_counter()
        loss, grad_norm = train_step(model, optimizer, batches, args)
        times.append(time.perf_counter() - start)
        if rank0:
            line = (f"step {step + 1}/{args.steps} loss {loss:.4f} grad_norm {grad_norm:.3f} "
                    f"time {times[-1] * 1e3:.1f} ms")
            if bar is not None:
                bar.update(1)
                bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    if rank0 and times:
        steady = times[1:] or times
        print(f"done: {args.steps} steps, {sum(times):.2f} s, "
              f"{sum(steady) / len(steady) * 1e3:.0f} ms/step after the first", flush=True)
    if dump_run:
        report_dumps(rank0)
    close_weight_sync()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def close_weight_sync() -> None:
    """Leave the weight-update group, if the weight_sync spec opened one, before the
    default group goes: torch's destroy of every group would wait for receivers that
    wait for the next update (source_patch.runtime.weight_sync.sync.close)."""
    sync = sys.modules.get("source_patch.runtime.weight_sync.sync")
    if sync is not None:
        sync.close()


def dumping() -> bool:
    """Is the `dump` spec (patches/dump.yaml) active and dumping enabled?"""
    from megatron.core.transformer import transformer_layer

    if not any(a.spec == "dump" for a in getattr(transformer_layer, "__source_patches__", ())):
        return False
    from source_patch.runtime.dump import api as dumper

    return dumper.state()["enabled"]


def name_dump_run(device: torch.device) -> None:
    """One experiment directory per run, named by rank 0's start time (unless
    SOURCE_PATCH_DUMP_EXP_NAME names one)."""
    if "SOURCE_PATCH_DUMP_EXP_NAME" in os.environ:
        return
    from source_patch.runtime.dump import api as dumper

    stamp = torch.tensor([int(time.time())], device=device)
    torch.distributed.broadcast(stamp, src=0)
    dumper.configure(exp_name=time.strftime("train_moe-%Y%m%d-%H%M%S", time.gmtime(stamp.item())))


def show_dumps(run: Path) -> None:
    """A run's dumps summarised, and the command that reads them back, runnable as printed
    from a fresh shell (core/commands.py: `.venv/bin/source-patch` where that is the one)."""
    from source_patch.runtime.core.commands import command
    from source_patch.runtime.dump.reader import load, summary

    run = run.resolve()
    print(f"\ndumps: {run}")
    try:
        print(summary(load(run)))
    except FileNotFoundError:
        print("no records were written")
    print(f"read them: {command('dumps', run.parent, '--exp-name', run.name)}")


def report_dumps(rank0: bool) -> None:
    """Where this run's dumps went and what they hold."""
    from source_patch.runtime.dump import api as dumper

    dumper.flush()
    torch.distributed.barrier()  # every rank's records are on disk
    state = dumper.state()
    if not rank0:
        return
    show_dumps(Path(state["exp_dir"]))
    counters = state["counters"]
    if counters["errors"] or counters["dropped"]:
        print(f"warning: {counters['errors']} write error(s), {counters['dropped']} record(s) dropped; "
              f"last error: {state['last_error']}")


if __name__ == "__main__":
    main()
