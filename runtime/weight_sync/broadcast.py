"""The broadcast backends, ``nccl`` (GPU) and ``gloo`` (CPU): the trainer (group rank
0) broadcasts every bucket to every engine rank over a process group of its own,
which the engines join through SGLang's ``/init_weights_update_group`` and read in
``update_weights_from_distributed`` (the protocol: sender.py; the engine end:
receiver.py, through sync.weight_sync_receive).

Two things on top of one group's send:

- ``Snapshot``: the update packed once into a stream of its own (one copy of its
  bytes), from which it can be sent later (the overlapped push: the parameters may
  change meanwhile) and more than once (to several groups);
- ``Fanout``: several update groups, one per engine (a TP 2 engine is one group of
  1 + 2 ranks): every update is sent on each group by its own broadcast, so each
  engine group runs its own handshake, manifest, checksums and verdict, and the
  trainer's bytes on the wire are the update's once per group.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from . import link as weight_link
from . import program, sender
from .wire import Buffers, Manifest, WeightSyncError, first_line, too_many_buckets


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

    @property
    def device(self) -> torch.device:
        return self.link.device

    def send(self, manifest: Manifest, tensors, extra=(), *, replay_packing: bool = True) -> None:
        sender.send(self.link, manifest, tensors, extra=extra, replay_packing=replay_packing)

    def close(self) -> None:
        self.link.close()


def link_device(name: str) -> torch.device:
    """The device a broadcast backend's link sends from (nccl: the current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")


class Snapshot:
    """An update packed into one stream of its own (``total_bytes``, kept while the
    update's size and device hold): ``take`` packs every bucket into its window of it
    (the same packings the ipc backend packs its export with: a program's gathers and
    copies, a buffer's spans, tensors), and returns the stream as ``Buffers`` that
    ``send`` sends from, bucket by bucket, with no copy and no per-tensor work.

    On a GPU the copies run on a stream of their own (``side``) that first waits for
    the current one (the optimizer step's writes), and the current stream then waits
    for them, on the device: the next step's writes to the parameters cannot overtake
    the copies, and the host waits for nothing.  A send from the snapshot runs on
    ``side`` (after the copies, beside the next step's kernels)."""

    def __init__(self):
        self.stream: Optional[torch.Tensor] = None
        self.buffers: Optional[Buffers] = None  # the stream as one piece: what send() sends from
        self.packing = None
        self.side = None  # cuda: the stream the copies (and the sends from it) run on
        self.last_s = None  # host time of the last take

    def take(self, manifest: Manifest, tensors, extra=(), *, device: torch.device,
             replay_packing: bool = True) -> Buffers:
        """Pack the update (``tensors`` and ``extra`` as ``sender.send`` takes them)
        into the stream; its Buffers.  On failure the rest of ``tensors`` is still
        consumed (a program's gathers drained), as ``sender.send`` does, so whoever
        produces them stays in step with its peers."""
        start = time.perf_counter()
        planned = isinstance(tensors, (Buffers, program.Sources))
        source = iter(extra) if planned else iter(tensors)
        if isinstance(tensors, program.Sources):
            tensors.done = 0
        try:
            refusal = too_many_buckets(manifest.bucket_bytes, manifest.total_bytes)
            if refusal:
                raise WeightSyncError(f"update v{manifest.version} refused: {refusal}")
            if isinstance(tensors, Buffers) and tensors.pieces:
                device = tensors.device
            packing = self._packing(manifest, tensors, sender._indexed(device))
            packing.replay_copies(replay_packing)
            side = self._side()
            with torch.no_grad(), torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for k, sources in packing.batches(source):
                    if k < manifest.buckets:  # an update of 0 bytes has tensors but no bucket
                        packing.pack(k, sources)
            if side is not None:  # the next step's writes wait for the copies (on the device)
                torch.cuda.current_stream(self.stream.device).wait_stream(side)
        except Exception:
            if isinstance(tensors, program.Sources):  # the other participants' gathers still need rank 0
                tensors.drain()
            for _ in source if not planned else ():
                pass
            raise
        self.last_s = time.perf_counter() - start
        return self.buffers

    def _packing(self, manifest: Manifest, tensors, device: torch.device):
        """The packing into the stream, kept while the layout and the source hold."""
        total = manifest.total_bytes
        if self.stream is None or self.stream.numel() != max(total, 1) or self.stream.device != device:
            self.stream = self.buffers = self.packing = None  # free the old one first
            self.stream = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            self.buffers = Buffers(((0, self.stream[:total]),) if total else (), (), device)
        packing, stream = self.packing, self.stream
        if isinstance(tensors, program.Sources):
            if not isinstance(packing, program.Program) or not packing.matches(manifest, tensors):
                self.packing = None  # its carries go first
                packing = program.Program(manifest, tensors, device, stream=stream)
        elif isinstance(tensors, Buffers):
            if not isinstance(packing, sender._Spans) or not packing.matches(manifest, tensors):
                packing = sender._Spans(manifest, tensors, stream=stream)
        elif not isinstance(packing, sender._Packing) or not packing.matches(manifest):
            packing = sender._Packing(manifest, device, stream=stream)
        self.packing = packing
        return packing

    def _side(self):
        if self.stream is None or self.stream.device.type != "cuda":
            return None
        if self.side is None:
            self.side = torch.cuda.Stream(self.stream.device)
        self.side.wait_stream(torch.cuda.current_stream(self.stream.device))  # the optimizer step's writes
        return self.side

    def sending(self):
        """The context a send from this snapshot runs in (cuda: on ``side``, so it
        follows the copies and not the training stream)."""
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()


