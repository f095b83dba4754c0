"""Rollout vs training per-token log-probabilities (runtime/dump/logprobs.py): the
log-softmax of (vocab-parallel) logits, the mismatch figures, SGLang's meta parser."""

import json
import math

import pytest
import torch

from source_patch.runtime.verdict import logprobs as lp

E = math.e


# ----------------------------------------------------------------------------- the mismatch


def test_two_tokens_by_hand():
    # r = train - rollout = [-0.5, 1.0]
    m = lp.mismatch(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    assert m.tokens == 2 and m.tis_clip == 2.0
    assert m.mean_abs_diff == pytest.approx(0.75, abs=1e-9)
    assert m.max_abs_diff == pytest.approx(1.0, abs=1e-9)
    k3 = ((math.exp(-0.5) - 1 + 0.5) + (E - 1 - 1.0)) / 2
    assert m.k3_kl == pytest.approx(k3, abs=1e-9)
    assert m.frac_over_ln2 == pytest.approx(0.5, abs=1e-9)      # |1.0| > ln 2, |-0.5| is not
    w = [math.exp(-0.5), 2.0]                                     # e^1 truncated at 2
    assert m.tis_mean == pytest.approx(sum(w) / 2, abs=1e-9)
    assert m.tis_ess == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), abs=1e-9)


def test_truncation_is_applied_and_can_be_turned_off():
    rollout, train = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    loose = lp.mismatch(rollout, train, tis_clip=math.inf)
    w = [math.exp(-0.5), E]
    assert loose.tis_mean == pytest.approx(sum(w) / 2, abs=1e-9)
    assert loose.tis_ess == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), abs=1e-9)
    tight = lp.mismatch(rollout, train, tis_clip=0.5)             # both weights above 0.5: all equal
    assert tight.tis_mean == pytest.approx(0.5, abs=1e-9) and tight.tis_ess == pytest.approx(1.0, abs=1e-9)
    assert loose.k3_kl == tight.k3_kl                             # the clip touches TIS only
    assert loose.to_json()["tis_clip"] is None                    # inf is not JSON
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tis_clip"):
            lp.mismatch(rollout, train, tis_clip=bad)


def test_k3_estimates_kl_rollout_to_train():
    """Tokens drawn in exact proportion to the rollout policy q: the k3 mean is KL(q || p)
    exactly (not KL(p || q)), and the untruncated TIS mean is E_q[p/q] = 1."""
    q, p = [0.5, 0.25, 0.25], [0.125, 0.375, 0.5]
    tokens = [0, 0, 1, 2]
    m = lp.mismatch(torch.tensor([math.log(q[t]) for t in tokens], dtype=torch.float64),
                    torch.tensor([math.log(p[t]) for t in tokens], dtype=torch.float64), tis_clip=math.inf)
    kl_qp = sum(a * math.log(a / b) for a, b in zip(q, p))
    kl_pq = sum(b * math.log(b / a) for a, b in zip(q, p))
    assert abs(kl_qp - kl_pq) > 0.05
    assert m.k3_kl == pytest.approx(kl_qp, abs=1e-12)
    assert m.tis_mean == pytest.approx(1.0, abs=1e-12)


def test_identical_inputs_are_all_zero():
    x = -torch.rand(96) * 5
    m = lp.mismatch(x, x.clone())
    assert (m.tokens, m.mean_abs_diff, m.max_abs_diff, m.k3_kl, m.frac_over_ln2) == (96, 0.0, 0.0, 0.0, 0.0)
    assert m.tis_mean == 1.0 and m.tis_ess == 1.0
    assert m.line() == "tokens 96  |dlogp| mean 0 max 0  k3 KL 0  >ln2 0.00%  TIS mean 1.000 ESS 1.000"


def test_small_and_large_mismatches_in_the_line():
    rollout = torch.full((4,), -1.0)
    train = rollout + torch.tensor([1e-6, -2e-6, 0.0, -1.0])      # one token beyond ln 2
    m = lp.mismatch(rollout, train)
    assert m.frac_over_ln2 == 0.25 and m.max_abs_diff == pytest.approx(1.0, abs=1e-6)
    assert m.k3_kl > 0
    line = m.line()
    assert line.startswith("tokens 4  |dlogp| mean 0.25 max 1  k3 KL ") and ">ln2 25.00%" in line
    assert json.loads(json.dumps(m.to_json(), allow_nan=False))["frac_over_ln2"] == 0.25


