"""Trace compressors: reduce a tensor to a small one, on the tensor's device.

``parse({"kind": "tiles", "tiles": 32})`` validates the parameters (ValueError /
TypeError with a clear message) and returns a :class:`Compressor` in two stages:

* ``reduce(tensor)`` on the tensor's device, torch ops only, on the training
  thread.  Nothing reads a value back to the host (no ``.item()``, ``.cpu()``,
  ``nonzero``, data-dependent shapes), so on a GPU it queues kernels and returns.
* ``finish(array, shape)``: numpy on the host copy, in the publisher thread.  Work
  moved here costs the training thread nothing (tiles: the per-tile combination of
  per-column results, which would be five more small kernel launches per call).

``compressor(tensor)`` runs both and returns the frame's values as a host tensor:
the same compressor applied offline to a saved tensor gives what a frame carries
(tests do exactly that).

    kind        params (defaults)                                     output
    tiles       stats [mean, absmax, rms], tiles 64, dim -1           float32 [len(stats), n_tiles]
    histogram   bins 64, range null (auto: finite min/max)            float32 [bins + 2] = lo, hi, counts
    topk        k 16, abs true                                        float64 [2, k]: values, flat positions
    projection  file, key null, dim -1, normalize true                float32: shape without `dim`
    raw         max_elements (the raw_max_elements setting)           float32, the tensor's shape

No expression strings, no pickle: a projection vector is read from a safetensors
file.

The trace forwarder process (forwarder.py) parses compressors (a client's parameters are
checked there) and runs their host stage, with numpy only: this module imports torch at
the device stage's first use (:class:`_Torch`), which only the traced process runs, so
the forwarder starts in a fraction of the time and memory torch takes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import Any, Callable

import numpy as np


class _Torch:
    """This module's ``torch`` until first used: then imported (in the traced process it
    already is), and the global is the module itself from then on, so the device stage
    pays nothing for it after its first call.  Parsing and the host stage never use it."""

    def __getattr__(self, name: str):
        global torch
        import torch as module

        torch = module
        return getattr(module, name)


torch = _Torch()

TILE_STATS = ("mean", "absmax", "rms", "min", "max")
MAX_TILES = 4096
MAX_BINS = 1 << 16
MAX_K = 1 << 16
MAX_VECTOR = 1 << 24
RAW_MAX_ELEMENTS = 1 << 16


class TooLarge(ValueError):
    """A tensor over the raw compressor's cap: not sent."""


def defaults(raw_max_elements: int = RAW_MAX_ELEMENTS) -> dict:
    """kind -> {param: default}: what the hub announces to clients."""
    return {
        "tiles": {"stats": ["mean", "absmax", "rms"], "tiles": 64, "dim": -1},
        "histogram": {"bins": 64, "range": None},
        "topk": {"k": 16, "abs": True},
        "projection": {"file": None, "key": None, "dim": -1, "normalize": True},
        "raw": {"max_elements": raw_max_elements},
    }


Finish = Callable[[np.ndarray, tuple], np.ndarray]


