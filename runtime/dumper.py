"""The dump runtime: tensors from patched call sites to safetensors files + a manifest.

Call sites (inserted by a spec, reached through ``__sp__``)::

    x = __sp__.dump("attn_output", x, layer=self.layer_number)   # returns x unchanged
    __sp__.dump_context(phase="fwd_bwd", microbatch=0)           # ambient tags
    __sp__.dump_microbatch()                                     # end of each microbatch's forward
    __sp__.dump_step(optimizer.step())                           # after each optimizer step

Scripts and tools::

    from source_patch.runtime.dumper import configure, flush, state, close
    configure(enable=True, dir="/scratch/dumps", names=["attn_*"])
    ...
    flush()                       # everything dumped so far is on disk

Design (see docs/runtime.md):

* Disabled, ``dump()`` is one module-global flag test.
* Enabled, the caller's thread only snapshots the tensor: a CPU tensor is cloned;
  a CUDA tensor is copied device-to-host into pinned memory on a side stream
  (``non_blocking``, an event recorded behind it).  A background writer thread
  waits on the event, packs queued records into safetensors files, writes each to
  a temp file, renames it into place and only then appends the records' lines to
  ``rank-<r>/manifest.jsonl``.  The queue is bounded in bytes (``queue_bytes``);
  ``on_full`` says whether a caller then waits for room or the record is dropped.
* Nothing raises into the caller: failures are counted, the first of each kind is
  logged, and ``state()`` shows them.

This module is loaded on the first ``__sp__.dump*`` call; it reads its settings
(environment > spec ``runtime: dump:`` > defaults) at that moment.
"""

from __future__ import annotations

import atexit
import errno
import fnmatch
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from source_patch.runtime import settings

log = logging.getLogger("source_patch.dump")

# The one thing a disabled call site reads.
_enabled = False

# -- ambient state (written by the training thread; replaced, never mutated in place)
_step = 0
_context: dict = {}

# -- configuration
_config: dict = {}
_filter: "_Filter"
_config_lock = threading.RLock()

# -- queue and writer (guarded by _cond)
_cond = threading.Condition()
_queue: deque = deque()
_queued_bytes = 0  # bytes of records queued or being written (their host copies are alive)
_pending = 0       # records queued or being written
_seq = 0
_file_seq = 0
_writer: threading.Thread | None = None
_stop = False
_session = ""

_COUNTERS = ("records", "bytes", "files", "dropped", "filtered", "errors", "lost", "blocked_s")
_counts: dict = dict.fromkeys(_COUNTERS, 0)
_last_error: str | None = None
_last_error_time: float | None = None
_logged: set = set()

_rank: int | None = None          # cached once torch.distributed is initialised
_parallel: tuple | None = None    # (key, tags) of the parallel ranks last read
_side_streams: dict = {}
_pool: dict = {}                  # nbytes -> idle uint8 host buffers (CPU snapshots)
_rank_dirs: dict = {}             # rank -> its directory under the current dir/exp_name
_hurry = 0                        # threads waiting in flush() or for room: the writer skips its linger
LINGER_S = 0.05                   # the writer waits this long for more records to pack
POOLED_MIN = 128 << 10            # CPU copies at least this big use pooled buffers
_pool_bytes = 0
POOL_BYTES = 256 << 20            # idle host buffers kept for reuse, at most
_server = None                    # dump_server.ControlServer while listening
_server_key: tuple | None = None

MANIFEST = "manifest.jsonl"
FORMAT_VERSION = 1
DEFAULT_PHASE = "inference"


# ---------------------------------------------------------------- call-site API


def dump(name: str, value: Any, /, **tags) -> Any:
    """Record ``value`` under ``name`` with ``tags``; return ``value`` unchanged.

    ``value``: a tensor, a tuple/list (elements recorded as ``name.0``, ``name.1``,
    ...), a dict (``name.key``), a Python number (a 0-d tensor) or None (ignored).
    Tags are keyword arguments (any name, ``name`` and ``value`` included).
    Never raises: failures are counted in :func:`state` and logged once per kind.
    """
    if not _enabled:
        return value
    try:
        _record(name, value, tags)
    except Exception as exc:  # noqa: BLE001 - a dump must never break the caller
        _fail(f"dump({name!r})", exc)
    return value


class _Restore:
    """What :func:`dump_context` returns: usable as a context manager that restores
    the tags it changed; ignoring it keeps the change."""

    __slots__ = ("_previous",)

    def __init__(self, previous: dict):
        self._previous = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _context
        context = dict(_context)
        for key, old in self._previous.items():
            if old is _MISSING:
                context.pop(key, None)
            else:
                context[key] = old
        _context = context
        return False


