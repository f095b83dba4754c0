"""Rollout/training log-prob mismatch per sample, and the capture it triggers
(docs/mismatch.md).

A framework calls, where it computes the trainer's log-probs of the rollout's tokens
(the ``fwd_only`` pass: the old log-probs)::

    import source_patch
    source_patch.watch_logprobs(request_ids, train_logprobs, rollout_logprobs, step=step)

``train_logprobs`` / ``rollout_logprobs``: one 1-D tensor (or list of floats) per sample,
or one padded ``[samples, tokens]`` tensor each with ``mask=`` (bool, True where a token
counts; without it every token counts).  Per sample, with ``r = train - rollout``:

    max_abs_diff   max |r|
    k3             mean((e^r - 1) - r), clamped at 0 per token (KL(rollout || train))
    frac_over_ln2  the fraction of tokens with |r| > ln 2 (ratio outside (1/2, 2))

the same formulas as runtime/verdict/logprobs.py's ``mismatch`` (a capability may not
import verdict/, and this one reduces many samples at once on the tensors' device, so the
few lines are here; tests/test_sentinels_mismatch.py checks both agree).  One host copy a
call, however many samples.  Off (the setting ``mismatch``): one flag test and return.

A sample whose ``max_abs_diff`` exceeds ``threshold`` is a trigger: an event
``mismatch_trigger`` (at most ``max_triggers`` a step) and its request id kept for the
step's ``fwd_bwd`` pass, where capture.py has the dump write its rows (through
core/watch.py's ``capture``), then, after the step, the engine re-run them and compare
write the verdict into the run folder.  ``triggered()`` / ``wants(request_ids)`` say which
samples a step captures, ``charge(nbytes)`` counts bytes against ``max_bytes`` (per run),
``drain(timeout)`` waits for the verdicts.
At ``step_end`` the step's aggregates go to metrics.jsonl (``mismatch``).  Nothing raises
into training: a failure is counted and said (``last_error``).
"""

from __future__ import annotations

import math
import threading

from ..core import settings
from ..core.failures import Counters
from . import capture, events

LN2 = math.log(2.0)

_on = False                  # the setting `mismatch`: the one flag watch_logprobs tests
_threshold = LN2
_max_triggers = 4
_max_bytes = 1 << 30

_lock = threading.Lock()
_budget_lock = threading.Lock()  # _bytes: charged by the dump's call sites and the capture's worker too
_pending_step = None         # the step the framework named (watch_logprobs(step=...)), None: not named
_steps = 0                   # step_end calls seen: the step when the framework names none
_samples: list = []          # this step's per-sample figures (dicts)
_triggered: list = []        # this step's captured request ids, in trigger order
_refused: list = []          # this step's triggers with an event but no capture (max_bytes spent)
_over = 0                    # this step's samples over the threshold
_dropped = 0                 # ... of which over max_triggers (no event, no capture)
_bytes = 0                   # bytes charged to captures this run
_dir = "./sp-sentinels"      # the run folder (the setting dir)

_NAMES = ("calls", "samples", "tokens", "triggers", "triggers_dropped", "captures_refused", "bytes", "steps",
          "errors", "lost")
_counters = Counters(_NAMES, "source_patch.sentinels", "sentinels mismatch")


# ---------------------------------------------------------------- the framework's call


def watch_logprobs(request_ids, train_logprobs, rollout_logprobs, *, step=None, mask=None):
    """Per-sample mismatch of the trainer's log-probs against the rollout's (module doc).

    Returns one dict per sample (``request_id``, ``tokens``, ``max_abs_diff``, ``k3``,
    ``frac_over_ln2``, ``nonfinite_tokens``, ``triggered``), or None when the watch is
    off or the call failed (counted; ``state()["last_error"]`` of the sentinels says why)."""
    if not _on:
        return None
    try:
        return _watch(request_ids, train_logprobs, rollout_logprobs, step, mask)
    except Exception as exc:  # noqa: BLE001 - a watch must never break training
        _counters.fail("watch_logprobs", exc)
        return None


