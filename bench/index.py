"""The benches' one entry point: what each measures, where it runs, how long it takes.

    python bench/index.py                 # the list
    python bench/index.py NAME [ARGS...]  # run bench NAME with ARGS (its own --help tells more)

Every bench prints its own table; results with machine and date go in
docs/benchmarks.md (the goals) and docs/bench-notes/ (the dated runs).  Shared
helpers (``HELPERS``): ``stats.py`` (bootstrap intervals, ratios, and the
``min / median [90% interval]`` cell every bench prints a timing as), ``training.py`` (runs
the Megatron example as a timed subprocess), ``gc_probe.py`` (the collector's and a due
call's time), ``overhead_probe.py`` (a training process's peak memory, CPU and
capability counters), ``machine_probe.py`` (fresh memory, disk, pinned allocation),
``import_table.py`` (import_bench.py's table), ``weight_sync_phases.py`` (weight_sync_bench.py's --phases), ``weight_sync_events.py`` (its --events),
``push_engine.py`` (push_bench.py's --engine), ``push_common.py`` (the model and push backend both use),
``sync_receiver.py`` (overhead_bench.py's weight-sync receiver), ``code_swap.py`` (its --swap:
patched functions swapped in place to the code fewer specs make).  ``upstream_tests.py`` (with its pytest plugin ``upstream_adapt.py``) is a
test harness, not a bench: docs/upstream_tests.md.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple


HELPERS = ("index.py", "stats.py", "training.py", "gc_probe.py", "upstream_tests.py", "upstream_adapt.py",
           "overhead_probe.py", "machine_probe.py", "import_table.py", "weight_sync_phases.py", "weight_sync_events.py",
           "push_engine.py", "push_common.py", "sync_receiver.py", "code_swap.py")


class Bench(NamedTuple):
    name: str
    script: str
    where: str
    takes: str
    measures: str


BENCHES = [
    Bench("import", "import_bench.py", "CPU", "~4 min",
          "start-up cost of the hook; real Megatron imports unpatched vs patched (cold, warm cache)"),
    Bench("cold-start", "cold_start_bench.py", "CPU", "~3 min",
          "many ranks importing at once with an empty and a filled code cache"),
    Bench("dump", "dump_bench.py", "GPU (CPU: --device cpu)", "~4 min",
          "a synthetic model's step: no dump / disabled call sites / async runtime / sync torch.save"),
    Bench("dump-step", "dump_step_bench.py", "GPU", "~5 min",
          "the Megatron example's step: no dump spec / spec disabled / dumping every site"),
    Bench("routing", "routing_bench.py", "GPU", "~8 min",
          "the Megatron example's step: no routing spec / spec off / capture / replay"),
    Bench("routing-call", "routing_call_bench.py", "GPU (CPU: --quick)", "~15 s",
          "routing capture's host time per router call (pooled copy vs the side stream it replaced) and save() a step"),
    Bench("graph", "graph_bench.py", "GPU", "~1 min",
          "routing capture on vs off in a step whose routers are Megatron's own CUDA graphs, one process, paired"),
    Bench("trace", "trace_bench.py", "GPU (CPU: --quick)", "~6 min",
          "the Megatron example's step traced vs not, one process, paired ratios with intervals"),
    Bench("compressor", "compressor_bench.py", "GPU", "~1 min",
          "device time per compressor; host time of due trace() calls; publisher and hub CPU per frame"),
    Bench("due-call", "due_call_bench.py", "CPU (GPU: --cuts --gpu)", "~10 s",
          "the planned due trace() call with stand-ins for its CUDA parts: bytecodes run, line by line; warm time "
          "and after other work (cold); --cuts: the call cut after each part, cold (--gpu: the real launch)"),
    Bench("whole-cost", "whole_cost_bench.py", "GPU (CPU: --smoke)", "~9 min a model",
          "each capability's whole cost in one training process, started and stopped between blocks through its "
          "public API (threads, forwarder, rings) vs plain, A/A row; CPU of threads and children, memory; --pool"),
    Bench("call-site-code", "call_site_code.py", "CPU", "~2 s",
          "each __sp__ call site's compiled code here vs a git revision (instructions, names, constants; "
          "docstrings and line numbers left out): which call sites changed"),
    Bench("overhead", "overhead_bench.py", "GPU (CPU: --quick)", "~7 min",
          "the Megatron example's step with each capability, and all at once, vs plain: ratio, memory, bytes/step; "
          "the machine's memory, disk and pinned probes; the first-run cliff of dumping; --resident K: blocks "
          "alternated between live processes, per round, means and 10th-percentile ratios; --pool: runs pooled"),
    Bench("call-profile", "call_profile.py", "GPU (CPU: --quick)", "~1 min a variant",
          "where a variant's step cost goes: each call site's calls and host time a step, torch.profiler's table"),
    Bench("sentinel-parts", "sentinel_parts.py", "GPU (CPU: --quick)", "~1 min",
          "inside the armed sentinels' call sites: their own functions' calls and host time a step"),
    Bench("step-noise", "step_noise.py", "GPU", "~4 min",
          "how noisy the example's steps are under process settings (what a comparison can resolve)"),
    Bench("weight-sync", "weight_sync_bench.py", "2 GPUs (CPU: --cpu)", "~2 min",
          "bucketed trainer-to-engine transfer vs per-tensor vs one raw broadcast, % of raw per round"),
    Bench("weight-sync-host", "weight_sync_host_bench.py", "CPU", "~1 min",
          "the sender's host CPU time per push at 7,239 and 36,169 tensors (planned, packed, buffers), --against REV"),
    Bench("contention", "contention_bench.py", "2 GPUs", "~15 s",
          "a 512 MiB broadcast while the sender's GPU copies or sums beside it (torch's kernels, throttled ones)"),
    Bench("weight-sync-backends", "weight_sync_backends_bench.py", "2 GPUs with --ipc (CPU: --mooncake)", "~1 min",
          "ipc and mooncake: an engine's whole receive vs a raw copy / read of the same bytes, % of raw"),
    Bench("push", "push_bench.py", "GPU, 2 GPUs with --engine (CPU: --cpu)", "~1 min",
          "push() on a real Megatron MoE: host time, and with --engine the whole push to a receiver"),
    Bench("servers", "server_load.py", "CPU", "~1 min",
          "dump endpoint and trace hub latency under 200 concurrent clients and idle sockets"),
    Bench("feature-store", "feature_store_bench.py", "CPU", "~2 min",
          "Mooncake zero-copy vs serialised vs shared folder, put+get per sample"),
    Bench("compare", "compare_bench.py", "CPU", "~1 min",
          "the comparator's throughput on a 1 GiB pair of dump directories"),
]


def table() -> str:
    rows = [("name", "script", "where", "takes", "measures")] + [b[:5] for b in BENCHES]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(table())
        print("\nall GPU parts in one device call: bash bench/gpu_session.sh [PART...] (see its header)")
        print("code versions A/B'd on one machine: bash bench/ab_wheels.sh (see its header)")
        return 0
    by_name = {b.name: b for b in BENCHES} | {b.script.removesuffix(".py"): b for b in BENCHES}
    bench = by_name.get(argv[0])
    if bench is None:
        print(f"no bench named {argv[0]!r}; `python bench/index.py` lists them", file=sys.stderr)
        return 2
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), bench.script)
    os.execv(sys.executable, [sys.executable, script, *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
