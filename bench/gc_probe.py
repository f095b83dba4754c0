"""Run the training example with the garbage collector's time recorded per step.

    python bench/gc_probe.py [--calls] examples/train_moe.py --steps 20 ...

The example runs as it does alone (its own main(), its own step lines); its
train_step is wrapped to sum the collections that ran during each step, in any
thread (gc.callbacks).  The last line of stdout is
``gc-steps: [[ms, gen0, gen1, gen2], ...]``: per step, the milliseconds spent
collecting and the collections of each generation.  trace_bench.py --gc uses it
to tell whether a slow step is one that collected.

``--calls`` also times the parts of each due trace() call on the training thread
(the planned call, ``api._fast``, or its compiled twin where the native launch is
built, counted with the calls it finds not due; the general
path's call, its device stage, the Triton launcher alone, the event record) and
prints ``call-parts: {part: [calls, total us, power-of-two us histogram, first
call's us]}`` before that line (the first call, which loads or compiles the kernel,
is in the histogram but not in the total): where a due call's time goes in training,
where the isolated bench (compressor_bench.py --profile) sees a quarter of it.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import training  # bench/: loads the example

per_step: list = []
current = [0.0, 0, 0, 0]  # this step's ms, collections of generation 0, 1, 2
started = [0.0]


def on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        current[0] += (time.perf_counter() - started[0]) * 1e3
        current[1 + info["generation"]] += 1


def probe_calls() -> dict:
    """Wrap the trace runtime's due-call parts (module globals, looked up at each call)
    with timers; their [calls, total us, histogram, first us] fill as training runs."""
    from source_patch.runtime.trace import api

    parts: dict = {}
    buckets = api.CALL_BUCKETS  # the runtime's due_call_us histogram's

    def timed(name: str, fn):
        part = parts.setdefault(name, [0, 0.0, [0] * buckets, None])

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                us = (time.perf_counter() - start) * 1e6
                if part[3] is None:
                    part[3] = us
                else:
                    part[0] += 1
                    part[1] += us
                part[2][min(int(us).bit_length(), buckets - 1)] += 1
        return wrapper

    api._fast = timed("due call, planned (_fast; not-due calls too)", api._fast)
    make = api._make_plan

    def make_timed(*args):  # a native plan's call is compiled (plan.due, called by trace()): timed where made
        plan = make(*args)
        if plan and getattr(plan, "due", None) is not None:
            plan.due = timed("due call, compiled (native_launch.cpp's due; not-due calls too)", plan.due)
        return plan
    api._make_plan = make_timed
    api._compress = timed("due call, general path (_compress)", api._compress)
    api._device_stage = timed("  device stage (launch, ring)", api._device_stage)
    api._record = timed("  event record", api._record)
    try:
        from source_patch.runtime.trace import fused
    except Exception:  # noqa: BLE001 - no Triton here: the torch reductions
        return parts
    launcher = fused._launcher

    def timed_launcher(kernel, *args):
        got = launcher(kernel, *args)
        return None if got is None else (timed("    Triton launcher alone", got[0]), *got[1:])

    fused._launcher = timed_launcher
    return parts


def main() -> None:
    calls = sys.argv[1] == "--calls"
    if calls:
        del sys.argv[1]
    example = training.load_example(sys.argv)  # the example parses its own flags
    train_step = example.train_step

    def probed(*args, **kwargs):
        current[:] = [0.0, 0, 0, 0]
        try:
            return train_step(*args, **kwargs)
        finally:
            per_step.append([round(current[0], 3), *current[1:]])

    example.train_step = probed  # main() looks it up at each step
    gc.callbacks.append(on_collection)
    parts = probe_calls() if calls else None
    example.main()
    if parts is not None:
        print("call-parts: " + json.dumps(parts), flush=True)
    print("gc-steps: " + json.dumps(per_step), flush=True)


if __name__ == "__main__":
    main()
