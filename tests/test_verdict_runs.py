"""A real mismatch, not a simulated one: examples/verdict_runs.py trains (one step's
forward and backward, Megatron-Core's own schedule, 2 micro-batches, 4 named requests)
the Megatron twin of one small Qwen3-MoE checkpoint that every run loads, and
`source-patch compare` compares two runs' dumps layer by layer:

(a) fp32 against bf16 (Float16Module, as Megatron's training loop runs it): a first
    divergent layer, relative L2 past 1e-3 growing over the layers, the worst tokens;
    fp32 against fp32 run again: bitwise equal, no divergence;
(b) TP 1 against TP 2 (gloo, two processes; vocab-parallel logits joined): no divergence,
    every relative L2 below 1e-5;
(c) one layer's expert weights scaled by 1.01: the first divergent layer is exactly that
    layer's mlp_output, everything before it bitwise equal, the worst tokens listed.

On CPU (2 cores: ~7 s a TP 1 run, ~9 s the TP 2 run; each run once per module).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")

from source_patch.runtime.verdict import compare  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_shared_code_cache")  # the runs compile patched code once (conftest.py)

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "verdict_runs.py"
REQUESTS = {"r0": 24, "r1": 17, "r2": 32, "r3": 20}  # examples/verdict_runs.py's REQUESTS: tokens each
LAYERS = 4


class Runs:
    """Each run of the script once per module, all loading one checkpoint written once."""

    def __init__(self, root: Path, cache: Path):
        self.root, self.cache, self.done = root, cache, {}
        self.checkpoint = root / "checkpoint"

    def __call__(self, name: str, *flags: str) -> Path:
        if name not in self.done:
            env = {**os.environ, "SOURCE_PATCH_CACHE": str(self.cache)}
            env.pop("SOURCE_PATCH", None)
            result = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(self.checkpoint),
                                     "--make-checkpoint", "--layers", str(LAYERS), "--out", str(self.root / "dumps"),
                                     "--name", name, *flags],
                                    env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            self.done[name] = result.stdout
        return self.root / "dumps" / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_code_cache):
    return Runs(tmp_path_factory.mktemp("verdict-runs"), shared_code_cache)


def verdict(reference: Path, other: Path, rtol: float = 1e-4):
    """Two training runs compared: ``other`` against ``reference`` (compare's B, the
    reference of relative L2); each side's layer numbering read from its records."""
    return compare.compare(str(other), str(reference), rtol=rtol)


def report_layer(report, layer: int) -> int:
    """The report's number of Megatron layer ``layer`` (1-based): reports number layers
    from their lowest, whatever base they count from."""
    return layer - 1 + min(r.layer for r in report.rows if r.layer is not None)


def rows_of(report) -> dict:
    return {(r.name, r.layer): r for r in report.rows}


def worst_tokens(report) -> list:
    """(request, position) of the tokens the report's JSON names as differing most in its
    first divergent row (its drill-down, "worst"), checked against its per-token view
    ("tokens": the first divergent row's tokens by request)."""
    data = compare.json_safe(report.to_json())
    first = list(data["first_divergent"])
    row = next(r for r in data["rows"] if [r["name"], r["layer"]] == first)
    view = data["tokens"]
    assert [view["name"], view["layer"]] == first and view["requests"], view
    assert {t["request"] for t in view["requests"]} <= set(REQUESTS), view
    return [(t["request"], t["position"]) for t in row.get("worst") or []]


# ---------------------------------------------------------------- (a) fp32 against bf16


def test_fp32_twice_is_bitwise_equal(runs):
    report = verdict(runs("fp32"), runs("fp32-again"))
    assert report.first_divergent is None, report.table()
    assert report.rows and all(r.max_abs == 0 and r.rel_l2 == 0 for r in report.rows), report.table()
    names = {r.name for r in report.rows}
    assert {"layer_input", "attention_output", "pre_mlp_residual", "mlp_output", "final_hidden", "logits"} <= names
    assert len({r.layer for r in report.rows if r.layer is not None}) == LAYERS


def test_bf16_diverges_from_fp32_from_the_first_layer_and_grows(runs):
    report = verdict(runs("fp32"), runs("bf16", "--dtype", "bf16"))
    table = report.table()
    # the embedding's output rounded to bf16 (layer 1's input): the first divergent row,
    # before any layer's
    assert report.first_divergent == ("embedding_output", None), table
    by = rows_of(report)
    assert by[("layer_input", report_layer(report, 1))].rel_l2 == by[("embedding_output", None)].rel_l2, table
    growth = [by[("layer_input", report_layer(report, n))].rel_l2 for n in range(1, LAYERS + 1)]
    assert all(x > 1e-3 for x in growth), table  # past bf16's own rounding (2^-9 relative) everywhere
    assert growth == sorted(growth) and growth[-1] > 3 * growth[0], table  # and growing layer over layer
    assert 1e-3 < by[("logits", None)].rel_l2 < 0.2, table
    assert by[("logits", None)].cosine > 0.99, table
    assert report.logprobs is not None and report.logprobs["line"], table
    print(table)


