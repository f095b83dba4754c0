"""The tiles device stage in one Triton kernel: every requested per-column statistic
(sum, 2-norm, inf-norm, min, max) of a contiguous ``[rows, cols]`` view in a single
pass and a single launch.

The torch path (compress.tile_columns) launches one reduction per statistic plus an
allocation: ~40 us of the training thread's time per traced tensor on an H200 host
and three passes over the tensor on the device.  This kernel reads the tensor once.
Its results equal the torch path's up to float32 summation order (it is
deterministic: no atomics, one program per column block).  NaN propagates into every
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
ELEMENTS = 4096  # per loop iteration of a program: BLOCK_R x BLOCK_C


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _column_stats(x_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  I_SUM: tl.constexpr, I_NORM: tl.constexpr, I_ABSMAX: tl.constexpr,
                  I_MIN: tl.constexpr, I_MAX: tl.constexpr):
    # One program per block of columns; it walks all rows.  I_*: the output row of a
    # statistic, or -1 when it was not asked for.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < cols
    total = tl.zeros([BLOCK_C], tl.float32)
    squares = tl.zeros([BLOCK_C], tl.float32)
    absmax = tl.zeros([BLOCK_C], tl.float32)
    low = tl.full([BLOCK_C], float("inf"), tl.float32)
    high = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r[:, None] < rows) & cmask[None, :]
        offsets = r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if I_SUM >= 0:
            total += tl.sum(x, 0)
        if I_NORM >= 0:
            squares += tl.sum(x * x, 0)
        if I_ABSMAX >= 0:
            absmax = _max_nan(absmax, tl.reduce(tl.abs(x), 0, _max_nan))
        if I_MIN >= 0:
            low = _min_nan(low, tl.reduce(tl.where(mask, x, float("inf")), 0, _min_nan))
        if I_MAX >= 0:
            high = _max_nan(high, tl.reduce(tl.where(mask, x, float("-inf")), 0, _max_nan))
    if I_SUM >= 0:
        tl.store(out_ptr + I_SUM * cols + c, total, mask=cmask)
    if I_NORM >= 0:
        tl.store(out_ptr + I_NORM * cols + c, tl.sqrt(squares), mask=cmask)
    if I_ABSMAX >= 0:
        tl.store(out_ptr + I_ABSMAX * cols + c, absmax, mask=cmask)
    if I_MIN >= 0:
        tl.store(out_ptr + I_MIN * cols + c, low, mask=cmask)
    if I_MAX >= 0:
        tl.store(out_ptr + I_MAX * cols + c, high, mask=cmask)


@functools.lru_cache(maxsize=64)
def _plan(stats: tuple, cols: int) -> tuple:
    """(grid, BLOCK_R, BLOCK_C, output row per statistic): enough column blocks to
    occupy a GPU (~128 programs for 1024 columns), ELEMENTS per loop iteration."""
    block_c = max(8, min(128, triton.next_power_of_2(max(cols // 128, 1))))
    rows_of = {"mean": -1, "rms": -1, "absmax": -1, "min": -1, "max": -1}
    for i, stat in enumerate(stats):
        rows_of[stat] = i
    return ((triton.cdiv(cols, block_c),), ELEMENTS // block_c, block_c,
            rows_of["mean"], rows_of["rms"], rows_of["absmax"], rows_of["min"], rows_of["max"])


def column_stats(x: torch.Tensor, stats: tuple) -> torch.Tensor:
    """float32 [len(stats), cols] of a contiguous CUDA tensor viewed as [rows, cols]
    (cols: its last dim): per column the sum ("mean"), 2-norm ("rms"), inf-norm
    ("absmax"), min and max, as compress.tile_columns defines them."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    grid, block_r, block_c, i_sum, i_norm, i_absmax, i_min, i_max = _plan(stats, cols)
    out = torch.empty((len(stats), cols), dtype=torch.float32, device=x.device)
    _column_stats[grid](x, out, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c, I_SUM=i_sum, I_NORM=i_norm,
                        I_ABSMAX=i_absmax, I_MIN=i_min, I_MAX=i_max)
    return out
