"""A miniature RL loop on CPU: SGLang rolls out, Megatron-Core trains, weights flow back.

    python examples/rl_loop.py [--iterations 3] [--out sp-rl]

Each iteration:
1. a real SGLang server (tiny Qwen3-MoE on CPU, ``SOURCE_PATCH=routing,dump,weight_sync``)
   rolls out a few prompts, returning each token's log-prob and the weight version it
   served;
2. the Megatron-Core twin of the same checkpoint (this process, under
   ``megatron_cpu,weight_sync``) computes its log-probs of the same tokens: the
   train-inference mismatch is printed (|dlogp|, k3 KL, TIS), and its routers' expert
   choices against the routes the engine captured (``routing``) per layer; then again
   with routing replay: the twin routes every token as the engine did (the engine's
   records aligned to the twin's batch): expert ids replayed and weights recomputed,
   then ids and the engine's own combine weights replayed;
3. the twin takes one training step on the rollout (a REINFORCE-style loss: the
   generated tokens' log-probs weighted by a toy reward) with the rollout's routes
   replayed (ids; weights recomputed, so the routers still learn), and the patched
   ``optimizer.step()`` pushes the new weights to the engine through weight sync;
   the engine loads them inside its own begin/update/end weight-update requests;
4. the next rollout carries the new ``weight_version``: 1, 2, 3.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path

from rl_common import (GROUP, SGLangServer, agreement, agreement_line, build_trainer, join_update,
                       reinforce_backward, replayed_logps, rollout, tiny_checkpoint, twin_logps)

from source_patch.patcher import activate
from source_patch.runtime.core.commands import command
from source_patch.runtime.core.endpoint import free_port


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--out", default="sp-rl")
    p.add_argument("--router-noise", type=float, default=0.0,
                   help="also measure with the twin's router weights perturbed by this much (relative): a "
                        "simulated train-inference mismatch that routing replay must remove")
    return p.parse_args(argv)


def engine_routes(folder: Path, rid: str, timeout: float = 30.0):
    """The routing record the engine wrote for a request (at its release)."""
    from source_patch.runtime.routing.records.record import load

    path = folder / "rank0" / f"{rid}.safetensors"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no routing record for request {rid} in {folder}")
        time.sleep(0.1)
    return load(path)


def push(server, port: int, first: bool) -> threading.Thread:
    """The engine joins the update in a thread while this process pushes."""
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": "gloo"} if first else None
    thread = threading.Thread(target=join_update, args=(server, body))
    thread.start()
    return thread


def measure(model, samples, records, routes: dict):
    """The twin's log-probs without replay, with the engine's ids, with its ids and
    weights (no grad), and per-layer routing agreement with the engine."""
    import torch

    plain, ids, both, agree = [], [], [], {}
    for s, record in zip(samples, records):
        with torch.no_grad():
            plain += twin_logps(model, [s])
        for layer, (same, n) in agreement([record], routes).items():  # the routes of that forward
            agree[layer] = [a + b for a, b in zip(agree.get(layer, [0, 0]), (same, n))]
        ids += replayed_logps(model, [s], [record])
        both += replayed_logps(model, [s], [record], weights=True)
    return torch.cat(plain), torch.cat(ids), torch.cat(both), agree


def report(engine, measured, prefix: str = "") -> None:
    from source_patch.runtime.verdict.logprobs import mismatch

    plain, ids, both, agree = measured
    print(f"  {prefix}mismatch:            {mismatch(engine, plain).line()}", flush=True)
    print(f"  {prefix}replay ids:          {mismatch(engine, ids).line()}", flush=True)
    print(f"  {prefix}replay ids+weights:  {mismatch(engine, both).line()}", flush=True)
    print(f"  {prefix}routing agreement per layer: {agreement_line(agree)}", flush=True)


@contextlib.contextmanager
def perturbed_routers(model, scale: float, seed: int):
    """Router weights += scale * std * noise for the block (then restored)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    generator = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TopKRouter):
                saved.append((m.weight, m.weight.detach().clone()))
                m.weight.add_(scale * m.weight.std() * torch.randn(m.weight.shape, generator=generator))
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)


