"""The planned due trace() call (runtime/trace/api.py ``_fast``) on the CPU: the bytecodes
it runs, line by line, and its time warm, with stand-ins for the parts only a GPU has
(the forwarder's pinned ring, the current CUDA stream, Triton's C launch, which does
nothing here).

    python bench/due_call_bench.py [--rounds 15] [--calls 20000] [--cold-rounds 40] [--lines]

The count is exact and the same on every machine: what a change to the call adds or
removes, where a GPU host's timing (compressor_bench.py, trace_bench.py) moves by a few
microseconds from host to host.  Two times: of a warm call (caches hot, back to back),
and of a call after other work (each alone, after a pass over 32 MiB and a few torch
ops, as compressor_bench.py's "after other work"), the way a due call runs between a
training step's layers, cold: there each object the call touches is a cache miss
(docs/bench-notes/overhead.md), ~4x the warm time.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import sys
import threading
import time

import torch

from stats import HEADER, cells

from source_patch.runtime.trace import api, device, hub, plan as plan_module

LAYOUT = (64, 4, 256)
STATS_SHAPE = (2, 5, 256)  # [splits, statistics, columns]: what the fused kernel writes


class Ring:
    """The forwarder's ring as _fast reads it: pinned, written by the device."""

    def __init__(self):
        self.direct, self.device_address, self.size, self.head, self.tail = True, 1 << 40, 32 << 20, 0, 0
        self.lock = threading.Lock()


class Launch:
    shape = STATS_SHAPE
    compiled = (lambda *arguments: None, (1, 2, 1), (0xF00, False, True, None, None),
                (256, 256, 128, 5, 16, 128, 0, 1))  # (C launch, before, middle, after): fused._launcher's shape


class Hooks:
    """Triton's launch hooks, none set (fused._hooks: triton.knobs.runtime)."""
    launch_enter_hook = launch_exit_hook = None


def stand_ins(x: torch.Tensor):
    """api's trace state set for one planned subscription of ``x``'s layout; the plan."""
    sub = hub.parse_subscription({"op": "subscribe", "id": "bench", "names": ["h"], "compressor": {"kind": "tiles"}})
    plan = plan_module.Plan(sub, x, Launch)  # as plan.make builds it
    device.known_streams[(plan.device, 0)] = (object(), 0)
    ring = Ring()
    for name, value in (("_ring", ring), ("_stepping", True), ("_publisher", threading.current_thread()),
                        ("_capturing", lambda: False), ("_stream_of", lambda index: (0, plan.device, 1)),
                        ("_fast_ring", ring), ("_launch_hooks", Hooks)):  # what api._arm sets on a GPU
        setattr(api, name, value)
    api._config = {**api._config, "queue": 1 << 30, "device_timing": False}
    return plan


def due_call(plan, x: torch.Tensor) -> tuple:
    """(one due call then the state put back so that the next one is due again, the
    putting back alone)."""
    key, tags, ring, sub = ("h", 1), {"layer": 1}, api._ring, plan.sub

    def put_back() -> None:
        sub.next_step.clear()
        ring.head = ring.tail = 0
        api._pending.clear()
        api._unsealed.clear()
        api._records.clear()
        api._durations.clear()

    def due() -> None:
        if not api._fast(plan, key, x, tags) or not api._records:
            raise RuntimeError("the planned call refused the stand-ins: this bench is out of step with api._fast")

    def call() -> None:
        due()
        put_back()
    return call, put_back, due


def timed(fn, rounds: int, calls: int) -> list:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return samples


class OtherWork:
    """What runs between two due calls in training, untimed (compressor_bench.py's
    "after other work" on the host): a pass over 32 MiB and a few small torch ops, which
    leave the call's code and data out of the caches."""

    def __init__(self):
        self.memory, self.small = torch.ones(8 << 20), torch.randn(64, 64)

    def __call__(self) -> None:
        self.memory.sum()
        x = torch.nn.functional.layer_norm(self.small, (64,))
        torch.sort(torch.cumsum(torch.softmax(x @ self.small, -1).sum(0), 0))


def timed_cold(fn, put_back, rounds: int, calls: int) -> list:
    """Seconds per call, each call timed alone after OtherWork (the state put back untimed)."""
    other, samples = OtherWork(), []
    for _ in range(rounds):
        total = 0.0
        for _ in range(calls):
            other()
            put_back()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        samples.append(total / calls)
    return samples


def bytecodes(call) -> collections.Counter:
    """(function, file, line) -> bytecodes run, in _fast and what it calls in Python."""
    counts: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True

        def local(frame, event, arg):
            if event == "opcode" and frame.f_code.co_filename != __file__:  # not the bench's stand-ins
                counts[(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno)] += 1
            return local
        return local
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20000, help="due calls a round")
    p.add_argument("--lines", action="store_true", help="the bytecodes of every line")
    p.add_argument("--cold-rounds", type=int, default=40, help="rounds of 40 calls, each after other work")
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(LAYOUT)
    call, put_back, due = due_call(stand_ins(x), x)
    call()  # the first call: caches filled, specialised bytecodes in place
    counts = bytecodes(call)
    by_function = collections.Counter()
    for (function, _, _), n in counts.items():
        by_function[function] += n
    print(f"the planned due call (api._fast) on {x.device}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    print("bytecodes a call runs: " + ", ".join(f"{f} {n}" for f, n in by_function.most_common()))
    if args.lines:
        for (function, filename, line), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
            text = linecache.getline(filename, line).strip() if line else ""
            print(f"{n:5}  {function}:{line}  {text[:100]}")
    print(f"\n{'warm, µs a call':44}{HEADER}")
    print(f"{'planned due call, the state put back after':44}{cells(timed(call, args.rounds, args.calls), 1e6)}")
    print(f"{'the state put back alone':44}{cells(timed(put_back, args.rounds, args.calls), 1e6)}")
    print(f"{'after other work (each call alone), µs':44}{HEADER}")
    print(f"{'planned due call':44}{cells(timed_cold(due, put_back, args.cold_rounds, 40), 1e6)}")
    put_back()  # nothing left queued for the runtime's flush at exit (its stream is a stand-in)


if __name__ == "__main__":
    main()