def parse_groups(items, group_name: str) -> list:
    """The ``groups`` setting's items, ``PORT:WORLD_SIZE[:NAME]``, as
    [{"port", "world_size", "group_name"}] (NAME: ``group_name``)."""
    out = []
    for item in items or ():
        parts = str(item).split(":")
        out.append({"port": int(parts[0]), "world_size": int(parts[1]),
                    "group_name": parts[2] if len(parts) > 2 and parts[2] else group_name})
    return out


class _Group:
    """One engine group of a Fanout: where it meets, its Broadcast once open, what it got."""

    def __init__(self, port: int, world_size: int, group_name: str):
        self.port, self.world_size, self.group_name = port, world_size, group_name
        self.backend: Optional[Broadcast] = None
        self.version = None   # the last version this group verified (its verdict OK)
        self.bytes = 0        # bytes the trainer broadcast on this group for its last update
        self.updates = self.failures = 0
        self.last_error: Optional[str] = None

    def state(self) -> dict:
        return {"group_name": self.group_name, "port": self.port, "world_size": self.world_size,
                "version": self.version, "bytes": self.bytes, "updates": self.updates, "failures": self.failures,
                "last_error": self.last_error, "connected": self.backend is not None and not self.backend.broken}


class Fanout:
    """The trainer's end for several update groups, one per engine (or engine group):
    each group is an update group of its own (a TCPStore on ``host:port`` under its
    ``group_name``, ``world_size`` = 1 + the engine's ranks), opened when first used
    and opened again when it broke, independently of the others.

    ``send`` sends the update on each group in turn by its own broadcast (the
    protocol of one group, unchanged: handshake, manifest where a receiver lacks the
    layout, buckets with their checksums, verdict).  Each group has its own verdict, so
    an engine group that refuses or fails an update keeps its old version while the
    others take it; ``send`` then raises naming the groups that failed, after every
    group had its turn.  The update is read once: ``Buffers`` without extras are sent
    from the buffers to each group; their extras are taken once and sent to each; a
    packed update (a program's gathers, tensors) is packed once into a ``Snapshot``
    and sent from it (memory: one copy of the update).  The trainer's bytes on the
    wire: the update's (plus its checksums, and the manifest where it travels) once
    per group, counted per group on its link (``state()``)."""

    def __init__(self, name: str, groups: list, *, host: str, timeout_s: float, nccl_ctas: int = 0):
        if not groups:
            raise WeightSyncError("weight_sync.groups is empty")
        self.name, self.host, self.timeout_s, self.nccl_ctas = name, host, float(timeout_s), nccl_ctas
        self.groups = [_Group(**g) for g in groups]
        self.snapshot = Snapshot()
        self.broken = None  # a broken group is opened again at the next send, alone

    @classmethod
    def open(cls, name: str, *, groups, group_name: str, host: str, timeout_s: float, nccl_ctas: int = 0,
             **_) -> "Fanout":
        return cls(name, parse_groups(groups, group_name), host=host, timeout_s=timeout_s, nccl_ctas=nccl_ctas)

    @property
    def device(self) -> torch.device:
        return link_device(self.name)

    def state(self) -> list:
        return [g.state() for g in self.groups]

    def send(self, manifest: Manifest, tensors, extra=(), *, replay_packing: bool = True) -> None:
        context = contextlib.nullcontext()
        if isinstance(tensors, Buffers):
            if tensors is self.snapshot.buffers:
                context = self.snapshot.sending()
            extra = list(extra)  # taken once, sent to every group
        else:
            tensors = self.snapshot.take(manifest, tensors, extra, device=self.device, replay_packing=replay_packing)
            extra, context = [], self.snapshot.sending()
        failed = []
        with context:
            for group in self.groups:
                error = self._send(group, manifest, tensors, extra, replay_packing)
                if error:
                    failed.append(f"{group.group_name}@{group.port}: {error}")
        if failed:
            raise WeightSyncError(f"update v{manifest.version} failed on {len(failed)} of {len(self.groups)} "
                                  f"engine groups ({'; '.join(failed)})")

    def _send(self, group: _Group, manifest: Manifest, tensors, extra: list, replay_packing: bool):
        try:
            if group.backend is None or group.backend.broken:
                if group.backend is not None:
                    group.backend.close()
                group.backend = None
                group.backend = Broadcast.open(self.name, host=self.host, port=group.port,
                                               world_size=group.world_size, group_name=group.group_name,
                                               timeout_s=self.timeout_s, nccl_ctas=self.nccl_ctas)
            link = group.backend.link
            before = link.broadcast_bytes
            try:
                group.backend.send(manifest, tensors, extra=extra, replay_packing=replay_packing)
            finally:
                group.bytes = link.broadcast_bytes - before
        except Exception as exc:  # noqa: BLE001 - this group's failure; the others still get the update
            group.failures += 1
            group.last_error = f"v{manifest.version}: {type(exc).__name__}: {first_line(exc)}"
            return f"{type(exc).__name__}: {first_line(exc)}"
        group.version, group.updates = manifest.version, group.updates + 1
        return None

    def close(self) -> None:
        for group in self.groups:
            backend, group.backend = group.backend, None
            if backend is not None:
                backend.close()