def main(argv=None) -> None:
    args = parse_args(argv)
    run = Path(args.out).resolve() / time.strftime("rl-%Y%m%d-%H%M%S")
    run.mkdir(parents=True)
    port = free_port()
    os.environ.update({"SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1", "SOURCE_PATCH_WEIGHT_SYNC_PORT": str(port),
                       "SOURCE_PATCH_WEIGHT_SYNC_WORLD_SIZE": "2", "SOURCE_PATCH_WEIGHT_SYNC_BACKEND": "gloo"})
    activate(["megatron_cpu", "weight_sync", "routing"])  # before Megatron is imported
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from source_patch.runtime.verdict.logprobs import rollout_logprobs

    checkpoint = tiny_checkpoint()
    print("starting SGLang (sglang_cpu, routing, dump, weight_sync) ...", flush=True)
    env = {"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(run / "routes"),
           "SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "120",
           "SOURCE_PATCH_DUMP_EXP_NAME": "startup",  # the harness's readiness probes
           "DUMPER_SERVER_PORT": "reuse"}  # /dumper/configure: each rollout dumps into a run of its own
    with SGLangServer(checkpoint, specs=["routing", "dump", "weight_sync"], env=env, workdir=run,
                      args=["--disable-radix-cache", "--skip-server-warmup"]) as server:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model, ddp, optimizer, routes = build_trainer(checkpoint)
        for iteration in range(1, args.iterations + 1):
            server.post("/dumper/configure", {"exp_name": f"iteration-{iteration}"})
            samples = rollout(server, args.new_tokens)
            versions = sorted({str(s["version"]) for s in samples})
            engine = torch.cat([rollout_logprobs(s["logps"]) for s in samples])
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            records = [engine_routes(run / "routes", s["rid"]) for s in samples]  # read once
            measured = measure(ddp, samples, records, routes)
            if args.router_noise:
                with perturbed_routers(model, args.router_noise, seed=iteration):
                    noisy = measure(ddp, samples, records, routes)
            # The training step routes every token as the rollout did (rollout routing
            # replay: expert ids replayed, weights recomputed so the router gets gradients).
            train = [replayed_logps(ddp, [s], [record], grad=True)[0] for s, record in zip(samples, records)]
            baseline = reinforce_backward(ddp, samples, train)
            print(f"iteration {iteration}: engine served weight version {', '.join(versions)}; "
                  f"mean reward {baseline:.3f}", flush=True)
            report(engine, measured)
            if args.router_noise:
                report(engine, noisy, prefix=f"router noise {args.router_noise:g}, ")
            receiver = push(server, port, first=iteration == 1)
            success, grad_norm, _ = optimizer.step()  # patched: pushes the new weights
            receiver.join(300)
            print(f"  step: success {success}, grad norm {float(grad_norm):.3f}; weights pushed", flush=True)
        server.post("/dumper/configure", {"exp_name": "final"})
        final = rollout(server, args.new_tokens)
        print(f"after {args.iterations} updates the engine serves weight version "
              f"{', '.join(sorted({str(s['version']) for s in final}))}", flush=True)
    print(f"dumps: {run / 'dumps'} (a run per rollout: iteration-1 ... iteration-{args.iterations}, final), "
          f"routes: {run / 'routes'}")
    print("the first rollout was served from the checkpoint; replay it through the twin and compare:")
    replay = command("replay", run / "dumps" / "iteration-1", "--checkpoint", checkpoint, "--routes", run / "routes",
                     "--out", run / "replay", "--html", run / "report.html")
    print(f"  {replay}", flush=True)
    os._exit(0)  # the update group's peer is gone; do not wait in its teardown


if __name__ == "__main__":
    sys.exit(main())
