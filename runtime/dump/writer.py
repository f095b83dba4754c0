"""The dump's asynchronous pipeline: host snapshots in a bytes-bounded queue, written
by one background thread.

The caller's thread only snapshots a tensor: a CPU tensor is copied (into a pooled
buffer when large); a CUDA tensor is copied device-to-host into pinned memory on a
side stream (``non_blocking``, an event recorded behind it).  The writer thread waits
on the event, packs queued records into one file per rank directory and batch
(:mod:`.files`), and counts what it wrote or lost.  The queue is bounded in bytes
(``queue_bytes``); ``on_full`` says whether a caller then waits for room or the record
is dropped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import torch

from . import files
from ..core.failures import Counters

LINGER_S = 0.05                   # the writer waits this long for more records to pack
POOLED_MIN = 128 << 10            # CPU copies at least this big use pooled buffers
POOL_BYTES = 256 << 20            # idle host buffers kept for reuse, at most


class _Item:
    __slots__ = ("seq", "name", "tags", "host", "event", "buffer", "nbytes", "rank_dir", "time")


class Pipeline:
    """One per process (a forked child makes a new one)."""

    def __init__(self, counters: Counters, session: str):
        self.counters, self.session = counters, session
        self.config: dict = {}        # queue_bytes, on_full, file_bytes, fsync, drop_behind(_bytes), gpu_copy
        self.behind = files.DropBehind()
        self.keep_buffers = False     # pool written records' buffers (only while enabled)
        self.cond = threading.Condition()
        self.queue: deque = deque()
        self.queued_bytes = 0  # bytes of records queued or being written (their host copies are alive)
        self.pending = 0       # records queued or being written
        self.seq = self.file_seq = 0
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.hurry = 0         # threads waiting in flush() or for room: the writer skips its linger
        self.urgent = False    # write what is queued now (the end of a forward pass), without waiting
        self.side_streams: dict = {}
        self.pool: dict = {}   # nbytes -> idle uint8 host buffers (CPU snapshots)
        self.pool_bytes = 0
        self.first_enqueue: float | None = None  # when records started to come (the incoming rate)
        self.enqueued_bytes = 0

    # -- the caller's side

    def enqueue(self, name: str, tensor: torch.Tensor, tags: dict, rank_dir: Path) -> None:
        if tensor.dtype not in files.ST_DTYPES:
            raise TypeError(f"dtype {tensor.dtype} cannot be stored in safetensors")
        if tensor.layout != torch.strided:
            raise TypeError(f"cannot dump a {tensor.layout} tensor")
        if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
            tensor = tensor.to_local()  # a DTensor: this rank's shard
        nbytes = tensor.numel() * tensor.element_size()
        seq = self._reserve(nbytes)
        if seq is None:
            return
        try:
            item = _Item()
            item.seq, item.name, item.tags, item.nbytes = seq, name, tags, nbytes
            item.rank_dir, item.time = rank_dir, time.time()
            item.host, item.event, item.buffer = self._snapshot(tensor, nbytes)
        except BaseException:
            with self.cond:
                self.queued_bytes -= nbytes
                self.pending -= 1
                self.cond.notify_all()
            raise
        with self.cond:
            self.queue.append(item)
            self.cond.notify_all()

    def _reserve(self, nbytes: int) -> int | None:
        """Room first: host memory held by queued copies stays under queue_bytes (a
        record larger than the whole queue passes alone when the queue is empty).
        Returns the record's sequence number, or None when it is dropped."""
        limit = self.config["queue_bytes"]
        with self.cond:
            self._ensure_thread()
            if self.first_enqueue is None:
                self.first_enqueue = time.monotonic()
            self.enqueued_bytes += nbytes
            if self.queued_bytes and self.queued_bytes + nbytes > limit:
                self._behind(limit)
                if self.config["on_full"] == "drop":
                    self.counters.add("dropped")
                    return None
                self.counters.add("waits")
                started = time.perf_counter()
                self.hurry += 1
                self.cond.notify_all()
                try:
                    while self.queued_bytes and self.queued_bytes + nbytes > limit:
                        self._ensure_thread()
                        self.cond.wait(1.0)
                finally:
                    self.hurry -= 1
                self.counters.add("blocked_s", time.perf_counter() - started)
            self.queued_bytes += nbytes
            self.pending += 1
            self.seq += 1
            return self.seq - 1

    def _behind(self, limit: int) -> None:
        """(caller holds cond) The queue is full: the writer is behind the callers.  Say
        so once (until reset()), with by how much (the rates in and out); state() counts every time
        (``waits`` and ``blocked_s`` with on_full: block, ``dropped`` with drop)."""
        counts = self.counters.counts
        if counts.get("waits") or counts.get("dropped"):
            return  # said already (since the counters were last reset)
        elapsed = max(time.monotonic() - (self.first_enqueue or 0.0), 1e-9)
        written, write_s = counts.get("bytes", 0), counts.get("write_s", 0.0)
        out = f"{written / 2**30 / write_s:.2f} GiB/s while writing" if write_s else "nothing written yet"
        what = "records are dropped" if self.config["on_full"] == "drop" else "the caller waits for room"
        self.counters.log.warning(
            "source-patch dump: the writer is falling behind: %.2f GiB of %.2f GiB (queue_bytes) wait to be "
            "written, so %s (on_full: %s); records came at %.2f GiB/s, the writer wrote %s. "
            "state() counts it: waits, blocked_s, dropped, write_s", self.queued_bytes / 2**30, limit / 2**30,
            what, self.config["on_full"], self.enqueued_bytes / 2**30 / elapsed, out)

    def _snapshot(self, tensor: torch.Tensor, nbytes: int):
        """A contiguous host copy that later in-place changes of ``tensor`` cannot reach,
        the CUDA event the writer must wait on before reading it (None for CPU tensors),
        and the pooled buffer under the copy (None when not pooled)."""
        source = tensor.detach()
        device = source.device.type
        if device == "cpu":
            if nbytes < POOLED_MIN:
                return source.clone(memory_format=torch.contiguous_format), None, None
            # A reused buffer: a fresh large allocation page-faults its way in, which
            # costs as much as the copy itself (far more on some VMs).
            buffer = self._take_buffer(nbytes)
            host = buffer.view(source.dtype).view(source.shape)
            host.copy_(source)
            return host, None, buffer
        if device == "cuda":
            return (*self._cuda_snapshot(source), None)  # pinned: torch's caching host allocator
        if device == "meta":
            raise TypeError("cannot dump a meta tensor (it has no data)")
        return source.to("cpu", copy=True).contiguous(), None, None  # other accelerators: synchronous

    def _cuda_snapshot(self, source: torch.Tensor):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("dump() under CUDA graph capture outside GraphStage.capture() records nothing "
                               "(runtime/core/adapters/graph_stage.py: capture in one to dump every replay)")
        device = source.device
        current = torch.cuda.current_stream(device)
        side = self.side_streams.get(device.index)
        if side is None:
            side = self.side_streams[device.index] = torch.cuda.Stream(device=device)
        if self.config["gpu_copy"] == "clone":
            # A device-side copy, ordered on the current stream before any later kernel
            # that could overwrite the tensor in place (fast: device memory bandwidth).
            source = source.clone(memory_format=torch.contiguous_format)
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        side.wait_stream(current)  # the copy starts after the kernels that produced the tensor
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the writer sleeps on it instead of spinning
            event.record(side)
        # The caching allocator must not hand the source's memory to anyone else until
        # the side stream's copy has run, even though we drop our reference now.
        source.record_stream(side)
        return host, event

    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        with self.cond:
            idle = self.pool.get(nbytes)
            if idle:
                self.pool_bytes -= nbytes
                return idle.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give_back(self, buffer: torch.Tensor) -> None:
        """Keep a written record's buffer for reuse (caller holds cond)."""
        nbytes = buffer.numel()
        if self.keep_buffers and nbytes and \
                self.pool_bytes + nbytes <= min(POOL_BYTES, self.config["queue_bytes"]):
            self.pool.setdefault(nbytes, []).append(buffer)
            self.pool_bytes += nbytes

    def drop_pool(self) -> None:
        with self.cond:
            self.pool.clear()
            self.pool_bytes = 0

    # -- control

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is written (or has failed). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self.hurry += 1
            self.cond.notify_all()
            try:
                while self.pending:
                    if self.queue:
                        self._ensure_thread()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self.cond.wait(0.5 if remaining is None else min(0.5, remaining))
            finally:
                self.hurry -= 1
        return True

    def nudge(self) -> None:
        """Write what is queued now instead of lingering for more: a unit of work ended
        (an SGLang forward pass) and the process may be killed right after it."""
        with self.cond:
            if self.queue:
                self.urgent = True
                self.cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the writer thread (after flush); enqueueing again starts it again."""
        with self.cond:
            thread, self.stopping = self.thread, True
            self.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout if timeout is not None else 30)
        with self.cond:
            self.thread, self.stopping = None, False
        self.drop_pool()

    def state(self) -> dict:
        with self.cond:
            depth, queued = self.pending, self.queued_bytes
        return {"queue_depth": depth, "queue_bytes": queued,
                "writer_alive": bool(self.thread and self.thread.is_alive())}

    # -- the writer thread

    def _ensure_thread(self) -> None:
        """Start the writer thread unless it runs (caller holds cond)."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._main, name="source-patch-dump-writer", daemon=True)
            self.thread.start()

    def _main(self) -> None:
        while True:
            batch, size = self._next_batch()
            if batch is None:
                return
            try:
                groups: dict = {}
                for item in batch:
                    groups.setdefault(item.rank_dir, []).append(item)
                for rank_dir, items in groups.items():
                    self._write_group(rank_dir, items)
            except BaseException as exc:  # noqa: BLE001 - the writer must survive anything
                self.counters.fail("writer", exc)
            finally:
                self._release(batch, size)

    def _next_batch(self):
        with self.cond:
            while not self.queue and not self.stopping:
                self.cond.wait()
            if not self.queue:
                return None, 0
            limit = self.config.get("file_bytes", 256 << 20)
            # Linger a little so records that come in a burst share a file: fewer
            # files and syscalls, and less of this thread competing with training.
            until = time.monotonic() + LINGER_S
            while not self.stopping and not self.hurry and not self.urgent and self.queued_bytes < limit:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            self.urgent = False
            batch, size = [], 0
            while self.queue and (not batch or size + self.queue[0].nbytes <= limit):
                item = self.queue.popleft()
                batch.append(item)
                size += item.nbytes
            return batch, size

    def _release(self, batch: list, size: int) -> None:
        with self.cond:
            for item in batch:
                if item.buffer is not None:
                    self._give_back(item.buffer)
                item.host = item.event = item.buffer = None  # release copies before making room
            self.queued_bytes -= size
            self.pending -= len(batch)
            self.cond.notify_all()

    def _write_group(self, rank_dir: Path, items: list) -> None:
        """One file for ``items`` (all for one rank directory), then their manifest
        lines.  A failure loses these records only: counted, logged once."""
        try:
            for item in items:
                if item.event is not None:
                    item.event.synchronize()  # the writer waits for the D2H copy, never the caller
            rank_dir.mkdir(parents=True, exist_ok=True)
            with self.cond:
                file_seq = self.file_seq
                self.file_seq += 1
            file_name = f"{self.session}-{file_seq:06d}.safetensors"
            started = time.perf_counter()
            files.write_records(rank_dir, file_name, items, self.session, bool(self.config.get("fsync")))
            if self.config.get("drop_behind"):
                self.behind.window = self.config.get("drop_behind_bytes", 0)
                self.behind.written(rank_dir / file_name, sum(item.nbytes for item in items))
            write_s = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001
            self.counters.fail(f"writing {len(items)} record(s) to {rank_dir}", exc, lost=len(items))
            return
        with self.counters.lock:
            counts = self.counters.counts
            counts["records"] += len(items)
            counts["bytes"] += sum(item.nbytes for item in items)
            counts["files"] += 1
            counts["write_s"] += write_s
