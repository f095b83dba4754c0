"""Training runs of one checkpoint through Megatron-Core's own schedule, dumped layer by
layer, so that `source-patch compare` can find a real mismatch between two of them.

    python examples/verdict_runs.py --checkpoint ckpt --make-checkpoint --out runs              # fp32, TP 1, CPU
    python examples/verdict_runs.py --checkpoint ckpt --out runs --dtype bf16                   # bf16 (Float16Module)
    python examples/verdict_runs.py --checkpoint ckpt --out runs --tp 2                         # TP 2 (gloo, 2 processes)
    python examples/verdict_runs.py --checkpoint ckpt --out runs --perturb 3:1e-2               # layer 3's experts x 1.01
    source-patch compare runs runs --exp-name bf16-tp1-cpu --exp-name fp32-tp1-cpu     # bf16 against fp32

Every run loads the same Hugging Face Qwen3-MoE checkpoint into the Megatron twin
(source_patch.runtime.verdict.twin; `--checkpoint tiny`: testing/sglang.py's
tiny_checkpoint(), which needs transformers; `--make-checkpoint`: a small random one
written once at --checkpoint without transformers) and runs one training step's
forward and backward over 2 micro-batches through `get_forward_backward_func()`:
four named requests of 17-32 tokens (prompt + response), two per micro-batch, padded
to [32, 2] (Megatron's [s, b] layout), the loss on the response tokens.  Each
micro-batch's row map (`input_ids`, `positions`, `row_request` with its `rids`) is
dumped beside patches/dump.yaml's activations, so a comparison pairs rows by
(request, position).

    --dtype fp32|bf16      bf16 as Megatron's training loop runs it: bf16 params and the
                           model wrapped in Float16Module (bf16=True on the config alone
                           fails with a dtype mismatch)
    --tp 1|2               tensor parallel size: one process per rank (gloo on CPU, nccl on
                           CUDA); each rank loads its shard of the full checkpoint; no
                           sequence parallelism (the local spec's norm refuses it), so each
                           MoELayer's own training flag is off (allow_tp_without_sp)
    --device cpu|cuda      cpu hides the GPUs from the workers (Megatron would put its
                           buffers there otherwise)
    --perturb L[:SCALE]    after loading, every expert's linear_fc2 weight of Megatron layer
                           L (1-based, as the dumps' `layer` tag) times (1 + SCALE), default
                           SCALE 1e-2: a divergence the comparison must place at layer L
    --megatron-version V   fail unless megatron-core V is the one imported (the version is
                           printed and recorded in <run>/run.json either way)

The workers run under SOURCE_PATCH=megatron_cpu,dump (added to what SOURCE_PATCH holds),
dumping into --out/<--name> (default <dtype>-tp<N>-<device>[-perturb<L>]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve()
SPECS = ("megatron_cpu", "dump")
# (request id, prompt tokens, response tokens): two requests per micro-batch
REQUESTS = (("r0", 10, 14), ("r1", 6, 11), ("r2", 16, 16), ("r3", 8, 12))
MICRO_BATCHES = 2
SEQ_LEN = 32
# The checkpoint --make-checkpoint writes: a Qwen3-MoE as small as the tests need, with
# more layers than tiny_checkpoint()'s two so that a divergence can grow over them.
SMALL_QWEN3_MOE = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, torch_dtype="float32",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="a Hugging Face Qwen3-MoE checkpoint (config.json + safetensors); 'tiny': tiny_checkpoint()")
    p.add_argument("--make-checkpoint", action="store_true",
                   help="write a small random Qwen3-MoE at --checkpoint first, unless one is there")
    p.add_argument("--layers", type=int, default=SMALL_QWEN3_MOE["num_hidden_layers"],
                   help="layers of the checkpoint --make-checkpoint writes")
    p.add_argument("--out", required=True, help="the dump root: this run's dumps go to OUT/NAME")
    p.add_argument("--name", help="the run's name (default <dtype>-tp<N>-<device>[-perturb<L>])")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--tp", type=int, choices=(1, 2), default=1, help="tensor-parallel size (processes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--perturb", metavar="LAYER[:SCALE]", type=perturbation,
                   help="scale layer LAYER's expert linear_fc2 weights by 1 + SCALE (default 1e-2) after loading")
    p.add_argument("--megatron-version", metavar="V", help="fail unless megatron-core V is imported")
    p.add_argument("--seed", type=int, default=1234, help="the requests' token ids")
    p.add_argument("--timeout", type=float, default=600, help="seconds the workers may take")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON of a worker's rank and settings
    args = p.parse_args(argv)
    if args.name is None:
        args.name = f"{args.dtype}-tp{args.tp}-{args.device}" + (f"-perturb{args.perturb[0]}" if args.perturb else "")
    if not args.name or "/" in args.name or args.name.startswith("."):
        p.error(f"--name {args.name!r}: a plain folder name")
    return args


def perturbation(text: str) -> tuple:
    layer, _, scale = text.partition(":")
    try:
        parsed = (int(layer), float(scale) if scale else 1e-2)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER or LAYER:SCALE (e.g. 3 or 3:1e-2)") from None
    if parsed[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: layers are numbered from 1 (Megatron's layer_number)")
    return parsed


# --------------------------------------------------------------------------- the launcher


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args, json.loads(args.worker))
    checkpoint = resolve_checkpoint(args)
    run = Path(args.out) / args.name
    if run.exists():
        sys.exit(f"error: {run} exists: remove it or pick another --name")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    active = [s for s in env.get("SOURCE_PATCH", "").split(",") if s]
    env["SOURCE_PATCH"] = ",".join(active + [s for s in SPECS if s not in active])
    env.update(SOURCE_PATCH_DUMP_DIR=str(Path(args.out).resolve()), SOURCE_PATCH_DUMP_EXP_NAME=args.name,
               SOURCE_PATCH_DUMP_ENABLE="1", PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # else Megatron-Core keeps its buffers on a visible GPU
    with tempfile.TemporaryDirectory(prefix="verdict-runs-") as tmp:
        store = Path(tmp) / "store"
        workers = []
        for rank in range(args.tp):
            spec = json.dumps({"rank": rank, "world": args.tp, "store": str(store), "checkpoint": str(checkpoint)})
            cmd = [sys.executable, str(HERE), *(sys.argv[1:] if argv is None else argv), "--worker", spec]
            workers.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout
        codes = []
        for w in workers:
            try:
                codes.append(w.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other in workers:
                    other.kill()
                sys.exit(f"error: the workers took more than {args.timeout:g} s")
    if any(codes):
        sys.exit(f"error: worker exit codes {codes}")
    print(f"compare with a reference run: source-patch compare {args.out} {args.out} --exp-name {args.name} "
          f"--exp-name REFERENCE_RUN")
    return 0


def resolve_checkpoint(args) -> Path:
    if args.checkpoint == "tiny":
        sys.path.insert(0, str(HERE.parent.parent.parent))  # a checkout named source_patch
        from source_patch.testing.sglang import tiny_checkpoint

        return tiny_checkpoint()
    checkpoint = Path(args.checkpoint)
    if args.make_checkpoint and not (checkpoint / "config.json").is_file():
        write_checkpoint(checkpoint, layers=args.layers)
        print(f"wrote a random Qwen3-MoE checkpoint ({args.layers} layers) to {checkpoint}")
    if not (checkpoint / "config.json").is_file():
        sys.exit(f"error: {checkpoint}: no config.json (--make-checkpoint writes a small random one)")
    return checkpoint.resolve()


def write_checkpoint(folder: Path, *, layers: int = 4, seed: int = 0) -> None:
    """A random Qwen3-MoE in Hugging Face's names, without transformers: every tensor the
    twin loads, linear weights N(0, 1/fan_in) (a signal of unit scale through every layer),
    embeddings N(0, 1), norms one.  Written to a temporary folder, then renamed."""
    import torch
    from safetensors.torch import save_file

    from source_patch.runtime.verdict.replay import _twin_tensors

    config = {**SMALL_QWEN3_MOE, "num_hidden_layers": layers}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _twin_tensors(config):
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            tensors[name] = torch.randn(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process wrote it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise


# --------------------------------------------------------------------------- a worker (one rank)


def worker(args, spec: dict) -> int:
    import torch

    for message in (".*Transformer Engine and Apex are not installed", "Apex is not installed",
                    "full scope is deprecated", "`torch.distributed.(all_gather|reduce_scatter)",
                    "When using async grad allreduce"):
        warnings.filterwarnings("ignore", message=message)
    import megatron.core
    from importlib import metadata

    version = metadata.version("megatron-core")
    if args.megatron_version and version != args.megatron_version:
        sys.exit(f"error: megatron-core {version} imported ({megatron.core.__file__}), "
                 f"--megatron-version asks for {args.megatron_version}")
    from megatron.core import parallel_state

    from source_patch.runtime.dump import api as dumper

    rank, world = spec["rank"], spec["world"]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does; the model is tiny
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         store=torch.distributed.FileStore(spec["store"], world),
                                         rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    if not dumper.state()["enabled"]:
        sys.exit("error: dumping is off: the dump spec did not start (is source-patch's start hook installed?)")

    checkpoint = Path(spec["checkpoint"])
    model, hf = build(checkpoint, args, device)
    batches = make_batches(hf["vocab_size"], args.seed, device)
    losses = train_step(model, batches)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    dumper.flush()
    torch.distributed.barrier()
    state = dumper.state()
    if rank == 0:
        run = Path(state["exp_dir"])
        info = {"run": args.name, "checkpoint": str(checkpoint), "dtype": args.dtype, "tp": args.tp,
                "device": device_name(device), "perturb": args.perturb and list(args.perturb),
                "megatron-core": version, "megatron path": str(Path(megatron.core.__file__).parent),
                "torch": torch.__version__, "requests": [f"{r}: {p}+{n}" for r, p, n in REQUESTS],
                "micro-batches": MICRO_BATCHES, "layout": f"[{SEQ_LEN}, {len(REQUESTS) // MICRO_BATCHES}] padded",
                "row map": "source_patch.batch" if row_map_writer() else "dumped by examples/verdict_runs.py",
                "losses": losses, "grads finite": finite, "written": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        (run / "run.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"{args.name}: megatron-core {version}, torch {torch.__version__}, {device_name(device)}, "
              f"{args.dtype}, tp {args.tp}"
              + (f", layer {args.perturb[0]} experts' linear_fc2 x (1 + {args.perturb[1]:g})" if args.perturb else ""))
        print(f"  {len(REQUESTS)} requests ({', '.join(f'{r}: {p}+{n}' for r, p, n in REQUESTS)} tokens) "
              f"in {MICRO_BATCHES} micro-batches of [{SEQ_LEN}, {len(REQUESTS) // MICRO_BATCHES}]; "
              f"forward+backward through get_forward_backward_func()")
        print(f"  loss per micro-batch {' '.join(f'{x:.6f}' for x in losses)}; gradients finite: {finite}")
        counters = state["counters"]
        print(f"  dumps: {run} ({counters['records']} records, "
              f"{counters['errors']} errors, {counters['dropped']} dropped)")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0 if finite else 1


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def build(checkpoint: Path, args, device):
    """The twin in this run's dtype and tensor-parallel shard, loaded, perturbed, wrapped."""
    import torch

    from source_patch.runtime.verdict import twin

    hf = twin.hf_config(checkpoint)
    bf16 = args.dtype == "bf16"
    # (initialised before loading: that is where Megatron marks each parameter's tensor-parallel split)
    model = twin.build(checkpoint, load=False, tensor_model_parallel_size=args.tp,
                       bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    if args.tp == 1:
        twin.load_checkpoint(model, checkpoint)
    else:
        load_shards(model, checkpoint)
    if args.perturb:
        perturb(model, *args.perturb)
    model.to(device).train()
    if args.tp > 1:
        allow_tp_without_sp(model)
    if bf16:  # what Megatron's training loop does (megatron.training.training.get_model)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model, hf


def load_shards(model, checkpoint: Path) -> None:
    """Each parameter's tensor-parallel shard of the full checkpoint tensor: split along its
    ``partition_dim`` in rank order (experts over the expert-tensor-parallel group), a gated
    ``linear_fc1`` as Megatron keeps it per rank, ``[gate_r; up_r]``."""
    import torch
    from megatron.core import parallel_state
    from safetensors.torch import load_file

    from source_patch.runtime.weight_sync.names import Layout, from_hf

    hf = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        hf.update(load_file(path))
    layout = Layout.from_config(model.config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not getattr(param, "tensor_model_parallel", False):
                param.copy_(from_hf(name, tuple(param.shape), hf, layout))
                continue
            if ".experts." in name:
                size = parallel_state.get_expert_tensor_parallel_world_size()
                rank = parallel_state.get_expert_tensor_parallel_rank()
            else:
                size = parallel_state.get_tensor_model_parallel_world_size()
                rank = parallel_state.get_tensor_model_parallel_rank()
            dim = param.partition_dim
            shape = list(param.shape)
            shape[dim] *= size
            full = from_hf(name, tuple(shape), hf, layout)
            if model.config.gated_linear_unit and name.endswith("linear_fc1.weight"):
                gate, up = full.chunk(2, dim=dim)
                shard = torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
            else:
                shard = full.chunk(size, dim=dim)[rank]
            param.copy_(shard)


def allow_tp_without_sp(model) -> None:
    """Megatron-Core's MoELayer refuses tensor parallelism without sequence parallelism in
    training mode (a performance guard: "performance may degrade"), and its local,
    Transformer-Engine-free spec refuses sequence parallelism (WrappedTorchNorm: "sequence
    parallel not supported by torch LayerNorm").  So, here on CPU, each MoELayer module
    alone (not its router or experts) is marked not training: in 0.16.1 MoELayer reads its
    own ``training`` flag for that guard only."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.training = False


def perturb(model, layer: int, scale: float) -> None:
    """Every expert's linear_fc2 (down projection) weight of Megatron layer ``layer`` times 1 + scale."""
    import torch

    if not 1 <= layer <= len(model.decoder.layers):
        sys.exit(f"error: --perturb {layer}: the model has layers 1..{len(model.decoder.layers)}")
    mlp = model.decoder.layers[layer - 1].mlp
    found = [p for n, p in mlp.named_parameters() if n.endswith("linear_fc2.weight")]
    with torch.no_grad():
        for p in found:
            p.mul_(1 + scale)


# --------------------------------------------------------------------------- data and the step


def make_batches(vocab: int, seed: int, device) -> list:
    """The requests' token ids (fixed by ``seed``), two per micro-batch, right-padded to
    SEQ_LEN; labels the next token, the loss on the response's tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per = len(REQUESTS) // MICRO_BATCHES
    batches = []
    for m in range(MICRO_BATCHES):
        mine = REQUESTS[m * per:(m + 1) * per]
        tokens = torch.zeros(per, SEQ_LEN + 1, dtype=torch.long)
        mask = torch.zeros(per, SEQ_LEN)
        rows = torch.full((per, SEQ_LEN), -1, dtype=torch.int32)
        for i, (_, prompt, response) in enumerate(mine):
            n = prompt + response
            tokens[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
            mask[i, prompt - 1:n - 1] = 1.0  # predicting each response token
            rows[i, :n] = i
        positions = torch.arange(SEQ_LEN).expand(per, SEQ_LEN).contiguous()
        batches.append({"tokens": tokens[:, :-1].contiguous().to(device), "labels": tokens[:, 1:].contiguous().to(device),
                        "position_ids": positions.to(device), "loss_mask": mask.to(device),
                        "row_request": rows, "rids": [r for r, _, _ in mine],
                        "prompt_lengths": [p for _, p, _ in mine], "response_lengths": [n for _, _, n in mine]})
    return batches


def dump_rows(batch: dict) -> None:
    """This micro-batch's row map in Megatron's [s, b] layout (-1: padding), so that a
    comparison pairs every row by (request, position).  (Every TP rank holds the whole
    sequence: no sequence parallelism here, see allow_tp_without_sp.)"""
    from source_patch.runtime.dump import api as dumper

    dumper.dump("input_ids", batch["tokens"].T.contiguous())
    dumper.dump("positions", batch["position_ids"].T.contiguous())
    dumper.dump("row_request", batch["row_request"].T.contiguous(), rids=batch["rids"])


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach()}


def row_map_writer():
    """``source_patch.batch`` (core/rows.py: the dump writes the row map itself) where this
    source-patch has it, else :func:`dump_rows`."""
    try:
        import source_patch

        return source_patch.batch
    except (ImportError, AttributeError):
        return None


def name_rows(batch: dict) -> None:
    """Inside the schedule's forward_step: the micro-batch's own ``microbatch`` tag."""
    writer = row_map_writer()
    if writer is None:
        dump_rows(batch)
    else:
        writer(batch["rids"], batch["prompt_lengths"], batch["response_lengths"], layout="padded", seq_len=SEQ_LEN,
               input_ids=batch["tokens"])


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    name_rows(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(model, batches) -> list:
    """One step's forward and backward over the micro-batches, Megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=SEQ_LEN, micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=False)
    return [float(x["lm loss"]) for x in out]


if __name__ == "__main__":
    sys.exit(main())
