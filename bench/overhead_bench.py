"""What each capability costs in a real training step, alone and all on at once.

The real Megatron example (examples/train_moe.py: GPTModel, MoE layers, Megatron's
schedule and optimizer), each variant its own process (patching happens at import),
alternated round by round (the order rotates, so drift and the machine's first-run
state hit every variant), each against `plain` (only `megatron_cpu`, which Megatron-
Core 0.16 needs without Transformer Engine):

    plain                  SOURCE_PATCH=megatron_cpu
    every spec inert       + routing, dump, trace, weight_sync, all off (each call site a flag test)
    routing capture        + routing, capture of every microbatch and layer, written each step
    routing replay         + routing, replay of a capture of the same run
    dump every layer       + dump, every site (every layer, the logits) every step
    dump every layer, cache kept   the same with drop_behind off (written files stay in the page cache)
    dump 1 layer / 10      + dump, layer 1 only, every 10th step (the debugging setting)
    trace, 1 client        + trace, a client subscribed to every layer's output (tiles), reading every frame
    weight sync every step + weight_sync pushing after every optimizer step over NCCL to
                           sync_receiver.py on the second GPU (two GPUs)
    everything at once     + all of the above that a user turns on together: routing capture,
                           dump 1 layer / 10, trace with the client; weight_sync inert
    everything + weight sync   the same with weight sync pushing every step (two GPUs)
    weight sync every step, 32 CTAs   with weight_sync.nccl_ctas 32 on both ends
    sentinels armed        + dump, routing and sentinels, dumping and routing off: non-finite
                           provenance, routing health and the mismatch watch armed (issue 54)
    plain, graphs          plain with Megatron's router CUDA graphs (graph_bench.py's model);
    routing capture, graphs    the ", graphs" variants are compared with it, not with plain
    everything at once, graphs
    sentinels armed, graphs
    sentinels: non-finite only, sentinels: routing health only   one watch armed (where the cost
                           is; only when named)

Per variant: step time against plain (ratio of medians and of means, each with a
bootstrap 90% interval over the timed steps of all its processes; the mean carries a
cost paid every 10th step), the peak device memory torch allocated, the host's
peak RSS and peak pinned host memory (torch's caching host allocator; the RSS does
not show it) against plain, and the bytes written per step (the dump and routing
folders).  Each process's own median is listed in the order the processes ran: the
first processes of a fresh machine are where the first-run cliff of dumping showed
(issue 34).  On a GPU the bench first measures the machine (``--no-probes``: not):
first touch of fresh host memory, the disk's sequential write bandwidth (buffered
and with fdatasync, on the folder the dumps go to), pinned host allocation; and each
dumping process's writer (its throughput, the time the training thread waited for
room in its queue, the final flush).

    python bench/overhead_bench.py                 # GPU: the issue's model (~7 min at 2 rounds)
    python bench/overhead_bench.py --quick         # CPU smoke run: plain vs everything at once
    python bench/overhead_bench.py --resident 8 --rounds 14 --variants "plain,plain again,..."

``--resident K``: one process per variant, all started at once and kept alive (they
share the GPU's memory, never its time: one runs while the others wait on a pipe);
the bench alternates blocks of K steps between them, the order rotating each round,
the first blocks of each process (--warmup steps at least) left out; every step of a later block counts
(its first, after the pause, is the same for every variant; leaving it out would hide
a cost paid every 10th step where 10 steps and the block line up).  A round is then a block of each variant
seconds apart, not a process start apart, so many rounds fit a device call and a
variant is compared with plain round by round (paired: drift cancels).  Per variant:
its block medians (min / median [90% interval]), the median over rounds of its
block's median against plain's of the same round, and the ratio of mean step times,
each with a bootstrap 90% interval over rounds.  ``plain again`` is plain in a
second process: the A/A row, what two identical processes differ by (a variant's
interval means something only where it is wider than that).  Replay is left out
(it needs a capture first).  A third ratio, of the steps' 10th percentiles
(low_steps), leaves out the seconds in which a host-bound step runs 15-25% slower on
every variant; it is blind to a cost only some steps pay (a dump every 10th step).
Two identical processes can differ by ~1% for their whole lives (the A/A row of the
issue's host-bound model, docs/bench-notes/overhead.md), which no number of rounds
of the same processes averages out: ``--sessions S`` starts S sets of processes in
turn, each for --rounds rounds, and the intervals resample the sets, then their rounds.

    python bench/overhead_bench.py --pool run1.json run2.json   # resident runs' rounds pooled (their --save)

Each pooled run's sets of processes stay apart in the intervals, as --sessions' do.

    python bench/overhead_bench.py --resident 1 --rounds 600 --swap --variants "every spec inert"

``--swap``: the comparison inside one process, where that whole-life offset cannot
enter.  Each variant's process runs three blocks a round, the order rotating: its
functions swapped to the code ``megatron_cpu`` alone makes (code_swap.py: every
function another spec changed gets its unpatched ``__code__``), twice (``[kept]``,
``[kept again]``: the A/A), and its own patched code (``[patched]``), each against the
first.  What it measures is the call sites' cost; what a spec does once at import
(module-level edits, the runtime's import) is the same in every block.  With a
capability on, its threads stay alive through the kept blocks, fed by none.  Blocks
of one step (``--resident 1``) alternate the codes step by step: the host-bound
model's slow stretches (a second or two) then hit both codes alike, where they fall
on whole blocks of 10.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import stats  # bench/
import training  # bench/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

import machine_probe  # noqa: E402  bench/
from source_patch.runtime.core.endpoint import free_port  # noqa: E402

BASE = "megatron_cpu"
EVERY = f"{BASE},routing,dump,trace,weight_sync"
CTAS = "SOURCE_PATCH_WEIGHT_SYNC_NCCL_CTAS"  # weight_sync.nccl_ctas: the receiver takes it as --nccl-ctas
TOKEN = "overhead-bench"
PROBE = re.compile(r"^overhead-probe: (\{.*)$", re.M)
PREFIXES = ("SOURCE_PATCH_DUMP", "SOURCE_PATCH_ROUTING", "SOURCE_PATCH_TRACE", "SOURCE_PATCH_WEIGHT_SYNC",
            "SOURCE_PATCH_SENTINELS")
# Issue 54 item 5: the sentinels armed (non-finite provenance, routing health, the mismatch
# watch without a trigger) on the dump and routing call sites, dumping and routing off.
SENTINELS = f"{BASE},dump,routing,sentinels"
ARMED = (("SOURCE_PATCH_SENTINELS_NONFINITE", "1"), ("SOURCE_PATCH_SENTINELS_ROUTING_HEALTH", "1"),
         ("SOURCE_PATCH_SENTINELS_MISMATCH", "1"))


class Variant(NamedTuple):
    """What a variant turns on: spec list, routing mode, dump ("all", "sparse" or None),
    a trace client; a weight-sync receiver on a second GPU (the trainer pushes every
    step); Megatron's router CUDA graphs (compared with ``plain, graphs``)."""
    spec: str
    routing: str = "off"
    dump: str | None = None
    client: bool = False
    sync: bool = False
    graphs: bool = False
    env: tuple = ()  # more (name, value) settings