_MISSING = object()


def dump_context(**tags) -> _Restore:
    """Set ambient tags merged into every record (``phase="fwd_bwd"``, ``microbatch=0``);
    a tag set to None is removed.  ``with dump_context(phase="eval"): ...`` restores
    the previous tags on exit."""
    global _context
    try:
        restore = _Restore({key: _context.get(key, _MISSING) for key in tags})
        context = dict(_context)
        for key, value in tags.items():
            if value is None:
                context.pop(key, None)
            else:
                context[key] = _tag_value(value)
        _context = context
        return restore
    except Exception as exc:  # noqa: BLE001
        _fail("dump_context", exc)
        return _Restore({})


def dump_microbatch(index: int | None = None) -> int | None:
    """Advance the ``microbatch`` tag by one and return it (0 when it was unset);
    ``index`` sets it instead.  Pair it with ``dump_context(microbatch=0)`` at the
    start of a schedule and call it at the end of each microbatch's forward."""
    global _context
    try:
        current = _context.get("microbatch")
        if index is not None:
            new = int(index)
        elif isinstance(current, int) and not isinstance(current, bool):
            new = current + 1
        else:
            new = 0
        _context = {**_context, "microbatch": new}
        return new
    except Exception as exc:  # noqa: BLE001
        _fail("dump_microbatch", exc)
        return None


def dump_step(success: Any = True, *, step: int | None = None) -> Any:
    """Advance the step counter after an optimizer step; return ``success`` unchanged.

    ``success`` may be Megatron's ``optimizer.step()`` result ``(ok, grad_norm,
    num_zeros)``: only its first element counts, so a skipped step (ok False) does
    not advance.  ``step=N`` sets the counter instead (e.g. when resuming).  A new
    step clears the microbatch tag."""
    global _step, _context
    try:
        if step is not None:
            _step = int(step)
        else:
            ok = success[0] if isinstance(success, tuple) and success else success
            if not ok:
                return success
            _step += 1
        if "microbatch" in _context:
            _context = {k: v for k, v in _context.items() if k != "microbatch"}
    except Exception as exc:  # noqa: BLE001
        _fail("dump_step", exc)
    return success


# ---------------------------------------------------------------- control API


def configure(**changes) -> dict:
    """Change settings at runtime (same keys as the ``dump`` settings schema).

    All values are validated before any is applied: KeyError names the valid keys,
    ValueError/TypeError say what is wrong.  Returns the effective configuration."""
    with _config_lock:
        parsed = {key: settings.check("dump", key, value) for key, value in changes.items()}
        _apply({**_config, **parsed})
        return public_config()


def configure_from_settings(environ=None) -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    with _config_lock:
        _apply(settings.resolve("dump", os.environ if environ is None else environ))
        return public_config()


def public_config() -> dict:
    return settings.redacted(_config)


def state() -> dict:
    """Counters and configuration (the body of ``GET /state``)."""
    with _cond:
        counts = dict(_counts)
        depth, queued = _pending, _queued_bytes
    return {
        "enabled": _enabled,
        "step": _step,
        "phase": _context.get("phase"),
        "context": dict(_context),
        "rank": _global_rank(),
        **counts,
        "blocked_s": round(counts["blocked_s"], 6),
        "last_error": _last_error,
        "last_error_time": _last_error_time,
        "queue_depth": depth,
        "queue_bytes": queued,
        "writer_alive": bool(_writer and _writer.is_alive()),
        "session": _session,
        "pid": os.getpid(),
        "exp_dir": str(Path(_config["dir"]) / _config["exp_name"]) if _config else None,
        "control": _server.url if _server is not None else None,
        "config": public_config(),
    }


def reset() -> dict:
    """Zero the counters, the last error and the step (the body of ``POST /reset``)."""
    global _step, _last_error, _last_error_time
    with _cond:
        for key in _COUNTERS:
            _counts[key] = 0
        _last_error = _last_error_time = None
        _logged.clear()
    _step = 0
    return state()


def flush(timeout: float | None = None) -> bool:
    """Wait until every record dumped so far is written (or has failed). False on timeout."""
    global _hurry
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cond:
        _hurry += 1
        _cond.notify_all()
        try:
            while _pending:
                if _queue and not (_writer and _writer.is_alive()):
                    _start_writer()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                _cond.wait(0.5 if remaining is None else min(0.5, remaining))
        finally:
            _hurry -= 1
    return True


