"""An engine's copy of an update and its per-bucket checksums in one pass over the
bytes (a Triton kernel): the copy reads every word anyway, so the sum costs no second
read.  Separately (copy, then ``torch.sum`` per bucket) the checksums took the
colocated ipc receive from 91.6% of a raw device-to-device copy to 58.9% (4 GiB, two
H100; docs/bench-notes/weight_sync.md).

The sum is wire.bucket_sum's: the bucket's int64 words added modulo 2**64 (exact,
so the order of the additions does not matter: per block, then atomically per bucket).

The sender's device work beside NCCL (``Table``, ``word_sum``): a sender packs bucket
k + 1 and sums bucket k while bucket k is on the wire.  A kernel that spreads over
every multiprocessor slows that broadcast: a 512 MiB broadcast between two H100 took
1.46 ms alone, 1.70 ms beside torch's copy of 512 MiB, but 1.47 ms beside the same
copy by 64 programs, and 1.47 ms beside this module's Table copying and summing it on
half the multiprocessors (bench/contention_bench.py; docs/bench-notes/weight_sync.md).
So these kernels run on 1 / ``SHARE`` of the multiprocessors (``programs``; a
quarter or an eighth measured the same), each program looping over its share; and a
Table packing a bucket adds what it copies into the bucket's checksum, so the sender
reads the bucket once.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Optional

import torch

MAX_BLOCK = 4096  # int64 words a program copies (32 KiB)
MIN_BLOCK = 128
ROW_WORDS = 32768  # a Table's longest row (256 KiB): a few rows per program balance the work
BLOCK = 2048       # int64 words a Table program moves per step (16 KiB)
SUM_BLOCK = 4096   # int64 words a word_sum program adds per step (32 KiB)
SEGMENTS = 64      # contiguous runs a strided source may be cut into for a Table
SHARE = 2          # the kernels beside NCCL run on 1 / SHARE of the multiprocessors


def block_for(bucket_bytes: int) -> int:
    """The largest power of two <= MAX_BLOCK that divides a bucket's words (a block
    never straddles two buckets), or 0 when that is below MIN_BLOCK (copy unfused)."""
    words = bucket_bytes // 8
    block = MAX_BLOCK
    while block >= MIN_BLOCK and words % block:
        block //= 2
    return block if block >= MIN_BLOCK and bucket_bytes % 8 == 0 else 0


def usable(source: torch.Tensor, dst: torch.Tensor, bucket_bytes: int) -> bool:
    """Whether copy_and_sum applies: both on one CUDA device (a peer's memory is read
    by copy_, which needs no peer access), 8-byte aligned, and a bucket size it can cut."""
    return (source.device.type == "cuda" and source.device == dst.device and block_for(bucket_bytes) > 0
            and source.data_ptr() % 8 == 0 and dst.data_ptr() % 8 == 0 and _kernels() is not None)


def copy_and_sum(source: torch.Tensor, dst: torch.Tensor, bucket_bytes: int, sums: torch.Tensor) -> None:
    """dst[:] = source[:n] (uint8, n = dst.numel(), a multiple of 8) and, per bucket of
    ``bucket_bytes``, the int64 word sum into ``sums`` (zeroed here)."""
    kernel, block = _kernels()[0], block_for(bucket_bytes)
    words = dst.numel() // 8
    sums.zero_()
    if words:
        grid = (-(-words // block),)
        kernel[grid](source.view(torch.int64), dst.view(torch.int64), sums, words, bucket_bytes // 8, BLOCK=block)


def programs(device: torch.device, share: int = SHARE) -> int:
    """How many programs the kernels beside NCCL run: 1 / ``share`` of the
    multiprocessors (see the module doc)."""
    return _programs(device.index if device.index is not None else torch.cuda.current_device(), share)


@functools.lru_cache(maxsize=None)
def _programs(index: int, share: int) -> int:
    return max(1, torch.cuda.get_device_properties(index).multi_processor_count // share)


def available() -> bool:
    """Whether Triton is there to run these kernels."""
    return _kernels() is not None


def summable(data: torch.Tensor) -> bool:
    """Whether word_sum applies: a CUDA tensor of whole, 8-byte aligned int64 words."""
    return (data.device.type == "cuda" and data.numel() * data.element_size() % 8 == 0
            and data.data_ptr() % 8 == 0 and _kernels() is not None)


def word_sum(data: torch.Tensor, out: torch.Tensor, programs: int) -> None:
    """``out`` (one int64, zeroed here) = the sum of ``data``'s int64 words modulo 2**64,
    by ``programs`` programs."""
    words = data.view(torch.int64)
    out.zero_()
    if words.numel():
        _kernels()[1][(programs,)](words, out, words.numel(), PROGRAMS=programs, BLOCK=SUM_BLOCK, num_warps=8)


class Table:
    """Copies between fixed addresses as one launch: rows of (source, destination,
    int64 words, copy?), each piece at most ROW_WORDS, on the device, made once (the
    addresses must stay put: Program's sources do).  Addresses are held as words from
    the table's own (so the kernel's loads are typed and 16-byte vectors).
    ``pieces``: (destination, source) tensor pairs that ``fit``; ``reads``: tensors
    (16-byte aligned, multiples of 16 bytes) only read, for their sum.  Once ``into``
    (one int64) is set, the launch also adds every word it copies or reads into it:
    a bucket's checksum in the pass that packs it (Program.summing)."""

    def __init__(self, pieces: list, device: torch.device, programs: int, reads: tuple = ()):
        # (int64 arithmetic, not a Python loop: a real model has ~20k pieces)
        spans = [(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size() // 8, 1) for d, s in pieces]
        spans += [(r.data_ptr(), r.data_ptr(), r.numel() * r.element_size() // 8, 0) for r in reads]
        dst, src, words, copy = torch.tensor(spans, dtype=torch.int64).reshape(-1, 4).unbind(1)
        cuts = (words + ROW_WORDS - 1) // ROW_WORDS  # rows per span
        span = torch.repeat_interleave(torch.arange(len(spans)), cuts)
        at = (torch.arange(len(span)) - (torch.cumsum(cuts, 0) - cuts)[span]) * ROW_WORDS  # row's first word
        self.rows = torch.empty((len(span), 4), dtype=torch.int64, device=device)
        base = self.rows.data_ptr()
        self.rows.copy_(torch.stack([(src[span] - base) // 8 + at, (dst[span] - base) // 8 + at,
                                     torch.clamp(words[span] - at, max=ROW_WORDS), copy[span]], 1))
        self.programs = max(1, min(programs, len(span)))
        self.spans = [(to, to + 8 * n) for to, _, n, _ in spans]  # the byte ranges it writes or reads
        self.keep = (pieces, reads)  # the memory the rows point into
        self.into: Optional[torch.Tensor] = None

    @staticmethod
    def fits(dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Contiguous, the same dtype and size, both 16-byte aligned and a multiple of 16 bytes."""
        nbytes = dst.numel() * dst.element_size()
        return (dst.is_contiguous() and src.is_contiguous() and nbytes % 16 == 0 and dst.dtype == src.dtype
                and dst.numel() == src.numel() and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0)

    @staticmethod
    def split(dst: torch.Tensor, src: torch.Tensor) -> Optional[list]:
        """``dst[:] = src`` as pieces that ``fit``: itself, or where ``src`` is a strided
        view (the fused QKV's q, k and v) one piece per contiguous run of it, at most
        SEGMENTS; None where neither fits."""
        if Table.fits(dst, src):
            return [(dst, src)]
        if not dst.is_contiguous() or dst.dtype != src.dtype or dst.numel() != src.numel() or not src.numel():
            return None
        d, run = src.dim(), 1  # the inner dims laid out contiguously: ``run`` elements
        while d and (src.shape[d - 1] == 1 or src.stride(d - 1) == run):
            run *= src.shape[d - 1]
            d -= 1
        outer = src.shape[:d]
        if math.prod(outer) > SEGMENTS:
            return None
        pieces = [(to, src[index].reshape(-1))
                  for to, index in zip(dst.reshape(-1).split(run), itertools.product(*map(range, outer)))]
        return pieces if all(Table.fits(to, frm) for to, frm in pieces) else None

    def __call__(self) -> None:
        if len(self.rows):
            into = self.into if self.into is not None else self.rows
            _kernels()[2][(self.programs,)](self.rows, len(self.rows), into, PROGRAMS=self.programs, BLOCK=BLOCK,
                                            SUM=self.into is not None, num_warps=8)


@functools.lru_cache(maxsize=1)
def _kernels():
    """(copy_sum, word_sum, table_copy), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_sum(src, dst, sums, n_words, words_per_bucket, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n_words
        words = tl.load(src + offsets, mask=mask, other=0)
        tl.store(dst + offsets, words, mask=mask)
        tl.atomic_add(sums + start // words_per_bucket, tl.sum(words, axis=0))

    @triton.jit
    def word_sum(src, out, n_words, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
        total = tl.zeros([BLOCK], tl.int64)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_words, PROGRAMS * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            total += tl.load(src + offsets, mask=offsets < n_words, other=0)
        tl.atomic_add(out, tl.sum(total, axis=0))

    @triton.jit
    def table_copy(rows, n_rows, into, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, SUM: tl.constexpr):
        # rows (int64 [n, 4]): source and destination as words from ``rows`` (16-byte
        # aligned: multiples of 2), words, copy (else only read).  Whole blocks unmasked,
        # so loads are vectors.
        total = tl.zeros([BLOCK], tl.int64)
        for r in range(tl.program_id(0), n_rows, PROGRAMS):
            src = rows + tl.multiple_of(tl.load(rows + 4 * r), 2)
            dst = rows + tl.multiple_of(tl.load(rows + 4 * r + 1), 2)
            words = tl.load(rows + 4 * r + 2)
            copy = tl.load(rows + 4 * r + 3) != 0
            whole = words // BLOCK * BLOCK
            for start in range(0, whole, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                x = tl.load(src + offsets)
                if copy:
                    tl.store(dst + offsets, x)
                if SUM:
                    total += x
            offsets = whole + tl.arange(0, BLOCK)
            mask = offsets < words
            x = tl.load(src + offsets, mask=mask, other=0)
            if copy:
                tl.store(dst + offsets, x, mask=mask)
            if SUM:
                total += x
        if SUM:
            tl.atomic_add(into, tl.sum(total, axis=0))

    return copy_sum, word_sum, table_copy
