"""The packed push as a program planned once per layout (issue 32, item 2).

A packed push (the path of every tensor- or expert-parallel trainer) used to do
~3.7 us of host work per engine tensor on the critical path, every push: walk the
parameters, join shards, map names and layouts (``names.to_hf``), take and check
each tensor, then copy it into its bucket.  The layout is the same every step, so
all of that is planned once here:

* ``Sources`` (planning.py builds it, megatron.MegatronParams.ops): the push as
  operations over memory that stays put: gathers of buffer windows into two kept
  slots, shard copies into kept staging (the joins), and every engine tensor as a
  *view* of a parameter or of a slot (the fused QKV as strided views: no copy);
* ``Program``: those operations bound to the sender's bucket buffers (the two
  reused ones, or the ipc export): per bucket, runs of copies between gathers,
  grouped by dtype into one ``torch._foreach_copy_`` each, on a GPU captured as a
  CUDA graph at the second push (the first copies: a warm-up) and replayed from then
  on (one launch per run, nothing per tensor).  On a GPU a bucket's copies go
  through copysum.Table, on half the multiprocessors (NCCL keeps the rest; bucket
  0, packed while only the handshake travels, on all of them), and every
  bucket gets its checksum in the same pass (_sum_in_tables).

A push then costs per bucket: its gathers (collectives on the tensor/expert groups,
issued from the host, ordered with the copies on the device: a gather for bucket
k + 1 runs while bucket k is on the wire) and one graph launch.  The program holds
while the parameters' storages and the buffer windows stay where they were
(planning.py checks one tensor per storage each push).  A tensor split over two
buckets whose source is a slot (or strided) is first copied whole into a kept
carry tensor, so every read of a slot happens in walk order, before the slot is
reused.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, Optional

import torch

from . import copysum
from .wire import Manifest, WeightSyncError, tensors_digest

log = logging.getLogger("source_patch.weight_sync")


class Sources:
    """A model's push as kept operations (see the module doc): ``ops`` in manifest
    order, ``anchors`` (megatron.storage_anchors) of the memory they read."""

    def __init__(self, ops: list, anchors: list, windows: tuple):
        self.ops, self.anchors, self.windows = ops, anchors, windows
        self.gathers = [op[1] for op in ops if op[0] == "gather"]
        self.done = 0  # gathers run in this push (a send sets 0 first)

    def drain(self) -> None:
        """Run this push's gathers not run yet (a failed send: the other participants
        still wait in theirs)."""
        while self.done < len(self.gathers):
            self.done += 1
            self.gathers[self.done - 1]()


def _layout_key(manifest: Manifest) -> tuple:
    return manifest.bucket_bytes, manifest.total_bytes, manifest.entries


class Packed:
    """What every way of packing an update's buckets keeps while its layout holds
    (sender._Packing, sender._Spans, Program): the manifest's tensor list as JSON and
    its digest, the manifest's bytes as sent (``manifest_message``), a checksum slot
    per bucket, and what it packs from (``source``)."""

    def __init__(self, manifest: Manifest, source, device: torch.device):
        self.manifest, self.source = manifest, source
        self.key = _layout_key(manifest)
        self.tensors_json = manifest.tensors_to_json()
        self.tensors_digest = tensors_digest(self.tensors_json)
        self.sums = torch.zeros(max(manifest.buckets, 1), dtype=torch.int64, device=device)
        self.message = None  # (head, int64[1] length, uint8 body): the manifest as sent (manifest_message)

    def manifest_message(self, manifest: Manifest, device: torch.device) -> tuple:
        """The manifest as the wire carries it, (int64[1] its length, uint8[length] its
        JSON) on ``device``: built once per layout, then per push only its head (the
        version) is written again where it changed, so a push whose manifest travels
        (a receiver new to the layout) does no work per tensor.  The bytes are
        ``manifest.to_json(self.tensors_json)``'s."""
        prefix = manifest.to_json(b"0")[:-2]  # up to '"tensors":' (the tensors come last)
        kept = self.message
        if kept is not None and len(kept[0]) == len(prefix) and kept[2].device == device:
            if kept[0] != prefix:  # another version: rewrite the head only
                kept[2][: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
                self.message = kept = (prefix, kept[1], kept[2])
            return kept[1], kept[2]
        text = prefix + self.tensors_json + b"}"
        body = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)
        length = torch.tensor([len(text)], dtype=torch.int64).to(device)
        self.message = (prefix, length, body)
        return length, body

    def matches(self, manifest: Manifest, source=None) -> bool:
        """Whether it packs this update (same layout, same source) as it stands."""
        return self.source is source and self.key == _layout_key(manifest)

    def replay_copies(self, on: bool) -> None:
        """The replay_packing setting, per send: may its copies replay as CUDA graphs
        (a packing without copies to replay ignores it)."""

    def staged(self, k: int) -> bool:
        """Whether bucket k is packed into one of the reused bucket buffers (else it is
        sent from memory nothing else writes during the update)."""
        return True

    def summed(self, k: int) -> bool:
        """Whether packing bucket k also wrote its checksum into ``sums[k]``."""
        return False


