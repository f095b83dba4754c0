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
import resource
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


def busy(seconds: float) -> None:
    """The training thread's own Python, holding the GIL as the host-bound model's does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(100):
            i * i


def thread_switches(native_ids: list) -> int:
    """Voluntary context switches of these threads of this process (Linux; else 0)."""
    total = 0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration, ValueError):
            pass
    return total


def saver_block(mode: str, args, ids, shape, folder: str) -> tuple[float, float, float, float]:
    """(the training thread's voluntary switches, the saver thread's CPU ms, the step's ms,
    the saver thread's voluntary switches: each a wait for work or for the GIL), per step,
    over ``--saver-steps`` steps of ``mode`` (after 2 untimed ones)."""
    rm.configure(mode=mode, dir=folder if mode == "capture" else "")
    rm.reset()
    x = torch.empty(shape, device=ids.device)
    share = args.busy_ms / 1e3 / args.layers
    switches = cpu = start = waits = 0.0
    clocks: list = []
    tids: list = []
    for step in range(args.saver_steps + 2):
        if step == 2:
            saver = megatron_capture._saver  # started by the first step's save
            clocks = [time.pthread_getcpuclockid(t.ident) for t in (saver._threads if saver else ())]
            tids = [t.native_id for t in (saver._threads if saver else ())]
            waits = thread_switches(tids)
            switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            cpu = sum(time.clock_gettime(c) for c in clocks)
            start = time.perf_counter()
        rm.routing_schedule(False)
        rm.routing_microbatch_begin()
        for layer in range(1, args.layers + 1):
            busy(share)
            router = SimpleNamespace(layer_number=layer, config=SimpleNamespace(sequence_parallel=False,
                                                                                num_moe_experts=8))
            rm.routing_enter(router, x)
            rm.routing_topk(None, (None, ids))
            rm.routing_exit()
        rm.routing_microbatch_end()
        rm.routing_schedule_end()
        rm.routing_step(True)
    elapsed = time.perf_counter() - start
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches
    if megatron_capture._saver is not None:
        megatron_capture._saver.submit(lambda: None).result()  # the last steps' saves, not an index write
    cpu = sum(time.clock_gettime(c) for c in clocks) - cpu
    waits = thread_switches(tids) - waits
    n = args.saver_steps
    return switches / n, cpu / n * 1e3, elapsed / n * 1e3, waits / n


def saver_probe(args, ids, folder: str) -> None:
    rows: dict = {"off": [], "capture": []}
    shape = (ids.shape[0] // 4, 4, 8)
    for r in range(args.saver_rounds):
        for mode in ("off", "capture") if r % 2 == 0 else ("capture", "off"):
            rows[mode].append(saver_block(mode, args, ids, shape, folder))
    rm.configure(mode="off", dir="")
    print(f"the saver in the background, per step (a training thread busy {args.busy_ms:g} ms a step in Python, "
          f"{args.layers} layers x {ids.shape[0]} tokens, 1 microbatch; {args.saver_rounds} rounds x "
          f"{args.saver_steps} steps), median [min..max] of rounds:")
    for mode, values in rows.items():
        cols = [sorted(v[i] for v in values) for i in range(4)]
        cell = [f"{statistics.median(c):.2f} [{c[0]:.2f}..{c[-1]:.2f}]" for c in cols]
        print(f"  {mode:8} training thread's voluntary switches {cell[0]}   saver CPU ms {cell[1]}   "
              f"saver's voluntary switches {cell[3]}   step ms {cell[2]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="steps a variant runs each round")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--saver-rounds", type=int, default=6, help="rounds of the saver probe (0: skip it)")
    p.add_argument("--saver-steps", type=int, default=30, help="steps a variant of the saver probe runs each round")
    p.add_argument("--busy-ms", type=float, default=20.0, help="the saver probe's training thread: Python a step")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.tokens = 3, 3, 256
        args.saver_rounds, args.saver_steps = min(args.saver_rounds, 2), min(args.saver_steps, 10)
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
    if args.saver_rounds > 0:
        saver_probe(args, ids, folder)


if __name__ == "__main__":
    main()
