"""The tiles device stage in one Triton kernel: every requested per-column statistic
(sum, 2-norm, inf-norm, min, max) of a contiguous ``[rows, cols]`` view in a single
pass and a single launch.

The torch path (compress.tile_columns) launches one reduction per statistic plus an
allocation: ~40 us of the training thread's time per traced tensor on an H200 host
and three passes over the tensor on the device.  This kernel reads the tensor once.
Its results equal the torch path's up to float32 summation order (it is
deterministic: no atomics; each program writes its own partial result, which the
host stage combines).  NaN propagates into every
statistic, as with torch.

Used by compress.tile_columns for CUDA tensors when Triton is importable and the
tiled dim is the last of a contiguous tensor; anything else takes the torch path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

STATS = ("mean", "rms", "absmax", "min", "max")
ELEMENTS = 2048    # per loop iteration of a program: BLOCK_R x BLOCK_C (x5 accumulators in registers)
PROGRAMS = 256     # aimed at: about two per SM of an H100 / H200
MAX_SPLITS = 16    # partial results per column: the host combines at most this many


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _column_stats(x_ptr, out_ptr, rows, cols, rows_per_split, K: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, I_SUM: tl.constexpr, I_NORM: tl.constexpr, I_ABSMAX: tl.constexpr,
                  I_MIN: tl.constexpr, I_MAX: tl.constexpr):
    # Program (column block, row split) reduces its rows of its columns and writes one
    # partial [K, cols] slice.  I_*: a statistic's output row, -1 when not asked for.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < cols
    first = tl.program_id(1) * rows_per_split
    last = tl.minimum(first + rows_per_split, rows)
    # Element-wise accumulators over the loop; one reduction across rows at the end
    # (a cross-thread reduction per iteration made the loop latency-bound).
    total = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    squares = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    absmax = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    low = tl.full([BLOCK_R, BLOCK_C], float("inf"), tl.float32)
    high = tl.full([BLOCK_R, BLOCK_C], float("-inf"), tl.float32)
    for r0 in range(first, last, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r[:, None] < last) & cmask[None, :]
        offsets = r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if I_SUM >= 0:
            total += x
        if I_NORM >= 0:
            squares += x * x
        if I_ABSMAX >= 0:
            absmax = _max_nan(absmax, tl.abs(x))
        if I_MIN >= 0:
            low = _min_nan(low, tl.where(mask, x, float("inf")))
        if I_MAX >= 0:
            high = _max_nan(high, tl.where(mask, x, float("-inf")))
    out = out_ptr + tl.program_id(1) * K * cols + c
    if I_SUM >= 0:
        tl.store(out + I_SUM * cols, tl.sum(total, 0), mask=cmask)
    if I_NORM >= 0:
        tl.store(out + I_NORM * cols, tl.sqrt(tl.sum(squares, 0)), mask=cmask)
    if I_ABSMAX >= 0:
        tl.store(out + I_ABSMAX * cols, tl.reduce(absmax, 0, _max_nan), mask=cmask)
    if I_MIN >= 0:
        tl.store(out + I_MIN * cols, tl.reduce(low, 0, _min_nan), mask=cmask)
    if I_MAX >= 0:
        tl.store(out + I_MAX * cols, tl.reduce(high, 0, _max_nan), mask=cmask)


@functools.lru_cache(maxsize=64)
def _plan(stats: tuple, cols: int) -> tuple:
    """(BLOCK_R, BLOCK_C, column blocks, output row per statistic).  Wide column blocks
    keep each row's load contiguous (coalesced); ELEMENTS per loop iteration."""
    block_c = min(128, triton.next_power_of_2(cols))
    rows_of = dict.fromkeys(STATS, -1)
    for i, stat in enumerate(stats):
        rows_of[stat] = i
    return (ELEMENTS // block_c, block_c, triton.cdiv(cols, block_c),
            rows_of["mean"], rows_of["rms"], rows_of["absmax"], rows_of["min"], rows_of["max"])


def column_stats(x: torch.Tensor, stats: tuple, into=None) -> torch.Tensor:
    """float32 [splits, len(stats), cols] of a contiguous CUDA tensor viewed as [rows,
    cols] (cols: its last dim): per column and split of the rows, the sum ("mean"),
    2-norm ("rms"), inf-norm ("absmax"), min and max.  The rows are split (at most
    MAX_SPLITS ways) so that enough programs run to use the whole GPU; the host stage
    (compress.tile_finish) combines the splits, off the training thread.  ``into(shape)``:
    host memory mapped for the device to write the result into (None: device memory)."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    block_r, block_c, col_blocks, *rows_of = _plan(stats, cols)
    splits = max(1, min(MAX_SPLITS, -(-PROGRAMS // col_blocks), -(-rows // block_r)))
    per_split = -(-rows // (splits * block_r)) * block_r
    splits = -(-rows // per_split)
    shape = (splits, len(stats), cols)
    out = into(shape) if into is not None else None
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    _column_stats[(col_blocks, splits)](x, out, rows, cols, per_split, len(stats), block_r, block_c, *rows_of,
                                        num_warps=8)
    return out
