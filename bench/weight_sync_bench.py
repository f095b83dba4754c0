"""Weight sync: bucketed transfer against per-tensor broadcast and one raw broadcast,
measured in the same run, on two processes (one per GPU, NCCL) or on CPU (gloo).

    python bench/weight_sync_bench.py --gb 4          # two GPUs: spawns rank 0 (sender) and rank 1
    python bench/weight_sync_bench.py --cpu           # smoke test on CPU over gloo, tiny sizes
    python bench/weight_sync_bench.py --phases        # one GPU (or --cpu), one process: per-phase breakdown

Needs torch and the installed source_patch (runtime/weight_sync: wire, link,
sender, receiver).  The synthetic model has
``--small-frac`` of its bytes in small tensors (norms, biases, fine-grained
experts: ``--small-kb`` and smaller), the rest in ``--large-mb`` matrices, and one
embedding-like tensor larger than a bucket (split across buckets).

Methods (sender's wall time from a barrier until every receiver is done; each round
runs them all in a rotating order, per-tensor in rounds of its own after the others):
  raw          one broadcast of a flat buffer of the model's size: the interconnect's bandwidth
  per-tensor   one async broadcast per tensor, all waited (SGLang's non-bucketed path, into
               preallocated tensors)
  bucketed     weight_transport.send/receive: manifest, double-buffered buckets, per-bucket
               checksums, verdict; the receiver stages the whole update (stage "update");
               on a GPU each bucket's copies replayed once its sources repeat (replay_packing)
  bucketed -c  the same without checksums
  bucketed, copied  bucketed with every tensor copied each update (replay_packing off)
  planned      the packed push's program (program.py, what push() sends with TP/EP gathers):
               the tensors' views planned once, per bucket one replayed CUDA graph of fused
               copies; receiver as bucketed
  streamed     stage "bucket": the receiver verifies and hands out bucket by bucket
  buffers      the sender's tensors are views of one flat buffer (as Megatron's parameter
               buffers with the distributed optimizer), planned with plan_buffers: each
               bucket is broadcast from the buffer itself, no pack; receiver as bucketed
  buffers -c   the same without checksums
  buffers streamed  from the buffers, the receiver in stage "bucket"

--timeline N (two GPUs) then records N checksummed and N unchecked bucketed updates,
N planned and N from the buffers per side with torch.profiler and prints, per update,
what the GPU did: time to the first bucket's broadcast, NCCL busy time, its largest
idle gap and what came before it, checksum and copy kernel time (to find where a slow
round loses its time).

--events N (two GPUs) then times N updates of raw, buffers, buffers -c, planned and
bucketed per side by CUDA events, without a profiler, and prints where the device
time goes: the first bucket's start, the buckets' and the small collectives' NCCL
time, the NCCL stream's idle time between buckets, the tail after the last bucket,
and the first calls' host and device times (bench/weight_sync_events.py; sets
TORCH_NCCL_ENABLE_TIMING=1 for the whole run, the table's rounds too).

--phases (one process, one GPU or --cpu; no process group: the sender's broadcasts
are recorded and replayed to the receivers in the same process, transport.LoopbackLink)
times each phase of an update alone, min and median over rounds: host time
(perf_counter; thread_time: this thread's CPU) and device time (CUDA events, with the
stream held back by a sleep kernel until the host has launched the region, so they
time the device work, not the launch rate; on CPU the host time).  Default: both
models of the 2-GPU runs, --small-frac 0.1 and 0.5.
  (a) sender: take + check the tensors of each bucket (_Packing.batches), pack them
      (_Packing.pack: one _foreach_copy_ per dtype), per bucket and per update
  (b) checksum of each bucket (wire.bucket_sum)
      send() over a wire that costs nothing: (a) + (b) + handshake, manifest, votes
      send() of the same tensors as views of one buffer (plan_buffers): no (a)
  (c) receivers over the replayed wire (its copies included: about (d)): stage
      "update" (receive() returns views of the staged buffer), stage "bucket"
      (every tensor handed out, tensors crossing bucket ends assembled by copies)
  (e) engine load: one copy_ per received tensor into its own tensor (what a plain
      weight_loader does)
  (d) reference: one device-to-device copy of the model's bytes
Not measured here: the gather across trainer ranks and the name/layout mapping
(synthetic tensors already carry engine names) and the transfer (two GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file
import stats  # noqa: E402 - bench/
import weight_sync_phases  # noqa: E402 - bench/: the --phases mode
from weight_sync_phases import PHASE_ROWS  # noqa: E402,F401 - the --phases rows (tests read them here)


def load_transport():
    try:
        from source_patch.runtime.weight_sync import transport as weight_transport
    except ImportError as exc:  # the transport is a package of modules now: install the project
        raise SystemExit(f"weight_sync_bench: install source_patch (pip install . or its wheel): {exc}") from None
    return weight_transport


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=None, help="model size in GiB (default 4; --cpu 0.03)")
    p.add_argument("--small-frac", type=float, default=None,
                   help="share of bytes in small tensors (default 0.1; --phases: 0.1 and 0.5)")
    p.add_argument("--small-kb", type=int, default=None, help="largest small tensor, KiB (default 128; --cpu 8)")
    p.add_argument("--large-mb", type=int, default=None, help="large tensor size, MiB (default 64; --cpu 1)")
    p.add_argument("--bucket-mb", type=int, default=None, help="bucket size, MiB (default 512; --cpu 4)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke test)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--nccl-ctas", type=int, default=0, help="the update group's thread blocks per collective "
                   "(weight_sync.nccl_ctas; 0: NCCL's choice)")
    p.add_argument("--profile", action="store_true", help="then profile the host side of bucketed updates")
    p.add_argument("--phases", action="store_true", help="one process: time each phase of an update alone")
    p.add_argument("--gc-off", action="store_true", help="the collector disabled during the timed rounds")
    p.add_argument("--milestones", action="store_true",
                   help="print each round's host timeline per side (protocol steps, buckets, GC pauses)")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="then profile N updates per variant on the GPUs and print each one's timeline summary")
    p.add_argument("--events", type=int, default=0, metavar="N",
                   help="then time N updates per variant by CUDA events (no profiler): where the device "
                   "time goes (bench/weight_sync_events.py)")
    args = p.parse_args(argv)
    cpu = args.cpu
    args.small_fracs = [args.small_frac] if args.small_frac is not None else [0.1, 0.5] if args.phases else [0.1]
    args.small_frac = args.small_fracs[0]
    args.gb = args.gb if args.gb is not None else (0.03 if cpu else 4.0)
    args.small_kb = args.small_kb or (8 if cpu else 128)
    args.large_mb = args.large_mb or (1 if cpu else 64)
    args.bucket_mb = args.bucket_mb or (4 if cpu else 512)
    return args


def model_layout(args) -> list[tuple[str, tuple]]:
    """(name, shape) of a bf16 model: layers of large matrices and many small tensors,
    plus an embedding larger than one bucket."""
    total = int(args.gb * (1 << 30)) // 2          # bf16 elements
    small_total = int(total * args.small_frac)
    small_max = args.small_kb * 512                # elements
    large = args.large_mb * (1 << 19)
    width = 1024 if large >= 1 << 20 else 128
    embed = int(1.25 * args.bucket_mb * (1 << 19)) // width * width
    layout = [("embed", (embed // width, width))] if embed < total // 4 else []
    large_total = total - small_total - sum(s[0] * s[1] for _, s in layout)
    n_large = max(1, large_total // large)
    sizes = [small_max, small_max // 4, small_max // 16, small_max // 2]  # norms, biases, small experts
    n_small = max(1, small_total // (sum(sizes) // len(sizes)))
    per_layer = max(1, n_small // n_large)
    s = 0
    for i in range(n_large):
        layout.append((f"layer{i}.large", (large // width, width)))
        for j in range(per_layer):
            layout.append((f"layer{i}.small{j}", (sizes[s % len(sizes)],)))
            s += 1
    return layout


class Run:
    def __init__(self, rank: int, args, device: torch.device, wt):
        self.rank, self.args, self.device, self.wt = rank, args, device, wt
        self.layout = model_layout(args)
        self.bytes = sum(2 * shape[0] * (shape[1] if len(shape) > 1 else 1) for _, shape in self.layout)
        self.link = None
        self.marks: Optional[list] = None  # --milestones: (what, perf_counter) of this round

    def setup(self, port: int):
        backend = "gloo" if self.device.type == "cpu" else "nccl"
        group = self.wt.open_group("127.0.0.1", port, self.rank, 2, "bench", backend, self.args.timeout,
                                   self.args.nccl_ctas)
        self.link = self.wt.Link(group, self.args.timeout)
        if self.args.milestones:
            watch(self)
        gen = torch.Generator(device=self.device).manual_seed(0)
        make = (lambda shape: torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)) \
            if self.rank == 0 else (lambda shape: torch.empty(shape, device=self.device, dtype=torch.bfloat16))
        self.tensors = [make(shape) for _, shape in self.layout]  # sender: the model; receiver: per-tensor targets
        self.flat = torch.empty(self.bytes, dtype=torch.uint8, device=self.device)
        specs = [(name, shape, torch.bfloat16) for name, shape in self.layout]
        planned = self.wt.plan(specs, self.args.bucket_mb << 20, 0)
        self.manifests = {True: planned, False: dataclasses.replace(planned, checksum=False)}
        self.version = 0
        if self.rank == 0:
            manifest, source = weight_sync_phases.in_one_buffer(self.wt, planned, self.layout, self.tensors)
            # one Buffers for both: a sender keeps its plan while the buffers are the same
            self.from_buffers = {True: (manifest, source), False: (dataclasses.replace(manifest, checksum=False), source)}
            from source_patch.runtime.weight_sync.program import Sources

            self.sources = Sources([("out", t, True) for t in self.tensors], [], (None, None))

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.link.vote(0, "barrier")

    def raw(self):
        self.link.wait(self.link.broadcast(self.flat), "raw")
        self.link.vote(0, "ack")

    def per_tensor(self):
        works = [self.link.broadcast(t) for t in self.tensors]
        for work in works:
            self.link.wait(work, "per-tensor")
        self.link.vote(0, "ack")

    def bucketed(self, checksum=True, stage="update", buffers=False, replay=True, planned=False):
        wt = self.wt
        if self.rank == 0:  # planned once, as the trainer does: a push only changes the version
            self.version += 1
            if planned:  # the packed push's program (program.py), as push() sends with gathers
                wt.send(self.link, dataclasses.replace(self.manifests[checksum], version=self.version),
                        self.sources)
                return None
            if buffers:
                manifest, source = self.from_buffers[checksum]
                wt.send(self.link, dataclasses.replace(manifest, version=self.version), source)
                return None
            wt.send(self.link, dataclasses.replace(self.manifests[checksum], version=self.version),
                    iter(self.tensors), replay_packing=replay)
            return None
        update = wt.receive(self.link, stage=stage)
        if stage == "bucket":
            for _ in update.tensors:
                pass
            return None
        return update.tensors

    def timed(self, fn) -> float:
        self.sync()
        if self.marks is not None:
            self.marks.clear()
        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if self.marks is not None:
            self.rounds.append((start, end, list(self.marks)))
        return end - start


def watch(run: Run) -> None:
    """--milestones: note when each of the link's waits and votes returns, and the
    collector's pauses (host clock), per timed round."""
    import gc

    link, run.marks, run.rounds = run.link, [], []
    wait = link.wait

    def timed_wait(work, what):
        wait(work, what)
        run.marks.append((what, time.perf_counter()))

    def collected(phase, info):
        run.marks.append((f"gc{info['generation']}-{phase}", time.perf_counter()))

    link.wait = timed_wait
    gc.callbacks.append(collected)
    run.unwatch = lambda: gc.callbacks.remove(collected)


