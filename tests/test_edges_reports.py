"""Issue 56, item 5: every patched process reports.  With SOURCE_PATCH_REPORT_DIR, a process
writes its patch report there after each target import, so one killed later (SGLang's
schedulers are, at shutdown) has already reported; a SIGTERM handler the program installed
is chained (the report says the signal, then the program's handler runs).
``source-patch report RUN_DIR`` collects them, and the driver's exit report no longer
says "not imported" for a patch another process applied."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from source_patch.patcher.cli import main

SPEC = """\
source_patch: 1
name: rep
patches:
  - id: neg
    module: spfix.basic
    target: add
    edits:
      - {at: return, code: "result = -result"}
  - id: extra
    module: spfix.notpatched
    target: <module>
    edits:
      - {at: entry, code: "EXTRA = 1"}
"""

WAIT = "import sys, time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def start(spec, code, reports, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_") or k == "SOURCE_PATCH_CACHE"}
    environ.update(SOURCE_PATCH=str(spec), SOURCE_PATCH_REPORT_DIR=str(reports), **env)
    return subprocess.Popen([sys.executable, "-c", code], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(spec, code, reports, **env):
    proc = start(spec, code, reports, **env)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def reports_in(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def states(report: dict) -> dict:
    return {p["id"]: p["state"] for s in report["specs"] for p in s["patches"]}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_process_killed_after_its_import_has_reported(write_spec, tmp_path, sig):
    reports = tmp_path / "reports"
    proc = start(write_spec(SPEC), "import spfix.basic\n" + WAIT, reports)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -sig  # killed as before: nothing of ours in the way
    (report,) = reports_in(reports)
    assert report["pid"] == proc.pid and report["argv0"] == "-c" and report["signal"] is None
    assert states(report) == {"neg": "applied", "extra": "not imported"}


def test_a_sigterm_handler_of_the_program_is_chained(write_spec, tmp_path):
    """The program's own handler (installed before the activation) still runs, after the
    report is written once more, saying the signal."""
    marker, reports = tmp_path / "handled", tmp_path / "reports"
    code = textwrap.dedent(f"""
        import signal, sys
        def mine(signum, frame):
            open({str(marker)!r}, "w").write("mine")
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
        from source_patch.patcher import activate
        activate({str(write_spec(SPEC))!r})
        import spfix.basic
    """) + WAIT
    proc = start("", code, reports)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 7 and marker.read_text() == "mine"
    (report,) = reports_in(reports)
    assert report["signal"] == "SIGTERM" and states(report)["neg"] == "applied"


def test_the_driver_s_exit_report_names_what_other_processes_applied(write_spec, tmp_path):
    spec, reports = write_spec(SPEC), tmp_path / "reports"
    rc, _, err = run(spec, "import spfix.basic; import spfix.notpatched", reports)
    assert rc == 0, err
    (scheduler,) = reports_in(reports)
    rc, _, err = run(spec, "print('driver')", reports, SOURCE_PATCH_REPORT="1")
    assert rc == 0, err
    assert f"  neg (spfix.basic): not imported here; applied in pid {scheduler['pid']} (-c)" in err, err
    assert "not imported\n" not in err + "\n"  # no patch is "not imported" without saying where it applied


def test_source_patch_report_collects_every_process(write_spec, tmp_path, capsys):
    spec, reports = write_spec(SPEC), tmp_path / "reports"
    first = run(spec, "import spfix.basic", reports)
    second = run(spec, "import spfix.notpatched", reports)
    assert first[0] == second[0] == 0, first[2] + second[2]
    pids = {tuple(states(r).values()): r["pid"] for r in reports_in(reports)}
    a, b = pids["applied", "not imported"], pids["not imported", "applied"]
    assert main(["report", str(reports)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"2 processes reported in {reports}:"
    assert f"  neg (spfix.basic): applied in pid {a} (-c)" in out
    assert f"  extra (spfix.notpatched): applied in pid {b} (-c)" in out
    assert main(["report", "--json", str(reports)]) == 0
    collected = json.loads(capsys.readouterr().out)
    assert sorted(p["pid"] for p in collected["processes"]) == sorted([a, b])
    (row,) = collected["specs"]
    assert {p["id"]: [w["pid"] for w in p["applied"]] for p in row["patches"]} == {"neg": [a], "extra": [b]}


def test_a_skipped_patch_is_reported_with_its_reason(write_spec, tmp_path, capsys):
    gated = SPEC.replace("source_patch: 1\n", "source_patch: 1.1\n").replace(
        "    target: add\n", "    target: add\n    requires: {vllm: '>=1'}\n")
    reports = tmp_path / "reports"
    rc, _, err = run(write_spec(gated), "import spfix.basic", reports)
    assert rc == 0, err
    assert main(["report", str(reports)]) == 0
    out = capsys.readouterr().out
    assert "  neg (spfix.basic): skipped in pid " in out and ": requires vllm>=1, which is not installed" in out


def test_no_report_folder_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert f"no patch report in {tmp_path}" in capsys.readouterr().err


def test_a_report_folder_that_cannot_be_written_is_said_once_and_the_run_goes_on(write_spec, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    rc, out, err = run(write_spec(SPEC), "import spfix.basic, spfix.notpatched\nprint(spfix.basic.add(1, 2))", blocked)
    assert rc == 0 and out == "-3\n", err
    assert err.count("cannot write the patch report to") == 1, err
    assert blocked.read_text() == "not a folder"
