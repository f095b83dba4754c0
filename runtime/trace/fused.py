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

Launches after the first of each input layout skip Triton's JIT dispatch
(``JITFunction.run``: argument binding, a cache key that formats the compile
options as a string, global checks): the grid, the arguments and the output shape of
a layout are worked out once (``_Launch``), and the compiled kernel Triton picked for
that layout's first launch is launched again through its own launcher, the one
``JITFunction.run`` ends in.  A layout is the input's shape, dtype, device and
16-byte alignment with the statistics asked for, so every argument Triton
specialises on (pointer alignment, integers equal to 1 or divisible by 16) is the
same at each launch of it.  Triton's dispatch is kept while a launch hook (a
profiler) is set, with the trace setting ``triton_launch: triton``, and for a Triton
whose compiled kernels lack the launcher's attributes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ring import Slice

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


class _Launch:
    """The fused kernel's launch for one input layout: grid, arguments and result
    shape, worked out once; once Triton launched it, ``compiled``: ``(call, before,
    middle, after)``, its launch as ``call(*before, stream, *middle, x address, output
    address, *after)`` (``_launcher``), and ``kernel``: Triton's compiled kernel (native.py
    reads its parameters), whose handle is ``function``."""

    __slots__ = ("grid", "args", "shape", "compiled", "kernel")

    def __init__(self, x: torch.Tensor, stats: tuple):
        cols = x.shape[-1]
        rows = x.numel() // cols
        block_c = min(128, triton.next_power_of_2(cols))
        block_r = ELEMENTS // block_c
        col_blocks = triton.cdiv(cols, block_c)
        # Split the rows so that enough programs run to use the whole GPU.
        splits = max(1, min(MAX_SPLITS, -(-PROGRAMS // col_blocks), -(-rows // block_r)))
        per_split = -(-rows // (splits * block_r)) * block_r
        splits = -(-rows // per_split)
        rows_of = dict.fromkeys(STATS, -1)  # each statistic's output row, -1: not asked for
        rows_of.update((stat, i) for i, stat in enumerate(stats))
        self.grid = (col_blocks, splits)
        self.args = (rows, cols, per_split, len(stats), block_r, block_c, *(rows_of[s] for s in STATS))
        self.shape = (splits, len(stats), cols)
        self.compiled = self.kernel = None

    @property
    def function(self):
        return None if self.kernel is None else self.kernel.function


_launches: dict = {}  # (shape, dtype, device, 16-byte aligned, stats) -> _Launch
_direct_ok = True    # false once this Triton's launcher refused our arguments: its dispatch from then on
MAX_LAUNCHES = 4096   # layouts remembered (forgotten all at once beyond: a bound, not an LRU)
_hooks = triton.knobs.runtime if hasattr(triton, "knobs") else None
# (absent from a CPU build of torch, where only Triton's interpreter runs this module)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def column_stats(x: torch.Tensor, stats: tuple, into=None, direct: bool = True):
    """float32 [splits, len(stats), cols] of a contiguous CUDA tensor viewed as [rows,
    cols] (cols: its last dim): per column and split of the rows, the sum ("mean"),
    2-norm ("rms"), inf-norm ("absmax"), min and max.  The rows are split (at most
    MAX_SPLITS ways) so that enough programs run to use the whole GPU; the host stage
    (compress.tile_finish) combines the splits, off the training thread.  ``into(shape)``:
    host memory mapped for the device to write the result into, 16-byte aligned: a
    tensor, or a ring.Slice (launched at its device address where the ring knows it),
    which is then what is returned; None there or no ``into``: device memory.
    ``direct``: launch the compiled kernel directly (the trace setting ``triton_launch``),
    else through Triton's dispatch."""
    global _direct_ok
    address, device = x.data_ptr(), x.get_device()
    key = (x.shape, x.dtype, device, address & 15 == 0, stats)
    launch = _launches.get(key)
    if launch is None:
        if len(_launches) >= MAX_LAUNCHES:
            _launches.clear()
        launch = _launches[key] = _Launch(x, stats)
    out = into(launch.shape) if into is not None else None
    if out is None:
        out = torch.empty(launch.shape, dtype=torch.float32, device=x.device)
    compiled = launch.compiled
    if compiled is not None and direct and _direct_ok and _no_hooks() and _current_device() == device:
        call, before, middle, after = compiled
        target = out.device_address or out if type(out) is Slice else out  # a ring slice: its device address
        try:
            call(*before, _current_raw_stream(device), *middle, address, target, *after)
            return out
        except TypeError:  # a launcher that takes other arguments (refused before launching): Triton's dispatch
            _launches.clear()
            _direct_ok = False
    kernel = _column_stats[launch.grid](x, out.tensor() if type(out) is Slice else out, *launch.args, num_warps=8)
    if compiled is None and kernel is not None and _current_device() == device:
        launch.compiled = _launcher(kernel, launch)  # None under Triton's interpreter (kernel None)
    return out


def planned(x: torch.Tensor, stats: tuple, dim: int) -> "_Launch | None":
    """The launch of ``x``'s layout once Triton has compiled it and direct launches are
    allowed (the trace runtime then launches it itself, without this module's call
    frames: api._fast), else None.  ``x`` as column_stats takes it: contiguous,
    floating, on CUDA, ``dim`` its last and at least 2-D."""
    rank = x.dim()
    if rank < 2 or dim % rank != rank - 1 or not (x.is_cuda and x.is_floating_point() and x.is_contiguous()):
        return None
    launch = _launches.get((x.shape, x.dtype, x.get_device(), x.data_ptr() & 15 == 0, stats))
    return launch if launch is not None and launch.compiled is not None and _direct_ok else None


def _launcher(kernel, launch: _Launch) -> tuple | None:
    """``launch``'s ``(call, before, middle, after)`` (see _Launch) for the compiled
    ``kernel``, or None for a Triton whose compiled kernels differ (its own dispatch
    only).  ``call`` is the launcher's C launch itself where its Python ``__call__``
    only passes arguments through (no scratch memory to allocate per launch): what the
    ``__call__`` hands it is recorded once, with stand-ins for the three arguments that
    change between launches, and replayed; else ``call`` is that ``__call__``."""
    try:
        kernel._init_handles()
        run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    except AttributeError:
        return None
    launch.kernel = kernel
    through = (run, (*launch.grid, 1), (function, metadata, None, None, None), launch.args)
    c_launch = getattr(run, "launch", None)
    if c_launch is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
            or getattr(run, "gsan_enabled", False):
        return through
    stream, x, out, seen = object(), object(), object(), []
    run.launch = lambda *arguments: seen.append(arguments)
    try:
        run(*through[1], stream, *through[2], x, out, *launch.args)
    except Exception:  # noqa: BLE001 - a __call__ that uses the arguments: it stays in the path
        return through
    finally:
        run.launch = c_launch
    passed = seen[0] if len(seen) == 1 else ()
    at = [i for i, value in enumerate(passed) if value is stream]
    at_x = [i for i, value in enumerate(passed) if value is x]
    if len(at) != 1 or len(at_x) != 1 or at_x[0] < at[0] or passed[at_x[0] + 1: at_x[0] + 2] != (out,) \
            or passed[at_x[0] + 2:] != launch.args:
        return through  # another shape of call (this Triton nests the kernel's arguments)
    return c_launch, passed[: at[0]], passed[at[0] + 1: at_x[0]], launch.args


def _no_hooks() -> bool:
    """No launch hook is set (a profiler's would want Triton's launch metadata)."""
    if _hooks is None:
        return False
    enter, leave = _hooks.launch_enter_hook, _hooks.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)
