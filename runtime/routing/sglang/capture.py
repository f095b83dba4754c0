"""Capture: each forward's routed rows into the slot store, and each request's record
read back from it.

Capture is keyed by KV slot, as SGLang's own capturer is (slot_store.py): each
forward's rows go to the slots of ``forward_batch.out_cache_loc``; a finished request's
rows are read back through its ``req_to_token`` row, so a prompt prefix served from
the radix cache (or recomputed after a retraction, or prefilled in chunks) reads the
rows its first computation wrote: every record covers positions ``[0, prompt +
generated - 1)``, as ``meta_info["routed_experts"]`` does.  Without KV slots (rows
attributed in process with ``batch.set_batch``) each request gets private slots and
its record starts where its first row did (``extra["start_pos"]``).

A record (routing/records/record.py) is one ``RoutingRecord`` per request
(``token_order="requests"``, ``sample_ids=[rid]``, ``source="sglang"``,
``extra={"rank", "start_pos"}``); files.py writes it.
"""

from __future__ import annotations

import torch

from ..records.file import RoutingRecordError
from ..records.record import RoutingRecord
from .batch import ambient_rows
from .state import S, this_rank, warn_once


def capture_layer(layer: int, routed: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
    """Hold this forward's rows of ``layer`` (still on the device; scattered into the slot
    store by KV slot when read)."""
    rows = ambient_rows(routed.shape[0])
    if rows is None:
        return
    if S.batch_slots is None:
        warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): capture skipped")
        return
    with S.lock:
        if S.current is None or S.current["id"] != S.forward_id:
            S.current = {"id": S.forward_id, "layers": {}}
            space, slots = S.batch_slots
            S.stores[space].pending(slots, S.current["layers"], (S.forward_id, S.batch))  # scattered when read
        S.current["layers"][layer] = (routed[:rows].detach().clone(), weights[:rows].detach().clone())
        S.num_experts = num_experts


def records(only=None) -> dict:
    """What was captured so far: ``{rid: RoutingRecord}`` (one per request, rows in
    generation order: prefill tokens then each decode token); ``only``: that request."""
    with S.lock:
        live = [(rid, e) for rid, e in S.live.items() if only is None or rid == only]
    out = {}
    for rid, e in live:
        rec = request_record(rid, e, e["end"], e["pool"], e["idx"])
        if rec is not None:
            out[rid] = rec
    return out


def request_record(rid, e, end, pool, idx, *, lazy: bool = False) -> RoutingRecord | None:
    """Rows ``[start, end)`` of ``rid`` read from the slot store (KV slots through
    ``pool[idx]``); None when nothing was captured.  ``lazy``: leave the latest forward
    on its device unless it holds rows of ``rid`` before ``end`` (a finished request's
    rows are all in earlier forwards under SGLang's overlap schedule, which has launched
    the next batch already: waiting for it would stall the overlap)."""
    if e["gap"]:
        raise RoutingRecordError(f"request {rid!r}: {e['gap']}")
    store = S.stores[e["space"]]
    latest = S.forward_id

    def keep(tag):
        fid, (rids, _, starts) = tag
        return fid == latest and not any(r == rid and s < end for r, s in zip(rids, starts))

    with S.lock:
        store.settle(keep if lazy else None)
        if not store.ids or end <= e["start"]:
            return None
        if e["space"] == "virtual":
            slots = torch.cat(e["vslots"])[:end - e["start"]]
        elif pool is None or idx is None:
            raise RoutingRecordError(f"request {rid!r}: its KV slots are unknown (the ModelRunner._forward_raw "
                                     "call site passes no runner: an older cached spec?)")
        else:
            slots = pool[idx, :end]
        try:
            layers, probs = store.read(slots, f"request {rid!r}")
        except LookupError as exc:
            raise RoutingRecordError(str(exc)) from None
    return RoutingRecord(indices=layers, probs=probs, num_experts=S.num_experts, token_order="requests",
                         sample_ids=[rid], seq_lens=[end - e["start"]], source="sglang",
                         extra={"rank": this_rank(), "start_pos": e["start"]})
