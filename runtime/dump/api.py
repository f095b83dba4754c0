"""The dump runtime's public side: call sites, control, records and their filter.

Call sites (inserted by a spec, reached through ``__sp__``)::

    x = __sp__.dump("attn_output", x, layer=self.layer_number)   # returns x unchanged
    __sp__.dump_context(phase="fwd_bwd", microbatch=0)           # ambient tags
    __sp__.dump_microbatch()                                     # end of each microbatch's forward
    __sp__.dump_step(optimizer.step())                           # after each optimizer step

Scripts and tools::

    import source_patch.runtime.dump as dump
    dump.configure(enable=True, dir="/scratch/dumps", names=["attn_*"])
    ...
    dump.flush()                  # everything dumped so far is on disk

Design (see docs/dumps.md): disabled, ``dump()`` is one module-global flag test.
Enabled, the caller's thread tags the record, applies the declarative filter and
hands a host snapshot to the pipeline (:mod:`.writer`), which writes safetensors
files and a manifest (:mod:`.files`) from a background thread.  Nothing raises into
the caller: failures are counted, the first of each kind is logged, and ``state()``
shows them.  Under CUDA graphs (core/graph_stage.py) a call site being captured stages
a copy in the graph, and the drain after every replay writes it as an eager call
would, tagged ``cuda_graph``; a Megatron graph's warm-up passes record nothing.

This module is loaded on the first ``__sp__.dump*`` call; it reads its settings
(environment > spec ``runtime: dump:`` > defaults) at that moment.

It is dump's ground floor: it owns the capability's state (the ``on`` flag, step,
configuration, filter, counters, pipeline, control endpoint), and the rest of dump/
reaches it through public names only.  sglang.py imports it (the call sites, the
control API, ``on``, ``fail``, ``nudge``, ``rank_dir``); server.py, which this module
starts, is handed ``state``, ``reset``, ``configure`` and ``fail`` (``server.Actions``).
"""

from __future__ import annotations

import atexit
import fnmatch
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..core import graph_stage, ranks, settings, tags as ambient
from ..core.failures import Counters
from .writer import Pipeline

SETTINGS = "dump"  # its settings component (the capability contract: core/capability.py)

# The one thing a disabled call site reads (here and in sglang.py): whether dumping is on.
# Written only by _apply (configure).
on = False
_step = 0

_config: dict = {}
_filter: "_Filter"
_config_lock = threading.RLock()
_rank_dirs: dict = {}             # rank -> its directory under the current dir/exp_name

_COUNTERS = ("records", "bytes", "files", "dropped", "filtered", "errors", "lost", "blocked_s", "waits", "write_s")
_counters = Counters(_COUNTERS, "source_patch.dump", "dump")
_pipeline: Pipeline
_server = None                    # server.ControlServer while listening
_server_key: tuple | None = None

DEFAULT_PHASE = "inference"


# ---------------------------------------------------------------- call-site API


def dump(name: str, value: Any, /, **tags) -> Any:
    """Record ``value`` under ``name`` with ``tags``; return ``value`` unchanged.

    ``value``: a tensor, a tuple/list (elements recorded as ``name.0``, ``name.1``,
    ...), a dict (``name.key``), a Python number (a 0-d tensor) or None (ignored).
    Tags are keyword arguments (any name, ``name`` and ``value`` included).
    Never raises: failures are counted in :func:`state` and logged once per kind.
    """
    if not on:
        return value
    try:
        if not (graph_stage.busy and _in_graph(name, value, tags)):
            _record(name, value, tags)
    except Exception as exc:  # noqa: BLE001 - a dump must never break the caller
        _counters.fail(f"dump({name!r})", exc)
    return value


def dump_context(**tags) -> ambient.Restore:
    """Set ambient tags merged into every record (``phase="fwd_bwd"``, ``microbatch=0``);
    a tag set to None is removed.  ``with dump_context(phase="eval"): ...`` restores
    the previous tags on exit."""
    try:
        return ambient.set_context(**tags)
    except Exception as exc:  # noqa: BLE001
        _counters.fail("dump_context", exc)
        return ambient.Restore({})


def dump_microbatch(index: int | None = None) -> int | None:
    """Advance the ``microbatch`` tag by one and return it (0 when it was unset);
    ``index`` sets it instead.  Pair it with ``dump_context(microbatch=0)`` at the
    start of a schedule and call it at the end of each microbatch's forward."""
    try:
        return ambient.next_microbatch(index)
    except Exception as exc:  # noqa: BLE001
        _counters.fail("dump_microbatch", exc)
        return None


