"""The wire contract both ends of a weight update read, whatever the backend: the
manifest (UTF-8 JSON, never pickle: version, bucket size, per tensor name, dtype,
shape and stream offset), its digests, the per-bucket checksum, the statuses of the
votes, the limits a receiver enforces before it allocates anything, and the errors.

The tensors are laid out back to back (each at a 16-byte aligned offset) in one
virtual byte stream, cut into buckets of ``bucket_bytes``: a tensor crosses a
bucket boundary like any other byte range, so tensors larger than a bucket need
no special case.  ``plan`` lays out tensors to be packed; ``plan_buffers`` lays out
views of a few contiguous buffers (Megatron's parameter buffers) as they lie in
memory, so buckets can be sent from the buffers themselves.

How the bytes move is the backends' business (docs/weight_sync_backends.md):
``broadcast`` (sender.py / receiver.py over link.py's group), ``ipc`` and
``mooncake`` (an engine request that carries this manifest).
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from ..core import bounded
from . import copysum

MAGIC = 0x53505753  # "SPWS"
# The protocol's format: 1, the manifest travelled with every update (header: its
# length); 2, a header broadcast, then a layout vote; 3, the two as one handshake.
FORMAT = 3
MANIFEST_FORMAT = 2  # the manifest's JSON "format" (unchanged by the protocol's 3)
ALIGN = 16          # stream offsets and bucket sizes: multiples of this

OK, CHECKSUM_MISMATCH, REJECTED, NEED_MANIFEST = 0, 1, 2, 3
MAX_LAYOUTS = 8  # a receiver remembers this many layouts (with and without checksums count twice)
# Bounds on what a manifest may make a receiver build before any data arrives: every
# bucket costs ~3.5 KB of views and work items (a 150-byte manifest asked for 524,288
# buckets: 2.9 GB), every tensor a view.  512 MiB buckets reach 8 TiB at MAX_BUCKETS.
MAX_BUCKETS = 1 << 14
MAX_TENSORS = 1 << 20
MANIFEST_DEPTH = 4  # {manifest: [tensors: [entry: [shape]]]}
VERDICTS = {CHECKSUM_MISMATCH: "a checksum mismatch", REJECTED: "a receive error"}
ROW = 7 + 2 * MAX_LAYOUTS  # int64s each rank puts in the handshake (handshake_row)

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)

# Test hooks (tests/e2e/weight_sync_*.py): called with (bucket index, its bytes)
# after a bucket was sent / received, before the receiver checks it; and with
# (bucket index, its checksum) before the sender sends the checksum.


class WeightSyncError(RuntimeError):
    """An update failed (docs/weight_sync_troubleshooting.md, "Failure behaviour", says what the engine then serves)."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not take part in the update within the timeout."""


class ChecksumMismatch(WeightSyncError):
    """Received bytes differ from the sent ones."""


class ManifestError(WeightSyncError, ValueError):
    """A received manifest is malformed or over a limit: refused (by a vote) before
    anything is allocated.  A ValueError too, as Manifest.from_json always raised."""


def handshake_row(version: int = 0, digest: int = 0, status: int = OK, take=(), refuse=()) -> list:
    """One rank's int64[ROW] in an update's handshake (an all-gather, so every rank
    reads every row): ``[MAGIC, FORMAT, version, layout digest, status, len(take),
    len(refuse), *take, *refuse, 0...]``.  The sender (group rank 0) fills in the
    update's version and digest and its own status (OK, or REJECTED for an update it
    refuses itself); a receiver, the digests of the layouts it accepted before: those
    it takes again (``take``) and those it would refuse now (``refuse``)."""
    row = [MAGIC, FORMAT, version, digest, status, len(take), len(refuse), *take, *refuse]
    if len(take) + len(refuse) > MAX_LAYOUTS:
        raise ValueError(f"a handshake row holds at most {MAX_LAYOUTS} layouts")
    return row + [0] * (ROW - len(row))


