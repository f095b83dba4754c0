"""An engine's copy of an update and its per-bucket checksums in one pass over the
bytes (a Triton kernel): the copy reads every word anyway, so the sum costs no second
read.  Separately (copy, then ``torch.sum`` per bucket) the checksums took the
colocated ipc receive from 91.6% of a raw device-to-device copy to 58.9% (4 GiB, two
H100; docs/bench-notes/weight_sync.md).

The sum is wire.bucket_sum's: the bucket's int64 words added modulo 2**64 (exact,
so the order of the additions does not matter: per block, then atomically per bucket).
"""

from __future__ import annotations

import functools

import torch

MAX_BLOCK = 4096  # int64 words a program copies (32 KiB)
MIN_BLOCK = 128


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
            and source.data_ptr() % 8 == 0 and dst.data_ptr() % 8 == 0 and _kernel() is not None)


def copy_and_sum(source: torch.Tensor, dst: torch.Tensor, bucket_bytes: int, sums: torch.Tensor) -> None:
    """dst[:] = source[:n] (uint8, n = dst.numel(), a multiple of 8) and, per bucket of
    ``bucket_bytes``, the int64 word sum into ``sums`` (zeroed here)."""
    kernel, block = _kernel(), block_for(bucket_bytes)
    words = dst.numel() // 8
    sums.zero_()
    if words:
        grid = (-(-words // block),)
        kernel[grid](source.view(torch.int64), dst.view(torch.int64), sums, words, bucket_bytes // 8, BLOCK=block)


@functools.lru_cache(maxsize=1)
def _kernel():
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

    return copy_sum
