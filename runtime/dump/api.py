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

Design (see docs/dump.md): disabled, ``dump()`` is one module-global flag test.
Enabled, the caller's thread tags the record, applies the declarative filter and
hands a host snapshot to the pipeline (:mod:`.writer`), which writes safetensors
files and a manifest (:mod:`.files`) from a background thread.  Nothing raises into
the caller: failures are counted, the first of each kind is logged, and ``state()``
shows them.  Under CUDA graphs (core/adapters/graph_stage.py) a call site being captured stages
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
import time
from pathlib import Path
from typing import Any

import torch

from ..core import ranks, rows as batch_rows, settings, tags as ambient, watch
from ..core.adapters import graph_stage
from ..core.control import Control
from ..core.failures import Counters
from .writer import Pipeline

SETTINGS = "dump"  # its settings component (the capability contract: core/capability.py)

# The one thing a disabled call site reads (here and in sglang.py): whether dumping is on.
# Written only by _apply (configure).
on = False
# What dump() tests first: dumping on, or a watcher's hook set (core/watch.py, e.g. the
# sentinels' non-finite fold): with neither, a call site costs this one flag test.
_gate = False
_paused = False  # pause(): a forward pass outside a prefill's requests (sglang.py)
_rows_cut = None  # cut_rows(): a prefill's pass shared with other requests, its requests' rows (sglang.py)
_step = 0

_config: dict = {}
_filter: "_Filter"
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
    A watcher's ``core.watch.tensor_hook`` sees every call, dumping on or off.
    """
    if not _gate:
        return value
    hook = watch.tensor_hook
    if hook is not None:
        hook(name, value, tags.get("layer"))  # never raises (core/watch.py)
    capture = watch.capture
    if capture is not None:
        try:
            _capture(capture, name, value, tags)
        except Exception as exc:  # noqa: BLE001
            _counters.fail(f"capture({name!r})", exc)
    if not on or _paused:
        return value
    try:
        if not (graph_stage.busy and _in_graph(name, value, tags)):
            if batch_rows.version and (batch_rows.version != _rows_seen[0] or ambient.context() is not _rows_seen[1]
                                       or _step != _rows_seen[2]):
                _write_rows(value)
            _record(name, value, tags)
    except Exception as exc:  # noqa: BLE001 - a dump must never break the caller
        _counters.fail(f"dump({name!r})", exc)
    return value


def dump_context(**tags) -> ambient.Restore:
    """Set ambient tags merged into every record (``phase="fwd_bwd"``, ``microbatch=0``);
    a tag set to None is removed.  ``with dump_context(phase="eval"): ...`` restores
    the previous tags on exit."""
    try:
        if tags.get("microbatch") == 0:  # a schedule starts: counted micro-batches start again
            batch_rows.schedule_begin()
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
        batch_rows.step_end()
    except Exception as exc:  # noqa: BLE001
        _counters.fail("dump_step", exc)
    return success


# ---------------------------------------------------------------- control API


def enabled() -> bool:
    return on


def _counts() -> dict:
    counts = _counters.snapshot()
    return {**counts, "blocked_s": round(counts["blocked_s"], 6)}


def _details() -> dict:
    """dump's own keys of state() (the body of ``GET /state``)."""
    context = ambient.context()
    return {"step": _step, "phase": context.get("phase"), "context": dict(context), "rank": ranks.global_rank(),
            "last_error_time": _counters.last_error_time, **_pipeline.state(), "session": _pipeline.session,
            "pid": os.getpid(), "control": _server.url if _server is not None else None,
            "exp_dir": str(Path(_config["dir"]) / _config["exp_name"]) if _config else None}


def _clear() -> None:
    """reset() (``POST /reset``): the counters, the last error and the step."""
    global _step, _rows_seen, _rows_written
    _counters.reset()
    _step = 0
    _rows_seen, _rows_written = (0, None, None), None


