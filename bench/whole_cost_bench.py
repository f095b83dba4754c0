"""The whole cost of each capability as a user pays it, not only its call sites (issue 59).

    python bench/whole_cost_bench.py --budget-s 520              # GPU: the issue's host-bound model
    python bench/whole_cost_bench.py --model gpubound --budget-s 520
    python bench/whole_cost_bench.py --smoke                     # CPU: a tiny model, the logic only (~1 min)
    python bench/whole_cost_bench.py --smoke --model cpu --rounds 8   # CPU: a larger model (profiling)
    python bench/whole_cost_bench.py --pool a.json b.json        # runs' rounds pooled (their --save)
    bash bench/gpu_session.sh wholecost                          # on the lent GPU machine (one 10-minute call)

**Method: blocks in one long-lived training process, each capability really started
and stopped between blocks through its public control API.**  One worker process
(this file, ``--worker``) runs the real Megatron example (examples/train_moe.py's
model, schedule and optimizer) under
``SOURCE_PATCH=megatron_cpu,routing,dump,trace,weight_sync`` with everything off.
The driver (this process) asks it for blocks, variant after variant, in an order that
rotates every round.  For each block the worker

1. puts in place the code the variant runs: ``plain`` runs what ``megatron_cpu`` alone
   makes (code_swap.py swaps every function another spec changed back to its unpatched
   code: no call site at all), every other variant the patched code;
2. starts the capability through the configure a user calls (``trace.configure(enable=
   True, port=...)``: the hub's forwarder process, its reader thread, the publisher
   thread, the pinned ring's first use; ``dump.configure(enable=True, ...)``: the writer
   thread and its pinned pool at the first record, here with a name filter that no
   record passes, or layer 1 every 10th step; ``routing.configure(mode="capture")``:
   the saver thread, its pinned pool);  a trace client (runtime/trace/client.py, in this
   driver process, as a user's would be in another) connects and subscribes to every
   layer's output before the configure returns (setting ``wait``);
3. runs warm-up steps: at least ``--warmup-steps``, ``--settle-s`` seconds from the
   block's start, and until the child processes it started use under 0.2 of a core (the
   trace forwarder imports torch in the background after it answers) over 0.25 s, at
   most ``--quiet-max-s`` longer;
4. times ``--block-steps`` steps, sampling around them the CPU time of every thread of
   the process (/proc/self/task/*/schedstat, ns) and of every child process (the
   forwarder: /proc/<pid>/task/*/schedstat), the training thread's context switches,
   the collector (gc.callbacks), resident, pinned and device memory;
5. stops the capability through its public close (``trace.close()``: clients closed,
   forwarder process ended, publisher joined; ``dump.configure(enable=False)`` +
   ``close()``; ``routing.configure(mode="off")`` + ``close()`` + ``reset()``: saver shut
   down, pools released).

**Why this sees the whole cost.**  Everything a capability adds runs during its timed
steps and not during plain's: its threads (taking the GIL from the training thread),
its child process (taking a core, memory bandwidth), its pinned memory and pools, its
extra streams and events, the collector's work on the objects it holds, and its call
sites.  The swap bench (overhead_bench.py --swap) keeps a capability's threads alive in
both halves, so it sees the call sites only.  One process against itself, rather than
processes against each other, because two identical processes of the host-bound model
differ by ~1% for their whole lives (docs/bench-notes/overhead.md), which no number of
rounds of the same processes averages out.

**What it does not see.**  What a spec costs once per process and keeps: the runtime's
import, module-level edits, the trace ring (mapped and page-locked at its first use and
kept until exit, by design: ring.py), Triton's compiled kernels, torch's caching host
allocator's cache (pinned blocks freed by a capability stay cached for the process).
Those are present in plain's blocks too once a capability ran; the warm-up round (every
variant once, untimed, first) reports each one's first-start growth of resident and
pinned memory.  Start-up and teardown themselves are timed apart (``start s``,
``stop s``), not in the steps.

**Statistics.**  Rounds: every variant's block once, in an order that rotates each
round.  Per variant: its block medians as ``min / median [90% interval]``, and against
``plain`` of the same round (paired): the median over rounds of the ratio of block
medians, and the ratio of mean step times, each with a bootstrap 90% interval over
rounds (stats.py; with --pool the runs are resampled first, then their rounds).
``plain again`` is plain in its own blocks: the A/A row, the resolution of the run.  On
the host-bound model the step moves between regimes for a second or two at a time
(+15-25%, every variant alike), which blocks of a few steps cannot average out: the
bench prints what its A/A row resolves and how many rounds ±0.3% would take (rounds of
several runs pool with --pool; fewer --variants make a round shorter).

Goals (issue 59 item 3), each judged on the per-round ratio's 90% interval: met where
its upper end is within the goal, not met where its lower end is above it, else not
resolved.  The resources are per timed step, the median over rounds: CPU of the training
thread, of the process's other threads and of its child processes (the client's, in
this process, apart), the training thread's voluntary context switches (each a wait:
for the GIL, a device sync, a lock), the collector's collections and time; resident
memory of the process and of its children, pinned memory (torch.cuda.host_memory_stats'
allocated_bytes, which keeps what the caching host allocator holds for the process's
life; the trace ring where page-locked by the driver, which torch does not count), device
memory (peak allocated in the block, reserved), each against plain's block of the same
round.  Then which threads and children took the CPU, by name, and what each variant's
blocks did (trace results and client frames, dump records written and filtered, routes
saved, child processes): a variant that did not turn its capability on measured nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import stats  # bench/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

BASE = "megatron_cpu"  # Megatron-Core 0.16 needs it without Transformer Engine, on a GPU too
SPECS = f"{BASE},routing,dump,trace,weight_sync"
TOKEN = "whole-cost-bench"
LINE = "whole-cost: "  # the worker's protocol lines on its stdout (everything else is the example's)
PREFIXES = ("SOURCE_PATCH_DUMP", "SOURCE_PATCH_ROUTING", "SOURCE_PATCH_TRACE", "SOURCE_PATCH_WEIGHT_SYNC")
NO_NAME = "whole-cost-bench-no-such-record"  # dump's name filter that nothing passes
SPARSE_STEPS = list(range(0, 100_000, 10))  # "every 10th step" (dump's step counts patched optimizer steps)


class Variant(NamedTuple):
    """What a variant's blocks run: the patched code or megatron_cpu's alone (``kept``),
    dump (None, "filtered": on with a filter nothing passes, "sparse": layer 1 every
    10th step), routing capture, trace (on, serving a hub) and a client on every layer."""
    kept: bool = False
    dump: str | None = None
    routing: bool = False
    trace: bool = False
    client: bool = False


VARIANTS = {
    "plain": Variant(kept=True),
    "plain again": Variant(kept=True),  # the A/A row
    "every spec inert": Variant(),
    "trace enabled, no client": Variant(trace=True),
    "trace, 1 client": Variant(trace=True, client=True),
    "dump on, all filtered": Variant(dump="filtered"),
    "routing capture": Variant(routing=True),
    "everything at once": Variant(dump="sparse", routing=True, trace=True, client=True),
}
# (variant, goal in %, where it is set): issue 59 item 3; its title says +1% for tracing
GOALS = (("every spec inert", 0.5, "issue 59 item 3"), ("trace enabled, no client", 0.5, "issue 59 item 3"),
         ("trace enabled, no client", 1.0, "issue 59's title"), ("trace, 1 client", 1.0, "issue 59 item 3"),
         ("routing capture", 1.0, "issue 59 item 3"), ("everything at once", 2.0, "issue 59 item 3"))
MODELS = {  # the example's size flags
    "hostbound": dict(layers=8, hidden=1024, heads=16, seq_len=1024, micro_batch=4, experts=8, vocab=4096),
    "gpubound": dict(layers=4, hidden=2048, heads=16, seq_len=1024, micro_batch=4, experts=8, vocab=4096),
    "smoke": dict(layers=2, hidden=64, heads=4, seq_len=32, micro_batch=8, experts=4, vocab=128),
    # --smoke --model cpu: a larger model on the CPU, for profiling
    "cpu": dict(layers=4, hidden=256, heads=4, seq_len=256, micro_batch=4, experts=8, vocab=1024),
}
RESOLVE = 0.3  # %: the half-width of the A/A interval the issue asks for
QUIET = 0.2  # cores: the child processes' load under which a block's warm-up may end (a starting
# forwarder takes a core, 0.3-0.5 of one on a loaded 2-core VM; one serving a client ~0.05)


# ====================================================================== the worker (the training process)


class Probe:
    """What the process and its children cost between two samples: CPU per thread and
    per child (schedstat: nanoseconds on a CPU), the training thread's context switches,
    the collector's collections and time."""

    def __init__(self):
        self.pid = os.getpid()
        self.gc_count = [0, 0, 0]
        self.gc_s = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_count[info["generation"]] += 1

    @staticmethod
    def _ns(path: str) -> int:
        try:
            with open(path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def _children(self) -> dict:
        """pid -> (comm, {tid: CPU ns}, RSS bytes) of this process's children."""
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(rest[1]) != self.pid:
                continue
            try:
                ns = {int(tid): self._ns(f"/proc/{entry}/task/{tid}/schedstat")
                      for tid in os.listdir(f"/proc/{entry}/task")}
            except OSError:
                continue
            out[int(entry)] = (comm, ns, _status_kib(f"/proc/{entry}/status").get("VmRSS", 0) * 1024)
        return out

    @staticmethod
    def _spent(before: dict, after: dict) -> float:
        """Seconds of CPU between two {key: ns} readings (a key gone since: not counted)."""
        return sum(ns - before.get(key, 0) for key, ns in after.items()) / 1e9

    def children_load(self, last: tuple | None = None) -> tuple:
        """(cores the children used since ``last``, the reading to pass next time)."""
        now = (time.perf_counter(), {(pid, tid): ns for pid, (_, tids, _) in self._children().items()
                                     for tid, ns in tids.items()})
        if last is None:
            return 0.0, now
        return self._spent(last[1], now[1]) / max(now[0] - last[0], 1e-6), now

    def sample(self) -> dict:
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads = {}
        for tid in os.listdir("/proc/self/task"):
            name = names.get(int(tid))
            if name is None:
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    continue
            threads[int(tid)] = (name, self._ns(f"/proc/self/task/{tid}/schedstat"))
        main = _status_kib(f"/proc/self/task/{self.pid}/status",
                           ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        return {"time": time.perf_counter(), "threads": threads, "children": self._children(), "ctx": main,
                "gc": list(self.gc_count), "gc_s": self.gc_s}

    def between(self, a: dict, b: dict) -> dict:
        """The cost from sample ``a`` to ``b``: seconds of CPU by thread name (the training
        thread as ``main``) and by child, context switches, collections."""
        others: dict = {}
        for tid, (name, ns) in b["threads"].items():
            spent = (ns - a["threads"].get(tid, (name, 0))[1]) / 1e9
            key = "main" if tid == self.pid else name
            others[key] = others.get(key, 0.0) + spent
        children: dict = {}
        for pid, (comm, tids, _) in b["children"].items():
            children[comm] = children.get(comm, 0.0) + self._spent(a["children"].get(pid, (comm, {}, 0))[1], tids)
        return {"wall_s": b["time"] - a["time"], "main_cpu_s": others.pop("main", 0.0), "threads_cpu_s": others,
                "children_cpu_s": children, "children_rss": sum(c[2] for c in b["children"].values()),
                "children_n": len(b["children"]),
                "voluntary": b["ctx"].get("voluntary_ctxt_switches", 0) - a["ctx"].get("voluntary_ctxt_switches", 0),
                "involuntary": (b["ctx"].get("nonvoluntary_ctxt_switches", 0)
                                - a["ctx"].get("nonvoluntary_ctxt_switches", 0)),
                "gc": [y - x for x, y in zip(a["gc"], b["gc"])], "gc_s": b["gc_s"] - a["gc_s"]}


def _status_kib(path: str, keys: tuple = ("VmRSS", "VmPin", "VmLck")) -> dict:
    """Fields of a /proc status file (kB values as numbers)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


class Trainer:
    """The example's model, optimizer and data in this process, and its step."""

    def __init__(self, size: dict, smoke: bool):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import training  # bench/: loads the example as a module, not run

        flags = [f"--{key.replace('_', '-')}={value}" for key, value in size.items()]
        self.example = example = training.load_example([sys.argv[0], str(training.EXAMPLE), *flags])
        import torch

        self.torch = torch
        args = example.parse_args(flags)
        args.device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
        self.device = torch.device(args.device)
        example.check_cpu_spec(self.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # as the example does
        example.init_distributed(self.device, args.ep)
        torch.manual_seed(args.seed)
        if self.device.type == "cuda":
            example.model_parallel_cuda_manual_seed(args.seed)
        self.args = args
        self.model = example.build_model(args, self.device)
        self.optimizer = example.build_optimizer(self.model, args)
        self.dataset = example.make_dataset(args, self.device)
        self.index = 0

    def step(self) -> float:
        """One optimizer step; its time in ms (the example's clock: it ends with a host sync)."""
        args = self.args
        batches = [self.example.make_batch(self.dataset, self.index * args.micro_batches + m, args)
                   for m in range(args.micro_batches)]
        self.index += 1
        start = time.perf_counter()
        self.example.train_step(self.model, self.optimizer, batches, args)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.example.close_weight_sync()
        self.example.parallel_state.destroy_model_parallel()
        self.torch.distributed.destroy_process_group()


class Capabilities:
    """Each capability started and stopped through its public control API."""

    def __init__(self, folder: str):
        from source_patch.runtime.dump import api as dump
        from source_patch.runtime.routing.megatron import control as routing
        from source_patch.runtime.trace import control as trace

        self.dump, self.routing, self.trace, self.folder = dump, routing, trace, folder
        self.on: Variant = Variant(kept=True)

    def start(self, v: Variant, block: int, port: int, wait: float) -> None:
        where = os.path.join(self.folder, f"block-{block}")
        if v.dump:
            flt = dict(names=[NO_NAME]) if v.dump == "filtered" else dict(layers=[1], steps=SPARSE_STEPS)
            self.dump.configure(enable=True, dir=os.path.join(where, "dump"), exp_name="run", **flt)
        if v.routing:
            self.routing.configure(mode="capture", dir=os.path.join(where, "routing"))
        if v.trace:
            self.trace.configure(enable=True, port=port, token=TOKEN, dir=os.path.join(self.folder, "trace"),
                                 wait=wait if v.client else 0.0)
        self.on = v

    def stop(self) -> None:
        v, self.on = self.on, Variant(kept=True)
        if v.trace:
            self.trace.close()
            self.trace.configure(enable=False, port=0, wait=0.0)
        if v.dump:
            self.dump.configure(enable=False, names=None, layers=None, steps=None)
            self.dump.close()
        if v.routing:
            self.routing.configure(mode="off")
            self.routing.close()
            self.routing.reset()

    def counters(self) -> dict:
        """The capabilities' own counters (deltas over a block say it did what it claims)."""
        out = {}
        try:  # api's snapshot, not trace.state(): that asks the forwarder for its hub's statistics (a round trip)
            t = self.trace.api.snapshot()
            counts = t.get("counters") or t
            out.update(trace_results=counts.get("results", 0), trace_dropped=counts.get("dropped", 0),
                       trace_subscriptions=t.get("subscriptions", 0),
                       publisher_cpu_s=(t.get("cost_seconds") or {}).get("publisher_cpu", 0.0))
        except Exception as exc:  # noqa: BLE001 - a bench reports, it does not fail the run
            out["trace_error"] = repr(exc)
        try:
            state = self.dump.state()
            counts = state.get("counters") or state
            out.update(dump_records=counts.get("records", 0), dump_filtered=counts.get("filtered", 0))
        except Exception as exc:  # noqa: BLE001
            out["dump_error"] = repr(exc)
        try:
            state = self.routing.state()
            out["routing_saved"] = (state.get("counters") or state).get("records_saved", 0)
        except Exception as exc:  # noqa: BLE001
            out["routing_error"] = repr(exc)
        return out


def memory(torch) -> dict:
    """Resident, pinned and device memory now (device: the peak since the block's start)."""
    status = _status_kib("/proc/self/status")
    out = {"rss": status.get("VmRSS", 0) * 1024, "vm_pinned": status.get("VmPin", 0) * 1024,
           "vm_locked": status.get("VmLck", 0) * 1024, "pinned": None, "pinned_reserved": None, "ring": 0,
           "device_peak": None, "device_reserved": None}
    ring = sys.modules.get("source_patch.runtime.trace.ring")
    if ring is not None and ring._ring is not None and ring._ring.pinned:
        out["ring"] = ring._ring.size  # page-locked by the driver: torch's counters do not see it
    if torch.cuda.is_available():
        try:
            host = torch.cuda.host_memory_stats()
            out["pinned"] = host.get("allocated_bytes.current", 0)
            out["pinned_reserved"] = host.get("reserved_bytes.current", 0)
        except Exception:  # noqa: BLE001 - an older torch: not measurable
            pass
        out["device_peak"] = torch.cuda.max_memory_allocated()
        out["device_reserved"] = torch.cuda.memory_reserved()
    return out


def worker(config: dict) -> None:
    """The training process: blocks as the driver asks for them on stdin."""
    def say(message: dict) -> None:
        print(LINE + json.dumps(message), flush=True)

    if config.get("switch_interval"):
        sys.setswitchinterval(config["switch_interval"])
    probe = Probe()
    started = time.perf_counter()
    trainer = Trainer(config["size"], config["smoke"])
    torch = trainer.torch
    caps = Capabilities(config["folder"])
    first = [trainer.step() for _ in range(2)]  # every patched module imported, the call sites' runtime too
    import code_swap  # bench/

    swap = code_swap.CodeSwap({BASE})
    say({"op": "ready", "pid": os.getpid(), "setup_s": time.perf_counter() - started, "first_ms": first,
         "swap": swap.describe(),
         "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu",
         "torch": torch.__version__, "rss": memory(torch)["rss"]})
    for line in sys.stdin:
        message = json.loads(line)
        if message["op"] == "end":
            break
        v = VARIANTS[message["variant"]]
        begin = time.perf_counter()
        before = memory(torch)
        swap.use("kept" if v.kept else "patched")
        caps.start(v, message["block"], message.get("port", 0), config["wait"])
        start_s = time.perf_counter() - begin
        warm, mark = 0, probe.children_load()[1]
        while True:
            trainer.step()
            warm += 1
            elapsed = time.perf_counter() - begin
            if warm < config["warmup_steps"] or elapsed < config["settle_s"] or time.perf_counter() - mark[0] < 0.25:
                continue
            # and until the child processes it started are done starting (the trace forwarder
            # imports torch after it answers): under QUIET cores over the last 0.25 s or more
            load, mark = probe.children_load(mark)
            if load < QUIET or elapsed > config["settle_s"] + config["quiet_max_s"]:
                break
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        counts = caps.counters()
        a = probe.sample()
        times = [trainer.step() for _ in range(config["block_steps"])]
        b = probe.sample()
        after, counts_after = memory(torch), caps.counters()
        stop = time.perf_counter()
        caps.stop()
        result = {"op": "block", "variant": message["variant"], "times": times, "warmup": warm, "start_s": start_s,
                  "warm_s": a["time"] - begin - start_s,
                  "stop_s": time.perf_counter() - stop, **probe.between(a, b), "memory": after, "memory_before": before,
                  "counters": {k: (counts_after[k] - counts.get(k, 0)) if isinstance(counts_after[k], (int, float))
                               else counts_after[k] for k in counts_after}}
        result["counters"]["trace_subscriptions"] = counts_after.get("trace_subscriptions", 0)
        say(result)
    caps.stop()
    trainer.close()
    say({"op": "end"})


# ====================================================================== the driver


class Worker:
    """The training process, driven block by block over its stdin and stdout."""

    def __init__(self, config: dict, env: dict, log: str):
        import queue

        self.lines: queue.Queue = queue.Queue()
        self.log = open(log, "w+")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(config)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(LINE):
                self.lines.put(json.loads(line[len(LINE):]))
        self.lines.put(None)

    def receive(self, timeout: float) -> dict:
        import queue

        try:
            message = self.lines.get(timeout=timeout)
        except queue.Empty:
            message = None
        if message is None:
            self.fail("no answer" if self.proc.poll() is None else f"exit {self.proc.returncode}")
        return message

    def send(self, message: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.fail("its stdin closed")

    def fail(self, why: str) -> None:
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read()[-4000:]
        if self.proc.poll() is None:
            self.proc.kill()
        raise SystemExit(f"the training process failed ({why}); its stderr ends:\n{tail}")

    def end(self) -> None:
        self.send({"op": "end"})
        try:
            self.receive(120)
            self.proc.wait(60)
        except (SystemExit, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


class Client:
    """A trace client in this process (a thread with its own event loop): connects to the
    worker's hub, subscribes to every layer's output (tiles) and reads every frame until
    the hub closes; ``frames`` and its thread's CPU seconds."""

    def __init__(self, port: int):
        self.port, self.frames, self.cpu_s, self.error = port, 0, 0.0, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        start = time.thread_time()
        try:
            asyncio.run(self._read())
        except Exception as exc:  # noqa: BLE001 - reported with the block
            self.error = f"{type(exc).__name__}: {exc}"
        self.cpu_s = time.thread_time() - start

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        from source_patch.runtime.trace.client import TraceError, connect

        async with connect(f"127.0.0.1:{self.port}", TOKEN, client="whole-cost-bench", retry=120) as c:
            await c.subscribe(["layer_output"], compressor={"kind": "tiles"}, id="tiles")
            try:
                while True:
                    await c.next_frame()
                    self.frames += 1
            except (StopAsyncIteration, TraceError, ConnectionClosed):
                pass

    def join(self) -> None:
        self.thread.join(30)


def environment(folder: str, smoke: bool) -> dict:
    """Every spec active, every capability off (the bench turns them on block by block)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIXES)}
    env.update(SOURCE_PATCH=SPECS, SOURCE_PATCH_DUMP_ENABLE="0", SOURCE_PATCH_DUMP_DIR=os.path.join(folder, "dump"),
               SOURCE_PATCH_ROUTING_MODE="off", SOURCE_PATCH_TRACE_ENABLE="0", SOURCE_PATCH_TRACE_PORT="0",
               SOURCE_PATCH_TRACE_TOKEN=TOKEN, SOURCE_PATCH_TRACE_DIR=os.path.join(folder, "trace"),
               SOURCE_PATCH_WEIGHT_SYNC_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    if smoke:  # the example refuses CPU training where a GPU is visible
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_block(worker: Worker, name: str, block: int) -> dict:
    from source_patch.runtime.core.endpoint import free_port

    v = VARIANTS[name]
    port = free_port() if v.trace else 0
    client = Client(port) if v.client else None
    worker.send({"op": "block", "variant": name, "block": block, "port": port})
    result = worker.receive(600)
    if client is not None:
        client.join()
        result.update(frames=client.frames, client_cpu_s=client.cpu_s, client_error=client.error)
    return result


def measure(args, names: list) -> dict:
    """Start the worker, run the warm-up round and as many timed rounds as the budget
    allows (or --rounds); the run as saved (--save) and printed."""
    begin = time.monotonic()
    run = {"names": names, "rounds": [], "warmup": {}, "config": {}}
    with tempfile.TemporaryDirectory(prefix="whole-cost-") as folder:
        config = {"size": args.size, "smoke": args.smoke, "folder": folder, "block_steps": args.block_steps,
                  "warmup_steps": args.warmup_steps, "settle_s": args.settle_s, "quiet_max_s": args.quiet_max_s,
                  "wait": 120.0,
                  "switch_interval": args.switch_interval}
        run["config"] = {k: v for k, v in config.items() if k != "folder"}
        worker = Worker(config, environment(folder, args.smoke), os.path.join(folder, "worker.log"))
        ready = worker.receive(900)
        run["ready"] = ready
        print(f"{_clock()} training process (pid {ready['pid']}) ready in {ready['setup_s']:.1f} s on "
              f"{ready['device']} "
              f"(torch {ready['torch']}); first steps {', '.join(f'{t:.0f}' for t in ready['first_ms'])} ms; "
              f"RSS {ready['rss'] / 2**20:.0f} MiB", flush=True)
        print(f"code swap: {ready['swap'][:300]}{'...' if len(ready['swap']) > 300 else ''}", flush=True)
        block = 0
        for name in names:  # the warm-up round: every capability's first start (kernels compiled, ring made)
            block += 1
            run["warmup"][name] = run_block(worker, name, block)
            w = run["warmup"][name]
            grew = {key: ((w["memory"].get(key) or 0) - (w["memory_before"].get(key) or 0)) / 2**20
                    for key in ("rss", "pinned", "ring")}
            print(f"{_clock()} warm-up {name:26} start {w['start_s']:.2f} s, warm-up {w['warm_s']:.2f} s "
                  f"({w['warmup']} steps), stop {w['stop_s']:.2f} s; over its first block: RSS {grew['rss']:+.0f} MiB, "
                  f"pinned {grew['pinned']:+.0f} MiB, ring {grew['ring']:+.0f} MiB; children "
                  f"{w['children_rss'] / 2**20:.0f} MiB", flush=True)
        print(f"{_clock()} warm ({time.monotonic() - begin:.0f} s); rounds of {len(names)} blocks of "
              f"{args.block_steps} timed steps (after >= {args.warmup_steps} steps and {args.settle_s:g} s)",
              flush=True)
        r = 0
        last = 0.0
        while r < (args.rounds or 10**9):
            left = args.budget_s - (time.monotonic() - begin) if args.budget_s else None
            if left is not None and left < 1.2 * last + args.reserve_s:
                print(f"{_clock()} budget: {left:.0f} s left, a round takes ~{last:.0f} s: stopping", flush=True)
                break
            t0 = time.monotonic()
            order = names[r % len(names):] + names[:r % len(names)]
            results = {}
            for name in order:
                block += 1
                results[name] = run_block(worker, name, block)
            run["rounds"].append(results)
            r += 1
            last = time.monotonic() - t0
            print(f"{_clock()} round {r} in {last:.1f} s ({time.monotonic() - begin:.0f} s in all)", flush=True)
            if args.save:
                Path(args.save).write_text(json.dumps(run))
            if r % args.table_every == 0:
                report([run], names, final=False)
        worker.end()
    return run


def _clock() -> str:
    return time.strftime("%H:%M:%S")


# ---------------------------------------------------------------------- the tables


def paired(runs: list, name: str, base: str = "plain") -> tuple[list, list, list]:
    """(variant blocks, base blocks, run index) of the rounds where both ran."""
    xs, ys, groups = [], [], []
    for i, run in enumerate(runs):
        for rnd in run["rounds"]:
            if name in rnd and base in rnd and rnd[name]["times"] and rnd[base]["times"]:
                xs.append(rnd[name]["times"])
                ys.append(rnd[base]["times"])
                groups.append(i)
    return xs, ys, groups


def ratios(xs: list, ys: list, groups: list) -> dict:
    """Per-round ratio of block medians (its median over rounds) and ratio of mean step
    times, in %, each (value, low, high) with a bootstrap 90% interval over rounds."""
    per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(xs, ys)]
    median = stats.bootstrap(statistics.median, per_round, groups=groups)

    def mean_ratio(bs, as_):
        return (sum(map(sum, bs)) / sum(map(len, bs))) / (sum(map(sum, as_)) / sum(map(len, as_)))

    means = stats.bootstrap(mean_ratio, xs, ys, paired=True, groups=groups)
    return {"median": tuple((v - 1) * 100 for v in median), "means": tuple((v - 1) * 100 for v in means)}


def cell(triple: tuple | None) -> str:
    if triple is None:
        return "-"
    value, low, high = triple
    return f"{value:+.2f}% ({low:+.2f}..{high:+.2f})"


def verdict(goal: float, triple: tuple | None) -> str:
    """met: the interval's upper end within the goal; not met: its lower end above it."""
    if triple is None:
        return "not measured"
    _, low, high = triple
    return "met" if high <= goal else "not met" if low > goal else "not resolved"


def _per_step(blocks: list, key) -> float | None:
    """The median over blocks of ``key(block)`` per timed step."""
    values = [key(b) / len(b["times"]) for b in blocks if b.get("times")]
    return statistics.median(values) if values else None


def _median(blocks: list, key) -> float | None:
    """The median over blocks of ``key(block)`` (None where no block has it)."""
    values = [key(b) for b in blocks if key(b) is not None]
    return statistics.median(values) if values else None


def _against(runs: list, name: str, key, base: str = "plain") -> float | None:
    """The median over rounds of ``key(block)`` minus plain's of the same round."""
    values = [key(rnd[name]) - key(rnd[base]) for run in runs for rnd in run["rounds"]
              if name in rnd and base in rnd and key(rnd[name]) is not None and key(rnd[base]) is not None]
    return statistics.median(values) if values else None


def _fmt(value, scale: float = 1.0, digits: int = 2, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * scale:+.{digits}f}" if sign else f"{value * scale:.{digits}f}"


def report(runs: list, names: list, final: bool = True) -> dict:
    """The tables; returns {variant: ratios} (for the goals)."""
    out: dict = {}
    rounds = sum(len(run["rounds"]) for run in runs)
    print(f"\n{'whole cost' if final else 'so far'}: {rounds} rounds"
          + (f" of {len(runs)} runs pooled (resampled run first, then its rounds)" if len(runs) > 1 else "")
          + "; 90% intervals: bootstrap over rounds, each variant paired with plain's block of its round")
    print(f"{'variant':26}{'rounds':>7}  {'block medians, ms: ' + stats.HEADER:44}{'vs plain, per round [90%]':28}"
          f"{'vs plain, means [90%]':28}")
    for name in names:
        blocks = [rnd[name] for run in runs for rnd in run["rounds"] if name in rnd and rnd[name]["times"]]
        if not blocks:
            print(f"{name:26}{0:>7}  (no blocks)")
            continue
        meds = [statistics.median(b["times"]) for b in blocks]
        row = {}
        if name != "plain":
            xs, ys, groups = paired(runs, name)
            if len(xs) >= 3:
                row = ratios(xs, ys, groups)
        out[name] = row
        label = name + (" (A/A)" if name == "plain again" else "")
        print(f"{label:26}{len(meds):>7}  {stats.cells(meds):44}{cell(row.get('median')):27} "
              f"{cell(row.get('means')):27}")
    if not final:
        print(flush=True)
        return out
    print("\nper timed step (medians over rounds; 'vs plain': minus plain's block of the same round); CPU ms: the "
          "training thread, the process's other threads, its child processes; vol cs: the training thread's voluntary "
          "context switches; MiB: resident (process, children), pinned (torch's host allocator + the trace ring), device")
    print(f"{'variant':26}{'train CPU':>10}{'threads':>9}{'children':>9}{'client':>8}{'vol cs':>8}{'gc':>9}"
          f"{'RSS vs plain':>13}{'children':>9}{'pinned':>8}{'ring':>6}{'dev peak vs':>12}{'reserved vs':>12}"
          f"{'start s':>8}{'warm s':>7}{'stop s':>7}")
    for name in names:
        blocks = [rnd[name] for run in runs for rnd in run["rounds"] if name in rnd and rnd[name]["times"]]
        if not blocks:
            continue
        mem = lambda key: (lambda b: b["memory"].get(key))  # noqa: E731
        gc_text = _fmt(_per_step(blocks, lambda b: sum(b["gc"])), digits=1) + "/" + \
            _fmt(_per_step(blocks, lambda b: b["gc_s"]), 1e3, 2)
        print(f"{name:26}{_fmt(_per_step(blocks, lambda b: b['main_cpu_s']), 1e3):>10}"
              f"{_fmt(_per_step(blocks, lambda b: sum(b['threads_cpu_s'].values())), 1e3):>9}"
              f"{_fmt(_per_step(blocks, lambda b: sum(b['children_cpu_s'].values())), 1e3):>9}"
              f"{_fmt(_per_step(blocks, lambda b: b.get('client_cpu_s', 0.0)), 1e3):>8}"
              f"{_fmt(_per_step(blocks, lambda b: b['voluntary']), digits=1):>8}{gc_text:>9}"
              f"{_fmt(_against(runs, name, mem('rss')), 2**-20, 0, True):>13}"
              f"{_fmt(_median(blocks, lambda b: b['children_rss']), 2**-20, 0):>9}"
              f"{_fmt(_median(blocks, mem('pinned')), 2**-20, 0):>8}"
              f"{_fmt(_median(blocks, mem('ring')), 2**-20, 0):>6}"
              f"{_fmt(_against(runs, name, mem('device_peak')), 2**-20, 0, True):>12}"
              f"{_fmt(_against(runs, name, mem('device_reserved')), 2**-20, 0, True):>12}"
              f"{_median(blocks, lambda b: b['start_s']):>8.2f}{_median(blocks, lambda b: b['warm_s']):>7.2f}"
              f"{_median(blocks, lambda b: b['stop_s']):>7.2f}")
    print("(gc: collections / ms a step; client: the trace client's thread in this driver process; pinned: '-' where "
          "torch reports no host allocator (CPU))")
    _threads(runs, names)
    _checks(runs, names)
    _goals(out)
    _resolution(runs, out)
    return out


def _threads(runs: list, names: list) -> None:
    """Which threads and children took the CPU, per variant (ms a step, median over rounds)."""
    print("\nCPU of the other threads and the child processes, ms a timed step (by thread name or command):")
    for name in names:
        blocks = [rnd[name] for run in runs for rnd in run["rounds"] if name in rnd and rnd[name]["times"]]
        parts = {}
        for key in ("threads_cpu_s", "children_cpu_s"):
            for who in {w for b in blocks for w in b[key]}:
                value = _per_step(blocks, lambda b: b[key].get(who, 0.0))
                if value and value * 1e3 >= 0.005:
                    parts[("child " if key == "children_cpu_s" else "") + who] = value * 1e3
        text = ", ".join(f"{who} {ms:.2f}" for who, ms in sorted(parts.items(), key=lambda kv: -kv[1])[:6])
        print(f"  {name:26}{text or '-'}")


def _checks(runs: list, names: list) -> None:
    """What each variant's blocks did (a variant that did not turn its capability on
    would measure nothing): trace results and frames, dump records, routes saved."""
    print("\nwhat the blocks did (sums over the timed steps of all rounds):")
    for name in names:
        blocks = [rnd[name] for run in runs for rnd in run["rounds"] if name in rnd and rnd[name]["times"]]
        total = lambda key: sum(b["counters"].get(key, 0) for b in blocks)  # noqa: E731
        frames = sum(b.get("frames", 0) for b in blocks)
        errors = {b.get("client_error") for b in blocks} - {None}
        print(f"  {name:26}trace results {total('trace_results')}, dropped {total('trace_dropped')}, client frames "
              f"{frames}; dump records {total('dump_records')}, filtered {total('dump_filtered')}; routes saved "
              f"{total('routing_saved')}; children {max((b['children_n'] for b in blocks), default=0)}"
              + (f"; client errors {sorted(errors)}" if errors else ""))


def _goals(rows: dict) -> None:
    print("\ngoals (issue 59 item 3), on the per-round ratio's 90% interval (means for comparison):")
    for name, goal, where in GOALS:
        row = rows.get(name) or {}
        print(f"  {name:26}<= +{goal:.1f}% ({where}): {verdict(goal, row.get('median')):13} "
              f"per round {cell(row.get('median'))}, means {cell(row.get('means'))}")


def _resolution(runs: list, rows: dict) -> None:
    row = (rows.get("plain again") or {}).get("median")
    if row is None:
        print("\nresolution: no A/A row (plain again) with 3 rounds or more")
        return
    half = (row[2] - row[1]) / 2
    rounds = sum(len(run["rounds"]) for run in runs)
    need = rounds * (half / RESOLVE) ** 2
    print(f"\nresolution: the A/A row's 90% interval is {row[1]:+.2f}..{row[2]:+.2f}% (half-width {half:.2f}%); "
          + (f"within the issue's ±{RESOLVE}%" if half <= RESOLVE else
             f"±{RESOLVE}% would take ~{need:.0f} rounds like these (1/sqrt(rounds); pool runs with --pool)"),
          flush=True)


# ---------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (python -c 'import whole_cost_bench; "
                                       "help(whole_cost_bench)') for the method.")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny model, 3 rounds of 3-step blocks (the logic)")
    p.add_argument("--model", choices=("hostbound", "gpubound", "cpu"), default=None,
                   help="hostbound (default on a GPU: 8 MoE layers, hidden 1024, seq 1024 x micro-batch 4), gpubound "
                        "(4 layers, hidden 2048); with --smoke: cpu (4 layers, hidden 256, seq 256 x 4) for profiling")
    p.add_argument("--variants", default="",
                   help="variant names separated by ';' (plain is always first; default: all): "
                   + "; ".join(VARIANTS))
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="wall seconds for the whole run, start-up included: no round starts that would not end "
                        "--reserve-s before it (0: --rounds only)")
    p.add_argument("--reserve-s", type=float, default=20.0, help="kept for the end of the run (default 20)")
    p.add_argument("--rounds", type=int, default=0, help="at most this many timed rounds (0: as the budget allows)")
    p.add_argument("--block-steps", type=int, default=None, help="timed steps a block (GPU 6, smoke 3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps after each switch, untimed (GPU 2, smoke 1)")
    p.add_argument("--settle-s", type=float, default=None,
                   help="... and at least this long from the block's start (GPU 0.5, smoke 0)")
    p.add_argument("--quiet-max-s", type=float, default=None,
                   help="... and until its child processes use under 0.2 of a core, at most this much longer "
                        "(GPU 10, smoke 3)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval in the training process (0: Python's 5 ms)")
    p.add_argument("--table-every", type=int, default=5, help="print the step table every N rounds")
    p.add_argument("--save", metavar="JSON", help="write the run here after every round")
    p.add_argument("--pool", nargs="+", metavar="JSON", help="the tables of saved runs pooled; runs nothing")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.pool:
        runs = [json.loads(Path(path).read_text()) for path in args.pool]
        names = list(dict.fromkeys(n for run in runs for n in run["names"]))
        print(f"{len(runs)} runs pooled: {', '.join(args.pool)}")
        report(runs, names)
        return
    names = [n.strip() for n in args.variants.split(";") if n.strip()] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; valid: {'; '.join(VARIANTS)}")
    names = ["plain"] + [n for n in names if n != "plain"]
    if args.smoke:  # (--model cpu: a larger model on the CPU, for profiling)
        model, defaults = args.model if args.model == "cpu" else "smoke", (3, 1, 0.0, 3.0)
        args.rounds = args.rounds or 3
    else:
        import torch

        if not torch.cuda.is_available():
            p.error("no GPU here: --smoke runs the bench's logic on CPU")
        model, defaults = args.model or "hostbound", (6, 2, 0.5, 10.0)
        if not (args.rounds or args.budget_s):
            p.error("give --budget-s (or --rounds)")
    args.size = MODELS[model]
    args.block_steps = args.block_steps or defaults[0]
    args.warmup_steps = defaults[1] if args.warmup_steps is None else args.warmup_steps
    args.settle_s = defaults[2] if args.settle_s is None else args.settle_s
    args.quiet_max_s = defaults[3] if args.quiet_max_s is None else args.quiet_max_s
    print(f"whole-cost bench (issue 59): {model} model {args.size}; specs {SPECS}; variants: {'; '.join(names)}")
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine {os.uname().nodename}, "
          f"{os.cpu_count()} CPUs; budget {args.budget_s:g} s, rounds {args.rounds or 'as the budget allows'}"
          + (f"; switch interval {args.switch_interval} s" if args.switch_interval else ""), flush=True)
    run = measure(args, names)
    run["model"] = model
    if args.save:
        Path(args.save).write_text(json.dumps(run))
    report([run], names)


if __name__ == "__main__":
    main()
