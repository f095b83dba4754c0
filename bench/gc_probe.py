"""Run the training example with the garbage collector's time recorded per step.

    python bench/gc_probe.py examples/train_moe.py --steps 20 ...

The example runs as it does alone (its own main(), its own step lines); its
train_step is wrapped to sum the collections that ran during each step, in any
thread (gc.callbacks).  The last line of stdout is
``gc-steps: [[ms, gen0, gen1, gen2], ...]``: per step, the milliseconds spent
collecting and the collections of each generation.  trace_bench.py --gc uses it
to tell whether a slow step is one that collected.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import time

per_step: list = []
current = [0.0, 0, 0, 0]  # this step's ms, collections of generation 0, 1, 2
started = [0.0]


def on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        current[0] += (time.perf_counter() - started[0]) * 1e3
        current[1 + info["generation"]] += 1


def main() -> None:
    path = sys.argv[1]
    sys.argv = sys.argv[1:]  # the example parses its own flags
    spec = importlib.util.spec_from_file_location("train_moe", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = example
    spec.loader.exec_module(example)
    train_step = example.train_step

    def probed(*args, **kwargs):
        current[:] = [0.0, 0, 0, 0]
        try:
            return train_step(*args, **kwargs)
        finally:
            per_step.append([round(current[0], 3), *current[1:]])

    example.train_step = probed  # main() looks it up at each step
    gc.callbacks.append(on_collection)
    example.main()
    print("gc-steps: " + json.dumps(per_step), flush=True)


if __name__ == "__main__":
    main()