def _stop(timeout: float | None) -> bool:
    """close(), after the drain: the writer thread and the control endpoint; dumping
    again later starts them again."""
    _pipeline.stop(timeout)
    _stop_server()
    return True


_control = Control(SETTINGS, apply=lambda config: _apply(config), enabled=enabled, counters=_counts,
                   last_error=lambda: _counters.last_error, details=_details, clear=_clear,
                   drain=lambda timeout: _pipeline.flush(timeout), stop=_stop)
configure, configure_from_settings, state, reset, flush, close = _control.surface()
public_config = _control.public_config


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
    """``leaf``: the name of ``value`` (a tensor) where it is one element of ``name``'s value.

    The filter decides first, on the name (cached per name), the rank, and the step,
    layer and phase the record would be tagged with; only a record it keeps gets its tag
    dict built and its tensors handed to the pipeline.  A call it filters out cost 3-4.5
    us when the tags were built first, 0.7-0.9 us now (the 2-core VM, 2026-12-07; the
    host-bound model makes 51 such calls a step: issue 59)."""
    if value is None:
        return
    filt = _filter
    if isinstance(value, torch.Tensor):
        leaves = ((leaf or name, value),)
        if filt.names is not None and not filt.admits_name(name, leaves[0][0]):
            _counters.add("filtered")
            return
    else:
        leaves = list(_leaves(name, value, 0))
        if filt.names is not None:
            kept = [(element, tensor) for element, tensor in leaves if filt.admits_name(name, element)]
            if len(kept) != len(leaves):
                _counters.add("filtered", len(leaves) - len(kept))
            if not kept:
                return
            leaves = kept
    if not filt.admits(tags):
        _counters.add("filtered", len(leaves))
        return
    rank = ranks.global_rank()
    record_tags = _record_tags(tags, rank)
    folder = rank_dir(rank)
    for element, tensor in leaves:
        _pipeline.enqueue(element, tensor if _rows_cut is None else _cut(tensor), record_tags, folder)


def _record_tags(tags: dict, rank: int) -> dict:
    """A kept record's tags: the defaults, the parallel ranks, the ambient tags, the
    call's own (each later one wins; ``_Filter.admits`` reads step, layer and phase in
    the same order)."""
    # Outside a training schedule (no phase set by one) a forward is inference.
    record_tags = {"step": _step, "rank": rank, "phase": DEFAULT_PHASE}
    record_tags.update(ranks.parallel_tags())
    record_tags.update(ambient.context())
    for key, tag in tags.items():
        record_tags[key] = ambient.tag_value(tag)
    return record_tags


def _tag(key: str, tags: dict, context: dict, default: Any) -> Any:
    """The value ``key`` would have in ``_record_tags``: the call's own tag, else the
    ambient one, else ``default`` (the parallel ranks never carry step, layer or phase)."""
    if key not in tags:
        return context.get(key, default)
    value = tags[key]
    return value if type(value) is int or type(value) is str else ambient.tag_value(value)


# ---------------------------------------------------------------- the micro-batch's row map (core/rows.py)

# (rows version, ambient context, step) at the last look: while none changes, no dump call
# looks again (an int compare, an identity test: the ambient context is replaced, never
# mutated).  _rows_written: (Rows, step, phase, microbatch) whose row map went out last.
_rows_seen: tuple = (0, None, None)
_rows_written: tuple | None = None
ROW_NAMES = ("row_request", "positions", "input_ids")


