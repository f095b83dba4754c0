"""Where a watching capability meets the call sites of the others, without importing them.

The sentinels (runtime/sentinels/) watch what the dump and routing call sites see: they
set the hooks below, and those call sites call them (one ``is None`` test when no one
watches).  Capabilities import core only, so the seam lives here.

    tensor_hook(name, tensor, layer)          dump's call sites on the training side, dumps on or off
    routes_hook(layer, topk_ids, scores, replayed)   Megatron's router call site (routing/megatron):
                                              the router's own top-k ids, its scores (logits or
                                              probabilities over all experts, [tokens, experts]),
                                              and the ids replayed in their place (None: not replaying)

A hook never raises into the call site (the watcher catches and counts its own failures).

``tensor_hook`` is set through :func:`set_tensor_hook`, which tells the modules that
:func:`listen`: dump's disabled call site keeps a single flag test (dumping on, or a hook
set) that it recomputes only when the hook changes, instead of testing the hook on
every call.
"""

from __future__ import annotations

tensor_hook = None
routes_hook = None

_listeners: list = []


def set_tensor_hook(hook) -> None:
    """Set (or, with None, clear) ``tensor_hook`` and tell every listener."""
    global tensor_hook
    tensor_hook = hook
    for listener in tuple(_listeners):
        listener()


def listen(listener) -> None:
    """Call ``listener()`` now and whenever ``tensor_hook`` changes (it reads the hook itself)."""
    _listeners.append(listener)
    listener()
