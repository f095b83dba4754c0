"""The sending end of a weight update: packing the tensors into buckets (once per
layout: cached views, one ``_foreach_copy_`` per dtype, on a GPU a replayed graph)
or taking buckets straight from parameter buffers (``plan_buffers``), and, for the
broadcast backends, the protocol's sender side over a ``Link``.

One update on the group, in order (docs/weight_sync_backends.md, "Wire format"):

1. handshake (all-gather of int64[ROW] per rank, wire.handshake_row): the sender's
   ``[MAGIC, FORMAT, version, layout digest, its status]``, each receiver's digests of
   the layouts it accepted before (those it takes again, those it would refuse).
   Every rank reads the same verdict from the rows (wire.layout_verdict): 0 when every
   receiver takes this layout, 3 when one never accepted it (it needs the manifest),
   2 when one refuses it.  One collective, and no host round trip between a header
   and the receivers' votes: a receiver's row does not wait for the sender's.  A
   receiver that cannot prepare a layout it offered takes the buckets and drops them
   (2 in the verdict)
2. only when some receiver needs it: int64[1] length, then the manifest:
   uint8[length], UTF-8 JSON (never pickle); then the manifest vote (2: rejected)
3. per bucket: the bytes, then (with checksums) int64[1], the sum of the
   bucket's int64 words computed on the sender's device
4. verdict (all-reduce MAX): 0 when every receiver verified every bucket

The sender packs bucket k+1 into the idle one of two buffers while bucket k is on the
wire.  A checksum mismatch or a rejected manifest leaves the link usable: all ranks
still run every step of the protocol.

Over 400 lines: the packing plans (_Packing, _Spans, _Replays) and the protocol's
sender are read together; the packing is what the ipc backend reuses.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
from typing import Callable, Iterable, Iterator, Optional

import torch

from .link import Link
from .program import Packed, Program, Sources, bucket_slots as _slots
from .wire import (CHECKSUM_MISMATCH, NEED_MANIFEST, OK, REJECTED, VERDICTS, Buffers, handshake_row, layout_verdict,
                   ChecksumMismatch, Entry, Manifest, WeightSyncError, bucket_sum, first_line, layout_digest,
                   tensors_digest, too_many_buckets)

# Test hooks (tests/e2e/weight_sync_*.py): called with (bucket index, its bytes)
# after a bucket was sent, and with (bucket index, its checksum) before the sender
# sends (or, ipc, publishes) the checksum.
after_send: Optional[Callable[[int, torch.Tensor], None]] = None
before_sum_send: Optional[Callable[[int, torch.Tensor], None]] = None


def send(link: Link, manifest: Manifest, tensors: Iterable[torch.Tensor] | Buffers, extra=(), *,
         replay_packing: bool = True) -> None:
    """Send one update: ``tensors`` in manifest order, or the ``Buffers`` that
    ``plan_buffers`` returned with ``manifest`` (and its ``extra`` tensors, in
    order: an iterable taken when the first bucket that holds one is packed, so a
    generator computes them while the buckets before are on the wire).  Raises
    WeightSyncError (a receiver rejected it, a checksum differed, a peer failed or
    timed out).  On failure the rest of ``tensors`` is still
    consumed, so whoever produces them (tensor-parallel gathers) stays in step with
    its peers.  ``replay_packing``: on a GPU, pack a bucket whose sources are the
    tensors of the update before (same addresses, contiguous) by replaying its copies,
    captured once as a CUDA graph (setting weight_sync.replay_packing)."""
    if isinstance(tensors, Buffers):
        if tensors.pieces and _indexed(tensors.device) != _indexed(link.device):
            raise WeightSyncError(f"the buffers are on {tensors.device}, the link on {link.device}")
        return _Sender(link, manifest, tensors).run(iter(extra))
    if isinstance(tensors, Sources):
        tensors.done = 0
        try:
            _Sender(link, manifest, sources=tensors, replay_packing=replay_packing).run(iter(()))
        except Exception:
            tensors.drain()
            raise
        return None
    it = iter(tensors)
    try:
        _Sender(link, manifest, replay_packing=replay_packing).run(it)
    except Exception:
        for _ in it:
            pass
        raise


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>``: the same device, comparable."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Packing(Packed):
    """Where each tensor goes in the two bucket buffers, computed once per layout and
    kept on the link: packing bucket k is then one ``_foreach_copy_`` per dtype from
    its tensors into cached views, with no per-tensor view work in the hot loop; on a
    GPU, once bucket k has had the same sources twice, a replay of those copies.

    ``batches`` takes and checks the tensors bucket by bucket and ``pack`` copies one
    bucket into its buffer; the sender interleaves them with its broadcasts, the
    bench (``--phases``) and the tests drive them without a group.

    ``stream``: a uint8 tensor of the update's total size (the ipc backend's exported
    memory) in which every bucket has its own window, instead of two reused buffers."""

    def __init__(self, manifest: Manifest, device: torch.device, stream: Optional[torch.Tensor] = None):
        super().__init__(manifest, None, device)
        self.buffers = _slots(manifest, device, stream)
        n = max(manifest.buckets, 1)
        self.new = [[] for _ in range(n)]      # entries that start in bucket k: its batch, in order
        self.shapes = [[] for _ in range(n)]   # their planned shapes and dtypes, to check the batch against
        self.dtypes = [[] for _ in range(n)]
        self.hold = [[] for _ in range(n)]     # (entry, batch position) of those that continue past bucket k
        self.release = [[] for _ in range(n)]  # entries split over buckets whose last bytes are in k
        copies = [[] for _ in range(n)]        # (destination view, source: batch position | (entry, byte range))
        for i, e in enumerate(manifest.entries):
            first = min(e.offset // manifest.bucket_bytes, n - 1)
            position = len(self.new[first])
            self.new[first].append(i)
            self.shapes[first].append(e.shape)
            self.dtypes[first].append(e.dtype)
            lo, k = e.offset, first
            while lo < e.offset + e.nbytes:
                k = lo // manifest.bucket_bytes
                start, end = manifest.window(k)
                hi = min(e.offset + e.nbytes, end)
                dst = self.buffers[k % len(self.buffers)][lo - start: hi - start]
                if lo == e.offset and hi == e.offset + e.nbytes:
                    copies[k].append((dst.view(e.dtype).view(e.shape), position))
                else:
                    copies[k].append((dst, (i, slice(lo - e.offset, hi - e.offset))))
                lo = hi
            if k != first:
                self.hold[first].append((i, position))
                self.release[k].append(i)
        self.groups = [_by_dtype(c) for c in copies]
        self.replays = _Replays(n, device)

    def replay_copies(self, on: bool) -> None:
        self.replays.enabled = on

    def batches(self, tensors: Iterator[torch.Tensor]) -> Iterator[tuple[int, list]]:
        """Per bucket k: take the tensors that start in it from ``tensors`` (manifest
        order), check their shapes and dtypes as a batch, and yield (k, the sources
        of ``pack(k, ...)``).  Raises WeightSyncError for a wrong shape or dtype and
        for fewer or more tensors than planned."""
        # The hot loop (tens of thousands of tensors per update): per tensor only the
        # check's two attribute reads, in map(); sources are slices of the batch, and
        # only tensors split over buckets are held from one bucket to the next.
        # (Reading (shape, dtype) pairs made a tuple per tensor: the cyclic GC then ran
        # full collections in the loop, and the check took 15x longer at the median.)
        held: dict = {}  # entry -> tensor, from its first bucket to its last
        count = len(self.manifest.entries)
        for k, shapes in enumerate(self.shapes):
            batch = list(itertools.islice(tensors, len(shapes)))
            if len(batch) < len(shapes):
                raise WeightSyncError(f"got fewer tensors than the manifest's {count}")
            if list(map(_SHAPE, batch)) != shapes or list(map(_DTYPE, batch)) != self.dtypes[k]:
                self._mismatch(k, batch)
            for i, position in self.hold[k]:
                held[i] = batch[position]
            yield k, [_sources(recipe, batch, held) for _, recipe in self.groups[k]]
            for i in self.release[k]:
                del held[i]
        if next(tensors, None) is not None:
            raise WeightSyncError(f"got more tensors than the manifest's {count}")

    def pack(self, k: int, sources: list) -> torch.Tensor:
        """Copy bucket k's ``sources`` (from ``batches``) into its buffer; returns the
        bucket's bytes.  The buffer must be free (its previous bucket sent)."""
        if not self.replays.replay(k, sources, self._copy):
            self._copy(k, sources)
        start, end = self.manifest.window(k)
        return self.buffers[k % len(self.buffers)][: end - start]

    def _copy(self, k: int, sources: list) -> None:
        for (dsts, _), srcs in zip(self.groups[k], sources):
            torch._foreach_copy_(dsts, srcs)

    def _mismatch(self, k: int, batch: list) -> None:
        for i, tensor in zip(self.new[k], batch):
            _as_planned(tensor, self.manifest.entries[i])


