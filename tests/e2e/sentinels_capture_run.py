"""A mismatch capture end to end, on CPU: a real SGLang engine rolls out, the Megatron-Core
twin of its checkpoint computes the same tokens' log-probs, and at one step one layer of
the twin is perturbed.  The mismatch watch triggers there only; the dump captures the
triggered samples in that step's fwd_bwd pass; the engine prefills them with dumps on
(POST /dumper/prefill); the verdict lands in the run folder with no one in the loop.

    python tests/e2e/sentinels_capture_run.py --out DIR [--steps 3] [--perturb-step 1 ...] [--fetch-from STEP]
        [--perturb-layer 1] [--threshold 0.05] [--max-triggers 2]

The last line of stdout is JSON: per step the samples' figures, the run folder, the
sentinels' counters, the seconds each part took.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # rl_common

from source_patch.patcher import activate  # noqa: E402


@contextlib.contextmanager
def perturbed(model, layer: int, scale: float):
    """The attention output projection of decoder layer ``layer`` (0-based) += noise."""
    import torch

    weight = model.decoder.layers[layer].self_attention.linear_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(scale * saved.std() * torch.randn(saved.shape, generator=torch.Generator().manual_seed(1)))
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--perturb-step", type=int, action="append", help="a step whose weights are perturbed "
                   "(repeat it for several; default 1)")
    p.add_argument("--fetch-from", type=int, default=None, help="from this step on, engine_files=fetch: the "
                   "engine dumps into its own folder and the trainer copies its files over HTTP")
    p.add_argument("--perturb-layer", type=int, default=1)
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--max-triggers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=6)
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.perturb_step = args.perturb_step or [1]
    times = {}
    t0 = time.monotonic()
    os.environ.update({"SOURCE_PATCH_DUMP_ENABLE": "0", "SOURCE_PATCH_DUMP_DIR": str(out / "trainer-dumps")})
    activate(["megatron_cpu", "dump"])  # before Megatron is imported: its dump call sites, dumping off

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from rl_common import SGLangServer, batch_ids, build_trainer, rollout, tiny_checkpoint, twin_logps

    import source_patch
    from source_patch.runtime.verdict.logprobs import rollout_logprobs

    checkpoint = tiny_checkpoint()
    env = {"SOURCE_PATCH_DUMP_DIR": str(out / "engine-dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "serve",
           "SOURCE_PATCH_DUMP_ENABLE": "0", "DUMPER_SERVER_PORT": "reuse"}  # dumps off until a prefill asks
    with SGLangServer(checkpoint, specs=["dump"], env=env, workdir=out / "engine",
                      args=["--skip-server-warmup"]) as server:  # radix cache on: the prefill flushes it
        times["engine_start_s"] = time.monotonic() - t0
        os.environ.update({"SOURCE_PATCH_SENTINELS_MISMATCH": "1",
                           "SOURCE_PATCH_SENTINELS_THRESHOLD": str(args.threshold),
                           "SOURCE_PATCH_SENTINELS_MAX_TRIGGERS": str(args.max_triggers),
                           "SOURCE_PATCH_SENTINELS_DIR": str(out / "sp-sentinels"),
                           "SOURCE_PATCH_SENTINELS_ENGINES": server.url})
        from source_patch.runtime.dump import api as dump
        from source_patch.runtime.sentinels import mismatch

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model, ddp, optimizer, routes = build_trainer(checkpoint)
        steps = []
        t1 = time.monotonic()
        for step in range(args.steps):
            samples = rollout(server, args.new_tokens)
            engine = [rollout_logprobs(s["logps"]) for s in samples]
            if step == args.fetch_from:
                from source_patch.runtime.sentinels import control as sentinels

                sentinels.configure(engine_files="fetch")
            here = perturbed(model, args.perturb_layer, args.scale) if step in args.perturb_step \
                else contextlib.nullcontext()
            with here:
                # fwd_only: the old log-probs of the samples, one right-padded micro-batch; the watch sees them
                name_rows(source_patch, samples, "fwd_only", batch_ids)
                with torch.no_grad():
                    train = twin_logps(model, samples)
                figures = source_patch.watch_logprobs([s["rid"] for s in samples], train, engine, step=step)
                # fwd_bwd: the same micro-batch with the graph for backward; the capture dumps here
                name_rows(source_patch, samples, "fwd_bwd", batch_ids)
                with torch.enable_grad():
                    sum(lp.sum() for lp in twin_logps(model, samples)).backward()
            model.zero_grad(set_to_none=True)
            dump.dump_step(step=step + 1)  # what the patched optimizer step does: the step's rows are done
            steps.append({"step": step, "perturbed": step in args.perturb_step,
                          "samples": [{"rid": s["rid"], "prompt": s["prompt"], "output": s["output"],
                                       **{k: f[k] for k in ("max_abs_diff", "triggered")}}
                                      for s, f in zip(samples, figures)]})
            # the step's end (the optimizer's sentinels_step), then its capture waited for: the
            # next rollout's requests would otherwise share the engine's batches with the prefill
            # (the engine dumps whole passes: their rows would be in the capture too)
            mismatch.step_end(step)
            mismatch.drain(300)
        times["steps_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        drained = mismatch.drain(300)
        times["verdict_wait_s"] = time.monotonic() - t2
        from source_patch.runtime.sentinels import control

        state = control.state()
    print(json.dumps({"steps": steps, "run": str(out / "sp-sentinels"), "drained": drained,
                      "counters": state["counters"], "last_error": state["last_error"], "times": times,
                      "threshold": args.threshold}, default=str), flush=True)
    os._exit(0)


def name_rows(source_patch, samples, phase, batch_ids):
    """source_patch.batch for the ``[batch, seq_len]`` right-padded micro-batch of ``samples``."""
    seq_len = max(len(s["prompt"]) + len(s["output"]) for s in samples)
    source_patch.batch([s["rid"] for s in samples], [len(s["prompt"]) for s in samples],
                       [len(s["output"]) for s in samples], seq_len=seq_len, input_ids=batch_ids(samples, seq_len),
                       phase=phase)


if __name__ == "__main__":
    main()