def test_k3_is_accurate_for_tiny_differences():
    m = lp.mismatch(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1e-6], dtype=torch.float64))
    assert m.k3_kl == pytest.approx(math.expm1(1e-6) - 1e-6, rel=1e-6)   # about r^2 / 2 = 5e-13


def test_mask_and_any_shape():
    rollout = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    train = torch.tensor([[-1.0, -9.0], [-1.1, -1.0]])              # [0, 1]: padding, masked off
    mask = torch.tensor([[True, False], [True, True]])
    m = lp.mismatch(rollout, train, mask=mask)
    assert m.tokens == 3 and m.frac_over_ln2 == 0.0
    assert m.max_abs_diff == pytest.approx(0.1, abs=1e-6)
    with pytest.raises(ValueError, match="boolean"):
        lp.mismatch(rollout, train, mask=mask.int())
    with pytest.raises(ValueError, match="mask has shape"):
        lp.mismatch(rollout, train, mask=mask[0])


def test_empty_input():
    m = lp.mismatch(torch.empty(0), torch.empty(0))
    assert m.tokens == 0 and all(math.isnan(getattr(m, f)) for f in
                                 ("mean_abs_diff", "max_abs_diff", "k3_kl", "frac_over_ln2", "tis_mean", "tis_ess"))
    assert "no tokens" in m.line()
    out = json.loads(json.dumps(m.to_json(), allow_nan=False))
    assert out["tokens"] == 0 and out["k3_kl"] is None and out["tis_clip"] == 2.0
    assert lp.mismatch(torch.ones(2) * -1, torch.ones(2) * -1, mask=torch.zeros(2, dtype=torch.bool)).tokens == 0


def test_input_errors():
    with pytest.raises(ValueError, match="shape"):
        lp.mismatch(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        lp.mismatch(torch.zeros(2, 3), torch.zeros(6))
    with pytest.raises(ValueError, match="train_logp holds 1 NaN.*index 1"):
        lp.mismatch(torch.zeros(3), torch.tensor([0.0, math.nan, 0.0]))


# ----------------------------------------------------------------------------- training side


def test_token_logprobs_by_hand_and_dtypes():
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0]])
    out = lp.token_logprobs(logits, torch.tensor([1, 0]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([math.log(0.75), math.log(0.5)]))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 33, generator=g) * 4).bfloat16()
    t = torch.randint(0, 33, (5,), generator=g)
    got = lp.token_logprobs(x, t)
    assert got.dtype == torch.float32                              # bf16 in, float32 maths out
    assert torch.equal(got, torch.log_softmax(x.float(), -1)[torch.arange(5), t])
    assert torch.all(got <= 0)


