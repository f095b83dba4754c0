"""Train a tiny GPT-MoE (examples/train_moe.py's, Megatron's real schedule and optimizer)
under the sentinels spec, with a NaN or an Inf planted where the test says.

    SOURCE_PATCH=megatron_cpu,dump,sentinels,tests/fixtures/plant_nan.yaml \\
        python tests/e2e/sentinels_run.py --steps 6 --plant-nan 2,1,2

--plant-nan STEP,MICROBATCH,LAYER   that layer's MoE output becomes NaN (plant() below,
                                    called by tests/fixtures/plant_nan.yaml's call site)
--plant-inf-grad STEP,PARAM         that parameter's main_grad gets an Inf before the step

The last line of stdout is JSON: the sentinels' state() and the seconds the steps took.
"""

import argparse
import json
import sys
import time

import torch

from example import counting_forward_step, forward_backward, start_cpu, train_moe  # tests/e2e/example.py


TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--experts", "4", "--topk", "2", "--vocab", "64",
        "--seq-len", "16", "--micro-batch", "4"]
now = {"step": 0, "microbatch": 0}
nan_at = None


def plant(out, layer):
    """tests/fixtures/plant_nan.yaml's call site: MoELayer.forward's (output, bias)."""
    if nan_at == (now["step"], now["microbatch"], layer):
        return (out[0] + float("nan"), *out[1:])
    return out


def main():
    global nan_at
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--plant-nan")
    p.add_argument("--plant-inf-grad")
    cli = p.parse_args()
    if cli.plant_nan:
        nan_at = tuple(int(v) for v in cli.plant_nan.split(","))
    inf_step, inf_param = cli.plant_inf_grad.split(",") if cli.plant_inf_grad else (None, None)
    args = start_cpu([*TINY, "--steps", str(cli.steps), "--micro-batches", str(cli.micro_batches)])
    torch.manual_seed(args.seed)
    model = train_moe.build_model(args, torch.device("cpu"))
    optimizer = train_moe.build_optimizer(model, args)
    dataset = train_moe.make_dataset(args, torch.device("cpu"))
    params = dict(model.module.named_parameters())

    def next_microbatch():
        now["microbatch"] += 1

    start = time.perf_counter()
    for step in range(args.steps):
        now.update(step=step, microbatch=0)
        forward_backward(model, optimizer, dataset, args, step, counting_forward_step(next_microbatch))
        if inf_step is not None and step == int(inf_step):
            params[inf_param].main_grad.view(-1)[0] = float("inf")
        optimizer.step()
    seconds = time.perf_counter() - start
    control = sys.modules.get("source_patch.runtime.sentinels.control")  # None: the spec not active
    state = None
    if control is not None:
        control.flush()
        state = control.state()
        control.close()
    print(json.dumps({"state": state, "seconds": seconds}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