def _as_planned(tensor: torch.Tensor, e: Entry) -> None:
    if tensor.shape != e.shape or tensor.dtype != e.dtype:
        raise WeightSyncError(f"{e.name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {e.shape} {e.dtype}")


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_ADDRESS, _CONTIGUOUS = operator.methodcaller("data_ptr"), operator.methodcaller("is_contiguous")


class _Replays:
    """Per bucket, its copies captured as a CUDA graph and the source addresses they
    were captured for.  A bucket's sources are known by their addresses alone: their
    shapes and dtypes are checked against the plan before, and only contiguous ones
    are captured (a graph reads the memory, whatever tensor is there now).  Captured
    on a side stream in thread-local mode, so other threads' CUDA calls (NCCL's
    watchdog) go on; nothing is allocated during a capture."""

    def __init__(self, buckets: int, device: torch.device):
        self.on = device.type == "cuda"
        self.enabled = True  # the setting, per send (weight_sync.replay_packing)
        self.device = device
        self.graphs: list = [None] * buckets  # (addresses, CUDAGraph)
        self.seen: list = [None] * buckets    # addresses of the update before, not captured yet
        self.stream = None

    def replay(self, k: int, sources: list, copy: Callable) -> bool:
        """Whether bucket k was packed by a replay (else the caller copies): its
        graph's sources, or the same contiguous ones as last time (captured now)."""
        if not (self.on and self.enabled):
            return False
        addresses = [list(map(_ADDRESS, srcs)) for srcs in sources]
        graph = self.graphs[k]
        if graph is not None and graph[0] == addresses:
            graph[1].replay()
            return True
        self.graphs[k] = None
        if self.seen[k] != addresses:
            self.seen[k] = addresses if all(all(map(_CONTIGUOUS, srcs)) for srcs in sources) else None
            return False
        try:
            self.graphs[k] = (addresses, self._capture(k, sources, copy))
        except Exception as exc:  # noqa: BLE001 - a copy that cannot be captured: copy, and never capture again
            self.on = False
            logging.getLogger("source_patch.weight_sync").warning(
                "weight sync: packing bucket %d could not be captured as a CUDA graph (%s: %s); packing by "
                "copies from now on", k, type(exc).__name__, first_line(exc))
            return False
        self.seen[k] = None
        self.graphs[k][1].replay()
        return True

    def _capture(self, k: int, sources: list, copy: Callable):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                copy(k, sources)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return graph


