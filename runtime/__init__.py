"""What patched call sites call, through the ``__sp__`` handle.

Submodules load on first use, so a patched module that never reaches a call
site never imports the runtime's dependencies.
"""

import importlib

_EXPORTS = {
    "emit": "events",
    "subscribe": "events",
    "capture": "events",
    "dump": "dumper",
    "dump_context": "dumper",
    "dump_step": "dumper",
    "dump_microbatch": "dumper",
    "dump_flush": "dumper",
    "dump_state": "dumper",
    "dump_configure": "dumper",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"source_patch.runtime has no {name!r} (available: {', '.join(__all__)})")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
