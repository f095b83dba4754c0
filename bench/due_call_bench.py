"""The planned due trace() call (runtime/trace/api.py ``_fast``) on the CPU: the bytecodes
it runs, line by line, and its time warm, with stand-ins for the parts only a GPU has
(the forwarder's pinned ring, the current CUDA stream, Triton's C launch, which does
nothing here).

    python bench/due_call_bench.py [--rounds 15] [--calls 20000] [--lines]

The count is exact and the same on every machine: what a change to the call adds or
removes, where a GPU host's timing (compressor_bench.py, trace_bench.py) moves by a few
microseconds from host to host.  The time is of a warm call (caches hot, back to back):
the object operations the call makes (attribute and dict lookups, torch's calls on the
tensor, the result's allocation, the locks), which a cold call between a training step's
layers pays again in cache misses (docs/bench-notes/overhead.md).
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
        self._lock = threading.Lock()


class Launch:
    shape = STATS_SHAPE
    compiled = (lambda *arguments: None, (1, 2, 1), (0xF00, False, True, None, None),
                (256, 256, 128, 5, 16, 128, 0, 1))  # (C launch, before, middle, after): fused._launcher's shape


class Fused:
    _hooks = type("Hooks", (), {"launch_enter_hook": None, "launch_exit_hook": None})()
    _direct_ok = True


class Compress:
    DIRECT_LAUNCH = USE_TRITON = True


def stand_ins(x: torch.Tensor):
    """api's trace state set for one planned subscription of ``x``'s layout; the plan."""
    sub = hub.parse_subscription({"op": "subscribe", "id": "bench", "names": ["h"], "compressor": {"kind": "tiles"}})
    plan = plan_module.Plan.__new__(plan_module.Plan)  # as plan.make builds it, without a GPU
    plan.sub, plan.subs, plan.stale, plan.failed, plan.fused, plan.compress = sub, [sub], False, False, Fused, Compress
    plan.launch, plan.device, plan.dims = Launch, x.get_device(), list(STATS_SHAPE)
    plan.layout = (x.shape, x.dtype, plan.device, x.data_ptr() & 15 == 0)
    plan.nbytes = 4 * STATS_SHAPE[0] * STATS_SHAPE[1] * STATS_SHAPE[2]
    plan.padded = -(-plan.nbytes // 256) * 256
    device.known_streams[(plan.device, 0)] = (object(), 0)
    for name, value in (("_ring", Ring()), ("_stepping", True), ("_publisher", threading.current_thread()),
                        ("_capturing", lambda: False), ("_stream_of", lambda index: (0, plan.device, 1))):
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

    def call() -> None:
        if not api._fast(plan, key, x, tags) or not api._pending:
            raise RuntimeError("the planned call refused the stand-ins: this bench is out of step with api._fast")
        put_back()
    return call, put_back


def timed(fn, rounds: int, calls: int) -> list:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
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
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(LAYOUT)
    call, put_back = due_call(stand_ins(x), x)
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


if __name__ == "__main__":
    main()