def _write_rows(value: Any) -> None:
    """The first dump call of a micro-batch whose Rows (``source_patch.batch``) has no row
    map written yet: ``row_request`` (tag ``rids``), ``positions`` and ``input_ids`` of this
    rank's part, tagged as the call's records are.  The rank, step and phase criteria of
    the filter apply; names and layers do not (compare needs the map of every record)."""
    global _rows_seen, _rows_written
    context = ambient.context()
    _rows_seen = (batch_rows.version, context, _step)
    microbatch = context.get("microbatch")
    rows = batch_rows.current(context.get("phase"), microbatch if type(microbatch) is int else None)
    if rows is None:
        return
    key = (rows, _step, context.get("phase"), microbatch)
    if key == _rows_written:
        return
    _rows_written = key
    sp = rows.sequence_parallel
    if sp is None and rows.tp_size > 1:  # the first tensor of the micro-batch says how long its part is
        first = next((t for _, t in _leaves("", value, 0) if t.dim() >= 1), None) if value is not None else None
        sp = rows.infer_sequence_parallel(int(first.shape[0])) if first is not None else False
    view = rows.view(sp)
    filt = _filter
    rank = ranks.global_rank()
    record_tags = _record_tags({}, rank)
    if (filt.ranks is not None and rank not in filt.ranks) or (filt.steps is not None and record_tags["step"] not in
                                                               filt.steps) or (
            filt.phases is not None and record_tags["phase"] not in filt.phases):
        _counters.add("filtered", len(ROW_NAMES))
        return
    folder = rank_dir(rank)
    _pipeline.enqueue("row_request", view["row_request"], {**record_tags, "rids": list(rows.request_ids)}, folder)
    _pipeline.enqueue("positions", view["positions"], record_tags, folder)
    if view["input_ids"] is not None:
        _pipeline.enqueue("input_ids", view["input_ids"], record_tags, folder)


# ---------------------------------------------------------------- a watcher's capture (core/watch.py)

# (capture, rows version, ambient context, step) at the last look, and what it said: the
# Rows of the micro-batch to capture, or None.  While none changes, a call looks no further.
_capture_seen: tuple = (None, 0, None, None)
_capture_rows = None


def _capture(capture, name: str, value: Any, tags: dict) -> None:
    """The sentinels' capture of triggered samples (sentinels/capture.py): in the pass it
    names (``fwd_bwd``), a micro-batch whose Rows (``source_patch.batch``) holds one of its
    request ids has those samples' rows written, every name and layer, with their row
    map, into the capture's folder: a record ``[s, b, ...]`` or ``[s * b, ...]`` becomes
    ``[n, ...]``, its n tokens of those samples (the row map too); one of another shape
    is written whole.  Each record is charged first (``take``: the run's ``max_bytes``).
    The dump's own switch and filter play no part: dumping may be off."""
    global _capture_seen, _capture_rows
    context = ambient.context()
    key = (capture, batch_rows.version, context, _step)
    if key[0] is not _capture_seen[0] or key[1] != _capture_seen[1] or key[2] is not _capture_seen[2] \
            or key[3] != _capture_seen[3]:
        _capture_seen = key
        microbatch = context.get("microbatch")
        phase = context.get("phase")
        rows = batch_rows.current(phase, microbatch if type(microbatch) is int else None)
        if rows is not None and (phase if phase is not None else rows.phase) == capture.phase and \
                not capture.request_ids.isdisjoint(rows.request_ids):
            _capture_rows = rows
            capture.writer(flush)
            capture.seen(rows)
        else:
            _capture_rows = None
    rows = _capture_rows
    if rows is None or value is None or graph_stage.busy:
        return
    leaves = ((name, value),) if isinstance(value, torch.Tensor) else tuple(_leaves(name, value, 0))
    if not leaves:
        return
    rank = ranks.global_rank()
    folder = Path(capture.folder) / (_config.get("rank_dir") or "rank-{rank}").replace("{rank}", str(rank))
    if context.get("phase") is None and rows.phase is not None and "phase" not in tags:
        tags = {**tags, "phase": rows.phase}  # the pass the Rows named (no schedule tagged one)
    if context.get("microbatch") is None and "microbatch" not in tags:
        tags = {**tags, "microbatch": rows.microbatch}  # the Rows' own count: each map pairs its records
    record_tags = _record_tags(tags, rank)
    written = (id(capture), rows.version, record_tags.get("phase"), record_tags.get("microbatch"))
    grid = _capture_grids.get(written)
    if grid is None:
        grid = _capture_grid(capture, rows, leaves[0][1])
        if len(_capture_grids) > 64:
            _capture_grids.clear()
        _capture_grids[written] = grid
        map_tags = _record_tags({"phase": record_tags["phase"], "microbatch": record_tags.get("microbatch")}, rank)
        view = grid["view"]
        maps = [("row_request", view["row_request"], {**map_tags, "rids": list(rows.request_ids)}),
                ("positions", view["positions"], map_tags)]
        if view["input_ids"] is not None:
            maps.append(("input_ids", view["input_ids"], map_tags))
        for leaf, tensor, leaf_tags in maps:
            tensor = _capture_rows_of(tensor, grid)
            if not capture.take(tensor.numel() * tensor.element_size()):
                return
            _pipeline.enqueue(leaf, tensor, leaf_tags, folder)
    for leaf, tensor in leaves:
        tensor = _capture_rows_of(tensor, grid)
        if not capture.take(tensor.numel() * tensor.element_size()):
            return
        _pipeline.enqueue(leaf, tensor, record_tags, folder)


