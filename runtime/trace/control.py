"""The trace control API: configure, state, reset, flush, close (and url, enabled,
public_config), the capability contract's module (core/capability.py).  Users reach
these and the call sites through the package (``source_patch.runtime.trace``).

Importing it reads the settings (environment > active specs > defaults) and applies
them: the package's exports and the ``__sp__`` names that need them (runtime/facade.py)
import it first.  The state lives in api.py, which this module imports and changes
through api's functions; it holds none of it but its own configuration lock.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from ..core import settings, sglang_graphs
from . import api, lifecycle

SETTINGS = "trace"  # its settings component (the capability contract: core/capability.py)
_config_lock = threading.RLock()


def enabled() -> bool:
    return api.is_enabled()


def configure(**changes) -> dict:
    """Change settings (keys of the ``trace`` schema); all are validated before any
    is applied (KeyError names the valid keys).  Returns the effective configuration."""
    with _config_lock:
        parsed = settings.check_all("trace", changes)
        lifecycle.apply({**api.config(), **parsed})
        return public_config()


def configure_from_settings(environ=None) -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    with _config_lock:
        lifecycle.apply(settings.resolve("trace", os.environ if environ is None else environ))
        return public_config()


def public_config() -> dict:
    return settings.redacted(api.config())


def url() -> str | None:
    """The page of this process's hub with its token in the fragment, or None."""
    hub = api.hub
    return hub.page_url if hub is not None else None


def state(with_hub: bool = True) -> dict:
    """Counters, hub and configuration (api.snapshot with the hub's own)."""
    hub = api.hub
    return {**api.snapshot(), "hub": hub.stats() if hub is not None and with_hub else None,
            "url": hub.url if hub is not None else None, "config": public_config()}


def reset() -> dict:
    """Zero the counters, the step and the names seen (not the subscriptions)."""
    api.clear()
    return state()


def flush(timeout: float = 5.0) -> bool:
    """Wait until traced results have reached the clients' queues and those are sent."""
    deadline = time.monotonic() + timeout
    if not api.drain(deadline):
        return False
    hub = api.hub
    return hub.drain(max(0.0, deadline - time.monotonic())) if hub is not None else True


def close(timeout: float | None = None) -> bool:
    """Send what is queued (up to ``timeout``, default 2 s), close the clients (1001) and
    the hub, stop the publisher; True when everything queued went out.  Registered with
    atexit; configuring again restarts them."""
    api.set_enabled(False)
    sent = False
    try:
        sent = flush(2.0 if timeout is None else timeout)
    except Exception as exc:  # noqa: BLE001
        api.fail("flush at close", exc)
    lifecycle.stop_hub()
    api.stop_publisher()
    return sent


# Names under which the handle exports these (runtime/facade.py).
trace_state = state


def trace_sglang_graph_build(runner, key) -> None:
    """Before an SGLang decode graph's capture: with tracing on (this module's import has
    read the settings: SGLang captures before its first forward) the graph gets a stage."""
    sglang_graphs.sglang_graph_build(runner, key)


# ``__sp__.trace`` (api.trace) also carries the control API, so that a script holding
# only the handle can configure tracing (``__sp__.trace.configure(...)``).
for _function in (configure, configure_from_settings, public_config, url, state, reset, flush, close):
    setattr(api.trace, _function.__name__, _function)
api.trace.trace_state = state
configure_from_settings()
atexit.register(close)
