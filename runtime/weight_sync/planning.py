"""What a push sends, planned once per model chunk and layout: the engine's names,
shapes and dtypes (names.plan), the packed manifest, or the manifest and ``Buffers``
that send the parameters straight from Megatron's parameter buffers.  sync.py calls
``plan_for``; the data then goes one way: call site, plan, pack, backend.
"""

from __future__ import annotations

import logging
import weakref

from . import wire
from .wire import Manifest

log = logging.getLogger("source_patch.weight_sync")

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model chunk -> Plan, dropped with it


def plan_for(chunk, params, layout) -> "Plan":
    """The chunk's plan, kept while the walk holds the same parameters under the same names."""
    plan = _plans.get(chunk)
    # The walk's list is the same object while no module changed (named_params); a new
    # walk (something registered, maybe elsewhere) keeps the plan if it holds the same
    # parameters under the same names.
    if plan is None or plan.layout != layout or not _same(plan.params, params.params):
        plan = _plans[chunk] = Plan(params, layout)
    plan.params = params.params
    return plan


def _same(planned: list, walked: list) -> bool:
    return planned is walked or (len(planned) == len(walked) and all(
        a is b and name_a == name_b for (name_a, a), (name_b, b) in zip(planned, walked)))


class Plan:
    """A model chunk's engine specs and bucket layouts, planned once (each push only
    changes the version, and the sender's cached packing sees the same entries)."""

    def __init__(self, params, layout):
        from . import names as weight_names

        self.params, self.layout = params.params, layout
        self.specs = list(weight_names.plan(params.shapes(), layout))
        self.manifests: dict = {}
        self.buffers: dict = {}
        self.sources = None  # (windows' identities, program.Sources or None): the packed push's program

    def manifest(self, bucket_bytes: int, checksum: bool) -> Manifest:
        key = (bucket_bytes, checksum)
        if key not in self.manifests:
            self.manifests = {key: wire.plan(self.specs, bucket_bytes, 0, checksum)}
        return self.manifests[key]

    def packed(self, params, layout):
        """The packed push planned as kept operations (program.Sources), or None where
        a parameter is gathered on its own (no buffer windows): then it is mapped and
        packed tensor by tensor.  Runs this push's window check (collective: the other
        participants run it in their gathers).  Planned again when a storage or a
        window moved (one tensor per storage is checked)."""
        from . import megatron as weight_megatron
        from .program import Sources

        windows = params.check_windows()
        ident = tuple(id(windows[flag][0]) if windows[flag] else None for flag in (False, True))
        cached = self.sources
        if cached is not None and cached[0] == ident and (
                cached[1] is None or weight_megatron.unmoved(cached[1].anchors)):
            return cached[1]
        ops = params.ops(layout)
        sources = None if ops is None else Sources(
            ops, weight_megatron.storage_anchors(param for _, param in params.params), ident)
        self.sources = (ident, sources)
        return sources

    def from_buffers(self, params, layout, bucket_bytes: int, checksum: bool):
        """(manifest, Buffers, extras) to send the parameters from Megatron's own
        parameter buffers, or None when too few of them lie in one (no distributed
        optimizer).  extras: (Megatron name, parameter, indices of its mapped outputs
        that are not views of a buffer: a fused QKV split by copies), mapped anew at
        each push.  Planned once; planned again if a buffer moved."""
        from . import megatron as weight_megatron

        key = (bucket_bytes, checksum)
        cached = self.buffers.get(key)
        if cached is None or not weight_megatron.unmoved(cached[1]):
            anchors = weight_megatron.storage_anchors(param for _, param in params.params)
            self.buffers = {key: (_from_buffers(params, layout, *key), anchors)}
            cached = self.buffers[key]
        return cached[0]


def extra_tensors(extras, layout):
    """The tensors of a from-buffers plan that are not in a buffer, mapped anew (a
    generator: computed while the buckets before them are on the wire)."""
    from . import names as weight_names

    return (out for name, param, picks in extras
            for i, (_, out) in enumerate(weight_names.to_hf(name, param.detach(), layout)) if i in picks)


def _from_buffers(params, layout, bucket_bytes: int, checksum: bool):
    from . import names as weight_names

    shared: dict = {}
    for _, param in params.params:
        ptr = param.untyped_storage().data_ptr()
        shared[ptr] = shared.get(ptr, 0) + 1
    views, extras, extra_specs = [], [], []
    for name, param in params.params:
        picks = []
        for i, (hf, out) in enumerate(weight_names.to_hf(name, param.detach(), layout)):
            ptr = out.untyped_storage().data_ptr()
            if shared.get(ptr, 0) > 1 and out.is_contiguous() and (out.data_ptr() - ptr) % wire.ALIGN == 0:
                views.append((hf, out))
            else:
                picks.append(i)
                extra_specs.append((hf, tuple(out.shape), out.dtype))
        if picks:
            extras.append((name, param, frozenset(picks)))
    if len(views) < len(extra_specs):  # mostly not in shared buffers: packing is the better path
        return None
    try:
        manifest, buffers = wire.plan_buffers(views, bucket_bytes, 0, checksum, extra=extra_specs)
    except ValueError as exc:  # e.g. two mapped outputs over the same bytes
        log.info("weight sync: sending packed tensors, not from the parameter buffers: %s", exc)
        return None
    return manifest, buffers, extras
