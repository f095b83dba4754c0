"""The capability contract (core/capability.py), implemented once.

A control module builds one ``Control`` from what its capability does differently and
exports its methods under the contract's names::

    _control = Control(SETTINGS, apply=_apply, enabled=..., counters=..., last_error=...)
    configure, configure_from_settings, state, reset, flush, close = _control.surface()

Everything the contract promises lives here: settings validated as a whole before any
is applied, one shape of ``state()``, ``flush`` as "wait until what was handed over is
written", and ``close`` that honours its timeout, never raises and says False when it
could not finish.  The call sites never come here: they read their capability's own
flags, which ``apply`` sets.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from . import capability, settings


def _nothing(*_args) -> None:
    return None


class Control:
    """One capability component's control surface.

    apply(config, **inputs)  the complete, validated settings (and the non-setting
                             ``inputs`` configure accepts): set the flags the call sites
                             read, start or stop what they need.  Raising leaves the
                             settings as they were.
    enabled()                whether the call sites do anything now
    counters()               name -> number
    last_error()             the capability's latest failure (str or None)
    details()                the capability's own keys of state(), beside the contract's
    clear()                  reset(): zero the counters, drop what was collected
    drain(timeout)           flush(): wait until what was handed over is written; bool
    quiesce()                close(), first: take no new work (what is queued still goes)
    stop(timeout)            close(), after the drain: stop threads, sockets, files; bool
    """

    def __init__(self, component: str, *, apply: Callable, enabled: Callable, counters: Callable,
                 last_error: Callable = _nothing, details: Callable = dict, clear: Callable = _nothing,
                 drain: Callable | None = None, quiesce: Callable = _nothing, stop: Callable | None = None,
                 inputs: tuple = (), close_timeout: float | None = None):
        self.component = component
        self.config: dict = {}  # the settings applied; {} until the first configure
        self.error: str | None = None  # a failure of flush or close (the capability's own come first)
        self._apply, self._enabled, self._counters, self._last_error = apply, enabled, counters, last_error
        self._details, self._clear, self._drain, self._quiesce, self._stop = details, clear, drain, quiesce, stop
        self._inputs, self._close_timeout = inputs, close_timeout
        self._lock = threading.RLock()

    def surface(self) -> tuple:
        """configure, configure_from_settings, state, reset, flush, close: the contract's names."""
        return self.configure, self.configure_from_settings, self.state, self.reset, self.flush, self.close

    def configure(self, **changes) -> dict:
        """Change settings (keys of the component's schema): every one is validated before
        any is applied (KeyError names the valid keys, ValueError/TypeError say what is
        wrong).  Returns the effective settings, secrets redacted."""
        inputs = {key: changes.pop(key) for key in self._inputs if key in changes}
        with self._lock:
            parsed = settings.check_all(self.component, changes)
            return self._set({**(self.config or settings.resolve(self.component)), **parsed}, inputs)

    def configure_from_settings(self, environ=None) -> dict:
        """Re-read the settings (environment > active specs > defaults) and apply them."""
        with self._lock:
            return self._set(settings.resolve(self.component, os.environ if environ is None else environ), {})

    def _set(self, config: dict, inputs: dict) -> dict:
        reason = capability.changes_results(self.component, config)
        if reason:
            _refuse_missing_call_sites(self.component, reason)
        applied = self._apply(config, **inputs)
        self.config = applied if isinstance(applied, dict) else config  # apply may normalise (a path made absolute)
        return self.public_config()

    def forget(self) -> None:
        """Drop the applied settings: the next configure reads them again."""
        self.config = {}

    def public_config(self) -> dict:
        return settings.redacted(self.config)

    def state(self) -> dict:
        """The capability's own keys, then the contract's: enabled, config, counters, last_error."""
        return {**self._details(), "enabled": bool(self._enabled()), "config": self.public_config(),
                "counters": dict(self._counters()), "last_error": self._last_error() or self.error}

    def reset(self) -> dict:
        """Zero the counters, drop what was collected; the settings stay.  Returns state()."""
        self._clear()
        self.error = None
        return self.state()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was handed over is written; False when that did not finish in
        ``timeout`` seconds (None: as long as it takes) or failed."""
        if self._drain is None:
            return True
        try:
            return bool(self._drain(timeout))
        except Exception as exc:  # noqa: BLE001 - the contract: flush says, never raises
            self.error = f"flush: {type(exc).__name__}: {exc}"
            return False

    def close(self, timeout: float | None = None) -> bool:
        """Take no new work, write what was handed over, stop threads, sockets and files;
        True when everything finished within ``timeout`` seconds.  Never raises; safe to
        call twice; a later call site or configure starts what it needs again."""
        timeout = self._close_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._quiesce()
        except Exception as exc:  # noqa: BLE001
            self.error = f"close: {type(exc).__name__}: {exc}"
        drained = self.flush(_left(deadline))
        try:
            stopped = True if self._stop is None else self._stop(_left(deadline))
        except Exception as exc:  # noqa: BLE001 - the contract: close says, never raises
            self.error = f"close: {type(exc).__name__}: {exc}"
            stopped = False
        return drained and stopped is not False and (deadline is None or time.monotonic() <= deadline + 0.05)


def results_at_stake(names, environ=None) -> list[str]:
    """For ``__sp__`` names that a patch which did not apply would have called: why the
    settings in force make their loss a wrong run (one line per component), else []
    (the patcher asks, where it leaves a patch out: patcher/finder.py)."""
    why = []
    for component in sorted({c for c in map(capability.component_of, names) if c}):
        config = settings.resolve(component, os.environ if environ is None else environ)
        reason = capability.changes_results(component, config)
        if reason:
            why.append(reason)
    return why


def _refuse_missing_call_sites(component: str, reason: str) -> None:
    """Fail closed: a setting that changes what the model computes (``reason``) is refused
    while a call site of ``component`` is missing in this process (its patch did not
    apply: the patcher's finder keeps which, found in sys.modules, never imported)."""
    activation = sys.modules.get("source_patch.patcher.activation")
    finder = activation.installed_finder() if activation is not None else None
    for skipped, names in getattr(finder, "missing", ()):
        if any(capability.component_of(name) == component for name in names):
            patch = skipped.patch
            raise RuntimeError(f"{reason} changes what the model computes, but patch {patch.id!r} of spec "
                               f"{patch.spec_name!r} ({patch.location.file}:{patch.location.line}) did not apply "
                               f"in this process: {skipped.reason.splitlines()[0]}; refused (nothing changed)")


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (None: no limit), never negative."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