class Compressor:
    """A validated compressor: ``kind``, canonical ``params`` (JSON), and its stages."""

    __slots__ = ("kind", "params", "key", "_reduce", "_finish", "_into", "fused")

    def __init__(self, kind: str, params: dict, reduce: Callable[[torch.Tensor], torch.Tensor],
                 finish: Finish | None = None, into: Callable | None = None, fused: tuple | None = None):
        self.kind, self.params, self._reduce, self._finish, self._into = kind, params, reduce, finish, into
        self.fused = fused  # (stats, dim) of the fused tiles kernel: the trace runtime's planned launches
        self.key = json.dumps([kind, params], sort_keys=True)  # equal keys compute the same thing

    def reduce(self, tensor: torch.Tensor, into: Callable | None = None) -> torch.Tensor:
        """The device stage: a small tensor on ``tensor``'s device, without a sync.
        ``into(shape)``, where given, offers float32 host memory the device can write (the
        trace ring): a compressor whose kernel can write there directly returns what
        ``into`` gave (the write lands when the stream gets there); the others ignore it."""
        if tensor.numel() == 0:
            raise ValueError("empty tensor")
        if into is not None and self._into is not None:
            result = self._into(tensor, into)  # a kernel reads pointers only: nothing to detach
            if result is not None:
                return result
        if tensor.is_complex():
            raise TypeError("complex tensors are not supported")
        return self._reduce(tensor.detach())

    def finish(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        """The host stage on the reduced result's copy; ``shape``: the traced tensor's."""
        return array if self._finish is None else self._finish(array, tuple(shape))

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Both stages: the values a frame carries, as a host tensor (offline use)."""
        reduced = self.reduce(tensor).cpu()
        return reduced if self._finish is None else torch.from_numpy(self.finish(reduced.numpy(), tensor.shape))

    def spec(self) -> dict:
        return {"kind": self.kind, **self.params}

    def __repr__(self) -> str:
        return f"Compressor({self.spec()})"


def parse(spec: Any, *, raw_max_elements: int = RAW_MAX_ELEMENTS) -> Compressor:
    """A compressor from ``{"kind": ..., **params}``; missing params take defaults."""
    if not isinstance(spec, dict):
        raise TypeError(f"compressor: expected an object such as {{\"kind\": \"tiles\"}}, "
                        f"got {type(spec).__name__}")
    kind = spec.get("kind")
    table = defaults(raw_max_elements)
    if kind not in table:
        raise ValueError(f"compressor: unknown kind {kind!r} (valid: {', '.join(table)})")
    given = {k: v for k, v in spec.items() if k != "kind"}
    unknown = sorted(set(given) - set(table[kind]))
    if unknown:
        raise ValueError(f"compressor {kind}: unknown parameter{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} (valid: {', '.join(table[kind])})")
    params = {**table[kind], **given}
    return _BUILDERS[kind](params, raw_max_elements)


# ---------------------------------------------------------------- parameter checks


def _int(kind: str, name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"compressor {kind}: {name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"compressor {kind}: {name} must be in {low}..{high}, got {value}")
    return value


def _bool(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"compressor {kind}: {name} must be true or false, got {value!r}")
    return value


def _floating(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.float()


# ---------------------------------------------------------------- tiles


def _tiles(params: dict, _raw_max: int) -> Compressor:
    stats = params["stats"]
    if isinstance(stats, str):
        stats = [stats]
    if not isinstance(stats, list) or not stats or not all(isinstance(s, str) for s in stats):
        raise TypeError(f"compressor tiles: stats must be a non-empty list of {', '.join(TILE_STATS)}")
    bad = [s for s in stats if s not in TILE_STATS]
    if bad or len(set(stats)) != len(stats):
        raise ValueError(f"compressor tiles: stats must be distinct names from {', '.join(TILE_STATS)}, "
                         f"got {stats}")
    tiles = _int("tiles", "tiles", params["tiles"], 1, MAX_TILES)
    dim = _int("tiles", "dim", params["dim"], -64, 63)
    canonical = {"stats": list(stats), "tiles": tiles, "dim": dim}
    stats = tuple(stats)
    # float32 [len(stats), n]: `dim` (size D) cut into contiguous tiles of
    # ceil(D / min(tiles, D)) entries (the last may be shorter, so n = ceil(D / size) may
    # be below `tiles`); each stat over every other dim x tile.
    return Compressor("tiles", canonical, lambda x: tile_columns(x, stats, dim),
                      lambda columns, shape: tile_finish(columns, shape, stats, tiles),
                      functools.partial(_fused_columns, stats=stats, dim=dim), (stats, dim))


def _fused_columns(x: torch.Tensor, into: Callable | None, stats: tuple, dim: int):
    """The fused kernel's column statistics (fused.py), written where ``into`` says (see
    Compressor.reduce; None: device memory), or None where that kernel does not apply:
    Triton not wanted or not importable, not a contiguous floating CUDA tensor, or
    ``dim`` not its last.  The ring's hot path calls it directly, tile_columns first."""
    if x.is_cuda and x.is_floating_point() and x.is_contiguous() and USE_TRITON:
        rank = x.dim()
        if rank < 2:
            x, rank, dim = x.reshape(1, -1), 2, -1
        if dim % rank == rank - 1 and (fused := _fused()) is not None:
            return fused.column_stats(x, stats, into, DIRECT_LAUNCH)
    return None


