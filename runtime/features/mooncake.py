"""The Mooncake backend of the feature store: one Mooncake object per tensor, keyed
``ref.key(name)`` = ``{store}/{sample}/g{generation}/{name}``, plus one 40-byte
marker ``{store}/{sample}/gen`` holding the sample's current generation and a digest
of its tensors' names, dtypes and shapes.  A Mooncake object is raw bytes, so the
digest is what refuses a ref naming another dtype or shape of the same byte count
(as the dir backend refuses it from its header); it is read in the get's one round
trip, with the data.

Facts it is built on (the design notes, "Mooncake store facts",
re-checked with mooncake-transfer-engine-non-cuda 0.3.13.post1):

* an object lives in the memory segment it was allocated in, and goes when the
  client that mounted that segment closes.  Puts ask for the producer's own segment
  (``preferred_segment``); that is a preference: once it is full the master places
  objects in another client's segment (measured), so consumers should mount none
  (``segment_mb=0``), or a trainer's restart could take features with it;
* without a hard pin the master silently evicts old objects once a segment is 90 %
  full; a feature not yet trained must never vanish, so puts are hard-pinned
  (``hard_pin=True``) and a full segment is a put error (rc -200), not data loss;
* ``put_from`` to an existing key keeps the old value, so everything is upserted;
* a get leaves a lease (10 s by default) on the object, during which a plain remove
  fails (-706); removes are forced, and retried with backoff if a lease still holds;
* a missing key reads as -704; a buffer smaller than the object as -600.

Buffers.  The transfer engine reads and writes only memory registered with it (on
RDMA that is mandatory and costly: pinning pages; on TCP it is a bookkeeping entry,
measured at 2-30 us for 64 MiB).  Two paths, chosen per tensor by size:

* large tensors (>= ``direct_kb``, 1 MiB by default) are registered in place, the
  source tensor on put and the freshly allocated output on get, for the one call,
  then unregistered: no staging copy of the bulk of the bytes (a 64 MiB memcpy costs
  ~10-20 ms here against ~50 ms for the loopback transfer), and registration is
  paid once per large tensor, which ``stats()["register_seconds"]`` shows apart
  from ``transfer_seconds``.  Where registration is refused (e.g. two names
  aliasing one memory range: overlapping regions are rejected) the tensor is staged;
* small tensors and the generation marker go through one staging buffer per call,
  taken from a pool of registered host buffers sized by powers of two (64 KiB up),
  each registered once when first made and reused (kept up to ``pool_mb``; pinned
  memory is not needed for CPU tensors).  One batched transfer moves all of a
  sample's objects and its marker, so many small tensors cost one round trip
  instead of one each, and their registration cost is nil in steady state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import torch

from ..core.endpoint import free_port
from .base import FeatureStore, StoreError, byte_view, next_generation, stale

OK, NO_SPACE, INVALID, NOT_FOUND, LEASE_HELD = 0, -200, -600, -704, -706
ALIGN = 64
MIN_POOLED = 64 << 10
GENERATION_BYTES, DIGEST_BYTES = 8, 32
MARKER_BYTES = GENERATION_BYTES + DIGEST_BYTES  # fits the staging buffer's first ALIGN bytes


def marker_bytes(ref) -> bytes:
    """The marker of ``ref``: its generation, then a digest of each tensor's name,
    dtype and shape (sorted by name: a ref's order does not matter)."""
    metas = sorted([m.name, m.dtype, list(m.shape)] for m in ref.tensors)
    digest = hashlib.sha256(json.dumps(metas, separators=(",", ":")).encode()).digest()
    return ref.generation.to_bytes(GENERATION_BYTES, "little") + digest


def missing(key: str) -> StoreError:
    return StoreError(f"missing object {key}: released, or its producer's client closed "
                      f"(objects live in the contributing client's segment)")


class BufferPool:
    """Registered host buffers by power-of-two size, registered once and reused."""

    def __init__(self, client, cap_bytes: int, add):
        self.client, self.cap, self.add = client, cap_bytes, add
        self.free: dict[int, list] = {}
        self.kept = 0  # bytes of the free buffers
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = max(MIN_POOLED, 1 << (max(nbytes, 1) - 1).bit_length())
        with self.lock:
            if self.free.get(size):
                self.kept -= size
                return self.free[size].pop()
        buf = torch.empty(size, dtype=torch.uint8)
        rc = register(self.client, buf.data_ptr(), size, self.add)
        if rc != OK:
            raise StoreError(f"register_buffer of a {size}-byte pool buffer failed rc={rc}")
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            if self.kept + buf.numel() <= self.cap:
                self.free.setdefault(buf.numel(), []).append(buf)
                self.kept += buf.numel()
                return
        self.client.unregister_buffer(buf.data_ptr())

    def close(self) -> None:
        with self.lock:
            buffers = [b for bucket in self.free.values() for b in bucket]
            self.free.clear()
            self.kept = 0
        for buf in buffers:
            self.client.unregister_buffer(buf.data_ptr())


def register(client, ptr: int, nbytes: int, add) -> int:
    start = time.perf_counter()
    rc = client.register_buffer(ptr, nbytes)
    add(register_seconds=time.perf_counter() - start, registrations=1)
    return rc


class Transfer:
    """One call's buffers: a staging buffer from the pool (the marker slot at offset 0,
    then the staged tensors) and the tensors registered in place."""

    def __init__(self, store: "MooncakeStore", metas, tensors: dict):
        self.store, self.pool = store, store.pool
        self.extra, self.registered = [], []
        self.slots = []  # (meta, ptr, staged view or None)
        threshold = store.direct_bytes
        staged = [m for m in metas if m.nbytes and m.nbytes < threshold]
        size, offsets = ALIGN, {}
        for meta in staged:
            offsets[meta.name] = size
            size += -(-meta.nbytes // ALIGN) * ALIGN
        self.staging = self.pool.take(size)
        self.marker_ptr = self.staging.data_ptr()
        try:
            for meta in metas:
                if not meta.nbytes:
                    continue
                tensor = tensors[meta.name]
                if meta.name in offsets:
                    view = self.staging[offsets[meta.name]:offsets[meta.name] + meta.nbytes]
                elif register(store.client, tensor.data_ptr(), meta.nbytes, store._add) == OK:
                    self.registered.append(tensor.data_ptr())
                    self.slots.append((meta, tensor.data_ptr(), None))
                    continue
                else:  # refused (an aliasing range): stage it in a buffer of its own
                    buf = self.pool.take(meta.nbytes)
                    self.extra.append(buf)
                    view = buf[:meta.nbytes]
                self.slots.append((meta, view.data_ptr(), view))
        except BaseException:
            self.done()
            raise

    def marker(self) -> torch.Tensor:
        return self.staging[:MARKER_BYTES]

    def done(self) -> None:
        for ptr in self.registered:
            self.store.client.unregister_buffer(ptr)
        self.registered = []
        for buf in [self.staging, *self.extra]:
            self.pool.give(buf)
        self.extra = []


class MooncakeStore(FeatureStore):
    """A Mooncake client (one per process and store is plenty; it is thread-safe).

    ``segment_mb``: the memory this client contributes, which holds the objects it
    puts (0 for a consumer that never puts); ``buffer_mb``: the client's own transfer
    buffer (used by the raw byte-object ``put``/``get``, not by this class);
    ``pool_mb``: registered staging buffers kept for reuse; ``direct_kb``: tensors of
    at least this size are registered in place instead of staged; ``hard_pin``: keep
    the master from evicting unreleased features (a full segment fails the put).
    """

    def __init__(self, master_addr: str, store: str = "features", segment_mb: int = 512, buffer_mb: int = 64,
                 pool_mb: int = 256, direct_kb: int = 1024, local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp", device_name: str = "",
                 hard_pin: bool = True):
        super().__init__(store)
        if min(segment_mb, buffer_mb, pool_mb, direct_kb) < 0:
            raise ValueError("segment_mb, buffer_mb, pool_mb and direct_kb must be >= 0")
        # The address the transfer engine advertises outside P2P-handshake mode; it binds
        # nothing: Mooncake's client listens on every interface whatever it is given
        # (docs/features.md, "Listeners").
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise StoreError(f"the Mooncake feature store needs the mooncake-transfer-engine package: {exc}") from exc
        self.master_addr = master_addr
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(local_hostname, metadata_server, segment_mb << 20, buffer_mb << 20,
                               protocol, device_name, master_addr)
        if rc != OK:
            raise StoreError(f"Mooncake setup against master {master_addr} failed rc={rc} "
                             f"(is mooncake_master running there? local hostname {local_hostname}, "
                             f"metadata {metadata_server}, protocol {protocol})")
        self.config = ReplicateConfig()
        self.config.with_hard_pin = bool(hard_pin)
        if segment_mb:
            self.config.preferred_segment = self.client.get_hostname()
        self.direct_bytes = direct_kb << 10
        self.pool = BufferPool(self.client, pool_mb << 20, self._add)

    def marker_key(self, sample_id: str) -> str:
        return f"{self.name}/{sample_id}/gen"

    # -- put ---------------------------------------------------------------------
    def _put(self, sample_id, items):
        metas = [meta for meta, _ in items]
        tensors = {meta.name: tensor for meta, tensor in items}
        marker_key = self.marker_key(sample_id)
        transfer = Transfer(self, metas, tensors)
        keys = []
        try:
            current = self._read_marker(marker_key, transfer.staging)
            generation = next_generation(current)
            ref = self._make_ref(sample_id, generation, items)
            start = time.perf_counter()
            for meta, _, view in transfer.slots:
                if view is not None:
                    view.copy_(byte_view(tensors[meta.name]))
            self._add(copy_seconds=time.perf_counter() - start)
            keys = [ref.key(meta.name) for meta, _, _ in transfer.slots]
            if keys:
                start = time.perf_counter()
                rcs = self.client.batch_upsert_from(keys, [p for _, p, _ in transfer.slots],
                                                    [m.nbytes for m, _, _ in transfer.slots], self.config)
                self._add(transfer_seconds=time.perf_counter() - start)
                for key, meta, rc in zip(keys, metas_of(transfer), rcs):
                    if rc != OK:
                        raise StoreError(f"put of {key} ({meta.nbytes} bytes) failed rc={rc}{hint(rc)}")
                if len(rcs) != len(keys):
                    raise StoreError(f"put of sample {sample_id}: {len(rcs)} results for {len(keys)} objects")
            transfer.marker().copy_(torch.frombuffer(bytearray(marker_bytes(ref)), dtype=torch.uint8))
            rc = self.client.upsert_from(marker_key, transfer.marker_ptr, MARKER_BYTES, self.config)
            if rc != OK:
                raise StoreError(f"put of {marker_key} (the generation marker) failed rc={rc}{hint(rc)}")
        except BaseException:
            if keys:
                self.client.batch_remove(keys, True)  # best effort: the put failed anyway
            raise
        finally:
            transfer.done()
        if current is not None:  # the previous generation's objects: its ref is stale now
            prefix = f"{self.name}/{sample_id}/g{current}/".replace(".", "\\.")
            rc = self.client.remove_by_regex("^" + prefix, True)
            if rc < 0:
                self._add(cleanup_errors=1)
                warnings.warn(f"feature store: removing generation {current} of sample {sample_id} "
                              f"failed rc={rc}; its objects stay until their client closes", stacklevel=3)
        return ref

    def _read_marker(self, key: str, buf: torch.Tensor) -> int | None:
        """The generation in marker ``key`` (None: no marker), read through ``buf``
        (registered, at least 8 bytes)."""
        rc = self.client.get_into(key, buf.data_ptr(), MARKER_BYTES)
        if rc == NOT_FOUND:
            return None
        if rc != MARKER_BYTES:
            raise StoreError(f"reading {key} (the generation marker) failed rc={rc}, expected {MARKER_BYTES} bytes")
        return int.from_bytes(bytes(buf[:GENERATION_BYTES].numpy()), "little")

    # -- get ---------------------------------------------------------------------
    def _get(self, ref, out):
        marker_key = self.marker_key(ref.sample_id)
        transfer = Transfer(self, ref.tensors, out)
        try:
            keys = [marker_key] + [ref.key(meta.name) for meta, _, _ in transfer.slots]
            ptrs = [transfer.marker_ptr] + [p for _, p, _ in transfer.slots]
            sizes = [MARKER_BYTES] + [m.nbytes for m, _, _ in transfer.slots]
            start = time.perf_counter()
            rcs = self.client.batch_get_into(keys, ptrs, sizes)
            self._add(transfer_seconds=time.perf_counter() - start)
            if len(rcs) != len(keys):
                raise StoreError(f"get of sample {ref.sample_id}: {len(rcs)} results for {len(keys)} objects")
            if rcs[0] == NOT_FOUND:
                raise missing(marker_key)
            if rcs[0] != MARKER_BYTES:
                raise StoreError(f"reading {marker_key} (the generation marker) failed rc={rcs[0]}, "
                                 f"expected {MARKER_BYTES} bytes")
            marker = bytes(transfer.marker().numpy())
            current = int.from_bytes(marker[:GENERATION_BYTES], "little")
            if current != ref.generation:
                raise stale(ref, current)
            if marker != marker_bytes(ref):
                raise StoreError(f"sample {ref.sample_id} generation {ref.generation} holds other tensors than "
                                 f"the ref names (another name, dtype or shape): refused, as its bytes would "
                                 f"be read reinterpreted")
            for key, meta, rc in zip(keys[1:], metas_of(transfer), rcs[1:]):
                if rc == NOT_FOUND:
                    raise missing(key)
                if rc == INVALID:
                    raise StoreError(f"get of {key} failed rc={rc} (invalid parameters: the object is "
                                     f"larger than the ref's {meta.nbytes} bytes?)")
                if rc < 0:
                    raise StoreError(f"get of {key} failed rc={rc}, expected {meta.nbytes} bytes")
                if rc != meta.nbytes:
                    raise StoreError(f"short read of {key}: rc={rc}, expected {meta.nbytes} bytes")
            start = time.perf_counter()
            for meta, _, view in transfer.slots:
                if view is not None:
                    byte_view(out[meta.name]).copy_(view)
            self._add(copy_seconds=time.perf_counter() - start)
        finally:
            transfer.done()

    # -- release -------------------------------------------------------------------
    def _release(self, ref):
        self._remove([ref.key(m.name) for m in ref.tensors if m.nbytes])
        marker_key = self.marker_key(ref.sample_id)
        buf = self.pool.take(MARKER_BYTES)
        try:
            current = self._read_marker(marker_key, buf)
        finally:
            self.pool.give(buf)
        if current == ref.generation:  # a stale ref must not take the newer generation's marker
            self._remove([marker_key])

    def _remove(self, keys: list, attempts: int = 5, delay: float = 0.02) -> None:
        """Force-remove ``keys``; absent ones count as removed (idempotent); a held
        lease is retried with backoff, then reported."""
        for attempt in range(attempts):
            if not keys:
                return
            rcs = self.client.batch_remove(keys, True)
            failed = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (OK, NOT_FOUND, LEASE_HELD)]
            if failed:
                raise StoreError(f"release: removing {failed[0][0]} failed rc={failed[0][1]}"
                                 + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
            keys = [k for k, rc in zip(keys, rcs) if rc == LEASE_HELD]
            if keys and attempt + 1 < attempts:
                self._add(release_retries=1)
                time.sleep(delay * 2 ** attempt)
        if keys:
            raise StoreError(f"release: {len(keys)} object(s) still lease-held after {attempts} tries "
                             f"(rc={LEASE_HELD}), e.g. {keys[0]}; they were not removed")

    def _close(self):
        try:
            self.pool.close()
        finally:
            self.client.close()


def metas_of(transfer: Transfer) -> list:
    return [meta for meta, _, _ in transfer.slots]


def hint(rc: int) -> str:
    if rc == NO_SPACE:
        return (" (no space: the segments are full of unreleased samples; release trained refs "
                "or give the producer a larger segment_mb)")
    return ""


@contextlib.contextmanager
def master(log: str | os.PathLike | None = None, timeout: float = 20.0, metadata_port: int | None = None):
    """A ``mooncake_master`` (the one installed next to this Python) on 127.0.0.1 for
    the block: yields its ``host:port``; SIGTERM on exit.  Ready once its metrics
    endpoint answers ``/health``.  With ``metadata_port`` it also serves TransferEngines'
    metadata there (``http://127.0.0.1:PORT/metadata``, the weight-sync mooncake backend)."""
    binary = Path(sys.executable).parent / "mooncake_master"
    if not binary.is_absolute() or not binary.exists():  # an embedded Python's empty sys.executable: never ./
        raise StoreError(f"no mooncake_master next to {sys.executable}: "
                         f"pip install mooncake-transfer-engine-non-cuda")
    rpc, metrics = free_port(), free_port()
    metadata = ["--enable_http_metadata_server=true", f"--http_metadata_server_port={metadata_port}"] \
        if metadata_port else []
    with open(log or os.devnull, "wb") as out:
        # every listener on loopback (the HTTP metadata server's too)
        proc = subprocess.Popen([str(binary), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                                 "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
                                 "--http_metadata_server_host=127.0.0.1", *metadata],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, metrics, timeout, log)
            yield f"127.0.0.1:{rpc}"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc, port: int, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise StoreError(f"mooncake_master did not answer /health within {timeout:.0f} s "
                             f"(exit {proc.poll()}; log: {log or 'not kept'})")
        time.sleep(0.05)
