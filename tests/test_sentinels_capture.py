"""The capture a mismatch trigger asks for (runtime/sentinels/capture.py, docs/sentinels.md
#capturing-a-triggered-sample): the trainer's triggered rows dumped in the same step's
fwd_bwd pass through core/watch.py's ``capture`` (dumping off, no user code), the
engine's re-run through ``POST /dumper/prefill`` (runtime/dump/sglang.py), and the verdict
written into the run folder by a background worker.

Without an engine: the trainer side, its bounds, the prefill action's checks and its
clean-up.  With a real SGLang engine on CPU and the Megatron-Core twin
(tests/e2e/sentinels_capture_run.py): one layer perturbed for one step, the verdict names it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import source_patch
from source_patch.runtime.core import rows as batch_rows, settings, tags, watch
from source_patch.runtime.sentinels import capture, events, mismatch


def lines(folder, stream):
    path = folder / "rank-0" / f"{stream}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def manifest(folder: Path) -> list:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture
def armed(tmp_path, monkeypatch, dumper):
    """The mismatch watch armed on tmp_path/run, the dump's call sites loaded with dumping
    off; ``armed(**changes)`` re-applies settings."""
    monkeypatch.delenv("RANK", raising=False)
    dumper.configure(enable=False)
    run = tmp_path / "run"

    def arm(**changes):
        mismatch.apply({**settings.resolve("sentinels", {}), "mismatch": True, "dir": str(run), **changes})
        return run

    mismatch.clear()
    batch_rows.clear()
    arm()
    yield arm
    mismatch.apply({**settings.resolve("sentinels", {}), "mismatch": False, "dir": str(run)})
    mismatch.clear()
    batch_rows.clear()
    events.close_run()


IDS = ["r0", "r1", "r2"]
LENGTHS = [(3, 4), (2, 5), (4, 2)]  # (prompt, response) per sample: a right-padded [b=3, s=7] micro-batch


def micro_batch(phase):
    ids = torch.arange(21).reshape(3, 7) + 100
    return source_patch.batch(IDS, [p for p, _ in LENGTHS], [r for _, r in LENGTHS], input_ids=ids, phase=phase)


def forward(dump, seed=0):
    """What the dump spec's Megatron call sites hand over: [s, b, h] activations, a router's
    [s * b, experts] map, a tensor of another shape."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, 3, 4, generator=g)
    dump.dump("layer_output", hidden, layer=1)
    dump.dump("routing_map", torch.arange(21 * 2).reshape(21, 2), layer=1)
    dump.dump("scale", torch.ones(5))
    return hidden


def trigger(step, which=(1,)):
    """Watch log-probs where the samples in ``which`` are far off."""
    rollout = [-torch.rand(r, dtype=torch.float64) for _, r in LENGTHS]
    train = [x + (1.0 if i in which else 0.0) for i, x in enumerate(rollout)]
    return source_patch.watch_logprobs(IDS, train, rollout, step=step)