_capture_grids: dict = {}  # (capture id, Rows version, phase, microbatch) -> its grid (_capture_grid)


def _capture_grid(capture, rows, first) -> dict:
    """This rank's ``[s, b]`` grid of the micro-batch and the flat indices of the captured
    samples' tokens in it (None: all of them)."""
    sp = rows.sequence_parallel
    if sp is None and rows.tp_size > 1 and first.dim() >= 1:
        sp = rows.infer_sequence_parallel(int(first.shape[0]))
    view = rows.view(sp)
    grid = view["row_request"]
    wanted = [i for i, rid in enumerate(rows.request_ids) if rid in capture.request_ids]
    keep = torch.isin(grid.reshape(-1), torch.tensor(wanted, dtype=grid.dtype))
    select = None if bool(keep.all()) else keep.nonzero().reshape(-1)
    return {"view": view, "shape": tuple(grid.shape), "select": select}


def _capture_rows_of(tensor: torch.Tensor, grid: dict) -> torch.Tensor:
    """The captured samples' rows of ``tensor`` (``[n, ...]``), or ``tensor`` whole where
    all rows are captured or its shape is not the grid's (``[s, b, ...]``, ``[s * b, ...]``)."""
    select = grid["select"]
    if select is None:
        return tensor
    s, b = grid["shape"]
    if tensor.dim() >= 2 and tuple(tensor.shape[:2]) == (s, b):
        tensor = tensor.reshape(s * b, *tensor.shape[2:])
    elif not (tensor.dim() >= 1 and tensor.shape[0] == s * b):
        return tensor
    return tensor.index_select(0, select.to(tensor.device))


def cut_rows(cut) -> None:
    """(sglang.py) While set, a record whose first dimension is the pass's token count
    keeps only the rows of ``cut = (tokens, token_index, requests, request_index)``, one
    whose first dimension is its request count (the logits) only those requests' rows;
    None: records are written whole.  A prefill's pass that other requests share (live
    traffic batched with it) is written as if it held the prefill's requests alone."""
    global _rows_cut
    _rows_cut = cut


def _cut(tensor: torch.Tensor) -> torch.Tensor:
    tokens, token_index, requests, request_index = _rows_cut
    if tensor.dim() == 0:
        return tensor
    # a pass of one-token requests (decode) has tokens == requests: both indices then agree
    index = token_index if tensor.shape[0] == tokens else request_index if tensor.shape[0] == requests else None
    return tensor if index is None else tensor.index_select(0, index.to(tensor.device))


def pause(paused: bool) -> None:
    """(sglang.py) While True, dumping on records nothing: a forward pass that holds none
    of the requests a prefill asked for (``/dumper/prefill``)."""
    global _paused
    _paused = bool(paused)


