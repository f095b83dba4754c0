"""Weight sync: Megatron-Core pushes its weights to SGLang engines after optimizer steps.

Call sites (patches/weight_sync.yaml, reached through ``__sp__``)::

    # trainer (Megatron-Core)
    __sp__.weight_sync_attach(result, model_chunks)   # get_megatron_optimizer: optimizer -> its model
    __sp__.weight_sync_step(self, result)             # optimizer.step() returns: push when due
    # engine (SGLang), in an update_weights_from_distributed request with load_format "source_patch"
    __sp__.weight_sync_receive(self, group_name)      # WeightUpdater.receive_weights_from_distributed
    __sp__.weight_sync_loaded(result)                 # WeightUpdater.load_weights_from_distributed
    __sp__.weight_sync_version(recv_req)              # the scheduler records the version it serves

Scripts::

    import source_patch.runtime.weight_sync.sync as weight_sync
    weight_sync.push(model_chunks)      # explicit push (raises on failure)
    weight_sync.state()                 # trainer: pushes, failures, last error, timings
    weight_sync.engine_state()          # engine: the version it serves, partial, failures

The work is done by megatron.py (gather), names.py (mapping) and
transport.py (buckets over the group).  See docs/weight_sync.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
import weakref
from typing import Any

import torch

from ..core import settings
from . import transport
from .transport import WeightSyncError

log = logging.getLogger("source_patch.weight_sync")

LOAD_FORMAT = "source_patch"  # SGLang's load_format that selects this receiver

SETTINGS = "weight_sync"  # its settings component (the capability contract: core/capability.py)
_config: dict = {}
_enabled = False  # the one thing a disabled trainer call site reads


def enabled() -> bool:
    return _enabled


def configure(**changes) -> dict:
    """Change settings (validated as a whole; same keys as the ``weight_sync`` schema)."""
    global _config, _enabled
    parsed = {key: settings.check(SETTINGS, key, value) for key, value in changes.items()}
    _config = {**_config, **parsed}
    _enabled = _config["enable"]
    return dict(_config)


def configure_from_settings() -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    global _config
    _config = settings.resolve(SETTINGS)
    return configure()


# ------------------------------------------------------------------ trainer

_attached: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> model chunks
_trainer: dict = {"step": 0, "pushes": 0, "failures": 0, "last_error": None, "last_push_s": None,
                  "last_bytes": 0, "version": None, "sent_from": None, "gathers": 0}
_link: transport.Link | None = None
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model chunk -> _Plan, dropped with it


def weight_sync_attach(optimizer: Any, model_chunks) -> Any:
    """Remember which model chunks ``optimizer`` steps; returns it unchanged."""
    try:
        _attached[optimizer] = list(model_chunks)
    except TypeError:  # not weak-referenceable: cannot be tracked
        log.warning("weight sync: cannot track optimizer %s", type(optimizer).__name__)
    return optimizer


attach = weight_sync_attach


def detach(optimizer: Any) -> None:
    """Stop pushing after ``optimizer``'s steps (e.g. a critic's optimizer)."""
    _attached.pop(optimizer, None)


def weight_sync_step(optimizer: Any, result: Any) -> Any:
    """After ``optimizer.step()`` returned ``result`` ((success, grad norm, zeros)):
    on every ``every``-th successful step, push.  Returns ``result`` unchanged."""
    if not _enabled:
        return result
    ok = result[0] if isinstance(result, tuple) and result else result
    chunks = _attached.get(optimizer)
    if not ok or chunks is None:
        return result
    _trainer["step"] += 1
    if _trainer["step"] % _config["every"]:
        return result
    try:
        push(chunks, version=_trainer["step"])
    except Exception as exc:  # noqa: BLE001 - on_error decides
        if _config["on_error"] == "raise":
            raise
        log.error("weight sync: push of v%d failed, training continues: %s", _trainer["step"], exc)
    return result


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off for the block (and on again only if it was on).
    A packed push makes tens of thousands of short-lived tensors and tuples: they
    drove the collector into full collections of the trainer's whole heap (Megatron:
    ~850k objects, 0.3-0.5 s each) every few pushes; freed by the end of the push,
    they leave its counters as they found them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def push(model_chunks, version: int | None = None) -> None:
    """Push the weights of ``model_chunks`` (collective over the data-, tensor- and
    expert-parallel ranks: all must call it).  Rank 0 sends; raises WeightSyncError.
    The cyclic garbage collector is paused meanwhile (see _collector_paused)."""
    from . import megatron as weight_megatron
    from . import names as weight_names

    version = _trainer["step"] if version is None else int(version)
    start = time.perf_counter()
    try:
        weight_megatron.finish_param_gather(model_chunks)
        params = weight_megatron.MegatronParams(model_chunks)
        if not params.participates:
            return
        layout = weight_names.Layout.from_config(params.config, vocab_size=_config["vocab_size"])
        # Planned on every participant, so a mapping error stops all before any gather.
        plan = _plan(model_chunks[0], params, layout)
        if not params.sender:
            for _ in params.tensors():  # take part in the gathers
                pass
            return
        buffers = plan.from_buffers(params, layout) if _config["from_buffers"] and not params.gathers else None
        if buffers is not None:
            manifest, tensors = buffers[0], buffers[1]
            # Computed while the buckets before them are on the wire (transport._Spans).
            extra = (out for name, param, picks in buffers[2]
                     for i, (_, out) in enumerate(weight_names.to_hf(name, param.detach(), layout)) if i in picks)
        else:
            manifest = plan.manifest()
            tensors = (out for name, full in params.tensors() for _, out in weight_names.to_hf(name, full, layout))
            extra = ()
        try:
            link = _connected()
        except Exception:
            for _ in tensors if buffers is None else ():  # the other participants' gathers still need rank 0
                pass
            raise
        transport.PACK_GRAPHS = _config["replay_packing"]
        transport.send(link, dataclasses.replace(manifest, version=version), tensors, extra=extra)
    except Exception as exc:
        _trainer["failures"] += 1
        _trainer["last_error"] = f"v{version}: {type(exc).__name__}: {exc}"
        raise
    _trainer.update(pushes=_trainer["pushes"] + 1, version=version, last_bytes=manifest.total_bytes,
                    last_push_s=round(time.perf_counter() - start, 6),
                    sent_from="buffers" if buffers is not None else "tensors",
                    gathers=params.collectives)


def _plan(chunk, params, layout) -> "_Plan":
    plan = _plans.get(chunk)
    # The walk's list is the same object while no module changed (named_params); a new
    # walk (something registered, maybe elsewhere) keeps the plan if it holds the same
    # parameters under the same names.
    if plan is None or plan.layout != layout or not _same(plan.params, params.params):
        plan = _plans[chunk] = _Plan(params, layout)
    plan.params = params.params
    return plan


def _same(planned: list, walked: list) -> bool:
    return planned is walked or (len(planned) == len(walked) and all(
        a is b and name_a == name_b for (name_a, a), (name_b, b) in zip(planned, walked)))


class _Plan:
    """A model chunk's engine specs and bucket layouts, planned once (each push only
    changes the version, and the sender's cached packing sees the same entries)."""

    def __init__(self, params, layout):
        from . import names as weight_names

        self.params, self.layout = params.params, layout
        self.specs = list(weight_names.plan(params.shapes(), layout))
        self.manifests: dict = {}
        self.buffers: dict = {}

    def manifest(self) -> transport.Manifest:
        key = (_config["bucket_bytes"], _config["checksum"])
        if key not in self.manifests:
            self.manifests = {key: transport.plan(self.specs, key[0], 0, key[1])}
        return self.manifests[key]

    def from_buffers(self, params, layout):
        """(manifest, Buffers, extras) to send the parameters from Megatron's own
        parameter buffers, or None when too few of them lie in one (no distributed
        optimizer).  extras: (Megatron name, parameter, indices of its mapped outputs
        that are not views of a buffer: a fused QKV split by copies), mapped anew at
        each push.  Planned once; planned again if a buffer moved."""
        from . import megatron as weight_megatron

        key = (_config["bucket_bytes"], _config["checksum"])
        cached = self.buffers.get(key)
        if cached is None or not weight_megatron.unmoved(cached[1]):
            anchors = weight_megatron.storage_anchors(param for _, param in params.params)
            self.buffers = {key: (_from_buffers(params, layout, *key), anchors)}
            cached = self.buffers[key]
        return cached[0]


