"""Per-token log-probability mismatch between a rollout (SGLang, the behaviour policy)
and training (Megatron, the current policy): the figures RL users track (slime/miles
``train_rollout_logprob_abs_diff``, the k3 KL estimate, truncated importance sampling).

    from source_patch.runtime.verdict import logprobs
    rollout = logprobs.rollout_logprobs(result["meta_info"]["output_token_logprobs"])
    train = logprobs.vocab_parallel_logprobs(logit_shards, targets)  # or token_logprobs(logits, targets)
    m = logprobs.mismatch(rollout, train, tis_clip=2.0)
    print(m.line()); m.to_json()

Log-probabilities of the training side come from its logits: ``token_logprobs`` on full
logits, ``gather_vocab_parallel`` to join Megatron's tensor-parallel logit shards, or
``vocab_parallel_logprobs`` to compute the same numbers from the shards without ever
holding the full vocabulary (what Megatron's ``vocab_parallel_cross_entropy`` does across
ranks).  All three work in float32 whatever the logits' dtype.

Padded vocabulary: Megatron pads the vocabulary (``make_vocab_size_divisible_by`` x TP)
and its log-softmax runs over the padded columns too; SGLang's logits processor slices
them off.  Pass ``vocab_size`` (the tokenizer's / HF config's) to leave them out.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch

__all__ = ["token_logprobs", "gather_vocab_parallel", "vocab_parallel_logprobs", "Mismatch", "mismatch",
           "rollout_logprobs", "rollout_token_ids"]

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- training side


def _check_targets(targets: torch.Tensor, tokens: int, vocab: int) -> torch.Tensor:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
    if targets.dim() != 1 or targets.shape[0] != tokens:
        raise ValueError(f"targets must have shape [{tokens}] (one per logits row), got {list(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if tokens:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target token id {bad} outside the vocabulary [0, {vocab})")
    return targets.long()


def _vocab_limit(vocab: int, vocab_size: int | None) -> int:
    if vocab_size is None:
        return vocab
    if not 0 < vocab_size <= vocab:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {vocab}] (the logits' width)")
    return vocab_size


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[i, targets[i]] for each row i: ``[tokens, vocab]`` logits of any
    float dtype (computed in float32) and ``[tokens]`` integer targets -> ``[tokens]``
    float32.  ``vocab_size`` keeps only the first ``vocab_size`` columns (padding off)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [tokens, vocab] tensor, got "
                         f"{list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    vocab = _vocab_limit(logits.shape[1], vocab_size)
    targets = _check_targets(targets, logits.shape[0], vocab)
    logp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _check_shards(shards) -> list:
    if isinstance(shards, torch.Tensor) or not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError("shards must be a non-empty list of [tokens, vocab/tp] tensors, one per TP rank")
    first = shards[0]
    for rank, s in enumerate(shards):
        if not isinstance(s, torch.Tensor) or s.dim() != 2:
            raise ValueError(f"shard {rank} must be a [tokens, vocab/tp] tensor, got "
                             f"{list(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
        if s.shape[1] == 0:
            raise ValueError(f"shard {rank} has no vocab columns")
        if not s.dtype.is_floating_point:
            raise ValueError(f"shard {rank} must be floating point, got dtype {s.dtype}")
        if s.shape != first.shape:
            raise ValueError(f"shard {rank} has shape {list(s.shape)}, shard 0 {list(first.shape)}: Megatron's "
                             "vocab-parallel logits are split into equal vocab ranges, one per TP rank")
        if s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"shard {rank} is {s.dtype} on {s.device}, shard 0 {first.dtype} on {first.device}")
    return list(shards)


def gather_vocab_parallel(shards) -> torch.Tensor:
    """The full ``[tokens, vocab]`` logits from Megatron's vocab-parallel shards.

    Megatron's output layer (``ColumnParallelLinear`` with ``gather_output=False``) leaves
    TP rank k holding the contiguous vocab range ``[k * vocab/tp, (k + 1) * vocab/tp)``
    (``VocabUtility.vocab_range_from_global_vocab_size``), so the shards, in TP-rank order,
    join along the last dim.  All shards must have the same shape, dtype and device."""
    return torch.cat(_check_shards(shards), dim=-1)


def vocab_parallel_logprobs(shards, targets: torch.Tensor, *, vocab_size: int | None = None) -> torch.Tensor:
    """``token_logprobs(gather_vocab_parallel(shards), targets)`` without materialising
    the full vocabulary: float32 ``[tokens]``.

    Megatron's ``vocab_parallel_cross_entropy`` pattern, its all-reduces here a loop over
    the shards (shard k holds the vocab columns from ``k * w``, ``w = vocab/tp``):

    1. max: m = max over shards of each shard's row max (all-reduce MAX);
    2. per shard, in float32, one shard at a time: s_k = sum exp(x - m) and the shifted
       target logit x[target] - m where the shard owns the target, 0 elsewhere;
    3. sum both over shards (all-reduce SUM): logsumexp = m + log sum_k s_k, and
       ``logp = (x[target] - m) - log sum_k s_k``.

    Shifting by the global max before the subtraction keeps the result as exact as
    ``log_softmax`` on the gathered logits, even for logits of large magnitude.
    ``vocab_size`` leaves out the padded columns at the top of the global vocabulary."""
    shards = _check_shards(shards)
    tokens, width = shards[0].shape
    vocab = _vocab_limit(width * len(shards), vocab_size)
    targets = _check_targets(targets, tokens, vocab).to(shards[0].device)
    kept = [(rank * width, max(0, min(width, vocab - rank * width))) for rank in range(len(shards))]
    kept = [(shard, start, keep) for shard, (start, keep) in zip(shards, kept) if keep]  # inside vocab_size
    # 1. the global max (a max is exact in the shards' own dtype)
    m = torch.stack([shard[:, :keep].amax(dim=-1) for shard, _, keep in kept]).amax(dim=0).float()
    # 2.-3. the rescaled exp sums and the owner's shifted target logit
    sum_exp = torch.zeros(tokens, dtype=torch.float32, device=m.device)
    picked = torch.zeros(tokens, dtype=torch.float32, device=m.device)
    for shard, start, keep in kept:
        x = shard[:, :keep].float() - m.unsqueeze(-1)
        sum_exp += x.exp().sum(dim=-1)
        owned = (targets >= start) & (targets < start + keep)
        local = (targets - start).clamp(0, keep - 1)
        picked += torch.where(owned, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(picked))
    return picked - sum_exp.log()


# ----------------------------------------------------------------------------- the mismatch


@dataclass
class Mismatch:
    """Summary of rollout vs training log-probabilities over ``tokens`` tokens (see
    ``mismatch`` for the formulas); every float is NaN when ``tokens`` is 0."""

    tokens: int
    mean_abs_diff: float     # mean |r|          (slime/miles train_rollout_logprob_abs_diff)
    max_abs_diff: float      # max |r|
    k3_kl: float             # mean (exp(r) - 1 - r) ~ KL(pi_rollout || pi_train)
    frac_over_ln2: float     # fraction of tokens with |r| > ln 2 (ratio outside (1/2, 2))
    tis_mean: float          # mean min(exp(r), tis_clip)
    tis_ess: float           # (sum w)^2 / (n sum w^2), in (0, 1]
    tis_clip: float          # the truncation used

    def line(self) -> str:
        if self.tokens == 0:
            return f"tokens 0  (no tokens to compare: no mismatch figures)  TIS clip {self.tis_clip:g}"
        return (f"tokens {self.tokens}  |dlogp| mean {self.mean_abs_diff:.2g} max {self.max_abs_diff:.2g}  "
                f"k3 KL {self.k3_kl:.2g}  >ln2 {100 * self.frac_over_ln2:.2f}%  "
                f"TIS mean {self.tis_mean:.3f} ESS {self.tis_ess:.3f}")

    def to_json(self) -> dict:
        """The fields as a JSON-safe dict: NaN (no tokens) and infinities (``tis_clip=inf`` too) become None."""
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(self).items()}


def _as_f64(name: str, x) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.dtype == torch.bool or t.dtype.is_complex:
        raise ValueError(f"{name} must be real log-probabilities, got dtype {t.dtype}")
    t = t.to(torch.float64)
    nan = torch.isnan(t).reshape(-1).nonzero()
    if nan.numel():
        raise ValueError(f"{name} holds {nan.numel()} NaN value(s), the first at flat index {int(nan[0])}")
    return t


def mismatch(rollout_logp, train_logp, tis_clip: float = 2.0, *, mask=None) -> Mismatch:
    """The log-probability mismatch of the sampled tokens, computed in float64.

    ``rollout_logp``: log pi_rollout(token) of the behaviour policy that sampled the tokens
    (SGLang); ``train_logp``: log pi_train(token) of the same tokens under the current
    policy (Megatron).  Same shape, any shape; ``mask`` (bool, same shape) keeps only the
    tokens where it is True (e.g. a loss mask).  With n tokens and, per token,

        r = train_logp - rollout_logp           log ratio, log(pi_train / pi_rollout)
        ratio = exp(r)                          the importance weight pi_train / pi_rollout

    the fields are

        mean_abs_diff = mean |r|,  max_abs_diff = max |r|
        k3_kl         = mean[(ratio - 1) - log(ratio)] = mean[expm1(r) - r]
        frac_over_ln2 = #{|r| > ln 2} / n             (ratio above 2 or below 1/2)
        w             = min(ratio, tis_clip)          truncated importance sampling
        tis_mean      = mean w
        tis_ess       = (sum w)^2 / (n * sum w^2)     normalised effective sample size, in (0, 1]

    k3 is Schulman's estimator ("Approximating KL divergence", 2020,
    http://joschu.net/blog/kl-approx.html): for x ~ q and ratio = p(x)/q(x),
    (ratio - 1) - log(ratio) is an unbiased estimate of KL(q || p) and >= 0 per sample.
    The tokens were sampled by the rollout policy, so q = pi_rollout, p = pi_train, and
    k3_kl estimates KL(pi_rollout || pi_train).  It is computed as expm1(r) - r (no
    cancellation for small r) and clamped at 0 per token against rounding.

    Identical inputs give 0 for the differences and the KL, tis_mean 1, ESS 1.  No tokens
    (empty, or nothing masked in) give ``tokens`` 0 and NaN figures.  Infinite log-probs
    pass through (infinite figures); NaN inputs, different shapes and a non-positive
    ``tis_clip`` raise ValueError (``tis_clip=math.inf`` turns truncation off)."""
    rollout, train = _as_f64("rollout_logp", rollout_logp), _as_f64("train_logp", train_logp)
    if rollout.shape != train.shape:
        raise ValueError(f"rollout_logp has shape {list(rollout.shape)}, train_logp {list(train.shape)}: "
                         "they must hold the same tokens")
    tis_clip = float(tis_clip)
    if not tis_clip > 0:
        raise ValueError(f"tis_clip must be > 0 (math.inf for no truncation), got {tis_clip}")
    if mask is not None:
        mask = mask.detach() if isinstance(mask, torch.Tensor) else torch.as_tensor(mask)
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be boolean, got dtype {mask.dtype}")
        if mask.shape != rollout.shape:
            raise ValueError(f"mask has shape {list(mask.shape)}, the log-probs {list(rollout.shape)}")
        mask = mask.to(rollout.device)
        rollout, train = rollout[mask], train[mask]
    rollout, train = rollout.reshape(-1), train.to(rollout.device).reshape(-1)
    n = rollout.numel()
    if n == 0:
        nan = math.nan
        return Mismatch(0, nan, nan, nan, nan, nan, nan, tis_clip)
    r = train - rollout
    a = r.abs()
    k3 = (torch.expm1(r) - r).clamp(min=0)
    w = torch.exp(r).clamp(max=tis_clip)
    w_sum, w_sq = float(w.sum()), float((w * w).sum())
    ess = w_sum * w_sum / (n * w_sq) if w_sq > 0 else math.nan
    return Mismatch(tokens=n, mean_abs_diff=float(a.mean()), max_abs_diff=float(a.max()),
                    k3_kl=float(k3.mean()), frac_over_ln2=float((a > LN2).sum()) / n,
                    tis_mean=w_sum / n, tis_ess=ess, tis_clip=tis_clip)


# ----------------------------------------------------------------------------- rollout side


def _parse(entries) -> list:
    """[(logprob, token_id)] of SGLang's ``meta_info["output_token_logprobs"]``."""
    if entries is None:
        raise ValueError("no output_token_logprobs: send the /generate request with \"return_logprob\": true")
    if isinstance(entries, dict):
        raise ValueError("pass meta_info[\"output_token_logprobs\"] (a list of [logprob, token_id, text] "
                         "triples), not a dict")
    if isinstance(entries, (str, bytes)) or not hasattr(entries, "__iter__"):
        raise ValueError(f"output_token_logprobs must be a list of [logprob, token_id, text] triples, "
                         f"got {type(entries).__name__}")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, (list, tuple)) or len(e) != 3:
            raise ValueError(f"output_token_logprobs[{i}] must be a [logprob, token_id, text] triple, got {e!r}")
        lp, tid, text = e
        if isinstance(lp, bool) or not isinstance(lp, numbers.Real) or math.isnan(lp) or lp > 1e-6:
            raise ValueError(f"output_token_logprobs[{i}]: logprob must be a number <= 0, got {lp!r}")
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral) or tid < 0:
            raise ValueError(f"output_token_logprobs[{i}]: token_id must be an integer >= 0, got {tid!r}")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"output_token_logprobs[{i}]: text must be a string or None, got {text!r}")
        out.append((float(lp), int(tid)))
    return out


def rollout_logprobs(meta_output_token_logprobs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[generated tokens]`` log-probs from SGLang's /generate ``meta_info["output_token_logprobs"]``
    (present with ``"return_logprob": true``): one ``[logprob, token_id, text]`` triple per
    generated token, ``text`` None unless ``return_text_in_logprobs``.  SGLang computes them
    in float32, so the float32 default loses nothing.  Strict: ValueError naming the index
    of the first malformed entry."""
    return torch.tensor([lp for lp, _ in _parse(meta_output_token_logprobs)], dtype=dtype)


def rollout_token_ids(meta_output_token_logprobs) -> torch.Tensor:
    """``[generated tokens]`` int64 token ids of the same triples (the targets on the training side)."""
    return torch.tensor([t for _, t in _parse(meta_output_token_logprobs)], dtype=torch.int64)
