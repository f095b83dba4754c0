"""The runtime: what inserted call sites call, through the ``__sp__`` handle
(:mod:`.facade`), organised by capability:

    core/      settings, events, endpoints, files, bounded reads, tags, ranks, failures, the capability
               contract, SGLang's batch rows, graph-safe call sites
    dump/      the dump runtime: call-site API, async writer, file format, control server, reader
    routing/   MoE routing: record format, Megatron capture/replay, SGLang capture/replay, alignment
    trace/     live tracing: call-site API, compressors, frames, WebSocket hub, client, browser view
    weight_sync/ weight sync trainer -> engines: sync API, transport, Megatron gathering, name mapping
    features/  feature streaming rollout -> trainer: refs, stores, the ref stream, hidden-state capture
    sentinels/ always-armed training watches: the first non-finite site, routing health, log-prob mismatch
    verdict/   after the fact, not a capability: compare two runs' dumps, replay a rollout, the twin

Capabilities depend on ``core`` only, never on each other; ``verdict`` reads them and nothing
of theirs imports it (tests/test_layout.py).
Submodules load on first use.  ``source_patch.runtime.emit``, ``.subscribe`` and
``.capture`` (in-process events, ``core/events.py``) are kept as shortcuts.
"""

_SHORTCUTS = ("emit", "subscribe", "capture")


def __getattr__(name: str):
    if name in _SHORTCUTS:
        from .core import events

        return getattr(events, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