def layout_verdict(rows: list) -> int:
    """What every rank reads from the gathered rows, the same on all: the sender's
    status and each receiver's for the sender's layout (OK where it takes it,
    REJECTED where it refuses it, NEED_MANIFEST where it never accepted it), MAX.
    WeightSyncError for a row of another protocol or format: the group is done."""
    for rank, row in enumerate(rows):
        if len(row) != ROW or row[0] != MAGIC or row[1] != FORMAT:
            raise WeightSyncError(f"rank {rank} of the update group does not speak this protocol's format "
                                  f"{FORMAT} (its first words: {row[:2]}; expected [{MAGIC:#x}, {FORMAT}]): "
                                  "run the same source-patch on the trainer and the engines")
    digest, verdict = rows[0][3], rows[0][4]
    for row in rows[1:]:
        take, refuse = row[7: 7 + row[5]], row[7 + row[5]: 7 + row[5] + row[6]]
        verdict = max(verdict, OK if digest in take else REJECTED if digest in refuse else NEED_MANIFEST)
    return verdict


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__





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
        head = json.dumps({"format": MANIFEST_FORMAT, "version": self.version, "bucket_bytes": self.bucket_bytes,
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
        head, tensors_json = split_tensors(data)
        doc = _load(head + b"}" if tensors_json else data, "the manifest")
        if not tensors_json or not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"not a format-{MANIFEST_FORMAT} manifest")
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
    least = aligned(-(-total_bytes // MAX_BUCKETS))
    return (f"{count:,} buckets of {bucket_bytes:,} bytes, more than the {MAX_BUCKETS:,} a receiver "
            f"accepts: bucket_bytes must be at least {least:,} for {total_bytes:,} bytes")


def tensors_digest(tensors_json: bytes) -> bytes:
    return hashlib.blake2b(tensors_json, digest_size=16).digest()


def layout_digest(manifest: Manifest, tensors: bytes) -> int:
    """The layout (everything but the version) as a signed int64, for the handshake:
    ``tensors`` is tensors_digest() of the manifest's tensors JSON, computed once."""
    head = b"%d,%d,%d," % (manifest.bucket_bytes, manifest.total_bytes, manifest.checksum)
    return int.from_bytes(hashlib.blake2b(head + tensors, digest_size=8).digest(), "little", signed=True)


_TENSORS = re.compile(rb',\s*"tensors"\s*:')


def split_tensors(data: bytes) -> tuple[bytes, bytes]:
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
        sendable(name, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append(Entry(name, dtype, tuple(shape), offset, nbytes))
        offset = aligned(offset + nbytes)
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
        sendable(name, tensor.dtype)
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
        hi = aligned(end)
        if hi > storage.nbytes():
            raise ValueError(f"{items[-1][1]}: its buffer ends {hi - storage.nbytes()} bytes short of "
                             f"a multiple of {ALIGN} after it; pad the buffer")
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (hi - lo,), (1,))
        pieces.append((base, view))
        base += hi - lo
    extras = []
    for name, shape, dtype in extra:
        sendable(name, dtype)
        entry = Entry(name, dtype, tuple(shape), base, math.prod(shape) * dtype.itemsize)
        entries.append(entry)
        extras.append((base, entry))
        base = aligned(base + entry.nbytes)
    device = pieces[0][1].device if pieces else torch.device("cpu")
    manifest = Manifest(int(version), bucket_bytes, base, bool(checksum), tuple(entries))
    return manifest, Buffers(tuple(pieces), tuple(extras), device)


def sendable(name: str, dtype: torch.dtype) -> None:
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise TypeError(f"{name}: dtype {dtype} cannot be sent")


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_sum(data: torch.Tensor, out: torch.Tensor, wide: bool = False) -> None:
    """Sum, wrapping modulo 2**64, of the bucket's int64 words into ``out`` (on the
    device: no sync).  Integer addition is exact and associative, so the result does
    not depend on reduction order.  (int32 words widened to int64 took 5.5x longer on
    an H200: 0.72 vs 0.13 ms per 512 MiB.)  On a GPU copysum.word_sum adds them on half
    the multiprocessors: beside a broadcast, torch.sum would slow it (copysum's doc);
    ``wide``: with nothing on the wire beside it, torch.sum on all of them."""
    if not wide and copysum.summable(data):
        copysum.word_sum(data, out, copysum.programs(data.device))
    else:
        torch.sum(data.view(torch.int64), 0, out=out)


def request_json(manifest: Manifest, fields: dict, tensors_json: bytes | None = None) -> bytes:
    """The manifest with a request backend's ``fields`` (backend, bucket sums, where
    the memory is), as the JSON an engine request carries; "tensors" stays last."""
    head = manifest.to_json(tensors_json)
    cut = _TENSORS.search(head).start()
    extra = json.dumps(fields, separators=(",", ":")).encode()
    return head[:cut] + b"," + extra[1:-1] + head[cut:]


def parse_request(data: bytes, max_update_bytes: int, known: tuple | None = None) -> tuple[Manifest, dict]:
    """(the manifest, the request's other fields) of ``request_json``'s bytes;
    ManifestError says what is wrong.  ``known``: as for Manifest.from_json."""
    manifest = Manifest.from_json(data, max_update_bytes, known)
    head = split_tensors(data)[0]
    fields = _load(head + b"}", "the request")
    return manifest, {k: v for k, v in fields.items() if k not in ("format", "version", "bucket_bytes",
                                                                   "total_bytes", "checksum")}


def verify_sums(manifest: Manifest, stream: torch.Tensor, sums: list, computed: torch.Tensor | None = None) -> None:
    """Compare each bucket's int64 word sum of ``stream`` (or ``computed``, those sums
    already made, e.g. while copying) with the sender's ``sums``."""
    if not manifest.checksum:
        return
    if not isinstance(sums, list) or len(sums) != manifest.buckets:
        raise ManifestError(f"{len(sums) if isinstance(sums, list) else 'no'} bucket sums for "
                                 f"{manifest.buckets} buckets")
    got = computed
    if got is None:
        got = torch.zeros(max(manifest.buckets, 1), dtype=torch.int64, device=stream.device)
        for k in range(manifest.buckets):
            bucket_sum(stream[slice(*manifest.window(k))], got[k])
    bad = [k for k, (a, b) in enumerate(zip(got.tolist(), sums)) if a != b]
    if bad:
        raise ChecksumMismatch(f"update v{manifest.version}: checksum mismatch in bucket(s) "
                               f"{', '.join(map(str, bad))} of {manifest.buckets}")
