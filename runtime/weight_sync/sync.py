"""Weight sync: Megatron-Core pushes its weights to SGLang engines after optimizer steps.

Call sites (patches/weight_sync.yaml, reached through ``__sp__``)::

    # trainer (Megatron-Core)
    __sp__.weight_sync_attach(result, model_chunks)   # get_megatron_optimizer: optimizer -> its model
    __sp__.weight_sync_step(self, result)             # optimizer.step() returns: push when due
    # engine (SGLang), load_format "source_patch": update_weights_from_distributed (nccl / gloo)
    __sp__.weight_sync_receive(self, group_name)      # WeightUpdater.receive_weights_from_distributed
    __sp__.weight_sync_loaded(result)                 # WeightUpdater.load_weights_from_distributed
    # ... or update_weights_from_tensor (ipc, mooncake): the request's bytes, never unpickled
    __sp__.weight_sync_load_request(self, payloads, tp_rank)  # WeightUpdater.update_weights_from_tensor
    __sp__.weight_sync_version(recv_req)              # the scheduler records the version it serves

Scripts::

    import source_patch.runtime.weight_sync.sync as weight_sync
    weight_sync.push(model_chunks)      # explicit push (raises on failure)
    weight_sync.state()                 # trainer: pushes, failures, last error, timings
    weight_sync.engine_state()          # engine: the version it serves, partial, failures

The work is done by megatron.py (gather), names.py (mapping), planning.py (what
is sent, planned once) and the backend (backend.py: broadcast.py, ipc.py,
mooncake.py) over the wire contract (wire.py).  See docs/weight_sync.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import time
import weakref
from typing import Any

from ..core.control import Control
from . import backend as weight_backend
from . import link as weight_link
from . import receiver as weight_receiver

log = logging.getLogger("source_patch.weight_sync")

LOAD_FORMAT = weight_backend.LOAD_FORMAT  # SGLang's load_format that selects our receivers

SETTINGS = "weight_sync"  # its settings component (the capability contract: core/capability.py)
_config: dict = {}
_enabled = False  # the one thing a disabled trainer call site reads


def enabled() -> bool:
    return _enabled


def _apply(config: dict) -> dict:
    global _config, _enabled
    _config, _enabled = config, config["enable"]
    return config


# ------------------------------------------------------------------ trainer

_attached: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> model chunks
_trainer: dict = {"step": 0, "pushes": 0, "failures": 0, "last_error": None, "last_push_s": None,
                  "last_bytes": 0, "version": None, "sent_from": None, "gathers": 0,
                  "planned": False, "last_wait_s": None, "last_snapshot_s": None, "last_send_s": None}
_backend = None  # the trainer's end of the configured backend (backend.Backend), opened on first push
_lock = threading.Lock()  # _trainer's counters: an overlapped push's thread updates them too
_inflight = None  # the overlapped push on the wire (_InFlight), at most one
_snapshot = None  # an overlapped push's copy of its update (broadcast.Snapshot), for a backend without one


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
        # (overlap: the error of the push before, which was on the wire; it names its version)
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
    from . import planning, program

    version = _trainer["step"] if version is None else int(version)
    start = time.perf_counter()
    previous = None  # overlap: the error of the push before, raised after this one is handed over
    try:
        weight_megatron.finish_param_gather(model_chunks)
        params = weight_megatron.MegatronParams(model_chunks)
        if not params.participates:
            return
        layout = weight_names.Layout.from_config(params.config, vocab_size=_config["vocab_size"])
        # Planned on every participant, so a mapping error stops all before any gather.
        plan = planning.plan_for(model_chunks[0], params, layout)
        if not params.sender:
            params.gather_only()  # take part in the gathers
            return
        bucket_bytes, checksum = _config["bucket_bytes"], _config["checksum"]
        buffers = plan.from_buffers(params, layout, bucket_bytes, checksum) \
            if _config["from_buffers"] and not params.gathers else None
        if buffers is not None:
            manifest, tensors = buffers[0], buffers[1]
            # Computed while the buckets before them are on the wire (sender._Spans).
            extra = planning.extra_tensors(buffers[2], layout)
        else:
            manifest = plan.manifest(bucket_bytes, checksum)
            # Planned once (program.py): no per-tensor host work; else tensor by tensor.
            tensors = plan.packed(params, layout)
            if tensors is None:
                tensors = (out for name, full in params.tensors() for _, out in weight_names.to_hf(name, full, layout))
            extra = ()
        # The push still on the wire (overlap) goes first: one update at a time on a link,
        # and its error, raised once this one is handed over (its gathers kept in step).
        waited = time.perf_counter()
        previous = _settle()
        _trainer["last_wait_s"] = round(time.perf_counter() - waited, 6)
        try:
            backend = _connected()
        except Exception:
            if isinstance(tensors, program.Sources):  # the other participants' gathers still need rank 0
                tensors.done = 0
                tensors.drain()
            for _ in tensors if buffers is None and not isinstance(tensors, program.Sources) else ():
                pass
            raise
        manifest = dataclasses.replace(manifest, version=version)
        if _config["overlap"]:
            _hand_over(backend, manifest, tensors, extra)
        else:
            backend.send(manifest, tensors, extra=extra, replay_packing=_config["replay_packing"])
    except Exception as exc:
        with _lock:
            _trainer["failures"] += 1
            _trainer["last_error"] = f"v{version}: {type(exc).__name__}: {exc}"
        if previous is not None:  # this push's own error is raised; the one before is said here
            log.error("weight sync: the push before v%d, sent while training went on, failed: %s", version, previous)
        raise
    with _lock:
        if not _config["overlap"]:  # else the push's thread says so once the update is through
            _trainer.update(pushes=_trainer["pushes"] + 1, version=version, last_bytes=manifest.total_bytes)
        _trainer.update(last_push_s=round(time.perf_counter() - start, 6),
                        sent_from="buffers" if buffers is not None else "tensors",
                        planned=isinstance(tensors, program.Sources),
                        gathers=params.collectives)
    if previous is not None:
        raise weight_backend.WeightSyncError(f"the push before, sent while training went on, failed: "
                                             f"{previous}") from previous


# ------------------------------------------------------------------ overlap


class _InFlight:
    """An overlapped push: its update, already copied into a snapshot, sent on a
    thread of its own.  Its outcome lands in the trainer's counters when it ends;
    its error is raised once, by whoever settles it first (the next push, flush(),
    close())."""

    def __init__(self, backend, manifest, buffers, snapshot, device):
        self.version, self.error, self.reported = manifest.version, None, False
        self.started, self.ended = time.perf_counter(), None
        self.thread = threading.Thread(target=self._run, args=(backend, manifest, buffers, snapshot, device),
                                       name=f"weight-sync-push-v{manifest.version}", daemon=True)
        self.thread.start()

    def _run(self, backend, manifest, buffers, snapshot, device) -> None:
        try:
            if device.type == "cuda":
                torch_cuda_set_device(device)
            with snapshot.sending():
                backend.send(manifest, buffers)
        except BaseException as exc:  # noqa: BLE001 - recorded, raised at the next push / flush / close
            self.error = exc
            with _lock:
                _trainer["failures"] += 1
                _trainer["last_error"] = f"v{self.version}: {type(exc).__name__}: {exc}"
        else:
            with _lock:
                _trainer.update(pushes=_trainer["pushes"] + 1, version=self.version,
                                last_bytes=manifest.total_bytes)
        finally:
            self.ended = time.perf_counter()
            _trainer["last_send_s"] = round(self.ended - self.started, 6)

    def wait(self, timeout: float | None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def torch_cuda_set_device(device) -> None:
    import torch

    torch.cuda.set_device(device)


def _hand_over(backend, manifest, tensors, extra) -> None:
    """Copy the update into the snapshot (the parameters may change as soon as this
    returns), then send it from there on a thread while the caller goes on."""
    global _inflight, _snapshot
    from . import broadcast

    snapshot = getattr(backend, "snapshot", None)
    if snapshot is None:
        snapshot = _snapshot = _snapshot or broadcast.Snapshot()
    device = getattr(backend, "device", None) or broadcast.link_device("nccl" if _cuda() else "gloo")
    buffers = snapshot.take(manifest, tensors, extra, device=device, replay_packing=_config["replay_packing"])
    _trainer["last_snapshot_s"] = round(snapshot.last_s, 6)
    _inflight = _InFlight(backend, manifest, buffers, snapshot, snapshot.stream.device)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _settle(timeout: float | None = None):
    """Wait for the overlapped push on the wire, if any (``timeout``: None waits as long
    as it takes, bounded by the link's own deadlines); its error if it failed and was not
    raised before, else None.  TimeoutError if it is still on the wire after ``timeout``."""
    global _inflight
    inflight = _inflight
    if inflight is None:
        return None
    if not inflight.wait(timeout):
        raise TimeoutError(f"the push of v{inflight.version} is still on the wire after {timeout:g} s")
    _inflight = None
    if inflight.error is None or inflight.reported:
        return None
    inflight.reported = True
    return inflight.error


def _drain(timeout: float | None) -> bool:
    """flush(): wait for the overlapped push on the wire; raises its error (flush then
    says False and state() has it)."""
    error = _settle(timeout)
    if error is not None:
        raise weight_backend.WeightSyncError(f"the push sent while training went on failed: {error}") from error
    return True


def _connected() -> weight_backend.Backend:
    """The trainer's end of the configured backend, opened on first use (broadcast:
    rank 0 serves the rendezvous)."""
    global _backend
    if _backend is not None and not _backend.broken:
        return _backend
    disconnect()
    options = {key: value for key, value in _config.items() if key.startswith("mooncake_") or key in (
        "host", "port", "world_size", "group_name", "timeout_s", "nccl_ctas")}
    if _config["groups"]:
        from . import broadcast

        name = weight_backend.resolve(_config["backend"])
        if name not in weight_backend.BROADCAST:
            raise weight_backend.WeightSyncError(f"weight_sync.groups is for the broadcast backends (nccl, gloo), "
                                                 f"not {name}: it posts each update to every URL in engines")
        _backend = broadcast.Fanout.open(name, groups=_config["groups"], **options)
        return _backend
    _backend = weight_backend.open_backend(_config["backend"], engines=_config["engines"], **options)
    return _backend


def disconnect() -> None:
    """Drop the trainer's backend (broadcast: its group; the engines must join the
    next one, e.g. SGLang's destroy/init_weights_update_group).  An overlapped push
    on the wire is waited for first (its error stays for the next push / flush)."""
    global _backend
    inflight = _inflight
    if inflight is not None:
        inflight.wait(_config.get("timeout_s"))
    backend, _backend = _backend, None
    if backend is not None:
        backend.close()


_TRAINER_COUNTERS = ("step", "pushes", "failures", "last_bytes", "gathers")
_ENGINE_COUNTERS = ("updates", "failures")


def _counters() -> dict:
    counters = {key: _trainer[key] for key in _TRAINER_COUNTERS}
    counters.update({f"engine_{key}": _engine[key] for key in _ENGINE_COUNTERS})
    return counters


def _details() -> dict:
    """The trainer's push (its counters are under ``counters``), the link, the engine's
    served version (each process is one or the other)."""
    trainer = {key: value for key, value in _trainer.items() if key not in (*_TRAINER_COUNTERS, "last_error")}
    inflight = _inflight
    groups = _backend.state() if _backend is not None and hasattr(_backend, "state") else None
    return {**trainer, "in_flight": inflight.version if inflight is not None and inflight.ended is None else None,
            "connected": _backend is not None and not _backend.broken,
            "broken": _backend.broken if _backend is not None else None, "groups": groups, "engine": engine_state()}


def _clear() -> None:
    """reset(): the trainer's and the engine's counters (not the link, nor the version served)."""
    _trainer.update(step=0, pushes=0, failures=0, last_error=None, last_push_s=None, last_bytes=0, gathers=0,
                    last_wait_s=None, last_snapshot_s=None, last_send_s=None)
    _engine.update(updates=0, failures=0, last_error=None)


def _stop(_timeout: float | None) -> bool:
    """close(): the trainer's backend (the next push opens a new one).  Call it before
    ``torch.distributed.destroy_process_group()`` where receivers wait for the next
    update (a ``receive()`` loop): torch's destroy of every group waits for them, this
    aborts the update group instead (examples/train_moe.py does).  A backend that could
    not be closed is dropped all the same (close() says False, its error in state())."""
    disconnect()
    return True


_control = Control(SETTINGS, apply=_apply, enabled=enabled, counters=_counters,
                   last_error=lambda: _trainer["last_error"] or _engine["last_error"], details=_details,
                   clear=_clear, drain=_drain, stop=_stop)
configure, configure_from_settings, state, reset, flush, close = _control.surface()


# ------------------------------------------------------------------ engine

_engine: dict = {"version": None, "partial": False, "updates": 0, "failures": 0, "last_error": None}
_pending: weight_receiver.Update | None = None
_engine_links: dict = {}  # id(group) -> Link


def weight_sync_receive(updater: Any, group_name: str):
    """Receive one update over SGLang's update group ``group_name`` and return the
    named tensors SGLang's ``load_weights`` takes.  Raises WeightSyncError; SGLang
    then answers "Failed to receive weights" and loads nothing."""
    global _pending
    group = updater._model_update_group[group_name]
    link = _engine_links.get(id(group))
    if link is None or link.group is not group:
        link = _engine_links[id(group)] = weight_link.Link(group, _config["timeout_s"])
    try:
        _pending = weight_receiver.receive(link, stage=_config["stage"],
                                     max_metadata_bytes=_config["max_metadata_bytes"],
                                     max_update_bytes=_config["max_update_bytes"],
                                     check=functools.partial(_fits_model, updater))
    except Exception as exc:
        _engine_failed(exc)
        raise
    return _pending.tensors


def weight_sync_load_request(updater: Any, payloads: Any, tp_rank: int) -> tuple:
    """An update_weights_from_tensor request with load_format "source_patch" (the ipc
    and mooncake backends): ``payloads`` are the request's bytes, one per engine rank
    (or one for all), which SGLang has not deserialized.  Receive, verify and load
    them into the model; (success, message) as SGLang's own loaders answer.  A
    refused update loads nothing: the engine serves its old weights and version."""
    global _pending
    _pending = None
    try:
        if not isinstance(payloads, (list, tuple)) or not payloads:
            raise weight_backend.WeightSyncError("the request carries no payload")
        payload = payloads[tp_rank] if tp_rank < len(payloads) else payloads[0]
        update = weight_backend.receive_request(
            payload, device=_model_device(updater), max_metadata_bytes=_config["max_metadata_bytes"],
            max_update_bytes=_config["max_update_bytes"], check=functools.partial(_fits_model_once, updater),
            rank=tp_rank, **{key: value for key, value in _config.items() if key.startswith("mooncake_")})
    except Exception as exc:  # noqa: BLE001 - refused: SGLang reports it, the old weights stay
        _engine_failed(exc)
        log.error("weight sync: update refused: %s", exc)
        return False, f"weight sync: update refused: {type(exc).__name__}: {exc}"
    try:
        _model(updater).load_weights(update.tensors)
    except Exception as exc:  # noqa: BLE001 - as SGLang's own loaders: the weights are partly new
        _engine.update(version=None, partial=True)
        _engine_failed(exc)
        return False, f"weight sync: loading v{update.version} failed, the weights are partly updated: {exc}"
    _pending = update
    return True, f"weight sync: loaded v{update.version}"


def _model(updater: Any):
    return updater.get_model() if hasattr(updater, "get_model") else updater.get_model_runner().model


def _model_device(updater: Any):
    return next(_model(updater).parameters()).device


def _fits_model(updater: Any, manifest) -> None:
    """A new layout must be exactly what the model loads (names.check_model): SGLang's
    load_weights skips unknown names and would report a partial update as complete.
    Raised before the manifest vote, so nothing is loaded and the trainer fails at once."""
    from . import names as weight_names

    weight_names.check_model(_model(updater), [(e.name, e.shape, e.dtype) for e in manifest.entries])


_fitted: dict = {}  # id(model) -> the entries last found to fit it (the request backends' layouts)


def _fits_model_once(updater: Any, manifest) -> None:
    """_fits_model for the request backends, once per layout: an engine parses a
    layout's tensor list once, so the same entries object means the same layout."""
    key = id(_model(updater))
    if _fitted.get(key) is not manifest.entries:
        _fits_model(updater, manifest)
        _fitted[key] = manifest.entries


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
