"""Weight sync: bucketed transfer against per-tensor broadcast and one raw broadcast,
measured in the same run, on two processes (one per GPU, NCCL) or on CPU (gloo).

    python bench/weight_sync_bench.py --gb 4          # two GPUs: spawns rank 0 (sender) and rank 1
    python bench/weight_sync_bench.py --cpu           # smoke test on CPU over gloo, tiny sizes

Needs only torch and runtime/weights/transport.py (imported from the installed
source_patch, else straight from this checkout).  The synthetic model has
``--small-frac`` of its bytes in small tensors (norms, biases, fine-grained
experts: ``--small-kb`` and smaller), the rest in ``--large-mb`` matrices, and one
embedding-like tensor larger than a bucket (split across buckets).

Methods (sender's wall time from a barrier until every receiver is done):
  raw          one broadcast of a flat buffer of the model's size: the interconnect's bandwidth
  per-tensor   one async broadcast per tensor, all waited (SGLang's non-bucketed path, into
               preallocated tensors)
  bucketed     weight_transport.send/receive: manifest, double-buffered buckets, per-bucket
               checksums, verdict; the receiver stages the whole update (stage "update")
  bucketed -c  the same without checksums
  streamed     stage "bucket": the receiver verifies and hands out bucket by bucket
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def load_transport():
    try:
        from source_patch.runtime.weights import transport as weight_transport
    except ImportError:  # a bare checkout: the module needs only torch
        path = Path(__file__).resolve().parents[1] / "runtime" / "weight_transport.py"
        spec = importlib.util.spec_from_file_location("weight_transport", path)
        weight_transport = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = weight_transport  # dataclasses look their module up there
        spec.loader.exec_module(weight_transport)
    return weight_transport


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=None, help="model size in GiB (default 4; --cpu 0.03)")
    p.add_argument("--small-frac", type=float, default=0.1, help="share of bytes in small tensors")
    p.add_argument("--small-kb", type=int, default=None, help="largest small tensor, KiB (default 128; --cpu 8)")
    p.add_argument("--large-mb", type=int, default=None, help="large tensor size, MiB (default 64; --cpu 1)")
    p.add_argument("--bucket-mb", type=int, default=None, help="bucket size, MiB (default 512; --cpu 4)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke test)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--profile", action="store_true", help="then profile the host side of bucketed updates")
    args = p.parse_args(argv)
    cpu = args.cpu
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

    def setup(self, port: int):
        backend = "gloo" if self.device.type == "cpu" else "nccl"
        group = self.wt.open_group("127.0.0.1", port, self.rank, 2, "bench", backend, self.args.timeout)
        self.link = self.wt.Link(group, self.args.timeout)
        gen = torch.Generator(device=self.device).manual_seed(0)
        make = (lambda shape: torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)) \
            if self.rank == 0 else (lambda shape: torch.empty(shape, device=self.device, dtype=torch.bfloat16))
        self.tensors = [make(shape) for _, shape in self.layout]  # sender: the model; receiver: per-tensor targets
        self.flat = torch.empty(self.bytes, dtype=torch.uint8, device=self.device)
        specs = [(name, shape, torch.bfloat16) for name, shape in self.layout]
        planned = self.wt.plan(specs, self.args.bucket_mb << 20, 0)
        self.manifests = {True: planned, False: dataclasses.replace(planned, checksum=False)}
        self.version = 0

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

    def bucketed(self, checksum=True, stage="update"):
        wt = self.wt
        if self.rank == 0:  # planned once, as the trainer does: a push only changes the version
            self.version += 1
            wt.send(self.link, dataclasses.replace(self.manifests[checksum], version=self.version),
                    iter(self.tensors))
            return None
        update = wt.receive(self.link, stage=stage)
        if stage == "bucket":
            for _ in update.tensors:
                pass
            return None
        return update.tensors

    def timed(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


METHODS = {
    "raw": lambda r: r.raw(),
    "per-tensor": lambda r: r.per_tensor(),
    "bucketed": lambda r: r.bucketed(),
    "bucketed -c": lambda r: r.bucketed(checksum=False),
    "streamed": lambda r: r.bucketed(stage="bucket"),
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
    names = list(METHODS)
    for r in range(args.warmup + args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            seconds = run.timed(lambda: METHODS[name](run))
            if r >= args.warmup:
                times[name].append(seconds)
    if rank == 0:
        report(run, times, args)
    if args.profile:
        profile(run, rank)
    run.sync()
    run.wt.close_group(run.link.group)


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
    side = "sender" if rank == 0 else "receiver"
    for r in range(2):
        run.sync()
        if r == rank:
            print(f"\n== profile, {side} (rank {rank}), {rounds} bucketed updates\n{out.getvalue()}", flush=True)


def check(run: Run):
    """The bucketed update delivers exactly what per-tensor broadcasts deliver."""
    run.sync()
    run.per_tensor()
    staged = run.bucketed()
    if staged is not None:
        bad = [name for (name, got), want in zip(staged, run.tensors) if not torch.equal(got, want)]
        if bad:
            raise SystemExit(f"bucketed transfer differs from per-tensor broadcast: {bad[:5]}")
        print(f"check: bucketed == per-tensor for all {len(staged)} tensors", flush=True)
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
    print(f"{'method':<12} {'median s':>10} {'min s':>9} {'max s':>9} {'GB/s':>8} {'% of raw':>9} {'x per-tensor':>13}")
    for name, values in times.items():
        gbps = run.bytes / med[name] / 1e9
        print(f"{name:<12} {med[name]:>10.4f} {min(values):>9.4f} {max(values):>9.4f} {gbps:>8.1f} "
              f"{100 * med['raw'] / med[name]:>8.1f}% {med['per-tensor'] / med[name]:>12.1f}x")
    print(f"\ngoal >= 80% of raw: bucketed {100 * med['raw'] / med['bucketed']:.0f}%, "
          f"without checksums {100 * med['raw'] / med['bucketed -c']:.0f}%")
    print(f"goal >= 10x per-tensor: bucketed {med['per-tensor'] / med['bucketed']:.1f}x", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs (or --cpu for the gloo smoke test)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
