"""Where a variant's step cost goes: the host time of each call site, per step.

For each named variant of overhead_bench.py, one process of the training example
(overhead_probe.py with ``OVERHEAD_PROBE_CALLS=1``: every ``__sp__`` name wrapped by a
counter and a timer) prints its step times and, per call site, its calls and the host
microseconds spent in them per step, over the steps after --warmup (the first steps load
kernels and allocate: a one-time cost that would swamp a short run's averages).  On a GPU a call site's host time is what it costs
the launching thread (kernel launches, Python, and any wait on the device: a hidden
synchronisation shows up here as a call site far slower than its launches).  What it
does not see is device time; the swap bench (overhead_bench.py --swap) measures the
step.  Python's garbage collections over the same steps are listed as ``(gc generation
N)`` (collections a step, their time): a collection runs inside whichever call
allocated last, so a call site can look slow for the collector's sake.  A diagnostic,
not a cost figure: the timer itself adds ~0.1 us a call.

    python bench/call_profile.py --variants "plain;sentinels armed"          # GPU: the host-bound model
    python bench/call_profile.py --quick --variants "sentinels armed"        # CPU smoke run
    python bench/call_profile.py --torch-profile 10:3 ...    # and torch.profiler's table of steps 10-12
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import overhead_bench  # bench/
import training  # bench/

HERE = Path(__file__).resolve().parent


def profile(args, name: str, folder: str) -> tuple[list[float], dict]:
    """One process of ``name``: its step times (ms) and call sites {name: (calls, ns)}, with
    Python's garbage collections as ``(gc generation N)`` (they run inside the calls)."""
    env = overhead_bench.environment(name, folder, os.path.join(folder, "replay"), args.steps, port=0)
    env.update(OVERHEAD_PROBE_CALLS="1", OVERHEAD_PROBE_CALLS_FROM=str(args.warmup + 1), **({"OVERHEAD_PROBE_TORCH_PROFILE": args.torch_profile}
                                            if args.torch_profile else {}), PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])))
    size = ["--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--micro-batches", str(args.micro_batches), "--experts", str(args.experts), "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, str(HERE / "overhead_probe.py"), str(training.EXAMPLE), *size],
                         env=env, capture_output=True, text=True, timeout=900)
    report = next((line.split(": ", 1)[1] for line in out.stdout.splitlines()
                   if line.startswith("overhead-probe: {")), None)
    if out.returncode != 0 or report is None:
        raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    got = json.loads(report)
    calls = {k: (v["calls"], v["ns"]) for k, v in got.get("calls", {}).items()}
    # Python's collections over the same steps, shown as a pseudo call site per generation
    calls.update({f"(gc generation {gen})": (v["collections"], v["ns"]) for gen, v in got.get("gc", {}).items()
                  if v["collections"]})
    for line in out.stdout.splitlines():
        if line.startswith("overhead-profile: "):
            print("   " + line.split(": ", 1)[1])
    return [float(t) for t in training.STEP.findall(out.stdout)], calls


def main() -> None:
    p = training.parser(__doc__)
    p.add_argument("--variants", default="plain;sentinels armed", help="overhead_bench variant names, ';'-separated")
    p.add_argument("--torch-profile", metavar="FIRST:COUNT", help="also run steps FIRST.. (COUNT of them) under "
                   "torch.profiler and print its operators and runtime calls by their own host time per step")
    p.add_argument("--top", type=int, default=12, help="call sites listed per variant")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 8, 2
    names = [n.strip() for n in args.variants.split(";") if n.strip()]
    unknown = [n for n in names if n not in overhead_bench.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(overhead_bench.VARIANTS)}")
    training.header(args)
    steps = args.steps - args.warmup  # the calls are counted from the first timed step
    for name in names:
        with tempfile.TemporaryDirectory(prefix="sp-calls-") as folder:
            times, calls = profile(args, name, folder)
        timed = times[args.warmup:] or times
        print(f"{name}: step median {statistics.median(timed):.2f} ms (steps {args.warmup + 1}-{len(times)}), "
              f"call sites {sum(ns for site, (_, ns) in calls.items() if not site.startswith('(gc')) / steps / 1e3:.1f}"
              " us a step in all")
        for site, (n, ns) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"   {site:<28} {n / steps:8.1f} calls/step {ns / steps / 1e3:10.1f} us/step "
                  f"{ns / n / 1e3:9.2f} us/call")
        print(flush=True)


if __name__ == "__main__":
    main()
