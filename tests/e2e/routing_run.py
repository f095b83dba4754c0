"""Train examples/train_moe.py's model under patches/routing.yaml, one scenario after another.

    SOURCE_PATCH=megatron_cpu,routing python tests/e2e/routing_run.py OUT_PREFIX SCENARIO...

A scenario is ``off``, ``capture:DIR`` or ``replay:DIR``.  Each scenario builds the
model afresh (same seed), resets the routing runtime, configures its mode and
trains ``--steps`` steps.  Saved to ``OUT_PREFIX.safetensors``: per scenario ``i``
the losses (``<i>/loss/<step>``) and, through a plain forward hook on every router
(no source patch), the routed expert ids of each (step, microbatch, layer), sorted
per token (``<i>/route/<step>/<microbatch>/<layer>``).  ``OUT_PREFIX.json``: per
scenario ``{"ok": true}`` or ``{"error": type, "message": ...}``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from example import counting_forward_step, forward_backward, start_cpu, train_moe  # tests/e2e/example.py


from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing  # noqa: E402
from source_patch.runtime.routing.megatron.files import RoutingReplayError  # noqa: E402
from source_patch.runtime.routing.megatron.replay import _replay  # noqa: E402


def run(args, out, prefix, device):
    torch.manual_seed(args.seed)
    model = train_moe.build_model(args, device)
    optimizer = train_moe.build_optimizer(model, args)
    dataset = train_moe.make_dataset(args, device)
    pos = {"step": 0, "mb": 0}

    def hook(router):
        def fn(module, inputs, output):
            routing_map = output[1]
            ids = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
            out[f"{prefix}/route/{pos['step']}/{pos['mb']}/{router.layer_number}"] = ids.clone()
        return fn

    for module in model.module.modules():
        if type(module).__name__ == "TopKRouter":
            module.register_forward_hook(hook(module))

    def next_microbatch():
        pos["mb"] += 1

    forward_step = counting_forward_step(next_microbatch)

    for step in range(args.steps):
        pos["step"], pos["mb"] = step, 0
        losses = forward_backward(model, optimizer, dataset, args, step, forward_step)
        out[f"{prefix}/loss/{step}"] = torch.stack([x["lm loss"] for x in losses]).detach().clone()
        success, _, _ = optimizer.step()
        assert success


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    cli = p.parse_args()
    args = start_cpu(["--steps", str(cli.steps), "--micro-batches", str(cli.micro_batches),
                      "--layers", "2", "--seq-len", "16", "--micro-batch", "4"])
    device = torch.device("cpu")
    out, status = {}, []
    for i, scenario in enumerate(cli.scenarios):
        mode, _, folder = scenario.partition(":")
        routing.reset()
        routing.configure(mode="off")
        _replay.clear()
        try:
            routing.configure(mode=mode, dir=folder)
            run(args, out, str(i), device)
            if mode == "capture" and folder:
                routing_capture.flush()
                routing.save()
            status.append({"ok": True})
        except RoutingReplayError as exc:
            status.append({"error": type(exc).__name__, "message": str(exc)})
        finally:
            routing.configure(mode="off")
    save_file({k: v.contiguous() for k, v in out.items()}, cli.out + ".safetensors")
    Path(cli.out + ".json").write_text(json.dumps(status, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
