"""Host time of one routing-capture call (runtime/routing/megatron/control.py) on the training
thread, per router call, and of the background saver per step.

    python bench/routing_call_bench.py           # GPU: 8 layers x 4096 tokens, top-2
    python bench/routing_call_bench.py --quick   # CPU smoke run

Variants, alternated round by round in one process: ``capture`` (the runtime's call:
a non-blocking copy on the current stream into a pooled page-locked buffer and an
event), ``side stream, pinned alloc`` (what it did before 2026-11-26: a page-locked
allocation, a side stream, wait_stream, record_stream and an event per call, kept here
to compare), and ``off`` (the flag test).  Each call follows a matmul on the device,
as a router call follows the gating linear.  Then the saver: ``save()`` of one step's
record (8 layers) and its share of the step.  Prints min / median [90% interval] in us.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import stats  # bench/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from source_patch.runtime.routing.megatron import capture as megatron_capture, control as rm  # noqa: E402


def old_to_host(t, side):
    """The capture's copy before 2026-11-26, for comparison."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(side):
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    t.record_stream(side)
    return host, event


def one_step(layers: int, ids, work, timer: list) -> None:
    rm.routing_schedule(False)
    rm.routing_microbatch_begin()
    for layer in range(1, layers + 1):
        router = SimpleNamespace(layer_number=layer, config=SimpleNamespace(sequence_parallel=False,
                                                                            num_moe_experts=8))
        work @ work  # the gating linear before the router's call
        start = time.perf_counter_ns()
        rm.routing_enter(router, ids.view(-1, 4, 2))
        rm.routing_topk(None, (None, ids))
        rm.routing_exit()
        timer.append((time.perf_counter_ns() - start) / 1e3)
    rm.routing_microbatch_end()
    rm.routing_schedule_end()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="steps a variant runs each round")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.tokens = 3, 3, 256
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(args.tokens)]).to(device)
    work = torch.randn(1024 if device == "cuda" else 64, 1024 if device == "cuda" else 64, device=device)
    side = torch.cuda.Stream() if device == "cuda" else None
    new_to_host = megatron_capture._to_host
    folder = tempfile.mkdtemp()
    times: dict = {"off": [], "capture": [], "side stream, pinned alloc": []}
    saves: list = []
    for r in range(args.rounds):
        for name in list(times)[r % 3:] + list(times)[:r % 3]:
            if name == "side stream, pinned alloc" and side is None:
                continue
            megatron_capture._to_host = (lambda t: old_to_host(t.detach(), side)) if name.startswith("side") else new_to_host
            rm.configure(mode="off" if name == "off" else "capture", dir="")
            for _ in range(args.steps):
                one_step(args.layers, ids, work, times[name])
                if name != "off":
                    start = time.perf_counter_ns()
                    rm.save(folder, index=False)
                    saves.append((time.perf_counter_ns() - start) / 1e3)
                rm.routing_step(True)
    megatron_capture._to_host = new_to_host
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"routing capture's host time per router call, us: {stats.HEADER} "
          f"({device}, {args.layers} layers x {args.tokens} tokens, top-2, {args.rounds} rounds x {args.steps} steps)")
    for name, values in times.items():
        if values:
            print(f"  {name:28}{stats.cells(values)}")
    print(f"save() of a step's record ({args.layers} layers), us: {stats.cells(saves)}; "
          f"median {statistics.median(saves) / 1e3:.2f} ms a step on the saver thread")


if __name__ == "__main__":
    main()