def tile_columns(x: torch.Tensor, stats, dim: int = -1) -> torch.Tensor:
    """The device stage of tiles, float32 [len(stats), D] (or [splits, len(stats), D] from
    the fused kernel, fused.py): per stat one reduction over
    every dim but ``dim`` (sum; 2-norm; inf-norm; min; max), written in place.  Column
    first: reducing (rows, within-tile) at once ran slower on an H200, and the
    per-tile step is left to the host (docs/benchmarks.md).  Float32 accumulation, no
    float32 copy of ``x``, no copy for a ``dim`` that is not last."""
    x = _floating(x)
    fused = _fused_columns(x, None, tuple(stats), dim)  # one launch, one pass
    if fused is not None:
        return fused
    if x.dim() < 2:
        x, dim = x.reshape(1, -1), -1
    dim = dim % x.dim()
    dims = tuple(d for d in range(x.dim()) if d != dim)
    out = torch.empty((len(stats), x.shape[dim]), dtype=torch.float32, device=x.device)
    for row, stat in zip(out, stats):
        if stat == "mean":
            torch.sum(x, dims, dtype=torch.float32, out=row)
        elif stat in ("rms", "absmax"):
            torch.linalg.vector_norm(x, 2 if stat == "rms" else math.inf, dims, dtype=torch.float32, out=row)
        elif x.dtype == torch.float32:
            (torch.amin if stat == "min" else torch.amax)(x, dims, out=row)
        else:
            row.copy_(x.amin(dims) if stat == "min" else x.amax(dims))
    return out


USE_TRITON = True  # the trace setting `triton` (api.py sets it)
DIRECT_LAUNCH = True  # the trace setting `triton_launch` is not "triton" (lifecycle.py sets it; passed to fused.py)
NATIVE_LAUNCH = False  # it is "auto" or "native", tracing is on and native.py's launch is built: plan.py uses it


def fused_kernel():
    """fused.py when Triton is wanted and can be imported, else None."""
    return _fused() if USE_TRITON else None


@functools.lru_cache(maxsize=1)
def _fused():
    try:
        from . import fused
    except Exception:  # noqa: BLE001 - no Triton (or a broken one): the torch path
        return None
    return fused