def _watch(request_ids, train, rollout, step, mask) -> list:
    global _pending_step, _over
    ids = list(request_ids)
    rows = _per_sample(len(ids), train, rollout, mask)  # the one host copy
    with _lock:
        if step is not None:
            step = int(step)
            if _pending_step is not None and step != _pending_step and _samples:
                _end(_pending_step)  # a new step named before the old one ended: write the old one
            _pending_step = step
        at = _current_step()
        out = []
        for rid, (count, max_abs, k3_sum, over, nonfinite) in zip(ids, rows):
            tokens = int(count)
            figures = {"request_id": _plain(rid), "tokens": tokens,
                       "max_abs_diff": max_abs if tokens else None,
                       "k3": k3_sum / tokens if tokens else None,
                       "frac_over_ln2": over / tokens if tokens else None,
                       "nonfinite_tokens": int(nonfinite), "triggered": False}
            if tokens and max_abs > _threshold:  # inf (a non-finite token) exceeds it too
                _over += 1
                figures["triggered"] = _trigger(figures, at)
            _samples.append(figures)
            out.append(figures)
        _counters.add("calls")
        _counters.add("samples", len(ids))
        _counters.add("tokens", sum(int(r[0]) for r in rows))
    return out


def _trigger(figures: dict, step) -> bool:
    """An event and a capture for one sample over the threshold; False past max_triggers
    (counted only) or when the run's max_bytes is spent (event, no capture)."""
    global _dropped
    rid = figures["request_id"]
    if rid in _triggered or rid in _refused:
        return rid in _triggered
    if len(_triggered) + len(_refused) >= _max_triggers:
        _dropped += 1
        _counters.add("triggers_dropped")
        return False
    capture_it = _bytes < _max_bytes
    if capture_it:
        _triggered.append(rid)
        capture.add(step, rid, _take, _dir)  # the dump's fwd_bwd call sites capture it (capture.py)
    else:
        _refused.append(rid)
        _counters.add("captures_refused")
    _counters.add("triggers")
    events.event("mismatch_trigger", step=step, where=f"request {rid}", request_id=rid,
                 tokens=figures["tokens"], max_abs_diff=_finite(figures["max_abs_diff"]), k3=_finite(figures["k3"]),
                 frac_over_ln2=_finite(figures["frac_over_ln2"]), nonfinite_tokens=figures["nonfinite_tokens"],
                 threshold=_threshold, capture=capture_it,
                 **({} if capture_it else {"reason": f"max_bytes: {_bytes:,} of {_max_bytes:,} bytes captured"}))
    return capture_it


def _per_sample(n: int, train, rollout, mask) -> list:
    """[(tokens, max |r|, sum k3, #|r| > ln 2, #non-finite r)] per sample, reduced on the
    tensors' device and copied to the host once."""
    import torch

    if isinstance(train, torch.Tensor) and train.dim() == 2:
        t = train.detach()
        if not isinstance(rollout, torch.Tensor) or rollout.shape != t.shape:
            raise ValueError(f"train_logprobs is a padded {list(t.shape)} tensor: rollout_logprobs must be one of "
                             f"the same shape, got {_shape(rollout)}")
        if t.shape[0] != n:
            raise ValueError(f"{n} request ids for {t.shape[0]} rows of log-probs")
        dtype = _dtype(t.device)
        r = t.to(dtype) - rollout.detach().to(t.device, dtype)
        valid = None
        if mask is not None:
            valid = torch.as_tensor(mask).to(t.device)
            if valid.dtype != torch.bool or valid.shape != t.shape:
                raise ValueError(f"mask must be a bool tensor of shape {list(t.shape)}, got "
                                 f"{valid.dtype} {list(valid.shape)}")
        a, k3, over, bad = _token_figures(r, valid)
        count = valid.sum(dim=1) if valid is not None else torch.full((n,), t.shape[1], device=t.device)
        table = torch.stack([count.to(dtype), a.amax(dim=1) if t.shape[1] else a.sum(dim=1), k3.sum(dim=1),
                             over.sum(dim=1), bad.sum(dim=1)], dim=1)
        return table.cpu().tolist()
    train, rollout = _sequences("train_logprobs", train, n), _sequences("rollout_logprobs", rollout, n)
    masks = _sequences("mask", mask, n) if mask is not None else None
    lengths = [x.numel() for x in train]
    for i, (x, y) in enumerate(zip(train, rollout)):
        if y.numel() != x.numel():
            raise ValueError(f"sample {i}: {x.numel()} train log-probs, {y.numel()} rollout ones")
        if masks is not None and masks[i].numel() != x.numel():
            raise ValueError(f"sample {i}: a mask of {masks[i].numel()} for {x.numel()} log-probs")
    if n == 0:
        return []
    device = train[0].device
    dtype = _dtype(device)
    total = sum(lengths)
    if total == 0:
        return [(0, 0.0, 0.0, 0, 0)] * n
    t = torch.cat([x.reshape(-1).to(device, dtype) for x in train])
    r = t - torch.cat([y.reshape(-1).to(device, dtype) for y in rollout])
    valid = torch.cat([m.reshape(-1).to(device, torch.bool) for m in masks]) if masks is not None else None
    a, k3, over, bad = _token_figures(r, valid)
    sample = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lengths, device=device),
                                     output_size=total)  # no device sync: the size is given
    ones = valid.to(dtype) if valid is not None else torch.ones(total, dtype=dtype, device=device)
    table = torch.zeros(n, 5, dtype=dtype, device=device)
    table[:, 0].index_add_(0, sample, ones)
    table[:, 1].scatter_reduce_(0, sample, a, "amax", include_self=True)  # a >= 0: the zeros start it
    table[:, 2].index_add_(0, sample, k3)
    table[:, 3].index_add_(0, sample, over.to(dtype))
    table[:, 4].index_add_(0, sample, bad.to(dtype))
    return table.cpu().tolist()


