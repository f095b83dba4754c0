"""Which request and token position each row of an SGLang forward batch is.

SGLang packs the tokens of all requests of a forward pass into one batch: in extend
(prefill) mode request i contributes ``extend_seq_lens[i]`` rows starting at its
prefix length; in decode mode one row, at position ``seq_lens[i] - 1``.  Routing
capture and the inference dump both need this map; it is read from the
``ForwardBatch`` without importing SGLang.
"""

from __future__ import annotations

from typing import NamedTuple


class BatchRows(NamedTuple):
    mode: str                 # "extend" | "decode"
    rids: list                # request ids, in batch order
    lens: list                # rows per request
    starts: list | None       # token position of each request's first row (None: unknown)


class Unattributed(NamedTuple):
    key: object               # what to warn about once
    reason: str


def _as_list(x):
    if x is None:
        return None
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def batch_rows(forward_batch) -> BatchRows | Unattributed | None:
    """The rows of ``forward_batch``; None for an idle batch or one without request
    ids, Unattributed for a mode whose rows cannot be attributed (speculative
    verification, ...)."""
    mode = forward_batch.forward_mode
    rids = forward_batch.rids
    if rids is None or mode.is_idle():
        return None
    if mode.is_decode():
        seq = _as_list(forward_batch.seq_lens_cpu)
        return BatchRows("decode", list(rids), [1] * len(rids), [s - 1 for s in seq] if seq is not None else None)
    if mode.is_extend(include_draft_extend_v2=True) or mode.is_mixed():
        if mode.is_target_verify() or (hasattr(mode, "is_draft_extend") and mode.is_draft_extend()):
            return Unattributed("spec", f"speculative forward mode {mode} is not attributed; its rows are skipped")
        lens = _as_list(forward_batch.extend_seq_lens_cpu)
        if lens is None:
            lens = _as_list(forward_batch.extend_seq_lens)
        return BatchRows("extend", list(rids), lens, _as_list(forward_batch.extend_prefix_lens_cpu))
    return Unattributed(("mode", str(mode)), f"forward mode {mode} is not attributed; its rows are skipped")


def is_probe(rid) -> bool:
    """SGLang's own /health and /health_generate requests: no user's request."""
    return str(rid).startswith("HEALTH_CHECK")
