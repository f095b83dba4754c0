"""Issue 56, item 7: short errors, no misleading lines.

- An error of ours at import (an anchor that no longer matches) says its first line
  first and shows the user's frames only: importlib's and the patcher's are hidden
  (SOURCE_PATCH_DEBUG=1 keeps them); pytest's traceback leaves out the rewrite's frames.
- The patcher's warnings print no line of the patcher's own source: at start-up none,
  at an import the user's import statement.  Other warnings print as before.
- An exception raised in inserted code shows the inserted line, not the anchor's
  upstream text; Python's own printer (SOURCE_PATCH_DEBUG=1) draws no carets under it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from source_patch.patcher import AnchorError, patched

PATCHER = str(Path(__file__).parent.parent / "patcher") + os.sep
DRIFTED = ("source_patch: 1\nname: bad\npatches:\n  - id: drifted\n    module: spfix.basic\n    target: add\n"
           "    edits:\n      - {at: after, match: \"total = a - b\", code: pass}\n")


def run(tmp_path, spec, code, **env):
    """``code`` as the script main.py, under SOURCE_PATCH=spec."""
    script = tmp_path / "main.py"
    script.write_text(code)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_") or k == "SOURCE_PATCH_CACHE"}
    environ.update(SOURCE_PATCH=str(spec), **env)
    proc = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=120)
    return proc, script


def patcher_lines() -> set[str]:
    """Every line of the patcher's sources, stripped (a warning must print none of them)."""
    return {line.strip() for path in Path(PATCHER).glob("*.py") for line in path.read_text().splitlines()
            if len(line.strip()) > 12}


# --------------------------------------------------------------------------- errors at import


def test_an_anchor_error_at_import_comes_first_and_without_internal_frames(write_spec, tmp_path):
    proc, script = run(tmp_path, write_spec(DRIFTED), "import json\nimport spfix.basic\n")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1
    assert lines[0].startswith("source-patch: error: cannot patch module spfix.basic ("), proc.stderr
    assert "SOURCE_PATCH_DEBUG=1 shows source-patch's own frames" in lines[0]
    frames = [line for line in lines if line.startswith("  File ")]
    assert frames == [f'  File "{script}", line 2, in <module>'], proc.stderr
    assert "expected 1 match, found 0; nearest candidates:" in proc.stderr  # the whole message, still
    assert len(lines) < 12, proc.stderr
    # SOURCE_PATCH_DEBUG=1: Python's own traceback, every frame of it
    debug, _ = run(tmp_path, write_spec(DRIFTED), "import json\nimport spfix.basic\n", SOURCE_PATCH_DEBUG="1")
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback (most recent call last):")
    assert f'File "{PATCHER}engine.py"' in debug.stderr and "<frozen importlib._bootstrap>" in debug.stderr


def test_the_raised_error_carries_none_of_the_rewrite_s_frames(write_spec):
    """What pytest and any other printer show: the loader's frame at most, not the code
    cache's, the engine's, the anchors' or libcst's."""
    with patched(write_spec(DRIFTED)), pytest.raises(AnchorError) as err:
        importlib.import_module("spfix.basic")
    files = {Path(frame.filename).name for frame in traceback.extract_tb(err.tb) if frame.filename.startswith(PATCHER)}
    assert files <= {"finder.py", "activation.py"}, files


# --------------------------------------------------------------------------- warnings


MISSING = ("source_patch: 1\nname: miss\npatches:\n  - id: p\n    module: spfix.basik\n    target: add\n"
           "    edits:\n      - {at: entry, code: pass}\n")
GATED = ("source_patch: 1.1\nname: gated\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
         "    requires: {vllm: '>=1'}\n    edits:\n      - {at: entry, code: pass}\n")


def test_a_start_up_warning_prints_no_line_of_ours_and_others_print_as_before(write_spec, tmp_path):
    code = "import warnings\nimport spfix.basic\nwarnings.warn('theirs')\n"
    proc, script = run(tmp_path, write_spec(MISSING), code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    (said,) = [i for i, line in enumerate(lines) if "spfix.basik, which cannot be found" in line]
    assert lines[said].startswith("<source-patch>:1: SourcePatchWarning: source-patch: ")
    assert not patcher_lines() & {line.strip() for line in lines}, proc.stderr
    assert lines[-2:] == [f"{script}:3: UserWarning: theirs", "  warnings.warn('theirs')"]


def test_a_warning_at_import_points_at_the_user_s_import(write_spec, tmp_path):
    proc, script = run(tmp_path, write_spec(GATED), "import os\nimport spfix.basic\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"{script}:2: SourcePatchWarning: source-patch: patch 'p' of spec 'gated'"), proc.stderr
    assert lines[1:] == ["  import spfix.basic"], proc.stderr


# --------------------------------------------------------------------------- inserted code


def inserted(at: str, code: str) -> str:
    return ("source_patch: 1\nname: ins\npatches:\n  - id: boom\n    module: spfix.basic\n    target: add\n"
            f"    edits:\n      - at: {at}\n        code: |\n" + "".join(f"          {line}\n" for line in code))


def test_an_exception_in_inserted_code_shows_the_inserted_line(write_spec, tmp_path):
    spec = write_spec(inserted("entry", ["y = 1", "z = None", "q = z.shape", "w = 2"]))
    proc, _ = run(tmp_path, spec, "from spfix import basic\nbasic.add(1, 2)\n")
    lines = proc.stderr.splitlines()
    assert lines[-4:] == [
        f'  File "{basic_file()}", line 8, in add',  # the anchor's line, as before
        "    q = z.shape  # inserted by source-patch",
        "AttributeError: 'NoneType' object has no attribute 'shape'",
        f"source-patch: raised in code inserted by patch 'boom' of spec 'ins' ({spec}:8)"], proc.stderr


def test_python_s_own_printer_draws_no_carets_under_the_anchor(write_spec, tmp_path):
    """SOURCE_PATCH_DEBUG=1 leaves the traceback to Python, which prints the anchor's
    (indented) upstream line: with no caret line under it."""
    spec = write_spec(inserted("before\n        match: total = _", ["[][1]"]))
    proc, _ = run(tmp_path, spec, "from spfix import basic\nbasic.add(1, 2)\n", SOURCE_PATCH_DEBUG="1")
    lines = proc.stderr.splitlines()
    at = lines.index(f'  File "{basic_file()}", line 10, in add')
    assert lines[at + 1:at + 3] == ["    total = a + b", "IndexError: list index out of range"], proc.stderr


def basic_file() -> str:
    return str(Path(__file__).parent / "fixtures" / "spfix" / "basic.py")


def test_a_rewritten_upstream_line_draws_no_carets_either(write_spec, tmp_path):
    """A call wrapped in place rewrites an indented upstream line: its columns no longer
    fit the text, and the span Python's printer is given covers exactly the line."""
    spec = write_spec("source_patch: 1\nname: wrap\npatches:\n  - id: w\n    module: spfix.basic\n"
                      "    target: keywords\n    edits:\n"
                      "      - {at: call, match: \"math.prod(...)\", wrap: \"__call__ / 0\"}\n")
    proc, _ = run(tmp_path, spec, "from spfix import basic\nbasic.keywords()\n", SOURCE_PATCH_DEBUG="1")
    lines = proc.stderr.splitlines()
    at = lines.index(f'  File "{basic_file()}", line 73, in keywords')
    assert lines[at + 1:at + 3] == ["    return dict(kwargs, call=math.prod([1, 2], start=3))",
                                    "ZeroDivisionError: division by zero"], proc.stderr
