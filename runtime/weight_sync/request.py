"""The engine request of the request backends (ipc, mooncake): the trainer posts its
manifest, as JSON bytes, through SGLang's own admin requests; the engine answers
whether it loaded it."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from .wire import ChecksumMismatch, WeightSyncError

LOAD_FORMAT = "source_patch"  # SGLang's load_format that selects our receivers


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
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.loads(response.read(1 << 20) or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            reply = json.loads(exc.read(1 << 20) or b"{}")
        except ValueError:
            reply = {"message": f"HTTP {exc.code}"}
        return False, reply if isinstance(reply, dict) else {"message": str(reply)}
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"the engine at {url} did not answer {path}: {exc}") from None
    return bool(reply.get("success", True)) if isinstance(reply, dict) else False, \
        reply if isinstance(reply, dict) else {}