# ---------------------------------------------------------------- under CUDA graphs


def _in_graph(name: str, value: Any, tags: dict) -> bool:
    """(a graph is being built or captured somewhere: core/adapters/graph_stage.py) True when this
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
    if not on or _paused:
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

    _MEMO = 4096  # at most this many names, or layer values, remembered

    def __init__(self, config: dict):
        names = config.get("names")
        self.names = re.compile("|".join(fnmatch.translate(p) for p in names)).match if names else None
        self.layers = settings.IntSet(config["layers"]) if config.get("layers") else None
        self.steps = settings.IntSet(config["steps"]) if config.get("steps") else None
        self.ranks = settings.IntSet(config["ranks"]) if config.get("ranks") else None
        self.phases = frozenset(config["phases"]) if config.get("phases") else None
        self._by_tags = self.layers is not None or self.steps is not None or self.phases is not None
        self._name_cache: dict = {}    # name -> admitted (the whole call site's value)
        self._leaf_cache: dict = {}    # (name, element) -> admitted
        self._layer_cache: dict = {}   # layer (an int) -> in layers
        self._step_seen: tuple = (None, False)  # (the last step asked about, its answer)

    def admits(self, tags: dict) -> bool:
        """Whether a record of this process with the call's ``tags`` passes the rank,
        step, layer and phase criteria, read before its tags are built (``_tag``)."""
        if self.ranks is not None and ranks.global_rank() not in self.ranks:
            return False
        if not self._by_tags:
            return True
        context = ambient.context()
        if self.steps is not None:
            step = _tag("step", tags, context, _step)
            seen, hit = self._step_seen
            if step is not seen or type(step) is not int:  # the same int object: the same answer
                hit = step in self.steps
                self._step_seen = (step, hit)
            if not hit:
                return False
        if self.layers is not None:
            layer = _tag("layer", tags, context, None)
            hit = self._layer_cache.get(layer) if type(layer) is int else None
            if hit is None:
                hit = layer in self.layers
                if type(layer) is int and len(self._layer_cache) < self._MEMO:
                    self._layer_cache[layer] = hit
            if not hit:
                return False
        if self.phases is not None and _tag("phase", tags, context, DEFAULT_PHASE) not in self.phases:
            return False
        return True

    def admits_name(self, base: str, leaf: str) -> bool:
        """A pattern that matches the call site's name selects all its elements; one
        that matches an element's name (``qkv.1``) selects that element."""
        if self.names is None:
            return True
        if leaf == base:
            hit = self._name_cache.get(base)
            if hit is None:
                hit = bool(self.names(base))
                if len(self._name_cache) < self._MEMO:
                    self._name_cache[base] = hit
            return hit
        key = (base, leaf)
        hit = self._leaf_cache.get(key)
        if hit is None:
            hit = bool(self.names(base) or self.names(leaf))
            if len(self._leaf_cache) < self._MEMO:
                self._leaf_cache[key] = hit
        return hit


# ---------------------------------------------------------------- configuration and lifecycle


def _apply(config: dict) -> dict:
    global _config, _filter, on, _rank_dirs
    config = dict(config)
    config["dir"] = os.path.abspath(os.path.expanduser(config["dir"]))
    new_filter = _Filter(config)
    on = False
    _config, _filter, _rank_dirs = config, new_filter, {}
    _pipeline.config = config
    on = _pipeline.keep_buffers = bool(config["enable"])
    _regate()
    graph_stage.use("dump", _unstaged, on=on)  # Megatron's own graphs stage for us while on
    if not on:
        _pipeline.drop_pool()
    _sync_server()
    return config


def _regate() -> None:
    """dump()'s first test, after dumping was switched or a watcher's hook or capture changed."""
    global _gate
    _gate = on or watch.tensor_hook is not None or watch.capture is not None


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
watch.listen(_regate)
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
