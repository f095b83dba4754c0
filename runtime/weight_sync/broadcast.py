"""The broadcast backends, ``nccl`` (GPU) and ``gloo`` (CPU): the trainer (group rank
0) broadcasts every bucket to every engine rank over a process group of its own,
which the engines join through SGLang's ``/init_weights_update_group`` and read in
``update_weights_from_distributed`` (the protocol: sender.py; the engine end:
receiver.py, through sync.weight_sync_receive)."""

from __future__ import annotations

from typing import Optional

from . import link as weight_link
from . import sender
from .wire import Manifest, WeightSyncError


class Broadcast:
    """The trainer's end: a Link to the engines and the protocol's sender."""

    def __init__(self, link: weight_link.Link, name: str = "gloo"):
        self.link, self.name = link, name

    @classmethod
    def open(cls, name: str, *, host: str, port: int, world_size: int, group_name: str, timeout_s: float,
             nccl_ctas: int = 0, **_) -> "Broadcast":
        """Open (rank 0: serve) the update group the engines join."""
        if not port:
            raise WeightSyncError("weight_sync.port is not set (SOURCE_PATCH_WEIGHT_SYNC_PORT)")
        group = weight_link.open_group(host, port, 0, world_size, group_name, name, timeout_s, nccl_ctas)
        return cls(weight_link.Link(group, timeout_s), name)

    @property
    def broken(self) -> Optional[str]:
        return self.link.broken

    def send(self, manifest: Manifest, tensors, extra=(), *, replay_packing: bool = True) -> None:
        sender.send(self.link, manifest, tensors, extra=extra, replay_packing=replay_packing)

    def close(self) -> None:
        if self.link.group is not None:
            weight_link.close_group(self.link.group)
