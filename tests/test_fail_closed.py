"""A run whose SOURCE_PATCH cannot be activated stops at its first non-stdlib import
with the spec's error, whatever the broken file looks like; never guessed targets,
never a silently unpatched run (unless SOURCE_PATCH_ON_ERROR=warn says so).
Error messages stay short however large the user's text is."""

import os
import subprocess
import sys

import pytest

from source_patch.patcher import SpecError, spec as spec_mod
from source_patch.patcher.errors import NotActivatedError, SourcePatchError, clip, show, shorten

# Every import after the stdlib line is third-party: the run must stop at the first.
PROGRAM = "import json, os; print('stdlib ok', flush=True); import spfix.basic; print('ran')"

GOOD = ("source_patch: 1\nname: good\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
        "    edits:\n      - at: entry\n        code: pass\n")

BROKEN = {
    # The target in YAML flow style, the error elsewhere (an unknown top-level key):
    # a text scan for block-style "module:" lines would miss the target.
    "flow": ("source_patch: 1\nname: flow\ncolour: red\npatches: [{id: p, module: spfix.basic, target: add, "
             "edits: [{at: entry, code: pass}]}]\n", "flow.yaml:3:1: colour: unknown key 'colour'"),
    "block": (GOOD.replace("at: entry", "at: entrance"),
              "block.yaml:8:13: patches[0].edits[0].at: unknown anchor 'entrance'"),
    "yaml": ("source_patch: 1\nname: [\npatches:\n  - module: spfix.basic\n", "yaml.yaml:4:3: invalid YAML: expected the node content"),
    # a broken file's text naming an unrelated module: it is not "blocked" by a guess
    "numpy-text": ("source_patch: 1\nname: x\npatches:\n  - module: numpy\n", "numpy-text.yaml:4:5: patches[0]: "
                   "missing required key 'edits'"),
}


def run(code, spec=None, python_flags=(), **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("SOURCE_PATCH", "SOURCE_PATCH_ON_ERROR")}
    if spec is not None:
        environ["SOURCE_PATCH"] = os.fspath(spec)
    environ.update(env)
    return subprocess.run([sys.executable, *python_flags, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120)


def assert_stopped(proc, target, reason):
    """The run printed its stdlib line, stopped at importing ``target`` with exit 1,
    and both the start-up line and the raised error carry ``reason``."""
    assert proc.returncode == 1, proc.stderr
    assert "stdlib ok" in proc.stdout and "ran" not in proc.stdout
    assert f"source-patch: error: " in proc.stderr and reason in proc.stderr.split("Traceback")[0]
    last = proc.stderr[proc.stderr.rindex("NotActivatedError: "):]
    assert last.startswith(f"NotActivatedError: source-patch: SOURCE_PATCH could not be activated, "
                           f"so importing {target} is refused")
    assert "SOURCE_PATCH_ON_ERROR=warn" in last and reason in last


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_spec_stops_the_first_third_party_import(write_spec, kind):
    text, reason = BROKEN[kind]
    spec = write_spec(text, f"{kind}.yaml")
    assert_stopped(run(PROGRAM, spec), "spfix", f"{spec.parent}/{reason}")


def test_a_missing_spec_file_and_a_broken_one_after_a_good_one(write_spec, tmp_path):
    missing = tmp_path / "nope" / "missing.yaml"
    assert_stopped(run(PROGRAM, missing), "spfix", f"{missing}: cannot read spec: No such file or directory")
    # one broken spec among good ones: none is activated, the run stops
    good, bad = write_spec(GOOD, "good.yaml"), write_spec(BROKEN["block"][0], "block.yaml")
    assert_stopped(run(PROGRAM, f"{good},{bad}"), "spfix", "unknown anchor 'entrance'")


def test_unusable_paths_fail_closed_too(tmp_path):
    """Errors that are not spec errors (a file name too long, an unknown ~user, a FIFO
    that would block, a directory, a device) used to escape into `site`, which printed
    them and ran the program unpatched."""
    os.mkfifo(tmp_path / "fifo.yaml")
    cases = {"x" * 5000: "not a usable spec path: File name too long",
             "~no_such_user_sp/a.yaml": "not a usable spec path: Could not determine home directory",
             str(tmp_path / "fifo.yaml"): "cannot read spec: not a regular file",
             str(tmp_path): "cannot read spec: Is a directory",
             "/dev/zero": "cannot read spec: not a regular file"}
    for ref, reason in cases.items():
        proc = run(PROGRAM, ref)
        assert_stopped(proc, "spfix", reason)
        assert len(proc.stderr) < 4000, (ref[:50], len(proc.stderr))


def test_unrelated_packages_are_refused_by_the_policy_with_the_spec_error(write_spec):
    spec = write_spec(BROKEN["flow"][0], "flow.yaml")
    proc = run("import json; print('stdlib ok'); import numpy; print('ran')", spec)
    assert_stopped(proc, "numpy", f"{spec}:3:1: colour: unknown key 'colour'")


def test_on_error_warn_runs_unpatched_with_a_warning(write_spec):
    spec = write_spec(BROKEN["block"][0], "block.yaml")
    proc = run("import numpy, spfix.basic; print('ran', hasattr(spfix.basic, '__source_patches__'))", spec,
               SOURCE_PATCH_ON_ERROR="warn")
    assert proc.returncode == 0 and "ran False" in proc.stdout, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"source-patch: warning: {spec}:8:13: patches[0].edits[0].at: unknown anchor 'entrance' "
        "(one of: entry, return, before, after, replace, call) (SOURCE_PATCH_ON_ERROR=warn: running UNPATCHED)"]
    proc = run(PROGRAM, spec, SOURCE_PATCH_ON_ERROR="sometimes")
    assert_stopped(proc, "spfix", "unknown anchor 'entrance'")
    assert "SOURCE_PATCH_ON_ERROR='sometimes' is not 'error' or 'warn': treated as 'error'" in proc.stderr


