"""Rollout vs training, layer by layer (runtime/dump/compare.py): a real SGLang server's
inference dumps against the Megatron twin's dumps of the same tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from source_patch.runtime.verdict import compare

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.usefixtures("in_shared_code_cache")  # the twin's replays: tests/conftest.py
REPLAY = Path(__file__).parent / "e2e" / "twin_replay.py"


@pytest.fixture(scope="module")
def served(instrumented_sglang, tmp_path_factory):
    """Two requests, prefill and decode, from the real server: their dumps (alone in their
    experiment) and the server's reply, with the log-probs of the generated tokens."""
    server = instrumented_sglang.server
    root = tmp_path_factory.mktemp("rollout")
    server.post("/dumper/configure", {"dir": str(root), "exp_name": "r", "names": []})
    try:
        reply = server.generate(input_ids=[[5, 9, 2, 7, 7, 1], [300, 4, 8]], max_new_tokens=4,
                                rid=["cmp-a", "cmp-b"], return_logprob=True, sampling={"ignore_eos": True})
        server.post("/flush_cache")
    finally:
        server.post("/dumper/configure", {"dir": str(instrumented_sglang.dumps.parent), "exp_name": "serve"})
    return root / "r", reply


@pytest.fixture(scope="module")
def rollout(served):
    return served[0]


@pytest.fixture(scope="module")
def replayed(sglang_checkpoint, rollout, tmp_path_factory, shared_code_cache):
    """The Megatron twin's replay of the rollout: its dumps, and its log-probs of every token."""
    tmp = tmp_path_factory.mktemp("replayed")
    train = replay(sglang_checkpoint, rollout, tmp / "train", "--logprobs", str(tmp / "twin.json"),
                   cache=shared_code_cache)
    return train, json.loads((tmp / "twin.json").read_text())


