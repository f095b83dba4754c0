"""Rollout vs training, layer by layer (runtime/dump/compare.py): a real SGLang server's
inference dumps against the Megatron twin's dumps of the same tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from source_patch.runtime.dump import compare

pytest.importorskip("megatron.core")
REPLAY = Path(__file__).parent / "e2e" / "twin_replay.py"


@pytest.fixture(scope="module")
def rollout(instrumented_sglang, tmp_path_factory):
    """Dumps of two requests, prefill and decode, from the real server (alone in their experiment)."""
    server = instrumented_sglang.server
    root = tmp_path_factory.mktemp("rollout")
    server.post("/dumper/configure", {"dir": str(root), "exp_name": "r", "names": []})
    try:
        server.generate(input_ids=[[5, 9, 2, 7, 7, 1], [300, 4, 8]], max_new_tokens=4, rid=["cmp-a", "cmp-b"],
                        sampling={"ignore_eos": True})
        server.post("/flush_cache")
    finally:
        server.post("/dumper/configure", {"dir": str(instrumented_sglang.dumps.parent), "exp_name": "serve"})
    return root / "r"


def replay(checkpoint, rollout, out, *extra):
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,dump", "SOURCE_PATCH_DUMP_DIR": str(out),
           "SOURCE_PATCH_DUMP_EXP_NAME": "t"}
    result = subprocess.run([sys.executable, str(REPLAY), str(checkpoint), str(rollout), *extra], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "t"


@pytest.mark.slow
def test_the_twin_and_the_engine_agree_on_every_layer(sglang_checkpoint, rollout, tmp_path):
    train = replay(sglang_checkpoint, rollout, tmp_path / "train")
    report = compare.compare(rollout, train)
    assert report.requests == 2 and report.tokens == (6 + 4 - 1) + (3 + 4 - 1)  # the last token is never fed
    assert report.first_divergent is None, report.table()
    names = {(r.name, r.layer) for r in report.rows}
    assert {("layer_input", 0), ("attention_output", 1), ("mlp_output", 1), ("final_hidden", None),
            ("logits", None)} <= names
    assert all(r.cosine > 0.99999 for r in report.rows)
    out = tmp_path / "report.json"
    from source_patch.patcher import cli

    assert cli.main(["compare", str(rollout), str(train), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["first_divergent"] is None


@pytest.mark.slow
def test_a_perturbed_layer_is_the_first_divergent_one(sglang_checkpoint, rollout, tmp_path, capsys):
    train = replay(sglang_checkpoint, rollout, tmp_path / "train", "--perturb", "2")
    report = compare.compare(rollout, train)
    assert report.first_divergent == ("attention_output", 1)  # SGLang layer 1 = Megatron layer 2
    assert all(r.ok for r in report.rows if r.layer == 0)
    assert compare.main([str(rollout), str(train)]) == 1
    assert "first divergent: attention_output layer 1" in capsys.readouterr().out


def test_a_misaligned_batch_fails_the_layout_self_test():
    """Shapes that match but rows that hold other tokens (the R3 class of bugs)."""
    import torch

    def side(tokens, order):
        tags = {"step": 0}
        return [compare.Rec("input_ids", tags, torch.tensor(tokens)), compare.Rec("positions", tags, torch.tensor(order)),
                compare.Rec("row_request", {**tags, "rids": ["r"]}, torch.zeros(len(tokens), dtype=torch.int32))]

    with pytest.raises(compare.LayoutError, match="request 'r' position 0: token 7 in the rollout, 9 in training"):
        compare.compare(side([7, 8, 9], [0, 1, 2]), side([7, 8, 9], [2, 1, 0]))
