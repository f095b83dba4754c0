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

import shutil
import tempfile

import training

VARIANTS = {
    "no dump spec": ("megatron_cpu", "0"),
    "dump spec, disabled": ("megatron_cpu,dump", "0"),
    "dump spec, dumping": ("megatron_cpu,dump", "1"),
}
DUMPING = "dump spec, dumping"


def main() -> None:
    p = training.parser(__doc__)
    p.add_argument("--dump-steps", type=int, default=5 if training.CUDA else 4)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.dump_steps = 1, 6, 2, 2
    training.header(args)
    first, last = args.warmup, args.warmup + args.dump_steps  # 0-based, as the dumper counts

    with tempfile.TemporaryDirectory() as root:
        def run(name: str) -> list[float]:
            spec, enable = VARIANTS[name]
            folder = tempfile.mkdtemp(dir=root)
            times = training.train(args, training.environment(
                "SOURCE_PATCH_DUMP", SOURCE_PATCH=spec, SOURCE_PATCH_DUMP_ENABLE=enable,
                SOURCE_PATCH_DUMP_DIR=folder, SOURCE_PATCH_DUMP_STEPS=f"{first}-{last - 1}"), name)
            shutil.rmtree(folder, ignore_errors=True)
            return times[first:last] if name == DUMPING else times[first:]

        training.rounds(args, list(VARIANTS), run)


if __name__ == "__main__":
    main()
