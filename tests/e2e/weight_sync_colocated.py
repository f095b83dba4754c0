"""The colocated layout, as RL frameworks run it: a Megatron trainer spread over two
devices (TP 2, or EP 2) and an engine receiver next to each trainer rank, fed by the
``ipc`` backend (CUDA IPC on GPUs, shared memory on CPU).

    trainer: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
             python tests/e2e/weight_sync_colocated.py trainer OUT --tp 2|--ep 2 [--cuda]
    engine:  python tests/e2e/weight_sync_colocated.py engine OUT DEVICE    (one per device)

The trainer ranks gather the model's shards for real (NCCL on GPUs, gloo on CPU) in
``sync.push``; rank 0 packs the update into its exported memory.  Where SGLang's
request would go, the request's bytes are handed to the engine receivers through a
file (SGLang cannot run on the GPU machines): each maps the export on its device,
copies, verifies every bucket's sum, and compares every tensor bitwise with
OUT.reference.safetensors (rank 0's gathered, mapped weights, written before the push).
The model lies in Megatron's DDP buffers, so push() gathers windows of them by its
program; updates 5 and 6 go nowhere (the program is planned, then its copies
captured on a GPU), then every parameter changes in place and update 7 is checked.
Each engine writes OUT.engine<DEVICE>.json: {"version", "tensors", "mismatched"}.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import weight_sync_models as models  # tests/e2e/


def trainer(out: str, tp: int, ep: int, cuda: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(rank)
        import megatron.core.transformer.moe.moe_utils as moe_utils  # no Transformer Engine there
        moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    from source_patch.runtime.weight_sync import megatron as weight_megatron
    from source_patch.runtime.weight_sync import names as weight_names
    from source_patch.runtime.weight_sync import request
    from source_patch.runtime.weight_sync import sync as weight_sync

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    model = models.megatron_model("llama" if tp > 1 else "qwen3_moe", ep=ep)
    if cuda:
        model.cuda()
    # In Megatron's buffers, as a trainer holds them: push() gathers windows of them, by
    # its program (runtime/weight_sync/program.py).
    model = DistributedDataParallel(config=model.config, module=model,
                                    ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))
    weight_sync.configure(backend="ipc", engines=["file"], bucket_bytes=64 << 10, timeout_s=120)
    if rank == 0:
        request.post_update = lambda *_: None  # updates 5 and 6 reach no engine
    for version in (5, 6):  # the program planned, its copies run once, then (GPU) captured as graphs
        weight_sync.push([model], version=version)
    with torch.no_grad():  # new values in place: update 7 (replayed graphs on a GPU) must read them
        for param in model.parameters():
            param.add_(1)
    params = weight_megatron.MegatronParams([model])
    layout = weight_names.Layout.from_config(model.config)
    reference = {n: t.detach().cpu().contiguous() for name, full in params.tensors()
                 for n, t in weight_names.to_hf(name, full, layout)}  # a gather of its own
    if rank == 0:
        save_file(reference, f"{out}.reference.safetensors")
        request.post_update = deliver(out)  # the engine request, through a file
    weight_sync.push([model], version=7)
    state = weight_sync.state()
    if rank == 0:
        Path(f"{out}.trainer.json").write_text(json.dumps({"counters": state["counters"],
                                                           "last_error": state["last_error"],
                                                           "planned": state["planned"]}))
    dist.barrier()
    weight_sync.close()


def deliver(out: str):
    """post_update for this test: hand the request's bytes to the engines, wait for
    each one's verdict, and fail as an engine's refusal would."""
    def post(url, payload, timeout_s):
        Path(f"{out}.request.tmp").write_bytes(payload)
        os.replace(f"{out}.request.tmp", f"{out}.request")
        deadline = time.monotonic() + timeout_s
        while not all(Path(f"{out}.engine{d}.json").exists() for d in range(2)):
            if time.monotonic() > deadline:
                raise TimeoutError("the engines did not answer")
            time.sleep(0.05)
    return post


def engine(out: str, device: str) -> None:
    from safetensors.torch import load_file

    from source_patch.runtime.weight_sync import backend

    index = int(device.split(":")[-1]) if ":" in device else int(device)
    device = torch.device("cuda", index) if torch.cuda.is_available() and device.startswith("cuda") \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    request = Path(f"{out}.request")
    deadline = time.monotonic() + 300
    while not request.exists():
        assert time.monotonic() < deadline, "no request came"
        time.sleep(0.05)
    result = {}
    try:
        update = backend.receive_request(request.read_bytes(), device=device, max_metadata_bytes=1 << 24,
                                         max_update_bytes=1 << 34)
        reference = load_file(f"{out}.reference.safetensors")
        got = {name: t.cpu() for name, t in update.tensors}
        result = {"version": update.version, "tensors": len(got), "names_match": sorted(got) == sorted(reference),
                  "mismatched": [n for n in reference if n not in got or not torch.equal(got[n], reference[n])],
                  "device": str(device)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(f"{out}.engine{index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    role, out = sys.argv[1], sys.argv[2]
    if role == "engine":
        engine(out, sys.argv[3])
    else:
        args = sys.argv[3:]
        tp = int(args[args.index("--tp") + 1]) if "--tp" in args else 1
        ep = int(args[args.index("--ep") + 1]) if "--ep" in args else 1
        trainer(out, tp, ep, "--cuda" in args)
    sys.stdout.flush()
    os._exit(0)