def _by_dtype(copies: list) -> list:
    """[(destinations, recipe of their sources)], one per destination dtype.

    torch's fused _foreach_copy_ needs one dtype per call; a bucket mixes whole
    tensors with byte ranges (uint8) of the tensors cut by its ends, so one call per
    dtype (one mixed call fell back to a copy per tensor, ~8 us each on an H200).
    A recipe is a list of ``slice``s of the bucket's batch (runs of whole tensors)
    and ``(entry, byte range)`` pieces of split tensors."""
    groups: dict = {}
    for dst, source in copies:
        dsts, recipe = groups.setdefault(dst.dtype, ([], []))
        dsts.append(dst)
        if isinstance(source, int) and recipe and isinstance(recipe[-1], list) and recipe[-1][1] == source:
            recipe[-1][1] = source + 1  # extends the run
        else:
            recipe.append([source, source + 1] if isinstance(source, int) else source)
    return [(dsts, [slice(*item) if isinstance(item, list) else item for item in recipe])
            for dsts, recipe in groups.values()]


def _sources(recipe: list, batch: list, held: dict) -> list:
    if len(recipe) == 1 and type(recipe[0]) is slice:  # the common case: one run
        return batch[recipe[0]]
    sources = []
    for item in recipe:
        if type(item) is slice:
            sources += batch[item]
        else:
            i, part = item
            sources.append(held[i].reshape(-1).view(torch.uint8)[part])
    return sources


