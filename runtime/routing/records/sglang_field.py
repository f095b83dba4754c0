"""SGLang's own routed-experts field (R3), as tensors.

An engine started with ``--enable-return-routed-experts`` returns, per request,
``meta_info["routed_experts"]``: base64 of int32 ``[seqlen - 1 - start_len,
num_layers, topk]`` (logical expert ids, layer ``i`` is SGLang's ``layer_id`` ``i``).
This module decodes and encodes that field; ``record.py`` turns the tensor into
a RoutingRecord and back (``RoutingRecord.from_sglang_meta``, ``to_sglang_meta``).
"""

from __future__ import annotations

import torch

from .file import RoutingRecordError

MAX_META_BYTES = 1 << 30  # a larger base64 routed_experts field is refused


def _meta_field(meta, rid):
    """(base64 text, meta_info or None, rid) of a /generate result, its meta_info, or the text."""
    if isinstance(meta, dict) and "meta_info" in meta:
        meta = meta["meta_info"]
    if isinstance(meta, dict):
        text = meta.get("routed_experts")
        if text is None:
            raise RoutingRecordError("meta_info has no routed_experts (start the engine with "
                                     "--enable-return-routed-experts and send return_routed_experts=True)")
        return text, meta, rid if rid is not None else meta.get("id")
    return meta, None, rid


def decode(meta, *, num_layers: int, topk: int, rid=None, start_len: int = 0) -> tuple[torch.Tensor, object]:
    """``(ids, rid)``: the int32 ``[rows, num_layers, topk]`` tensor of ``meta`` (a
    /generate result, its ``meta_info``, or the base64 text) and the request id
    (default ``meta_info["id"]``).  With a ``meta_info`` the row count must be
    ``prompt_tokens + completion_tokens - 1 - start_len``."""
    import base64
    import binascii

    text, info, rid = _meta_field(meta, rid)
    if not isinstance(text, (str, bytes)) or len(text) > MAX_META_BYTES:
        raise RoutingRecordError(f"routed_experts must be base64 text (at most {MAX_META_BYTES} bytes), "
                                 f"got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingRecordError(f"routed_experts is not valid base64: {exc}") from None
    row = 4 * num_layers * topk
    if num_layers < 1 or topk < 1 or len(raw) % row:
        raise RoutingRecordError(f"routed_experts holds {len(raw)} bytes: not whole rows of int32 "
                                 f"[layers={num_layers}, topk={topk}] ({row} bytes)")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, num_layers, topk)
    if info is not None and "prompt_tokens" in info and "completion_tokens" in info:
        want = int(info["prompt_tokens"]) + int(info["completion_tokens"]) - 1 - start_len
        if ids.shape[0] != want:
            raise RoutingRecordError(f"routed_experts has {ids.shape[0]} rows; request {rid!r} has "
                                     f"{info['prompt_tokens']} prompt + {info['completion_tokens']} completion "
                                     f"tokens: expected {want} (the last token is never routed)")
    return ids, rid


def encode(ids: torch.Tensor) -> str:
    """The base64 text of an int32 ``[rows, num_layers, topk]`` tensor, as SGLang sends it."""
    import base64

    return base64.b64encode(ids.numpy().tobytes()).decode("ascii")
