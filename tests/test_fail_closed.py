"""A run whose SOURCE_PATCH cannot be activated stops at its first non-stdlib import
with the spec's error, whatever the broken file looks like; never guessed targets,
never a silently unpatched run (unless SOURCE_PATCH_ON_ERROR=warn says so)."""

import os
import subprocess
import sys

import pytest


def run(code, spec=None, python_flags=(), **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("SOURCE_PATCH", "SOURCE_PATCH_ON_ERROR")}
    if spec is not None:
        environ["SOURCE_PATCH"] = os.fspath(spec)
    environ.update(env)
    return subprocess.run([sys.executable, *python_flags, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120)


BROKEN = {
    # a flow-style target with an error elsewhere: a text scan for "module:" lines misses it
    "flow": "source_patch: 1\nname: flow\npatches: [{module: spfix.basic, target: add, "
            "edits: [{at: entrance, code: pass}]}]\n",
    "block": "source_patch: 1\nname: block\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
             "    edits:\n      - at: entrance\n        code: pass\n",
    "yaml": "source_patch: 1\nname: [\n",
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_spec_stops_the_first_third_party_import(write_spec, kind):
    spec = write_spec(BROKEN[kind], f"{kind}.yaml")
    proc = run("import json, os; print('stdlib ok'); import spfix.basic; print('ran')", spec)
    assert proc.returncode != 0 and "stdlib ok" in proc.stdout and "ran" not in proc.stdout
    assert f"source-patch: error: {spec}:" in proc.stderr
    assert "ActivationError" in proc.stderr and "so spfix would run unpatched" in proc.stderr


def test_unrelated_packages_are_blocked_by_policy_not_by_guessing(write_spec):
    spec = write_spec(BROKEN["flow"], "flow.yaml")
    proc = run("import numpy", spec)
    assert proc.returncode != 0 and "numpy would run unpatched" in proc.stderr
    assert f"{spec}:3" in proc.stderr  # the spec's own error travels with it


def test_on_error_warn_runs_unpatched_with_a_warning(write_spec):
    spec = write_spec(BROKEN["block"], "block.yaml")
    proc = run("import numpy, spfix.basic; print('ran')", spec, SOURCE_PATCH_ON_ERROR="warn")
    assert proc.returncode == 0 and "ran" in proc.stdout
    assert "SOURCE_PATCH_ON_ERROR=warn: running UNPATCHED" in proc.stderr and "unknown anchor 'entrance'" in proc.stderr
    proc = run("import spfix.basic", spec, SOURCE_PATCH_ON_ERROR="sometimes")
    assert proc.returncode != 0 and "treated as 'error'" in proc.stderr


def test_a_start_hook_after_the_target_was_imported_is_an_error(write_spec):
    """python -S, the target imported, then site.main() runs the start hook: too late
    to patch it, so the run stops at its next non-stdlib import."""
    spec = write_spec("source_patch: 1\nname: late\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
                      "    edits:\n      - at: entry\n        code: pass\n", "late.yaml")
    code = ("import sys; sys.path[:0] = [p for p in __import__('os').environ['PYTHONPATH'].split(':') if p]; "
            "import spfix.basic, site; site.main(); import spfix.notpatched; print('ran')")
    proc = run(code, spec, python_flags=("-S",))
    assert proc.returncode != 0 and "ran" not in proc.stdout
    assert "already imported, so they cannot be patched: spfix.basic" in proc.stderr


def test_a_huge_patch_id_gives_a_short_error(write_spec):
    from source_patch.patcher import SpecError, spec as spec_mod

    huge = "x" * 5_000_000
    path = write_spec(f"source_patch: 1\nname: big\npatches:\n  - id: {huge}\n    module: m\n    target: f\n"
                      "    edits:\n      - at: entrance\n        code: pass\n", "big.yaml")
    with pytest.raises(SpecError) as info:
        spec_mod.load(path)
    assert len(str(info.value)) < 1500, len(str(info.value))
    proc = run("import spfix.basic", path)
    assert proc.returncode != 0 and len(proc.stderr) < 20_000
