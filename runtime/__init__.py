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
    "routing_enter": "routing",
    "routing_exit": "routing",
    "routing_topk": "routing",
    "routing_probs": "routing",
    "routing_fused": "routing",
    "routing_schedule": "routing",
    "routing_schedule_end": "routing",
    "routing_microbatch_begin": "routing",
    "routing_microbatch_end": "routing",
    "routing_step": "routing",
    "sglang_routing_topk": "routing_sglang",
    "sglang_routing_batch": "routing_sglang",
    "weight_sync_attach": "weight_sync",
    "weight_sync_step": "weight_sync",
    "weight_sync_receive": "weight_sync",
    "weight_sync_loaded": "weight_sync",
    "weight_sync_version": "weight_sync",
    "trace": "trace",
    "trace_step": "trace",
    "trace_state": "trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"source_patch.runtime has no {name!r} (available: {', '.join(__all__)})")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
