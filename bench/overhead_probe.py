"""Run the training example and report what the process cost besides its step times.

    python bench/overhead_probe.py examples/train_moe.py --steps 30 ...

The example runs as it does alone (its own main(), its own step lines).  The last
line of stdout is ``overhead-probe: {json}``: peak device memory (allocated and
reserved by torch's caching allocator), peak host RSS, the process's user and system
CPU seconds, peak pinned host memory (torch's caching host allocator), the wall time from the first step
to the end of the dump writer's final flush, the flush alone, what the capabilities' state() counters say (dump, routing,
trace, where loaded), and changes of a few /proc/vmstat counters over the run (page
faults, pages dirtied and written back, reclaim): what tells a disk-bound run from a
memory-bound one.  overhead_bench.py reads it.

With ``OVERHEAD_PROBE_BLOCK=K`` the process runs in blocks of K steps: before each it
prints ``overhead-probe: ready`` and waits for a line on stdin (overhead_bench.py's
resident mode keeps one process per variant alive and alternates their blocks, so a
round costs no process start and the variants share the machine's drift).

With ``OVERHEAD_PROBE_SWAP=SPECS`` as well (overhead_bench.py --swap) the line a block
waits for names the code it runs: ``patched`` (what the process imported) or ``kept``
(what the comma-separated SPECS alone make: code_swap.py swaps every function the other
specs changed); the report gains ``swap``, what was swapped.

With ``OVERHEAD_PROBE_GRAPHS=1`` the model's routers run as Megatron's own CUDA graphs
(graph_bench.graphed_model).

With ``OVERHEAD_PROBE_TORCH_PROFILE=FIRST:COUNT`` steps FIRST..FIRST+COUNT-1 (from 1) run
under torch.profiler (CPU and CUDA): before the report, its table of the operators and
runtime calls by their own host time (``overhead-profile:`` lines): where a host-side
synchronisation (cudaStreamSynchronize, aten::item) or a slow launch sits.

With ``OVERHEAD_PROBE_CALLS=1`` every ``__sp__`` name is wrapped before the example
imports anything patched: the report gains ``calls``, per name the number of calls and
the nanoseconds spent in them over the run (timed inside the wrapper: what the call
sites of an inert spec cost, plus the timer's own ~0.1 us a call); with
``OVERHEAD_PROBE_CALLS_FROM=N`` too, only from step N on (from 1: the warm-up's first
kernel loads and allocations left out).  It also gains ``gc``: per generation, Python's
garbage collections over the same steps and the nanoseconds they took (a collection
runs inside whatever call allocated last: a call site that allocates more makes them
come sooner, and one that happens to trigger one looks slow).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time

import training  # bench/: loads the example

VMSTAT = ("pgfault", "pgmajfault", "nr_dirtied", "nr_written", "pgalloc_normal", "pgfree",
          "allocstall_normal", "pgsteal_kswapd", "pgsteal_direct", "thp_fault_alloc")


def vmstat() -> dict:
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {k: int(v) for k, v in pairs if k in VMSTAT or k in ("nr_dirty", "nr_writeback")}
    except OSError:
        return {}


def capability_states() -> dict:
    """The state() counters of each capability the run loaded (nothing is imported here)."""
    out: dict = {}
    for name, module in (("dump", "source_patch.runtime.dump.api"), ("routing", "source_patch.runtime.routing.megatron.control"),
                         ("trace", "source_patch.runtime.trace.control")):
        api = sys.modules.get(module)
        if api is not None:
            try:
                state = api.state()
                out[name] = {"enabled": state.get("enabled"), **state.get("counters", {})}
            except Exception as exc:  # noqa: BLE001 - a probe reports, it does not fail the run
                out[name] = {"error": repr(exc)}
    return out


def pinned_peak(torch) -> int:
    """Peak bytes of torch's caching host (pinned) allocator, where this torch reports it:
    page-locked memory the RSS does not show."""
    try:
        got = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    except Exception:  # noqa: BLE001 - an older torch
        return 0
    return int(got.get("reserved_bytes.peak", got.get("allocated_bytes.peak", 0)) or 0)


def count_calls() -> dict:
    """Wrap every __sp__ name (runtime/facade.py) with a counter and a timer."""
    import importlib

    from source_patch.runtime import facade

    counts: dict = {}
    for name, where in facade.exports().items():
        try:
            module = importlib.import_module(f"source_patch.runtime.{where}")
        except ImportError:  # a capability whose dependencies this machine lacks: never called here
            continue
        real = getattr(module, name, None)
        if real is None:
            continue
        counts[name] = [0, 0]
        setattr(module, name, timed(real, counts[name]))
    return counts


def timed(real, cell: list):
    """``real`` wrapped: each call adds 1 to ``cell[0]`` and its nanoseconds to ``cell[1]``."""
    def wrapped(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return real(*args, **kwargs)
        finally:
            cell[0] += 1
            cell[1] += time.perf_counter_ns() - start

    return wrapped


def count_collections() -> dict:
    """Python's garbage collections, per generation: [collections, ns] (gc.callbacks)."""
    counts = {gen: [0, 0] for gen in range(3)}
    started = [0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            cell = counts[info["generation"]]
            cell[0] += 1
            cell[1] += time.perf_counter_ns() - started[0]

    gc.callbacks.append(callback)
    return counts


def torch_profiler():
    import torch

    kinds = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=kinds)


