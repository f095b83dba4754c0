"""bench/overhead_bench.py --resident (CPU smoke run): one process per variant kept
alive, blocks of steps alternated round by round, sets of processes in turn
(--sessions), the A/A row and a variant against plain with per-round, mean and
10th-percentile ratios; the waits between blocks are not in the step times; runs pooled
(--pool), their sets of processes kept apart in the intervals."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_resident_mode_alternates_blocks_and_reports_an_aa_row(tmp_path):
    save = tmp_path / "run.json"
    out = subprocess.run([sys.executable, "bench/overhead_bench.py", "--resident", "3", "--rounds", "2", "--sessions", "2",
                          "--no-probes",
                          "--variants", "plain;plain again;routing capture", "--save", str(save)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    final = out.stdout.split("with each process's peaks")[-1]
    cell = r"[+-][\d.]+% \([+-][\d.]+\.\.[+-][\d.]+\)"
    for name in ("plain again", "routing capture"):  # per round, means, 10th percentiles
        assert re.search(rf"^{name}\s+4\s+[\d.]+ / [\d.]+ \[[\d.]+\.\.[\d.]+\]\s+{cell}\s+{cell}\s+{cell}", final,
                         re.M), final
    saved = json.loads(save.read_text())
    blocks, spans = saved["blocks"], saved["spans"]
    assert set(blocks) == set(spans) == {"plain", "plain again", "routing capture"}
    assert saved["sessions"] == [0, 0, 1, 1]  # two sets of processes, two rounds each
    assert out.stdout.count("resident: 3 processes warm") == 2
    for name, rows in blocks.items():
        assert len(rows) == 4 and all(len(b) == 3 for b in rows), rows  # 4 rounds of a block of 3 steps
        # a step waits for its block before its clock starts: a block's steps fit in its own
        # wall time, from "go" to its next "ready" (a step holding a wait would not, however
        # loaded the machine: the wait happens outside that span)
        for steps, span in zip(rows, spans[name]):
            assert 0 < sum(steps) <= span, (name, steps, span)


def test_calls_counts_what_the_inert_call_sites_are_called_a_step_and_everything_at_once_works():
    out = subprocess.run([sys.executable, "bench/overhead_bench.py", "--quick", "--calls",
                          "--variants", "plain;every spec inert;everything at once"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^(plain|everything at once)\s+1\s+[\d.]+\s+[+-].*$",
                                                          out.stdout, re.M)}
    assert set(rows) == {"plain", "everything at once"}, out.stdout
    # the everything-at-once process dumped (layer 1, every 10th step), captured routes and got trace frames
    line = next(line for line in out.stdout.splitlines() if re.match(r"\s*\d+\. everything at once", line))
    frames = int(re.search(r"trace frames (\d+)", line).group(1))
    assert frames >= 4 and "dump 0.00 GiB" in line, line  # 4 layers, 5 steps; a small model's layer: KiB
    assert float(rows["everything at once"].split()[-1].removesuffix("Mi")) > 0, rows
    found = re.search(r"every spec inert: (\d+) call-site calls a step, ([\d.]+) us a step in them .*most: (.*)$",
                      out.stdout, re.M)
    assert found, out.stdout
    # 4 layers: each layer's dump and trace sites, each router's entry, top-k and exit, the step hooks
    assert int(found.group(1)) >= 4 * 3 and float(found.group(2)) > 0, found.group(0)
    assert "dump" in found.group(3) and "trace" in found.group(3), found.group(0)
    assert "plain: " not in out.stdout  # megatron_cpu alone inserts no call sites


def test_variants_this_machine_cannot_run_are_refused_by_name():
    out = subprocess.run([sys.executable, "bench/overhead_bench.py", "--quick", "--variants",
                          "plain;weight sync every step"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode != 0
    assert "'weight sync every step' needs two GPUs" in out.stderr, out.stderr[-2000:]


def test_pooled_runs_pair_each_round_within_its_run_and_the_low_quantile_skips_slow_stretches(tmp_path):
    """--pool: resident runs' rounds in one table, each round's blocks from one run; the
    10th-percentile ratio reads a variant's undisturbed steps where a slow stretch of
    the host hit some blocks (here plain's), and the per-round medians do not."""
    def run(plain_slow: float) -> dict:
        return {"plain": [[100.0] * 8 + [plain_slow] * 2, [plain_slow] * 10, [100.0] * 10],
                "routing capture": [[101.0] * 10, [101.0] * 9 + [150.0], [101.0] * 10]}
    paths = []
    for i, slow in enumerate((130.0, 120.0)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"blocks": run(slow), "spans": {}}))
    out = subprocess.run([sys.executable, "bench/overhead_bench.py", "--pool", *map(str, paths)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("routing capture "))
    assert re.match(r"routing capture\s+6\s", row), row  # 3 rounds of each run
    per_round, means, low = re.findall(r"([+-][\d.]+)% \(", row)
    assert float(low) == 1.0  # 101 against 100: the undisturbed steps
    assert float(means) < 0  # the means carry plain's slow stretch

def test_the_interval_resamples_sets_of_processes_where_rounds_share_one():
    """stats.bootstrap with groups: rounds that share a set of processes share its
    offset, so the interval must span the sets' offsets, where resampling the rounds
    alone would shrink it with their number."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import stats
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import statistics

    ratios = [1.0 + 0.01 * group + 0.001 * (i % 5) for group in range(4) for i in range(20)]  # 4 sets' offsets
    groups = [group for group in range(4) for _ in range(20)]
    _, low, high = stats.bootstrap(statistics.fmean, ratios, paired=True)
    _, g_low, g_high = stats.bootstrap(statistics.fmean, ratios, paired=True, groups=groups)
    assert g_high - g_low > 3 * (high - low)
    assert stats.bootstrap(statistics.fmean, ratios, paired=True, groups=[0] * 80) == \
        stats.bootstrap(statistics.fmean, ratios, paired=True)  # one set: the rounds, as before


def test_swap_alternates_one_process_between_its_patched_code_and_megatron_cpus_alone(tmp_path):
    """--swap: one process per variant, three blocks a round (the code megatron_cpu alone
    makes, twice, and the patched code), each compared with the kept code's first block."""
    save = tmp_path / "run.json"
    out = subprocess.run([sys.executable, "bench/overhead_bench.py", "--resident", "2", "--rounds", "3", "--swap",
                          "--no-probes", "--variants", "every spec inert", "--save", str(save)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    final = out.stdout.split("with each process's peaks")[-1]
    cell = r"[+-][\d.]+% \([+-][\d.]+\.\.[+-][\d.]+\)"
    for label in ("every spec inert [kept again]", "every spec inert [patched]"):
        assert re.search(rf"^{re.escape(label)}\s+3\s+[\d.]+ / [\d.]+ \[[\d.]+\.\.[\d.]+\]\s+{cell}\s+{cell}\s+{cell}",
                         final, re.M), final
    assert out.stdout.count("resident: 1 processes warm") == 1
    swapped = re.search(r"^every spec inert: (\d+) functions of (\d+) modules swappable: (.*)$", out.stdout, re.M)
    assert swapped, out.stdout[-3000:]
    # the trace and dump sites of a layer, the router's routing capture, the step hooks
    for name in ("TransformerLayer._forward_mlp", "TopKRouter.routing", "MixedPrecisionOptimizer.step"):
        assert name in swapped.group(3), swapped.group(0)
    assert "left patched" not in swapped.group(0)
    blocks = json.loads(save.read_text())["blocks"]
    assert set(blocks) == {"every spec inert [kept]", "every spec inert [kept again]", "every spec inert [patched]"}
    assert all(len(rows) == 3 and all(len(b) == 2 for b in rows) for rows in blocks.values()), blocks


def test_call_profile_counts_the_sentinels_call_sites_a_step_after_the_warmup():
    """bench/call_profile.py --quick: one process of the variant, its call sites' calls and
    host time per timed step (the warm-up's left out), and torch.profiler's table."""
    out = subprocess.run([sys.executable, "bench/call_profile.py", "--quick", "--torch-profile", "4:2", "--variants",
                          "sentinels armed;sentinels: routing health only"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    armed, health = out.stdout.split("sentinels: routing health only: step median")
    site = r"^\s+{}\s+([\d.]+) calls/step\s+([\d.]+) us/step"
    # the quick model: 4 MoE layers, each a router call; every layer's dump sites and the logits
    assert float(re.search(site.format("routing_topk"), armed, re.M).group(1)) == 4.0
    assert float(re.search(site.format("sentinels_step"), armed, re.M).group(1)) == 1.0
    assert float(re.search(site.format("dump"), armed, re.M).group(1)) > 8
    # the profiler's table: host time and device time per step (0 on the CPU)
    assert re.search(r"^\s+aten::mm\s+[\d.]+\s+[\d.]+\s+[\d.]+$", armed, re.M), armed
    # routing health alone: the dump call sites have no hook (a flag test), the router's has
    dump_us = float(re.search(site.format("dump"), health, re.M).group(2))
    assert dump_us < float(re.search(site.format("dump"), armed, re.M).group(2)), out.stdout


def test_sentinel_parts_times_the_sentinels_own_functions_a_step_after_the_warmup():
    """bench/sentinel_parts.py --quick: the armed sentinels' functions inside Megatron's
    real schedule, calls and host time per step after the warm-up."""
    out = subprocess.run([sys.executable, "bench/sentinel_parts.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row = r"^\s+{}\s+([\d.]+) calls/step\s+([\d.]+) us/step"
    calls = {name: float(re.search(row.format(re.escape(name)), out.stdout, re.M).group(1))
             for name in ("nonfinite._hook", "nonfinite._read_by_layer", "nonfinite.write_kept",
                          "routing_health.routes", "routing_health._accumulate")}
    # 4 MoE layers: a router call each, accumulated once a step; the step's reads written
    # into their slots once; each layer's input is the layer before's output (or the
    # embedding's), already read: 4 hook calls that take no slot
    # (the close's step end after the last step adds a fraction to a once-a-step count)
    assert calls["routing_health.routes"] == 4.0 and round(calls["routing_health._accumulate"]) == 1, out.stdout
    assert round(calls["nonfinite.write_kept"]) == 1, out.stdout
    assert calls["nonfinite._read_by_layer"] <= calls["nonfinite._hook"] - 4, out.stdout


def test_the_probe_counts_garbage_collections_per_generation():
    """overhead_probe's ``gc`` report (call_profile's ``(gc generation N)`` rows): each
    collection counted in its generation, with the time it took."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import overhead_probe
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import gc
    counts = overhead_probe.count_collections()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.pop()
    assert counts[0][0] >= 1 and counts[2][0] >= 2 and counts[2][1] > 0
