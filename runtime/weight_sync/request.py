"""The engine request of the request backends (ipc, mooncake): the trainer posts its
manifest, as JSON bytes, through SGLang's own admin requests; the engine answers
whether it loaded it."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

import torch

from ..core import bounded
from . import program, sender
from .wire import Buffers, ChecksumMismatch, Manifest, WeightSyncError, bucket_sum, request_json, too_many_buckets

LOAD_FORMAT = "source_patch"  # SGLang's load_format that selects our receivers
MAX_REPLY_BYTES = 1 << 20     # an engine's answer is a few hundred bytes; a larger one is refused


class RequestSender:
    """The trainer's end of a request backend (ipc.py, mooncake.py): each update is
    packed into one region of memory the engines can reach (``memory``: made by
    ``_new_memory``, made again only when the update no longer fits, or ``_moved``),
    then the engine request goes to every engine.  A backend says how its memory is
    made and named (``_memory_fields``) and on which device the stream is packed."""

    name = ""

    def __init__(self, engines: list, timeout_s: float):
        if not engines:
            raise WeightSyncError(f"weight_sync.engines is empty: the {self.name} backend posts each update to "
                                  "the engines' URLs (SOURCE_PATCH_WEIGHT_SYNC_ENGINES=http://HOST:PORT,...)")
        self.engines, self.timeout_s = list(engines), float(timeout_s)
        self.memory = self.packing = self.broken = None

    def send(self, manifest: Manifest, tensors, extra=(), *, replay_packing: bool = True) -> None:
        """Pack the update into the memory and ask every engine to load it.  Raises
        WeightSyncError (ChecksumMismatch when an engine found one)."""
        planned = isinstance(tensors, (Buffers, program.Sources))
        source = iter(extra) if planned else iter(tensors)
        if isinstance(tensors, program.Sources):
            tensors.done = 0
        try:
            payload = self.stage(manifest, tensors, source, replay_packing)
        except Exception:
            if isinstance(tensors, program.Sources):  # peers' gathers still need rank 0
                tensors.drain()
            for _ in source if not planned else ():
                pass
            raise
        for url in self.engines:
            post_update(url, payload, self.timeout_s)

    def stage(self, manifest: Manifest, tensors, source, replay_packing: bool = True) -> bytes:
        """Pack every bucket into the memory; the engine request's bytes."""
        refusal = too_many_buckets(manifest.bucket_bytes, manifest.total_bytes)
        if refusal:
            raise WeightSyncError(f"update v{manifest.version} refused: {refusal}")
        packing = self._packing(manifest, tensors, self._stream_device(tensors))
        packing.replay_copies(replay_packing)
        sums = packing.sums  # kept with the packing: bucket_sum overwrites each bucket's
        with torch.no_grad():
            for k, sources in packing.batches(source):
                if k >= manifest.buckets:  # an update of 0 bytes has tensors but no bucket
                    continue
                data = packing.pack(k, sources)
                if manifest.checksum:
                    bucket_sum(data, sums[k])
                    if sender.before_sum_send is not None:
                        sender.before_sum_send(k, sums[k: k + 1])
                if sender.after_send is not None:
                    sender.after_send(k, data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # packed (and copied off the device) before an engine reads it
        fields = {"backend": self.name, "sums": sums[: manifest.buckets].tolist() if manifest.checksum else [],
                  "memory": self._memory_fields()}
        return request_json(manifest, fields, packing.tensors_json)

    def _packing(self, manifest: Manifest, tensors, device: torch.device):
        """The packing plan into the memory, kept while the layout holds."""
        if self.memory is None or self.memory.nbytes < manifest.total_bytes or self._moved(device):
            self.packing = None
            if self.memory is not None:
                self.memory.close()
            self.memory = self._new_memory(manifest.total_bytes, device)
        packing, stream = self.packing, self.memory.tensor
        if isinstance(tensors, program.Sources):
            if not isinstance(packing, program.Program) or not packing.matches(manifest, tensors):
                self.packing = None  # its carries go first
                packing = program.Program(manifest, tensors, stream.device, stream=stream)
        elif isinstance(tensors, Buffers):
            if not isinstance(packing, sender._Spans) or not packing.matches(manifest, tensors):
                packing = sender._Spans(manifest, tensors, stream=stream)
        elif not isinstance(packing, sender._Packing) or not packing.matches(manifest):
            packing = sender._Packing(manifest, stream.device, stream=stream)
        self.packing = packing
        return packing

    def _stream_device(self, tensors) -> torch.device:
        raise NotImplementedError

    def _moved(self, device: torch.device) -> bool:
        return False

    def _new_memory(self, nbytes: int, device: torch.device):
        raise NotImplementedError

    def _memory_fields(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        self.memory = self.packing = None


def post_update(url: str, payload: bytes, timeout_s: float, session: bool = True) -> None:
    """Ask the SGLang engine at ``url`` to load the update ``payload`` describes
    (its admin requests begin_weight_update / update_weights_from_tensor /
    end_weight_update, with our load_format).  Raises WeightSyncError with the
    engine's answer; ChecksumMismatch when the engine found one."""
    began = session and _post(url, "/begin_weight_update", {}, timeout_s)[0]
    try:
        ok, reply = _post(url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(payload).decode()], "load_format": LOAD_FORMAT,
            "flush_cache": True}, timeout_s)
    finally:
        if began:
            _post(url, "/end_weight_update", {}, timeout_s)
    if not ok:
        message = str(reply.get("message", reply))[:2000]
        error = ChecksumMismatch if "checksum mismatch" in message else WeightSyncError
        raise error(f"the engine at {url} refused the update: {message}")


def _post(url: str, path: str, body: dict, timeout_s: float) -> tuple[bool, dict]:
    _check_url(url)
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    what = f"the engine at {url}: its answer to {path}"
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = _reply(response.read(MAX_REPLY_BYTES + 1), what)
    except urllib.error.HTTPError as exc:
        try:
            reply = _reply(exc.read(MAX_REPLY_BYTES + 1), what)
        except (OSError, WeightSyncError, http.client.HTTPException):  # no readable body: its status says enough
            reply = {"message": f"HTTP {exc.code}"}
        return False, reply if isinstance(reply, dict) else {"message": str(reply)}
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a broken reply too: one line, not raw
        raise WeightSyncError(f"the engine at {url} did not answer {path}: {exc or type(exc).__name__}") from None
    return bool(reply.get("success", True)) if isinstance(reply, dict) else False, \
        reply if isinstance(reply, dict) else {}


def _reply(data: bytes, what: str):
    """An engine's JSON reply, bounded in size and depth (a deep one is WeightSyncError,
    not a RecursionError); an empty body is ``{}``."""
    return bounded.load_json(data or b"{}", what=what, error=WeightSyncError, max_bytes=MAX_REPLY_BYTES)


def _check_url(url) -> None:
    """An engine URL is http(s)://HOST[:PORT][/PATH] with no whitespace or control
    characters (a CR or LF would be a raw InvalidURL from http.client, or a header)."""
    ok = isinstance(url, str) and not any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url)
    try:
        parts = urllib.parse.urlsplit(url) if ok else None
    except ValueError:  # an unclosed [IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise WeightSyncError(f"engine URL {str(url)[:200]!r}: expected http(s)://HOST:PORT, without spaces "
                              "or control characters")
