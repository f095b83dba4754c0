"""The SGLang side's state, on the ground floor: every module of routing/sglang/ imports
it downward; none assigns itself into another.

``S`` holds the settings in force (``mode``, ``dir``, ``replay``: control.py sets
them), the ambient batch (batch.py), the rows captured per forward and the requests'
places in the slot stores (capture.py), the replay source (replay.py) and the causes
already warned about; ``S.lock`` guards what the release and write_held paths read while a
forward writes.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .slot_store import SlotStore


class State:
    """Everything the SGLang side holds; ``S`` is its one instance (``reset`` forgets it all)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.config = None  # None: read the settings on first use
        self.mode = None
        self.dir = None
        self.last_error = None
        self.written = 0  # records written by capture
        self.rank = None
        self.batch = None  # (rids, lens, starts) of the current forward
        self.batch_slots = None  # (space, slots): the KV slot of each row of that forward
        self.skip = False  # the current forward is a draft model's or cannot be attributed: not routed here
        self.forward_id = -1
        self.current = None  # {"id", "layers": {layer: (ids, weights)}} the forward being captured
        self.stores = {"kv": SlotStore(), "virtual": SlotStore()}  # engine slots / private ones
        self.live = {}  # rid -> {"space", "start", "end", "gap", "vslots", "pool", "idx", "reach"}
        self.next_virtual = 0
        self.num_experts = None
        self.replay = None  # {rid: RoutingRecord}
        self.graph_ids = self.graph_experts = None  # a drained graph's ids of a layer, awaiting its weights
        self.warned = set()


S = State()


def warn_once(key, message):
    """One RuntimeWarning per process and ``key``: a serving engine is observed, never stopped."""
    if key not in S.warned:
        S.warned.add(key)
        warnings.warn(f"source-patch sglang routing: {message}", RuntimeWarning, stacklevel=3)


def this_rank():
    """The rank folder capture writes to: ``configure(rank=)``, else the process's rank."""
    if S.rank is not None:
        return S.rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))