STEPS = {"handshake": "hdr", "waiting for an update": "hdr", "manifest": "manifest",
         "manifest vote": "vote", "verdict": "verdict"}


def milestones(run: Run, rank: int, names: list) -> None:
    """Per method and round, ms from the start when each wait returned: handshake,
    manifest, vote, each bucket's data and checksum (b ...), verdict; the round's
    time first; gc: the collector's pauses in the round."""
    lines = []
    for (start, end, marks), name in zip(run.rounds, names):
        if name in ("raw", "per-tensor"):
            continue
        before, buckets, after, gc_ms, gc_start = [], [], [], 0.0, None
        for what, t in marks:
            ms = 1e3 * (t - start)
            if what.startswith("gc"):
                if what.endswith("start"):
                    gc_start = t
                elif gc_start is not None:
                    gc_ms += 1e3 * (t - gc_start)
            elif what.startswith("bucket"):
                buckets.append(f"{ms:.1f}")
            elif what in STEPS:
                (after if buckets else before).append(f"{STEPS[what]} {ms:.1f}")
        lines.append(f"  {name:<16} {1e3 * (end - start):6.1f} | {' '.join(before)} | b {' '.join(buckets)} | "
                     f"{' '.join(after)} | gc {gc_ms:.1f}")
    run.unwatch()
    in_turn(run, rank, f"\n== milestones, {side(rank)} (rank {rank}); ms from the round's start\n" + "\n".join(lines))


