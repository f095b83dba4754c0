"""Bucketed weight transfer over a torch.distributed group: group rank 0 sends,
every other rank receives (NCCL on GPU, gloo on CPU).

    group = open_group("10.0.0.1", 29600, rank, world_size, "source_patch_weights", "nccl", 300)
    link = Link(group, timeout_s=300)
    send(link, plan(specs, bucket_bytes=512 << 20, version=7), tensors)  # rank 0
    send(link, *plan_buffers(named_views, 512 << 20, 7))                  # or from the buffers themselves
    update = receive(link)                                               # engine ranks
    model.load_weights(update.tensors)

The tensors are laid out back to back (each at a 16-byte aligned offset) in one
virtual byte stream, cut into buckets of ``bucket_bytes``: a tensor crosses a
bucket boundary like any other byte range, so tensors larger than a bucket need
no special case.  The sender packs bucket k+1 into the idle one of two buffers
(one ``_foreach_copy_`` into views cached per layout) while bucket k is on the wire;
tensors planned with ``plan_buffers`` are sent from their own buffers' memory.

One update on the group, in order (docs/weight_sync.md, "Wire format"):

1. header: int64[4] ``[MAGIC, FORMAT, version, layout digest]``
2. layout vote (all-reduce MAX of int64[1]): 0 from a receiver that holds this
   layout (its manifest, buffers and views from an earlier update), 3 from one that
   needs the manifest, 2 from one that cannot take it
3. only when some receiver needs it: int64[1] length, then the manifest:
   uint8[length], UTF-8 JSON (never pickle): version, sizes, and per tensor name,
   dtype, shape and stream offset; then the manifest vote (2: rejected)
4. per bucket: the bytes, then (with checksums) int64[1], the sum of the
   bucket's int64 words computed on the sender's device
5. verdict (all-reduce MAX): 0 when every receiver verified every bucket

An update with the layout of the one before costs two small collectives before its
data (the manifest of 36k tensors took ~2 ms more of both hosts' time per update).

Every wait is bounded by ``timeout_s``; a peer that dies or stalls fails the
update with WeightSyncTimeout / WeightSyncError and marks the link broken (the
group is then unusable: create a new one).  A checksum mismatch or a rejected
manifest leaves the link usable: all ranks still run every step of the protocol.

Sender and receivers implement the two ends of one wire protocol (manifest,
buckets, checksums, versions) and are read side by side, in one module.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import operator
import re
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from ..core import bounded

MAGIC = 0x53505753  # "SPWS"
FORMAT = 2  # 1: the manifest travelled with every update (header: its length)
ALIGN = 16          # stream offsets and bucket sizes: multiples of this

OK, CHECKSUM_MISMATCH, REJECTED, NEED_MANIFEST = 0, 1, 2, 3
MAX_LAYOUTS = 8  # a receiver remembers this many layouts (with and without checksums count twice)
# Bounds on what a manifest may make a receiver build before any data arrives: every
# bucket costs ~3.5 KB of views and work items (a 150-byte manifest asked for 524,288
# buckets: 2.9 GB), every tensor a view.  512 MiB buckets reach 8 TiB at MAX_BUCKETS.
MAX_BUCKETS = 1 << 14
MAX_TENSORS = 1 << 20
MANIFEST_DEPTH = 4  # {manifest: [tensors: [entry: [shape]]]}
_VERDICTS = {CHECKSUM_MISMATCH: "a checksum mismatch", REJECTED: "a receive error"}

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)

# Test hooks (tests/e2e/weight_sync_*.py): called with (bucket index, its bytes)
# after a bucket was sent / received, before the receiver checks it; and with
# (bucket index, its checksum) before the sender sends the checksum.
after_send: Optional[Callable[[int, torch.Tensor], None]] = None
before_verify: Optional[Callable[[int, torch.Tensor], None]] = None
before_sum_send: Optional[Callable[[int, torch.Tensor], None]] = None


class WeightSyncError(RuntimeError):
    """An update failed (docs/weight_sync.md, "Failure behaviour", says what the engine then serves)."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not take part in the update within the timeout."""


class ChecksumMismatch(WeightSyncError):
    """Received bytes differ from the sent ones."""


class ManifestError(WeightSyncError, ValueError):
    """A received manifest is malformed or over a limit: refused (by a vote) before
    anything is allocated.  A ValueError too, as Manifest.from_json always raised."""


# ------------------------------------------------------------------ the group


def open_group(host: str, port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float):
    """Join (rank 0: create) a process group of its own for weight updates: a
    TCPStore at host:port (rank 0 serves it, listening on host only) under a
    PrefixStore(group_name).  The same construction as SGLang's
    ``init_custom_process_group``, which its ``/init_weights_update_group`` uses on
    the engine ranks, so a trainer joins the group an SGLang server opens.  The
    default group is neither used nor changed."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(host, port, rank, world_size, timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                         PrefixStore(group_name, store), group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta):
    """Rank 0 serves the rendezvous store, the others connect to it (also usable for a
    default group: ``init_process_group(store=...)``).  torch's server
    listens on every interface whatever ``host`` says, so it is handed a socket bound
    to ``host`` alone.  (torch's rendezvous() served none at all under torchrun, which
    sets TORCHELASTIC_USE_AGENT_STORE: every rank became a client.)"""
    if rank:
        return dist.TCPStore(host, port, world_size, False, timeout)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise WeightSyncError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # The store owns the descriptor from here (closed with it, or if it fails to start).
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach(),
                         use_libuv=True)


def close_group(group) -> None:
    """Destroy a group made by open_group (best effort: its peers may be gone)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001
        pass


