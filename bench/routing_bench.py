"""Step time of the real Megatron training example under patches/moe.yaml: no moe spec vs.
the spec active with routing off (idle call sites) vs. capture (every microbatch and
layer, written to disk at each step end) vs. replay (of a capture made first).

Each variant is its own process (patching happens at import), run in alternating
rounds; each round trains `--steps` steps and the first `--warmup` are discarded.

    python bench/routing_bench.py              # GPU: a mid-size GPT-MoE
    python bench/routing_bench.py --quick      # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
BASE = "megatron_cpu"
VARIANTS = {
    "no moe spec": (BASE, {}),
    "moe spec, off": (BASE + ",moe", {"SOURCE_PATCH_ROUTING_MODE": "off"}),
    "moe spec, capture": (BASE + ",moe", {"SOURCE_PATCH_ROUTING_MODE": "capture"}),
    "moe spec, replay": (BASE + ",moe", {"SOURCE_PATCH_ROUTING_MODE": "replay"}),
}
STEP = re.compile(r"^step \d+/\d+ .* time (\d+(?:\.\d+)?) ms$", re.M)


def run(name: str, args, root: str, replay_dir: str | None = None) -> list[float]:
    spec, env = VARIANTS[name]
    folder = replay_dir if name.endswith("replay") else tempfile.mkdtemp(dir=root)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_ROUTING")}
    environ.update(SOURCE_PATCH=spec, SOURCE_PATCH_ROUTING_DIR=folder, **env)
    size = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--micro-batches", str(args.micro_batches), "--experts", str(args.experts),
            "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(args.steps), *size],
                         env=environ, capture_output=True, text=True, timeout=900)
    if folder != replay_dir:
        shutil.rmtree(folder, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stdout}\n{out.stderr}")
    return [float(t) for t in STEP.findall(out.stdout)][args.warmup:]


def capture_once(args, root: str) -> str:
    """A capture run whose records the replay variant replays (same seed, data, steps)."""
    folder = tempfile.mkdtemp(dir=root)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_ROUTING")}
    environ.update(SOURCE_PATCH=BASE + ",moe", SOURCE_PATCH_ROUTING_MODE="capture", SOURCE_PATCH_ROUTING_DIR=folder)
    size = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--micro-batches", str(args.micro_batches), "--experts", str(args.experts),
            "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(args.steps), *size],
                         env=environ, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"capture for replay failed:\n{out.stdout}\n{out.stderr}")
    return folder


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2 if not cuda else 4)
    p.add_argument("--steps", type=int, default=12 if not cuda else 60)
    p.add_argument("--warmup", type=int, default=2 if not cuda else 10)
    p.add_argument("--layers", type=int, default=4 if not cuda else 8)
    p.add_argument("--hidden", type=int, default=64 if not cuda else 1024)
    p.add_argument("--heads", type=int, default=4 if not cuda else 16)
    p.add_argument("--seq-len", type=int, default=32 if not cuda else 1024)
    p.add_argument("--micro-batch", type=int, default=8 if not cuda else 4)
    p.add_argument("--micro-batches", type=int, default=1 if not cuda else 2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128 if not cuda else 4096)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 6, 2

    print(f"machine   {platform.node()}, {os.cpu_count()} CPUs, "
          f"{torch.cuda.get_device_name() if cuda else 'no GPU'}")
    print(f"software  python {platform.python_version()}, torch {torch.__version__}")
    print(f"date      {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model     {args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts, "
          f"seq {args.seq_len} x micro-batch {args.micro_batch} x {args.micro_batches}, fp32; "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps per variant\n")
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        replay_dir = capture_once(args, root)
        n = len(VARIANTS)
        for r in range(args.rounds):
            order = list(VARIANTS)[r % n:] + list(VARIANTS)[:r % n]
            for name in order:
                samples[name] += run(name, args, root, replay_dir)
    base = statistics.median(samples["no moe spec"])
    print(f"{'variant':<22}{'steps':>7}{'median ms':>11}{'min ms':>9}{'vs none':>10}")
    for name, times in samples.items():
        med = statistics.median(times)
        print(f"{name:<22}{len(times):>7}{med:>11.2f}{min(times):>9.2f}{(med / base - 1) * 100:>+9.2f}%")


if __name__ == "__main__":
    main()
