"""Step time of the real Megatron training example: no dump spec vs. the dump spec
active but disabled (the cost of idle call sites) vs. dumping every site.

Each variant is its own process (patching happens at import), run in alternating
rounds so machine drift hits all alike; each round trains `--steps` steps and the
first `--warmup` are discarded.  The dumping variant dumps every site for
`--dump-steps` steps after the warm-up (a debugging session dumps a few steps, and
a mid-size model writes hundreds of MiB per step) and is timed on those steps.

    python bench/dump_step_bench.py                     # GPU: a mid-size GPT-MoE
    python bench/dump_step_bench.py --quick             # CPU smoke run
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
VARIANTS = {
    "no dump spec": ("megatron_cpu", {}),
    "dump spec, disabled": ("megatron_cpu,dump", {"SOURCE_PATCH_DUMP_ENABLE": "0"}),
    "dump spec, dumping": ("megatron_cpu,dump", {"SOURCE_PATCH_DUMP_ENABLE": "1"}),
}
DUMPING = "dump spec, dumping"
STEP = re.compile(r"^step \d+/\d+ .* time (\d+(?:\.\d+)?) ms$", re.M)


def run(name: str, args, dump_root: str) -> list[float]:
    spec, env = VARIANTS[name]
    dump_dir = tempfile.mkdtemp(dir=dump_root)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_DUMP")}
    first, last = args.warmup, args.warmup + args.dump_steps  # 0-based, as the dumper counts
    environ.update(SOURCE_PATCH=spec, SOURCE_PATCH_DUMP_DIR=dump_dir,
                   SOURCE_PATCH_DUMP_STEPS=f"{first}-{last - 1}", **env)
    size = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--experts", str(args.experts), "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(args.steps), *size],
                         env=environ, capture_output=True, text=True, timeout=900)
    shutil.rmtree(dump_dir, ignore_errors=True)
    if out.returncode != 0 or "write error" in out.stdout:
        raise SystemExit(f"{name} failed:\n{out.stdout}\n{out.stderr}")
    times = [float(t) for t in STEP.findall(out.stdout)]
    return times[first:last] if name == DUMPING else times[first:]


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2 if not cuda else 4)
    p.add_argument("--steps", type=int, default=12 if not cuda else 60)
    p.add_argument("--warmup", type=int, default=2 if not cuda else 10)
    p.add_argument("--dump-steps", type=int, default=4 if not cuda else 5)
    p.add_argument("--layers", type=int, default=4 if not cuda else 8)
    p.add_argument("--hidden", type=int, default=64 if not cuda else 1024)
    p.add_argument("--heads", type=int, default=4 if not cuda else 16)
    p.add_argument("--seq-len", type=int, default=32 if not cuda else 1024)
    p.add_argument("--micro-batch", type=int, default=8 if not cuda else 4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128 if not cuda else 4096)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.dump_steps = 1, 6, 2, 2

    print(f"machine   {platform.node()}, {os.cpu_count()} CPUs, "
          f"{torch.cuda.get_device_name() if cuda else 'no GPU'}")
    print(f"software  python {platform.python_version()}, torch {torch.__version__}")
    print(f"date      {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model     {args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts, "
          f"seq {args.seq_len} x micro-batch {args.micro_batch}, fp32; "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps per variant\n")
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as dump_dir:
        for r in range(args.rounds):
            order = list(VARIANTS)[r % 3:] + list(VARIANTS)[:r % 3]
            for name in order:
                samples[name] += run(name, args, dump_dir)
    base = statistics.median(samples["no dump spec"])
    print(f"{'variant':<22}{'steps':>7}{'median ms':>11}{'min ms':>9}{'vs none':>10}")
    for name, times in samples.items():
        med = statistics.median(times)
        print(f"{name:<22}{len(times):>7}{med:>11.2f}{min(times):>9.2f}{(med / base - 1) * 100:>+9.2f}%")


if __name__ == "__main__":
    main()
