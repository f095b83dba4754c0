"""The trace control API: configure, state, names, reset, flush, close (and url,
public_config).  Users import these from the package or from api.py, which re-exports
them; the capability contract (core/capability.py) checks them there.

The state they read and write lives in api.py, where the hot path reads it as module
globals; api hands itself over at import (``api`` below), so this module never imports
it and holds no copy of that state.
"""

from __future__ import annotations

import os
import threading
import time

from ..core import ranks, settings
from . import lifecycle

api = None  # runtime/trace/api.py, set by it at import: the one place the trace state lives
_config_lock = threading.RLock()


def enabled() -> bool:
    return api._enabled


def configure(**changes) -> dict:
    """Change settings (keys of the ``trace`` schema); all are validated before any
    is applied (KeyError names the valid keys).  Returns the effective configuration."""
    with _config_lock:
        parsed = settings.check_all("trace", changes)
        lifecycle.apply({**api._config, **parsed})
        return public_config()


def configure_from_settings(environ=None) -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    with _config_lock:
        lifecycle.apply(settings.resolve("trace", os.environ if environ is None else environ))
        return public_config()


def public_config() -> dict:
    return settings.redacted(api._config)


def url() -> str | None:
    """The page of this process's hub with its token in the fragment, or None."""
    hub = api._hub
    return hub.page_url if hub is not None else None


def state(with_hub: bool = True) -> dict:
    """Counters, hub and configuration (also the hub's ``stats`` reply)."""
    with api._cond:
        counts = dict(api._counts)
        queued = len(api._pending) + len(api._records) + api._busy
        calls = api.due_call_us()
        cost = dict(api._cost)
    hub, ring = api._hub, api._ring
    hub_stats = hub.stats() if hub is not None and with_hub else None
    cost["hub_cpu"] = hub.cpu_seconds() if hub is not None else 0.0
    return {
        "enabled": api._enabled,
        "step": api._step,
        "rank": ranks.global_rank(),
        **counts,
        "counters": counts,
        "queued": queued,
        "last_error": api._counters.last_error,
        "series": len(api._seen),
        "subscriptions": len(api._table.subs),
        "cost_seconds": cost,
        "due_call_us": calls,
        "hub": hub_stats,
        "ring": ring.state() if ring is not None else None,
        "url": hub.url if hub is not None else None,
        "config": public_config(),
    }


def names() -> list[dict]:
    """The names traced so far: ``{"name", "layers", "shape", "dtype"}`` each."""
    grouped: dict = {}
    for (name, layer), (shape, dtype) in dict(api._seen).items():
        entry = grouped.setdefault(name, {"name": name, "layers": [], "shape": shape, "dtype": dtype})
        if layer is not None:
            entry["layers"].append(layer)
    for entry in grouped.values():
        entry["layers"] = sorted(entry["layers"], key=lambda v: (not isinstance(v, int), str(v)))
    return sorted(grouped.values(), key=lambda e: e["name"])


def reset() -> dict:
    """Zero the counters, the step and the names seen (not the subscriptions)."""
    api._counters.reset()
    with api._cond:
        for key in api._cost:
            api._cost[key] = 0.0
        api._call_us[:] = [0] * len(api._call_us)
        api._durations = []
    api._step = 0
    api._seen.clear()
    api._table = api._Table(api._table.subs)
    return state()


def flush(timeout: float = 5.0) -> bool:
    """Wait until traced results have reached the clients' queues and those are sent."""
    deadline = time.monotonic() + timeout
    with api._cond:
        api._seal()  # on the tracing thread; any other waits for that thread to seal them
        api._cond.notify_all()
        while api._pending or api._records or api._busy:
            publisher = api._publisher
            if not (publisher and publisher.is_alive()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            api._cond.wait(min(remaining, 0.1))
    hub = api._hub
    return hub.drain(max(0.0, deadline - time.monotonic())) if hub is not None else True


def close(timeout: float | None = None) -> bool:
    """Send what is queued (up to ``timeout``, default 2 s), close the clients (1001) and
    the hub, stop the publisher; True when everything queued went out.  Registered with
    atexit; configuring again restarts them."""
    api._enabled = False
    sent = False
    try:
        sent = flush(2.0 if timeout is None else timeout)
    except Exception as exc:  # noqa: BLE001
        api._fail("flush at close", exc)
    lifecycle.stop_hub()
    with api._cond:
        publisher, api._stop = api._publisher, True
        api._cond.notify_all()
    if publisher is not None and publisher is not threading.current_thread():
        publisher.join(5)
    with api._cond:
        api._publisher, api._stop = None, False
        api._pending.clear()
        api._unsealed = []
        api._records.clear()
    return sent