VARIANTS = {
    "plain": Variant(BASE),
    "plain again": Variant(BASE),  # the A/A control: a second plain process
    "every spec inert": Variant(EVERY),
    "routing capture": Variant(f"{BASE},routing", "capture"),
    "routing replay": Variant(f"{BASE},routing", "replay"),
    "dump every layer": Variant(f"{BASE},dump", dump="all"),
    "dump every layer, cache kept": Variant(f"{BASE},dump", dump="all", env=(("SOURCE_PATCH_DUMP_DROP_BEHIND", "0"),)),
    "dump 1 layer / 10": Variant(f"{BASE},dump", dump="sparse"),
    "trace, 1 client": Variant(f"{BASE},trace", client=True),
    "weight sync every step": Variant(f"{BASE},weight_sync", sync=True),
    "everything at once": Variant(EVERY, "capture", "sparse", True),
    "everything + weight sync": Variant(EVERY, "capture", "sparse", True, sync=True),
    "weight sync every step, 32 CTAs": Variant(f"{BASE},weight_sync", sync=True, env=((CTAS, "32"),)),
    "sentinels armed": Variant(SENTINELS, env=ARMED),
    "sentinels: non-finite only": Variant(SENTINELS, env=ARMED[:1]),
    "sentinels: routing health only": Variant(SENTINELS, env=(("SOURCE_PATCH_SENTINELS_NONFINITE", "0"), ARMED[1])),
    "plain, graphs": Variant(BASE, graphs=True),
    "sentinels armed, graphs": Variant(SENTINELS, graphs=True, env=ARMED),
    "routing capture, graphs": Variant(f"{BASE},routing", "capture", graphs=True),
    "everything at once, graphs": Variant(EVERY, "capture", "sparse", True, graphs=True),
}
QUICK = ("plain", "everything at once")
ONLY_NAMED = ("sentinels: non-finite only", "sentinels: routing health only")  # diagnostics: not in the default run
FIRST = "dump every layer"  # first in the first round: the fresh machine's first dumping process


