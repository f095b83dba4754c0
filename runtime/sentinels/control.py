"""The sentinels' control (the capability contract, core/control.py) and their call sites.

Each watch is a module with the same small surface, which this one drives:

    apply(config)   arm or disarm from the complete settings (config["dir"]: the run folder)
    step_end(step)  the step is over: read back what the device gathered (asynchronously:
                    a step's flags may be reported at the next step's end), write events
                    and metrics
    drain()         (nonfinite, routing_health) flush(), close(): wait for the device reads
                    in flight and write what they say
    counters()      name -> number;  last_error() -> str | None;  clear()

The call sites (patches/sentinels.yaml):

    sentinels_attach(optimizer, model_chunks)   get_megatron_optimizer's returns: the model an
                                 optimizer steps (its parameters' names); also loads this module,
                                 and so reads the settings, before the first forward
    sentinels_schedule()         a forward-backward schedule's entry: loads this module where
                                 the optimizer was built some other way
    sentinels_grads(optimizer, result=None)   at Megatron's optimizer step's return: the
                                 gradients, unless the step's result (success, grad_norm, ...)
                                 has a finite grad norm (then every gradient is finite)
    sentinels_step(step=None)    right after it: the step's end (and the heartbeat: a ``sentinels``
                                 metrics line, {"step", "watches"}, at the first step end after
                                 arming and then at most once a minute).  The step number the watches get is
                                 ``step`` where given, else one more than the last (from 0):
                                 every optimizer step counts, a skipped one too.

A watch's exception is counted (``errors``, last_error), never raised into training;
a BaseException that is not an Exception (SystemExit from an on_event callback) is.
"""

from __future__ import annotations

import time

from ..core.control import Control
from . import events, mismatch, nonfinite, routing_health

SETTINGS = "sentinels"  # its settings component (the capability contract: core/capability.py)
WATCHES = (nonfinite, routing_health, mismatch)
_ARMING = ("nonfinite", "routing_health", "mismatch")
_on = False   # any watch armed: the call sites' one flag test
_step = 0     # the number the next sentinels_step gives the watches
_armed: list = []      # the armed watches' names, for the heartbeat
_next_beat = 0.0       # time.monotonic() at or after which a step end writes the heartbeat
BEAT_S = 60.0          # at most one heartbeat line a minute (and at the first step end)
_errors = 0
_error: str | None = None


def _apply(config: dict) -> dict:
    global _on, _armed, _next_beat
    if any(config[k] for k in _ARMING):
        events.open_run(config["dir"])
    else:
        events.close_run()
    for watch in WATCHES:
        watch.apply(config)
    _armed = [k for k in _ARMING if config[k]]
    _on, _next_beat = bool(_armed), 0.0
    return config


def sentinels_attach(optimizer, model_chunks=None):
    """Returns ``optimizer`` unchanged."""
    nonfinite.attach(optimizer, model_chunks)
    return optimizer


def sentinels_schedule() -> None:
    return None  # importing this module was the point (settings read, hooks set)


def sentinels_grads(optimizer, result=None) -> None:
    if _on:
        nonfinite.gradients(optimizer, result)


def sentinels_step(step=None) -> None:
    global _step, _errors, _error
    if step is not None:
        _step = int(step)
    if _on:
        _heartbeat()
        for watch in WATCHES:
            try:
                watch.step_end(_step)
            except Exception as exc:  # noqa: BLE001 - a watch must never stop training
                _errors += 1
                _error = f"{watch.__name__.rpartition('.')[2]}.step_end: {type(exc).__name__}: {exc}"
    _step += 1



def _heartbeat() -> None:
    """A ``sentinels`` line in metrics.jsonl at the first step end after arming, then at
    most once a minute: a healthy run has a run folder too, and `source-patch watch`
    says which watches are armed and the last step they saw, not "no such folder"."""
    global _next_beat
    now = time.monotonic()
    if now >= _next_beat:
        _next_beat = now + BEAT_S
        events.metric("sentinels", step=_step, watches=list(_armed))


def enabled() -> bool:
    return _on


def _counters() -> dict:
    out = {"errors": _errors}
    for watch in WATCHES:
        for key, value in watch.counters().items():
            out[key] = out.get(key, 0) + value if key == "errors" else value
    out.update(events.counters())
    return out


def _last_error():
    return next((e for e in (*(w.last_error() for w in WATCHES), events.last_error(), _error) if e), None)


def _details() -> dict:
    return {"step": _step, "dir": events.folder()}


def _clear() -> None:
    # reset(): what was collected goes, the step count too (a framework that names its
    # steps passes them to sentinels_step)
    global _errors, _error, _step
    _errors, _error, _step = 0, None, 0
    for watch in (*WATCHES, events):
        watch.clear()


def _drain(timeout) -> bool:
    nonfinite.drain()
    routing_health.drain()
    return events.flush()


def _stop(timeout) -> bool:
    global _on
    _on = False
    if _control.config:
        for watch in WATCHES:
            watch.apply({**_control.config, **SETTINGS_OFF})
    events.close_run()
    return True


# close(): every watch disarmed (a later configure arms them again)
SETTINGS_OFF = {key: False for key in _ARMING}

_control = Control(SETTINGS, apply=_apply, enabled=enabled, counters=_counters, last_error=_last_error,
                   details=_details, clear=_clear, drain=_drain, stop=_stop)
configure, configure_from_settings, state, reset, flush, close = _control.surface()
configure_from_settings()  # environment > the specs' runtime: section > defaults