def test_a_trigger_dumps_that_samples_rows_in_the_same_steps_fwd_bwd_with_dumping_off(armed, dumper):
    run = armed()
    micro_batch("fwd_only")
    forward(dumper)  # the old log-probs' pass: nothing to capture yet
    assert watch.capture is None and dumper._gate is False
    figures = trigger(step=3)
    assert [f["triggered"] for f in figures] == [False, True, False]
    assert watch.capture.request_ids == {"r1"} and dumper._gate is True and not dumper.on
    forward(dumper)  # the fwd_only Rows still current: another pass, not captured
    micro_batch("fwd_bwd")
    hidden = forward(dumper, seed=1)
    mismatch.step_end(3)
    assert watch.capture is None and dumper._gate is False  # the step is over
    assert capture.drain(30)
    folder = run / "rank-0" / "capture-step3" / "trainer" / "rank-0"
    records = {r["name"]: r for r in manifest(folder)}
    assert set(records) == {"row_request", "positions", "input_ids", "layer_output", "routing_map", "scale"}
    from source_patch.runtime.dump import reader

    loaded = {r.name: r for r in reader.load(folder)}
    # r1 is column 1 of [s=7, b=3]: its 7 tokens, as [n, ...] rows; the map names them
    assert loaded["row_request"].tensor.tolist() == [1] * 7 and loaded["row_request"].tags["rids"] == IDS
    assert loaded["positions"].tensor.tolist() == list(range(7))
    assert loaded["input_ids"].tensor.tolist() == [100 + 7 + i for i in range(7)]
    assert torch.equal(loaded["layer_output"].tensor, hidden[:, 1])
    assert loaded["routing_map"].tensor.tolist() == [[2 * (3 * s + 1), 2 * (3 * s + 1) + 1] for s in range(7)]
    assert loaded["scale"].tensor.shape == (5,)  # not of the grid: whole
    assert {r.tags["phase"] for r in loaded.values()} == {"fwd_bwd"}
    # no engines set: the verdict says so; the bytes were charged against max_bytes
    (verdict,) = [e for e in lines(run, "events") if e["kind"] == "mismatch_verdict"]
    assert verdict["where"] == "trainer side only" and verdict["request_ids"] == ["r1"]
    assert verdict["trainer_records"] == 6 and not verdict["truncated"]
    assert mismatch.budget_left() == (1 << 30) - verdict["trainer_bytes"] and verdict["trainer_bytes"] == 7 * (
        4 + 4 + 8 + 16 + 16) + 20
    assert not (run / "rank-0" / "verdict-step3.json").exists()


def test_under_the_threshold_nothing_is_captured(armed, dumper):
    run = armed()
    micro_batch("fwd_only")
    assert not any(f["triggered"] for f in trigger(step=0, which=()))
    assert watch.capture is None
    micro_batch("fwd_bwd")
    forward(dumper)
    mismatch.step_end(0)
    assert capture.drain(10)
    assert not (run / "rank-0" / "capture-step0").exists()
    assert [e["kind"] for e in lines(run, "events")] == []
    assert mismatch.counters()["capture_records"] == 0


def test_max_triggers_and_max_bytes_bound_the_capture(armed, dumper):
    run = armed(max_triggers=1, max_bytes=200)  # r1 and r2 over; one captured; 200 bytes
    micro_batch("fwd_only")
    figures = trigger(step=5, which=(1, 2))
    assert [f["triggered"] for f in figures] == [False, True, False]
    micro_batch("fwd_bwd")
    forward(dumper)
    mismatch.step_end(5)
    assert capture.drain(30)
    (verdict,) = [e for e in lines(run, "events") if e["kind"] == "mismatch_verdict"]
    # the row map (28 + 28 + 56 bytes) fits, layer_output's 112 more do not: cut there
    assert verdict["truncated"] and verdict["trainer_records"] == 3 and verdict["trainer_bytes"] == 112
    assert mismatch.budget_left() == 200 - 112
    metric = lines(run, "metrics")[-1]
    assert metric["triggers_dropped"] == 1 and metric["captures"] == 1


def test_a_capture_needs_the_pass_it_names():
    """A micro-batch named for no pass, outside a schedule, is not captured (it could be
    the old log-probs' pass)."""
    class Capture:
        request_ids, phase, folder = frozenset({"r1"}), "fwd_bwd", "/nonexistent"

        def take(self, n):
            raise AssertionError("nothing is written")

    from source_patch.runtime.dump import api as dump

    batch_rows.clear()
    source_patch.batch(IDS, [3, 2, 4], [4, 5, 2])
    watch.set_capture(Capture())
    try:
        restore = tags.set_context(phase=None)
        dump.dump("layer_output", torch.ones(7, 3, 4), layer=1)
        restore.__exit__()
    finally:
        watch.set_capture(None)
        batch_rows.clear()
    assert dump._gate is dump.on


# ---------------------------------------------------------------- the engine's action, without an engine


def test_the_prefill_action_checks_its_body_as_a_whole(dumper):
    from source_patch.runtime.dump import sglang as dump_sglang

    before = dumper.public_config()
    for body, message in [({}, "non-empty list"), ({"requests": [{"rid": "a"}]}, "exactly 'rid' and 'input_ids'"),
                          ({"requests": [{"rid": "a", "input_ids": [1, -2]}]}, "token ids"),
                          ({"requests": [{"rid": "a", "input_ids": [1]}] * 2}, "given twice"),
                          ({"requests": [{"rid": str(i), "input_ids": [1]} for i in range(17)]}, "at most 16"),
                          ({"requests": [{"rid": "a", "input_ids": [1] * 70000}]}, "token ids in all"),
                          ({"requests": [{"rid": "a", "input_ids": [1]}], "port": 1}, "unknown key"),
                          ({"requests": [{"rid": "a", "input_ids": [1]}], "exp_name": "../x"}, "exp_name")]:
        with pytest.raises(Exception, match=message):
            dump_sglang.handle_control("prefill", body)
    assert dumper.public_config() == before and dump_sglang._only is None


