"""Trainer side of the weight-sync end-to-end test: Megatron-Core trains a
Qwen3-MoE-style GPTModel (tests/e2e/weight_sync_models.py) on CPU, and the
patched optimizer.step() (patches/weight_sync.yaml) pushes each step's weights.

    SOURCE_PATCH=megatron_cpu,weight_sync[,weight_sync_distopt_cpu.yaml] \
    SOURCE_PATCH_WEIGHT_SYNC_ENABLE=1 SOURCE_PATCH_WEIGHT_SYNC_PORT=P ... \
    [RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=Q] \
        python tests/e2e/weight_sync_trainer.py OUT --steps 3 [--ep 2] [--distributed-optimizer]
        [--die-after V:K] [--tamper V:K] [--skip-param-gather] [--generate URL]

Megatron's own data, schedule, DDP and optimizer (examples/train_moe.py's pieces).
With --distributed-optimizer, DDP uses overlap_param_gather: after step() each
rank's parameters outside its shard are stale until the next forward's gathers.
Writes (after every step) OUT.rank<r>.safetensors: after step s, ``s/<name>`` for this rank's
parameters once Megatron's own param sync ran (the reference the engine must
match); OUT.rank<r>.json: weight_sync.state() after each step.
--skip-param-gather turns the runtime's forced gather off (a control: the engine
then gets stale weights).  --die-after V:K exits once bucket K of update V is sent; --tamper V:K sends a wrong
checksum for it (a bucket corrupted in transit, as the receiver sees it).
--generate URL: after each step rank 0 asks the SGLang server at URL to generate
(weight_sync_models.PROMPTS) and records its answer in OUT.rank0.json (the request
backends, where the trainer itself posts each update to the engine).
"""

import argparse
import json
import os
import sys
import time
import urllib.request

import torch
from safetensors.torch import save_file

import weight_sync_models as models  # tests/e2e/
from example import train_moe        # tests/e2e/: examples/train_moe.py as a module

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--die-after", help="V:K")
    p.add_argument("--tamper", help="V:K: send a wrong checksum for bucket K of update V")
    p.add_argument("--skip-param-gather", action="store_true")
    p.add_argument("--generate", help="URL of an SGLang server to generate from after each step (rank 0)")
    cli = p.parse_args()
    torch.set_num_threads(1)
    args = train_moe.parse_args(["--device", "cpu", "--vocab", str(models.VOCAB), "--seq-len", str(models.SEQ),
                                 "--micro-batch", "4", "--ep", str(cli.ep), "--lr", "1e-2"])
    device = torch.device("cpu")
    train_moe.init_distributed(device, cli.ep)
    rank = torch.distributed.get_rank()

    from source_patch.runtime.weight_sync import megatron as weight_megatron
    from source_patch.runtime.weight_sync import sync as weight_sync
    from source_patch.runtime.weight_sync import sender as weight_sender

    if cli.skip_param_gather:
        weight_megatron.finish_param_gather = lambda chunks: None
    if cli.die_after:
        version, bucket = (int(x) for x in cli.die_after.split(":"))

        def after_send(k, data):
            if weight_sync.state()["counters"]["step"] == version and k == bucket:
                os._exit(17)
        weight_sender.after_send = after_send
    if cli.tamper:  # as if bucket K of update V were corrupted in transit: its checksum no longer matches
        tampered = tuple(int(x) for x in cli.tamper.split(":"))

        def before_sum_send(k, checksum):
            if (weight_sync.state()["counters"]["step"], k) == tampered:
                checksum.add_(1)
        weight_sender.before_sum_send = before_sum_send

    torch.manual_seed(1234)
    model = models.megatron_model("qwen3_moe", ep=cli.ep)
    dist_opt = cli.distributed_optimizer
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, overlap_param_gather=dist_opt))
    optimizer = get_megatron_optimizer(   # patched: remembers optimizer -> [ddp]
        OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0, bf16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=dist_opt), [ddp])
    from megatron.core.distributed import finalize_model_grads
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.grad_scale_func = optimizer.scale_loss
    dataset = train_moe.make_dataset(args, device)

    saved, states = {}, []
    for step in range(cli.steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=train_moe.forward_step, data_iterator=iter([train_moe.make_batch(dataset, step, args)]),
            model=[ddp], num_microbatches=1, seq_length=args.seq_len, micro_batch_size=args.micro_batch,
            forward_only=False)
        start = time.monotonic()
        success, _, _ = optimizer.step()   # patched: pushes the new weights
        states.append({**weight_sync.state(), "step_seconds": round(time.monotonic() - start, 3)})
        if cli.generate and rank == 0:
            states[-1]["generated"] = generate(cli.generate)
        assert success
        if dist_opt:
            ddp.start_param_sync(force_sync=True)  # Megatron's own sync: the reference
        for name, param in model.named_parameters():
            saved[f"{step + 1}/{name}"] = param.detach().clone()
        save_file(saved, f"{cli.out}.rank{rank}.safetensors")  # after every step: a rank may die later
        with open(f"{cli.out}.rank{rank}.json", "w") as f:
            json.dump(states, f, indent=1)
    weight_sync.close()  # the ipc backend's shared memory goes
    sys.stdout.flush()
    os._exit(0)  # the update group's peers may be gone; do not wait in its teardown


def generate(url: str) -> list:
    body = {"input_ids": models.PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": models.NEW,
                                                             "ignore_eos": True}}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    main()
