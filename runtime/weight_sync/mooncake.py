"""The ``mooncake`` backend: the trainer packs each update into memory registered
with a Mooncake TransferEngine, and each engine reads it from there with its own
TransferEngine (RDMA in production; TCP, on loopback in the tests).  The engine
request (SGLang's ``update_weights_from_tensor``, load_format "source_patch") carries
the manifest as JSON with the trainer's segment name, the memory's address and the
bucket sums; nothing is pickled.

    trainer: pack into the registered stream -> bucket sums -> POST the request
    engine:  read every bucket into its own registered buffer (one batch) -> verify -> load

Segments are found through ``metadata``: ``P2PHANDSHAKE`` (the engines ask the
trainer's engine directly) or a metadata server's URL, such as a ``mooncake_master``
started with ``--enable_http_metadata_server`` (``http://127.0.0.1:PORT/metadata``).
The memory is registered once and again only when it moves (a larger update).  The
stream lives in host memory (the mooncake build without CUDA registers host memory
only): on a GPU trainer the packing copies device to host, and a GPU engine copies its
host buffer to the device.
"""

from __future__ import annotations

import threading

import torch

from ..core.endpoint import free_port
from .receiver import Update
from .request import RequestSender
from .wire import Manifest, ManifestError, WeightSyncError, verify_sums


def _transfer_engine(host: str, metadata: str, protocol: str, device: str):
    """A started TransferEngine and the segment name peers read it by."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise WeightSyncError(f"the mooncake backend needs mooncake-transfer-engine ({exc})") from None
    engine = TransferEngine()
    p2p = metadata == "P2PHANDSHAKE"
    name = host if p2p else f"{host}:{free_port()}"  # a segment name of its own on the metadata server
    if engine.initialize(name, metadata, protocol, device) != 0:
        raise WeightSyncError(f"Mooncake TransferEngine did not start (host {host}, metadata {metadata}, "
                              f"protocol {protocol})")
    return engine, (f"{host}:{engine.get_rpc_port()}" if p2p else name)


class _Registered:
    """A uint8 host buffer registered with ``engine`` (unregistered when replaced)."""

    def __init__(self, engine, nbytes: int):
        self.engine, self.nbytes = engine, nbytes
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                  pin_memory=torch.cuda.is_available())
        if engine.register_memory(self.tensor.data_ptr(), self.tensor.numel()) != 0:
            raise WeightSyncError(f"Mooncake refused to register {nbytes} bytes")

    def close(self) -> None:
        self.engine.unregister_memory(self.tensor.data_ptr())


class MooncakeSender(RequestSender):
    """The trainer's end: a TransferEngine, the registered stream, the engines' URLs."""

    name = "mooncake"

    def __init__(self, engines: list, timeout_s: float = 300.0, host: str = "127.0.0.1",
                 metadata: str = "P2PHANDSHAKE", protocol: str = "tcp", device: str = ""):
        super().__init__(engines, timeout_s)
        self.engine, self.segment = _transfer_engine(host, metadata, protocol, device)
        self.registrations = 0

    @classmethod
    def open(cls, name: str, *, engines=None, timeout_s: float = 300.0, mooncake_host: str = "127.0.0.1",
             mooncake_metadata: str = "P2PHANDSHAKE", mooncake_protocol: str = "tcp", mooncake_device: str = "",
             **_) -> "MooncakeSender":
        return cls(engines or [], timeout_s, mooncake_host, mooncake_metadata, mooncake_protocol, mooncake_device)

    def _stream_device(self, tensors) -> torch.device:
        return torch.device("cpu")  # registered host memory (the mooncake build without CUDA)

    def _new_memory(self, nbytes: int, device: torch.device) -> "_Registered":
        self.registrations += 1
        return _Registered(self.engine, nbytes)

    def _memory_fields(self) -> dict:
        return {"segment": self.segment, "address": self.memory.tensor.data_ptr()}


# ------------------------------------------------------------------ engine

_engine_lock = threading.Lock()
_reader: dict = {}  # (host, metadata, protocol, device) -> (TransferEngine, segment); "staged": (entries, _Registered, views)


def receive(manifest: Manifest, fields: dict, *, device: torch.device, rank: int = 0,
            mooncake_host: str = "127.0.0.1", mooncake_metadata: str = "P2PHANDSHAKE",
            mooncake_protocol: str = "tcp", mooncake_device: str = "", **_) -> Update:
    """Read the update from the trainer's registered memory into this engine's own
    registered buffer, verify the bucket sums, and hand out views (on ``device``).
    The ``mooncake_*`` settings start this process's TransferEngine (once)."""
    memory = fields.get("memory")
    if not isinstance(memory, dict) or not isinstance(memory.get("segment"), str) or \
            not isinstance(memory.get("address"), int) or isinstance(memory.get("address"), bool):
        raise ManifestError("the request names no registered memory (memory.segment, memory.address)")
    with _engine_lock:
        engine = _engine((mooncake_host, mooncake_metadata, mooncake_protocol, mooncake_device))
        stream, views = _stage(engine, manifest)
        n = manifest.buckets
        if n:
            windows = [manifest.window(k) for k in range(n)]
            rc = engine.batch_transfer_sync_read(
                memory["segment"], [stream.data_ptr() + lo for lo, _ in windows],
                [memory["address"] + lo for lo, _ in windows], [hi - lo for lo, hi in windows])
            if rc != 0:
                raise WeightSyncError(f"reading v{manifest.version} from {memory['segment'][:200]} failed "
                                      f"(Mooncake rc {rc}): the trainer is gone or its memory moved")
        verify_sums(manifest, stream, fields.get("sums"))
        if device.type != "cpu":  # a GPU engine: its host buffer to the device, once
            on_device = stream[: manifest.total_bytes].to(device)
            views = [(e.name, on_device[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape))
                     for e in manifest.entries]
        return Update(manifest.version, manifest, list(views), lambda: None)


def _engine(options: tuple):
    if options not in _reader:
        _reader[options] = _transfer_engine(*options)
    return _reader[options][0]


def _stage(engine, manifest: Manifest):
    staged = _reader.get("staged")
    if staged is None or (staged[0] is not manifest.entries and staged[0] != manifest.entries) \
            or staged[1].nbytes != manifest.total_bytes:
        if staged is not None:
            _reader.pop("staged")[1].close()
        buffer = _Registered(engine, manifest.total_bytes)
        stream = buffer.tensor
        views = [(e.name, stream[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape))
                 for e in manifest.entries]
        staged = _reader["staged"] = (manifest.entries, buffer, views)
    return staged[1].tensor, staged[2]
