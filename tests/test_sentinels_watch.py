"""`source-patch watch RUN_FOLDER` (runtime/sentinels/watch.py) on hand-written run folders:
several ranks in time order, the metrics' last values, a malformed line, a huge line, a
FIFO refused at once, the error line and its JSON, --follow in a real subprocess."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from source_patch.patcher import cli
from source_patch.runtime.sentinels import watch


def write(folder, rank, stream, *records, raw=b""):
    path = folder / f"rank-{rank}" / f"{stream}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for r in records:
            f.write((json.dumps(r) + "\n").encode())
        f.write(raw)
    return path


@pytest.fixture
def run(tmp_path):
    """Two ranks: events interleaved in time, metrics of two kinds (one per layer)."""
    folder = tmp_path / "sp-sentinels"
    write(folder, 0, "events",
          {"kind": "nonfinite", "time": 100.0, "rank": 0, "step": 3, "where": "layer 2 attn_output"},
          {"kind": "mismatch_trigger", "time": 300.0, "rank": 0, "step": 5, "where": "request r7",
           "request_id": "r7", "max_abs_diff": 1.2})
    write(folder, 1, "events", {"kind": "nonfinite", "time": 200.0, "rank": 1, "step": 3, "layer": 2,
                                "name": "mlp_output"})
    for step in (1, 2):
        write(folder, 0, "metrics", {"kind": "mismatch", "time": 10.0 + step, "rank": 0, "step": step,
                                     "samples": 8, "k3_mean": 0.001 * step})
        for rank in (0, 1):
            for layer in (0, 1):
                write(folder, rank, "metrics", {"kind": "routing_health", "time": 10.0 + step, "rank": rank,
                                                "step": step, "layer": layer, "imbalance": step + layer / 10,
                                                "dead_experts": 0})
    return folder


def test_events_in_time_order_and_the_last_metrics(run, capsys):
    assert cli.main(["watch", str(run)]) == 1
    out = capsys.readouterr().out
    assert "2 ranks (rank-0, rank-1)" in out and "events: 3" in out
    order = [out.index(s) for s in ("nonfinite  step 3  rank 0  layer 2 attn_output",
                                    "nonfinite  step 3  rank 1  name mlp_output, layer 2",
                                    "mismatch_trigger  step 5  rank 0  request r7")]
    assert order == sorted(order), out
    assert "mismatch  rank 0 step 2: samples 8, k3_mean 0.002" in out
    for rank in (0, 1):
        for layer in (0, 1):
            assert f"routing_health  rank {rank} layer {layer} step 2: imbalance {2 + layer / 10:.4g}" in out
    assert "step 1:" not in out  # the latest line only


def test_json_is_one_object(run, capsys):
    assert cli.main(["watch", str(run), "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["exit"] == 1 and said["ranks"] == [0, 1] and said["events_total"] == 3
    assert [(e["kind"], e["rank"]) for e in said["events"]] == [("nonfinite", 0), ("nonfinite", 1),
                                                                ("mismatch_trigger", 0)]
    assert [(m["rank"], m["layer"], m["step"]) for m in said["metrics"]["routing_health"]] == \
        [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert said["metrics"]["mismatch"][0]["figures"] == {"samples": 8, "k3_mean": 0.002}
    assert said["problems"] == []


def test_no_event_exits_0(tmp_path, capsys):
    write(tmp_path, 0, "metrics", {"kind": "mismatch", "time": 1.0, "step": 0, "samples": 2})
    assert cli.main(["watch", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "events: none" in out and "mismatch  rank 0 step 0: samples 2" in out


def test_a_malformed_line_is_counted_and_said(run, capsys):
    write(run, 1, "events", raw=b"{not json\n[1, 2]\n" + json.dumps({"no": "kind"}).encode() + b"\n")
    write(run, 1, "events", {"kind": "late", "time": 400.0, "step": 9})
    assert cli.main(["watch", str(run)]) == 1
    captured = capsys.readouterr()
    assert "late  step 9  rank 1" in captured.out
    assert "source-patch: warning: rank-1/events.jsonl: 3 malformed lines (the first: rank-1/events.jsonl " \
           "line 2: not valid JSON" in captured.err
    assert "Traceback" not in captured.err


def test_a_line_over_1_mib_is_refused_and_the_next_ones_read(run, capsys):
    huge = json.dumps({"kind": "huge", "time": 1.0, "blob": "x" * (3 << 20)}).encode() + b"\n"
    write(run, 0, "events", raw=huge)
    write(run, 0, "events", {"kind": "after", "time": 500.0, "step": 11})
    assert cli.main(["watch", str(run), "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in said["events"]][-1] == "after" and "huge" not in [e["kind"] for e in said["events"]]
    (problem,) = said["problems"]
    assert problem.startswith("rank-0/events.jsonl: 1 line over 1,048,576 bytes refused (the first: "
                              "rank-0/events.jsonl line 3: over 1,048,576 bytes")


def test_a_last_line_without_its_newline_is_said(run, capsys):
    write(run, 0, "events", raw=b'{"kind": "half", "ti')
    assert cli.main(["watch", str(run), "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["events_total"] == 3 and "no newline at its end" in said["problems"][0]


def test_a_fifo_is_refused_at_once(tmp_path, capsys):
    write(tmp_path, 0, "events", {"kind": "nonfinite", "time": 1.0, "step": 0})
    (tmp_path / "rank-1").mkdir()
    os.mkfifo(tmp_path / "rank-1" / "events.jsonl")
    start = time.monotonic()
    assert cli.main(["watch", str(tmp_path)]) == 1
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert "rank-1/events.jsonl" in err and "is not a regular file" in err


@pytest.mark.parametrize("make, said", [
    (lambda p: None, "no such folder"),
    (lambda p: p.write_text("x"), "is not a folder"),
    (lambda p: (p.mkdir(), (p / "rank-x").mkdir()), "is not a sentinels run folder"),
])
def test_not_a_run_folder_is_the_one_error_line(tmp_path, capsys, make, said):
    target = tmp_path / "run"
    make(target)
    assert cli.main(["watch", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("source-patch: error: ") and said in captured.err
    assert captured.err.count("\n") == 1
    assert cli.main(["watch", str(target), "--json"]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["exit"] == 2 and said in answer["error"]


def source_patch(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "source_patch.patcher", *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


def test_the_cli_in_a_subprocess(run, tmp_path):
    done = source_patch("watch", str(run), "--json")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["events_total"] == 3
    done = source_patch("watch", str(tmp_path / "missing"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("source-patch: error: ") and done.stderr.count("\n") == 1
    help_text = source_patch("watch", "--help")
    assert help_text.returncode == 0 and "--follow" in help_text.stdout and "exit codes" in help_text.stdout


def test_follow_prints_new_events_until_ctrl_c(tmp_path):
    write(tmp_path, 0, "metrics", {"kind": "mismatch", "time": 1.0, "step": 0, "samples": 1})
    child = subprocess.Popen([sys.executable, "-m", "source_patch.patcher", "watch", str(tmp_path), "--follow"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().startswith("run folder ")
        while not child.stdout.readline().startswith("following "):
            pass
        write(tmp_path, 2, "events", raw=b'{"kind": "nonfinite", "time": 5.0, "st')  # half a line: waits
        time.sleep(0.7)
        write(tmp_path, 2, "events", raw=b'ep": 4, "where": "grad layer 1"}\n')
        line = child.stdout.readline()
        assert "nonfinite  step 4  rank 2  grad layer 1" in line, line
        write(tmp_path, 0, "metrics", {"kind": "mismatch", "time": 6.0, "step": 1, "samples": 3})
        time.sleep(0.7)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 1, err
    assert "mismatch  rank 0 step 1: samples 3" in out and "1 event in all" in out
    assert "Traceback" not in err


def test_the_reader_is_light():
    """The CLI's reader imports neither torch nor the sentinels' training side."""
    code = ("import sys; import source_patch.runtime.sentinels.watch; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('source_patch.runtime.sentinels')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "['source_patch.runtime.sentinels', 'source_patch.runtime.sentinels.watch']", \
        done.stderr
    assert watch.MAX_LINE == 1 << 20 and watch.POLL_S == 0.5


def test_a_healthy_armed_run_has_a_folder_watch_reads_as_no_event(tmp_path, capsys):
    """The heartbeat: the first step end after arming writes a ``sentinels`` metrics line
    (the armed watches, the step), then at most one a minute; nothing else happened, so
    `watch` exits 0 and says which watches are armed and how far the run got."""
    from source_patch.runtime.sentinels import control

    try:
        control.configure(nonfinite=True, routing_health=True, mismatch=False, dir=str(tmp_path))
        control.reset()
        for _ in range(3):
            control.sentinels_step()
        assert [line["step"] for line in map(json.loads, (tmp_path / "rank-0" / "metrics.jsonl").open())] == [0]
        control._next_beat = 0.0  # a minute later
        control.sentinels_step()
    finally:
        control.close()
        control.reset()
        control.configure_from_settings()
    assert cli.main(["watch", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "events: none" in out and 'sentinels  rank 0 step 3: watches ["nonfinite","routing_health"]' in out, out
