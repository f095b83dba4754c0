"""How noisy the training example's step time is, under a few process settings: the
noise a traced-vs-untraced comparison has to see through.

    python bench/step_noise.py --steps 150 --rounds 1

Each variant runs the example alone (SOURCE_PATCH=megatron_cpu only, which it needs
without Transformer Engine: trace_bench's "no trace spec"), variants alternated by round;
per variant: median, 10th and 90th percentile step time, the spread (p90 - p10) over
the median, and the lag-1 autocorrelation (near 0: step-to-step noise, which pairing
neighbouring steps cannot cancel).
"""

from __future__ import annotations

import argparse
import os
import statistics

import training

# name -> (environment, model-size flags multiplied, the CPUs it runs on: None for all)
VARIANTS = {
    "as is": ({}, {}, None),
    "OMP_NUM_THREADS=1": ({"OMP_NUM_THREADS": "1"}, {}, None),
    "expandable segments": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {}, None),
    "pinned to 4 cores": ({}, {}, range(4)),
    "hidden x2 (more GPU work)": ({}, {"hidden": 2}, None),
}


def lag1(xs: list[float]) -> float:
    mu = statistics.fmean(xs)
    return sum((a - mu) * (b - mu) for a, b in zip(xs, xs[1:])) / sum((a - mu) ** 2 for a in xs)


def main() -> None:
    p = training.parser(__doc__)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = p.parse_args()
    training.header(args)
    samples: dict = {name: [] for name in args.variants}

    def run(name: str) -> list[float]:
        env, scale, cpus = VARIANTS[name]
        env = training.environment("SOURCE_PATCH", **env)
        env["SOURCE_PATCH"] = "megatron_cpu"  # what the example needs without Transformer Engine (trace_bench's base)
        sized = argparse.Namespace(**{**vars(args), **{k: getattr(args, k) * f for k, f in scale.items()}})
        mine = os.sched_getaffinity(0)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # the child inherits it
        try:
            times = training.train(sized, env, name)[args.warmup:]
        finally:
            os.sched_setaffinity(0, mine)
        samples[name] += times
        return times

    training.rounds(args, args.variants, run)
    print(f"\n{'variant':24}{'steps':>6}{'median':>9}{'p10':>8}{'p90':>8}{'spread':>8}{'lag-1':>7}")
    for name, xs in samples.items():
        deciles = statistics.quantiles(xs, n=10)
        median = statistics.median(xs)
        print(f"{name:24}{len(xs):6}{median:9.1f}{deciles[0]:8.1f}{deciles[-1]:8.1f}"
              f"{(deciles[-1] - deciles[0]) / median:8.1%}{lag1(xs):7.2f}")


if __name__ == "__main__":
    main()
