"""weight_sync_bench.py's ``--phases`` mode: each phase of an update timed apart in
one process (one GPU, or --cpu): pack, checksums, both receivers, load into the
engine, device copy.  Its own module so that the two-process bench stays readable;
run it through ``python bench/weight_sync_bench.py --phases``.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

class Clock:
    """Times regions: host wall (perf_counter) and CPU (thread_time) time, and device
    time from CUDA events (read in settle(), one sync per round; on CPU the work is
    synchronous, so device time is the host wall time)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        # torch.cuda._sleep spins for a number of GPU clock cycles: measure the rate once.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        return 20_000_000 / (start.elapsed_time(end) / 1e3)

    def run(self, fn, hold_s: float = 0.0, device: bool = True):
        """(fn(), {"host", "cpu", "device"} seconds), after the device finished earlier
        regions (a region that syncs must not wait for another's work).  ``device``:
        False for host-only work (device time None).  ``hold_s``:
        first make the stream wait that long (a sleep kernel) so that everything fn
        launches is queued when the device starts it: the events then time the device
        work alone, not the host's launch rate.  Only for regions that do not wait for
        the device and launch fewer kernels than the launch queue holds."""
        sample = {"device": None}
        events = self.cuda and device
        if self.cuda:
            torch.cuda.synchronize()
        if events:
            if hold_s:
                torch.cuda._sleep(int(hold_s * self.cycles_per_s))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn()
        sample["host"], sample["cpu"] = time.perf_counter() - t0, time.thread_time() - c0
        if events:
            end.record()
            self.pending.append((sample, start, end))
        elif device:
            sample["device"] = sample["host"]
        return out, sample

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for sample, start, end in self.pending:
                sample["device"] = start.elapsed_time(end) / 1e3
        self.pending.clear()


def _hold(last: Optional[dict]) -> float:
    """How long to hold the stream before a region: well over the host time it took
    last round (50 ms before the first)."""
    return 0.05 if last is None else 2 * last["host"] + 1e-3


def _total(*samples: dict) -> dict:
    """The sum of samples; device time None when no sample has one."""
    device = [s["device"] for s in samples if s["device"] is not None]
    return {"host": sum(s["host"] for s in samples), "cpu": sum(s["cpu"] for s in samples),
            "device": sum(device) if device else None}


def phases(args, wt, layout: list) -> None:
    """``wt``: the transport module; ``layout``: weight_sync_bench.model_layout(args)."""
    from source_patch.runtime.weight_sync import sender, wire  # the packing and checksums measured alone

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # as the 2-process CPU run: one core per side
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) for _, shape in layout]
    nbytes = sum(t.nbytes for t in tensors)
    manifest = wt.plan([(name, shape, torch.bfloat16) for name, shape in layout], args.bucket_mb << 20, 1)
    buckets = manifest.buckets
    packing = sender._Packing(manifest, device)
    tx = wt.LoopbackLink(device)                   # records the update once, for the receivers
    rx = wt.LoopbackLink(device, replay=tx)
    quiet = wt.LoopbackLink(device, record=False)  # send() with a wire that costs nothing
    wt.send(tx, manifest, iter(tensors))
    targets = [torch.empty_like(t) for t in tensors]  # the engine's parameters
    flat = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    phases_check(wt, manifest, packing, tensors, tx, rx)
    from_buffers = in_one_buffer(wt, manifest, layout, tensors)
    clock = Clock(device)

    def streamed():
        for _ in wt.receive(rx, stage="bucket").tensors:
            pass

    def load(received):
        for (_, tensor), target in zip(received, targets):
            target.copy_(tensor)

    per_bucket = {key: [[] for _ in range(buckets)] for key in ("take", "pack", "sum")}
    rows: dict = {}
    last: dict = {}
    for r in range(args.warmup + args.rounds):
        round_rows: dict = {}
        take, pack, sums = [], [], []
        batches = packing.batches(iter(tensors))
        for k in range(buckets):
            (_, sources), sample = clock.run(lambda: next(batches), device=False)
            take.append(sample)
            data, sample = clock.run(lambda: packing.pack(k, sources), _hold(last.get(("pack", k))))
            pack.append(sample)
            last[("pack", k)] = sample
            _, sample = clock.run(lambda: wire.bucket_sum(data, packing.sums[k]), 1e-3)
            sums.append(sample)
        for _ in batches:  # its end: the check for more tensors than planned
            pass
        quiet.rewind()
        _, round_rows["send"] = clock.run(lambda: wt.send(quiet, manifest, iter(tensors)))
        quiet.rewind()
        _, round_rows["send buffers"] = clock.run(lambda: wt.send(quiet, *from_buffers))
        rx.rewind()
        received, round_rows["staged"] = clock.run(lambda: wt.receive(rx).tensors)
        # No hold: one copy_ per tensor would fill the launch queue and block the host.
        _, round_rows["load"] = clock.run(lambda: load(received))
        rx.rewind()
        _, round_rows["streamed"] = clock.run(streamed)
        _, round_rows["copy"] = clock.run(lambda: flat[1].copy_(flat[0]), 1e-3)
        clock.settle()
        if r < args.warmup:
            continue
        for key, samples in (("take", take), ("pack", pack), ("sum", sums)):
            for k, sample in enumerate(samples):
                per_bucket[key][k].append(sample)
        round_rows["take"], round_rows["pack"], round_rows["sum"] = _total(*take), _total(*pack), _total(*sums)
        round_rows["pack total"] = _total(round_rows["take"], round_rows["pack"])
        for key, sample in round_rows.items():
            rows.setdefault(key, []).append(sample)
    phases_report(args, device, manifest, layout, nbytes, per_bucket, rows)


