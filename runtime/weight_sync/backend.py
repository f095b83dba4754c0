"""One interface, several backends: how a trainer's update reaches the engines.

    backend = open_backend("ipc", timeout_s=300, engines=["http://127.0.0.1:30000"])
    backend.send(manifest, tensors_or_buffers, extra=(), replay_packing=True)   # trainer rank 0
    backend.close()

| backend | bytes move by | engine request (SGLang admin) |
| --- | --- | --- |
| ``nccl`` / ``gloo`` (broadcast.py) | a broadcast over a process group | ``update_weights_from_distributed`` |
| ``ipc`` (ipc.py) | the engine copies from the trainer's exported memory (CUDA IPC, shared memory on CPU) | ``update_weights_from_tensor`` |
| ``mooncake`` (mooncake.py) | the engine reads the trainer's registered memory (TransferEngine) | ``update_weights_from_tensor`` |

All take the same manifest (wire.py), the same per-bucket checksums and versions
and refuse the same way: a receiver that refuses keeps serving its old weights.
The request backends carry the manifest in the engine request itself, as plain
JSON bytes (never pickle), with their own fields (where the memory is, the bucket
sums); ``receive_request`` is their engine end, picked by the request's
``backend`` field.  Settings reach a backend as arguments of ``open_backend``.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from . import wire
from .request import LOAD_FORMAT  # noqa: F401 - SGLang's load_format that selects our receivers
from .wire import Manifest, WeightSyncError

BROADCAST = ("nccl", "gloo")
REQUEST = ("ipc", "mooncake")


class Backend(Protocol):
    """The trainer's end of a backend."""

    name: str
    broken: Optional[str]  # why it cannot be used any more (then open a new one)

    def send(self, manifest: Manifest, tensors, extra=(), *, replay_packing: bool = True) -> None: ...

    def close(self) -> None: ...


def resolve(name: str) -> str:
    """``auto``: nccl when CUDA is available, else gloo."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BROADCAST + REQUEST:
        raise WeightSyncError(f"unknown weight-sync backend {name!r} (one of auto, {', '.join(BROADCAST + REQUEST)})")
    return name


def open_backend(name: str, **options) -> Backend:
    """The trainer's end of backend ``name``; ``options``: the weight_sync settings
    (each backend takes the ones it names in its signature)."""
    name = resolve(name)
    if name in BROADCAST:
        from .broadcast import Broadcast as cls
    elif name == "ipc":
        from .ipc import IpcSender as cls
    else:
        from .mooncake import MooncakeSender as cls
    return cls.open(name, **options)


_known = None  # (tensors JSON, entries) of the last request: a layout is parsed once


def receive_request(payload: bytes, *, device: torch.device, max_metadata_bytes: int, max_update_bytes: int,
                    check: Optional[Callable[[Manifest], None]] = None, rank: int = 0, **options):
    """An engine's end of a request backend: the update described by ``payload`` (an
    engine request's bytes), its bucket sums verified: an Update whose tensors are
    ready to load.  Raises WeightSyncError (ChecksumMismatch, ManifestError) and
    keeps nothing of a refused update.  ``options``: the weight_sync settings a
    backend's engine end takes (mooncake: ``mooncake_*``)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not 0 < len(payload) <= max_metadata_bytes:
        raise wire.ManifestError(f"an engine request of {len(payload) if hasattr(payload, '__len__') else '?'} "
                                 f"bytes (max_metadata_bytes={max_metadata_bytes})")
    global _known
    payload = bytes(payload)
    manifest, fields = wire.parse_request(payload, max_update_bytes, _known)
    _known = (wire.split_tensors(payload)[1], manifest.entries)  # the same tensors next time: not parsed again
    name = fields.get("backend")
    if name == "ipc":
        from .ipc import receive as receive_backend
    elif name == "mooncake":
        from .mooncake import receive as receive_backend
    else:
        raise wire.ManifestError(f"an engine request for backend {str(name)[:40]!r} (expected ipc or mooncake)")
    if check is not None:
        check(manifest)
    return receive_backend(manifest, fields, device=device, rank=rank, **options)
