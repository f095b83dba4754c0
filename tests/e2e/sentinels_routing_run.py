"""Train examples/train_moe.py's model with the sentinels' routing health on, one scenario
after another (tests/test_sentinels_routing.py).

    SOURCE_PATCH=megatron_cpu,routing python tests/e2e/sentinels_routing_run.py OUT SCENARIO...

A scenario (each builds the model afresh, same seed, and writes the run folder
``OUT/<i>-<name>``; routing health on, ``sentinels_step(step)`` called after each
optimizer step, as patches/sentinels.yaml's call site does):

    off               routing off: the router's own routes only
    capture           routing capture into ``OUT/capture``
    replay            routing replay of ``OUT/capture`` (the router's own routes)
    planted           routing replay of ``OUT/capture`` with a known fraction of tokens' expert
                      sets changed (layer 1: every 4th token, layer 2: 3 tokens of every 8)
    planted_last      the same with layer 2's tokens changed only (layer 1 as captured)
    router_replay     routing off, Megatron-Core's RouterReplay (moe_enable_routing_replay)
                      replaying the same planted routes (REPLAY_FORWARD, set before each
                      micro-batch's forward)

Saved: ``OUT/out.safetensors``: through a plain forward hook on every router (no source
patch), the router's logits of each (scenario, step, microbatch, layer)
(``<i>/logits/<step>/<mb>/<layer>``, recomputed from the router's input by its own
gating) and the routes it dispatched (``<i>/route/...``); ``OUT/status.json``: per
scenario ``{"ok": true, "dir": run folder}`` or ``{"error": ..., "message": ...}``.
"""

import argparse
import functools
import json
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from example import counting_forward_step, forward_backward, start_cpu, train_moe  # tests/e2e/example.py

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing  # noqa: E402
from source_patch.runtime.routing.megatron import files as routing_files, replay as routing_replay  # noqa: E402
from source_patch.runtime.sentinels import control as sentinels  # noqa: E402

PLANT = {1: lambda t: t % 4 == 0, 2: lambda t: t % 8 in (0, 1, 2)}  # layer -> tokens changed


def plant(records: dict, layers=(1, 2)) -> dict:
    """Each record with the expert set of PLANT's tokens changed (one id to an expert the
    token does not use), the rest as captured."""
    out = {}
    for key, rec in records.items():
        indices = {}
        for layer, ids in rec.indices.items():
            ids = ids.clone()
            for t in range(ids.shape[0]):
                if layer in layers and PLANT[layer](t):
                    used = set(ids[t].tolist())
                    ids[t, 0] = next(e for e in range(rec.num_experts) if e not in used)
            indices[layer] = ids
        out[key] = rec.replace(indices=indices)
    return out


def run(args, out, prefix, device, feed=None):
    torch.manual_seed(args.seed)
    RouterReplay.clear_global_router_replay_instances()
    model = train_moe.build_model(args, device)
    optimizer = train_moe.build_optimizer(model, args)
    dataset = train_moe.make_dataset(args, device)
    pos = {"step": 0, "mb": 0}

    def hook(router):
        def fn(module, inputs, output):
            at = f"{pos['step']}/{pos['mb']}/{router.layer_number}"
            with torch.no_grad():
                out[f"{prefix}/logits/{at}"] = module.gating(inputs[0]).reshape(-1, module.config.num_moe_experts)
            routing_map = output[1]
            out[f"{prefix}/route/{at}"] = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).clone()
        return fn

    for module in model.module.modules():
        if type(module).__name__ == "TopKRouter":
            module.register_forward_hook(hook(module))

    def next_microbatch():
        pos["mb"] += 1

    forward_step = counting_forward_step(next_microbatch)
    if feed is not None:  # Megatron-Core's RouterReplay: this micro-batch's target ids, every layer
        assert len(RouterReplay.global_router_replay_instances) == args.layers
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        counted = forward_step

        def forward_step(data_iterator, model):
            RouterReplay.clear_global_indices()
            record = feed[pos["step"], pos["mb"]]
            RouterReplay.set_replay_data([record.indices[layer] for layer in sorted(record.indices)])
            return counted(data_iterator, model)

    for step in range(args.steps):
        pos["step"], pos["mb"] = step, 0
        forward_backward(model, optimizer, dataset, args, step, forward_step)
        success, _, _ = optimizer.step()
        assert success
        sentinels.sentinels_step(step)  # patches/sentinels.yaml's call site, after the optimizer step


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
    root = Path(cli.out)
    root.mkdir(parents=True, exist_ok=True)
    capture_dir = root / "capture"
    config = train_moe.TransformerConfig
    out, status = {}, []
    for i, scenario in enumerate(cli.scenarios):
        run_dir = root / f"{i}-{scenario}"
        routing.reset()
        routing.configure(mode="off")
        routing_replay.clear()
        feed = None
        try:
            sentinels.reset()
            sentinels.configure(routing_health=True, dir=str(run_dir))
            if scenario == "capture":
                routing.configure(mode="capture", dir=str(capture_dir))
            elif scenario in ("replay", "planted", "planted_last"):
                routing.configure(mode="replay", dir="")
                records = routing_files.load_dir(capture_dir)
                if scenario != "replay":
                    records = plant(records, (1, 2) if scenario == "planted" else (2,))
                routing_replay.set_replay(records)
            elif scenario == "router_replay":
                feed = plant(routing_files.load_dir(capture_dir))
                train_moe.TransformerConfig = functools.partial(config, moe_enable_routing_replay=True)
                RouterReplay.clear_global_router_replay_instances()
            elif scenario != "off":
                raise ValueError(f"unknown scenario {scenario!r}")
            run(args, out, str(i), device, feed)
            if scenario == "capture":
                routing_capture.flush()
                routing.save()
            sentinels.flush()
            status.append({"ok": True, "dir": str(run_dir), "state": sentinels.state()["counters"]})
        except Exception as exc:
            traceback.print_exc()
            status.append({"error": type(exc).__name__, "message": str(exc)})
        finally:
            train_moe.TransformerConfig = config
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_router_replay_instances()
            sentinels.configure(routing_health=False)
            routing.configure(mode="off")
    save_file({k: v.contiguous() for k, v in out.items()}, str(root / "out.safetensors"))
    (root / "status.json").write_text(json.dumps(status, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
