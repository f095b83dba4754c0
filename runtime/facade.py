"""The ``__sp__`` facade: every name that inserted call sites may call, and the
module that defines it.  The handle (patcher/finder.py ``RuntimeHandle``) resolves a
name here on first use, so a patched module that never reaches a call site never
imports a capability or its dependencies (torch, websockets, ...)."""

import importlib

_EXPORTS = {
    "emit": "core.events",
    "subscribe": "core.events",
    "capture": "core.events",
    "dump": "dump.api",
    "dump_context": "dump.api",
    "dump_step": "dump.api",
    "dump_microbatch": "dump.api",
    "dump_flush": "dump.api",
    "dump_state": "dump.api",
    "dump_configure": "dump.api",
    "dump_sglang_forward": "dump.sglang",
    "dump_sglang_forward_end": "dump.sglang",
    "dump_sglang_control": "dump.sglang",
    "dump_sglang_replay": "dump.sglang",
    "dump_sglang_graph_build": "dump.sglang",
    "features_forward": "features.capture",
    "features_layer": "features.capture",
    "features_final": "features.capture",
    "features_forward_end": "features.capture",
    "routing_enter": "routing.megatron.control",
    "routing_exit": "routing.megatron.control",
    "routing_topk": "routing.megatron.control",
    "routing_probs": "routing.megatron.control",
    "routing_fused": "routing.megatron.control",
    "routing_schedule": "routing.megatron.control",
    "routing_schedule_end": "routing.megatron.control",
    "routing_microbatch_begin": "routing.megatron.control",
    "routing_microbatch_end": "routing.megatron.control",
    "routing_step": "routing.megatron.control",
    "graph_build": "core.graph_stage",
    "graph_capture": "core.graph_stage",
    "graph_captured": "core.graph_stage",
    "graph_replay": "core.graph_stage",
    "graph_replayed": "core.graph_stage",
    "sglang_graph_built": "core.sglang_graphs",
    "sglang_graph_replay": "core.sglang_graphs",
    "sglang_graph_replayed": "core.sglang_graphs",
    "routing_sglang_topk": "routing.sglang.call_sites",
    "routing_sglang_batch": "routing.sglang.call_sites",
    "routing_sglang_release": "routing.sglang.call_sites",
    "routing_sglang_graph_build": "routing.sglang.call_sites",
    "weight_sync_attach": "weight_sync.sync",
    "weight_sync_step": "weight_sync.sync",
    "weight_sync_receive": "weight_sync.sync",
    "weight_sync_loaded": "weight_sync.sync",
    "weight_sync_version": "weight_sync.sync",
    "weight_sync_load_request": "weight_sync.sync",
    "trace": "trace",  # the package's export: it reads the settings (trace/control.py) before the first call
    "trace_step": "trace.api",
    "trace_state": "trace.control",
    "trace_sglang_graph_build": "trace.control",
}

__all__ = sorted(_EXPORTS)
_PACKAGE = __name__.rpartition(".")[0]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"the source-patch runtime has no {name!r} (available: {', '.join(__all__)})")
    value = getattr(importlib.import_module(f"{_PACKAGE}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
