"""A record to and from Megatron-Core's own ``RouterReplay`` (megatron-core >= 0.16).

RouterReplay keeps, per router instance in its registry (instantiation order), the
``[tokens, topk]`` ids of the last call; these functions map registry positions to a
record's layers.  Megatron is imported only when a function needs the registry.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .file import RoutingRecordError
from .record import RoutingRecord


def _router_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def to_megatron_native(record: RoutingRecord, *, layers: Sequence[int] | None = None, device=None,
                       install: bool = False) -> list:
    """The list Megatron's ``RouterReplay.set_replay_data`` takes: one ``[tokens, topk]``
    int64 tensor per router instance, in the registry's (instantiation) order.

    ``layers``: the record layer for each registry position (default: the record's
    layers, sorted; see :func:`megatron_replay_layers`).  ``install=True`` also
    calls ``RouterReplay.set_replay_data`` with it (each call also queues the
    tensors for ``REPLAY_BACKWARD`` recompute)."""
    layers = list(record.layers if layers is None else layers)
    missing = [layer for layer in layers if layer not in record.indices]
    if missing:
        raise RoutingRecordError(f"record has no layer {missing[0]} (it has {record.layers})")
    out = [record.indices[layer].to(device=device, dtype=torch.int64) for layer in layers]
    if install:
        replay = _router_replay_class()
        count = len(replay.global_router_replay_instances)
        if count != len(out):
            raise RoutingRecordError(f"{len(out)} layers for {count} RouterReplay instances "
                                     "(enable moe_enable_routing_replay and pass layers=)")
        replay.set_replay_data(out)
    return out


def from_megatron_native(data: Sequence | None = None, *, num_experts: int, layers: Sequence[int] | None = None,
                         **fields) -> RoutingRecord:
    """A record from ``RouterReplay.get_recorded_data()`` (the default ``data``): per
    router instance, the ``[tokens, topk]`` indices of its last recorded call.

    ``layers``: the layer id of each registry position (default ``0 .. n-1``).
    Other keyword arguments are :class:`RoutingRecord` fields (``seq_lens``,
    ``sample_ids``, ``parallel``, ...).  An instance that recorded nothing is an
    error, never an empty layer."""
    if data is None:
        data = _router_replay_class().get_recorded_data()
    data = list(data)
    layers = list(range(len(data)) if layers is None else layers)
    if len(layers) != len(data):
        raise RoutingRecordError(f"{len(data)} recorded tensors but {len(layers)} layer ids")
    if len(set(layers)) != len(layers):
        raise RoutingRecordError(f"duplicate layer ids {layers}")
    for pos, (layer, t) in enumerate(zip(layers, data)):
        if t is None:
            raise RoutingRecordError(f"RouterReplay instance {pos} (layer {layer}) recorded nothing: set "
                                     "RouterReplayAction.RECORD and run a forward first")
    return RoutingRecord(indices={layer: t.detach().to("cpu", torch.int64) for layer, t in zip(layers, data)},
                         num_experts=num_experts, **fields)


def megatron_replay_layers(*models) -> list:
    """The Megatron layer number of each ``RouterReplay`` instance, in registry order.

    Found through the routers (``router.router_replay``, ``router.layer_number``) in
    ``models`` (several for virtual pipeline chunks); every registered instance must
    belong to one of them."""
    owner = {}
    for model in models:
        for module in model.modules():
            replay = getattr(module, "router_replay", None)
            if replay is not None and hasattr(module, "layer_number"):
                owner[id(replay)] = module.layer_number
    out = []
    for pos, replay in enumerate(_router_replay_class().global_router_replay_instances):
        if id(replay) not in owner:
            raise RoutingRecordError(f"RouterReplay instance {pos} belongs to no router of the given models")
        out.append(owner[id(replay)])
    return out