class Link:
    """A weight-update group, its device, and the deadline every wait gets."""

    def __init__(self, group, timeout_s: float = 300.0):
        self.group = group
        self.timeout_s = float(timeout_s)
        self.backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self.rank = group.rank()
        self.size = group.size()
        self.broken: Optional[str] = None
        self.packing = None  # the sender's bucket buffers and layout, reused while it holds
        self.spans = None  # the same for updates sent from buffers (plan_buffers)
        self.known_manifest = None  # a receiver's last (tensors JSON, entries): parsed once
        self.layouts: dict = {}  # a receiver's accepted layouts: digest -> manifest (at most MAX_LAYOUTS)
        self.staged = None  # a receiver's (entries, stream buffer, views into it), reused while it holds
        self.streamed = None  # a streamed receiver's _BucketPlan, reused while its layout holds
        self.sums = None  # a receiver's (sent, computed) checksum tensors, reused while the bucket count holds

    def broadcast(self, tensor: torch.Tensor):
        self._check()
        return dist.broadcast(tensor, group=self.group, group_src=0, async_op=True)

    def wait(self, work, what: str) -> None:
        """Wait for ``work`` at most timeout_s; a failure breaks the link."""
        self._check()
        try:
            if self.backend == "gloo":
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                self._poll(work, what)
                work.wait()  # orders the current stream after it; no host sync
        except WeightSyncError as exc:
            self.broken = str(exc)
            raise
        except RuntimeError as exc:
            text = str(exc).lower()
            timed_out = "timed out" in text or "timeout" in text
            reason = f"no peer answered within {self.timeout_s:g} s" if timed_out else "a peer failed"
            self.broken = f"{what}: {reason} ({type(exc).__name__}: {_first_line(exc)})"
            raise (WeightSyncTimeout if timed_out else WeightSyncError)(self.broken) from exc

    def after(self, work, what: str) -> None:
        """Order the current stream after ``work``: on NCCL without waiting on the host
        (work still to check with ``wait``, for its deadline); elsewhere, ``wait``."""
        if self.backend == "nccl":
            self._check()
            work.wait()
        else:
            self.wait(work, what)

    def _poll(self, work, what: str) -> None:
        # NCCL work cannot be waited on with a deadline; poll its completion
        # (an event query, no device sync) and give the communicator up on expiry.
        # The first 0.2 ms spin: a header or a vote completes in tens of us, and a
        # sleep rounds up to the timer's slack (~60 us) at each of the update's steps.
        now = time.monotonic()
        spin, deadline = now + 2e-4, now + self.timeout_s
        pause = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                self._abort()
                raise WeightSyncTimeout(f"{what}: no peer answered within {self.timeout_s:g} s")
            if now > spin:
                time.sleep(pause)
                pause = min(pause * 2, 5e-5)  # a late wake-up would leave the wire idle

    def _abort(self) -> None:
        try:
            self.group._get_backend(self.device).abort()
        except Exception:  # noqa: BLE001 - best effort; the link is broken either way
            pass

    def vote(self, status, what: str) -> int:
        """All-reduce MAX of every rank's status: an int, or an int64 tensor of one
        element on the link's device (computed there: no host sync before the vote)."""
        flag = status if isinstance(status, torch.Tensor) else \
            torch.tensor([status], dtype=torch.int64, device=self.device)
        self._check()
        self.wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what)
        return int(flag.item())

    def layout_vote(self, status: int) -> int:
        return self.vote(status, "layout vote")

    def _check(self) -> None:
        if self.broken:
            raise WeightSyncError(f"the weight-update group is broken ({self.broken}); "
                                  "create a new one")