def dump_step(success: Any = True, *, step: int | None = None) -> Any:
    """Advance the step counter after an optimizer step; return ``success`` unchanged.

    ``success`` may be Megatron's ``optimizer.step()`` result ``(ok, grad_norm,
    num_zeros)``: only its first element counts, so a skipped step (ok False) does
    not advance.  ``step=N`` sets the counter instead (e.g. when resuming).  A new
    step clears the microbatch tag."""
    global _step
    try:
        if step is not None:
            _step = int(step)
        else:
            ok = success[0] if isinstance(success, tuple) and success else success
            if not ok:
                return success
            _step += 1
        ambient.end_step()
    except Exception as exc:  # noqa: BLE001
        _counters.fail("dump_step", exc)
    return success


# ---------------------------------------------------------------- control API


def enabled() -> bool:
    return on


def configure(**changes) -> dict:
    """Change settings at runtime (same keys as the ``dump`` settings schema).

    All values are validated before any is applied: KeyError names the valid keys,
    ValueError/TypeError say what is wrong.  Returns the effective configuration."""
    with _config_lock:
        parsed = settings.check_all("dump", changes)
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
    counts = _counters.snapshot()
    context = ambient.context()
    return {
        "enabled": on,
        "step": _step,
        "phase": context.get("phase"),
        "context": dict(context),
        "rank": ranks.global_rank(),
        **counts,
        "blocked_s": round(counts["blocked_s"], 6),
        "counters": {**counts, "blocked_s": round(counts["blocked_s"], 6)},
        "last_error": _counters.last_error,
        "last_error_time": _counters.last_error_time,
        **_pipeline.state(),
        "session": _pipeline.session,
        "pid": os.getpid(),
        "exp_dir": str(Path(_config["dir"]) / _config["exp_name"]) if _config else None,
        "control": _server.url if _server is not None else None,
        "config": public_config(),
    }


def reset() -> dict:
    """Zero the counters, the last error and the step (the body of ``POST /reset``)."""
    global _step
    _counters.reset()
    _step = 0
    return state()


def flush(timeout: float | None = None) -> bool:
    """Wait until every record dumped so far is written (or has failed). False on timeout."""
    return _pipeline.flush(timeout)


def close(timeout: float | None = None) -> bool:
    """Flush, stop the writer thread and the control endpoint.  Dumping again later
    starts them again.  Registered with atexit."""
    drained = flush(timeout)
    _pipeline.stop(timeout)
    _stop_server()
    return drained


# Names under which the handle (``__sp__``) exports these (runtime/facade.py).
dump_flush = flush
dump_state = state
dump_configure = configure


# ---------------------------------------------------------------- for the other modules of dump/
# (sglang.py reads these and ``on``, rank_dir below; server.py is handed state, reset,
# configure and fail when this module starts it: nothing reads this module's private names)


def fail(where: str, exc: BaseException) -> None:
    """Count a failure (``errors``, ``last_error``) and log the first of its kind."""
    _counters.fail(where, exc)


def nudge() -> None:
    """Write what is queued now, not after the writer's linger."""
    _pipeline.nudge()


# ---------------------------------------------------------------- records


def _record(name: str, value: Any, tags: dict, leaf: str | None = None) -> None:
    """``leaf``: the name of ``value`` (a tensor) where it is one element of ``name``'s value."""
    if value is None:
        return
    filt = _filter
    rank = ranks.global_rank()
    # Outside a training schedule (no phase set by one) a forward is inference.
    record_tags = {"step": _step, "rank": rank, "phase": DEFAULT_PHASE}
    record_tags.update(ranks.parallel_tags())
    record_tags.update(ambient.context())
    for key, tag in tags.items():
        record_tags[key] = ambient.tag_value(tag)
    if not filt.admits_tags(record_tags, rank):
        _counters.add("filtered", 1 if isinstance(value, torch.Tensor) else sum(1 for _ in _leaves(name, value, 0)))
        return
    leaves = ((leaf or name, value),) if isinstance(value, torch.Tensor) else _leaves(name, value, 0)
    for leaf, tensor in leaves:
        if filt.admits_name(name, leaf):
            _pipeline.enqueue(leaf, tensor, record_tags, rank_dir(rank))
        else:
            _counters.add("filtered")


