"""The feature store's interface, shared by its backends (store.py's SharedDirStore,
mooncake.py's MooncakeStore): argument and ref checks, output allocation, counters,
generations.  Its own module so that neither backend imports the other."""

from __future__ import annotations

import re
import threading
import time

import torch

from .ref import MAX_DIMS, MAX_TENSOR_BYTES, MAX_TENSORS, FeatureRef, RefError, check_id, meta_of


STAT_KEYS = ("puts", "gets", "releases", "bytes_put", "bytes_got", "put_seconds", "get_seconds",
             "transfer_seconds", "register_seconds", "copy_seconds", "registrations",
             "release_retries", "cleanup_errors")


class StoreError(RuntimeError):
    """A store operation failed: I/O, a short read, a missing object, a full segment."""


def next_generation(current: int | None) -> int:
    """Strictly above ``current``, and at least the wall clock in microseconds, so a
    sample re-put after its release (marker gone) never reuses an old generation."""
    return max((current or 0) + 1, time.time_ns() // 1000)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (0-dim tensors too)."""
    return tensor.reshape(-1).view(torch.uint8)


def stale(ref: FeatureRef, current: int) -> RefError:
    if current > ref.generation:
        return RefError(f"stale ref: sample {ref.sample_id} generation {ref.generation}, current {current}")
    return RefError(f"ref of sample {ref.sample_id} names generation {ref.generation}, "
                    f"but the store's current generation is {current} (a ref from another store?)")


class FeatureStore:
    """A store of samples' tensors.  Subclasses implement ``_put``, ``_get``,
    ``_release`` and ``_close``; this class checks arguments and refs, allocates the
    outputs, and keeps the counters.  Safe to share between threads."""

    def __init__(self, store: str = "features"):
        self.name = check_id(store, "store name")
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._closed = False

    # -- the API -------------------------------------------------------------------
    def put(self, sample_id: str, tensors: dict) -> FeatureRef:
        """Store ``tensors`` (CPU; non-contiguous ones are copied) as ``sample_id``'s
        features; a re-put replaces them under a new generation."""
        self._check_open()
        check_id(sample_id, "sample_id")
        if not isinstance(tensors, dict) or not 0 < len(tensors) <= MAX_TENSORS:
            raise ValueError(f"tensors must be a dict of 1 to {MAX_TENSORS} named tensors")
        items = []
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor {str(name)[:80]!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if tensor.device.type != "cpu" or tensor.layout != torch.strided:
                raise ValueError(f"tensor {str(name)[:80]!r} must be a dense CPU tensor, "
                                 f"got {tensor.layout} on {tensor.device}")
            meta = meta_of(name, tensor)
            if len(meta.shape) > MAX_DIMS or meta.nbytes > MAX_TENSOR_BYTES:
                raise RefError(f"tensor {name!r}: at most {MAX_DIMS} dimensions and "
                               f"{MAX_TENSOR_BYTES >> 30} GiB per tensor")
            items.append((meta, tensor.detach().contiguous()))
        start = time.perf_counter()
        ref = self._put(sample_id, items)
        self._add(puts=1, bytes_put=ref.nbytes, put_seconds=time.perf_counter() - start)
        return ref

    def get(self, ref: FeatureRef, out: dict | None = None) -> dict:
        """The tensors of ``ref``, read straight into tensors allocated from the ref's
        meta, or into ``out[name]`` where given (contiguous CPU tensors of the ref's
        shape and dtype, e.g. reused across samples: no page faults on fresh memory).
        RefError: a stale or foreign ref; StoreError: missing objects, short reads."""
        self._check_open()
        self._check_ref(ref)
        start = time.perf_counter()
        out = {m.name: _target(m, (out or {}).get(m.name)) for m in ref.tensors}
        self._get(ref, out)
        self._add(gets=1, bytes_got=ref.nbytes, get_seconds=time.perf_counter() - start)
        return out

    def release(self, ref: FeatureRef) -> None:
        """Remove the objects of ``ref``.  Idempotent; a failure is a StoreError."""
        self._check_open()
        self._check_ref(ref)
        self._release(ref)
        self._add(releases=1)

    def close(self) -> None:
        """Idempotent.  For Mooncake, the objects this client put go with it."""
        if not self._closed:
            self._closed = True
            self._close()

    def stats(self) -> dict:
        """Counters: puts, gets, releases, bytes_put, bytes_got, put_seconds,
        get_seconds, transfer_seconds (moving bytes), register_seconds (registering
        memory with the transfer engine), copy_seconds (staging copies), ..."""
        with self._lock:
            return dict(self._stats, store=self.name, backend=type(self).__name__)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- for subclasses ------------------------------------------------------------
    def _put(self, sample_id: str, items: list) -> FeatureRef:
        raise NotImplementedError

    def _get(self, ref: FeatureRef, out: dict) -> None:
        raise NotImplementedError

    def _release(self, ref: FeatureRef) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    def _add(self, **counts) -> None:
        with self._lock:
            for key, value in counts.items():
                self._stats[key] += value

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"feature store {self.name!r} is closed")

    def _check_ref(self, ref) -> None:
        if not isinstance(ref, FeatureRef):
            raise RefError(f"expected a FeatureRef, got {type(ref).__name__} (FeatureRef.from_json reads JSON)")
        if ref.store != self.name:
            raise RefError(f"ref of store {ref.store!r} given to store {self.name!r}")

    def _make_ref(self, sample_id: str, generation: int, items: list) -> FeatureRef:
        ref = FeatureRef(self.name, sample_id, generation, tuple(meta for meta, _ in items))
        return FeatureRef.from_json(ref.to_json())  # what a reader will accept, checked now


def _target(meta, given):
    """Where one tensor of a ref is read to: ``given``, checked, or a new tensor."""
    dtype = torch_dtype(meta.dtype)
    if given is None:
        return torch.empty(meta.shape, dtype=dtype)
    if (not isinstance(given, torch.Tensor) or tuple(given.shape) != meta.shape or given.dtype != dtype
            or given.device.type != "cpu" or not given.is_contiguous()):
        raise ValueError(f"out[{meta.name!r}] must be a contiguous CPU tensor of shape {list(meta.shape)} "
                         f"and dtype {meta.dtype}")
    return given
