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
    dump 1 layer / 10      + dump, layer 1 only, every 10th step (the debugging setting)
    trace, 1 client        + trace, a client subscribed to every layer's output (tiles), reading every frame
    everything at once     + all of the above that a user turns on together: routing capture,
                           dump 1 layer / 10, trace with the client; weight_sync inert

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
the first block of each process left out (warm-up); every step of a later block counts
(its first, after the pause, is the same for every variant; leaving it out would hide
a cost paid every 10th step where 10 steps and the block line up).  A round is then a block of each variant
seconds apart, not a process start apart, so many rounds fit a device call and a
variant is compared with plain round by round (paired: drift cancels).  Per variant:
its block medians (min / median [90% interval]), the median over rounds of its
block's median against plain's of the same round, and the ratio of mean step times,
each with a bootstrap 90% interval over rounds.  ``plain again`` is plain in a
second process: the A/A row, what two identical processes differ by (a variant's
interval means something only where it is wider than that).  Replay is left out
(it needs a capture first).
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

import stats  # bench/
import training  # bench/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

import machine_probe  # noqa: E402  bench/
from source_patch.runtime.core.endpoint import free_port  # noqa: E402

BASE = "megatron_cpu"
EVERY = f"{BASE},routing,dump,trace,weight_sync"
TOKEN = "overhead-bench"
PROBE = re.compile(r"^overhead-probe: (\{.*)$", re.M)
PREFIXES = ("SOURCE_PATCH_DUMP", "SOURCE_PATCH_ROUTING", "SOURCE_PATCH_TRACE", "SOURCE_PATCH_WEIGHT_SYNC")
# name -> what it turns on: spec, routing mode, dump ("all", "sparse" or None), trace client
VARIANTS = {
    "plain": (BASE, "off", None, False),
    "plain again": (BASE, "off", None, False),  # the A/A control: a second plain process
    "every spec inert": (EVERY, "off", None, False),
    "routing capture": (f"{BASE},routing", "capture", None, False),
    "routing replay": (f"{BASE},routing", "replay", None, False),
    "dump every layer": (f"{BASE},dump", "off", "all", False),
    "dump 1 layer / 10": (f"{BASE},dump", "off", "sparse", False),
    "trace, 1 client": (f"{BASE},trace", "off", None, True),
    "everything at once": (EVERY, "capture", "sparse", True),
}
QUICK = ("plain", "everything at once")
FIRST = "dump every layer"  # first in the first round: the fresh machine's first dumping process