def tile_finish(columns: np.ndarray, shape: tuple, stats, tiles: int) -> np.ndarray:
    """The host stage of tiles: combine the per-column results over each tile (float64).
    ``columns``: [len(stats), D], or [splits, len(stats), D] partial results over
    splits of the rows (the fused kernel), combined here first."""
    if columns.ndim == 3:
        columns = _join_splits(columns.astype(np.float64), stats)
    width = columns.shape[1]
    starts, widths = _tile_layout(width, tiles)
    count = (math.prod(shape) // width) * widths  # elements per tile
    out = np.empty((len(stats), len(starts)), dtype=np.float32)
    for i, (stat, column) in enumerate(zip(stats, columns.astype(np.float64))):
        if stat == "mean":
            out[i] = np.add.reduceat(column, starts) / count
        elif stat == "rms":
            out[i] = np.sqrt(np.add.reduceat(column * column, starts) / count)
        elif stat == "min":
            out[i] = np.minimum.reduceat(column, starts)
        else:  # absmax, max
            out[i] = np.maximum.reduceat(column, starts)
    return out


def _join_splits(parts: np.ndarray, stats) -> np.ndarray:
    """[splits, len(stats), D] partial column results -> [len(stats), D]."""
    joined = np.empty(parts.shape[1:], dtype=np.float64)
    for i, stat in enumerate(stats):
        if stat == "mean":
            joined[i] = parts[:, i].sum(0)
        elif stat == "rms":
            joined[i] = np.sqrt(np.square(parts[:, i]).sum(0))
        elif stat == "min":
            joined[i] = parts[:, i].min(0)
        else:  # absmax, max
            joined[i] = parts[:, i].max(0)
    return joined


@functools.lru_cache(maxsize=256)
def _tile_layout(width: int, tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """First column and width of each tile."""
    size = -(-width // min(tiles, width))
    starts = np.arange(0, width, size)
    return starts, np.diff(np.append(starts, width))


# ---------------------------------------------------------------- histogram


def _histogram(params: dict, _raw_max: int) -> Compressor:
    bins = _int("histogram", "bins", params["bins"], 1, MAX_BINS)
    span = params["range"]
    if span is not None:
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in span)):
            raise TypeError(f"compressor histogram: range must be null or [lo, hi], got {span!r}")
        lo, hi = float(span[0]), float(span[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"compressor histogram: range must be finite with lo < hi, got {span!r}")
        span = [lo, hi]
    return Compressor("histogram", {"bins": bins, "range": span}, lambda x: histogram(x, bins, span))


def histogram(x: torch.Tensor, bins: int, span=None) -> torch.Tensor:
    """float32 [bins + 2]: lo, hi, then the count of each of ``bins`` equal bins over
    [lo, hi] (the last bin includes hi, as numpy.histogram).  Without ``span``, lo and
    hi are the finite min and max, computed on the device; values outside [lo, hi]
    and non-finite values are not counted."""
    x = _floating(x).reshape(-1).double()  # float64: bins and bounds as numpy places them
    if span is None:
        finite = torch.isfinite(x)
        lo = torch.where(finite, x, math.inf).amin()
        hi = torch.where(finite, x, -math.inf).amax()
        scale = bins / torch.where(hi > lo, hi - lo, 1.0)
    else:
        # Python numbers, not host tensors: a host-to-device copy would wait for the GPU.
        lo = torch.full((), span[0], dtype=torch.float64, device=x.device)
        hi = torch.full((), span[1], dtype=torch.float64, device=x.device)
        scale = bins / (span[1] - span[0])
    inside = (x >= lo) & (x <= hi)
    # Outside values (NaN, inf) get position 0 and weight 0: a NaN cast to an index
    # would be out of bounds (on a GPU, a device-side assert).
    index = torch.where(inside, (x - lo) * scale, 0.0).floor_().clamp_(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, index, inside.long())
    return torch.cat([torch.stack([lo, hi]), counts.double()]).float()


# ---------------------------------------------------------------- topk


def _topk(params: dict, _raw_max: int) -> Compressor:
    k = _int("topk", "k", params["k"], 1, MAX_K)
    by_abs = _bool("topk", "abs", params["abs"])
    return Compressor("topk", {"k": k, "abs": by_abs}, lambda x: top_k(x, k, by_abs))


def top_k(x: torch.Tensor, k: int, by_abs: bool = True) -> torch.Tensor:
    """float64 [2, min(k, numel)]: row 0 the largest values (by magnitude when
    ``by_abs``; signed either way), row 1 their positions in the flattened tensor."""
    flat = _floating(x).reshape(-1)
    k = min(k, flat.numel())
    key = flat.abs() if by_abs else flat
    index = torch.topk(key, k, sorted=True).indices
    return torch.stack([flat[index].double(), index.double()])


# ---------------------------------------------------------------- projection


def _projection(params: dict, _raw_max: int) -> Compressor:
    path, key = params["file"], params["key"]
    if not isinstance(path, str) or not path.endswith(".safetensors"):
        raise ValueError(f"compressor projection: file must be the path of a .safetensors file, got {path!r}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"compressor projection: key must be a string or null, got {key!r}")
    dim = _int("projection", "dim", params["dim"], -64, 63)
    normalize = _bool("projection", "normalize", params["normalize"])
    vector, key = load_vector(path, key, normalize)
    canonical = {"file": path, "key": key, "dim": dim, "normalize": normalize}
    on_device: dict = {}

    def project(x: torch.Tensor) -> torch.Tensor:
        nonlocal vector
        v = on_device.get(x.device)
        if v is None:
            if isinstance(vector, np.ndarray):  # read where torch was not imported (see load_vector)
                vector = _pinned(torch.from_numpy(vector))
            v = on_device[x.device] = vector.to(x.device, non_blocking=True)
        width = x.shape[dim]
        if width != v.numel():
            raise ValueError(f"projection: vector {key!r} has {v.numel()} elements, "
                             f"the tensor's dim {dim} has {width} (shape {list(x.shape)})")
        return torch.matmul(x.movedim(dim, -1).float(), v)

    return Compressor("projection", canonical, project)


def load_vector(path: str, key: str | None, normalize: bool) -> tuple[Any, str]:
    """A 1-D float32 vector from a safetensors file (safetensors reads no code): a torch
    tensor, pinned when CUDA is there so its one copy to each device is asynchronous; in
    a process without torch (the forwarder, which only checks it) a numpy array, which
    the device stage makes a tensor of at its first use."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"compressor projection: no such file {path!r}")
    with_torch = "torch" in sys.modules
    try:
        with safe_open(path, framework="pt" if with_torch else "numpy") as f:
            keys = list(f.keys())
            if key is None:
                if len(keys) != 1:
                    raise ValueError(f"compressor projection: {path} holds {len(keys)} tensors; "
                                     f"name one with key (keys: {', '.join(keys[:20])})")
                key = keys[0]
            if key not in keys:
                raise ValueError(f"compressor projection: no tensor {key!r} in {path} "
                                 f"(keys: {', '.join(keys[:20])})")
            sliced = f.get_slice(key)
            shape = sliced.get_shape()
            if len(shape) != 1 or not 0 < shape[0] <= MAX_VECTOR:
                raise ValueError(f"compressor projection: {key!r} must be a 1-D vector of at most "
                                 f"{MAX_VECTOR} elements, got shape {shape}")
            if with_torch:
                vector = f.get_tensor(key).float()
            else:
                vector = _numpy_vector(f, path, key, sliced.get_dtype())
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad file is a bad parameter
        raise ValueError(f"compressor projection: cannot read {path}: {type(exc).__name__}: {exc}") from None
    if normalize:
        norm = float(vector.norm()) if with_torch else float(np.linalg.norm(vector))
        if not math.isfinite(norm) or norm == 0:
            raise ValueError(f"compressor projection: {key!r} has norm {norm}; cannot normalize")
        vector = vector / (norm if with_torch else np.float32(norm))
    return (_pinned(vector) if with_torch else vector), key


def _pinned(vector):
    """``vector`` in page-locked memory where CUDA is there."""
    return vector.pin_memory() if torch.cuda.is_available() else vector


def _numpy_vector(f, path: str, key: str, dtype: str) -> np.ndarray:
    """The float32 values of a vector without torch (the forwarder's check of the
    parameters): numpy reads most dtypes; bfloat16 and the 8-bit floats, which it has
    not, are widened from their bits."""
    if dtype not in _WIDENED:
        return f.get_tensor(key).astype(np.float32)
    with open(path, "rb") as file:  # the format: u64 header size, the JSON header, the data (safe_open checked it)
        size = int.from_bytes(file.read(8), "little")
        begin, end = json.loads(file.read(size))[key]["data_offsets"]
        file.seek(8 + size + begin)
        raw = file.read(end - begin)
    return _WIDENED[dtype](raw)


def _e4m3_values() -> np.ndarray:
    """float32 of each float8 e4m3fn byte (no infinities; S.1111.111 is NaN)."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    values = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where((exponent == 15) & (mantissa == 7), np.nan, values)
    return np.where(bits >> 7, -values, values).astype(np.float32)


_WIDENED = {
    "BF16": lambda raw: (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4"),  # a float32's upper half
    "F8_E5M2": lambda raw: (np.frombuffer(raw, "u1").astype("<u2") << 8).view("<f2").astype("<f4"),  # a float16's
    "F8_E4M3": lambda raw: _e4m3_values()[np.frombuffer(raw, "u1")],
}


# ---------------------------------------------------------------- raw


def _raw(params: dict, raw_max: int) -> Compressor:
    cap = _int("raw", "max_elements", params["max_elements"], 1, raw_max)

    def raw(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > cap:
            raise TooLarge(f"raw: tensor of {x.numel()} elements (shape {list(x.shape)}) is over "
                           f"max_elements {cap}; not sent")
        return x.to(torch.float32, copy=True)

    return Compressor("raw", {"max_elements": cap}, raw)


_BUILDERS = {"tiles": _tiles, "histogram": _histogram, "topk": _topk, "projection": _projection, "raw": _raw}
