"""SGLang routing capture and replay (issue 4, SGLang side).

Two call sites (``patches/routing.yaml``) reach this module through ``__sp__``:

* ``ModelRunner._forward_raw`` (entry): :func:`routing_sglang_batch` reads the
  ``ForwardBatch`` and makes it the *ambient batch*: which request each row of the
  flat token batch belongs to, and at which position of that request it is
  (``rids``; extend: ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu``; decode: one
  token per request at ``seq_lens_cpu - 1``).
* ``select_experts`` (just before ``_post_process_topk_ids``, where SGLang's own
  ``apply_routing_simulation`` rewrites ``topk_ids``): :func:`routing_sglang_topk`
  sees the *logical* expert ids (before the EPLB logical-to-physical remap) and
  captures them per layer, or overrides them in place from a replay record and
  recomputes the weights.

Records use :mod:`source_patch.runtime.routing.record`: one ``RoutingRecord`` per
request (``token_order="requests"``, ``sample_ids=[rid]``, ``source="sglang"``,
``extra={"rank", "start_pos"}``), written to ``<dir>/rank<R>/<rid>.safetensors`` when
the request finishes (:func:`routing_sglang_release`, at ``release_kv_cache``) and by
:func:`flush` (at exit: what is left); :func:`merge_rank_files` merges a directory of
rank folders by request.

Settings: the ``sglang_routing`` component (docs/settings.md), read on first use:
``SOURCE_PATCH_SGLANG_ROUTING_MODE`` / ``_DIR`` / ``_REPLAY`` over a spec's
``runtime: sglang_routing:`` over the defaults (off; no dir; no replay source).

Replay weights: ``scores = f(router_logits.float())`` with ``f`` the config's
``scoring_func`` (softmax / sigmoid / sqrtsoftplus), ``w = scores.gather(1, ids)``;
with ``renormalize`` ``w / (w.sum(-1) + 1e-20)`` as SGLang's torch-native top-k does;
then times ``routed_scaling_factor`` when ``apply_routed_scaling_factor_on_output``
is set. Any ``correction_bias`` only changes *which* experts are chosen, never the
weights (as in SGLang's biased top-k), so it plays no part. Only the routed columns
(the first ``top_k - num_shared_topk_slots``) are captured or replaced; fused shared
expert columns keep what the router gave them.

Over 400 lines on purpose: capture, replay and the per-request records share the
ambient batch and its row bookkeeping, which must be read together.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import warnings
from pathlib import Path

import torch

from ..core import settings
from ..core.sglang_batch import BatchRows, Unattributed, batch_rows, is_probe
from .record import RoutingRecord, RoutingRecordError, load

SETTINGS = "sglang_routing"  # its settings component (the capability contract: core/capability.py)
_RENORM_EPS = 1e-20  # sglang.srt.layers.moe.topk._RENORMALIZE_SUM_EPSILON


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.config = None  # None: read the settings on first use
        self.mode = None
        self.dir = None
        self.last_error = None
        self.written = 0  # records written by capture
        self.rank = None
        self.batch = None  # (rids, lens, starts) of the current forward
        self.forward_id = -1
        self.forwards = []  # [{"rids", "lens", "starts", "layers": {layer: ids}}]
        self.num_experts = None
        self.replay = None  # {rid: RoutingRecord}
        self.warned = set()


_S = _State()


def _warn_once(key, message):
    if key not in _S.warned:
        _S.warned.add(key)
        warnings.warn(f"source-patch sglang routing: {message}", RuntimeWarning, stacklevel=3)


def configure(**changes) -> dict:
    """Change settings (keys of the ``sglang_routing`` schema: ``mode``, ``dir``,
    ``replay``) and apply them; returns the effective settings.  Two more inputs:
    ``replay`` may also be a RoutingRecord or a ``{rid: record}`` mapping, and ``rank``
    names the rank folder capture writes to (default: the process's rank)."""
    rank = changes.pop("rank", _S.rank)
    objects = changes.pop("replay") if not isinstance(changes.get("replay", ""), (str, os.PathLike)) else None
    parsed = {key: settings.check(SETTINGS, key, os.fspath(v) if isinstance(v, os.PathLike) else v)
              for key, v in changes.items()}
    config = {**(_S.config or settings.resolve(SETTINGS)), **parsed}
    src = None
    if config["mode"] == "replay":  # read before any state is set: a bad source fails every call alike
        src = _replay_source(objects if objects is not None else config["replay"])
    _S.mode, _S.replay, _S.rank, _S.config = config["mode"], src, rank, config
    _S.dir = config["dir"] or None
    return dict(config)


def configure_from_settings() -> dict:
    """Re-read the settings (environment > active specs > defaults) and apply them."""
    _S.config = None
    return configure()


def _replay_source(src) -> dict:
    if isinstance(src, RoutingRecord):
        return {src.sample_ids[0] if src.sample_ids and len(src.sample_ids) == 1 else None: src}
    if isinstance(src, dict):
        return src
    if not src:
        raise ValueError("replay mode needs a record (SOURCE_PATCH_SGLANG_ROUTING_REPLAY)")
    p = Path(src)
    if p.is_dir() and not any(p.rglob("*.safetensors")):
        # as for a request without a record: the router's own routes, said once
        _warn_once("emptydir", f"replay: no routing files under {p}: every request keeps the router's own routes")
        return {}
    return merge_rank_files(p) if p.is_dir() else _by_request([load(p)])


def enabled() -> bool:
    return _mode() != "off"


def state() -> dict:
    with _S.lock:
        rows = sum(n for fw in _S.forwards for n in fw["lens"])
        requests = len({rid for fw in _S.forwards for rid in fw["rids"]})
    # Settings not read yet stay unread: the first call site reads them (state() must not).
    return {"enabled": _S.mode not in (None, "off"), "config": dict(_S.config or {}), "last_error": _S.last_error,
            "counters": {"requests_held": requests, "rows_held": rows, "records_written": _S.written,
                         "replay_records": len(_S.replay or {}), "warnings": len(_S.warned)}}


def reset() -> dict:
    """Forget everything (settings, ambient batch, captured rows, replay source); returns
    state(), whose settings are read again on first use."""
    with _S.lock:
        _S.reset()
    return state()


def close(timeout: float | None = None) -> bool:
    """Write what is still held (capture with a dir); True when that succeeded.
    Registered with atexit."""
    if _S.mode == "capture" and _S.dir and _S.forwards:
        try:
            flush()
        except Exception as exc:  # never fail interpreter exit
            _S.last_error = f"flush: {type(exc).__name__}: {exc}"
            warnings.warn(f"source-patch sglang routing: flush at exit failed: {exc}", RuntimeWarning)
            return False
    return True


def _mode():
    if _S.mode is None:
        configure()
    return _S.mode


def _rank():
    if _S.rank is not None:
        return _S.rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------- the ambient batch


def set_batch(rids, lens, starts=None) -> None:
    """Make ``rids`` / ``lens`` (tokens of each request in this forward, in row
    order) / ``starts`` (position of each request's first row in that request;
    default: right after what was captured for it so far) the ambient batch."""
    rids, lens = list(rids), [int(n) for n in lens]
    if len(rids) != len(lens):
        raise ValueError(f"{len(rids)} request ids for {len(lens)} lengths")
    if starts is None:
        starts = [_captured_len(r) for r in rids]
    _S.batch = (rids, lens, [int(s) for s in starts])
    _S.forward_id += 1


def clear_batch() -> None:
    _S.batch = None


def _captured_len(rid):
    layer_rows = {}
    for fw in _S.forwards:
        for i, r in enumerate(fw["rids"]):
            if r == rid and fw["layers"]:
                n = fw["lens"][i]
                for layer in fw["layers"]:
                    layer_rows[layer] = layer_rows.get(layer, 0) + n
    return max(layer_rows.values(), default=0)


def routing_sglang_batch(forward_batch) -> None:
    """Call site at ``ModelRunner._forward_raw`` entry: the ambient batch from an
    SGLang ``ForwardBatch``. Does nothing when the mode is off."""
    if _mode() == "off":
        return
    rows = batch_rows(forward_batch)
    if isinstance(rows, Unattributed):
        _warn_once(rows.key, rows.reason)
    if not isinstance(rows, BatchRows):
        _S.batch = None
        return
    set_batch(rows.rids, rows.lens, rows.starts)


# ---------------------------------------------------------------- select_experts


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


def _replay_rows(layer: int, live: torch.Tensor) -> torch.Tensor | None:
    """The ids to route the ambient batch's rows with: each request's recorded rows;
    a request without a record (SGLang's own health checks, a request nobody
    captured) or rows past its record's end keep the router's choice (``live``),
    with a warning: a serving engine must not die for a missing route."""
    if _S.batch is None:
        if len(_S.replay) == 1:  # one record, no attribution: the batch is that record
            (rec,) = _S.replay.values()
            if layer not in rec.indices:
                raise RoutingRecordError(f"replay record has no layer {layer} (it has {rec.layers})")
            return rec.indices[layer].to(live.device)
        _warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): replay skipped")
        return None
    rids, lens, starts = _S.batch
    parts, row = [], 0
    for rid, n, start in zip(rids, lens, starts):
        rec = _S.replay.get(rid)
        recorded = _recorded(rec, rid, layer, start, n)
        parts.append(live[row:row + n] if recorded is None else recorded.to(live.device))
        row += n
    return torch.cat(parts) if parts else live[:0]


