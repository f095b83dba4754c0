"""The source-patch command line, run as a user runs it (a real subprocess)."""

import os
import subprocess
import sys

SPEC = """
source_patch: 1
name: cli
patches:
  - id: entry
    module: spfix.basic
    target: add
    edits:
      - {at: entry, code: "__sp__.emit('add', a)"}
"""


def cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "source_patch.patcher", *args], text=True,
                          capture_output=True, timeout=120, env={**os.environ, **env})


def test_diff_prints_a_plain_unified_diff_when_not_a_terminal(write_spec):
    spec = write_spec(SPEC)
    result = cli("diff", str(spec))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["--- a/spfix/basic.py", "+++ b/spfix/basic.py"]
    assert "+        __sp__.emit('add', a)" in lines  # inside the try that notes the patch
    assert "\033[" not in result.stdout
    colored = cli("diff", "--color", "always", str(spec))
    assert "\033[32m+        __sp__.emit('add', a)\033[0m" in colored.stdout


def test_dry_runs_do_not_import_the_target(write_spec, tmp_path):
    # A package whose __init__ explodes: diff and check must still work.
    pkg = tmp_path / "boom"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (pkg / "mod.py").write_text("def f(x):\n    return x\n")
    spec = write_spec(SPEC.replace("spfix.basic", "boom.mod").replace("target: add", "target: f")
                      .replace("'add', a", "'f', x"))
    for command in ("diff", "check"):
        result = cli(command, str(spec), "--against", str(tmp_path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "imported!" not in result.stdout + result.stderr


def test_against_names_a_folder_or_says_what_it_is_not(write_spec, tmp_path):
    wheel = tmp_path / "megatron_core-0.19.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip
    for target, said in ((wheel, "is not a directory; unpack the wheel first"), (tmp_path / "nope", "does not exist")):
        result = cli("check", str(write_spec(SPEC)), "--against", str(target))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"argument --against: {target} {said}" in result.stderr


def test_check_exits_nonzero_with_the_report(write_spec):
    spec = write_spec(SPEC.replace("at: entry", "at: before, match: 'total = a * b'"))
    result = cli("check", str(spec))
    assert result.returncode == 1
    assert "FAIL cannot patch module spfix.basic" in result.stdout
    assert "line 10: total = a + b" in result.stdout  # nearest candidate, true line


def test_list_shows_patches_and_anchors(write_spec):
    result = cli("list", str(write_spec(SPEC)))
    assert result.returncode == 0
    assert "entry: spfix.basic:add" in result.stdout and result.stdout.splitlines()[-1] == "    at entry"


def test_bad_spec_is_a_clean_error(write_spec):
    spec = write_spec(SPEC.replace("target: add", "target: add\n    colour: red"))
    result = cli("check", str(spec))
    assert result.returncode == 2
    assert f"{spec}:8:5: patches[0].colour: unknown key 'colour'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_bundled_name_lists_the_bundled_specs():
    result = cli("list", "no_such_spec")
    assert result.returncode == 2
    assert "no spec file or bundled spec named 'no_such_spec'" in result.stderr
    assert "megatron_topk" in result.stderr


def test_run_sets_the_absolute_spec_path_and_patches_the_child(write_spec, tmp_path):
    spec = write_spec(SPEC)
    rel = os.path.relpath(spec, tmp_path)
    code = ("import os, spfix.basic as b; print(os.environ['SOURCE_PATCH']); "
            "print(b.__source_patches__[0].patch)")
    result = subprocess.run([sys.executable, "-m", "source_patch.patcher", "run", "-s", rel, "--",
                             sys.executable, "-c", code], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(spec), "entry"]