def phases_check(wt, manifest, packing, tensors, tx, rx) -> None:
    """What is timed is what a real update does: each packed bucket equals the bytes
    send() broadcast for it, and both receivers hand out the sent tensors."""
    step = 2 if manifest.checksum else 1  # per bucket: the bytes, then the checksum
    # (the loopback wire always carries the manifest: the handshake row, its length, the manifest, then the buckets)
    for k, sources in packing.batches(iter(tensors)):
        if k < manifest.buckets and not torch.equal(packing.pack(k, sources), tx.messages[3 + step * k]):
            raise SystemExit(f"bucket {k}: packed bytes differ from the bytes send() broadcast")
    for stage in ("update", "bucket"):
        rx.rewind()
        handed = 0
        for (name, got), want in zip(wt.receive(rx, stage=stage).tensors, tensors):
            if not torch.equal(got, want):  # before the next one: streamed buffers are reused
                raise SystemExit(f"stage {stage}: {name} differs from the sent tensor")
            handed += 1
        if handed != len(tensors):
            raise SystemExit(f"stage {stage}: {handed} of {len(tensors)} tensors handed out")
    print(f"check: packed buckets == broadcast bytes; both stages hand out all {len(tensors)} tensors", flush=True)


PHASE_ROWS = [  # (key, label)
    ("take", "(a) sender take + check (batches)"),
    ("pack", "(a) sender pack copies (pack)"),
    ("pack total", "(a) sender pack total"),
    ("sum", "(b) checksums (bucket_sum)"),
    ("send", "    send(), free wire: (a)+(b)+protocol"),
    ("send buffers", "    send() from one buffer (plan_buffers)"),
    ("staged", "(c) receiver stage update (+ wire copies)"),
    ("streamed", "(c) receiver stage bucket (+ wire copies)"),
    ("load", "(e) engine load: copy_ per tensor"),
    ("copy", "(d) one d2d copy of the model's bytes"),
]


def phases_report(args, device, manifest, layout, nbytes, per_bucket, rows) -> None:
    def ms(values):
        if None in values:
            return f"{'-':>8} {'-':>8}"
        return f"{1e3 * min(values):>8.3f} {1e3 * statistics.median(values):>8.3f}"

    def gbps(size, values):
        return f"{'-':>7}" if None in values else f"{size / statistics.median(values) / 1e9:>7.1f}"

    n = len(layout)
    small = sum(1 for name, _ in layout if ".small" in name)
    name = "CPU, 1 thread" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\nweight sync phases: {name}, torch {torch.__version__}")
    print(f"model: {nbytes / (1 << 30):.2f} GiB bf16, {n} tensors ({small} small <= {args.small_kb} KiB), "
          f"bucket {args.bucket_mb} MiB, {manifest.buckets} buckets, {args.rounds} rounds after "
          f"{args.warmup} warm-up; times in ms, min and median")
    print("(device: the host time; the work is synchronous)\n" if device.type == "cpu" else
          "(device: CUDA events; (a) pack, (b), (d): the work alone (stream held until launched), "
          "else from the region's start until its work is done)\n")
    print(f"{'bucket':>6} {'tensors':>8} {'MiB':>7}  {'take host':>17}  {'pack host':>17}  "
          f"{'pack device':>17} {'GB/s':>7}  {'sum device':>17} {'GB/s':>7}")
    for k in range(manifest.buckets):
        start, end = manifest.window(k)
        count = sum(1 for e in manifest.entries if start <= e.offset < end)
        take, pack, sums = ([s[column] for s in per_bucket[key][k]]
                            for key, column in (("take", "host"), ("pack", "host"), ("sum", "device")))
        pack_device = [s["device"] for s in per_bucket["pack"][k]]
        print(f"{k:>6} {count:>8} {(end - start) / (1 << 20):>7.1f}  {ms(take)}  {ms(pack)}  "
              f"{ms(pack_device)} {gbps(end - start, pack_device)}  {ms(sums)} {gbps(end - start, sums)}")
    print(f"\n{'per update':<42} {'host':>17} {'cpu':>8} {'device':>17} {'GB/s':>7} {'host us/tensor':>15}")
    for key, label in PHASE_ROWS:
        samples = rows[key]
        host, dev = [s["host"] for s in samples], [s["device"] for s in samples]
        print(f"{label:<42} {ms(host)} {1e3 * statistics.median([s['cpu'] for s in samples]):>8.3f} {ms(dev)} "
              f"{gbps(nbytes, dev)} {1e6 * statistics.median(host) / n:>15.3f}")
    print("(GB/s: the bytes over the median device time; the copies read and write them; cpu: median "
          "thread_time)", flush=True)


def in_one_buffer(wt, planned, layout, tensors):
    """The tensors copied into one flat buffer at the offsets plan() gives them (as a
    parameter buffer holds them), and plan_buffers() of those views: the same
    manifest entries, so a receiver's cached views serve both."""
    buffer = torch.empty(planned.total_bytes, dtype=torch.uint8, device=tensors[0].device)
    views = [(name, buffer[e.offset: e.offset + e.nbytes].view(t.dtype).view(t.shape))
             for (name, _), e, t in zip(layout, planned.entries, tensors)]
    torch._foreach_copy_([v for _, v in views], tensors)
    manifest, source = wt.plan_buffers(views, planned.bucket_bytes, planned.version)
    assert manifest.entries == planned.entries
    return manifest, source
