"""Which request and token position each row of an SGLang forward batch is.

SGLang packs the tokens of all requests of a forward pass into one batch: in extend
(prefill) mode request i contributes ``extend_seq_lens[i]`` rows starting at its
prefix length; in decode mode one row, at position ``seq_lens[i] - 1``.  Routing
capture and the inference dump both need this map; it is read from the
``ForwardBatch`` without importing SGLang.

Speculative decoding adds two kinds of forward.  A draft model's (its ``spec_info``
is a draft input, or its runner ``is_draft_worker``) is never a target request's
rows: :data:`DRAFT`.  A target verify pass scores every draft token of each request;
which of them are accepted is known only after it, so only a consumer keyed by KV
slot (routing capture: rejected tokens' slots are freed and never read back through
``req_to_token``) asks for its rows (``verify=True``); the others skip it.
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


class Draft(NamedTuple):
    """A draft model's forward: skipped without a warning (it is expected)."""


DRAFT = Draft()


def _as_list(x):
    if x is None:
        return None
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def batch_rows(forward_batch, runner=None, *, verify: bool = False) -> BatchRows | Unattributed | Draft | None:
    """The rows of ``forward_batch`` (run by ``runner``, a ModelRunner, where known);
    None for an idle batch or one without request ids, DRAFT for a draft model's
    forward, Unattributed for a mode whose rows cannot be attributed.  ``verify``: a
    target verify pass gets rows (mode "verify", each request's draft tokens, starts
    at its length before the pass) instead of Unattributed."""
    mode = forward_batch.forward_mode
    rids = forward_batch.rids
    if rids is None or mode.is_idle():
        return None
    if getattr(runner, "is_draft_worker", False) or _is_draft(getattr(forward_batch, "spec_info", None), mode):
        return DRAFT
    if mode.is_target_verify():
        return _verify_rows(forward_batch, list(rids)) if verify else Unattributed(
            "spec", f"speculative forward mode {mode} is not attributed; its rows are skipped")
    if mode.is_decode():
        seq = _as_list(forward_batch.seq_lens_cpu)
        return BatchRows("decode", list(rids), [1] * len(rids), [s - 1 for s in seq] if seq is not None else None)
    if mode.is_extend(include_draft_extend_v2=True) or mode.is_mixed():
        lens = _as_list(forward_batch.extend_seq_lens_cpu)
        if lens is None:
            lens = _as_list(forward_batch.extend_seq_lens)
        return BatchRows("extend", list(rids), lens, _as_list(forward_batch.extend_prefix_lens_cpu))
    return Unattributed(("mode", str(mode)), f"forward mode {mode} is not attributed; its rows are skipped")


def _is_draft(spec, mode) -> bool:
    if getattr(mode, "is_draft_extend_v2", lambda: False)():
        return True
    is_draft_input = getattr(spec, "is_draft_input", None)
    return bool(is_draft_input and is_draft_input())


def _verify_rows(forward_batch, rids: list) -> BatchRows | Unattributed:
    """Each request's draft tokens in a target verify pass (uniform, or the ragged
    layout's lengths)."""
    spec = forward_batch.spec_info
    layout = getattr(spec, "ragged_verify_layout", None)
    lens = _as_list(getattr(layout, "verify_lens_cpu", None)) if layout is not None else None
    if lens is None:
        per = getattr(spec, "draft_token_num", None) or getattr(spec, "num_tokens_per_req", -1)
        total = int(forward_batch.out_cache_loc.shape[0])
        if per is None or per <= 0 or per * len(rids) != total:
            return Unattributed(("verify", per, total), f"a verify pass of {total} rows for {len(rids)} requests "
                                f"({per} draft tokens each?) is not attributed; its rows are skipped")
        lens = [int(per)] * len(rids)
    return BatchRows("verify", rids, lens, _as_list(forward_batch.seq_lens_cpu))


def is_probe(rid) -> bool:
    """SGLang's own /health and /health_generate requests: no user's request."""
    return str(rid).startswith("HEALTH_CHECK")
