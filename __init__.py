"""source-patch: instrument Megatron-Core and SGLang without forking them.

The names a training framework calls, loaded on first use (PEP 562: importing this
package imports nothing, so the start hook stays cheap)::

    import source_patch
    rows = source_patch.batch(request_ids, prompt_lengths, response_lengths, layout="padded", ...)

``batch``: name the rows of one micro-batch (runtime/core/rows.py): the dump writes its
row map, routing replay aligns request records to it.  ``watch_logprobs``: the trainer's
log-probs of the rollout's tokens against the rollout's, per sample (the sentinels'
mismatch watch, runtime/sentinels/mismatch.py: docs/sentinels.md).  The patcher's API (``activate``,
``patched``, ...) is ``source_patch.patcher``'s, also reachable here.
"""

# public name -> (module, attribute)
_EXPORTS = {
    "batch": ("source_patch.runtime.core.rows", "batch"),
    "Rows": ("source_patch.runtime.core.rows", "Rows"),
    "watch_logprobs": ("source_patch.runtime.sentinels.mismatch", "watch_logprobs"),
    "activate": ("source_patch.patcher", "activate"),
    "patched": ("source_patch.patcher", "patched"),
    "import_patched_copy": ("source_patch.patcher", "import_patched_copy"),
    "load_spec": ("source_patch.patcher", "load_spec"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    module, attr = _EXPORTS[name]
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
