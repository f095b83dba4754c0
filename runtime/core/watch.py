"""Where a watching capability meets the call sites of the others, without importing them.

The sentinels (runtime/sentinels/) watch what the dump and routing call sites see: they
set the hooks below, and those call sites call them (one ``is None`` test when no one
watches).  Capabilities import core only, so the seam lives here.

    tensor_hook(name, tensor, layer)          dump's call sites on the training side, dumps on or off
    routes_hook(layer, topk_ids, scores, replayed)   Megatron's router call site (routing/megatron):
                                              the router's own top-k ids, its scores (logits or
                                              probabilities over all experts, [tokens, experts]),
                                              and the ids replayed in their place (None: not replaying)

    capture                                   the sentinels' mismatch capture (sentinels/capture.py), read
                                              by dump's training-side call sites: None, or an object with
                                              ``request_ids`` (frozenset of the request ids to dump),
                                              ``phase`` (the pass to dump them in: "fwd_bwd"), ``folder``
                                              (the run folder its records go to), ``take(nbytes) -> bool``
                                              (charge a record against the run's max_bytes; False: over,
                                              write nothing more), ``seen(rows)`` (a core/rows.Rows of a
                                              micro-batch holding one of them: its token ids) and
                                              ``writer(flush)`` (the dump's flush(timeout), handed over
                                              so that the capture can wait for its records on disk)

A hook never raises into the call site (the watcher catches and counts its own failures).

``tensor_hook`` and ``capture`` are set through :func:`set_tensor_hook` and
:func:`set_capture`, which tell the modules that :func:`listen`: dump's disabled call
site keeps a single flag test (dumping on, a hook or a capture set) that it recomputes
only when one of them changes, instead of testing them on every call.
"""

from __future__ import annotations

tensor_hook = None
routes_hook = None
capture = None

_listeners: list = []


def set_tensor_hook(hook) -> None:
    """Set (or, with None, clear) ``tensor_hook`` and tell every listener."""
    global tensor_hook
    tensor_hook = hook
    for listener in tuple(_listeners):
        listener()


def set_capture(value) -> None:
    """Set (or, with None, clear) ``capture`` and tell every listener."""
    global capture
    capture = value
    for listener in tuple(_listeners):
        listener()


def listen(listener) -> None:
    """Call ``listener()`` now and whenever ``tensor_hook`` or ``capture`` changes (it reads
    them itself)."""
    _listeners.append(listener)
    listener()
