"""The control surface every capability exposes, in one shape.

Each settings component has one control module (``CONTROL``), which provides::

    SETTINGS                           the settings component it reads (core/settings.py)
    enabled() -> bool                  whether its call sites do anything now
    configure(**changes) -> dict       validate every change, then apply them all;
                                       returns the effective settings (secrets redacted)
    configure_from_settings() -> dict  re-read environment > active specs > defaults
    state() -> dict                    at least STATE_KEYS: enabled, config, counters
                                       (name -> number), last_error (str or None)
    reset() -> dict                    zero the counters, drop what was collected; keep
                                       the settings; returns state()
    close(timeout=None) -> bool        flush, stop threads, sockets and files; True when
                                       everything went out in time.  Safe to call twice;
                                       a later call site starts them again.

Settings are read the same way everywhere: through ``settings.resolve`` on first use (the
first call site that reaches the module), and again on ``configure_from_settings()``.  tests/test_layout.py checks every module below.
"""

from __future__ import annotations

import inspect

# settings component -> control module, relative to the runtime package
CONTROL = {
    "dump": "dump.api",
    "routing": "routing.megatron.control",
    "sglang_routing": "routing.sglang.control",
    "trace": "trace.control",
    "weight_sync": "weight_sync.sync",
    "features": "features.capture",
}
STATE_KEYS = frozenset({"enabled", "config", "counters", "last_error"})
_NO_ARGUMENTS = ("enabled", "configure_from_settings", "state", "reset")


def violations(module) -> list[str]:
    """What ``module`` lacks of the contract (its signatures only); empty when none."""
    found = []
    if not isinstance(getattr(module, "SETTINGS", None), str):
        found.append("SETTINGS: missing (the settings component it reads)")
    for name in (*_NO_ARGUMENTS, "configure", "close"):
        function = getattr(module, name, None)
        if not callable(function):
            found.append(f"{name}(): missing")
            continue
        params = inspect.signature(function).parameters.values()
        required = [p.name for p in params if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            found.append(f"{name}(): must be callable without arguments (requires {', '.join(required)})")
        if name == "configure" and not any(p.kind is p.VAR_KEYWORD for p in params):
            found.append("configure(): must take **changes")
        if name == "close" and "timeout" not in inspect.signature(function).parameters:
            found.append("close(): must take timeout=")
    return found


def state_violations(state: dict) -> list[str]:
    """What a ``state()`` (or ``reset()``) result lacks of the contract's shape."""
    if not isinstance(state, dict):
        return [f"state is a {type(state).__name__}, not a dict"]
    found = [f"state: no {key!r}" for key in sorted(STATE_KEYS - set(state))]
    if "counters" in state and not (isinstance(state["counters"], dict) and all(
            isinstance(v, (int, float)) for v in state["counters"].values())):
        found.append("state: 'counters' must map names to numbers")
    if "enabled" in state and not isinstance(state["enabled"], bool):
        found.append("state: 'enabled' must be a bool")
    return found
