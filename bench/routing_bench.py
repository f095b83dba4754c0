"""Step time of the real Megatron training example under patches/routing.yaml: no routing spec vs.
the spec active with routing off (idle call sites) vs. capture (every microbatch and
layer, written to disk at each step end) vs. replay (of a capture made first).

Each variant is its own process (patching happens at import), run in alternating
rounds; each round trains `--steps` steps and the first `--warmup` are discarded.

    python bench/routing_bench.py              # GPU: a mid-size GPT-MoE
    python bench/routing_bench.py --quick      # CPU smoke run
"""

from __future__ import annotations

import shutil
import tempfile

import training

BASE = "megatron_cpu"
VARIANTS = {
    "no routing spec": (BASE, "off"),
    "routing spec, off": (BASE + ",routing", "off"),
    "routing spec, capture": (BASE + ",routing", "capture"),
    "routing spec, replay": (BASE + ",routing", "replay"),
}


def routing_env(spec: str, mode: str, folder: str) -> dict:
    return training.environment("SOURCE_PATCH_ROUTING", SOURCE_PATCH=spec, SOURCE_PATCH_ROUTING_MODE=mode,
                                SOURCE_PATCH_ROUTING_DIR=folder)


def main() -> None:
    p = training.parser(__doc__)
    p.set_defaults(micro_batches=2 if training.CUDA else 1)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 6, 2
    training.header(args)

    with tempfile.TemporaryDirectory() as root:
        # A capture whose records the replay variant replays (same seed, data, steps).
        replay_dir = tempfile.mkdtemp(dir=root)
        training.train(args, routing_env(BASE + ",routing", "capture", replay_dir), "capture for replay")

        def run(name: str) -> list[float]:
            spec, mode = VARIANTS[name]
            folder = replay_dir if mode == "replay" else tempfile.mkdtemp(dir=root)
            times = training.train(args, routing_env(spec, mode, folder), name)
            if folder != replay_dir:
                shutil.rmtree(folder, ignore_errors=True)
            return times[args.warmup:]

        training.rounds(args, list(VARIANTS), run)


if __name__ == "__main__":
    main()