def environment(name: str, folder: str, replay_dir: str, steps: int, port: int) -> dict:
    spec, mode, dump, client = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIXES)}
    env.update(SOURCE_PATCH=spec, SOURCE_PATCH_DUMP_ENABLE="1" if dump else "0",
               SOURCE_PATCH_DUMP_DIR=os.path.join(folder, "dump"), SOURCE_PATCH_ROUTING_MODE=mode,
               SOURCE_PATCH_ROUTING_DIR=replay_dir if mode == "replay" else os.path.join(folder, "routing"),
               SOURCE_PATCH_TRACE_PORT=str(port if client else 0), SOURCE_PATCH_TRACE_TOKEN=TOKEN,
               SOURCE_PATCH_TRACE_DIR=os.path.join(folder, "trace"))
    if dump == "sparse":  # Megatron numbers layers from 1; the dumper counts steps from 0
        env.update(SOURCE_PATCH_DUMP_LAYERS="1", SOURCE_PATCH_DUMP_STEPS=",".join(map(str, range(0, steps, 10))))
    if client:
        env["SOURCE_PATCH_TRACE_WAIT"] = "120"  # every step has the client: training starts once it subscribed
    return env


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
    if VARIANTS[name][1] == "replay" and "dir" not in replay:
        replay["dir"] = train(args, "routing capture", root, replay)["routing_dir"]
    port = free_port()
    env = environment(name, folder, replay.get("dir", ""), args.steps, port)
    if args.calls:
        env["OVERHEAD_PROBE_CALLS"] = "1"
    report: dict = {}
    thread = None
    if VARIANTS[name][3]:
        thread = threading.Thread(target=lambda: asyncio.run(trace_client(port, report)), daemon=True)
        thread.start()
    started = time.perf_counter()
    probe = str(Path(__file__).with_name("overhead_probe.py"))
    out = subprocess.run([sys.executable, probe, str(training.EXAMPLE), *size_args(args, args.steps)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or "write error" in out.stdout:
        raise SystemExit(f"{name} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    if thread is not None:
        thread.join(30)
    times = [float(t) for t in training.STEP.findall(out.stdout)]
    written = {part: folder_bytes(os.path.join(folder, part)) for part in ("dump", "routing")
               if os.path.isdir(os.path.join(folder, part))}
    result = {"name": name, "times": times[args.warmup:], "probe": json.loads(PROBE.search(out.stdout).group(1)),
              "written": written, "frames": report.get("frames"), "wall_s": time.perf_counter() - started,
              "routing_dir": os.path.join(folder, "routing")}
    if VARIANTS[name][1] == "capture" and "dir" not in replay:
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
    """The overhead table: every variant against plain."""
    by_name: dict = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    base = by_name.get("plain")
    if not base:
        return
    plain_times = [t for run in base for t in run["times"]]
    plain_dev = statistics.median(r["probe"]["device_peak_allocated"] for r in base)
    plain_rss = statistics.median(r["probe"]["host_peak_rss"] for r in base)
    plain_pinned = statistics.median(r["probe"].get("pinned_peak", 0) for r in base)
    print(f"{'variant':22}{'procs':>6}{'median ms':>10}  {'vs plain, medians [90%]':26}{'vs plain, means [90%]':26}"
          f"{'device peak':>12}{'host RSS':>10}{'pinned':>9}{'written/step':>13}")
    for name, group in by_name.items():
        times = [t for run in group for t in run["times"]]
        if not times:
            continue
        dev = statistics.median(r["probe"]["device_peak_allocated"] for r in group) - plain_dev
        rss = statistics.median(r["probe"]["host_peak_rss"] for r in group) - plain_rss
        pinned = statistics.median(r["probe"].get("pinned_peak", 0) for r in group) - plain_pinned
        written = statistics.median(sum(r["written"].values()) for r in group) / steps
        print(f"{name:22}{len(group):>6}{statistics.median(times):>10.1f}  "
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
    line = f"{i:3}. {run['name']:22}{statistics.median(times) if times else 0:9.1f} ms"
    dump = probe["states"].get("dump") or {}
    if dump.get("bytes"):
        gib, write_s = dump["bytes"] / 2**30, dump.get("write_s") or 0
        line += (f"  dump {gib:.2f} GiB, {gib / write_s if write_s else 0:.2f} GiB/s writing, "
                 f"{gib / probe['run_s']:.2f} GiB/s over the run, {dump.get('waits', 0)} waits "
                 f"{dump.get('blocked_s', 0):.2f} s, flush {probe['flush_s']:.2f} s; sys {probe['cpu_sys_s']:.1f} s; "
                 f"pinned {probe.get('pinned_peak', 0) / 2**30:.2f} GiB; vmstat {probe['vmstat']}")
    if run.get("frames") is not None:
        line += f"  trace frames {run['frames']}"
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

    def __init__(self, args, name: str, root: str):
        import queue

        self.name, self.folder, self.lines = name, tempfile.mkdtemp(dir=root), queue.Queue()
        port = free_port()
        total = args.resident * (args.rounds + 1)  # + the warm-up block
        env = {**environment(name, self.folder, "", total, port), "OVERHEAD_PROBE_BLOCK": str(args.resident),
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # several processes share the GPU's memory
        if args.calls:
            env["OVERHEAD_PROBE_CALLS"] = "1"
        self.report: dict = {}
        if VARIANTS[name][3]:
            threading.Thread(target=lambda: asyncio.run(trace_client(port, self.report)), daemon=True).start()
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

    def wait_ready(self) -> list[float]:
        """Step times until the process waits for its next block (or ends)."""
        times = []
        while not self.ended:
            line = self.lines.get(timeout=900)
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

    def block(self, discard: int) -> list[float]:
        if self.proc.poll() is not None:
            return []
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except OSError:
            return []
        return self.wait_ready()[discard:]

    def finish(self) -> dict:
        self.wait_ready()  # the last block's end: the example's own end, then the probe's report
        code = self.proc.wait(timeout=300)
        self.err.seek(0)
        if code != 0 or self.probe is None:
            print(f"{self.name}: exit {code}:\n{self.err.read()[-3000:]}", flush=True)
        self.err.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.probe or {}


def resident_table(blocks: dict, probes: dict) -> None:
    """Per variant: block medians, and against plain round by round (paired over rounds)."""
    base = blocks.get("plain")
    print(f"{'variant':22}{'rounds':>7}  {'block medians, ms: ' + stats.HEADER:44}"
          f"{'vs plain, per round [90%]':28}{'vs plain, means [90%]':26}{'device peak':>12}{'pinned':>9}")
    for name, rows in blocks.items():
        pairs = [(b, a) for b, a in zip(rows, base) if b and a] if base else []
        meds = [statistics.median(b) for b in rows if b]
        if not meds:
            print(f"{name:22}{0:>7}  (no steps: see its exit above)")
            continue
        per_round = "-"
        if name != "plain" and len(pairs) >= 3:
            value, low, high = stats.bootstrap(statistics.median, [statistics.median(b) / statistics.median(a)
                                                                   for b, a in pairs])
            per_round = f"{(value - 1) * 100:+.2f}% ({(low - 1) * 100:+.2f}..{(high - 1) * 100:+.2f})"
        means = "-"
        if name != "plain" and len(pairs) >= 3:
            value, low, high = stats.bootstrap(
                lambda bs, as_: sum(map(sum, bs)) / sum(map(len, bs)) / (sum(map(sum, as_)) / sum(map(len, as_))),
                [b for b, _ in pairs], [a for _, a in pairs], paired=True)
            means = f"{(value - 1) * 100:+.2f}% ({(low - 1) * 100:+.2f}..{(high - 1) * 100:+.2f})"
        probe, plain_probe = probes.get(name) or {}, probes.get("plain") or {}
        dev = (probe.get("device_peak_allocated", 0) - plain_probe.get("device_peak_allocated", 0)) / 2**20
        pinned = (probe.get("pinned_peak", 0) - plain_probe.get("pinned_peak", 0)) / 2**20
        print(f"{name:22}{len(meds):>7}  {stats.cells(meds):44}{per_round:28}{means:26}{dev:>+10.0f}Mi{pinned:>+7.0f}Mi")
    print(flush=True)


def run_resident(args, names: list[str], root: str) -> None:
    names = [n for n in names if VARIANTS[n][1] != "replay"]
    if "plain" in names:  # plain first: every round's ratios need its block
        names.remove("plain")
    names.insert(0, "plain")
    procs = {name: Resident(args, name, root) for name in names}  # started together: one start-up wait
    for proc in procs.values():
        proc.wait_ready()
    for proc in procs.values():  # the warm-up block, not timed
        proc.block(0)
    print(f"resident: {len(procs)} processes warm (a first block of {args.resident} steps each, left out); "
          f"{args.rounds} rounds of a block of {args.resident} steps per variant", flush=True)
    blocks: dict = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            blocks[name].append(procs[name].block(0))
        if (r + 1) % max(1, args.rounds // 3) == 0 or r + 1 == args.rounds:
            print(f"after round {r + 1}/{args.rounds}")
            resident_table(blocks, {})
            if args.save:  # a run cut short by a time limit keeps what it measured
                Path(args.save).write_text(json.dumps({"blocks": blocks}))
    probes = {name: proc.finish() for name, proc in procs.items()}
    print("with each process's peaks (device: torch's allocated; pinned: its caching host allocator)")
    resident_table(blocks, probes)
    for name, proc in procs.items():
        if proc.report.get("frames") is not None:
            print(f"{name}: trace frames {proc.report['frames']}")
        line = calls_line(name, probes.get(name) or {}, args.resident * (args.rounds + 1))
        if line:
            print(line)
    if args.save:
        Path(args.save).write_text(json.dumps({"blocks": blocks, "probes": probes}))


def main() -> None:
    p = training.parser(__doc__)
    p.set_defaults(vocab=32000 if training.CUDA else 128, rounds=2 if training.CUDA else 1,
                   steps=40 if training.CUDA else 6, warmup=8 if training.CUDA else 2)
    p.add_argument("--variants", default="", help="variant names, separated by ',' or ';' (default: all; --quick: "
                   + ", ".join(QUICK) + ")")
    p.add_argument("--no-probes", action="store_true", help="skip the machine probes (memory, disk, pinned)")
    p.add_argument("--probe-gib", type=float, default=4.0, help="GiB each machine probe writes or touches")
    p.add_argument("--save", metavar="JSON", help="also write every process's times and probe report here")
    p.add_argument("--calls", action="store_true", help="count and time every call site's calls (overhead_probe.py)")
    p.add_argument("--resident", type=int, default=0, metavar="K",
                   help="one process per variant kept alive, blocks of K steps alternated (see above)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.no_probes = 1, 5, 2, True
    sep = ";" if ";" in args.variants else ","  # ";" where a name has a comma ("trace, 1 client")
    names = [n.strip() for n in args.variants.split(sep) if n.strip()] or list(QUICK if args.quick else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
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