class LoopbackLink(Link):
    """A Link without a process group, for one process that plays both ends (the
    bench's ``--phases`` mode, tests).  ``send`` on a sender link records a copy of
    every broadcast (``record=False``: drops them, a wire that costs nothing);
    ``receive`` on ``LoopbackLink(device, replay=sender_link)`` gets those copies
    in order, as if broadcast.  Votes return the caller's own status, and every
    wait is already done.  ``rewind()`` before each update."""

    def __init__(self, device, record: bool = True, replay: Optional["LoopbackLink"] = None):
        self.group, self.timeout_s, self.backend = None, 0.0, "loopback"
        self.device = torch.device(device)
        self.rank, self.size = (0 if replay is None else 1), 2
        self.broken = None
        self.packing = self.spans = self.known_manifest = self.staged = self.streamed = self.sums = None
        self.layouts = {}
        self.record, self.source = record, replay
        self.messages: list = []  # a sender's recorded broadcasts
        self.position = 0         # a receiver's next message

    def rewind(self) -> None:
        """Before each update: a sender forgets the last one, a receiver replays from the start."""
        if self.source is None:
            self.messages.clear()
        self.position = 0

    def broadcast(self, tensor: torch.Tensor):
        self._check()
        if self.source is not None:
            tensor.copy_(self.source.messages[self.position])
            self.position += 1
        elif self.record:
            self.messages.append(tensor.clone())
        return None

    def wait(self, work, what: str) -> None:
        self._check()

    def vote(self, status, what: str) -> int:
        self._check()
        return int(status.item()) if isinstance(status, torch.Tensor) else status

    def layout_vote(self, status: int) -> int:
        # A recorded wire cannot hear its receivers: the manifest always travels.
        self._check()
        return NEED_MANIFEST


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ------------------------------------------------------------------ manifest


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int   # in the stream
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    version: int
    bucket_bytes: int
    total_bytes: int
    checksum: bool
    entries: tuple

    @property
    def buckets(self) -> int:
        return math.ceil(self.total_bytes / self.bucket_bytes) if self.total_bytes else 0

    def window(self, k: int) -> tuple[int, int]:
        start = k * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def to_json(self, tensors_json: bytes | None = None) -> bytes:
        """The manifest as JSON; ``tensors_json`` (tensors_to_json()) when already known."""
        head = json.dumps({"format": FORMAT, "version": self.version, "bucket_bytes": self.bucket_bytes,
                           "total_bytes": self.total_bytes, "checksum": self.checksum},
                          separators=(",", ":")).encode()
        return head[:-1] + b',"tensors":' + (tensors_json or self.tensors_to_json()) + b"}"

    def tensors_to_json(self) -> bytes:
        return json.dumps([[e.name, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset]
                           for e in self.entries], separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, max_update_bytes: int, known: tuple | None = None) -> "Manifest":
        """Parse and validate a received manifest; ManifestError (a ValueError) says
        what is wrong.  ``known``: (tensors JSON, entries) of an earlier manifest; the
        same tensors (every step but the first) are not parsed again."""
        head, tensors_json = _split_tensors(data)
        doc = _load(head + b"}" if tensors_json else data, "the manifest")
        if not tensors_json or not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"not a format-{FORMAT} manifest")
        version, bucket, total = (_int(doc.get(k), k) for k in ("version", "bucket_bytes", "total_bytes"))
        if bucket <= 0 or bucket % ALIGN or total % ALIGN:
            raise ManifestError(f"bucket_bytes {bucket} / total_bytes {total} not positive multiples of {ALIGN}")
        if total > max_update_bytes:
            raise ManifestError(f"update of {total} bytes exceeds max_update_bytes={max_update_bytes}")
        too_many = too_many_buckets(bucket, total)
        if too_many:
            raise ManifestError(too_many)
        if known is not None and known[0] == tensors_json:
            entries = known[1]
        else:
            entries = _parse_entries(_load(tensors_json, "the manifest's tensors", 2 * MAX_TENSORS + 1))
        if entries and entries[-1].offset + entries[-1].nbytes > total:
            raise ManifestError(f"{entries[-1].name[:200]!r}: outside the stream of {total} bytes")
        return cls(version, bucket, total, bool(doc.get("checksum")), entries)


def _load(data: bytes, what: str, max_items: int | None = None):
    """JSON bounded in depth and container count before it is parsed (the parser
    recurses: 50k levels were a RecursionError that skipped the manifest vote)."""
    return bounded.load_json(data, what=what, error=ManifestError, max_bytes=len(data),
                             max_depth=MANIFEST_DEPTH, max_items=max_items)