def _from_buffers(params, layout, bucket_bytes: int, checksum: bool):
    from . import names as weight_names

    shared: dict = {}
    for _, param in params.params:
        ptr = param.untyped_storage().data_ptr()
        shared[ptr] = shared.get(ptr, 0) + 1
    views, extras, extra_specs = [], [], []
    for name, param in params.params:
        picks = []
        for i, (hf, out) in enumerate(weight_names.to_hf(name, param.detach(), layout)):
            ptr = out.untyped_storage().data_ptr()
            if shared.get(ptr, 0) > 1 and out.is_contiguous() and (out.data_ptr() - ptr) % transport.ALIGN == 0:
                views.append((hf, out))
            else:
                picks.append(i)
                extra_specs.append((hf, tuple(out.shape), out.dtype))
        if picks:
            extras.append((name, param, frozenset(picks)))
    if len(views) < len(extra_specs):  # mostly not in shared buffers: packing is the better path
        return None
    try:
        manifest, buffers = transport.plan_buffers(views, bucket_bytes, 0, checksum, extra=extra_specs)
    except ValueError as exc:  # e.g. two mapped outputs over the same bytes
        log.info("weight sync: sending packed tensors, not from the parameter buffers: %s", exc)
        return None
    return manifest, buffers, extras


def _connected() -> transport.Link:
    """The link to the engines, opened on first use (rank 0 serves the rendezvous)."""
    global _link
    if _link is not None and not _link.broken:
        return _link
    disconnect()
    if not _config["port"]:
        raise WeightSyncError("weight_sync.port is not set (SOURCE_PATCH_WEIGHT_SYNC_PORT)")
    backend = _config["backend"]
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    group = transport.open_group(_config["host"], _config["port"], 0, _config["world_size"],
                                 _config["group_name"], backend, _config["timeout_s"])
    _link = transport.Link(group, _config["timeout_s"])
    return _link