def environment(name: str, folder: str, replay_dir: str, steps: int, port: int, sync_port: int = 0) -> dict:
    v = VARIANTS[name]
    env = {key: value for key, value in os.environ.items() if not key.startswith(PREFIXES)}
    env.update(SOURCE_PATCH=v.spec, SOURCE_PATCH_DUMP_ENABLE="1" if v.dump else "0",
               SOURCE_PATCH_DUMP_DIR=os.path.join(folder, "dump"), SOURCE_PATCH_ROUTING_MODE=v.routing,
               SOURCE_PATCH_ROUTING_DIR=replay_dir if v.routing == "replay" else os.path.join(folder, "routing"),
               SOURCE_PATCH_TRACE_PORT=str(port if v.client else 0), SOURCE_PATCH_TRACE_TOKEN=TOKEN,
               SOURCE_PATCH_TRACE_DIR=os.path.join(folder, "trace"), OVERHEAD_PROBE_GRAPHS="1" if v.graphs else "0",
               SOURCE_PATCH_SENTINELS_DIR=os.path.join(folder, "sentinels"))
    if v.dump == "sparse":  # Megatron numbers layers from 1; the dumper counts steps from 0
        env.update(SOURCE_PATCH_DUMP_LAYERS="1", SOURCE_PATCH_DUMP_STEPS=",".join(map(str, range(0, steps, 10))))
    if v.client:
        env["SOURCE_PATCH_TRACE_WAIT"] = "120"  # every step has the client: training starts once it subscribed
    env.update(v.env)
    if v.graphs:  # Megatron refuses graphs under expandable segments (resident mode) without it
        env["NCCL_GRAPH_REGISTER"] = "0"
    if v.sync:  # every step pushes to sync_receiver.py (rank 1 on the second GPU); a failed push raises
        env.update(SOURCE_PATCH_WEIGHT_SYNC_ENABLE="1", SOURCE_PATCH_WEIGHT_SYNC_PORT=str(sync_port),
                   SOURCE_PATCH_WEIGHT_SYNC_BACKEND="nccl", SOURCE_PATCH_WEIGHT_SYNC_ON_ERROR="raise")
    return env


def baseline(name: str) -> str:
    """What a variant is compared with: plain with the same graphs setting; in --swap
    mode, its own process's blocks of the kept code."""
    if name.endswith(SWAP_LABELS):
        return swap_label(name, "kept")
    return "plain, graphs" if VARIANTS[name].graphs else "plain"


# --swap: each process's blocks by the code they run (code_swap.py), the kept code twice (A/A)
SWAP_LABELS = (" [patched]", " [kept]", " [kept again]")


def swap_label(label: str, code: str) -> str:
    """The label of the same process's blocks running ``code`` ("patched", "kept", "kept again")."""
    variant = next(label.removesuffix(end) for end in SWAP_LABELS if label.endswith(end))
    return f"{variant} [{code}]"


def companions(name: str, port: int, sync_port: int, report: dict) -> tuple:
    """What variant ``name``'s training process needs beside it, started: its weight-sync
    receiver (or None) and its trace client's thread (or None; it counts frames in ``report``)."""
    v = VARIANTS[name]
    receiver = sync_receiver(sync_port, dict(v.env).get(CTAS, "0")) if v.sync else None
    thread = None
    if v.client:
        thread = threading.Thread(target=lambda: asyncio.run(trace_client(port, report)), daemon=True)
        thread.start()
    return receiver, thread