def close(timeout: float | None = None) -> bool:
    """Flush, stop the writer thread and the control endpoint.  Dumping again later
    starts them again.  Registered with atexit."""
    global _writer, _stop
    drained = flush(timeout)
    with _cond:
        writer, _stop = _writer, True
        _cond.notify_all()
    if writer is not None and writer is not threading.current_thread():
        writer.join(timeout if timeout is not None else 30)
    with _cond:
        _writer, _stop = None, False
    _drop_pool()
    _stop_server()
    return drained


# Names under which the handle (``__sp__``) exports these (runtime/__init__.py _EXPORTS).
dump_flush = flush
dump_state = state
dump_configure = configure


# ---------------------------------------------------------------- records


def _record(name: str, value: Any, tags: dict) -> None:
    if value is None:
        return
    filt = _filter
    rank = _global_rank()
    # Outside a training schedule (no phase set by one) a forward is inference.
    record_tags = {"step": _step, "rank": rank, "phase": DEFAULT_PHASE}
    record_tags.update(_parallel_tags())
    record_tags.update(_context)
    for key, tag in tags.items():
        record_tags[key] = _tag_value(tag)
    if not filt.admits_tags(record_tags, rank):
        _count("filtered", 1 if isinstance(value, torch.Tensor) else sum(1 for _ in _leaves(name, value, 0)))
        return
    if isinstance(value, torch.Tensor):
        if filt.admits_name(name, name):
            _enqueue(name, value, record_tags, rank)
        else:
            _count("filtered")
        return
    for leaf, tensor in _leaves(name, value, 0):
        if filt.admits_name(name, leaf):
            _enqueue(leaf, tensor, record_tags, rank)
        else:
            _count("filtered")