class _Spans(Packed):
    """``_Packing`` for ``Buffers``: bucket k is a slice of the one buffer that holds
    its window (no copy, no per-tensor work), or its pieces (of buffers, of the extra
    tensors) copied into one of two bucket buffers with one ``_foreach_copy_``
    (``stream``: every bucket copied into its window of it, as for _Packing)."""

    def __init__(self, manifest: Manifest, buffers: Buffers, stream: Optional[torch.Tensor] = None):
        super().__init__(manifest, buffers, buffers.device)
        n = manifest.buckets
        sizes = [manifest.window(k)[1] - manifest.window(k)[0] for k in range(n)]
        pieces = [(base, view.numel(), view) for base, view in buffers.pieces] + \
            [(base, e.nbytes, i) for i, (base, e) in enumerate(buffers.extra)]  # i: the i-th extra tensor
        self.whole: list = [None] * n   # bucket k's bytes when one buffer holds them
        self.parts: list = [None] * n   # else (destinations, sources: a view | (extra, byte range))
        self.buffers = [torch.empty(max(sizes, default=0), dtype=torch.uint8, device=buffers.device)
                        for _ in range(2)] if stream is None else _slots(manifest, buffers.device, stream)
        for k in range(n):
            start, end = manifest.window(k)
            parts = [(max(start, base), min(end, base + size), base, source)
                     for base, size, source in pieces if base < end and base + size > start]
            if stream is None and len(parts) == 1 and parts[0][:2] == (start, end) and \
                    isinstance(parts[0][3], torch.Tensor):
                lo, hi, base, view = parts[0]
                self.whole[k] = view[lo - base: hi - base]
                continue
            data = self.buffers[k % len(self.buffers)]
            self.parts[k] = ([data[lo - start: hi - start] for lo, hi, _, _ in parts],
                             [source[lo - base: hi - base] if isinstance(source, torch.Tensor)
                              else (source, slice(lo - base, hi - base)) for lo, hi, base, source in parts])
        if not any(p is not None for p in self.parts):
            self.buffers = []
        # The first bucket that packs an extra tensor (they lie after the buffers).
        self.first_extra = next((k for k, parts in enumerate(self.parts) if parts is not None and any(
            not isinstance(s, torch.Tensor) for s in parts[1])), n)

    def batches(self, extra: Iterator[torch.Tensor]) -> Iterator[tuple[int, list]]:
        """Every bucket with the extra tensors as bytes (checked against the plan),
        taken from ``extra`` when the first bucket that holds one is packed: computing
        them (push() splits the fused QKV weights by copies, ~2 ms of host time for 48
        layers) then overlaps the transfer of the buckets before them."""
        taken = None
        for k in range(self.manifest.buckets):
            if taken is None and k >= self.first_extra:
                taken = self._extras(extra)
            yield k, taken or ()
        if taken is None:
            self._extras(extra)

    def _extras(self, extra: Iterator[torch.Tensor]) -> list:
        planned = self.source.extra
        tensors = list(itertools.islice(extra, len(planned) + 1))
        if len(tensors) != len(planned):
            raise WeightSyncError(f"got {len(tensors)} extra tensors, planned {len(planned)}")
        for (_, e), tensor in zip(planned, tensors):
            _as_planned(tensor, e)
        return [t.reshape(-1).view(torch.uint8) for t in tensors]

    def staged(self, k: int) -> bool:
        return self.whole[k] is None

    def pack(self, k: int, extra: list) -> torch.Tensor:
        if self.whole[k] is not None:
            return self.whole[k]
        dsts, sources = self.parts[k]
        torch._foreach_copy_(dsts, [s if isinstance(s, torch.Tensor) else extra[s[0]][s[1]] for s in sources])
        start, end = self.manifest.window(k)
        return self.buffers[k % len(self.buffers)][: end - start]


