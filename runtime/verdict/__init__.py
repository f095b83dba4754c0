"""The verdict: what two runs did differently, read from their dumps after the fact.

    compare.py       two runs' dumps (rollout or training, either side) compared layer by layer
                     (source-patch compare): the steps below in order, the CLI, exit code
    records.py       one side's records with their tensors, the tag checks
    sides.py         each side's kind (SGLang, Megatron) and layer numbering, read from its records
    join.py          tensor- and expert-parallel shards (and vocab-parallel logits) joined
    rows.py          rows keyed by (request, position): pairing, the layout self-test, rows one side lacks
    drill.py         inside one (name, layer): where |a-b| is largest, percentiles, the worst tokens
    agreement.py     routing agreement and next-token log-prob mismatch
    report.py        the report: table and JSON (the contract compare_html.py reads)
    compare_html.py  the comparison as one self-contained HTML page
    logprobs.py      per-token log-probabilities from (vocab-parallel) logits, the mismatch figures
    replay.py        a rollout's tokens through a Megatron model under the dump spec (source-patch replay)
    twin.py          a Megatron-Core twin of a Hugging Face Qwen3-MoE checkpoint

A tool room, not a capability: it reads what the capabilities wrote (dump's reader,
routing's records and alignment, weight sync's name mapping) and no call site, control
module or capability imports it, so a training or serving process never loads it
(tests/test_layout.py).
"""
