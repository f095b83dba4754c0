"""Issue 53 item 4 (drill-down): per (name, layer) where the largest |a - b| is, its
percentiles, the tokens ranked by divergence; the report's per-token view; the JSON
contract the HTML page is written against; the text table's section."""

import json
import math

import numpy as np
import pytest
import torch
from test_compare_runs import BATCH, HIDDEN, RIDS, SEQ, megatron, run, sglang, values, write_run

from source_patch.runtime.verdict import compare, drill


def diverged(delta=0.5):
    """The rollout against a training side whose attention_output of layer 1 differs at
    request r1 position 3 hidden 5 (by ``delta``) and a little at r0 position 2."""
    tokens, acts = values()
    changed = {k: v.clone() for k, v in acts.items()}
    changed[("attention_output", 1)][1, 3, 5] += delta
    changed[("attention_output", 1)][0, 2, 0] += delta / 10
    return tokens, acts, changed


def test_the_drill_down_finds_where_and_ranks_the_tokens():
    tokens, acts, changed = diverged()
    report = compare.compare(sglang(tokens, acts), megatron(tokens, changed))
    row = next(r for r in report.rows if not r.ok)
    assert (row.name, row.layer) == ("attention_output", 1)
    a, b = acts[("attention_output", 1)], changed[("attention_output", 1)]
    assert row.where == {"request": "r1", "position": 3, "index": 5, "a": pytest.approx(float(a[1, 3, 5])),
                         "b": pytest.approx(float(b[1, 3, 5]))}
    # percentiles of |a - b| over all 12 x 8 values: two nonzero
    diff = (a - b).abs().reshape(-1).numpy()
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert row.percentiles[name] == pytest.approx(float(np.quantile(diff, q, method="nearest")))
    assert row.percentiles["p50"] == 0 and row.percentiles["max"] == pytest.approx(0.5)
    # tokens ranked by the relative L2 of their row; the two changed first, then the rest (10 at most)
    expected = lambda r, p: float((a[r, p] - b[r, p]).norm() / b[r, p].norm())  # noqa: E731
    assert [(w["request"], w["position"]) for w in row.worst[:2]] == [("r1", 3), ("r0", 2)]
    assert row.worst[0] == {"request": "r1", "position": 3, "token": int(tokens[1, 3]),
                            "diff": pytest.approx(expected(1, 3))}
    assert len(row.worst) == 10 and all(w["diff"] == 0 for w in row.worst[2:])


def test_the_report_json_keeps_the_contract(tmp_path, capsys):
    tokens, acts, changed = diverged()
    a, b = write_run(tmp_path / "a", sglang(tokens, acts)), write_run(tmp_path / "b", megatron(tokens, changed))
    assert run(a, b, "--json-out", tmp_path / "r.json") == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["layer_numbering"] == "layers numbered from 0 as SGLang's layer_id (A); Megatron's layer_number - 1 (B)"
    for row in report["rows"]:
        assert set(row["where"]) == {"request", "position", "index", "a", "b"}
        assert set(row["percentiles"]) == {"p50", "p90", "p99", "max"}
        assert 1 <= len(row["worst"]) <= 10
        assert all(set(w) == {"request", "position", "token", "diff"} for w in row["worst"])
        diffs = [w["diff"] for w in row["worst"]]
        assert diffs == sorted(diffs, reverse=True)
    view = report["tokens"]
    assert (view["name"], view["layer"]) == ("attention_output", 1) and report["tokens_paired"] == BATCH * SEQ
    assert [r["request"] for r in view["requests"]] == ["r1", "r0"]  # the worst first
    for request, row in zip(view["requests"], (1, 0)):
        assert [t["position"] for t in request["tokens"]] == list(range(SEQ))  # every paired token, in order
        assert [t["token"] for t in request["tokens"]] == tokens[row].tolist()  # from input_ids
        assert request["worst"] == max(t["diff"] for t in request["tokens"])
    (first,) = [r for r in report["rows"] if (r["name"], r["layer"]) == ("attention_output", 1)]
    assert view["requests"][0]["tokens"][3]["diff"] == first["worst"][0]["diff"] > 0
    capsys.readouterr()
    # --json on stdout: the same keys
    assert run(a, b, "--json") == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == view and printed["rows"] == report["rows"]


