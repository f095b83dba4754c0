"""What a sender's own device work costs its NCCL broadcast (issue 32's packed push).

A packed push copies bucket k + 1 into its buffer (and sums bucket k) while bucket k
is on the wire.  This bench measures one 512 MiB broadcast from GPU 0 to GPU 1 while
GPU 0 runs, on another stream, nothing or one of: torch's copy of 512 MiB, torch.sum
of 512 MiB of int64 words, both, a copy by a Triton kernel limited to P programs
(a copy that takes longer but leaves the memory system room), or what the sender
runs (runtime/weight_sync/copysum.py: the packing's Table of 1 MiB pieces and the
checksum's word_sum, on half the multiprocessors, apart or in one pass as a packed
bucket's are; the one pass also on a quarter and an eighth of them).  Per variant: the
broadcast's time (median and 90% interval over rounds, CUDA events around it on the
sender) and the side work's time alone.  Both are queued behind a ~1 ms sleep before
the device starts them (since 2026-11-27 06:00 UTC; before, the side work's host launch
time, tens of us for a Triton launch from Python, was counted as the broadcast's).  Needs two GPUs.

    python bench/contention_bench.py [--mib 512] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def throttled_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        for start in range(tl.program_id(0) * BLOCK, n, PROGRAMS * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    def run(src, dst, programs):
        copy[(programs,)](src, dst, src.numel(), BLOCK=2048, PROGRAMS=programs)
    return run


PROGRAMS = (16, 32, 64, 132)
VARIANTS = ("none", "torch copy", "torch.sum", "copy + sum", *(f"Triton copy, {p} programs" for p in PROGRAMS),
            "copysum.Table (the packing)", "copysum.word_sum (the checksum)", "Table + word_sum",
            "Table summing as it copies (kept)", "the same, 1/4 of the SMs", "the same, 1/8 of the SMs")


def side_work(mib: int, device: torch.device) -> dict:
    words = (mib << 20) // 8
    src = torch.randint(0, 1 << 40, (words,), dtype=torch.int64, device=device)
    dst, total = torch.empty_like(src), torch.zeros((), dtype=torch.int64, device=device)
    work = {"none": lambda: None, "torch copy": lambda: dst.copy_(src),
            "torch.sum": lambda: torch.sum(src, 0, out=total),
            "copy + sum": lambda: (dst.copy_(src), torch.sum(dst, 0, out=total))}
    copy = throttled_copy()
    for programs in PROGRAMS:
        work[f"Triton copy, {programs} programs"] = lambda p=programs: copy(src, dst, p)
    from source_patch.runtime.weight_sync import copysum

    half = copysum.programs(device)
    cut = 1 << 17  # 1 MiB pieces, as a bucket of many tensors
    pieces = list(zip(dst.split(cut), src.split(cut)))
    table = copysum.Table(pieces, device, half)
    work["copysum.Table (the packing)"] = table
    work["copysum.word_sum (the checksum)"] = lambda: copysum.word_sum(dst, total, half)
    work["Table + word_sum"] = lambda: (table(), copysum.word_sum(dst, total, half))

    def summing(share: int):  # the packing's Table adding what it copies into one checksum
        t = copysum.Table(pieces, device, copysum.programs(device, share))
        t.into = total.view(1)
        return lambda: (total.zero_(), t())
    work["Table summing as it copies (kept)"] = summing(copysum.SHARE)
    for share in (4, 8):
        work[f"the same, 1/{share} of the SMs"] = summing(share)
    return work


QUEUE_CYCLES = 2_000_000  # ~1 ms of GPU clock: the host queues the side work and the broadcast meanwhile


def timed(fn, queued: bool = True) -> float:
    """Device ms of what ``fn`` queues; ``queued``: behind a ~1 ms sleep, so that both
    start together on the device and the host's launch time (a Triton launch from
    Python: tens of us) is not counted as the broadcast's."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(QUEUE_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def rank_main(rank: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    data = torch.zeros(args.mib << 20, dtype=torch.uint8, device=device)
    work = side_work(args.mib, device) if rank == 0 else None
    variants = list(VARIANTS)
    side = torch.cuda.Stream(device)
    results = {v: [] for v in variants}
    alone = {}
    if rank == 0:
        for v in variants:
            for _ in range(3):
                work[v]()
            torch.cuda.synchronize()
            alone[v] = statistics.median(timed(work[v]) for _ in range(10))
    for r in range(args.warmup + args.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:  # rotate the order
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            if rank == 0:
                def both():
                    side.wait_stream(torch.cuda.current_stream())  # after the sleep
                    with torch.cuda.stream(side):
                        work[v]()
                    dist.broadcast(data, 0, async_op=True).wait()
                ms = timed(both)
            else:
                ms = timed(lambda: dist.broadcast(data, 0, async_op=True).wait(), queued=False)  # (waits for rank 0)
            torch.cuda.synchronize()
            if r >= args.warmup:
                results[v].append(ms)
    if rank == 0:
        from stats import bootstrap
        base = statistics.median(results["none"])
        print(f"{args.mib} MiB broadcast GPU 0 -> GPU 1 while GPU 0 runs side work; {args.rounds} rounds, ms")
        print(f"{'side work':34}{'alone':>8}{'bcast min':>11}{'median':>9}{'90% interval':>17}{'x none':>8}")
        for v in variants:
            values = results[v]
            _, low, high = bootstrap(statistics.median, values)
            print(f"{v:34}{alone[v]:8.3f}{min(values):11.3f}{statistics.median(values):9.3f}"
                  f"{low:9.3f}..{high:6.3f}{statistics.median(values) / base:8.3f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--port", type=int, default=29561)
    args = p.parse_args()
    mp.spawn(rank_main, args=(args,), nprocs=2)


if __name__ == "__main__":
    main()
