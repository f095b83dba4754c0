"""The ``__sp__`` facade: every name that inserted call sites may call, and the
module that defines it.  The handle (patcher/finder.py ``RuntimeHandle``) resolves a
name here on first use, so a patched module that never reaches a call site never
imports a capability or its dependencies (torch, websockets, ...).

Core's own call sites are listed here; each capability's come from its manifest
(``call_sites`` in runtime/<capability>/manifest.py)."""

import importlib

from .core import capability

CORE = {
    "emit": "core.events",
    "subscribe": "core.events",
    "capture": "core.events",
    "graph_build": "core.adapters.graph_stage",
    "graph_capture": "core.adapters.graph_stage",
    "graph_captured": "core.adapters.graph_stage",
    "graph_replay": "core.adapters.graph_stage",
    "graph_replayed": "core.adapters.graph_stage",
    "sglang_graph_built": "core.adapters.sglang_graphs",
    "sglang_graph_replay": "core.adapters.sglang_graphs",
    "sglang_graph_replayed": "core.adapters.sglang_graphs",
}
_PACKAGE = __name__.rpartition(".")[0]


def exports() -> dict[str, str]:
    """``__sp__`` name -> the module that defines it, relative to the runtime package."""
    return {**CORE, **capability.call_sites()}


def __getattr__(name: str):
    table = exports()
    if name not in table:
        raise AttributeError(f"the source-patch runtime has no {name!r} (available: {', '.join(sorted(table))})")
    value = getattr(importlib.import_module(f"{_PACKAGE}.{table[name]}"), name)
    globals()[name] = value
    return value
