"""weight_sync_bench.py --events N: where an update's device time goes, read from CUDA
events instead of a profiler (which slowed the updates it watched too much to place a
1% gap).  Per side, every collective's end is an event recorded on a probe stream
made to wait for it (the sender's and receiver's own streams untouched), its device
duration NCCL's own (TORCH_NCCL_ENABLE_TIMING), and each bucket's packing ends at an
event on the stream that packed it.  From them, per update, ms from the round's start:

  first     the first bucket's broadcast starts (the handshake and bucket 0's packing before it)
  data      the buckets' broadcasts, summed (raw: the one broadcast)
  small     the handshake, the votes and the checksums' broadcasts, summed
  idle      the NCCL stream idle between the first bucket's start and the last's end
  tail      from the last bucket's end to the side's last event (checksum, verdict)

and the first calls of an update: what, when the host called it and got it back, when
it started and ended on the device (where the time before the first bucket goes).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

BUCKET_BYTES = 1 << 20  # a collective this large or larger carries a bucket's data


class Recorder:
    """Patches torch.distributed's broadcast, all_reduce and all_gather (link.py looks
    them up at each call) and the packings' pack() to note an event after each."""

    def __init__(self, device: torch.device):
        self.probe = torch.cuda.Stream(device)
        self.marks: list = []  # (kind, bytes or bucket, end event, work or None, host perf_counter at call and return)
        self.on = False
        for name in ("broadcast", "all_reduce", "all_gather"):
            setattr(dist, name, self._collective(getattr(dist, name), name))
        from source_patch.runtime.weight_sync import program, sender

        for cls in (program.Program, sender._Spans, sender._Packing):
            cls.pack = self._pack(cls.pack)

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _collective(self, call, kind: str):
        def noted(tensor, *args, **kwargs):  # (all_gather: the list of outputs first, then the input)
            posted = time.perf_counter()
            work = call(tensor, *args, **kwargs)
            if isinstance(tensor, list):
                tensor = args[0]
            if self.on:
                if work is not None:  # its end, without ordering the caller's stream after it
                    with torch.cuda.stream(self.probe):
                        work.wait()
                        event = self._event()
                else:
                    event = self._event()
                self.marks.append((kind, tensor.numel() * tensor.element_size(), event, work,
                                   (posted, time.perf_counter())))
            return work
        return noted

    def _pack(self, pack):
        def noted(packing, k, *args, **kwargs):
            posted = time.perf_counter()
            data = pack(packing, k, *args, **kwargs)
            if self.on:
                self.marks.append(("pack", k, self._event(), None, (posted, time.perf_counter())))
            return data
        return noted

    def round(self, fn) -> dict:
        """Run ``fn`` (one update) and return its device timeline summary."""
        self.marks.clear()
        start = self._event()
        self.host_start = time.perf_counter()
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        end = self._event()
        torch.cuda.synchronize()
        return summary(start, end, self.marks, self.host_start)


def summary(start, end, marks: list, host_start: float) -> dict:
    collectives = []
    packs = []
    steps = []  # (what, host ms at the call and at its return, device ms at its start and end) of the first marks
    for kind, size, event, work, (posted, returned) in marks:
        at = start.elapsed_time(event)
        if len(steps) < STEPS:
            steps.append((f"{kind[:4]} {size}" if kind == "pack" else f"{kind[:4]} {_size(size)}",
                          1e3 * (posted - host_start), 1e3 * (returned - host_start), at - _took(work), at))
        if kind == "pack":
            packs.append(at)
            continue
        took = _took(work)
        collectives.append((at - took, at, size))
    data = [c for c in collectives if c[2] >= BUCKET_BYTES]
    small = [c for c in collectives if c[2] < BUCKET_BYTES]
    total = start.elapsed_time(end)
    if not data:
        return dict(total=total, first=0, data=0, small=0, idle=0, tail=0, buckets=0, packs=packs, steps=steps)
    busy, idle, last = 0.0, 0.0, data[0][0]
    for begin, finish, _ in sorted(c for c in collectives if c[0] >= data[0][0] and c[1] <= data[-1][1]):
        idle += max(0.0, begin - last)
        last = max(last, finish)
    return dict(total=total, first=data[0][0], data=sum(f - b for b, f, _ in data),
                small=sum(f - b for b, f, _ in small), idle=idle, tail=total - data[-1][1],
                buckets=len(data), packs=packs, steps=steps)


def _took(work) -> float:
    """A collective's device ms (NCCL's start and end events), 0 where unknown."""
    try:
        return work._get_duration() if work is not None else 0.0
    except (RuntimeError, AttributeError):  # timing off
        return 0.0


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n}B"


STEPS = 7  # the first calls shown with their host and device times


COLUMNS = ("total", "first", "data", "small", "idle", "tail")


def report(rows: dict, side: str) -> str:
    """Medians (and the range) over each variant's rounds, ms."""
    lines = [f"\n== device timeline (CUDA events), {side}; ms, median (min..max) over the rounds",
             f"{'variant':<12}" + "".join(f"{c:>20}" for c in COLUMNS) + f"{'buckets':>9}"]
    for label, summaries in rows.items():
        cells = []
        for column in COLUMNS:
            values = [s[column] for s in summaries]
            cells.append(f"{statistics.median(values):7.3f} ({min(values):.2f}..{max(values):.2f})")
        lines.append(f"{label:<12}" + "".join(f"{c:>20}" for c in cells) + f"{summaries[0]['buckets']:>9}")
    packs = {label: [s["packs"] for s in summaries] for label, summaries in rows.items() if summaries[0]["packs"]}
    for label, rounds in packs.items():
        ends = [statistics.median(r[i] for r in rounds) for i in range(min(len(r) for r in rounds))]
        lines.append(f"  {label}: bucket k packed at (median ms) " + " ".join(f"{e:.2f}" for e in ends))
    lines.append("  the first calls, median ms from the round's start: what host call-return, device start-end")
    for label, summaries in rows.items():
        n = min(len(s["steps"]) for s in summaries)
        cells = [f"{summaries[0]['steps'][i][0]} " + "/".join(
            "-".join(f"{statistics.median(s['steps'][i][j] for s in summaries):.2f}" for j in pair)
            for pair in ((1, 2), (3, 4))) for i in range(n)]
        lines.append(f"  {label:<11} " + " | ".join(cells))
    return "\n".join(lines)