def test_except_importerror_and_importorskip_cannot_hide_it(write_spec):
    """NotActivatedError is no ImportError; it carries the spec error and its location."""
    spec = write_spec(BROKEN["flow"][0], "flow.yaml")
    code = ("import pytest\n"
            "try:\n    import spfix.basic\nexcept ImportError:\n    print('swallowed')\n")
    proc = run(code, spec)
    assert proc.returncode == 1 and "swallowed" not in proc.stdout and "importing pytest is refused" in proc.stderr
    code = ("try:\n    import spfix.basic\nexcept Exception as exc:\n"
            "    loc = exc.error.location\n"
            "    print(type(exc).__name__, isinstance(exc, ImportError), loc.line, loc.field)\n")
    proc = run(code, spec)
    assert proc.stdout.split() == ["NotActivatedError", "False", "3", "colour"], proc.stderr


LATE_SPEC = GOOD


def test_a_start_hook_after_the_target_was_imported_stops_the_run(write_spec):
    """python -S, the target imported, then site.main() runs the start hook: too late
    to patch it, so the run stops at its next non-stdlib import."""
    spec = write_spec(LATE_SPEC, "late.yaml")
    code = "import json, spfix.basic, site; site.main(); print('stdlib ok'); import spfix.notpatched; print('ran')"
    proc = run(code, spec, python_flags=("-S",))
    assert_stopped(proc, "spfix.notpatched", "already imported, so they cannot be patched: spfix.basic")
    # ... and the start hook's own entry point, called late, does the same
    code = (f"import os, spfix.basic; os.environ['SOURCE_PATCH'] = {str(spec)!r}; "
            "from source_patch.patcher import startup; startup.run(); print('stdlib ok'); import numpy; print('ran')")
    assert_stopped(run(code), "numpy", "already imported, so they cannot be patched: spfix.basic")
    # warn: the warning names the late module, the run goes on unpatched
    code = "import spfix.basic, site; site.main(); import spfix.notpatched; print('ran')"
    proc = run(code, spec, python_flags=("-S",), SOURCE_PATCH_ON_ERROR="warn")
    assert proc.returncode == 0 and "ran" in proc.stdout
    assert "already imported, so they cannot be patched: spfix.basic" in proc.stderr and "UNPATCHED" in proc.stderr


