"""The ambient batch: which request each row of the flat token batch of the current
forward belongs to, at which position of that request, and (capture) the KV slot
each row went to.  ``call_sites.routing_sglang_batch`` sets it from SGLang's
``ForwardBatch``; without an engine, :func:`set_batch` / :func:`clear_batch` set it by
hand.
"""

from __future__ import annotations

import torch

from .state import S, warn_once


def set_batch(rids, lens, starts=None, *, slots=None, pool=None, pool_indices=None, verify=False) -> None:
    """Make ``rids`` / ``lens`` (tokens of each request in this forward, in row
    order) / ``starts`` (position of each request's first row in that request;
    default: right after what was captured for it so far) the ambient batch.

    Capture only: ``slots`` (one KV slot per row, ``out_cache_loc``), ``pool``
    (``req_to_token``) and ``pool_indices`` (each request's row of it) key the rows by
    KV slot; without ``slots`` each request gets private slots.  ``verify``: the rows
    are a speculative verify pass's draft tokens (``slots`` required); only the accepted
    ones stay in ``req_to_token``, so a request's settled length does not move."""
    rids, lens = list(rids), [int(n) for n in lens]
    if len(rids) != len(lens):
        raise ValueError(f"{len(rids)} request ids for {len(lens)} lengths")
    if starts is None:
        starts = [S.live[r]["end"] if r in S.live else 0 for r in rids]
    starts = [int(s) for s in starts]
    S.batch, S.batch_slots, S.skip = (rids, lens, starts), None, False
    S.forward_id += 1
    if S.mode != "capture":
        return
    space = "kv" if slots is not None else "virtual"
    if slots is None:
        slots = torch.arange(S.next_virtual, S.next_virtual + sum(lens))
        S.next_virtual += sum(lens)
    S.batch_slots = (space, slots)
    with S.lock:
        _track(rids, lens, starts, space, slots, pool, pool_indices, verify)
        # forwards older than the previous one are done even under the overlap schedule:
        # to the host now, so at most two forwards stay on the device
        S.stores[space].settle(keep=lambda tag: tag[0] >= S.forward_id - 1)


def _track(rids, lens, starts, space, slots, pool, pool_indices, verify=False) -> None:
    """Where each request of this forward has got to (and, in private slots, which
    slot each of its positions has); a verify pass only says how far it may reach."""
    off = 0
    for i, (rid, n, start) in enumerate(zip(rids, lens, starts)):
        e = S.live.get(rid)
        if e is None or e["space"] != space:
            e = S.live[rid] = {"space": space, "start": start if space == "virtual" else 0, "end": start,
                               "gap": None, "vslots": [], "pool": None, "idx": None, "reach": 0}
        if space == "virtual":
            if start != e["end"] and e["gap"] is None:
                e["gap"] = f"rows resume at position {start}, expected {e['end']} (retracted or re-prefilled request?)"
            e["vslots"].append(slots[off:off + n])
        else:
            e["pool"], e["idx"] = pool, (pool_indices[i] if pool_indices is not None else None)
        if verify:
            e["reach"] = max(e["reach"], start + n)
        else:
            e["end"] = start + n
        off += n


def clear_batch(skip: bool = False) -> None:
    """No ambient batch; ``skip``: the forward is a draft model's (SGLang opts its
    routers out of its own capture too) or one whose rows cannot be attributed, so its
    routers are neither captured nor replayed."""
    S.batch = S.batch_slots = None
    S.skip = skip


def kv_slots(forward_batch, runner):
    """(out_cache_loc, req_to_token, [req_pool_idx]) of an engine forward; SGLang's own
    capturer prefers ``out_cache_loc_virtual`` (the ids ``req_to_token`` holds)."""
    slots = getattr(forward_batch, "out_cache_loc_virtual", None)
    if slots is None:
        slots = getattr(forward_batch, "out_cache_loc", None)
    pool = getattr(getattr(runner, "req_to_token_pool", None), "req_to_token", None)
    idx = getattr(forward_batch, "req_pool_indices_cpu", None)
    if idx is None:
        idx = getattr(forward_batch, "req_pool_indices", None)
    return slots, pool, None if idx is None else [int(i) for i in idx.tolist()]


def ambient_rows(total: int) -> int | None:
    """How many of the router's ``total`` rows are the ambient batch's tokens (the rest:
    padding); None (warned) when the batch has more than the router sees."""
    if S.batch is None:
        return total
    rows = sum(S.batch[1])
    if rows > total:
        warn_once(("rows", rows, total), f"ambient batch has {rows} tokens but the router sees {total} "
                  "(attention-DP / sequence-sharded MoE input is not attributed): skipped")
        return None
    return rows
