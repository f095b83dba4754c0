"""Replay: the recorded expert ids for the ambient batch's rows, and the weights SGLang's
top-k would give them.

Replay weights: ``scores = f(router_logits.float())`` with ``f`` the config's
``scoring_func`` (softmax / sigmoid / sqrtsoftplus), ``w = scores.gather(1, ids)``;
with ``renormalize`` ``w / (w.sum(-1) + 1e-20)`` as SGLang's torch-native top-k does;
then times ``routed_scaling_factor`` when ``apply_routed_scaling_factor_on_output``
is set. Any ``correction_bias`` only changes *which* experts are chosen, never the
weights (as in SGLang's biased top-k), so it plays no part. Only the routed columns
(the first ``top_k - num_shared_topk_slots``) are captured or replaced; fused shared
expert columns keep what the router gave them.
"""

from __future__ import annotations

import torch

from ...core.adapters.sglang_batch import is_probe
from ..records.file import RoutingRecordError
from .state import S, warn_once

_RENORM_EPS = 1e-20  # sglang.srt.layers.moe.topk._RENORMALIZE_SUM_EPSILON


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = logits.float()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise RoutingRecordError(f"cannot recompute weights for scoring function {scoring_func!r}")


def replay_weights(router_logits: torch.Tensor, ids: torch.Tensor, topk_config) -> torch.Tensor:
    """The weights SGLang's top-k gives experts ``ids`` (``[tokens, k]``) of these
    logits under ``topk_config`` (see the module docstring)."""
    w = _scores(router_logits, topk_config.scoring_func).gather(1, ids.long())
    if topk_config.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True, dtype=torch.float32) + _RENORM_EPS)
    if topk_config.apply_routed_scaling_factor_on_output and topk_config.routed_scaling_factor is not None:
        w = w * topk_config.routed_scaling_factor
    return w


def check_ids(ids: torch.Tensor, *, rows: int, topk: int, num_experts: int, what: str = "replay ids") -> None:
    """Clear errors for a wrong row count, out-of-range or duplicate expert ids."""
    if ids.dim() != 2 or ids.shape[1] != topk:
        raise RoutingRecordError(f"{what}: shape {list(ids.shape)}, expected [{rows}, {topk}]")
    if ids.shape[0] != rows:
        raise RoutingRecordError(f"{what}: {ids.shape[0]} rows for {rows} tokens of this batch")
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        r = int(bad.any(1).nonzero()[0])
        raise RoutingRecordError(f"{what}: row {r}: expert id out of range [0, {num_experts}) "
                                 f"(row {ids[r].tolist()})")
    s = ids.sort(1).values
    dup = (s[:, 1:] == s[:, :-1]).any(1)
    if bool(dup.any()):
        r = int(dup.nonzero()[0])
        raise RoutingRecordError(f"{what}: row {r}: an expert is chosen twice (row {ids[r].tolist()})")


def replay_rows(layer: int, live: torch.Tensor) -> torch.Tensor | None:
    """The ids to route the ambient batch's rows with: each request's recorded rows;
    a request without a record (SGLang's own health checks, a request nobody
    captured) or rows past its record's end keep the router's choice (``live``),
    with a warning: a serving engine must not die for a missing route."""
    if S.batch is None:
        if len(S.replay) == 1:  # one record, no attribution: the batch is that record
            (rec,) = S.replay.values()
            if layer not in rec.indices:
                raise RoutingRecordError(f"replay record has no layer {layer} (it has {rec.layers})")
            return rec.indices[layer].to(live.device)
        warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): replay skipped")
        return None
    rids, lens, starts = S.batch
    parts, row = [], 0
    for rid, n, start in zip(rids, lens, starts):
        rec = S.replay.get(rid)
        recorded = recorded_rows(rec, rid, layer, start, n)
        parts.append(live[row:row + n] if recorded is None else recorded.to(live.device))
        row += n
    return torch.cat(parts) if parts else live[:0]


def recorded_rows(rec, rid, layer: int, start: int, n: int) -> torch.Tensor | None:
    """Rows [start, start + n) of ``rid``'s record at ``layer``, or None (warned)."""
    if rec is None:
        if not is_probe(rid):
            warn_once(("norecord", len(S.warned) // 64), f"replay: no record for request {rid!r} "
                      "(it keeps the router's own routes; later ones are not reported)")
        return None
    if layer not in rec.indices:
        raise RoutingRecordError(f"replay: request {rid!r} has no layer {layer} (it has {rec.layers})")
    off = start - int((rec.extra or {}).get("start_pos", 0))
    if off < 0 or off + n > rec.num_tokens:
        warn_once(("short", rid), f"replay: request {rid!r} needs rows [{off}, {off + n}) of layer {layer}, "
                  f"its record has {rec.num_tokens}: those rows keep the router's own routes")
        return None
    return rec.indices[layer][off:off + n]
