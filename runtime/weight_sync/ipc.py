"""The ``ipc`` backend, for a trainer and its engines on the same machine (colocated:
the same GPUs): the trainer packs each update into memory it exported once, and each
engine copies the bytes device to device (on CPU: from a shared-memory file).
Nothing crosses a link and nothing is pickled: the engine request
(SGLang's ``update_weights_from_tensor``, load_format "source_patch") carries the
manifest as JSON with the memory's handle as plain bytes (base64) and the bucket sums.

    trainer: pack into the exported stream -> bucket sums -> device sync -> POST the request
    engine:  map the handle (once per handle) -> copy into its own buffer -> verify sums -> load

The memory is exported once and again only when it moves (a larger update, another
device); an engine maps each handle once.  A trainer that dies before the request
changes nothing on the engine; a refused request (a wrong sum, a bad manifest) leaves
the engine on its old weights.
"""

from __future__ import annotations

import base64
import itertools
import os
import re
import secrets
import stat
from typing import Optional

import torch

from . import copysum
from .receiver import Update
from .request import RequestSender
from .wire import Buffers, Manifest, ManifestError, WeightSyncError, verify_sums

SHM_DIR = "/dev/shm"  # where CPU exports live (named shared memory)
_NAME = re.compile(r"sp-ws-[0-9]+-[0-9]+-[0-9a-f]{8}\Z")
_counter = itertools.count()
MAX_MAPPED = 4  # an engine keeps this many mapped exports (a new one appears only when the trainer's moves)


class Exported:
    """A uint8 buffer another process on this machine can map, and the fields that say how."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device, self.path = nbytes, device, None
        if device.type == "cuda":
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            shared = self.tensor.untyped_storage()._share_cuda_()
            dev, handle, size, offset, ref_handle, ref_offset, event, event_sync = shared
            self.fields = {"kind": "cuda", "device": int(dev), "handle": _b64(handle), "size": int(size),
                           "offset": int(offset), "ref_counter_handle": _b64(ref_handle),
                           "ref_counter_offset": int(ref_offset), "event_handle": _b64(event),
                           "event_sync_required": bool(event_sync)}
            return
        name = f"sp-ws-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.tensor = torch.from_file(self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self.fields = {"kind": "shm", "name": name, "nbytes": max(nbytes, 1)}

    def close(self) -> None:
        """Unlink a shared-memory export (engines that mapped it keep their mapping)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def _b64(data) -> str:
    return base64.b64encode(bytes(data or b"")).decode()


class IpcSender(RequestSender):
    """The trainer's end: one exported stream, the packing plan into it, the engines' URLs."""

    name = "ipc"

    def __init__(self, engines: list, timeout_s: float = 300.0, device: Optional[torch.device] = None):
        super().__init__(engines, timeout_s)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.exports = 0  # how many times memory was exported (once, unless it had to move)

    @classmethod
    def open(cls, name: str, *, engines=None, timeout_s: float = 300.0, **_) -> "IpcSender":
        return cls(engines or [], timeout_s)

    def _stream_device(self, tensors) -> torch.device:
        return tensors.device if isinstance(tensors, Buffers) and tensors.pieces else self.device

    def _moved(self, device: torch.device) -> bool:
        return self.memory.device != device

    def _new_memory(self, nbytes: int, device: torch.device) -> Exported:
        self.exports += 1
        return Exported(nbytes, device)

    def _memory_fields(self) -> dict:
        return self.memory.fields


# ------------------------------------------------------------------ engine


_mapped: dict = {}   # export key -> the trainer's memory, mapped here
_staged: dict = {}   # device -> (entries, stream, views): this engine's copy, reused while the layout holds


def receive(manifest: Manifest, fields: dict, *, device: torch.device, rank: int = 0, **_) -> Update:
    """Copy the update out of the trainer's exported memory into this engine's own
    buffer, verify the bucket sums, and hand out views of it."""
    source = _map(fields.get("memory"), manifest.total_bytes)[: manifest.total_bytes]
    entries, stream, views = _stage(manifest, device)
    computed = None
    if manifest.total_bytes and manifest.checksum and copysum.usable(source, stream, manifest.bucket_bytes):
        computed = torch.empty(manifest.buckets, dtype=torch.int64, device=device)
        copysum.copy_and_sum(source, stream, manifest.bucket_bytes, computed)  # one pass: no second read
    elif manifest.total_bytes:
        stream.copy_(source)
    verify_sums(manifest, stream, fields.get("sums"), computed)
    return Update(manifest.version, manifest, list(views), lambda: None)


def _stage(manifest: Manifest, device: torch.device):
    staged = _staged.get(device)
    if staged is None or (staged[0] is not manifest.entries and staged[0] != manifest.entries) \
            or staged[1].numel() != manifest.total_bytes:
        _staged.pop(device, None)  # free the old buffer first
        stream = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
        views = [(e.name, stream[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape))
                 for e in manifest.entries]
        staged = _staged[device] = (manifest.entries, stream, views)
    return staged


def _map(memory, total: int) -> torch.Tensor:
    """The trainer's exported memory as a uint8 tensor of at least ``total`` bytes."""
    if not isinstance(memory, dict) or memory.get("kind") not in ("shm", "cuda"):
        raise ManifestError("the request names no exported memory (memory.kind: shm or cuda)")
    key = tuple(sorted((k, str(v)) for k, v in memory.items()))
    mapped = _mapped.get(key)
    if mapped is None:
        mapped = _map_shm(memory) if memory["kind"] == "shm" else _map_cuda(memory)
        if len(_mapped) >= MAX_MAPPED:
            _mapped.clear()  # a bound, not an LRU: the trainer's memory rarely moves
        _mapped[key] = mapped
    if mapped.numel() < total:
        raise ManifestError(f"the exported memory holds {mapped.numel()} bytes, the update {total}")
    return mapped


def _map_shm(memory: dict) -> torch.Tensor:
    name, nbytes = memory.get("name"), memory.get("nbytes")
    if not isinstance(name, str) or not _NAME.match(name) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ManifestError(f"bad shared-memory export {str(memory)[:200]}")
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise WeightSyncError(f"cannot open the trainer's shared memory {name}: {exc.strerror}") from None
    # /dev/shm is everyone's: only a trainer of this user exports there for this engine
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        raise ManifestError(f"shared memory {name} is not a regular file of this user's (uid {st.st_uid})")
    size = st.st_size
    if size < nbytes:  # mapping past the file's end would fault on read
        raise ManifestError(f"shared memory {name} holds {size} bytes, the request says {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _map_cuda(memory: dict) -> torch.Tensor:
    """torch's own CUDA IPC rebuild (torch.multiprocessing.reductions.rebuild_cuda_tensor),
    from plain fields instead of a pickle."""
    try:
        args = (int(memory["device"]), base64.b64decode(memory["handle"], validate=True), int(memory["size"]),
                int(memory["offset"]), base64.b64decode(memory["ref_counter_handle"], validate=True),
                int(memory["ref_counter_offset"]), base64.b64decode(memory["event_handle"], validate=True),
                bool(memory["event_sync_required"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"bad CUDA export: {type(exc).__name__}: {exc}") from None
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", args[0])).set_(
        storage, 0, (args[2],), (1,))