def test_bf16_verdict_through_the_cli(runs, tmp_path):
    """What bench/gpu_session.sh's `verdict` part runs: the CLI, exit 1, the JSON report."""
    out = tmp_path / "verdict.json"
    root = runs("fp32").parent
    runs("bf16", "--dtype", "bf16")
    result = subprocess.run([sys.executable, "-m", "source_patch.patcher", "compare", str(root), str(root),
                             "--exp-name", "bf16", "--exp-name", "fp32",
                             "--json-out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(out.read_text())
    first = data["first_divergent"]
    assert first == ["embedding_output", None] and data["rows"][0]["name"] == "embedding_output"
    assert "first divergent: embedding_output" in result.stdout


def test_bf16_verdict_lists_the_worst_tokens(runs):
    """The drill-down (compare's "worst" tokens): the tokens of the first divergent layer
    that differ most, each a (request, position) of the batch."""
    report = verdict(runs("fp32"), runs("bf16", "--dtype", "bf16"))
    worst = worst_tokens(report)
    assert worst, report.table()
    for rid, position in worst:
        assert rid in REQUESTS and 0 <= position < REQUESTS[rid]


def test_every_request_of_both_micro_batches_is_paired(runs):
    """Two micro-batches in one step: rows pair by (request, position) across them."""
    report = verdict(runs("fp32"), runs("fp32-again"))
    assert report.requests == len(REQUESTS), report.table()
    assert report.tokens == sum(REQUESTS.values()), report.table()


# ---------------------------------------------------------------- (b) TP 1 against TP 2


def test_tp2_equals_tp1_within_fp32_rounding(runs):
    report = verdict(runs("fp32"), runs("tp2", "--tp", "2"), rtol=1e-5)
    table = report.table()
    assert report.first_divergent is None, table
    by = rows_of(report)
    assert ("logits", None) in by, table  # the two vocabulary halves joined
    for row in report.rows:
        assert row.rel_l2 < 1e-5 and row.cosine > 0.999999, table
    assert max(r.max_abs for r in report.rows) < 1e-4, table
    print(table)


# ---------------------------------------------------------------- (c) one layer perturbed


def test_a_perturbed_layer_is_found_exactly_there(runs):
    report = verdict(runs("fp32"), runs("perturb", "--perturb", "3:1e-2"))
    table = report.table()
    layer = report_layer(report, 3)
    assert report.first_divergent == ("mlp_output", layer), table
    first = report.rows.index(rows_of(report)[("mlp_output", layer)])
    assert first > 0 and all(r.max_abs == 0 for r in report.rows[:first]), table  # everything before: bitwise equal
    assert all(r.max_abs == 0 for r in report.rows if r.layer is not None and r.layer < layer), table
    # the experts' output exactly 1.01 times: relative L2 1e-2 at every token
    assert abs(report.rows[first].rel_l2 - 1e-2) < 1e-4, table
    assert all(not r.ok for r in report.rows if r.layer is not None and r.layer > layer), table
    assert not rows_of(report)[("logits", None)].ok, table
    assert [r["agreement"] for r in report.routing][:layer + 1] == [1.0] * (layer + 1), table
    print(table)


def test_a_perturbed_layer_lists_the_tokens_most_affected(runs):
    report = verdict(runs("fp32"), runs("perturb", "--perturb", "3:1e-2"))
    worst = worst_tokens(report)
    assert worst, report.table()
    for rid, position in worst:
        assert rid in REQUESTS and 0 <= position < REQUESTS[rid]


# ---------------------------------------------------------------- the script's own checks


def test_the_run_records_what_it_ran(runs):
    run = runs("fp32")
    info = json.loads((run / "run.json").read_text())
    import importlib.metadata as metadata

    assert info["megatron-core"] == metadata.version("megatron-core")
    assert (info["dtype"], info["tp"], info["device"]) == ("fp32", 1, "cpu")
    assert len(info["losses"]) == 2 and info["grads finite"] is True
    assert f"megatron-core {info['megatron-core']}" in runs.done["fp32"]


def test_bad_arguments_are_refused(tmp_path):
    for flags, message in ((["--perturb", "0"], "numbered from 1"), (["--perturb", "x:1"], "LAYER or LAYER:SCALE"),
                           (["--megatron-version", "0.0.1", "--make-checkpoint"], "--megatron-version asks for 0.0.1")):
        result = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(tmp_path / "ckpt"), "--out",
                                 str(tmp_path / "dumps"), *flags], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