def side(rank: int) -> str:
    return "sender" if rank == 0 else "receiver"


def in_turn(run: Run, rank: int, text: str) -> None:
    """Print ``text`` from each side in turn, the sender first (not interleaved)."""
    for r in range(2):
        run.sync()
        if r == rank:
            print(text, flush=True)


def rotation(names, r: int) -> list:
    """``names`` from the r-th on, then the rest: the order of round r."""
    return [*names[r % len(names):], *names[: r % len(names)]]


METHODS = {
    "raw": lambda r: r.raw(),
    "per-tensor": lambda r: r.per_tensor(),
    "bucketed": lambda r: r.bucketed(),
    "bucketed -c": lambda r: r.bucketed(checksum=False),
    "bucketed, copied": lambda r: r.bucketed(replay=False),
    "planned": lambda r: r.bucketed(planned=True),
    "streamed": lambda r: r.bucketed(stage="bucket"),
    "buffers": lambda r: r.bucketed(buffers=True),
    "buffers -c": lambda r: r.bucketed(checksum=False, buffers=True),
    "buffers streamed": lambda r: r.bucketed(stage="bucket", buffers=True),
}


def worker(rank: int, args, port: int):
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    run = Run(rank, args, device, load_transport())
    run.setup(port)
    check(run)
    times = {name: [] for name in METHODS}
    # Per-tensor's rounds come after the others: the update timed right after its
    # thousands of small broadcasts read 13-28 ms instead of 13-14 (whichever method
    # it was, also after a 1 s pause; two H100, 2026-11-25), which made the bucketed
    # row bimodal for as long as the methods rotated through one sequence.
    rotated = [name for name in METHODS if name != "per-tensor"]
    order = []
    if args.gc_off:
        import gc
        gc.collect()
        gc.disable()
    for names in (rotated, ["per-tensor"]):
        for r in range(args.warmup + args.rounds):
            for name in rotation(names, r):
                seconds = run.timed(lambda: METHODS[name](run))
                order.append(name)
                if r >= args.warmup:
                    times[name].append(seconds)
    check(run, "after the timed rounds: ")  # the last update still exact, bit for bit
    if rank == 0:
        report(run, times, args)
    if args.milestones:
        milestones(run, rank, order)
    if args.profile:
        profile(run, rank)
    if args.timeline:
        timeline(run, rank, args.timeline)
    if args.events:
        device_events(run, rank, args.events)
    run.sync()
    run.link.close()  # the group dropped here: its threads stop before the exit (Link.close)