def test_without_divergence_the_view_is_the_largest_relative_l2():
    tokens, acts, changed = diverged(delta=1e-6)
    report = compare.compare(sglang(tokens, acts), megatron(tokens, changed), rtol=1e-3)
    assert report.first_divergent is None
    assert report.to_json()["tokens"]["name"] == "attention_output" and report.to_json()["tokens"]["layer"] == 1


def test_the_table_has_a_section_for_the_first_divergent_layer():
    tokens, acts, changed = diverged()
    table = compare.compare(sglang(tokens, acts), megatron(tokens, changed)).table().splitlines()
    assert table[-1] == "first divergent: attention_output layer 1"
    assert table[-3].startswith("attention_output layer 1: largest |a-b| 0.5 at request 'r1' position 3 "
                                "hidden index 5 (a ")
    assert "|a-b| p50 0 p90 0 p99 0.05 max 0.5" in table[-3]
    assert table[-2].startswith(f"  worst rows (relative L2): 'r1'@3 token {int(tokens[1, 3])} 0.19")
    assert table[-2].count("@") == 2  # the rows that differ, not the ties at 0
    clean = compare.compare(sglang(tokens, acts), megatron(tokens, acts)).table().splitlines()
    assert clean[-1] == "no divergence" and not any("largest |a-b|" in line for line in clean)


def test_per_row_figures_equal_a_loop_and_rank_nan_first():
    torch.manual_seed(0)
    x, y = torch.randn(40, 16), torch.randn(40, 16)
    x[7] = float("nan")
    x[9], y[9] = 1.0, 0.0      # a zero reference with a difference: infinite
    x[11], y[11] = 0.0, 0.0    # both zero: 0
    labels = drill.Labels(keys=[("r", i) for i in range(40)], tokens=list(range(40)))
    m = drill.measure(x.clone(), y, labels)
    for i in range(40):
        d, ref = float((x[i] - y[i]).norm()), float(y[i].norm())
        want = d / ref if ref > 0 or math.isnan(ref) else (0.0 if d == 0 else math.inf)
        got = float(m.per_row[i])
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, rel=1e-6), i
    assert [w["position"] for w in m.worst[:2]] in ([7, 9], [9, 7])  # NaN and infinity lead
    assert math.isnan(m.rel_l2) and math.isnan(m.max_abs)


def test_percentiles_above_the_limit_come_from_a_strided_sample(monkeypatch):
    torch.manual_seed(0)
    values_ = torch.rand(64 * 100)
    exact = drill.percentiles(values_, width=64)
    assert exact["p90"] == float(np.quantile(values_.numpy(), 0.9, method="nearest"))
    monkeypatch.setattr(drill, "EXACT_UP_TO", 1000)
    assert drill.stride(values_.numel(), 64) == 7
    sampled = drill.percentiles(values_, width=64)
    assert sampled["max"] == exact["max"] == float(values_.max())
    assert sampled["p50"] != exact["p50"]  # a sample indeed ...
    for name in ("p50", "p90", "p99"):
        assert sampled[name] == pytest.approx(exact[name], abs=0.03)  # ... close to the exact figure
    # the stride is odd and prime to the width: a sample of more values than the width
    # visits every hidden index
    monkeypatch.setattr(drill, "EXACT_UP_TO", 5000)
    for width in (64, 63, 1024, 4096, 15):
        step = drill.stride(width * 1000, width)
        assert step > 1 and math.gcd(step, width) == 1
        assert len(set((torch.arange(width * 1000)[::step] % width).tolist())) == width


def test_rids_of_the_json_are_the_dumped_ones():
    tokens, acts, changed = diverged()
    report = compare.compare(sglang(tokens, acts), megatron(tokens, changed)).to_json()
    assert {r["request"] for r in report["tokens"]["requests"]} == set(RIDS)
    assert json.dumps(compare.json_safe(report), allow_nan=False)
    assert all(len(r["tokens"]) == SEQ for r in report["tokens"]["requests"]) and HIDDEN == 8