def _kept(link: Link, slot: str, manifest: Manifest, source, make) -> Packed:
    """The packing the link keeps in ``slot`` while it matches this update, else ``make()``'s."""
    packing = getattr(link, slot)
    if packing is None or not packing.matches(manifest, source):
        setattr(link, slot, None)  # free the old buffers first
        packing = make()
        setattr(link, slot, packing)
    return packing


class _Sender:
    def __init__(self, link: Link, manifest: Manifest, buffers: Optional[Buffers] = None,
                 replay_packing: bool = True, sources: Optional[Sources] = None):
        self.link, self.manifest = link, manifest
        # An update no receiver would accept is refused in the votes, so both ends
        # stay usable, and without building its packing (as costly here as there).
        self.refusal = too_many_buckets(manifest.bucket_bytes, manifest.total_bytes)
        if self.refusal:
            packing = None
        elif sources is not None:
            packing = _kept(link, "program", manifest, sources, lambda: Program(manifest, sources, link.device))
        elif buffers is not None:
            packing = _kept(link, "spans", manifest, buffers, lambda: _Spans(manifest, buffers))
        else:
            packing = _kept(link, "packing", manifest, None, lambda: _Packing(manifest, link.device))
        if packing is not None:
            packing.replay_copies(replay_packing)
        self.packing = packing
        self.in_flight: list = [None, None]   # per buffer: (bucket, its data work)
        self.works: list = []
        self.aside: Optional[torch.cuda.Stream] = None  # where bucket 0 was packed (_aside)

    def run(self, tensors: Iterator[torch.Tensor]) -> None:
        link, manifest, packing = self.link, self.manifest, self.packing
        tensors_json = packing.tensors_json if packing else manifest.tensors_to_json()
        digest = layout_digest(manifest, packing.tensors_digest if packing else tensors_digest(tensors_json))
        batches = packing.batches(tensors) if packing is not None else iter(())
        first = self._pack_first(batches)
        try:
            self._agree(manifest, digest, tensors_json)
        finally:
            if self.aside is not None:  # bucket 0's copies ran on a stream of their own
                torch.cuda.current_stream(link.device).wait_stream(self.aside)
        if isinstance(first, Exception):
            raise first
        with torch.no_grad():
            for k, sources, data in itertools.chain([first] if first else [], ((*b, None) for b in batches)):
                if k < manifest.buckets:  # an update of 0 bytes has tensors but no bucket
                    self._flush(k, sources, data)
        for work in self.works:
            link.wait(work, "bucket")
        verdict = link.vote(OK, "verdict")
        if verdict:
            raise (ChecksumMismatch if verdict == CHECKSUM_MISMATCH else WeightSyncError)(
                f"update v{manifest.version} failed on an engine rank with {VERDICTS[verdict]} "
                "(see its log)")

    def _agree(self, manifest: Manifest, digest: int, tensors_json: bytes) -> None:
        """The handshake and, where a receiver lacks the layout, the manifest and its
        vote: raises unless every rank accepts the update."""
        link = self.link
        mine = REJECTED if self.refusal else OK
        status = layout_verdict(link.handshake(handshake_row(manifest.version, digest, mine), "handshake"))
        if status == NEED_MANIFEST:  # a receiver does not hold this layout yet
            if self.packing is not None:  # its bytes kept with the packing: no work per tensor
                length, body = self.packing.manifest_message(manifest, link.device)
            else:
                text = manifest.to_json(tensors_json)
                length = torch.tensor([len(text)], dtype=torch.int64).to(link.device)
                body = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(link.device)
            link.wait(link.broadcast(length), "manifest")
            link.wait(link.broadcast(body), "manifest")
            status = link.vote(mine, "manifest vote")
        if self.refusal:
            raise WeightSyncError(f"update v{manifest.version} refused: {self.refusal}")
        if status:
            raise WeightSyncError(f"update v{manifest.version} was refused by an engine rank (a bad manifest, "
                                  "one that does not match its model, or not enough memory; see its log)")

    def _pack_first(self, batches: Iterator):
        """Bucket 0 packed (its gathers and copies queued, on a GPU on a stream of
        their own: ``_aside``) before the handshake, so its copies run while the handshake and
        the votes travel instead of holding back the first broadcast: (0, its sources,
        its bytes), None without a bucket, or what packing it raised (run() raises it
        after the votes, where bucket 0 would have been packed)."""
        self.aside = self._aside()
        try:
            with torch.no_grad(), torch.cuda.stream(self.aside) if self.aside is not None else contextlib.nullcontext():
                k, sources = next(batches)
                return k, sources, self.packing.pack(k, sources) if k < self.manifest.buckets else None
        except StopIteration:
            return None
        except Exception as exc:  # noqa: BLE001 - raised by run() after the votes
            return exc

    def _aside(self) -> Optional[torch.cuda.Stream]:
        """The stream a Program packs bucket 0 on, on a GPU: the handshake and the votes go
        through NCCL, whose stream waits for the current one, so they would wait for
        bucket 0's copies there (run() joins it before bucket 0 goes out)."""
        packing = self.packing
        if not isinstance(packing, Program) or packing.device.type != "cuda":
            return None
        if packing.first_stream is None:
            packing.first_stream = torch.cuda.Stream(packing.device)
        packing.first_stream.wait_stream(torch.cuda.current_stream(packing.device))  # the sources' writes
        return packing.first_stream

    def _flush(self, k: int, sources: list, data: Optional[torch.Tensor] = None) -> None:
        link, slot, staged = self.link, k % 2, self.packing.staged(k)
        if staged and self.in_flight[slot] is not None:  # the buffer's previous bucket must be out
            # On NCCL the device orders it (no host wait: the host runs ahead and every
            # work's deadline is checked after the last bucket); gloo waits here.  A
            # bucket sent from its own memory waits for nothing: its checksum may run
            # ahead of the buckets still on the wire.
            before, work = self.in_flight[slot]
            link.after(work, f"bucket {before}")
        if data is None:
            data = self.packing.pack(k, sources)
        work = link.broadcast(data)
        if staged:
            self.in_flight[slot] = (k, work)
        self.works.append(work)
        if self.manifest.checksum:
            if not self.packing.summed(k):
                bucket_sum(data, self.packing.sums[k])
            if before_sum_send is not None:
                before_sum_send(k, self.packing.sums[k: k + 1])
            self.works.append(link.broadcast(self.packing.sums[k: k + 1]))
        if after_send is not None:
            after_send(k, data)
