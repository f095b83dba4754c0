"""The verdict: what two runs did differently, read from their dumps after the fact.

    compare.py       two dump directories paired row by row and compared layer by layer
                     (source-patch compare): table, JSON, exit code
    compare_html.py  the comparison as one self-contained HTML page
    logprobs.py      per-token log-probabilities from (vocab-parallel) logits, the mismatch figures
    replay.py        a rollout's tokens through a Megatron model under the dump spec (source-patch replay)
    twin.py          a Megatron-Core twin of a Hugging Face Qwen3-MoE checkpoint

A tool room, not a capability: it reads what the capabilities wrote (dump's reader,
routing's records and alignment, weight sync's name mapping) and no call site, control
module or capability imports it, so a training or serving process never loads it
(tests/test_layout.py).
"""
