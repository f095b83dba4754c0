"""The sentinels' mismatch watch (runtime/sentinels/mismatch.py): per-sample figures of the
trainer's log-probs against the rollout's, the step's metric line, the triggers and the
capture they ask for, and the disabled path that does nothing."""

import json
import math

import pytest
import torch

import source_patch
from source_patch.runtime.core import settings
from source_patch.runtime.sentinels import events, mismatch
from source_patch.runtime.verdict.logprobs import mismatch as verdict_mismatch


def lines(folder, stream):
    path = folder / "rank-0" / f"{stream}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def watch(tmp_path, monkeypatch):
    """The watch armed on a fresh run folder; ``watch(**changes)`` re-applies settings."""
    monkeypatch.delenv("RANK", raising=False)

    def arm(**changes):
        mismatch.apply({**settings.resolve("sentinels", {}), "mismatch": True, "dir": str(tmp_path), **changes})
        return tmp_path

    mismatch.clear()
    arm()
    yield arm
    mismatch.apply({**settings.resolve("sentinels", {}), "mismatch": False, "dir": str(tmp_path)})
    mismatch.clear()
    events.close_run()


def samples(lengths, seed=0, noise=0.01):
    """Rollout log-probs (<= 0) per sample and the trainer's, a little off."""
    g = torch.Generator().manual_seed(seed)
    rollout = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lengths]
    train = [x + noise * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in rollout]
    return train, rollout


def direct(train, rollout):
    """The figures written out token by token, in float64."""
    r = [t - x for t, x in zip(train.tolist(), rollout.tolist())]
    return {"tokens": len(r), "max_abs_diff": max(abs(v) for v in r),
            "k3": sum(max(0.0, math.expm1(v) - v) for v in r) / len(r),
            "frac_over_ln2": sum(abs(v) > math.log(2) for v in r) / len(r)}