def test_token_logprobs_errors():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        lp.token_logprobs(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lp.token_logprobs(x, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="integer"):
        lp.token_logprobs(x, torch.zeros(3))
    with pytest.raises(ValueError, match=r"\[tokens, vocab\]"):
        lp.token_logprobs(torch.zeros(3, 8, 1), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lp.token_logprobs(x, torch.tensor([0, 6, 1]), vocab_size=6)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_equals_the_gathered_log_softmax(tp, dtype):
    g = torch.Generator().manual_seed(tp)
    tokens, vocab = 24, 64
    full = (torch.randn(tokens, vocab, generator=g) * 6).to(dtype)
    targets = (torch.arange(tokens) * 11) % vocab                  # ids in every shard
    shards = list(full.chunk(tp, dim=-1))
    gathered = lp.gather_vocab_parallel(shards)
    assert torch.equal(gathered, full)
    expect = lp.token_logprobs(gathered, targets)
    got = lp.vocab_parallel_logprobs(shards, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expect)
    # the padded vocabulary left out: inside the last shard (50) and whole shards off (40, with tp 4)
    for vocab_size in (50, 40):
        keep = targets % vocab_size
        torch.testing.assert_close(lp.vocab_parallel_logprobs(shards, keep, vocab_size=vocab_size),
                                   lp.token_logprobs(full[:, :vocab_size], keep))
        torch.testing.assert_close(lp.token_logprobs(full, keep, vocab_size=vocab_size),
                                   lp.token_logprobs(full[:, :vocab_size], keep))


def test_vocab_parallel_is_stable_for_large_logits():
    full = torch.tensor([[1e4, 1e4 - 1.0, -1e4, 0.0]])
    shards = list(full.chunk(2, dim=-1))
    torch.testing.assert_close(lp.vocab_parallel_logprobs(shards, torch.tensor([1])),
                               lp.token_logprobs(full, torch.tensor([1])))
    assert torch.isfinite(lp.vocab_parallel_logprobs(shards, torch.tensor([2]))).all()


def test_shard_errors():
    a = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="non-empty list"):
        lp.gather_vocab_parallel([])
    with pytest.raises(ValueError, match="non-empty list"):
        lp.gather_vocab_parallel(a)
    with pytest.raises(ValueError, match="shard 1 has shape"):
        lp.gather_vocab_parallel([a, torch.zeros(3, 7)])
    with pytest.raises(ValueError, match="shard 1 has shape"):
        lp.vocab_parallel_logprobs([a, torch.zeros(2, 8)], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="shard 1 is torch.bfloat16"):
        lp.gather_vocab_parallel([a, a.bfloat16()])
    with pytest.raises(ValueError, match="no vocab columns"):
        lp.gather_vocab_parallel([torch.zeros(3, 0)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lp.vocab_parallel_logprobs([a, a], torch.tensor([0, 16, 1]))
    assert lp.vocab_parallel_logprobs([torch.zeros(0, 8)] * 2, torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="vocab_size"):
        lp.vocab_parallel_logprobs([a, a], torch.zeros(3, dtype=torch.long), vocab_size=17)


# ----------------------------------------------------------------------------- SGLang's meta


# a /generate reply with "return_logprob": true (text only where return_text_in_logprobs)
SGLANG_REPLY = json.loads("""{"text": " Paris.", "meta_info": {"id": "a1", "finish_reason": {"type": "length",
  "length": 3}, "prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 0,
  "input_token_logprobs": [[null, 791, null], [-7.25, 6864, null]],
  "output_token_logprobs": [[-0.0123291015625, 12366, " Paris"], [-1.5, 13, null], [0.0, 128009, "<|eot_id|>"]]}}""")


def test_parse_sglang_output_token_logprobs():
    meta = SGLANG_REPLY["meta_info"]["output_token_logprobs"]
    got = lp.rollout_logprobs(meta)
    assert got.dtype == torch.float32
    assert got.tolist() == [-0.0123291015625, -1.5, 0.0]
    assert lp.rollout_logprobs(meta, dtype=torch.float64).dtype == torch.float64
    ids = lp.rollout_token_ids(meta)
    assert ids.dtype == torch.int64 and ids.tolist() == [12366, 13, 128009]
    assert lp.rollout_logprobs([]).shape == (0,)
    assert lp.rollout_token_ids([tuple(e) for e in meta]).tolist() == [12366, 13, 128009]


@pytest.mark.parametrize("entries, message", [
    ([[-0.1, 5, None], [-0.2, 6]], r"output_token_logprobs\[1\] must be a .*triple"),
    ([[-0.1, 5, None], [-0.2, 6, None], [None, 7, None]], r"\[2\]: logprob must be a number"),  # orjson's -inf
    ([[0.5, 5, None]], r"\[0\]: logprob must be a number <= 0"),
    ([[-0.1, 5.0, None]], r"\[0\]: token_id must be an integer"),
    ([[-0.1, 5, None], [6, -0.2, None]], r"\[1\]: logprob must be a number <= 0"),  # fields swapped
    ([[-0.1, True, None]], r"\[0\]: token_id"),
    ([[-0.1, 5, 7]], r"\[0\]: text must be a string or None"),
    ([-0.1, 5, None], r"output_token_logprobs\[0\] must be"),     # one triple, not a list of them
    (None, "return_logprob"),
    ({"output_token_logprobs": []}, "not a dict"),
])
def test_parse_is_strict(entries, message):
    for parse in (lp.rollout_logprobs, lp.rollout_token_ids):
        with pytest.raises(ValueError, match=message):
            parse(entries)


def test_end_to_end_on_parsed_rollout():
    """SGLang's log-probs of its sampled tokens vs Megatron-style TP-sharded logits."""
    meta = SGLANG_REPLY["meta_info"]["output_token_logprobs"]
    ids = lp.rollout_token_ids(meta)
    logits = torch.full((3, 128256), -30.0)
    logits[torch.arange(3), ids] = 0.0
    train = lp.vocab_parallel_logprobs(list(logits.chunk(2, dim=-1)), ids)
    m = lp.mismatch(lp.rollout_logprobs(meta), train)
    assert m.tokens == 3 and m.max_abs_diff == pytest.approx(1.5, abs=1e-3)
    assert m.frac_over_ln2 == pytest.approx(1 / 3)