def _token_figures(r, valid):
    """Per token: |r| (NaN as inf), k3 (inf where r is not finite), |r| > ln 2, r not
    finite; each 0 where ``valid`` is False."""
    import torch

    finite = torch.isfinite(r)
    a = torch.where(torch.isnan(r), torch.full_like(r, math.inf), r.abs())
    k3 = torch.where(finite, (torch.expm1(r) - r).clamp(min=0), torch.full_like(r, math.inf))
    over = (a > LN2).to(r.dtype)
    bad = (~finite).to(r.dtype)
    if valid is not None:
        zero = torch.zeros_like(r)
        a, k3, over, bad = (torch.where(valid, x, zero) for x in (a, k3, over, bad))
    return a, k3, over, bad


def _sequences(name: str, value, n: int) -> list:
    import torch

    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a list of one 1-D tensor (or list of floats) per sample, or a padded "
                        f"[samples, tokens] tensor, got {_shape(value)}")
    if len(value) != n:
        raise ValueError(f"{n} request ids for {len(value)} samples of {name}")
    out = []
    for x in value:
        x = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        out.append(x)
    return out


def _dtype(device):
    import torch

    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _shape(value) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__} of shape {list(shape)}" if shape is not None else type(value).__name__


def _plain(rid):
    """A request id as JSON keeps it: str, int, or its str."""
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else str(rid)


def _finite(x):
    return x if x is None or math.isfinite(x) else None


# ---------------------------------------------------------------- the capture it triggers


def triggered() -> list:
    """The request ids this step's triggers asked to capture (trigger order); cleared at
    the step's end.  The trainer dumps the micro-batch that holds each in the step's
    ``fwd_bwd`` pass (docs/mismatch.md#capturing-a-triggered-sample)."""
    with _lock:
        return list(_triggered)


def wants(request_ids) -> bool:
    """Whether a micro-batch of these request ids holds a sample to capture this step."""
    if not _triggered:
        return False
    with _lock:
        return any(_plain(rid) in _triggered for rid in request_ids)


def charge(nbytes: int) -> int:
    """Count ``nbytes`` a capture wrote (e.g. the dump's ``counters["bytes"]`` after minus
    before) against ``max_bytes``; returns the bytes left this run.  Once none are left a
    trigger is still an event, with ``capture: false``."""
    global _bytes
    with _budget_lock:
        n = max(0, int(nbytes))
        _bytes += n
        _counters.add("bytes", n)
        return max(0, _max_bytes - _bytes)


def budget_left() -> int:
    return max(0, _max_bytes - _bytes)