def replay(checkpoint, rollout, out, *extra, cache=None):
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,dump", "SOURCE_PATCH_DUMP_DIR": str(out),
           "SOURCE_PATCH_DUMP_EXP_NAME": "t", **({"SOURCE_PATCH_CACHE": str(cache)} if cache else {})}
    result = subprocess.run([sys.executable, str(REPLAY), str(checkpoint), str(rollout), *extra], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "t"


@pytest.mark.slow
def test_the_twin_and_the_engine_agree_on_every_layer(rollout, replayed, tmp_path):
    train, _ = replayed
    report = compare.compare(rollout, train)
    assert report.requests == 2 and report.tokens == (6 + 4 - 1) + (3 + 4 - 1)  # the last token is never fed
    assert report.first_divergent is None, report.table()
    names = {(r.name, r.layer) for r in report.rows}
    assert {("layer_input", 0), ("attention_output", 1), ("mlp_output", 1), ("final_hidden", None),
            ("logits", None)} <= names
    assert all(r.cosine > 0.99999 for r in report.rows)
    # Same weights, same tokens: every token picks the same experts in every MoE layer.
    assert [r["layer"] for r in report.routing] == [0, 1] and report.routing_any_differ == 0.0
    assert all(r["agreement"] == 1.0 and r["tokens"] == report.tokens for r in report.routing)
    # The generated tokens' log-probs from both sides' logits (the RL figures).
    assert report.logprobs["tokens"] == 6 and report.logprobs["max_abs_diff"] < 1e-4
    out = tmp_path / "report.json"
    from source_patch.patcher import cli

    assert cli.main(["compare", str(rollout), str(train), "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["first_divergent"] is None


@pytest.mark.slow
def test_a_perturbed_layer_is_the_first_divergent_one(sglang_checkpoint, rollout, tmp_path, capsys):
    train = replay(sglang_checkpoint, rollout, tmp_path / "train", "--perturb", "2")
    report = compare.compare(rollout, train)
    assert report.first_divergent == ("attention_output", 1)  # SGLang layer 1 = Megatron layer 2
    assert all(r.ok for r in report.rows if r.layer == 0)
    assert compare.main([str(rollout), str(train)]) == 1
    assert "first divergent: attention_output layer 1" in capsys.readouterr().out


@pytest.mark.slow
def test_the_engines_log_probs_equal_the_twins(served, replayed):
    """SGLang's returned log-probs of its generated tokens against the Megatron twin's on the
    same tokens: the figures RL users track (|dlogp|, k3 KL, TIS) show no mismatch."""
    from source_patch.runtime.verdict import logprobs

    (_, reply), (_, twin) = served, replayed
    engine, train = [], []
    for request, (rid, prompt) in zip(reply, (("cmp-a", 6), ("cmp-b", 3))):
        # Generated token i sits at position prompt + i; the twin's list starts at position 1.
        # The last generated token is never fed back, so the rollout's dumps (what the twin
        # replays) stop before it: 3 of the 4 generated tokens per request are compared.
        theirs = twin[rid][prompt - 1:]
        engine.append(logprobs.rollout_logprobs(request["meta_info"]["output_token_logprobs"])[:len(theirs)])
        train.append(torch.tensor(theirs))
    m = logprobs.mismatch(torch.cat(engine), torch.cat(train))
    assert m.tokens == 6
    assert m.max_abs_diff < 1e-4 and m.k3_kl < 1e-8 and m.frac_over_ln2 == 0.0, m.line()
    assert abs(m.tis_mean - 1) < 1e-4 and m.tis_ess > 0.9999, m.line()


def test_a_misaligned_batch_fails_the_layout_self_test():
    """Shapes that match but rows that hold other tokens (the R3 class of bugs)."""
    import torch

    def side(tokens, order):
        tags = {"step": 0}
        return [compare.Rec("input_ids", tags, torch.tensor(tokens)), compare.Rec("positions", tags, torch.tensor(order)),
                compare.Rec("row_request", {**tags, "rids": ["r"]}, torch.zeros(len(tokens), dtype=torch.int32))]

    with pytest.raises(compare.LayoutError, match="request 'r' position 0: token 7 in A, 9 in B"):
        compare.compare(side([7, 8, 9], [0, 1, 2]), side([7, 8, 9], [2, 1, 0]))


def _batch(seq=8, batch=2, hidden=4, layers=2):
    """An unsplit [s, b] training batch: per-layer activations, token ids, row maps."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (seq, batch))
    tensors = {("input_ids", None): ids,
               ("positions", None): torch.arange(seq).unsqueeze(1).expand(seq, batch).contiguous(),
               ("row_request", None): torch.arange(batch, dtype=torch.int32).expand(seq, batch).contiguous()}
    for layer in range(1, layers + 1):
        tensors[("layer_input", layer)] = torch.randn(seq, batch, hidden)
        tensors[("mlp_output", layer)] = torch.randn(seq, batch, hidden)
    return tensors


def _records(tensors, rank=0, rids=("r0", "r1"), split=lambda t: t, layer_shift=0):
    out = []
    for (name, layer), t in tensors.items():
        tags = {"step": 0, "rank": rank, "layer": None if layer is None else layer + layer_shift}
        if name == "row_request":
            tags["rids"] = list(rids)
        out.append(compare.Rec(name, tags, split(t)))
    return out


@pytest.mark.parametrize("cp, tp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_context_and_sequence_parallel_slices_reassemble_to_the_unsplit_batch(cp, tp):
    """Each CP (zigzag) x SP rank dumps its own slice with its own row map: compared with
    the unsplit batch (as the rollout side, layers 0-based), every token pairs and
    nothing differs; a wrong split (no zigzag) fails the layout self-test."""
    from source_patch.runtime.core import slicing

    full = _batch(seq=16)
    rollout = _records(full, layer_shift=-1)
    train = []
    for c in range(cp):
        for t in range(tp):
            train += _records(full, rank=c * tp + t,
                              split=lambda x, c=c, t=t: slicing.sp_split(slicing.cp_split(x, cp, c), tp, t))
    report = compare.compare(rollout, train)
    assert report.tokens == 16 * 2 and report.first_divergent is None
    assert all(r.rows == 32 and r.max_abs == 0.0 for r in report.rows)
    if cp > 1:  # a row map split the plain way while the batch was zigzagged: caught
        bad = []
        for c in range(cp):
            pieces = {k: slicing.cp_split(v, cp, c) for k, v in full.items()}
            pieces[("positions", None)] = full[("positions", None)].chunk(cp)[c]
            bad += _records(pieces, rank=c)
        with pytest.raises(compare.LayoutError, match="layout self-test"):
            compare.compare(rollout, bad)


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    import torch

    from source_patch.runtime.core import slicing

    x = torch.arange(8)
    assert [slicing.cp_split(x, 2, r).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 4"):
        slicing.cp_split(torch.arange(6), 2, 0)


def test_routing_agreement_pairs_sglang_topk_ids_with_megatron_routing_maps():
    """SGLang: topk_ids [tokens, k] by a 1-D row map; Megatron: routing_map [s * b, experts]
    in the [s, b] row map's order.  One token of layer 0 picks another expert."""
    import torch

    tokens = torch.tensor([11, 12, 21, 22])            # r0: 11 12, r1: 21 22
    topk = {0: torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), 1: torch.tensor([[1, 0], [3, 2], [5, 4], [7, 6]])}
    tags = {"step": 0, "rank": 0}
    rollout = [compare.Rec("input_ids", tags, tokens), compare.Rec("positions", tags, torch.tensor([0, 1, 0, 1])),
               compare.Rec("row_request", {**tags, "rids": ["r0", "r1"]}, torch.tensor([0, 0, 1, 1]))]
    rollout += [compare.Rec("topk_ids", {**tags, "layer": k}, v) for k, v in topk.items()]
    # training [s=2, b=2]: column j is request j; rows flattened s-major: (s0 r0, s0 r1, s1 r0, s1 r1)
    order = [0, 2, 1, 3]
    train = [compare.Rec("input_ids", tags, tokens[order].reshape(2, 2)),
             compare.Rec("positions", tags, torch.tensor([[0, 0], [1, 1]])),
             compare.Rec("row_request", {**tags, "rids": ["r0", "r1"]}, torch.tensor([[0, 1], [0, 1]]))]
    for layer, ids in topk.items():
        routing_map = torch.zeros(4, 8, dtype=torch.bool)
        routing_map[torch.arange(4).unsqueeze(1), ids[order]] = True
        if layer == 0:
            routing_map[3] = False
            routing_map[3, [6, 0]] = True                # r1 position 1: experts {0, 6}, not {6, 7}
        train.append(compare.Rec("routing_map", {**tags, "layer": layer + 1}, routing_map))
    report = compare.compare(rollout, train)
    assert report.routing == [{"layer": 0, "tokens": 4, "agreement": 0.75},
                              {"layer": 1, "tokens": 4, "agreement": 1.0}]
    assert report.routing_any_differ == 0.25
    assert report.to_json()["routing"]["tokens_differing_any_layer"] == 0.25
    assert "routing agreement      0      4     75.00%" in report.table()


def test_next_token_log_probs_come_from_both_sides_logits():
    """Logits at (request, p) with the token at p + 1 known: each side's log-prob of it."""
    import torch

    from source_patch.runtime.verdict.logprobs import mismatch, token_logprobs

    torch.manual_seed(0)
    tokens, logits = torch.tensor([3, 1, 4, 1]), torch.randn(4, 8)
    tags = {"step": 0, "rank": 0}

    def side(values):
        return [compare.Rec("input_ids", tags, tokens), compare.Rec("positions", tags, torch.arange(4)),
                compare.Rec("row_request", {**tags, "rids": ["r"]}, torch.zeros(4, dtype=torch.int32)),
                compare.Rec("logits", tags, values)]

    shifted = logits.clone()
    shifted[1, 4] += 1.0  # training disagrees about the token after position 1
    report = compare.compare(side(logits), side(shifted))
    expected = mismatch(token_logprobs(logits[:3], tokens[1:]), token_logprobs(shifted[:3], tokens[1:]))
    assert report.logprobs["tokens"] == 3  # position 3 has no next token
    assert report.logprobs["max_abs_diff"] == expected.max_abs_diff > 0
    assert f"next-token log-probs: {expected.line()}" in report.table()


def test_vocab_parallel_logits_are_joined_across_tensor_parallel_ranks():
    """Training logits split over TP 2 (a vocabulary half each, same rows) against the
    rollout's full logits: joined, they compare equal and give the next-token figures."""
    import torch

    torch.manual_seed(0)
    tokens, logits = torch.tensor([3, 1, 4, 1]), torch.randn(4, 8)

    def records(rank, tp, values):
        tags = {"step": 0, "rank": rank, **({} if tp is None else {"tp": tp})}
        return [compare.Rec("input_ids", tags, tokens), compare.Rec("positions", tags, torch.arange(4)),
                compare.Rec("row_request", {**tags, "rids": ["r"]}, torch.zeros(4, dtype=torch.int32)),
                compare.Rec("logits", tags, values)]

    train = records(0, 0, logits[:, :4]) + records(1, 1, logits[:, 4:])
    report = compare.compare(records(0, None, logits), train)
    (row,) = [r for r in report.rows if r.name == "logits"]
    assert row.rows == 4 and row.max_abs == 0.0
    assert report.logprobs["tokens"] == 3 and report.logprobs["max_abs_diff"] == 0.0