def profile(run: Run, rank: int, rounds: int = 3):
    """Where the host time of a bucketed update goes, per side (cProfile, by own time)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(rounds):
        profiler.runcall(run.timed, lambda: METHODS["bucketed"](run))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    in_turn(run, rank, f"\n== profile, {side(rank)} (rank {rank}), {rounds} bucketed updates\n{out.getvalue()}")


def timeline(run: Run, rank: int, n: int):
    """Per update, what the GPU did (torch.profiler's kernel records): the limiting
    phase of a slow round, on each side."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    rows = []
    for label, fn in (("bucketed", METHODS["bucketed"]), ("bucketed -c", METHODS["bucketed -c"]),
                      ("planned", METHODS["planned"]), ("buffers", METHODS["buffers"])):
        for _ in range(n):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                wall = run.timed(lambda: fn(run))
            rows.append((label, wall, kernel_summary(prof)))
    lines = [f"\n== timeline, {side(rank)} (rank {rank}); ms; gap: the NCCL stream's largest idle time "
             "between its first and last kernel, and the kernel that ended before it",
             f"{'variant':<12} {'wall':>7} {'to 1st bcast':>12} {'nccl busy':>9} {'n nccl':>6} "
             f"{'gap':>7}  {'after':<28} {'sum':>6} {'copy':>6} {'other':>6}"]
    lines += [f"{label:<12} {1e3 * wall:>7.2f} {k['first']:>12.2f} {k['nccl']:>9.2f} {k['n_nccl']:>6} "
              f"{k['gap']:>7.2f}  {k['gap_after'][:28]:<28} {k['sum']:>6.2f} {k['copy']:>6.2f} {k['other']:>6.2f}"
              for label, wall, k in rows]
    in_turn(run, rank, "\n".join(lines))


def device_events(run: Run, rank: int, n: int):
    """--events N: each variant's device timeline from CUDA events, rounds alternated."""
    import weight_sync_events

    if run.device.type != "cuda":
        print("--events: GPUs only (CUDA events)", flush=True)
        return
    recorder = weight_sync_events.Recorder(run.device)
    labels = ("raw", "buffers", "buffers -c", "planned", "bucketed")
    rows = {label: [] for label in labels}
    for r in range(n + 1):
        for label in rotation(labels, r):
            run.sync()
            summary = recorder.round(lambda: METHODS[label](run))
            if r:  # the first round warms the probe stream and the events up
                rows[label].append(summary)
    in_turn(run, rank, weight_sync_events.report(rows, side(rank)))


def kernel_summary(prof) -> dict:
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA"), key=lambda k: k[0])
    if not kernels:
        return dict(first=0, nccl=0, n_nccl=0, gap=0, gap_after="-", sum=0, copy=0, other=0)
    t0 = min(e.time_range.start for e in prof.events())
    nccl = [k for k in kernels if "nccl" in k[2].lower()]
    big = [k for k in nccl if k[1] - k[0] > 50]  # a bucket's broadcast, not a header, sum or vote
    gap, after = 0.0, "-"
    for a, b in zip(nccl, nccl[1:]):
        if b[0] - a[1] > gap:
            gap, after = b[0] - a[1], a[2]
    kind = lambda name: "sum" if "reduce" in name.lower() and "nccl" not in name.lower() else \
        "copy" if "copy" in name.lower() or "memcpy" in name.lower() else "other"
    total = {"sum": 0.0, "copy": 0.0, "other": 0.0}
    for start, end, name in kernels:
        if "nccl" not in name.lower():
            total[kind(name)] += end - start
    return dict(first=((big[0][0] if big else nccl[0][0]) - t0) / 1e3, nccl=sum(b - a for a, b, _ in nccl) / 1e3,
                n_nccl=len(nccl), gap=gap / 1e3, gap_after=after, **{k: v / 1e3 for k, v in total.items()})


def check(run: Run, when: str = ""):
    """The bucketed update, and the one sent from the flat buffer, deliver exactly
    what per-tensor broadcasts deliver."""
    for method in ("bucketed", "planned", "buffers"):
        run.sync()
        run.per_tensor()
        staged = METHODS[method](run)
        if staged is not None:
            want = dict(zip((name for name, _ in run.layout), run.tensors))
            bad = [name for name, got in staged if not torch.equal(got, want[name])]
            if bad or len(staged) != len(want):
                raise SystemExit(f"{method} transfer differs from per-tensor broadcast: {bad[:5]}")
            print(f"check: {when}{method} == per-tensor for all {len(staged)} tensors", flush=True)
    run.sync()


def report(run: Run, times: dict, args):
    gib = run.bytes / (1 << 30)
    n = len(run.layout)
    small = sum(1 for name, _ in run.layout if ".small" in name)
    device = "CPU (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} x2 (NCCL)"
    print(f"\nweight sync bench: {device}, torch {torch.__version__}")
    print(f"model: {gib:.2f} GiB bf16, {n} tensors ({small} small <= {args.small_kb} KiB), "
          f"bucket {args.bucket_mb} MiB, {args.rounds} rounds after {args.warmup} warm-up\n")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'method':<16} {'median s':>10} {'min s':>9} {'max s':>9} {'GB/s':>8} {'% of raw':>9} "
          f"{'90% interval':>15} {'worst round':>11} {'x per-tensor':>13}")
    for name, values in times.items():
        gbps = run.bytes / med[name] / 1e9
        # paired by round: each round runs every method once, one after the other
        _, low, high = stats.bootstrap(stats.ratio_of_medians, times["raw"], values, paired=True)
        print(f"{name:<16} {med[name]:>10.4f} {min(values):>9.4f} {max(values):>9.4f} {gbps:>8.1f} "
              f"{100 * med['raw'] / med[name]:>8.1f}% {f'{100 * low:.1f}..{100 * high:.1f}%':>15} "
              f"{100 * med['raw'] / max(values):>10.1f}% {med['per-tensor'] / med[name]:>12.1f}x")
    print("\n% of raw: the raw broadcast's median time over the method's (90% interval: a bootstrap over "
          "the rounds, resampled as pairs; worst round: over its slowest)")
    print("every round, ms (the order of methods rotates by one each round; per-tensor runs after the others):")
    for name, values in times.items():
        print(f"  {name:<16} " + " ".join(f"{1e3 * v:.1f}" for v in values))
    for name in ("bucketed", "bucketed, copied", "planned", "streamed", "buffers", "buffers streamed"):
        print(f"{name}: {100 * med['raw'] / med[name]:.0f}% of raw at the median, "
              f"{100 * med['raw'] / max(times[name]):.0f}% in the worst round; "
              f"{med['per-tensor'] / med[name]:.1f}x per-tensor", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.phases:
        for frac in args.small_fracs:
            one = argparse.Namespace(**{**vars(args), "small_frac": frac})
            weight_sync_phases.phases(one, load_transport(), model_layout(one))
        return
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs (or --cpu for the gloo smoke test)")
    if args.events:  # NCCL's own start events, for each collective's duration (before any group)
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