# ---------------------------------------------------------------- under CUDA graphs


def _in_graph(name: str, value: Any, tags: dict) -> bool:
    """(a graph is being built or captured somewhere: core/graph_stage.py) True when this
    call must record nothing now: a Megatron graph's warm-up pass, or a capture, where
    each leaf is staged in the graph and written by the drain after every replay."""
    if graph_stage.warming_up():
        return True
    if not graph_stage.capturing():
        return False
    leaves = () if value is None else ((name, value),) if isinstance(value, torch.Tensor) \
        else _leaves(name, value, 0)
    for leaf, tensor in leaves:
        if not graph_stage.stage(_drained, (name, leaf), tensor, tags=tags):
            raise TypeError(f"{leaf}: a {tensor.device.type} value under CUDA graph capture is not dumped "
                            "(a replay would not compute it again)")
    return True


def _drained(key: tuple, tensor: torch.Tensor, *, cuda_graph: bool, replay: int, tags: dict, **drain_tags) -> None:
    """A replayed graph's staged leaf: the record an eager call would write now (step,
    phase, microbatch as they are now; the filter as configured now), tagged cuda_graph."""
    if not on:
        return
    name, leaf = key
    _record(name, tensor, {**tags, **drain_tags, "cuda_graph": cuda_graph}, leaf)


# a Megatron graph built while dumping was off is replayed: its call sites are not dumped
_unstaged = graph_stage.reported_once("dumping", fail)


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


def rank_dir(rank: int) -> Path:
    """``rank``'s folder under the configured ``dir``/``exp_name`` (created by the writer)."""
    folder = _rank_dirs.get(rank)
    if folder is None:
        name = _config["rank_dir"].replace("{rank}", str(rank))
        folder = _rank_dirs[rank] = Path(_config["dir"]) / _config["exp_name"] / name
    return folder


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


# ---------------------------------------------------------------- configuration and lifecycle


def _apply(config: dict) -> None:
    global _config, _filter, on, _rank_dirs
    config = dict(config)
    config["dir"] = os.path.abspath(os.path.expanduser(config["dir"]))
    new_filter = _Filter(config)
    on = False
    _config, _filter, _rank_dirs = config, new_filter, {}
    _pipeline.config = config
    on = _pipeline.keep_buffers = bool(config["enable"])
    graph_stage.use("dump", _unstaged, on=on)  # Megatron's own graphs stage for us while on
    if not on:
        _pipeline.drop_pool()
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
        from . import server

        _server = server.start(server.Actions(state=state, reset=reset, configure=configure, fail=fail), _config)
    except Exception as exc:  # noqa: BLE001 - no control endpoint, dumping goes on
        _counters.fail("starting the control endpoint", exc)


def _stop_server() -> None:
    global _server, _server_key
    server, _server, _server_key = _server, None, None
    if server is not None:
        try:
            server.stop()
        except Exception as exc:  # noqa: BLE001
            _counters.fail("stopping the control endpoint", exc)


def _new_session() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname().split('.')[0]}-p{os.getpid()}"


def _new_pipeline() -> Pipeline:
    pipeline = Pipeline(_counters, _new_session())
    pipeline.config, pipeline.keep_buffers = _config, on
    return pipeline


def _after_fork_in_child() -> None:
    """A forked child has no writer thread, no server and its own rank: start clean."""
    global _pipeline, _server, _server_key, _counters
    if _server is not None:
        try:
            _server.close_socket()
        except Exception:  # noqa: BLE001
            pass
    _server = _server_key = None
    ranks.forget()
    _counters = Counters(_COUNTERS, "source_patch.dump", "dump")
    _pipeline = _new_pipeline()


def _at_exit() -> None:
    """Flush while the writer makes progress; give up after 60 s without any (a hung
    filesystem must not hang the process's exit)."""
    try:
        while not flush(timeout=60):
            before = _counters.counts["records"] + _counters.counts["lost"]
            if not flush(timeout=60):
                if _counters.counts["records"] + _counters.counts["lost"] == before:
                    _counters.log.warning("source-patch dump: exiting with %d record(s) not written "
                                          "(the writer made no progress for 60 s)", _pipeline.pending)
                    break
        close(timeout=5)
    except Exception:  # noqa: BLE001
        pass


_pipeline = _new_pipeline()
configure_from_settings()
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