def sync_receiver(port: int, ctas: str = "0") -> subprocess.Popen:
    """The receiving end of "weight sync every step": its own process on GPU 1."""
    script = str(Path(__file__).with_name("sync_receiver.py"))
    return subprocess.Popen([sys.executable, script, "--port", str(port), "--device", "cuda:1", "--nccl-ctas", ctas],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_receiver(proc: subprocess.Popen) -> str:
    """Stop a receiver once its trainer is gone; its last line (updates received)."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = [line for line in (out or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}, no output"


def runnable(name: str) -> str | None:
    """Why this machine cannot run variant ``name`` (None: it can)."""
    import torch

    if VARIANTS[name].sync and torch.cuda.device_count() < 2:
        return "needs two GPUs (its receiver runs on the second)"
    if VARIANTS[name].graphs and not torch.cuda.is_available():
        return "needs a GPU (CUDA graphs)"
    return None


def choose(text: str, quick: bool) -> list[str]:
    """The variants named in ``text`` (all this machine can run if none)."""
    sep = ";" if ";" in text else ","  # ";" where a name has a comma ("trace, 1 client")
    names = [n.strip() for n in text.split(sep) if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if not names:
        return [n for n in (QUICK if quick else VARIANTS) if n not in ONLY_NAMED and runnable(n) is None]
    why = {n: runnable(n) for n in names}
    if any(why.values()):
        raise SystemExit("; ".join(f"{n!r} {reason}" for n, reason in why.items() if reason))
    return names


async def trace_client(port: int, report: dict) -> None:
    """Subscribe to every layer's output (tiles) and read every frame until training ends."""
    from websockets.exceptions import ConnectionClosed

    from source_patch.runtime.trace.client import TraceError, connect

    report["frames"] = 0
    async with connect(f"127.0.0.1:{port}", TOKEN, client="overhead-bench", retry=300) as c:
        await c.subscribe(["layer_output"], compressor={"kind": "tiles"}, id="tiles")
        try:
            while True:
                await c.next_frame()
                report["frames"] += 1
        except (StopAsyncIteration, TraceError, ConnectionClosed):
            pass


def folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def size_args(args, steps: int) -> list[str]:
    return ["--steps", str(steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--micro-batches", str(args.micro_batches), "--experts", str(args.experts), "--vocab", str(args.vocab)]


def train(args, name: str, root: str, replay: dict) -> dict:
    """One process of variant ``name``: its step times and its probe's report."""
    folder = tempfile.mkdtemp(dir=root)
    if VARIANTS[name].routing == "replay" and "dir" not in replay:
        replay["dir"] = train(args, "routing capture", root, replay)["routing_dir"]
    port, sync_port = free_port(), free_port()
    env = environment(name, folder, replay.get("dir", ""), args.steps, port, sync_port)
    if args.calls:
        env["OVERHEAD_PROBE_CALLS"] = "1"
    report: dict = {}
    receiver, thread = companions(name, port, sync_port, report)
    started = time.perf_counter()
    probe = str(Path(__file__).with_name("overhead_probe.py"))
    out = subprocess.run([sys.executable, probe, str(training.EXAMPLE), *size_args(args, args.steps)], env=env,
                         capture_output=True, text=True, timeout=900)
    if receiver is not None:
        report["receiver"] = stop_receiver(receiver)
    if out.returncode != 0 or "write error" in out.stdout:
        raise SystemExit(f"{name} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    if thread is not None:
        thread.join(30)
    times = [float(t) for t in training.STEP.findall(out.stdout)]
    written = {part: folder_bytes(os.path.join(folder, part)) for part in ("dump", "routing")
               if os.path.isdir(os.path.join(folder, part))}
    result = {"name": name, "times": times[args.warmup:], "probe": json.loads(PROBE.search(out.stdout).group(1)),
              "written": written, "frames": report.get("frames"), "receiver": report.get("receiver"),
              "wall_s": time.perf_counter() - started, "routing_dir": os.path.join(folder, "routing")}
    if VARIANTS[name].routing == "capture" and "dir" not in replay:
        replay["dir"] = result["routing_dir"]  # kept: the replay variant replays it
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def mean_ratio(b: list, a: list) -> float:
    return statistics.fmean(b) / statistics.fmean(a)


def ratio_text(stat, x: list, y: list) -> str:
    if len(x) < 3 or len(y) < 3:
        return "-"
    value, low, high = stats.bootstrap(stat, x, y, rounds=1000)
    return f"{(value - 1) * 100:+.1f}% ({(low - 1) * 100:+.1f}..{(high - 1) * 100:+.1f})"


def table(runs: list[dict], steps: int) -> None:
    """The overhead table: every variant against its plain (baseline())."""
    by_name: dict = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)

    def peak(group: list, key: str) -> float:
        return statistics.median(r["probe"].get(key, 0) for r in group)

    print(f"{'variant':28}{'procs':>6}{'median ms':>10}  {'vs plain, medians [90%]':26}{'vs plain, means [90%]':26}"
          f"{'device peak':>12}{'host RSS':>10}{'pinned':>9}{'written/step':>13}")
    for name, group in by_name.items():
        times = [t for run in group for t in run["times"]]
        base = by_name.get(baseline(name))
        if not times or not base:
            continue
        plain_times = [t for run in base for t in run["times"]]
        dev, rss, pinned = (peak(group, key) - peak(base, key)
                            for key in ("device_peak_allocated", "host_peak_rss", "pinned_peak"))
        written = statistics.median(sum(r["written"].values()) for r in group) / steps
        print(f"{name:28}{len(group):>6}{statistics.median(times):>10.1f}  "
              f"{ratio_text(stats.ratio_of_medians, times, plain_times):26}"
              f"{ratio_text(mean_ratio, times, plain_times):26}"
              f"{dev / 2**20:>+10.0f}Mi{rss / 2**20:>+8.0f}Mi{pinned / 2**20:>+7.0f}Mi{written / 2**20:>11.1f}Mi")
    print(flush=True)


PROCESS_LOG = ("process (in the order they ran): median ms of its timed steps; dump writer: GiB written, its GiB/s "
               "while writing, all bytes over the run, the training thread's waits for room, the final flush; CPU "
               "seconds in the kernel; pinned peak; /proc/vmstat changes")


def process_line(i: int, run: dict) -> str:
    """One process: its median and what its writer said."""
    probe, times = run["probe"], run["times"]
    line = f"{i:3}. {run['name']:28}{statistics.median(times) if times else 0:9.1f} ms"
    dump = probe["states"].get("dump") or {}
    if dump.get("bytes"):
        gib, write_s = dump["bytes"] / 2**30, dump.get("write_s") or 0
        line += (f"  dump {gib:.2f} GiB, {gib / write_s if write_s else 0:.2f} GiB/s writing, "
                 f"{gib / probe['run_s']:.2f} GiB/s over the run, {dump.get('waits', 0)} waits "
                 f"{dump.get('blocked_s', 0):.2f} s, flush {probe['flush_s']:.2f} s; sys {probe['cpu_sys_s']:.1f} s; "
                 f"pinned {probe.get('pinned_peak', 0) / 2**30:.2f} GiB; vmstat {probe['vmstat']}")
    if run.get("frames") is not None:
        line += f"  trace frames {run['frames']}"
    if run.get("receiver"):
        line += f"  {run['receiver']}"
    return line


def calls_line(name: str, probe: dict, steps: int) -> str | None:
    """``--calls``: the call sites' calls a step and the time a step spent in them."""
    calls = probe.get("calls")
    if not calls:
        return None
    n = sum(c["calls"] for c in calls.values())
    us = sum(c["ns"] for c in calls.values()) / 1e3
    top = ", ".join(f"{k} {c['calls'] / steps:.0f}" for k, c in sorted(calls.items(), key=lambda kv: -kv[1]["calls"])[:5])
    return (f"{name}: {n / steps:.0f} call-site calls a step, {us / steps:.1f} us a step in them "
            f"({us * 1e3 / n:.0f} ns a call, the wrapper's timer included); most: {top}")


def first_run(runs: list[dict]) -> None:
    """The first dumping process against the later ones (the cliff: issue 34)."""
    dumping = [statistics.median(r["times"]) for r in runs if r["name"] == FIRST and r["times"]]
    if len(dumping) >= 2:
        later = statistics.median(dumping[1:])
        print(f"first-run: the first '{FIRST}' process {dumping[0]:.1f} ms/step, later ones {later:.1f} "
              f"({dumping[0] / later:.2f}x; goal <= 1.2x)\n", flush=True)


class Resident:
    """One variant's process, alive across rounds: ``block()`` runs its next K steps."""

    def __init__(self, args, name: str, root: str, per_round: int = 1):
        import queue

        self.name, self.folder, self.lines = name, tempfile.mkdtemp(dir=root), queue.Queue()
        port, sync_port = free_port(), free_port()
        total = args.resident * (args.rounds * per_round + warm_blocks(args))
        env = {**environment(name, self.folder, "", total, port, sync_port), "OVERHEAD_PROBE_BLOCK": str(args.resident),
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # several processes share the GPU's memory
        if args.calls:
            env["OVERHEAD_PROBE_CALLS"] = "1"
        if args.swap:  # the code the plain process runs: megatron_cpu's patches only
            env["OVERHEAD_PROBE_SWAP"] = BASE
        self.report: dict = {}
        self.receiver, _ = companions(name, port, sync_port, self.report)
        probe = str(Path(__file__).with_name("overhead_probe.py"))
        self.err = open(os.path.join(self.folder, "stderr.txt"), "w+")
        self.proc = subprocess.Popen([sys.executable, probe, str(training.EXAMPLE), *size_args(args, total)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        self.probe: dict | None = None
        self.ended = False

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float = 900) -> list[float]:
        """Step times until the process waits for its next block (or ends)."""
        times = []
        while not self.ended:
            line = self.lines.get(timeout=timeout)
            if line is None:
                self.ended = True
                break
            if line.startswith("overhead-probe: ready"):
                return times
            found = PROBE.match(line)
            if found:
                self.probe = json.loads(found.group(1))
            step = training.STEP.match(line.rstrip("\n"))
            if step:
                times.append(float(step.group(1)))
        return times

    def block(self, discard: int, code: str = "go") -> list[float]:
        """Its next block's step times (ms); ``span``: the block's wall time (ms), from
        "go" to its next "ready", which holds all of its steps and none of its waits.
        ``code`` (--swap): "patched" or "kept", the code the block runs."""
        self.span = 0.0
        if self.proc.poll() is not None:
            return []
        start = time.perf_counter()
        try:
            self.proc.stdin.write(f"{code}\n")
            self.proc.stdin.flush()
        except OSError:
            return []
        times = self.wait_ready()[discard:]
        self.span = (time.perf_counter() - start) * 1e3
        return times

    def finish(self) -> dict:
        import queue

        try:  # the last block's end: the example's own end, then the probe's report
            self.wait_ready(timeout=120)
            code = self.proc.wait(timeout=60)
        except (queue.Empty, subprocess.TimeoutExpired):  # its teardown hangs: the others still report
            self.proc.kill()
            code = "killed: it did not exit within 3 minutes of its last block"
        if self.receiver is not None:
            self.report["receiver"] = stop_receiver(self.receiver)
        self.err.seek(0)
        if code != 0 or self.probe is None:
            print(f"{self.name}: exit {code}:\n{self.err.read()[-3000:]}", flush=True)
        self.err.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.probe or {}


def low_steps(blocks: list, fraction: float = 0.1) -> float:
    """The ``fraction`` quantile of every step of ``blocks``: the undisturbed step.  On a
    host-bound step the host moves between regimes for a second or two at a time
    (+15-25% on every variant, plain included: docs/bench-notes/overhead.md), which the
    medians carry and a low quantile leaves out; a cost in every step moves it."""
    steps = sorted(t for block in blocks for t in block)
    return steps[int(fraction * (len(steps) - 1))]


def ratio_cell(stat, *samples: list, groups: list | None = None) -> str:
    """A ratio and its 90% interval (the samples resampled together; with ``groups``,
    the sessions first, then their rounds), in percent."""
    value, low, high = stats.bootstrap(stat, *samples, paired=True, groups=groups)
    return f"{(value - 1) * 100:+.2f}% ({(low - 1) * 100:+.2f}..{(high - 1) * 100:+.2f})"


def resident_table(blocks: dict, probes: dict, sessions: list | None = None) -> None:
    """Per variant: block medians, and against its plain (baseline()) round by round
    (paired over rounds): the ratio of block medians, of the means, and of the steps'
    10th percentiles (low_steps: blind to a cost only some steps pay, such as a dump
    every 10th step; the A/A row says what it resolves).  ``sessions``: each round's
    set of processes (--sessions, --pool); the intervals resample the sets, then their
    rounds, since two identical processes can differ for their whole lives."""
    against = "[kept]" if any(name.endswith(SWAP_LABELS) for name in blocks) else "plain"
    print(f"{'variant':32}{'rounds':>7}  {'block medians, ms: ' + stats.HEADER:44}"
          f"{f'vs {against}, per round [90%]':28}{f'vs {against}, means [90%]':26}{f'vs {against}, p10 [90%]':26}"
          f"{'device peak':>12}{'pinned':>9}")
    for name, rows in blocks.items():
        base = baseline(name)
        labels = sessions or [0] * len(rows)
        kept = [(b, a, g) for b, a, g in zip(rows, blocks.get(base, []), labels) if b and a] if name != base else []
        pairs, groups = [(b, a) for b, a, _ in kept], [g for _, _, g in kept]
        meds = [statistics.median(b) for b in rows if b]
        if not meds:
            print(f"{name:32}{0:>7}  (no steps: see its exit above)")
            continue
        per_round = means = low = "-"
        if len(pairs) >= 3:
            per_round = ratio_cell(statistics.median, [statistics.median(b) / statistics.median(a) for b, a in pairs],
                                   groups=groups)
            variant, plain = [b for b, _ in pairs], [a for _, a in pairs]
            means = ratio_cell(lambda bs, as_: sum(map(sum, bs)) / sum(map(len, bs)) / (sum(map(sum, as_)) / sum(map(len, as_))),
                               variant, plain, groups=groups)
            low = ratio_cell(lambda bs, as_: low_steps(bs) / low_steps(as_), variant, plain, groups=groups)
        probe, plain_probe = probes.get(name) or {}, probes.get(base) or {}
        dev = (probe.get("device_peak_allocated", 0) - plain_probe.get("device_peak_allocated", 0)) / 2**20
        pinned = (probe.get("pinned_peak", 0) - plain_probe.get("pinned_peak", 0)) / 2**20
        # (a space after each ratio: a wide interval of a noisy run would run into the next)
        print(f"{name:32}{len(meds):>7}  {stats.cells(meds):44}{per_round:27} {means:25} {low:25} "
              f"{dev:>+10.0f}Mi{pinned:>+7.0f}Mi")
    print(flush=True)


def run_resident(args, names: list[str], root: str) -> None:
    names = [n for n in names if VARIANTS[n].routing != "replay"]
    # the baselines first ("plain" before "plain, graphs"): every round's ratios need their blocks
    for base in sorted({baseline(n) for n in names} if not args.swap else (), reverse=True):
        if base in names:
            names.remove(base)
        names.insert(0, base)
    plan = round_plan(args, names)
    blocks: dict = {label: [] for label, _, _ in plan}
    spans: dict = {label: [] for label, _, _ in plan}  # each block's wall time, ms (see Resident.block)
    sessions: list = []  # each round's set of processes
    for session in range(args.sessions):
        if args.sessions > 1:
            print(f"== set of processes {session + 1}/{args.sessions}", flush=True)
        probes, procs = resident_session(args, plan, root, blocks, spans, sessions, session)
    print("with each process's peaks (device: torch's allocated; pinned: its caching host allocator)"
          + (", of the last set" if args.sessions > 1 else ""))
    resident_table(blocks, probes, sessions)
    for name, proc in procs.items():
        if proc.report.get("frames") is not None:
            print(f"{name}: trace frames {proc.report['frames']}")
        if proc.report.get("receiver"):
            print(f"{name}: {proc.report['receiver']}")
        if (probes.get(name) or {}).get("swap"):
            print(f"{name}: {probes[name]['swap']}")
        line = calls_line(name, probes.get(name) or {},
                          args.resident * (args.rounds * len(plan) // len(procs) + warm_blocks(args)))
        if line:
            print(line)
    if args.save:
        Path(args.save).write_text(json.dumps({"blocks": blocks, "spans": spans, "sessions": sessions,
                                               "probes": probes}))


def warm_blocks(args) -> int:
    """Blocks each process runs before the timed rounds: at least --warmup steps (with
    --swap at least two, for each code its first run: a capability's first call, its
    kernels' compilation, is a warm-up's)."""
    return max(2 if args.swap else 1, -(-args.warmup // args.resident))


def round_plan(args, names: list) -> list[tuple[str, str, str]]:
    """(label, process, code) of each block of a round: a process per variant; with
    --swap each process runs three blocks a round, the kept code twice (its A/A) and
    the patched code once."""
    if not args.swap:
        return [(name, name, "go") for name in names]
    return [(f"{name} [{code}]", name, code.split()[0]) for name in names for code in ("kept", "kept again", "patched")]


def resident_session(args, plan: list, root: str, blocks: dict, spans: dict, sessions: list,
                     session: int) -> tuple[dict, dict]:
    """One set of processes, started together, warmed up, then ``args.rounds`` rounds
    of ``plan`` (round_plan) appended to ``blocks``, ``spans`` and ``sessions``; (their
    probes, the processes)."""
    names = list(dict.fromkeys(name for _, name, _ in plan))
    per_round = len(plan) // len(names)
    procs = {name: Resident(args, name, root, per_round) for name in names}  # started together: one start-up wait
    for proc in procs.values():
        proc.wait_ready()
    for n in range(warm_blocks(args)):  # the warm-up blocks, not timed (with --swap: the swap made, both codes run)
        for proc in procs.values():
            proc.block(0, ("patched", "kept")[n % 2] if args.swap else "go")
    print(f"{time.strftime('%H:%M:%S')} resident: {len(procs)} processes warm (the first "
          f"{args.resident * warm_blocks(args)} steps of each left out); "
          f"{args.rounds} rounds of a block of {args.resident} steps per "
          + ("code (patched, kept, kept again) per process" if args.swap else "variant"), flush=True)
    for r in range(args.rounds):
        for label, name, code in plan[r % len(plan):] + plan[:r % len(plan)]:
            blocks[label].append(procs[name].block(0, code))
            spans[label].append(procs[name].span)
        sessions.append(session)
        if (r + 1) % max(1, args.rounds // 3) == 0 or r + 1 == args.rounds:
            print(f"after round {r + 1}/{args.rounds} ({time.strftime('%H:%M:%S')})")
            resident_table(blocks, {}, sessions)
            if args.save:  # a run cut short by a time limit keeps what it measured
                Path(args.save).write_text(json.dumps({"blocks": blocks, "spans": spans, "sessions": sessions}))
    return {name: proc.finish() for name, proc in procs.items()}, procs


def pool(paths: list) -> None:
    """The resident table of several runs' rounds pooled, each round pairing blocks of
    one run (a variant absent from a run has empty blocks there: no pairs); each run's
    sets of processes stay apart in the intervals (resident_table's ``sessions``)."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    blocks: dict = {name: [] for run in runs for name in run["blocks"]}
    sessions: list = []
    for n, run in enumerate(runs):
        rounds = min(len(rows) for rows in run["blocks"].values())
        for name, rows in blocks.items():
            rows.extend(run["blocks"][name][:rounds] if name in run["blocks"] else [[] for _ in range(rounds)])
        sessions.extend(f"{n}.{label}" for label in (run.get("sessions") or [0] * rounds)[:rounds])
    print(f"{len(paths)} resident runs pooled ({len(set(sessions))} sets of processes): {', '.join(paths)}")
    resident_table(blocks, {}, sessions)


def main() -> None:
    p = training.parser(__doc__)
    p.set_defaults(vocab=32000 if training.CUDA else 128, rounds=2 if training.CUDA else 1,
                   steps=40 if training.CUDA else 6, warmup=8 if training.CUDA else 2)
    p.add_argument("--variants", default="", help="variant names, separated by ',' or ';' (default: all this machine can run; --quick: "
                   + ", ".join(QUICK) + ")")
    p.add_argument("--no-probes", action="store_true", help="skip the machine probes (memory, disk, pinned)")
    p.add_argument("--probe-gib", type=float, default=4.0, help="GiB each machine probe writes or touches")
    p.add_argument("--save", metavar="JSON", help="also write every process's times and probe report here "
                   "(resident mode: each block's step times, its wall time from \"go\" to \"ready\", the reports)")
    p.add_argument("--calls", action="store_true", help="count and time every call site's calls (overhead_probe.py)")
    p.add_argument("--resident", type=int, default=0, metavar="K",
                   help="one process per variant kept alive, blocks of K steps alternated (see above)")
    p.add_argument("--swap", action="store_true",
                   help="--resident: one process per variant, its blocks alternated between its patched code and "
                   "the code megatron_cpu alone makes (code_swap.py; see above)")
    p.add_argument("--sessions", type=int, default=1, metavar="S",
                   help="--resident: S sets of processes in turn, each for --rounds rounds (see above)")
    p.add_argument("--pool", nargs="+", metavar="JSON", help="the table of resident runs' rounds pooled "
                   "(their --save files); runs nothing")
    args = p.parse_args()
    if args.swap and not args.resident:
        p.error("--swap needs --resident K (its blocks alternate the codes)")
    if args.pool:
        pool(args.pool)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup, args.no_probes = 1, 5, 2, True
    names = choose(args.variants, args.quick)
    if FIRST in names:
        names.remove(FIRST)
        names.insert(0, FIRST)
    training.header(args)
    if args.resident:
        with tempfile.TemporaryDirectory(dir=os.environ.get("OVERHEAD_BENCH_DIR")) as root:
            run_resident(args, names, root)
        return
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("OVERHEAD_BENCH_DIR")) as root:
        if not args.no_probes:
            machine_probe.report(root, args.probe_gib, training.CUDA)
        replay: dict = {}
        print(PROCESS_LOG, flush=True)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs.append(train(args, name, root, replay))
                print(process_line(len(runs), runs[-1]), flush=True)
                line = calls_line(name, runs[-1]["probe"], args.steps)
                if line:
                    print(f"     {line}", flush=True)
            print(f"\nafter round {r + 1}/{args.rounds}: {args.steps - args.warmup} timed steps a process")
            table(runs, args.steps)
            if args.save:  # each round: a run cut short by a time limit keeps what it measured
                Path(args.save).write_text(json.dumps(runs))
        first_run(runs)


if __name__ == "__main__":
    main()
