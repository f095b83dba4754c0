"""What a capability is: its declaration (``Capability``, one ``manifest.py`` per
capability folder, found here), and the control surface every capability exposes.

A capability is a folder ``runtime/<name>/`` with a ``manifest.py`` that binds
``CAPABILITY = Capability(...)``: its settings components (each with its schema and its
control module), the ``__sp__`` call-site names it defines, its bundled specs and its
docs page.  Everything that lists capabilities is derived from the manifests:
``settings.SCHEMAS``, ``controls()`` below, the facade's names (runtime/facade.py),
``source-patch settings`` and docs/settings.md, the layout test.  A manifest imports
core only (the settings parsers), so reading every manifest imports no capability's
code: the spec loader does it to validate ``runtime:`` sections.

Each settings component has one control module, which provides (core/control.py
implements it once; a control module supplies what differs)::

    SETTINGS                           the settings component it reads (core/settings.py)
    enabled() -> bool                  whether its call sites do anything now
    configure(**changes) -> dict       validate every change, then apply them all;
                                       returns the effective settings (secrets redacted)
    configure_from_settings() -> dict  re-read environment > active specs > defaults
    state() -> dict                    at least STATE_KEYS: enabled, config, counters
                                       (name -> number), last_error (str or None)
    reset() -> dict                    zero the counters, drop what was collected; keep
                                       the settings; returns state()
    flush(timeout=None) -> bool        wait until what was handed over is written; True
                                       when it was in time
    close(timeout=None) -> bool        flush, stop threads, sockets and files; True when
                                       everything went out in time.  Safe to call twice;
                                       a later call site starts them again.

Settings are read the same way everywhere: through ``settings.resolve`` on first use (the
first call site that reaches the module), and again on ``configure_from_settings()``.
tests/test_layout.py checks every control module.
"""

from __future__ import annotations

import importlib
import os
import importlib.util
import inspect
import pkgutil
from dataclasses import dataclass, field

_RUNTIME = __name__.rsplit(".", 2)[0]  # source_patch.runtime


@dataclass(frozen=True)
class Component:
    """One settings component: its control module (relative to the capability's
    package) and its schema (key -> ``settings.Setting``)."""

    control: str
    settings: dict
    # key -> the values under which this component changes what the model computes (routing
    # replay); it then fails closed where its call sites did not apply (changes_results below)
    changes_results: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Capability:
    """A capability's declaration (its ``manifest.py``)."""

    name: str  # the folder under runtime/, the spec's and the facade prefix's name
    summary: str  # one line: what it does
    components: dict  # settings component -> Component
    call_sites: dict = field(default_factory=dict)  # module (relative) -> the __sp__ names it defines
    specs: tuple = ()  # bundled specs (patches/<name>.yaml) that insert its call sites
    page: str = ""  # its docs page (docs/<page>)

    def module(self, relative: str) -> str:
        """A module of this capability, relative to the runtime package (``dump.api``)."""
        return f"{self.name}.{relative}" if relative else self.name


_FOUND: dict[str, Capability] = {}


def capabilities() -> dict[str, Capability]:
    """Every capability, by name: each ``runtime/<name>/manifest.py`` found on the
    runtime package's path (read once; sorted by name)."""
    if not _FOUND:
        runtime = importlib.import_module(_RUNTIME)
        found = {}
        for info in sorted(pkgutil.iter_modules(runtime.__path__), key=lambda i: i.name):
            if info.ispkg and _has_manifest(info):
                declared = importlib.import_module(f"{_RUNTIME}.{info.name}.manifest").CAPABILITY
                if declared.name != info.name:
                    raise ImportError(f"runtime/{info.name}/manifest.py declares {declared.name!r}: "
                                      f"a capability is named after its folder")
                found[info.name] = declared
        _FOUND.update(found)  # all or nothing: a manifest that fails to load is raised again next time
    return _FOUND


def _has_manifest(info) -> bool:
    """Whether a runtime subpackage holds a manifest.py, looked up without importing the
    package (a room that is not a capability, such as verdict/, stays unloaded)."""
    spec = info.module_finder.find_spec(f"{_RUNTIME}.{info.name}")
    return any(os.path.isfile(os.path.join(folder, "manifest.py"))
               for folder in (spec.submodule_search_locations or ()) if spec is not None)


def controls() -> dict[str, str]:
    """settings component -> its control module, relative to the runtime package."""
    return {component: cap.module(declared.control) for cap in capabilities().values()
            for component, declared in cap.components.items()}


def call_sites() -> dict[str, str]:
    """``__sp__`` name -> the module that defines it, relative to the runtime package."""
    return {name: cap.module(module) for cap in capabilities().values()
            for module, names in cap.call_sites.items() for name in names}


def component_of(name: str) -> str | None:
    """The settings component an ``__sp__`` name belongs to: the longest component name
    it starts with (``routing_sglang_topk`` -> routing_sglang), among its capability's."""
    owner = next((cap for cap in capabilities().values() for names in cap.call_sites.values() if name in names),
                 None)
    if owner is None:
        return None
    fits = [c for c in owner.components if name == c or name.startswith(c + "_")]
    return max(fits, key=len) if fits else None


def changes_results(component: str, config: dict) -> str | None:
    """Why ``config`` makes ``component`` change what the model computes (``mode=replay``),
    or None: then a call site of it that did not apply is an observer's loss, not a wrong run."""
    declared = next((cap.components[component] for cap in capabilities().values()
                     if component in cap.components), None)
    for key, values in (declared.changes_results.items() if declared else ()):
        if config.get(key) in values:
            return f"{component} {key}={config[key]}"
    return None


STATE_KEYS = frozenset({"enabled", "config", "counters", "last_error"})
_NO_ARGUMENTS = ("enabled", "configure_from_settings", "state", "reset")


def violations(module) -> list[str]:
    """What ``module`` lacks of the contract (its signatures only); empty when none."""
    found = []
    if not isinstance(getattr(module, "SETTINGS", None), str):
        found.append("SETTINGS: missing (the settings component it reads)")
    for name in (*_NO_ARGUMENTS, "configure", "flush", "close"):
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
        if name in ("flush", "close") and "timeout" not in inspect.signature(function).parameters:
            found.append(f"{name}(): must take timeout=")
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
