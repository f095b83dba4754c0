"""The call sites SGLang's patched code calls (``patches/routing.yaml``, through ``__sp__``);
with the mode off each returns after one test:

* ``ModelRunner._forward_raw`` (entry): :func:`routing_sglang_batch` reads the
  ``ForwardBatch`` and makes it the *ambient batch* (batch.py): which request each row
  of the flat token batch belongs to, and at which position of that request it is
  (``rids``; extend: ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu``; decode: one
  token per request at ``seq_lens_cpu - 1``).
* ``select_experts`` (just before ``_post_process_topk_ids``, where SGLang's own
  ``apply_routing_simulation`` rewrites ``topk_ids``): :func:`routing_sglang_topk`
  sees the *logical* expert ids (before the EPLB logical-to-physical remap) and
  captures them per layer (capture.py), or overrides them in place from a replay
  record and recomputes the weights (replay.py).
* ``release_kv_cache`` (entry): :func:`routing_sglang_release` writes a finished
  request's record (files.py).
* ``capture_one_shape``: :func:`routing_sglang_graph_build` before a decode graph's
  capture (graphs.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...core.adapters import graph_stage, sglang_graphs
from ...core.adapters.sglang_batch import DRAFT, BatchRows, Unattributed, batch_rows, is_probe
from .batch import ambient_rows, clear_batch, kv_slots, set_batch
from .capture import capture_layer, request_record
from .control import current_mode
from .files import drop, finished_rows, safe_name
from .graphs import in_graph
from .replay import check_ids, replay_rows, replay_weights
from .state import S, this_rank, warn_once


def routing_sglang_batch(forward_batch, runner=None) -> None:
    """Call site at ``ModelRunner._forward_raw`` entry (``runner``: that ModelRunner):
    the ambient batch from an SGLang ``ForwardBatch``. Does nothing when the mode is off."""
    if current_mode() == "off":
        return
    capture = S.mode == "capture"
    rows = batch_rows(forward_batch, runner, verify=capture)  # a verify pass: rows keyed by KV slot
    if isinstance(rows, Unattributed):
        warn_once(rows.key, rows.reason)
    if not isinstance(rows, BatchRows):
        clear_batch(skip=rows is DRAFT or isinstance(rows, Unattributed))
        return
    if not capture:
        set_batch(rows.rids, rows.lens, rows.starts)
        return
    slots, pool, idx = kv_slots(forward_batch, runner)
    if slots is None and rows.mode == "verify":
        warn_once("verify-slots", "a verify pass without KV slots is not attributed; its rows are skipped")
        clear_batch(skip=True)
        return
    if slots is not None:
        slots = slots[:sum(rows.lens)]
    set_batch(rows.rids, rows.lens, rows.starts, slots=slots, pool=pool, pool_indices=idx,
              verify=rows.mode == "verify")


def routing_sglang_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor, router_logits: torch.Tensor,
                        topk_config, layer_id, num_routed_topk: int) -> None:
    """Call site before ``_post_process_topk_ids`` in ``select_experts``: capture the
    logical ids of the routed columns, or overwrite them (and their weights) in
    place from the replay record. Rows past the ambient batch's tokens (padding)
    are left alone."""
    mode = current_mode()
    if mode == "off" or layer_id is None or not getattr(topk_config, "allow_routed_experts_capture", True):
        return
    if graph_stage.busy and in_graph(topk_ids, topk_weights, router_logits, topk_config, int(layer_id),
                                     num_routed_topk, mode):
        return
    if S.skip:
        return
    routed = topk_ids[:, :num_routed_topk]
    if mode == "capture":
        capture_layer(int(layer_id), routed, topk_weights[:, :num_routed_topk], router_logits.shape[-1])
        return
    rows = ambient_rows(routed.shape[0])
    if rows is None:
        return
    ids = replay_rows(int(layer_id), routed[:rows])
    if ids is None:
        return
    check_ids(ids, rows=rows, topk=num_routed_topk, num_experts=router_logits.shape[-1],
              what=f"layer {layer_id} replay ids")
    routed[:rows] = ids.to(routed.dtype)
    w = replay_weights(router_logits[:rows], ids, topk_config)
    topk_weights[:rows, :num_routed_topk] = w.to(topk_weights.dtype)


def routing_sglang_release(req, tree_cache=None) -> None:
    """Call site at ``release_kv_cache`` entry: a finished request's record is written
    now (a scheduler is killed at shutdown, so waiting for exit would lose it), read
    through its ``req_to_token`` row (``tree_cache.req_to_token_pool``) over
    ``[0, prompt + output through stop - 1)``, the rows SGLang's ``routed_experts``
    returns.  A retracted request (not finished) keeps its place."""
    if S.mode != "capture" or not S.dir:
        return
    try:
        if not req.finished():
            return
        rid = req.rid
        e = S.live.get(rid)
        if e is not None and not is_probe(rid):
            rec = request_record(rid, e, *finished_rows(req, e, tree_cache), lazy=True)
            if rec is not None:
                folder = Path(S.dir) / f"rank{this_rank()}"
                folder.mkdir(parents=True, exist_ok=True)
                rec.save(folder / f"{safe_name(rid)}.safetensors")
                S.written += 1
        drop(rid)
    except Exception as exc:  # noqa: BLE001 - capture must never break serving
        S.last_error = f"release: {type(exc).__name__}: {exc}"
        warn_once(("release", type(exc).__name__), f"writing a finished request's routes failed: {exc}")


def routing_sglang_graph_build(runner, key) -> None:
    """Before a decode graph's capture (``capture_one_shape``): the settings are read now
    (SGLang captures before its first forward), so with routing on the graph gets a
    stage (core/adapters/sglang_graphs.py)."""
    current_mode()
    sglang_graphs.sglang_graph_build(runner, key)