def print_profile(profiler, steps: int) -> None:
    """The operators and runtime calls by their own host time, per step (and their own
    device time: a call slow on the host because the device is behind shows up there)."""
    rows = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:40]
    print(f"overhead-profile: {'name':<48} {'calls/step':>10} {'self host us/step':>18} {'self device us/step':>20}",
          flush=True)
    for e in rows:
        device = getattr(e, "self_device_time_total", 0) or 0
        print(f"overhead-profile: {e.key[:48]:<48} {e.count / steps:10.1f} {e.self_cpu_time_total / steps:18.1f}"
              f" {device / steps:20.1f}")


def graphed(example) -> None:
    """The example's model with Megatron's router CUDA graphs (graph_bench.py's), and
    the graph-safe RNG Megatron's graphs need."""
    import graph_bench  # bench/

    seed = example.model_parallel_cuda_manual_seed
    example.model_parallel_cuda_manual_seed = lambda s: seed(s, use_cudagraphable_rng=True)
    example.build_model = lambda args, device: graph_bench.graphed_model(example, args)


def main() -> None:
    counts = count_calls() if os.environ.get("OVERHEAD_PROBE_CALLS") == "1" else None
    collections = count_collections() if counts is not None else None
    example = training.load_example(sys.argv)  # the example parses its own flags
    if os.environ.get("OVERHEAD_PROBE_GRAPHS") == "1":
        graphed(example)
    marks = {"first_step": None, "flush_s": 0.0}
    train_step = example.train_step
    block = int(os.environ.get("OVERHEAD_PROBE_BLOCK", "0"))
    keep = os.environ.get("OVERHEAD_PROBE_SWAP")
    make_batch = example.make_batch

    def waiting_batch(dataset, index, args):  # main() makes a step's batches before it starts its clock
        if block and index % (args.micro_batches * block) == 0:  # resident mode: wait for this block's turn
            print("overhead-probe: ready", flush=True)
            code = sys.stdin.readline().strip()
            if not code:
                raise SystemExit(0)  # the bench is gone
            if keep:
                swap(code)
        return make_batch(dataset, index, args)

    def swap(code: str) -> None:  # made at the first block: every patched module is imported by then
        if "swap" not in marks:
            import code_swap  # bench/

            marks["swap"] = code_swap.CodeSwap(set(keep.split(",")))
        marks["swap"].use(code)

    example.make_batch = waiting_batch

    calls_from = int(os.environ.get("OVERHEAD_PROBE_CALLS_FROM", "0"))
    profile = os.environ.get("OVERHEAD_PROBE_TORCH_PROFILE")
    first, count = (int(x) for x in profile.split(":")) if profile else (0, 0)

    def timed_step(*args, **kwargs):
        if marks["first_step"] is None:
            marks["first_step"] = time.perf_counter()
        marks["steps"] = marks.get("steps", 0) + 1
        if counts is not None and marks["steps"] == calls_from:  # warm-up's calls left out
            for cell in (*counts.values(), *collections.values()):
                cell[0] = cell[1] = 0
        if marks["steps"] == first:
            marks["profiler"] = torch_profiler()
            marks["profiler"].__enter__()
        try:
            return train_step(*args, **kwargs)
        finally:
            if marks["steps"] == first + count - 1 and "profiler" in marks:
                marks["profiler"].__exit__(None, None, None)
                print_profile(marks.pop("profiler"), count)

    example.train_step = timed_step  # main() looks it up at each step
    report_dumps = example.report_dumps

    def timed_report(*args, **kwargs):  # its flush: what the writer still had to write when training ended
        start = time.perf_counter()
        try:
            return report_dumps(*args, **kwargs)
        finally:
            marks["flush_s"] += time.perf_counter() - start

    example.report_dumps = timed_report
    before = vmstat()
    example.main()
    end = time.perf_counter()
    after = vmstat()
    import torch

    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "device_peak_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        "device_peak_reserved": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0,
        "host_peak_rss": usage.ru_maxrss * 1024,  # Linux: KiB
        "pinned_peak": pinned_peak(torch),
        "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
        "run_s": end - (marks["first_step"] or end), "flush_s": marks["flush_s"],
        "states": capability_states(),
        "vmstat": {k: after[k] - before.get(k, 0) for k in after if k in VMSTAT},
        "vmstat_end": {k: after[k] for k in ("nr_dirty", "nr_writeback") if k in after},
    }
    if "swap" in marks:
        report["swap"] = marks["swap"].describe()
    if counts is not None:
        report["calls"] = {name: {"calls": n, "ns": ns} for name, (n, ns) in counts.items() if n}
        report["gc"] = {str(gen): {"collections": n, "ns": ns} for gen, (n, ns) in collections.items()}
    print("overhead-probe: " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