def test_a_non_spec_failure_in_the_hook_is_armed_too(monkeypatch):
    """Anything that goes wrong in activate_from_env (a bug, an OSError) arms the
    failure: an exception escaping the .pth hook would be swallowed by site."""
    from source_patch.patcher import activation

    def broken(ref):
        raise RuntimeError("boom " + "y" * 10_000)

    monkeypatch.setattr(spec_mod, "resolve", broken)
    before = list(sys.meta_path)
    try:
        assert activation.activate_from_env({"SOURCE_PATCH": "a.yaml"}) is None
        armed = sys.meta_path[0]
        assert isinstance(armed, activation.FailedActivation)
        assert armed.find_spec("json") is None and armed.find_spec("source_patch.runtime") is None
        with pytest.raises(NotActivatedError, match="importing numpy.linalg is refused") as info:
            armed.find_spec("numpy.linalg")
        assert "SOURCE_PATCH='a.yaml': RuntimeError: boom yyy" in str(info.value)
        assert len(str(info.value)) < 1500
    finally:
        sys.meta_path[:] = before


def test_the_explicit_api_raises():
    from source_patch.patcher import activate

    with pytest.raises(SpecError, match="cannot read spec"):
        activate("/nonexistent/spec.yaml")
    with pytest.raises(SpecError, match="not a usable spec path: File name too long"):
        activate("z" * 5000)


# --------------------------------------------------------------------------- short messages


HUGE = "x" * 100_000  # PyYAML composes ~0.5 MB/s: 5 MB runs once, in the real run below


@pytest.mark.parametrize("field,text", [
    ("id", HUGE + "!"),                 # an invalid id is echoed, shortened
    ("module", HUGE + "-"),             # an invalid module name
    ("key", HUGE),                      # an unknown key: in the message and in the field path
    ("at", HUGE),                       # an unknown anchor
    ("duplicate", HUGE),                # a valid huge id, twice
])
def test_a_huge_value_gives_a_short_spec_error(write_spec, field, text):
    spec = {"id": GOOD.replace("id: p", f"id: {text}"),
            "module": GOOD.replace("module: spfix.basic", f"module: {text}"),
            "key": GOOD.replace("    target: add", f"    target: add\n    ? {text}\n    : 1"),
            "at": GOOD.replace("at: entry", f"at: {text}"),
            "duplicate": GOOD.replace("id: p", f"id: {text}") + GOOD.split("patches:\n")[1].replace(
                "id: p", f"id: {text}")}[field]
    path = write_spec(spec, "big.yaml")
    with pytest.raises(SpecError) as info:
        spec_mod.load(path)
    message = str(info.value)
    assert len(message) < 1000, (field, len(message))
    assert "... (100001 characters)" in message or "... (100000 characters)" in message


def test_a_huge_id_gives_a_short_error_in_a_real_run(write_spec):
    """Also where the engine reports a valid huge id (an anchor that does not match, at import)."""
    invalid = write_spec(GOOD.replace("id: p", f"id: {'x' * 5_000_000}!"), "invalid.yaml")
    proc = run(PROGRAM, invalid)
    assert_stopped(proc, "spfix", "an id of letters, digits, '_', '.', '-' expected, got 'xxx")
    assert "... (5000001 characters)" in proc.stderr
    assert len(proc.stderr) < 3000, len(proc.stderr)  # the start-up line, the traceback, the error again
    miss = write_spec(GOOD.replace("id: p", f"id: {HUGE}").replace(
        "at: entry", "at: before\n        match: does_not_exist()"), "miss.yaml")
    proc = run("import spfix.basic", miss)
    assert proc.returncode == 1 and "AnchorError: cannot patch module spfix.basic" in proc.stderr
    error = proc.stderr[proc.stderr.rindex("AnchorError"):]
    assert len(error) < 1200 and "characters cut" in error and "does_not_exist()" in error, len(error)


def test_clip_shorten_show():
    assert shorten("abc") == "abc" and shorten("a" * 300) == "a" * 200 + "... (300 characters)"
    assert show("ab") == "'ab'" and show("a" * 300) == repr("a" * 200) + "... (300 characters)"
    line = "h" * 2000 + "tail"
    clipped = clip(line)
    assert len(clipped) < 1050 and clipped.startswith("h" * 600) and clipped.endswith("tail")
    assert clip("short\nlines") == "short\nlines"
    many = clip("\n".join(["l"] * 100_000))
    assert many.count("\n") == 200 and many.endswith("... (99800 more lines)")
    assert len(str(SourcePatchError("m" * 5_000_000))) < 1100
