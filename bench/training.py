"""What the training-step benches share: the example's size flags, running it in a
subprocess, alternating rounds, and the table (printed after every round, so a run
cut short by a time limit still reports what it measured)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import stats  # bench/

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
STEP = re.compile(r"^step \d+/\d+ .* time (\d+(?:\.\d+)?) ms$", re.M)
GC_STEPS = re.compile(r"^gc-steps: (.*)$", re.M)
CALL_PARTS = re.compile(r"^call-parts: (.*)$", re.M)
CUDA = torch.cuda.is_available()


def load_example(argv: list):
    """In a probe process (gc_probe.py, overhead_probe.py): ``argv[1]`` is the example's
    path, the rest its flags; the example loaded as module ``train_moe`` (not run), with
    ``sys.argv`` set for its own parser."""
    import importlib.util

    sys.argv = argv[1:]
    spec = importlib.util.spec_from_file_location("train_moe", argv[1])
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = example
    spec.loader.exec_module(example)
    return example


def parser(doc: str) -> argparse.ArgumentParser:
    """Flags for the rounds and the model: small on CPU, mid-size on a GPU."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--quick", action="store_true", help="a CPU-sized smoke run")
    p.add_argument("--rounds", type=int, default=4 if CUDA else 2)
    p.add_argument("--steps", type=int, default=60 if CUDA else 12)
    p.add_argument("--warmup", type=int, default=10 if CUDA else 2)
    p.add_argument("--layers", type=int, default=8 if CUDA else 4)
    p.add_argument("--hidden", type=int, default=1024 if CUDA else 64)
    p.add_argument("--heads", type=int, default=16 if CUDA else 4)
    p.add_argument("--seq-len", type=int, default=1024 if CUDA else 32)
    p.add_argument("--micro-batch", type=int, default=4 if CUDA else 8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096 if CUDA else 128)
    return p


def train(args, environ: dict, what: str, steps: int | None = None, gc: list | None = None,
          calls: dict | None = None) -> list[float]:
    """Run the example with these sizes and environment; its per-step times in ms.
    With a ``gc`` list: run it under gc_probe.py and fill the list with each step's
    [ms collecting, collections of generation 0, 1, 2]; with a ``calls`` dict (and a
    ``gc`` list) fill it with the parts of the due trace() calls (gc_probe --calls)."""
    size = ["--steps", str(steps or args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len),
            "--micro-batch", str(args.micro_batch), "--micro-batches", str(args.micro_batches),
            "--experts", str(args.experts), "--vocab", str(args.vocab)]
    probe = [str(Path(__file__).with_name("gc_probe.py"))] if gc is not None else []
    probe += ["--calls"] if probe and calls is not None else []
    out = subprocess.run([sys.executable, *probe, str(EXAMPLE), *size], env=environ, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0 or "write error" in out.stdout:
        raise SystemExit(f"{what} failed:\n{out.stdout}\n{out.stderr}")
    if gc is not None:
        gc.extend(json.loads(GC_STEPS.search(out.stdout).group(1)))
    if probe and calls is not None:
        calls.update(json.loads(CALL_PARTS.search(out.stdout).group(1)))
    return [float(t) for t in STEP.findall(out.stdout)]


def environment(drop_prefix: str, **env) -> dict:
    """This process's environment without the component's own settings, plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefix)}
    environ.update(env)
    return environ


def header(args) -> None:
    print(f"machine   {platform.node()}, {os.cpu_count()} CPUs, "
          f"{torch.cuda.get_device_name() if CUDA else 'no GPU'}")
    print(f"software  python {platform.python_version()}, torch {torch.__version__}")
    print(f"date      {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model     {args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts, "
          f"seq {args.seq_len} x micro-batch {args.micro_batch} x {args.micro_batches}, fp32; "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps per variant\n", flush=True)


def rounds(args, variants: list[str], run: Callable[[str], list[float]]) -> None:
    """Run every variant once per round, rotating the order; print the table each round."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in variants[r % len(variants):] + variants[:r % len(variants)]:
            samples[name] += run(name)
        table(samples, f"after round {r + 1}/{args.rounds}")


def table(samples: dict[str, list[float]], title: str) -> None:
    base = statistics.median(samples[next(iter(samples))])
    print(f"{title}\n{'variant':<22}{'steps':>7}{'median ms':>11}{'min ms':>9}{'vs first':>10}")
    for name, times in samples.items():
        if not times:
            print(f"{name:<22}{0:>7}")
            continue
        med = statistics.median(times)
        print(f"{name:<22}{len(times):>7}{med:>11.2f}{min(times):>9.2f}{(med / base - 1) * 100:>+9.2f}%")
    print(flush=True)


def ratio(samples: dict[str, list[float]], a: str, b: str) -> None:
    """`a` against `b`: medians and a bootstrap 90% interval of the median's ratio."""
    x, y = samples[a], samples[b]
    if len(x) < 3 or len(y) < 3:
        return
    med, low, high = stats.bootstrap(stats.ratio_of_medians, x, y)
    print(f"{a} vs {b}: {(med - 1) * 100:+.2f}% on the medians (90% interval {(low - 1) * 100:+.2f}% .. "
          f"{(high - 1) * 100:+.2f}%), {(min(x) / min(y) - 1) * 100:+.2f}% on the minima\n", flush=True)