def _take(nbytes: int, *, left: bool = False, force: bool = False):
    """(capture.py) Charge ``nbytes`` of a capture if the run's max_bytes has room (True),
    else nothing (False); ``force``: charge what was written anyway (the engine's dump,
    known after the fact); ``left``: the bytes left."""
    global _bytes
    with _budget_lock:
        if left:
            return max(0, _max_bytes - _bytes)
        if not force and _bytes + nbytes > _max_bytes:
            return False
        _bytes += nbytes
        _counters.add("bytes", nbytes)
        return True


def drain(timeout: float | None = None) -> bool:
    """Wait until every captured step has its verdict (capture.py's worker)."""
    return capture.drain(timeout)


# ---------------------------------------------------------------- the watch surface (control.py)


def apply(config: dict) -> None:
    global _on, _threshold, _max_triggers, _max_bytes, _dir
    turning_off = _on and not config["mismatch"]
    if turning_off:
        with _lock:
            if _samples:
                _end(_current_step())  # what was gathered goes out before the watch stops
    _threshold, _max_triggers, _max_bytes = float(config["threshold"]), int(config["max_triggers"]), \
        int(config["max_bytes"])
    if config["mismatch"]:
        events.open_run(config["dir"])  # control.py opens it too; the same folder is opened once
    _dir = config["dir"]
    capture.apply(config)
    _on = bool(config["mismatch"])


def step_end(step) -> None:
    """The step is over: its aggregates to metrics.jsonl, its triggers forgotten."""
    global _steps
    if not _on and not _samples:
        return
    try:
        with _lock:
            told = int(step) if step is not None else _steps
            _end(_pending_step if _pending_step is not None else told)
            _steps = told + 1  # the control's count, followed: an unnamed trigger's step is the metric's
    except Exception as exc:  # noqa: BLE001
        _counters.fail("step_end", exc)


def _current_step() -> int:
    return _pending_step if _pending_step is not None else _steps


def _end(step) -> None:
    """Write the gathered step's metric line (if any sample came) and start a new step.
    Called with the lock held."""
    global _pending_step, _over, _dropped
    if _samples:
        counted = [s for s in _samples if s["tokens"]]
        line = {"step": step, "samples": len(_samples), "tokens": sum(s["tokens"] for s in _samples),
                "threshold": _threshold, "over_threshold": _over, "triggers": len(_triggered) + len(_refused),
                "captures": len(_triggered), "triggers_dropped": _dropped,
                "nonfinite_tokens": sum(s["nonfinite_tokens"] for s in _samples),
                "bytes_captured": _bytes, "bytes_left": max(0, _max_bytes - _bytes)}
        for key in ("max_abs_diff", "k3", "frac_over_ln2"):
            values = [s[key] for s in counted if s[key] is not None and math.isfinite(s[key])]
            line[f"{key}_mean"] = sum(values) / len(values) if values else None
            line[f"{key}_max"] = max(values) if values else None
        line["nonfinite_samples"] = sum(1 for s in counted if s["nonfinite_tokens"])
        events.metric("mismatch", **line)
        _counters.add("steps")
    _samples.clear()
    _triggered.clear()
    _refused.clear()
    _over = _dropped = 0
    _pending_step = None
    capture.step_done(step)  # no more records; the engine side and the verdict in the background


def counters() -> dict:
    return {**{f"mismatch_{k}": v for k, v in _counters.snapshot().items()}, **capture.counters()}


def last_error():
    return _counters.last_error or capture.last_error()


def clear() -> None:
    global _steps, _bytes, _pending_step, _over, _dropped
    with _lock:
        _samples.clear()
        _triggered.clear()
        _refused.clear()
        _steps = _bytes = _over = _dropped = 0
        _pending_step = None
    _counters.reset()
    capture.clear()


def _read_settings() -> None:
    """The settings as they stand (environment > specs > defaults), read when this module
    is first imported: a framework may call watch_logprobs before any sentinel call site
    has loaded control.py, which applies them again (the same values)."""
    try:
        apply(settings.resolve("sentinels"))
    except Exception as exc:  # noqa: BLE001 - a bad value: off, and said
        _counters.fail("settings", exc)


_read_settings()