def _recorded(rec, rid, layer: int, start: int, n: int) -> torch.Tensor | None:
    """Rows [start, start + n) of ``rid``'s record at ``layer``, or None (warned)."""
    if rec is None:
        if not is_probe(rid):
            _warn_once(("norecord", len(_S.warned) // 64), f"replay: no record for request {rid!r} "
                       "(it keeps the router's own routes; later ones are not reported)")
        return None
    if layer not in rec.indices:
        raise RoutingRecordError(f"replay: request {rid!r} has no layer {layer} (it has {rec.layers})")
    off = start - int((rec.extra or {}).get("start_pos", 0))
    if off < 0 or off + n > rec.num_tokens:
        _warn_once(("short", rid), f"replay: request {rid!r} needs rows [{off}, {off + n}) of layer {layer}, "
                   f"its record has {rec.num_tokens}: those rows keep the router's own routes")
        return None
    return rec.indices[layer][off:off + n]


def routing_sglang_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor, router_logits: torch.Tensor,
                        topk_config, layer_id, num_routed_topk: int) -> None:
    """Call site before ``_post_process_topk_ids`` in ``select_experts``: capture the
    logical ids of the routed columns, or overwrite them (and their weights) in
    place from the replay record. Rows past the ambient batch's tokens (padding)
    are left alone."""
    mode = _mode()
    if mode == "off" or layer_id is None or not getattr(topk_config, "allow_routed_experts_capture", True):
        return
    num_experts = router_logits.shape[-1]
    routed = topk_ids[:, :num_routed_topk]
    total = routed.shape[0]
    if _S.batch is not None:
        rows = sum(_S.batch[1])
        if rows > total:
            _warn_once(("rows", rows, total), f"ambient batch has {rows} tokens but the router sees {total} "
                       "(attention-DP / sequence-sharded MoE input is not attributed): skipped")
            return
    else:
        rows = total
    if mode == "capture":
        if _S.batch is None:
            _warn_once("nobatch", "no ambient batch (ModelRunner._forward_raw not patched?): capture skipped")
            return
        with _S.lock:
            if not _S.forwards or _S.forwards[-1]["id"] != _S.forward_id:
                rids, lens, starts = _S.batch
                _S.forwards.append({"id": _S.forward_id, "rids": rids, "lens": lens, "starts": starts,
                                    "layers": {}})
            _S.forwards[-1]["layers"][int(layer_id)] = (  # ids and their combine weights
                routed[:rows].detach().clone(), topk_weights[:rows, :num_routed_topk].detach().clone())
            _S.num_experts = num_experts
        return
    ids = _replay_rows(int(layer_id), routed[:rows])
    if ids is None:
        return
    check_ids(ids, rows=rows, topk=num_routed_topk, num_experts=num_experts, what=f"layer {layer_id} replay ids")
    routed[:rows] = ids.to(routed.dtype)
    w = replay_weights(router_logits[:rows], ids, topk_config)
    topk_weights[:rows, :num_routed_topk] = w.to(topk_weights.dtype)