def too_many_buckets(bucket_bytes: int, total_bytes: int) -> str | None:
    """Why an update cut into this many buckets is refused (by sender and receivers
    alike), or None."""
    count = -(-total_bytes // bucket_bytes)
    if count <= MAX_BUCKETS:
        return None
    least = _aligned(-(-total_bytes // MAX_BUCKETS))
    return (f"{count:,} buckets of {bucket_bytes:,} bytes, more than the {MAX_BUCKETS:,} a receiver "
            f"accepts: bucket_bytes must be at least {least:,} for {total_bytes:,} bytes")


def tensors_digest(tensors_json: bytes) -> bytes:
    return hashlib.blake2b(tensors_json, digest_size=16).digest()


def layout_digest(manifest: Manifest, tensors: bytes) -> int:
    """The layout (everything but the version) as a signed int64, for the header:
    ``tensors`` is tensors_digest() of the manifest's tensors JSON, computed once."""
    head = b"%d,%d,%d," % (manifest.bucket_bytes, manifest.total_bytes, manifest.checksum)
    return int.from_bytes(hashlib.blake2b(head + tensors, digest_size=8).digest(), "little", signed=True)


_TENSORS = re.compile(rb',\s*"tensors"\s*:')


def _split_tensors(data: bytes) -> tuple[bytes, bytes]:
    """(the manifest without its last key, that key's value): "tensors" comes last."""
    match = _TENSORS.search(data)
    tail = data.rstrip()
    if match is None or not tail.endswith(b"}"):
        return data, b""
    return data[: match.start()], tail[match.end(): -1]


def _parse_entries(items) -> tuple:
    if not isinstance(items, list):
        raise ManifestError("tensors: expected a list")
    entries, names, end = [], set(), 0
    for item in items:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
            raise ManifestError(f"bad tensor entry {str(item)[:80]}")
        name, dtype_name, shape, offset = item
        dtype = DTYPES.get(dtype_name)
        if dtype is None or name in names or not isinstance(shape, list):
            raise ManifestError(f"{name[:200]!r}: bad dtype {str(dtype_name)[:40]!r}, shape or duplicate name")
        shape = tuple(_int(s, "shape") for s in shape)
        offset = _int(offset, "offset")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < end or offset % ALIGN:
            raise ManifestError(f"{name[:200]!r}: offset {offset} out of order or not aligned")
        names.add(name)
        end = offset + nbytes
        entries.append(Entry(name, dtype, shape, offset, nbytes))
    return tuple(entries)


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{what}: expected a non-negative integer, got {str(value)[:40]!r}")
    return value


def plan(specs: Iterable[tuple[str, tuple, torch.dtype]], bucket_bytes: int, version: int,
         checksum: bool = True) -> Manifest:
    """Lay ``(name, shape, dtype)`` out in the stream, in the given order."""
    bucket_bytes = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    entries, offset = [], 0
    for name, shape, dtype in specs:
        _sendable(name, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append(Entry(name, dtype, tuple(shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return Manifest(int(version), bucket_bytes, offset, bool(checksum), tuple(entries))


class Buffers:
    """The stream as byte ranges of a few contiguous buffers (``plan_buffers``):
    ``pieces`` are (stream offset, uint8 view of a buffer's bytes), in stream order;
    ``extra`` the (stream offset, entry) of the tensors sent after them, given to each
    ``send`` anew."""

    def __init__(self, pieces: tuple, extra: tuple, device: torch.device):
        self.pieces, self.extra, self.device = pieces, extra, device


def plan_buffers(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int,
                 checksum: bool = True, extra: Iterable[tuple[str, tuple, torch.dtype]] = ()
                 ) -> tuple[Manifest, Buffers]:
    """Plan an update whose tensors are views of a few contiguous buffers, such as
    Megatron's parameter buffers (``DistributedDataParallel.buffers[i].param_data``
    with the distributed optimizer), laid out in the stream as they lie in memory.

    ``send(link, manifest, buffers)`` then sends each bucket from the buffers' own
    memory: no copy and no per-tensor work per update, whatever the tensor count
    (a bucket that spans two buffers is copied together).  ``extra``: (name, shape,
    dtype) of tensors that are not in a buffer (computed per update), laid out after
    the buffers; ``send(link, manifest, buffers, extra=tensors)`` packs them.
    Receivers need nothing new: the manifest names each tensor at its offset; gaps
    between tensors (the buffers' padding) travel as bytes nobody reads.  The
    buffers are read at send time: plan again if they are reallocated.  Raises
    ValueError for a view that is not contiguous, not 16-byte aligned in its buffer,
    or overlaps another (tied weights: name them once)."""
    bucket_bytes = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    by_storage: dict = {}
    for name, tensor in named:
        _sendable(name, tensor.dtype)
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: not contiguous, so not a range of its buffer; send it as an extra")
        storage = tensor.untyped_storage()
        start = tensor.data_ptr() - storage.data_ptr()
        if start % ALIGN:
            raise ValueError(f"{name}: at byte {start} of its buffer, not a multiple of {ALIGN}")
        by_storage.setdefault(storage.data_ptr(), (storage, tensor.device, []))[2].append(
            (start, name, tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size()))
    if len({device for _, device, _ in by_storage.values()}) > 1:
        raise ValueError("the buffers are on different devices")
    entries, pieces, base = [], [], 0
    for storage, device, items in by_storage.values():
        items.sort(key=operator.itemgetter(0))
        lo = end = items[0][0]
        for start, name, dtype, shape, nbytes in items:
            if start < end:
                raise ValueError(f"{name}: overlaps the tensor before it in its buffer (name tied weights once)")
            entries.append(Entry(name, dtype, shape, base + start - lo, nbytes))
            end = start + nbytes
        hi = _aligned(end)
        if hi > storage.nbytes():
            raise ValueError(f"{items[-1][1]}: its buffer ends {hi - storage.nbytes()} bytes short of "
                             f"a multiple of {ALIGN} after it; pad the buffer")
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (hi - lo,), (1,))
        pieces.append((base, view))
        base += hi - lo
    extras = []
    for name, shape, dtype in extra:
        _sendable(name, dtype)
        entry = Entry(name, dtype, tuple(shape), base, math.prod(shape) * dtype.itemsize)
        entries.append(entry)
        extras.append((base, entry))
        base = _aligned(base + entry.nbytes)
    device = pieces[0][1].device if pieces else torch.device("cpu")
    manifest = Manifest(int(version), bucket_bytes, base, bool(checksum), tuple(entries))
    return manifest, Buffers(tuple(pieces), tuple(extras), device)


def _sendable(name: str, dtype: torch.dtype) -> None:
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise TypeError(f"{name}: dtype {dtype} cannot be sent")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bucket_sum(data: torch.Tensor, out: torch.Tensor) -> None:
    """Sum, wrapping modulo 2**64, of the bucket's int64 words into ``out`` (on the
    device: no sync).  Integer addition is exact and associative, so the result does
    not depend on reduction order.  (int32 words widened to int64 took 5.5x longer on
    an H200: 0.72 vs 0.13 ms per 512 MiB.)"""
    torch.sum(data.view(torch.int64), 0, out=out)


# ------------------------------------------------------------------ sender


def send(link: Link, manifest: Manifest, tensors: Iterable[torch.Tensor] | Buffers, extra=()) -> None:
    """Send one update: ``tensors`` in manifest order, or the ``Buffers`` that
    ``plan_buffers`` returned with ``manifest`` (and its ``extra`` tensors, in
    order: an iterable taken when the first bucket that holds one is packed, so a
    generator computes them while the buckets before are on the wire).  Raises
    WeightSyncError (a receiver rejected it, a checksum differed, a peer failed or
    timed out).  On failure the rest of ``tensors`` is still
    consumed, so whoever produces them (tensor-parallel gathers) stays in step with
    its peers."""
    if isinstance(tensors, Buffers):
        if tensors.pieces and _indexed(tensors.device) != _indexed(link.device):
            raise WeightSyncError(f"the buffers are on {tensors.device}, the link on {link.device}")
        return _Sender(link, manifest, tensors).run(iter(extra))
    it = iter(tensors)
    try:
        _Sender(link, manifest).run(it)
    except Exception:
        for _ in it:
            pass
        raise


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>``: the same device, comparable."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# Pack a bucket whose sources are the tensors of the update before (same addresses,
# contiguous) by replaying its copies, captured as a CUDA graph: one launch per bucket
# where the copies' launches cost the sender's host ~1 us per tensor, the limit with
# many small tensors (docs/benchmarks.md).  Setting weight_sync.replay_packing.
PACK_GRAPHS = True


class _Packing:
    """Where each tensor goes in the two bucket buffers, computed once per layout and
    kept on the link: packing bucket k is then one ``_foreach_copy_`` per dtype from
    its tensors into cached views, with no per-tensor view work in the hot loop; on a
    GPU, once bucket k has had the same sources twice, a replay of those copies.

    ``batches`` takes and checks the tensors bucket by bucket and ``pack`` copies one
    bucket into its buffer; the sender interleaves them with its broadcasts, the
    bench (``--phases``) and the tests drive them without a group."""

    def __init__(self, manifest: Manifest, device: torch.device):
        self.manifest = manifest
        self.key = (manifest.bucket_bytes, manifest.total_bytes, manifest.entries)
        self.tensors_json = manifest.tensors_to_json()
        self.tensors_digest = tensors_digest(self.tensors_json)
        size = min(manifest.bucket_bytes, manifest.total_bytes)
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.sums = torch.zeros(max(manifest.buckets, 1), dtype=torch.int64, device=device)
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
                dst = self.buffers[k % 2][lo - start: hi - start]
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

    def matches(self, manifest: Manifest) -> bool:
        return self.key == (manifest.bucket_bytes, manifest.total_bytes, manifest.entries)

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
        return self.buffers[k % 2][: end - start]

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
        self.device = device
        self.graphs: list = [None] * buckets  # (addresses, CUDAGraph)
        self.seen: list = [None] * buckets    # addresses of the update before, not captured yet
        self.stream = None

    def replay(self, k: int, sources: list, copy: Callable) -> bool:
        """Whether bucket k was packed by a replay (else the caller copies): its
        graph's sources, or the same contiguous ones as last time (captured now)."""
        if not (self.on and PACK_GRAPHS):
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
                "copies from now on", k, type(exc).__name__, _first_line(exc))
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


class _Spans:
    """``_Packing`` for ``Buffers``: bucket k is a slice of the one buffer that holds
    its window (no copy, no per-tensor work), or its pieces (of buffers, of the extra
    tensors) copied into one of two bucket buffers with one ``_foreach_copy_``."""

    def __init__(self, manifest: Manifest, buffers: Buffers):
        self.manifest, self.source = manifest, buffers
        self.key = (manifest.bucket_bytes, manifest.total_bytes, manifest.entries)
        self.tensors_json = manifest.tensors_to_json()
        self.tensors_digest = tensors_digest(self.tensors_json)
        n = manifest.buckets
        self.sums = torch.zeros(max(n, 1), dtype=torch.int64, device=buffers.device)
        sizes = [manifest.window(k)[1] - manifest.window(k)[0] for k in range(n)]
        pieces = [(base, view.numel(), view) for base, view in buffers.pieces] + \
            [(base, e.nbytes, i) for i, (base, e) in enumerate(buffers.extra)]  # i: the i-th extra tensor
        self.whole: list = [None] * n   # bucket k's bytes when one buffer holds them
        self.parts: list = [None] * n   # else (destinations, sources: a view | (extra, byte range))
        self.buffers = [torch.empty(max(sizes, default=0), dtype=torch.uint8, device=buffers.device)
                        for _ in range(2)]
        for k in range(n):
            start, end = manifest.window(k)
            parts = [(max(start, base), min(end, base + size), base, source)
                     for base, size, source in pieces if base < end and base + size > start]
            if len(parts) == 1 and parts[0][:2] == (start, end) and isinstance(parts[0][3], torch.Tensor):
                lo, hi, base, view = parts[0]
                self.whole[k] = view[lo - base: hi - base]
                continue
            data = self.buffers[k % 2]
            self.parts[k] = ([data[lo - start: hi - start] for lo, hi, _, _ in parts],
                             [source[lo - base: hi - base] if isinstance(source, torch.Tensor)
                              else (source, slice(lo - base, hi - base)) for lo, hi, base, source in parts])
        if not any(p is not None for p in self.parts):
            self.buffers = []
        # The first bucket that packs an extra tensor (they lie after the buffers).
        self.first_extra = next((k for k, parts in enumerate(self.parts) if parts is not None and any(
            not isinstance(s, torch.Tensor) for s in parts[1])), n)

    def matches(self, manifest: Manifest, buffers: Buffers) -> bool:
        return self.source is buffers and self.key == (manifest.bucket_bytes, manifest.total_bytes,
                                                       manifest.entries)

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

    def pack(self, k: int, extra: list) -> torch.Tensor:
        if self.whole[k] is not None:
            return self.whole[k]
        dsts, sources = self.parts[k]
        torch._foreach_copy_(dsts, [s if isinstance(s, torch.Tensor) else extra[s[0]][s[1]] for s in sources])
        start, end = self.manifest.window(k)
        return self.buffers[k % 2][: end - start]


class _Sender:
    def __init__(self, link: Link, manifest: Manifest, buffers: Optional[Buffers] = None):
        self.link, self.manifest = link, manifest
        # An update no receiver would accept is refused in the votes, so both ends
        # stay usable, and without building its packing (as costly here as there).
        self.refusal = too_many_buckets(manifest.bucket_bytes, manifest.total_bytes)
        if self.refusal:
            packing = None
        elif buffers is not None:
            packing = link.spans
            if packing is None or not packing.matches(manifest, buffers):
                link.spans = None
                packing = link.spans = _Spans(manifest, buffers)
        else:
            packing = link.packing
            if packing is None or not packing.matches(manifest):
                link.packing = None  # free the old buffers first
                packing = link.packing = _Packing(manifest, link.device)
        self.packing = packing
        self.in_flight: list = [None, None]   # data work per buffer
        self.works: list = []

    def run(self, tensors: Iterator[torch.Tensor]) -> None:
        link, manifest, packing = self.link, self.manifest, self.packing
        tensors_json = packing.tensors_json if packing else manifest.tensors_to_json()
        digest = layout_digest(manifest, packing.tensors_digest if packing else tensors_digest(tensors_json))
        header = torch.tensor([MAGIC, FORMAT, manifest.version, digest], dtype=torch.int64)
        link.wait(link.broadcast(header.to(link.device)), "header")
        mine = REJECTED if self.refusal else OK
        status = link.layout_vote(mine)
        if status == NEED_MANIFEST:  # a receiver does not hold this layout yet
            text = manifest.to_json(tensors_json)
            link.wait(link.broadcast(torch.tensor([len(text)], dtype=torch.int64).to(link.device)), "manifest")
            body = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(link.device)
            link.wait(link.broadcast(body), "manifest")
            status = link.vote(mine, "manifest vote")
        if self.refusal:
            raise WeightSyncError(f"update v{manifest.version} refused: {self.refusal}")
        if status:
            raise WeightSyncError(f"update v{manifest.version} was refused by an engine rank (a bad manifest, "
                                  "one that does not match its model, or not enough memory; see its log)")
        with torch.no_grad():
            for k, sources in self.packing.batches(tensors):
                if k < manifest.buckets:  # an update of 0 bytes has tensors but no bucket
                    self._flush(k, sources)
        for work in self.works:
            link.wait(work, "bucket")
        verdict = link.vote(OK, "verdict")
        if verdict:
            raise (ChecksumMismatch if verdict == CHECKSUM_MISMATCH else WeightSyncError)(
                f"update v{manifest.version} failed on an engine rank with {_VERDICTS[verdict]} "
                "(see its log)")

    def _flush(self, k: int, sources: list) -> None:
        link, slot = self.link, k % 2
        if self.in_flight[slot] is not None:  # the buffer's previous bucket must be out
            link.wait(self.in_flight[slot], f"bucket {k - 2}")
        data = self.packing.pack(k, sources)
        self.in_flight[slot] = link.broadcast(data)
        self.works.append(self.in_flight[slot])
        if self.manifest.checksum:
            _bucket_sum(data, self.packing.sums[k])
            if before_sum_send is not None:
                before_sum_send(k, self.packing.sums[k: k + 1])
            self.works.append(link.broadcast(self.packing.sums[k: k + 1]))
        if after_send is not None:
            after_send(k, data)


# ------------------------------------------------------------------ receiver


@dataclass
class Update:
    """A received update.  ``tensors``: [(name, tensor)] (stage "update": every
    bucket already verified) or a one-shot iterator that verifies each bucket
    before yielding its tensors (stage "bucket").  ``close()`` finishes the
    protocol when a streamed update was not consumed to the end."""

    version: int
    manifest: Manifest
    tensors: object
    close: Callable[[], None]


def receive(link: Link, *, stage: str = "update", max_metadata_bytes: int = 64 << 20,
            max_update_bytes: int = 1 << 40, check: Optional[Callable[[Manifest], None]] = None) -> Update:
    """Receive one update from group rank 0 (see the module doc for the protocol).
    ``check(manifest)`` vets a new layout before the manifest vote (an exception
    refuses it; an accepted layout is not checked again)."""
    header = torch.zeros(4, dtype=torch.int64, device=link.device)
    link.wait(link.broadcast(header), "waiting for an update")
    magic, fmt, version, digest = header.tolist()
    if magic != MAGIC or fmt != FORMAT:
        # Not our protocol (or another format of it): the peers' next steps cannot
        # be matched, so this group is done.
        link.broken = f"bad header {header.tolist()} (expected magic {MAGIC:#x}, format {FORMAT})"
        raise WeightSyncError(f"received {link.broken}")
    status, receiver, refusal = NEED_MANIFEST, None, None
    if digest in link.layouts:  # the layout of an earlier update
        status, receiver, refusal = _prepared(link, replace(link.layouts[digest], version=version), stage,
                                              max_update_bytes)
    verdict = link.layout_vote(status)
    if verdict == NEED_MANIFEST:  # a receiver needs the manifest: every rank takes part
        manifest, why = _manifest(link, digest, version, max_metadata_bytes, max_update_bytes, check)
        if status == NEED_MANIFEST:
            status, receiver, refusal = (REJECTED, None, why) if manifest is None else \
                _prepared(link, manifest, stage, max_update_bytes)
            if status == OK:
                if len(link.layouts) >= MAX_LAYOUTS:
                    link.layouts.clear()  # a bound, not an LRU: layouts rarely change
                link.layouts[digest] = replace(manifest, version=0)
        verdict = link.vote(status, "manifest vote")
    if status != OK:
        raise WeightSyncError(f"update v{version} refused here: {refusal}")
    if verdict:
        raise WeightSyncError(f"update v{version} refused by another rank (an engine rank or the sender)")
    return Update(version, receiver.manifest, receiver.tensors(), receiver.close)


def _manifest(link: Link, digest: int, version: int, max_metadata_bytes: int, max_update_bytes: int,
              check: Optional[Callable[[Manifest], None]] = None):
    """Receive the manifest: (it, None) or (None, why it is refused).  Whatever goes
    wrong after it arrived is a refusal, so the manifest vote is always cast and the
    sender fails at once instead of after timeout_s."""
    length = torch.zeros(1, dtype=torch.int64, device=link.device)
    link.wait(link.broadcast(length), "manifest")
    length = int(length.item())
    if not 0 < length <= max_metadata_bytes:  # a length we will not allocate: the group is done
        link.broken = f"manifest of {length} bytes (max_metadata_bytes={max_metadata_bytes})"
        raise WeightSyncError(f"received a {link.broken}")
    body = torch.empty(length, dtype=torch.uint8, device=link.device)
    link.wait(link.broadcast(body), "manifest")
    try:
        text = _to_bytes(body.cpu())
        manifest = Manifest.from_json(text, max_update_bytes, link.known_manifest)
        tensors_json = _split_tensors(text)[1]
        link.known_manifest = (tensors_json, manifest.entries)
        if manifest.version != version:
            raise ValueError(f"header says v{version}, manifest v{manifest.version}")
        if layout_digest(manifest, tensors_digest(tensors_json)) != digest:
            raise ValueError("the manifest does not match the header's layout digest")
        if check is not None:
            check(manifest)
        return manifest, None
    except Exception as exc:  # noqa: BLE001 - refused here; the peers learn it from the vote
        return None, f"{type(exc).__name__}: {_first_line(exc)[:2000]}"


def _prepared(link: Link, manifest: Manifest, stage: str, max_update_bytes: int) -> tuple:
    """(status, receiver, refusal): a receiver for ``manifest`` in ``stage``, its
    buffers allocated (or reused), or why not."""
    try:
        if stage not in ("update", "bucket"):
            raise ValueError(f"stage must be 'update' or 'bucket', got {stage!r}")
        if manifest.total_bytes > max_update_bytes:
            raise ValueError(f"update of {manifest.total_bytes} bytes exceeds max_update_bytes={max_update_bytes}")
        return OK, (_Staged if stage == "update" else _Streamed)(link, manifest), None
    except Exception as exc:  # noqa: BLE001 - refused here; the peers learn it from the vote
        return REJECTED, None, f"{type(exc).__name__}: {exc}"


def _to_bytes(data: torch.Tensor) -> bytes:
    try:
        return data.numpy().tobytes()
    except RuntimeError:  # torch without numpy
        return bytes(data.tolist())


class _Receiver:
    def __init__(self, link: Link, manifest: Manifest):
        self.link, self.manifest = link, manifest
        # Reused across updates: every bucket's two sums are written (broadcast,
        # _bucket_sum) before they are compared, so stale values are never read.
        n = max(manifest.buckets, 1)
        if link.sums is None or link.sums[0].numel() != n:
            link.sums = tuple(torch.zeros(n, dtype=torch.int64, device=link.device) for _ in range(2))
        self.sent_sums, self.sums = link.sums

    def _post(self, k: int, data: torch.Tensor) -> list:
        works = [self.link.broadcast(data)]
        if self.manifest.checksum:
            works.append(self.link.broadcast(self.sent_sums[k: k + 1]))
        return works

    def _arrived(self, k: int, data: torch.Tensor, works: list, wait: bool = True) -> None:
        """Bucket k's checksum, after its ``works``: waited for on the host, or with
        ``wait=False`` (NCCL) queued behind them on the device."""
        for work in works:
            (self.link.wait if wait else self.link.after)(work, f"bucket {k} of {self.manifest.buckets}")
        if before_verify is not None:
            before_verify(k, data)
        if self.manifest.checksum:
            _bucket_sum(data, self.sums[k])

    def _bad_buckets(self, ks) -> list:
        if not self.manifest.checksum:
            return []
        ks = list(ks)
        differ = (self.sums[ks] != self.sent_sums[ks]).tolist()
        return [k for k, bad in zip(ks, differ) if bad]

    def _finish(self, bad: Optional[list] = None) -> None:
        """The verdict.  ``bad``: the buckets found bad, known on the host (stage
        "bucket"); None: compare every bucket's sums on the device and vote with the
        result, so no host sync waits for the last sum before the vote."""
        n = self.manifest.buckets
        if bad is not None:
            verdict = self.link.vote(CHECKSUM_MISMATCH if bad else OK, "verdict")
        else:
            mismatch = torch.ne(self.sums[:n], self.sent_sums[:n]).any().to(torch.int64).reshape(1) \
                if self.manifest.checksum and n else OK  # CHECKSUM_MISMATCH is 1, True as int64
            verdict = self.link.vote(mismatch, "verdict")
            bad = self._bad_buckets(range(n)) if verdict else []
        version = self.manifest.version
        if bad:
            raise ChecksumMismatch(f"update v{version}: checksum mismatch in bucket(s) "
                                   f"{', '.join(map(str, bad))} of {self.manifest.buckets}")
        if verdict:
            raise WeightSyncError(f"update v{version} failed on another engine rank "
                                  f"with {_VERDICTS[verdict]}")


class _Staged(_Receiver):
    """Receive the whole update into one buffer, verify it, then hand it out."""

    def __init__(self, link: Link, manifest: Manifest):
        super().__init__(link, manifest)
        # The same layout every step: reuse the buffer and its views.  Making ~7 us of
        # views per tensor each time cost more than the transfer itself (bench on 2 H200).
        staged = link.staged
        if staged is None or (staged[0] is not manifest.entries and staged[0] != manifest.entries) \
                or staged[1].numel() != manifest.total_bytes:
            link.staged = None  # free the old buffer first
            stream = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=link.device)
            views = [(e.name, stream[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape))
                     for e in manifest.entries]
            staged = link.staged = (manifest.entries, stream, views)
        self.stream, self.views = staged[1], staged[2]

    def tensors(self) -> list:
        manifest, stream = self.manifest, self.stream
        windows = [stream[slice(*manifest.window(k))] for k in range(manifest.buckets)]
        posted = [self._post(k, data) for k, data in enumerate(windows)]  # all in flight
        for k, data in enumerate(windows):  # each sum queued behind its bucket: no host wait between
            self._arrived(k, data, posted[k], wait=False)
        for k, works in enumerate(posted):  # the deadline, and which bucket a silent peer left
            for work in works:
                self.link.wait(work, f"bucket {k} of {manifest.buckets}")
        self._finish()
        return list(self.views)

    def close(self) -> None:
        pass


class _BucketPlan:
    """The streamed receiver's two bucket buffers and, per bucket, what to hand out
    once it is verified, computed once per layout and kept on the link (like stage
    "update"'s views): a slice and two views per tensor made anew each update cost
    7.5-12 us per tensor on an H100 machine's host, more than the transfer.

    Bucket k's items are, in stream order: ``head[k]``, the piece of a tensor begun
    in an earlier bucket; ``whole[k]``, (name, view into buffer k % 2) of the tensors
    wholly inside it; ``tail[k]``, the first piece of a tensor that continues past it.
    A piece is (entry, its bytes in the bucket, where they go in the tensor); the
    head's last element says whether the tensor ends in bucket k."""

    def __init__(self, manifest: Manifest, device: torch.device):
        self.key = (manifest.bucket_bytes, manifest.total_bytes, manifest.entries)
        n, size = manifest.buckets, min(manifest.bucket_bytes, manifest.total_bytes)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.data = [self.buffers[k % 2][: manifest.window(k)[1] - manifest.window(k)[0]] for k in range(n)]
        self.whole: list = [[] for _ in range(n)]
        self.head: list = [None] * n
        self.tail: list = [None] * n
        for e in manifest.entries if n else ():  # no bucket: nothing is handed out (as before)
            first = min(e.offset // manifest.bucket_bytes, n - 1)  # empty tensors at the end: the last
            start, end = manifest.window(first)
            if e.offset + e.nbytes <= end:
                view = self.data[first][e.offset - start: e.offset + e.nbytes - start]
                self.whole[first].append((e.name, view.view(e.dtype).view(e.shape)))
                continue
            lo = e.offset
            for k in range(first, n):  # crosses a bucket end: one piece per bucket it touches
                start, end = manifest.window(k)
                hi = min(e.offset + e.nbytes, end)
                piece = (e, self.data[k][lo - start: hi - start], slice(lo - e.offset, hi - e.offset))
                if k == first:
                    self.tail[k] = piece
                else:
                    self.head[k] = piece + (hi == e.offset + e.nbytes,)
                if hi == e.offset + e.nbytes:
                    break
                lo = hi

    def matches(self, manifest: Manifest) -> bool:
        bucket, total, entries = self.key
        return bucket == manifest.bucket_bytes and total == manifest.total_bytes and \
            (entries is manifest.entries or entries == manifest.entries)


class _Streamed(_Receiver):
    """Two bucket buffers; each bucket is verified before its tensors are yielded,
    so engine memory is two buckets (plus tensors that cross a boundary).

    A yielded tensor that lies wholly in one bucket is a view into that bucket's
    buffer, which the bucket after next overwrites: use it (copy it out) before
    asking for the next item, and do not change it in place, data or shape (the same
    view objects are handed out again by the next update with this layout).  A
    tensor that crosses a bucket end is assembled in an allocation of its own, new
    every update."""

    def __init__(self, link: Link, manifest: Manifest):
        super().__init__(link, manifest)
        plan = link.streamed
        if plan is None or not plan.matches(manifest):
            link.streamed = None  # free the old buffers first
            plan = link.streamed = _BucketPlan(manifest, link.device)
        self.plan = plan
        self.posted: dict = {}
        self.arrived = 0        # buckets received so far
        self.partial = None     # a tensor crossing a bucket boundary, being assembled
        self.state = "new"      # -> "started" -> "done"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.state = "started"
        n, bad = self.manifest.buckets, []
        try:
            if n:
                self._post_bucket(0)
            for k in range(n):
                if k + 1 < n:  # its buffer held bucket k-1, whose tensors were consumed
                    self._post_bucket(k + 1)
                self._arrive(k)
                bad = self._bad_buckets([k])
                if bad:
                    self._drain()
                    break
                yield from self._entries(k)
        except GeneratorExit:  # the consumer stopped early (load_weights failed)
            self._abandon()
            raise
        self.state = "done"
        self._finish(bad)

    def close(self) -> None:
        """Finish the protocol when the consumer gave up before the end."""
        if self.state == "new":
            self._abandon()

    def _abandon(self) -> None:
        self.state = "done"
        self._drain()
        self.link.vote(REJECTED, "verdict")

    def _post_bucket(self, k: int) -> None:
        self.posted[k] = self._post(k, self.plan.data[k])

    def _arrive(self, k: int) -> None:
        self._arrived(k, self.plan.data[k], self.posted.pop(k))
        self.arrived = k + 1

    def _drain(self) -> None:
        for k in range(self.arrived, self.manifest.buckets):
            if k not in self.posted:
                self._post_bucket(k)
            self._arrive(k)

    def _entries(self, k: int) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self.plan
        head = plan.head[k]
        if head is not None:  # the rest of a tensor begun in an earlier bucket
            e, data, part, ends = head
            self.partial[part].copy_(data)
            if not ends:  # it spans this whole bucket: nothing else is in it
                return
            whole, self.partial = self.partial, None
            yield e.name, whole.view(e.dtype).view(e.shape)
        yield from plan.whole[k]  # the hot path: cached views, no per-tensor work
        tail = plan.tail[k]
        if tail is not None:  # a new allocation each update: the consumer may keep it
            e, data, part = tail
            self.partial = torch.empty(e.nbytes, dtype=torch.uint8, device=self.link.device)
            self.partial[part].copy_(data)