def test_the_figures_are_the_direct_computation_and_the_verdict_s(watch):
    train, rollout = samples([5, 17, 1, 9], noise=0.6)  # some tokens over ln 2
    got = source_patch.watch_logprobs(["a", "b", "c", "d"], train, rollout)
    assert [g["request_id"] for g in got] == ["a", "b", "c", "d"]
    for g, t, x in zip(got, train, rollout):
        want = direct(t, x)
        verdict = verdict_mismatch(x, t)
        for key in ("max_abs_diff", "k3", "frac_over_ln2"):
            assert g[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
        assert g["tokens"] == want["tokens"] == verdict.tokens
        assert g["max_abs_diff"] == pytest.approx(verdict.max_abs_diff, rel=1e-12)
        assert g["k3"] == pytest.approx(verdict.k3_kl, rel=1e-12)
        assert g["frac_over_ln2"] == verdict.frac_over_ln2
    assert any(0 < g["frac_over_ln2"] < 1 for g in got)


def test_a_padded_batch_with_a_mask_gives_the_same_figures(watch):
    train, rollout = samples([5, 17, 3], noise=0.3)
    width = 17
    padded_t = torch.full((3, width), 7.0, dtype=torch.float64)  # padding far off: the mask leaves it out
    padded_r = torch.zeros((3, width), dtype=torch.float64)
    mask = torch.zeros((3, width), dtype=torch.bool)
    for i, (t, x) in enumerate(zip(train, rollout)):
        padded_t[i, :len(t)], padded_r[i, :len(x)], mask[i, :len(t)] = t, x, True
    flat = mismatch.watch_logprobs([1, 2, 3], train, rollout)
    padded = mismatch.watch_logprobs([1, 2, 3], padded_t.float(), padded_r.float(), mask=mask)
    for a, b in zip(flat, padded):
        assert a["tokens"] == b["tokens"]
        for key in ("max_abs_diff", "k3", "frac_over_ln2"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_one_host_copy_a_call_however_many_samples(watch, monkeypatch):
    copies = []
    real_cpu, real_item = torch.Tensor.cpu, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append("cpu") or real_cpu(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: copies.append("item") or real_item(self))
    train, rollout = samples([4] * 64)
    mismatch.watch_logprobs(list(range(64)), train, rollout)
    assert copies == ["cpu"]


def test_a_perturbed_step_triggers_on_that_step_only(watch):
    folder = watch()
    ids = ["r0", "r1", "r2", "r3"]
    seen = {}
    for step in range(4):
        train, rollout = samples([6, 8, 5, 7], seed=step)
        if step == 2:
            train[1] = train[1].clone()
            train[1][3] += 1.5  # one token of r1: |dlogp| 1.5 > ln 2
        figures = mismatch.watch_logprobs(ids, train, rollout, step=step)
        seen[step] = mismatch.triggered()
        assert [f["triggered"] for f in figures] == [step == 2 and rid == "r1" for rid in ids]
        assert mismatch.wants(["r1", "x"]) is (step == 2) and not mismatch.wants(["r0"])
        mismatch.step_end(None)
        assert mismatch.triggered() == []
    assert seen == {0: [], 1: [], 2: ["r1"], 3: []}
    (trigger,) = lines(folder, "events")
    assert trigger["kind"] == "mismatch_trigger" and trigger["step"] == 2 and trigger["request_id"] == "r1"
    assert trigger["max_abs_diff"] == pytest.approx(1.5, abs=0.05) and trigger["capture"] is True
    assert trigger["where"] == "request r1" and trigger["rank"] == 0
    metrics = lines(folder, "metrics")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert [m["over_threshold"] for m in metrics] == [0, 0, 1, 0]
    assert all(m["kind"] == "mismatch" and m["samples"] == 4 and m["tokens"] == 26 for m in metrics)
    assert metrics[2]["max_abs_diff_max"] == pytest.approx(trigger["max_abs_diff"])


def test_a_sample_under_the_threshold_triggers_nothing(watch):
    folder = watch(threshold=1.0)
    train, rollout = samples([6, 8])
    train[0] = train[0].clone()
    train[0][0] += 0.9  # over ln 2, under the threshold 1.0
    figures = mismatch.watch_logprobs(["a", "b"], train, rollout, step=0)
    assert figures[0]["frac_over_ln2"] == pytest.approx(1 / 6) and not figures[0]["triggered"]
    assert mismatch.triggered() == []
    mismatch.step_end(0)
    assert lines(folder, "events") == []
    (metric,) = lines(folder, "metrics")
    assert metric["over_threshold"] == 0 and metric["triggers"] == 0 and metric["threshold"] == 1.0


def test_max_triggers_a_step(watch):
    folder = watch(max_triggers=2)
    for step in (0, 1):
        train, rollout = samples([4] * 5, seed=step)
        train = [t + 2.0 for t in train]  # every sample over the threshold
        mismatch.watch_logprobs([f"s{step}-{i}" for i in range(5)], train, rollout, step=step)
        assert mismatch.triggered() == [f"s{step}-0", f"s{step}-1"]
        mismatch.step_end(step)
    triggers = lines(folder, "events")
    assert [(e["step"], e["request_id"]) for e in triggers] == [(0, "s0-0"), (0, "s0-1"), (1, "s1-0"), (1, "s1-1")]
    assert [(m["over_threshold"], m["triggers"], m["triggers_dropped"]) for m in lines(folder, "metrics")] == \
        [(5, 2, 3)] * 2
    assert mismatch.counters()["mismatch_triggers_dropped"] == 6


def test_max_bytes_stops_the_captures_not_the_events(watch):
    folder = watch(max_bytes=1000)
    train, rollout = samples([4, 4])
    train = [t + 2.0 for t in train]
    mismatch.watch_logprobs(["a"], train[:1], rollout[:1], step=0)
    assert mismatch.triggered() == ["a"]
    assert mismatch.charge(1500) == 0 and mismatch.budget_left() == 0  # the capture wrote 1500 bytes
    mismatch.step_end(0)
    mismatch.watch_logprobs(["b"], train[1:], rollout[1:], step=1)
    assert mismatch.triggered() == [] and not mismatch.wants(["b"])
    mismatch.step_end(1)
    first, second = lines(folder, "events")
    assert first["capture"] is True and second["capture"] is False and "max_bytes" in second["reason"]
    assert lines(folder, "metrics")[1]["bytes_captured"] == 1500


def test_a_non_finite_log_prob_triggers_and_the_lines_stay_json(watch):
    folder = watch()
    train, rollout = samples([5, 5])
    train[0] = train[0].clone()
    train[0][2] = float("nan")
    figures = mismatch.watch_logprobs(["nan", "ok"], train, rollout, step=0)
    assert figures[0]["nonfinite_tokens"] == 1 and figures[0]["max_abs_diff"] == math.inf and figures[0]["triggered"]
    mismatch.step_end(0)
    (event,) = lines(folder, "events")
    assert event["max_abs_diff"] is None and event["nonfinite_tokens"] == 1
    (metric,) = lines(folder, "metrics")
    assert metric["nonfinite_samples"] == 1 and metric["max_abs_diff_max"] == pytest.approx(figures[1]["max_abs_diff"])
    assert mismatch.last_error() is None and events.last_error() is None


def test_naming_a_new_step_ends_the_old_one(watch):
    folder = watch()
    train, rollout = samples([3])
    mismatch.watch_logprobs(["a"], train, rollout, step=7)
    mismatch.watch_logprobs(["a"], train, rollout, step=8)  # no step_end between (no optimizer call site)
    assert [m["step"] for m in lines(folder, "metrics")] == [7]
    mismatch.step_end(None)
    assert [m["step"] for m in lines(folder, "metrics")] == [7, 8]


def test_bad_input_is_counted_and_said_never_raised(watch):
    train, rollout = samples([3, 4])
    assert mismatch.watch_logprobs(["a", "b", "c"], train, rollout) is None
    assert mismatch.watch_logprobs(["a", "b"], train, [rollout[0], rollout[0]]) is None
    assert mismatch.counters()["mismatch_errors"] == 2
    assert "sample 1: 4 train log-probs, 3 rollout ones" in mismatch.last_error()


def test_disabled_it_does_nothing_and_writes_nothing(tmp_path):
    mismatch.clear()
    mismatch.apply({**settings.resolve("sentinels", {}), "mismatch": False, "dir": str(tmp_path / "run")})
    poison = object()  # touched at all, it would fail
    assert mismatch.watch_logprobs(poison, poison, poison, step=poison) is None
    mismatch.step_end(0)
    assert mismatch.triggered() == [] and not (tmp_path / "run").exists()
    assert all(v == 0 for v in mismatch.counters().values())


def test_the_root_package_exports_it_lazily():
    assert "watch_logprobs" in source_patch.__all__
    assert source_patch.watch_logprobs is mismatch.watch_logprobs


def test_through_the_sentinels_control(tmp_path):
    """control.configure arms it; the optimizer call site's sentinels_step ends the step."""
    from source_patch.runtime.sentinels import control

    try:
        control.configure(mismatch=True, nonfinite=False, routing_health=False, dir=str(tmp_path))
        control.reset()  # the step counts from 0, whatever ran in this process before
        assert control.enabled()
        train, rollout = samples([4, 4])
        train[0] = train[0] + 2.0
        mismatch.watch_logprobs(["a", "b"], train, rollout)  # no step named: the control's counts
        control.sentinels_step()
        state = control.state()
        assert state["counters"]["mismatch_triggers"] == 1 and state["counters"]["mismatch_steps"] == 1
        assert [e["request_id"] for e in lines(tmp_path, "events")] == ["a"]
        assert [(m["kind"], m["step"]) for m in lines(tmp_path, "metrics")] == [
            ("sentinels", 0), ("mismatch", lines(tmp_path, "events")[0]["step"])]  # the heartbeat, then the step's
        assert lines(tmp_path, "metrics")[0]["watches"] == ["mismatch"]
    finally:
        control.close()
        control.reset()
        control.configure_from_settings()
