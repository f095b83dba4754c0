"""The trace control API: configure, state, reset, flush, close (and url, enabled,
public_config), the capability contract's module (core/capability.py).  Users reach
these and the call sites through the package (``source_patch.runtime.trace``).

Importing it reads the settings (environment > active specs > defaults) and applies
them: the package's exports and the ``__sp__`` names that need them (runtime/facade.py)
import it first.  The state lives in api.py, which this module imports and changes
through api's functions; its contract is core/control.py's, given what tracing does.
"""

from __future__ import annotations

import atexit
import os
import time

from ..core.adapters import sglang_graphs
from ..core.control import Control
from . import api, lifecycle

SETTINGS = "trace"  # its settings component (the capability contract: core/capability.py)
_CONTRACT_KEYS = ("enabled", "counters", "last_error", *api.COUNTERS)  # the contract's, and the counters flat


def _apply(config: dict) -> dict:
    lifecycle.apply(config)
    return api.config()  # as applied (its folder made absolute)


def _details() -> dict:
    """trace's own keys of state(): api.snapshot's (step, rank, queue, series, costs,
    due calls, ring) and the hub's."""
    details = {key: value for key, value in api.snapshot().items() if key not in _CONTRACT_KEYS}
    hub = api.hub
    return {**details, "hub": hub.stats() if hub is not None else None, "url": hub.url if hub is not None else None}


def _drain(timeout: float | None) -> bool:
    """flush: the traced results handed to the hub, and the clients' queues sent."""
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    if not api.drain(deadline):
        return False
    hub = api.hub
    # None: the hub closes a client stalled for stall_timeout, so its queues drain in bounded time
    return hub.drain(60.0 if timeout is None else max(0.0, deadline - time.monotonic())) if hub is not None \
        else True


def _stop(_timeout: float | None) -> bool:
    """close, after the drain: the clients (1001), the hub and the publisher."""
    lifecycle.stop_hub()
    api.stop_publisher()
    return True


_control = Control(SETTINGS, apply=_apply, enabled=api.is_enabled, counters=api.counts,
                   last_error=api.last_error, details=_details, clear=api.clear,
                   drain=_drain, quiesce=lambda: api.set_enabled(False), stop=_stop, close_timeout=2.0)
configure, configure_from_settings, state, reset, flush, close = _control.surface()
public_config = _control.public_config
enabled = api.is_enabled


def url() -> str | None:
    """The page of this process's hub with its token in the fragment, or None."""
    hub = api.hub
    return hub.page_url if hub is not None else None


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
