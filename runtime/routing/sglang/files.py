"""Record files: each request's record written to ``<dir>/rank<R>/<rid>.safetensors``
(at its release: call_sites.py; what is left: :func:`write_held`, at close), waited for
(:func:`wait_record`), and the rank folders merged by request
(:func:`merge_rank_files`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ..records.file import RoutingRecordError
from ..records.record import RoutingRecord, load
from .capture import records
from .slot_store import SlotStore
from .state import S, this_rank


def wait_record(dir, rid, *, rank: int = 0, timeout: float = 20.0) -> RoutingRecord:
    """The record capture writes for request ``rid`` under ``dir`` (in the scheduler
    process, when the request releases its KV cache: shortly after its response), once
    it is there; FileNotFoundError naming the file after ``timeout`` seconds."""
    path = Path(dir) / f"rank{rank}" / f"{safe_name(rid)}.safetensors"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no routing record of request {rid!r} at {path} after {timeout:.0f} s")
        time.sleep(0.05)
    return load(path)


def safe_name(rid) -> str:
    """A request id as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(rid))[:128] or "_"


def write_held(dir=None, *, clear: bool = True) -> list:
    """Write each captured request to ``<dir>/rank<R>/<rid>.safetensors``; returns the paths."""
    dir = dir if dir is not None else S.dir
    if dir is None:
        raise ValueError("no directory to write to (SOURCE_PATCH_ROUTING_SGLANG_DIR)")
    recs = records()
    folder = Path(dir) / f"rank{this_rank()}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rid, rec in recs.items():
        path = folder / f"{safe_name(rid)}.safetensors"
        rec.save(path)
        paths.append(path)
        S.written += 1
    if clear:
        with S.lock:
            S.live = {}
            S.stores["virtual"], S.next_virtual = SlotStore(), 0  # engine slots stay: the radix cache keeps them
    return paths


def finished_rows(req, e, tree_cache) -> tuple:
    """(end, req_to_token, row) of a finished request: SGLang's own count of routed
    tokens; capture that stopped short of it is an error, not a short record."""
    if e["space"] != "kv":
        return e["end"], e["pool"], e["idx"]
    end = len(req.origin_input_ids) + len(req.output_ids_through_stop) - 1
    if max(e["end"], e["reach"]) < end:
        raise RoutingRecordError(f"request {req.rid!r}: routes captured up to position {e['end']}, "
                                 f"it has {end} routed tokens")
    pool = getattr(getattr(tree_cache, "req_to_token_pool", None), "req_to_token", None)
    return end, pool if pool is not None else e["pool"], req.kv.req_pool_idx


def drop(rid) -> None:
    """Forget ``rid``'s place (its slots' rows stay: the radix cache may serve them again)."""
    with S.lock:
        S.live.pop(rid, None)


def by_request(recs, rank_of=None) -> dict:
    """``{rid: RoutingRecord}`` of SGLang records, one request each; a request several
    ranks wrote (TP replicas) must be identical on all of them: the lowest rank's is kept."""
    out, owner = {}, {}
    for rec in recs:
        if rec.sample_ids is None or len(rec.sample_ids) != 1:
            raise RoutingRecordError(f"an SGLang routing file holds one request, this one has sample_ids "
                                     f"{rec.sample_ids}")
        rid = rec.sample_ids[0]
        rank = (rec.extra or {}).get("rank", 0)
        if type(rank) is not int:  # metadata a file brought: compared below
            raise RoutingRecordError(f"request {rid!r}: its record's rank is {str(rank)[:40]!r}, not an integer")
        if rid in out:
            other = out[rid]
            if not other.equals(rec.replace(extra=other.extra)):
                raise RoutingRecordError(f"request {rid!r}: ranks {owner[rid]} and {rank} captured different "
                                         "routes (TP ranks should see the same tokens)")
            if rank >= owner[rid]:
                continue
        out[rid], owner[rid] = rec, rank
    return out


def merge_rank_files(dir) -> dict:
    """``{rid: RoutingRecord}`` from every ``*.safetensors`` under ``dir`` (the
    ``rank<R>`` folders :func:`write_held` writes). A request seen by several ranks (TP
    replicas) must be identical on all of them; the lowest rank's record is kept."""
    files = sorted(Path(dir).rglob("*.safetensors"))
    if not files:
        raise RoutingRecordError(f"no routing files under {dir}")
    return by_request([load(f) for f in files])
