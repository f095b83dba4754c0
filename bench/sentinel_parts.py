"""Where the armed sentinels' host time goes inside their call sites, per step.

call_profile.py times each call site (``dump``, ``sentinels_step``, ``routing_topk``);
this looks inside them.  One process of the training example with every sentinel armed
(overhead_bench.py's "sentinels armed" variant) runs with the sentinels' own functions
wrapped by timers, counted from step --warmup + 1 on (the first steps load kernels and
allocate pinned buffers: one-time costs that would swamp the averages), and prints, per
function, its calls and host microseconds a step.  Times nest: a function's time holds
that of the functions it calls (``read_batch`` holds ``_norms``).  On a GPU a function's
host time is what it costs the training thread (Python, launches, and any wait); on the
CPU the reductions run in it, so the CPU figures are the smoke run's, not a cost.

    python bench/sentinel_parts.py             # GPU: the host-bound model of overhead_bench.py
    python bench/sentinel_parts.py --quick     # CPU smoke run
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {  # module (under source_patch.runtime) -> its functions timed
    "sentinels.nonfinite": ("_hook", "_read_by_layer", "read_batch", "_norms", "_keep", "write_kept", "step_end",
                            "drain", "_inspect"),
    "sentinels.routing_health": ("routes", "_accumulate", "_batch", "step_end", "drain", "_write"),
    "core.adapters.readback": ("Readback.start",),
}


def child(argv: list) -> None:
    """In the training process: wrap the parts, run the example, print their table."""
    import importlib

    import training  # bench/
    from overhead_probe import timed  # bench/
    from source_patch.runtime.core import watch

    warmup, argv = int(argv[0]), argv[1:]
    times: dict = {}  # label -> [calls, ns]
    steps = [0]
    for name, functions in PARTS.items():
        module = importlib.import_module(f"source_patch.runtime.{name}")
        for dotted in functions:
            owner, _, attr = dotted.rpartition(".")
            target = getattr(module, owner) if owner else module
            cell = times[f"{name.rpartition('.')[2]}.{dotted}"] = [0, 0]
            setattr(target, attr, timed(getattr(target, attr), cell))
    nonfinite = importlib.import_module("source_patch.runtime.sentinels.nonfinite")
    step_end, threads = nonfinite.step_end, []

    def counted_step_end(step):
        step_end(step)
        steps[0] += 1
        if steps[0] == warmup:  # the warm-up's calls left out; the Python threads a GIL release may hand the GIL to
            for cell in times.values():
                cell[0] = cell[1] = 0
            threads.extend(sorted(t.name for t in threading.enumerate() if t is not threading.current_thread()))
    nonfinite.step_end = counted_step_end
    # arming sets the module's _hook (now the timed one); armed already, it is set again
    if watch.tensor_hook is not None:
        watch.set_tensor_hook(nonfinite._hook)
    training.load_example(["", *argv]).main()
    counted = max(1, steps[0] - warmup)
    print(f"sentinel-parts: {counted} steps after {warmup}; other Python threads at step {warmup}: "
          f"{', '.join(threads) or 'none'}")
    for label, (calls, ns) in sorted(((k, v) for k, v in times.items() if v[0]), key=lambda kv: -kv[1][1]):
        print(f"   {label:<34} {calls / counted:8.1f} calls/step {ns / counted / 1e3:10.1f} us/step "
              f"{ns / max(calls, 1) / 1e3:9.2f} us/call")


def main() -> None:
    import overhead_bench  # bench/
    import training

    p = training.parser(__doc__)
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 10, 3
    training.header(args)
    with tempfile.TemporaryDirectory(prefix="sp-parts-") as folder:
        env = overhead_bench.environment("sentinels armed", folder, os.path.join(folder, "replay"), args.steps, port=0)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        size = ["--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
                "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                "--micro-batches", str(args.micro_batches), "--experts", str(args.experts), "--vocab", str(args.vocab)]
        out = subprocess.run([sys.executable, __file__, "--child", str(args.warmup), str(training.EXAMPLE), *size],
                             env=env, capture_output=True, text=True, timeout=900)
    table = out.stdout[out.stdout.find("sentinel-parts:"):] if "sentinel-parts:" in out.stdout else ""
    if out.returncode != 0 or not table:
        raise SystemExit(f"the training process failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(table, end="")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(HERE))
        child(sys.argv[2:])
    else:
        main()