class Program(Packed):
    """``Sources`` bound to the bucket buffers (``stream``: the ipc export, each bucket
    in its own window of it; else two reused buffers).  The sender drives it like
    sender._Packing: ``batches`` then ``pack(k, _)`` per bucket."""

    def __init__(self, manifest: Manifest, sources: Sources, device: torch.device,
                 stream: Optional[torch.Tensor] = None, tables: Optional[bool] = None):
        """``tables``: copy into the buckets by copysum.Table where it can (default: on
        a GPU with Triton)."""
        super().__init__(manifest, sources, device)
        self.buffers = bucket_slots(manifest, device, stream)
        n = max(manifest.buckets, 1)
        self.carries: list = []  # kept whole copies of split tensors read from slots
        steps: list = [[] for _ in range(n)]  # per bucket: ("gather", call) | (phase, dst, src)
        pending: list = []
        entries = manifest.entries
        i = 0
        for op in sources.ops:
            if op[0] != "out":
                pending.append(op)
                continue
            if i >= len(entries):
                raise WeightSyncError(f"the program has more tensors than the manifest's {len(entries)}")
            first = min(entries[i].offset // manifest.bucket_bytes, n - 1)
            steps[first] += pending
            pending = []
            self._place(entries[i], op[1], op[2], steps, n)
            i += 1
        if i != len(entries):
            raise WeightSyncError(f"the program has {i} tensors, the manifest {len(entries)}")
        steps[-1] += pending
        if tables is None:
            tables = device.type == "cuda" and copysum.available()
        table = _table_maker(device) if tables else None
        # Bucket 0 is packed while only the handshake is on the wire, and
        # the first broadcast waits for it: its Table runs on every multiprocessor.
        first = _table_maker(device, share=1) if tables else None
        self.runs = [_runs(ops, table if k else first) for k, ops in enumerate(steps)]  # per bucket: [call | run]
        self.summing: set = set()  # buckets whose checksum the packing computes (summed)
        if table is not None and manifest.checksum and stream is None:
            for k in range(manifest.buckets):
                self._sum_in_tables(k, table if k else first)
        self.graphs: list = [[None] * len(runs) for runs in self.runs]
        self.capturable = device.type == "cuda"  # off for good once a capture failed
        self.enabled = True  # the replay_packing setting, per send
        self.device = device
        self.capture_stream = None
        self.first_stream = None  # where the sender packs bucket 0 (sender._Sender._aside)

    def _place(self, e, src: torch.Tensor, stable: bool, steps: list, n: int) -> None:
        if src.dtype != e.dtype or src.numel() != math.prod(e.shape):
            raise WeightSyncError(f"{e.name}: the program has {tuple(src.shape)} {src.dtype}, "
                                  f"planned {e.shape} {e.dtype}")
        size = self.manifest.bucket_bytes
        first, last = e.offset // size, max(e.offset + e.nbytes - 1, e.offset) // size
        if first == last or e.nbytes == 0:
            k = min(first, n - 1)
            start = self.manifest.window(k)[0] if self.manifest.buckets else 0
            dst = self.buffers[k % len(self.buffers)][e.offset - start: e.offset - start + e.nbytes]
            steps[k].append(("out", dst.view(e.dtype).view(src.shape), src))
            return
        if not (stable and src.is_contiguous()):  # read it whole now: its slot may be reused before its tail
            carry = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            self.carries.append(carry)
            steps[first].append(("carry", carry, src))
            src = carry
        flat = src.reshape(-1).view(torch.uint8)
        lo = e.offset
        while lo < e.offset + e.nbytes:
            k = lo // size
            start, end = self.manifest.window(k)
            hi = min(e.offset + e.nbytes, end)
            steps[k].append(("out", self.buffers[k % len(self.buffers)][lo - start: hi - start],
                             flat[lo - e.offset: hi - e.offset]))
            lo = hi

    def _sum_in_tables(self, k: int, table) -> None:
        """Bucket k's checksum in the pass that packs it: its Tables add what they copy
        into sums[k] (zeroed first), and one more, after every copy into the bucket, reads
        the words no Table copies (torch's copies, padding).  One pass over the bucket
        instead of two, so less work beside its broadcast."""
        start, end = self.manifest.window(k)
        bucket = self.buffers[k % len(self.buffers)][: end - start]
        base, runs = bucket.data_ptr(), self.runs[k]
        if base % 16 or bucket.numel() % 16:
            return
        tables = [group for run in runs if not callable(run) for group in run if isinstance(group, copysum.Table)]
        gaps, at = [], base
        for lo, hi in sorted(span for t in tables for span in t.spans) + [(base + bucket.numel(),) * 2]:
            if lo > at:
                gaps.append(bucket[at - base: lo - base])
            at = max(at, hi)
        rest = table([], gaps)
        into = self.sums[k: k + 1]
        for t in (*tables, rest):
            t.into = into
        if not callable(runs[0]):  # (a bucket has a run: it holds some tensor's bytes)
            runs[0].insert(0, into.zero_)
        else:
            runs.insert(0, [into.zero_])
        if not callable(runs[-1]):
            runs[-1].append(rest)
        else:
            runs.append([rest])
        self.summing.add(k)

    def summed(self, k: int) -> bool:
        return k in self.summing

    def replay_copies(self, on: bool) -> None:
        self.enabled = on

    def batches(self, _tensors=None) -> Iterator[tuple[int, None]]:
        """Every bucket, in order (the sources are the program's own)."""
        for k in range(len(self.runs)):
            yield k, None

    def pack(self, k: int, _sources=None) -> torch.Tensor:
        """Run bucket k's gathers and copies; its bytes.  The buffer must be free."""
        for j, run in enumerate(self.runs[k]):
            if callable(run):
                self.source.done += 1
                run()
            elif not self._replayed(k, j, run):
                _copy(run)
        if not self.manifest.buckets:
            return self.buffers[0][:0]
        start, end = self.manifest.window(k)
        return self.buffers[k % len(self.buffers)][: end - start]

    def _replayed(self, k: int, j: int, run: list) -> bool:
        if not (self.capturable and self.enabled):
            return False
        graph = self.graphs[k][j]
        if graph is None:  # the first time copied, as a warm-up (lazy kernel loading is not captured)
            self.graphs[k][j] = False
            return False
        if graph is False:
            try:
                graph = self.graphs[k][j] = self._capture(run)
            except Exception as exc:  # noqa: BLE001 - copies that cannot be captured: copy from now on
                self.capturable = False
                log.warning("weight sync: the packed push's copies could not be captured as a CUDA graph "
                            "(%s: %s); copying from now on", type(exc).__name__, str(exc).splitlines()[0])
                return False
        graph.replay()
        return True

    def _capture(self, run: list):
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.capture_stream.wait_stream(current)
        with torch.cuda.stream(self.capture_stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _copy(run)
            finally:
                graph.capture_end()
        current.wait_stream(self.capture_stream)
        return graph


def bucket_slots(manifest: Manifest, device: torch.device, stream: Optional[torch.Tensor]) -> list:
    """Where bucket k is packed: ``slots[k % len(slots)]``, two reused buffers, or
    with ``stream`` each bucket's own window of it."""
    if stream is None:
        size = min(manifest.bucket_bytes, manifest.total_bytes)
        return [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
    if stream.dtype != torch.uint8 or stream.numel() < manifest.total_bytes:
        raise WeightSyncError(f"the stream buffer holds {stream.numel()} bytes, the update {manifest.total_bytes}")
    return [stream[slice(*manifest.window(k))] for k in range(manifest.buckets)] or [stream[:0]]


PHASES = ("copy", "carry", "out")  # shard copies into staging, then whole copies of split tensors, then buckets


def _table_maker(device: torch.device, share: int = copysum.SHARE):
    programs = copysum.programs(device, share) if device.type == "cuda" else 4
    return lambda pieces, reads=(): copysum.Table(pieces, device, programs, reads)


def _runs(ops: list, table=None) -> list:
    """A bucket's operations as runs between its gathers: [call | run], a run being
    its copies in three phases (each phase's destinations and sources by dtype and
    contiguity): the joins' shard copies, then the carries (which may read them), then
    the bucket copies (which read both).  A fused copy orders nothing among its tensors, so a
    copy never shares a call with one that writes its source.  With ``table``
    (pieces -> copysum.Table), the bucket copies it can take go into one Table, last:
    it leaves NCCL room where torch's copy would not (copysum's module doc)."""
    runs: list = []
    for op in ops:
        if op[0] == "gather":
            runs.append(op[1])
            continue
        if not runs or callable(runs[-1]):
            runs.append({phase: {} for phase in PHASES})
        # by dtype, and strided copies (q, k, v) apart: one would send the whole fused
        # call down its per-tensor path (a kernel per tensor, replayed or not)
        key = (op[1].dtype, op[1].is_contiguous() and op[2].is_contiguous())
        dsts, srcs = runs[-1][op[0]].setdefault(key, ([], []))
        dsts.append(op[1])
        srcs.append(op[2])
    return [run if callable(run) else _groups(run, table) for run in runs]


def _groups(run: dict, table) -> list:
    before = [group for phase in PHASES[:-1] for group in run[phase].values()]
    if table is None:
        return before + list(run["out"].values())
    pieces, rest = [], []
    for dsts, srcs in run["out"].values():
        left = ([], [])
        for dst, src in zip(dsts, srcs):
            split = copysum.Table.split(dst, src)
            if split is None:
                left[0].append(dst)
                left[1].append(src)
            else:
                pieces += split
        if left[0]:
            rest.append(left)
    return before + rest + ([table(pieces)] if pieces else [])


def _copy(run: list) -> None:
    for group in run:
        if callable(group):  # a copysum.Table, or a checksum slot's zero_
            group()
        else:
            torch._foreach_copy_(*group)


class Slots:
    """Kept memory for the program's gathers: window i of a megatron._Windows is gathered into
    slot i % 2 and its joined tensors staged in staging slot i % 2, so a push's
    sources are the same addresses every push; window i + 2 reuses the slot after
    every read of window i (the program runs in walk order, on one stream)."""

    def __init__(self, windows):
        self.windows = windows
        self.size = torch.distributed.get_world_size(windows.group)
        self.stride = -(-max(size for _, _, size in windows.spans) // 16) * 16
        device = windows.spans[0][0].device
        self.memory = [torch.empty((self.size, self.stride), dtype=torch.uint8, device=device) for _ in range(2)]
        self.staged = [None, None]
        self.cursor: dict = {}  # window -> next free byte of its staging slot
        self.gathered: dict = {}  # window -> its gathered rows (views of its slot)

    def rows(self, index: int) -> list:
        """Window ``index``'s bytes as every rank of the group holds them (in its slot)."""
        if index not in self.gathered:
            size = self.windows.spans[index][2]
            self.gathered[index] = [row[:size] for row in self.memory[index % 2]]
        return self.gathered[index]

    def parts(self, param) -> list:
        index, start, nbytes = self.windows.where[id(param)]
        offset = start - self.windows.spans[index][1]
        return [row[offset: offset + nbytes].view(param.dtype).view(param.shape) for row in self.rows(index)]

    def staging(self, index: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A kept tensor of ``shape`` in window ``index``'s staging slot."""
        slot = index % 2
        if self.staged[slot] is None:  # a window's joined tensors fill at most its gathered bytes
            self.staged[slot] = torch.empty(self.memory[slot].numel() + (1 << 20), dtype=torch.uint8,
                                            device=self.memory[slot].device)
        at = self.cursor.get(index, 0)
        nbytes = math.prod(shape) * dtype.itemsize
        self.cursor[index] = -(-(at + nbytes) // 16) * 16
        if self.cursor[index] > self.staged[slot].numel():
            raise ValueError("weight sync: a window's joined tensors outgrew its staging slot")
        return self.staged[slot][at: at + nbytes].view(dtype).view(shape)