def test_a_prefill_that_cannot_reach_its_engine_fails_and_puts_the_dump_back(dumper, tmp_path):
    """Outside SGLang the thread finds no server: the prefill fails, said in get_state,
    and every setting it changed is back."""
    from source_patch.runtime.dump import sglang as dump_sglang

    dumper.configure(enable=False)
    before = dumper.public_config()
    reply = dump_sglang.handle_control("prefill", {"requests": [{"rid": "a", "input_ids": [1, 2, 3]}],
                                                   "dir": str(tmp_path / "cap"), "exp_name": "engine"})
    assert reply["prefill"]["status"] == "running" and reply["prefill"]["tokens"] == 3
    deadline = time.monotonic() + 30
    while dump_sglang.handle_control("get_state", {})["prefill"]["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    state = dump_sglang.handle_control("get_state", {})
    assert state["prefill"]["status"] == "failed" and state["prefill"]["error"]
    assert dumper.public_config() == before and dump_sglang._only is None and not dumper._paused


def test_a_prefills_pass_shared_with_live_traffic_keeps_only_its_requests_rows(dumper, sglang_cpu, monkeypatch):
    """A prefill's request batched with others (live traffic): its pass is recorded as if
    it held that request alone (row map, token rows, its logits row); a pass without it
    is not recorded; with no prefill running, passes are written whole."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from source_patch.runtime.dump import reader
    from source_patch.runtime.dump import sglang as dump_sglang
    from source_patch.runtime.verdict import rows as verdict_rows

    model = torch.nn.Linear(2, 2)  # its summary (model.json) is written once

    def run_pass(rids, lens):
        n = sum(lens)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(rids), input_ids=torch.arange(n) + 100,
                          req_pool_indices=torch.arange(len(rids)), seq_lens=torch.tensor(lens),
                          out_cache_loc=torch.arange(n), seq_lens_sum=n)
        fb.rids, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(rids), list(lens), [0] * len(rids)
        positions = torch.cat([torch.arange(k) for k in lens])
        dump_sglang.dump_sglang_forward(model, fb.input_ids, positions, fb)
        dumper.dump("mlp_output", torch.arange(n * 4.0).reshape(n, 4), layer=0)
        dumper.dump("logits", torch.arange(len(rids) * 5.0).reshape(len(rids), 5))
        dump_sglang.dump_sglang_forward_end()

    monkeypatch.setattr(dump_sglang, "_only", frozenset({"b"}))
    run_pass(["a", "b", "c"], [2, 3, 1])  # the prefill's "b" between two others
    run_pass(["a", "c"], [1, 1])          # live traffic alone: not recorded
    monkeypatch.setattr(dump_sglang, "_only", None)
    dumper.pause(False)  # as prefill_end puts it back
    run_pass(["a", "c"], [1, 1])          # no prefill: whole
    dumper.flush(10)
    assert dumper.state()["counters"]["errors"] == 0
    records = reader.load(dumper.state()["exp_dir"])
    steps = sorted({r.step for r in records})
    assert len(steps) == 2, [(r.name, r.step, r.tags.get("rids")) for r in records]  # the pass without "b": nothing
    got = {r.name: r for r in records if r.step == steps[0]}
    assert got["row_request"].tags["rids"] == ["b"] and got["row_request"].tensor.tolist() == [0, 0, 0]
    assert got["input_ids"].tensor.tolist() == [102, 103, 104] and got["positions"].tensor.tolist() == [0, 1, 2]
    assert torch.equal(got["mlp_output"].tensor, torch.arange(24.0).reshape(6, 4)[2:5])
    assert got["logits"].tensor.tolist() == [[5.0, 6.0, 7.0, 8.0, 9.0]]  # b's row of the three
    assert verdict_rows.keys_of(got["row_request"], got["positions"]) == [("b", 0), ("b", 1), ("b", 2)]
    whole = {r.name: r for r in records if r.step == steps[1]}
    assert whole["row_request"].tags["rids"] == ["a", "c"] and whole["mlp_output"].tensor.shape == (2, 4)


def test_a_finished_prefills_files_are_listed_and_read_back_and_nothing_else(dumper, tmp_path):
    """/dumper/prefill_files and /dumper/prefill_read (an engine on another host): a
    finished prefill's own rank folder only, regular files by name, in chunks; a link, a
    path out of it, another rank's folder, an unknown prefill: refused or skipped."""
    import base64

    from source_patch.runtime.dump import sglang as dump_sglang

    dumper.configure(enable=False)
    reply = dump_sglang.handle_control("prefill", {"requests": [{"rid": "a", "input_ids": [1, 2]}],
                                                   "dir": str(tmp_path / "cap"), "exp_name": "engine"})
    prefill_id = reply["prefill"]["id"]
    deadline = time.monotonic() + 30
    while dump_sglang.handle_control("get_state", {})["prefill"]["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    folder = tmp_path / "cap" / "engine" / "rank-0"  # what the rank would have dumped (the engine was not there)
    folder.mkdir(parents=True)
    data = os.urandom(dump_sglang.FILE_CHUNK + 123)
    (folder / "00000001.safetensors").write_bytes(data)
    (folder / "manifest.jsonl").write_text('{"name": "x"}\n')
    (tmp_path / "secret").write_text("not a dump")
    (folder / "link").symlink_to(tmp_path / "secret")
    listed = dump_sglang.handle_control("prefill_files", {"id": prefill_id})
    assert listed["files"] == [{"path": "rank-0/00000001.safetensors", "bytes": len(data)},
                               {"path": "rank-0/manifest.jsonl", "bytes": 14}]  # not the link
    got, offset = b"", 0
    while True:
        chunk = dump_sglang.handle_control("prefill_read", {"id": prefill_id, "path": "rank-0/00000001.safetensors",
                                                            "offset": offset})
        got += base64.b64decode(chunk["data"])
        offset = len(got)
        if chunk["eof"]:
            break
    assert got == data and chunk["size"] == len(data)
    assert dump_sglang.handle_control("prefill_read", {"id": prefill_id, "path": "rank-1/manifest.jsonl"})["skip"]
    for body, message in [({"id": prefill_id, "path": "rank-0/link"}, "symbolic link"),  # O_NOFOLLOW
                          ({"id": prefill_id, "path": "rank-0/../secret"}, "rank folder"),
                          ({"id": prefill_id, "path": "rank-0/.hidden"}, "not a dump file"),
                          ({"id": prefill_id, "path": "../../secret"}, "rank folder"),
                          ({"id": prefill_id, "path": "rank-0/manifest.jsonl", "offset": -1}, "offset"),
                          ({"id": "prefill-0-0", "path": "rank-0/manifest.jsonl"}, "no finished prefill"),
                          ({"id": prefill_id, "path": "rank-0/manifest.jsonl", "size": 1}, "unknown key")]:
        with pytest.raises(Exception, match=message):
            dump_sglang.handle_control("prefill_read", body)


# ---------------------------------------------------------------- a real engine and the Megatron twin

RUN = Path(__file__).parent / "e2e" / "sentinels_capture_run.py"


@pytest.mark.slow
def test_one_perturbed_layer_for_one_step_the_verdict_names_it(tmp_path, shared_code_cache):
    """Steps 1 and 3 perturbed: step 1's engine side dumped straight into the run folder
    (engine_files auto, one filesystem), step 3's into the engine's own dump folder and
    copied over HTTP (engine_files fetch, as for an engine on another host)."""
    pytest.importorskip("megatron.core")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    environ["SOURCE_PATCH_CACHE"] = str(shared_code_cache)
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(RUN), "--out", str(tmp_path), "--steps", "4", "--perturb-step", "1",
                          "--perturb-step", "3", "--fetch-from", "2", "--perturb-layer", "1", "--max-triggers", "2"],
                         env=environ, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    run = Path(result["run"])
    threshold = result["threshold"]
    assert result["drained"] and result["last_error"] is None, result
    triggered = {}
    for step in result["steps"]:
        over = [s for s in step["samples"] if s["max_abs_diff"] > threshold]
        if not step["perturbed"]:
            assert over == [] and max(s["max_abs_diff"] for s in step["samples"]) < 1e-4  # the twin = the engine
        else:
            assert len(over) >= 1  # the perturbed layer moves the log-probs past the threshold
        fired = [s["rid"] for s in step["samples"] if s["triggered"]]
        assert all(s["max_abs_diff"] > threshold for s in step["samples"] if s["triggered"])
        assert len(fired) == min(len(over), 2)  # at most max_triggers a step
        triggered[step["step"]] = fired
    assert [step for step, fired in triggered.items() if fired] == [1, 3]
    # both sides' dumps, for the triggered samples only, of the perturbed steps only
    rank = run / "rank-0"
    assert sorted(p.name for p in rank.iterdir() if p.name.startswith("capture-")) == ["capture-step1", "capture-step3"]
    samples = {(step["step"], s["rid"]): s for step in result["steps"] for s in step["samples"]}
    verdicts = {e["step"]: e for e in lines(run, "events") if e["kind"] == "mismatch_verdict"}
    assert sorted(verdicts) == [1, 3]
    for n in (1, 3):
        (trainer,) = (rank / f"capture-step{n}" / "trainer").iterdir()
        (engine,) = (rank / f"capture-step{n}" / "engine").iterdir()
        trainer_rids = {rid for r in manifest(trainer) if r["name"] == "row_request" for rid in r["tags"]["rids"]}
        engine_rids = {rid for r in manifest(engine) if r["name"] == "row_request" for rid in r["tags"]["rids"]}
        assert engine_rids == set(triggered[n]) and set(triggered[n]) <= trainer_rids  # the trainer's map names
        tokens = sum(len(samples[n, rid]["prompt"]) + len(samples[n, rid]["output"])  # the micro-batch; its
                     for rid in triggered[n])                                          # rows: theirs
        assert {r["shape"][0] for r in manifest(trainer) if r["name"] in ("row_request", "layer_output")} == {tokens}
        # the verdict, in the run folder, with no one in the loop
        report = json.loads((rank / f"verdict-step{n}.json").read_text())
        assert (rank / f"verdict-step{n}.html").is_file()
        assert report["first_divergent"] == ["attention_output", 1]
        assert report["requests"] == len(triggered[n]) and report["tokens_paired"] == tokens
        assert all(r["ok"] for r in report["rows"] if r["layer"] == 0) and report["rows"][0]["ok"]
        verdict = verdicts[n]
        assert verdict["first_divergent"] == {"name": "attention_output", "layer": 1}
        assert verdict["where"] == "attention_output layer 1" and len(verdict["worst_tokens"]) == 5
        assert {t["request"] for t in verdict["worst_tokens"]} <= set(triggered[n])
        assert verdict["engine_status"] == "done" and verdict["cached_tokens"] == 0 and verdict["compare_exit"] == 1
    # step 1: the engine wrote into the run folder itself; step 3: into its own dump folder, copied here byte
    # for byte (every file the engine's rank folder holds, and their sizes summed in engine_fetched)
    assert "engine_fetched" not in verdicts[1]
    (served,) = (tmp_path / "engine-dumps").glob("sp-capture-r0-step3-*")
    originals = {p.relative_to(served): p.read_bytes() for p in served.rglob("*") if p.is_file()}
    fetched = {p.relative_to(rank / "capture-step3" / "engine"): p.read_bytes()
               for p in (rank / "capture-step3" / "engine").rglob("*") if p.is_file()}
    assert originals and fetched == originals
    assert verdicts[3]["engine_fetched"] == sum(map(len, originals.values()))
    counters = result["counters"]
    assert counters["capture_engine_fetched"] == verdicts[3]["engine_fetched"]
    assert counters["mismatch_bytes"] == sum(verdicts[n]["trainer_bytes"] + verdicts[n]["engine_bytes"]
                                             for n in (1, 3))
    print(f"capture e2e: {time.monotonic() - started:.1f} s, {result['times']}")