# ---------------------------------------------------------------- records and files


def records(only=None) -> dict:
    """What was captured so far: ``{rid: RoutingRecord}`` (one per request, rows in
    generation order: prefill tokens then each decode token); ``only``: that request."""
    per = {}  # rid -> {"start": int, "next": int, "layers": {layer: [tensors]}}
    with _S.lock:
        forwards = list(_S.forwards)
    for fw in forwards:
        off = 0
        for rid, n, start in zip(fw["rids"], fw["lens"], fw["starts"]):
            if only is not None and rid != only:
                off += n
                continue
            entry = per.setdefault(rid, {"start": start, "next": start, "layers": {}})
            if start != entry["next"]:
                raise RoutingRecordError(f"request {rid!r}: rows resume at position {start}, expected "
                                         f"{entry['next']} (retracted or re-prefilled request?)")
            entry["next"] = start + n
            for layer, (ids, weights) in fw["layers"].items():
                entry["layers"].setdefault(layer, []).append((ids[off:off + n], weights[off:off + n]))
            off += n
    out = {}
    for rid, entry in per.items():
        layers = {k: torch.cat([i for i, _ in v]).to("cpu", torch.int64) for k, v in entry["layers"].items()}
        if not layers:
            continue
        probs = {k: torch.cat([w for _, w in v]).to("cpu", torch.float32) for k, v in entry["layers"].items()}
        out[rid] = RoutingRecord(indices=layers, probs=probs, num_experts=_S.num_experts, token_order="requests",
                                 sample_ids=[rid], seq_lens=[entry["next"] - entry["start"]], source="sglang",
                                 extra={"rank": _rank(), "start_pos": entry["start"]})
    return out