def disconnect() -> None:
    """Drop the trainer's group; the next push opens a new one (the engines must
    join again, e.g. SGLang's destroy/init_weights_update_group)."""
    global _link
    link, _link = _link, None
    if link is not None:
        transport.close_group(link.group)


_TRAINER_COUNTERS = ("step", "pushes", "failures", "last_bytes", "gathers")
_ENGINE_COUNTERS = ("updates", "failures")


def state() -> dict:
    """The trainer's counters and the link, the engine's served version (each process
    is one or the other; the other side's counters stay 0)."""
    counters = {key: _trainer[key] for key in _TRAINER_COUNTERS}
    counters.update({f"engine_{key}": _engine[key] for key in _ENGINE_COUNTERS})
    return {**_trainer, "enabled": _enabled, "connected": _link is not None and not _link.broken,
            "broken": _link.broken if _link is not None else None, "engine": engine_state(),
            "config": dict(_config), "counters": counters,
            "last_error": _trainer["last_error"] or _engine["last_error"]}


def reset() -> dict:
    """Zero the trainer's and the engine's counters (not the link, nor the version
    served); returns state()."""
    _trainer.update(step=0, pushes=0, failures=0, last_error=None, last_push_s=None, last_bytes=0, gathers=0)
    _engine.update(updates=0, failures=0, last_error=None)
    return state()


def close(timeout: float | None = None) -> bool:
    """Leave the trainer's update group (the next push opens a new one)."""
    disconnect()
    return True


# ------------------------------------------------------------------ engine

_engine: dict = {"version": None, "partial": False, "updates": 0, "failures": 0, "last_error": None}
_pending: transport.Update | None = None
_engine_links: dict = {}  # id(group) -> Link


def weight_sync_receive(updater: Any, group_name: str):
    """Receive one update over SGLang's update group ``group_name`` and return the
    named tensors SGLang's ``load_weights`` takes.  Raises WeightSyncError; SGLang
    then answers "Failed to receive weights" and loads nothing."""
    global _pending
    group = updater._model_update_group[group_name]
    link = _engine_links.get(id(group))
    if link is None or link.group is not group:
        link = _engine_links[id(group)] = transport.Link(group, _config["timeout_s"])
    try:
        _pending = transport.receive(link, stage=_config["stage"],
                                     max_metadata_bytes=_config["max_metadata_bytes"],
                                     max_update_bytes=_config["max_update_bytes"],
                                     check=functools.partial(_fits_model, updater))
    except Exception as exc:
        _engine_failed(exc)
        raise
    return _pending.tensors


def _fits_model(updater: Any, manifest: transport.Manifest) -> None:
    """A new layout must be exactly what the model loads (names.check_model): SGLang's
    load_weights skips unknown names and would report a partial update as complete.
    Raised before the manifest vote, so nothing is loaded and the trainer fails at once."""
    from . import names as weight_names

    model = updater.get_model() if hasattr(updater, "get_model") else updater.get_model_runner().model
    weight_names.check_model(model, [(e.name, e.shape, e.dtype) for e in manifest.entries])


def weight_sync_loaded(result: Any) -> Any:
    """After ``load_weights_from_distributed`` returned ``(ok, message)``: a failed
    load (which SGLang reports as partial) leaves no version served."""
    global _pending
    if _pending is not None and isinstance(result, tuple) and not result[0]:
        update, _pending = _pending, None
        try:
            update.close()
        except Exception as exc:  # noqa: BLE001 - the load's failure is what SGLang reports
            log.warning("weight sync: finishing the failed update: %s", exc)
        _engine.update(version=None, partial=True)
        _engine_failed(result[1])
    return result


def weight_sync_version(recv_req: Any) -> Any:
    """The version SGLang records after a successful update: ours for a
    source_patch update (and it becomes the served version), else the request's."""
    global _pending
    if getattr(recv_req, "load_format", None) != LOAD_FORMAT or _pending is None:
        return recv_req.weight_version
    version, _pending = _pending.version, None
    _engine.update(version=version, partial=False, updates=_engine["updates"] + 1)
    return str(version)


def _engine_failed(error: Any) -> None:
    _engine["failures"] += 1
    _engine["last_error"] = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)


def engine_state() -> dict:
    """The version this engine process serves (None: none yet, or a partial load)."""
    return dict(_engine)


configure_from_settings()  # environment over the specs' runtime: section over defaults