def _leaves(name: str, value: Any, depth: int):
    if depth > 8:
        raise TypeError(f"{name}: nested more than 8 levels deep")
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if item is not None:
                yield from _leaves(f"{name}.{i}", item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if item is not None:
                yield from _leaves(f"{name}.{key}", item, depth + 1)
    elif isinstance(value, (bool, int, float)):
        yield name, torch.tensor(value)
    else:
        raise TypeError(f"cannot dump a {type(value).__name__} as {name!r} "
                        "(expected a tensor, a tuple/list/dict of tensors, a number or None)")


def _tag_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type == "cpu":
            return value.item()
        return f"<tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')} {value.device}>"
    if hasattr(value, "__index__"):
        return int(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return _tag_value(value.item())  # numpy scalars
    if isinstance(value, (list, tuple)):
        return [_tag_value(v) for v in value]
    return str(value)


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class _Item:
    __slots__ = ("seq", "name", "tags", "host", "event", "buffer", "nbytes", "rank_dir", "time")


def _enqueue(name: str, tensor: torch.Tensor, tags: dict, rank: int) -> None:
    global _queued_bytes, _pending, _seq, _hurry
    if tensor.dtype not in _ST_DTYPES:
        raise TypeError(f"dtype {tensor.dtype} cannot be stored in safetensors")
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot dump a {tensor.layout} tensor")
    if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
        tensor = tensor.to_local()  # a DTensor: this rank's shard
    nbytes = tensor.numel() * tensor.element_size()
    limit = _config["queue_bytes"]
    # Reserve room first: host memory held by queued copies stays under queue_bytes
    # (a record larger than the whole queue passes alone when the queue is empty).
    with _cond:
        if _writer is None or not _writer.is_alive():
            _start_writer()
        if _queued_bytes and _queued_bytes + nbytes > limit:
            if _config["on_full"] == "drop":
                _counts["dropped"] += 1
                return
            started = time.perf_counter()
            _hurry += 1
            _cond.notify_all()
            try:
                while _queued_bytes and _queued_bytes + nbytes > limit:
                    if not (_writer and _writer.is_alive()):
                        _start_writer()
                    _cond.wait(1.0)
            finally:
                _hurry -= 1
            _counts["blocked_s"] += time.perf_counter() - started
        _queued_bytes += nbytes
        _pending += 1
        seq = _seq
        _seq += 1
    try:
        item = _Item()
        item.seq, item.name, item.tags, item.nbytes = seq, name, tags, nbytes
        item.rank_dir = _rank_dir(rank)
        item.time = time.time()
        item.host, item.event, item.buffer = _snapshot(tensor, nbytes)
    except BaseException:
        with _cond:
            _queued_bytes -= nbytes
            _pending -= 1
            _cond.notify_all()
        raise
    with _cond:
        _queue.append(item)
        _cond.notify_all()


def _snapshot(tensor: torch.Tensor, nbytes: int):
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
        buffer = _take_buffer(nbytes)
        host = buffer.view(source.dtype).view(source.shape)
        host.copy_(source)
        return host, None, buffer
    if device == "cuda":
        return (*_cuda_snapshot(source), None)  # pinned memory: torch's caching host allocator
    if device == "meta":
        raise TypeError("cannot dump a meta tensor (it has no data)")
    return source.to("cpu", copy=True).contiguous(), None, None  # other accelerators: synchronous


def _take_buffer(nbytes: int) -> torch.Tensor:
    global _pool_bytes
    with _cond:
        idle = _pool.get(nbytes)
        if idle:
            _pool_bytes -= nbytes
            return idle.pop()
    return torch.empty(nbytes, dtype=torch.uint8)


def _give_back(buffer: torch.Tensor) -> None:
    """Keep a written record's buffer for reuse (caller holds _cond)."""
    global _pool_bytes
    nbytes = buffer.numel()
    if _enabled and nbytes and _pool_bytes + nbytes <= min(POOL_BYTES, _config["queue_bytes"]):
        _pool.setdefault(nbytes, []).append(buffer)
        _pool_bytes += nbytes


def _drop_pool() -> None:
    global _pool_bytes
    with _cond:
        _pool.clear()
        _pool_bytes = 0


def _cuda_snapshot(source: torch.Tensor):
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("dump() during CUDA graph capture is not supported (nothing recorded)")
    device = source.device
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device.index)
    if side is None:
        side = _side_streams[device.index] = torch.cuda.Stream(device=device)
    if _config["gpu_copy"] == "clone":
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


def _rank_dir(rank: int) -> Path:
    cache = _rank_dirs
    folder = cache.get(rank)
    if folder is None:
        folder = cache[rank] = Path(_config["dir"]) / _config["exp_name"] / f"rank-{rank}"
    return folder


def _global_rank() -> int:
    global _rank
    if _rank is not None:
        return _rank
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            _rank = dist.get_rank()
            return _rank
    except Exception:  # noqa: BLE001
        pass
    return 0


_MEGATRON_RANKS = (("tp", "get_tensor_model_parallel_rank"), ("pp", "get_pipeline_model_parallel_rank"),
                   ("cp", "get_context_parallel_rank"), ("ep", "get_expert_model_parallel_rank"),
                   ("dp", "get_data_parallel_rank"))
_SGLANG_RANKS = (("tp", "get_tensor_model_parallel_rank"), ("pp", "get_pipeline_model_parallel_rank"),
                 ("ep", "get_moe_expert_parallel_rank"))


def _parallel_tags() -> dict:
    """Parallel ranks from an already imported, initialised Megatron (or SGLang)
    parallel_state; never imports either."""
    global _parallel
    for module_name, getters, key_attrs in (
        ("megatron.core.parallel_state", _MEGATRON_RANKS,
         ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP")),
        ("sglang.srt.distributed.parallel_state", _SGLANG_RANKS, ("_TP", "_PP")),
    ):
        ps = sys.modules.get(module_name)
        if ps is None:
            continue
        try:
            if not ps.model_parallel_is_initialized():
                continue
        except Exception:  # noqa: BLE001
            continue
        key = (module_name,) + tuple(id(getattr(ps, attr, None)) for attr in key_attrs)
        cached = _parallel
        if cached is not None and cached[0] == key:
            return cached[1]
        tags = {}
        for tag, getter in getters:
            try:
                tags[tag] = int(getattr(ps, getter)())
            except Exception:  # noqa: BLE001 - a group that this job does not use
                pass
        _parallel = (key, tags)
        return tags
    return {}


# ---------------------------------------------------------------- filter


class _Filter:
    """The declarative selection: every given criterion must hold (no eval)."""

    def __init__(self, config: dict):
        names = config.get("names")
        self.names = re.compile("|".join(fnmatch.translate(p) for p in names)).match if names else None
        self.layers = settings.IntSet(config["layers"]) if config.get("layers") else None
        self.steps = settings.IntSet(config["steps"]) if config.get("steps") else None
        self.ranks = settings.IntSet(config["ranks"]) if config.get("ranks") else None
        self.phases = frozenset(config["phases"]) if config.get("phases") else None
        self._name_cache: dict = {}

    def admits_tags(self, tags: dict, rank: int) -> bool:
        if self.ranks is not None and rank not in self.ranks:
            return False
        if self.steps is not None and tags.get("step") not in self.steps:
            return False
        if self.layers is not None and tags.get("layer") not in self.layers:
            return False
        if self.phases is not None and tags.get("phase") not in self.phases:
            return False
        return True

    def admits_name(self, base: str, leaf: str) -> bool:
        """A pattern that matches the call site's name selects all its elements; one
        that matches an element's name (``qkv.1``) selects that element."""
        if self.names is None:
            return True
        key = (base, leaf)
        hit = self._name_cache.get(key)
        if hit is None:
            hit = bool(self.names(base) or (leaf != base and self.names(leaf)))
            if len(self._name_cache) < 4096:
                self._name_cache[key] = hit
        return hit


# ---------------------------------------------------------------- writer


def _start_writer() -> None:
    """Start the writer thread (caller holds _cond)."""
    global _writer
    _writer = threading.Thread(target=_writer_main, name="source-patch-dump-writer", daemon=True)
    _writer.start()


def _writer_main() -> None:
    global _queued_bytes, _pending
    while True:
        with _cond:
            while not _queue and not _stop:
                _cond.wait()
            if not _queue:
                return
            limit = _config.get("file_bytes", 256 << 20)
            # Linger a little so records that come in a burst share a file: fewer
            # files and syscalls, and less of this thread competing with training.
            until = time.monotonic() + LINGER_S
            while not _stop and not _hurry and _queued_bytes < limit:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                _cond.wait(remaining)
            batch, size = [], 0
            while _queue and (not batch or size + _queue[0].nbytes <= limit):
                item = _queue.popleft()
                batch.append(item)
                size += item.nbytes
            count = len(batch)
        groups: dict = {}
        try:
            for item in batch:
                groups.setdefault(item.rank_dir, []).append(item)
            for rank_dir, items in groups.items():
                _write_group(rank_dir, items)
        except BaseException as exc:  # noqa: BLE001 - the writer must survive anything
            _fail("writer", exc, lost=0)
        finally:
            with _cond:
                for item in batch:
                    if item.buffer is not None:
                        _give_back(item.buffer)
                    item.host = item.event = item.buffer = None  # release copies before making room
            del batch, groups
            with _cond:
                _queued_bytes -= size
                _pending -= count
                _cond.notify_all()


def _write_group(rank_dir: Path, items: list) -> None:
    """One safetensors file for ``items`` (all for one rank directory), then their
    manifest lines.  A failure loses these records only: counted, logged once."""
    global _file_seq
    try:
        for item in items:
            if item.event is not None:
                item.event.synchronize()  # the writer waits for the D2H copy, never the caller
        rank_dir.mkdir(parents=True, exist_ok=True)
        with _cond:
            file_seq = _file_seq
            _file_seq += 1
        file_name = f"{_session}-{file_seq:06d}.safetensors"
        entries, lines = [], []
        for item in items:
            key = f"{item.seq:08d}:{item.name}"
            entries.append((key, item.host))
            lines.append({
                "seq": item.seq, "name": item.name, "tags": item.tags, "file": file_name, "key": key,
                "shape": list(item.host.shape), "dtype": str(item.host.dtype).removeprefix("torch."),
                "bytes": item.nbytes, "time": round(item.time, 6), "session": _session,
            })
        metadata = {"format": "pt", "source_patch.dump": str(FORMAT_VERSION),
                    "records": json.dumps([{k: line[k] for k in ("seq", "name", "tags")} for line in lines])}
        path = rank_dir / file_name
        fsync = bool(_config.get("fsync"))
        _write_safetensors(path, entries, metadata, fsync)
        data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
        try:
            _append_manifest(rank_dir / MANIFEST, data, fsync)
        except BaseException:
            _remove_quietly(path)  # no file without its manifest lines
            raise
    except Exception as exc:  # noqa: BLE001
        _fail(f"writing {len(items)} record(s) to {rank_dir}", exc, lost=len(items))
        return
    with _cond:
        _counts["records"] += len(items)
        _counts["bytes"] += sum(item.nbytes for item in items)
        _counts["files"] += 1


def _write_safetensors(path: Path, entries: list, metadata: dict, fsync: bool = False) -> None:
    """Write a safetensors file atomically: a temp file in the same directory, renamed
    into place.  The tensor bytes go straight from the host copies to the file
    (safetensors' own save functions build the whole file in memory first: one more
    copy of every byte).  Readers use the safetensors library, which checks the format."""
    header: dict = {}
    offset = 0
    for key, tensor in entries:
        end = offset + tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as out:
            _write_bytes(out, struct.pack("<Q", len(blob)) + blob)
            for _, tensor in entries:
                if tensor.numel():
                    _write_bytes(out, tensor.reshape(-1).view(torch.uint8).numpy())
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def _write_bytes(out, data) -> None:
    """Every write of the dump files goes through here (tests make it fail)."""
    out.write(data)


def _append_manifest(path: Path, data: bytes, fsync: bool = False) -> None:
    """Append whole lines; on a failed or short write, cut the file back so no partial
    line is left for the next append to run into."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "short write to the manifest")
                view = view[written:]
            if fsync:
                os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------- failures


def _count(key: str, n: int = 1) -> None:
    with _cond:
        _counts[key] += n


def _fail(where: str, exc: BaseException, lost: int = 0) -> None:
    """Count a failure; log the first of each kind (where it happened, exception
    type, errno) at WARNING; keep the latest in state()['last_error']."""
    global _last_error, _last_error_time
    try:
        message = f"{where}: {type(exc).__name__}: {exc}"
        kind = (re.sub(r"'[^']*'|\d+", "", where), type(exc).__name__, getattr(exc, "errno", None))
        with _cond:
            _counts["errors"] += 1
            _counts["lost"] += lost
            _last_error, _last_error_time = message, time.time()
            first = kind not in _logged and len(_logged) < 64
            _logged.add(kind)
        if first:
            log.warning("source-patch dump: %s (training continues; later failures of this kind are "
                        "only counted: see state())", message)
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------- configuration


def _apply(config: dict) -> None:
    global _config, _filter, _enabled, _rank_dirs
    config = dict(config)
    config["dir"] = os.path.abspath(os.path.expanduser(config["dir"]))
    new_filter = _Filter(config)
    _enabled = False
    _config, _filter, _rank_dirs = config, new_filter, {}
    _enabled = bool(config["enable"])
    if not _enabled:
        _drop_pool()
    _sync_server()


def _sync_server() -> None:
    """Start, restart or stop the control endpoint to match the configuration."""
    global _server, _server_key
    key = (_config["port"], _config["host"], _config["token"])
    if key == _server_key:
        if _server is not None:
            _server.max_request_bytes = _config["max_request_bytes"]
        return
    _stop_server()
    _server_key = key
    if not _config["port"]:
        return
    try:
        from source_patch.runtime import dump_server

        _server = dump_server.start(sys.modules[__name__], _config)
    except Exception as exc:  # noqa: BLE001 - no control endpoint, dumping goes on
        _fail("starting the control endpoint", exc)


def _stop_server() -> None:
    global _server, _server_key
    server, _server, _server_key = _server, None, None
    if server is not None:
        try:
            server.stop()
        except Exception as exc:  # noqa: BLE001
            _fail("stopping the control endpoint", exc)


def _new_session() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname().split('.')[0]}-p{os.getpid()}"


def _after_fork_in_child() -> None:
    """A forked child has no writer thread, no server and its own rank: start clean."""
    global _cond, _queue, _queued_bytes, _pending, _writer, _stop, _server, _server_key
    global _rank, _parallel, _session, _side_streams, _file_seq, _pool, _pool_bytes, _hurry
    _cond = threading.Condition()
    _queue = deque()
    _queued_bytes = _pending = _file_seq = 0
    _writer, _stop = None, False
    if _server is not None:
        try:
            _server.close_socket()
        except Exception:  # noqa: BLE001
            pass
    _server = _server_key = None
    _rank = _parallel = None
    _side_streams = {}
    _pool, _pool_bytes, _hurry = {}, 0, 0
    for key in _COUNTERS:
        _counts[key] = 0
    _session = _new_session()


def _at_exit() -> None:
    """Flush while the writer makes progress; give up after 60 s without any (a hung
    filesystem must not hang the process's exit)."""
    try:
        while not flush(timeout=60):
            with _cond:
                before = _counts["records"] + _counts["lost"]
            if not flush(timeout=60):
                with _cond:
                    if _counts["records"] + _counts["lost"] == before:
                        log.warning("source-patch dump: exiting with %d record(s) not written "
                                    "(the writer made no progress for 60 s)", _pending)
                        break
        close(timeout=5)
    except Exception:  # noqa: BLE001
        pass


_session = _new_session()
configure_from_settings()
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