def _safe_name(rid) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(rid))[:128] or "_"


def flush(dir=None, *, clear: bool = True) -> list:
    """Write each captured request to ``<dir>/rank<R>/<rid>.safetensors``; returns the paths."""
    dir = dir if dir is not None else _S.dir
    if dir is None:
        raise ValueError("no directory to write to (SOURCE_PATCH_SGLANG_ROUTING_DIR)")
    recs = records()
    folder = Path(dir) / f"rank{_rank()}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rid, rec in recs.items():
        path = folder / f"{_safe_name(rid)}.safetensors"
        rec.save(path)
        paths.append(path)
        _S.written += 1
    if clear:
        with _S.lock:
            _S.forwards = []
    return paths


def routing_sglang_release(req) -> None:
    """Call site at ``release_kv_cache`` entry: a finished request's record is written
    now (a scheduler is killed at shutdown, so waiting for exit would lose it) and
    its rows leave memory.  A retracted request (not finished) keeps its rows."""
    if _S.mode != "capture" or not _S.dir:
        return
    try:
        if not req.finished():
            return
        rid = req.rid
        rec = records(only=rid).get(rid)
        if rec is not None and not is_probe(rid):
            folder = Path(_S.dir) / f"rank{_rank()}"
            folder.mkdir(parents=True, exist_ok=True)
            rec.save(folder / f"{_safe_name(rid)}.safetensors")
            _S.written += 1
        _drop(rid)
    except Exception as exc:  # noqa: BLE001 - capture must never break serving
        _S.last_error = f"release: {type(exc).__name__}: {exc}"
        _warn_once(("release", type(exc).__name__), f"writing a finished request's routes failed: {exc}")


def _drop(rid) -> None:
    """Remove ``rid``'s rows from every captured forward."""
    with _S.lock:
        kept = []
        for fw in _S.forwards:
            if rid not in fw["rids"]:
                kept.append(fw)
                continue
            i = fw["rids"].index(rid)
            off, n = sum(fw["lens"][:i]), fw["lens"][i]
            rest = [j for j in range(len(fw["rids"])) if j != i]
            if rest:
                kept.append({**fw, "rids": [fw["rids"][j] for j in rest], "lens": [fw["lens"][j] for j in rest],
                             "starts": [fw["starts"][j] for j in rest],
                             "layers": {k: torch.cat([v[:off], v[off + n:]]) for k, v in fw["layers"].items()}})
        _S.forwards = kept


def _by_request(recs, rank_of=None) -> dict:
    out, owner = {}, {}
    for rec in recs:
        if rec.sample_ids is None or len(rec.sample_ids) != 1:
            raise RoutingRecordError(f"an SGLang routing file holds one request, this one has sample_ids "
                                     f"{rec.sample_ids}")
        rid = rec.sample_ids[0]
        rank = (rec.extra or {}).get("rank", 0)
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
    ``rank<R>`` folders :func:`flush` writes). A request seen by several ranks (TP
    replicas) must be identical on all of them; the lowest rank's record is kept."""
    files = sorted(Path(dir).rglob("*.safetensors"))
    if not files:
        raise RoutingRecordError(f"no routing files under {dir}")
    return _by_request([load(f) for f in files])


atexit.register(close)
