"""Issue 57, items 9 and 10 (and item 5's `trace summary` and `settings --write`): a large
code block refused before anything parses it, settings from the environment checked at
activation, SOURCE_PATCH_STRICT's values, terminal escapes in listings, and the small
command-line edges that gave tracebacks or hung."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from source_patch.patcher import cli, patched
from source_patch.patcher import spec as spec_mod
from source_patch.patcher.errors import ActivationError, SpecError

SPEC = ("source_patch: 1\nname: s\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
        "    edits:\n      - at: entry\n        code: pass\n")
PROGRAM = ("import json\nprint('stdlib ok', flush=True)\nimport spfix.basic\n"
           "print('ran', hasattr(spfix.basic, '__source_patches__'))\n")
CLI = [sys.executable, "-m", "source_patch.patcher"]


def child(args, **env) -> subprocess.CompletedProcess:
    """A process of its own; the timeout makes a hang fail the test."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_")
               or k == "SOURCE_PATCH_CACHE"}
    return subprocess.run(args, env={**environ, **env}, capture_output=True, text=True, timeout=60)


@pytest.fixture
def no_hang():
    """A blocking open of a FIFO fails the test instead of hanging it."""
    def expire(*_):
        raise TimeoutError("hung")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- 9. a large code block


def code_block(lines: int, line: str = "x = 1") -> str:
    return SPEC.replace("code: pass\n", "code: |\n" + f"          {line}\n" * lines)


MEASURE = """import resource, sys, time
from source_patch.patcher import spec
text = open(sys.argv[1]).read()
before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
try:
    spec.loads(text, sys.argv[1])
except spec.SpecError as exc:
    print(exc)
print(time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_large_code_block_is_refused_before_it_is_parsed(write_spec):
    """A 5.3 MB block took 14 s and 2.9 GB (Python's parser) before the node count refused it."""
    path = write_spec(code_block(300_000))  # 4.8 MB of file, 1.5 MB of code
    proc = child([sys.executable, "-c", MEASURE, str(path)])
    error, cost = proc.stdout.splitlines()
    seconds, mib = float(cost.split()[0]), int(cost.split()[1])
    assert error == (f"{path}:9:9: code: too much inserted code: more than 256 KiB in this spec's code and "
                     "wrap fields (the bundled specs hold at most 3 KiB)"), proc.stderr
    assert seconds < 1 and mib < 100, cost
    # Under the limit, in a text over it (indentation, a long description), still a spec.
    long_lines = code_block(200, "x = '" + "a" * 1000 + "'").replace("name: s\n", "name: s\ndescription: |\n"
                                                                        + "  words\n" * 20_000)
    assert len(spec_mod.loads(long_lines).patches[0].edits[0].code) > 200_000


def test_code_the_line_scan_cannot_see_is_refused_before_pythons_parser(write_spec):
    """In a flow mapping the code is counted after YAML, still before ast.parse."""
    flow = "- {at: entry, code: '" + "x = 1; " * 40_000 + "'}"  # 280,000 characters on one line
    path = write_spec(SPEC.replace("- at: entry\n        code: pass", flow))
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        spec_mod.load(path)
    assert time.perf_counter() - start < 5
    assert str(info.value).startswith(f"{path}:8:27: patches[0].edits[0].code: too much inserted code: more "
                                      "than 256 KiB"), str(info.value)


# --------------------------------------------------------------------------- 10. settings from the environment


@pytest.mark.parametrize("variable, value, allowed", [
    ("SOURCE_PATCH_DUMP_PORT", "abc", "expected a port number 0-65535, got 'abc'"),
    ("SOURCE_PATCH_DUMP_ENABLE", "maybe", "expected a boolean (true/false, 1/0, yes/no, on/off), got 'maybe'"),
    ("SOURCE_PATCH_DUMP_EXP_NAME", "../../x", "expected a plain directory name (no '/', '\\' or NUL, "
                                              "not '.' or '..'), got '../../x'"),
    ("SOURCE_PATCH_WEIGHT_SYNC_BUCKET_BYTES", "16", "expected a byte count >= 4096, got 16"),
])
def test_a_bad_setting_in_the_environment_stops_the_start_up(write_spec, variable, value, allowed):
    """They crashed the job at its first call site with a 16-93-line traceback."""
    spec = str(write_spec(SPEC))
    line = f"{variable}={value!r}: {allowed}"
    proc = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=spec, **{variable: value})
    assert proc.returncode == 1 and proc.stdout == "stdlib ok\n", proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"source-patch: error: {line}\n"), proc.stderr
    warned = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=spec, SOURCE_PATCH_ON_ERROR="warn",
                   **{variable: value})
    assert warned.stdout == "stdlib ok\nran False\n"  # unpatched, as for any failed activation
    assert warned.stderr == f"source-patch: warning: {line} (SOURCE_PATCH_ON_ERROR=warn: running UNPATCHED)\n"


def test_a_start_up_from_its_boot_record_checks_the_settings_too(write_spec):
    """A boot record (written by a good start-up) skips the full activation: the
    settings are checked where it hands over, at the first import of a target."""
    spec, boot = str(write_spec(SPEC)), Path(os.environ["SOURCE_PATCH_CACHE"], "boot")
    for _ in range(5):  # a source of the patcher changed in the last 2 s is not recorded yet (boot.RACY_NS)
        assert child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=spec).stdout == "stdlib ok\nran True\n"
        if list(boot.glob("*.spb")):
            break
        time.sleep(2.1)
    proc = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=spec, SOURCE_PATCH_TRACE_PORT="http")
    assert proc.returncode == 1 and proc.stdout == "stdlib ok\n", proc.stdout + proc.stderr
    line = "SOURCE_PATCH_TRACE_PORT='http': expected a port number 0-65535, got 'http'"
    assert proc.stderr.startswith(f"source-patch: error: {line}\n"), proc.stderr
    assert "NotActivatedError: source-patch: SOURCE_PATCH could not be activated, so importing this module" \
        in proc.stderr  # the boot record's path ("spfix" on the full one)
    warned = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=spec, SOURCE_PATCH_ON_ERROR="warn",
                   SOURCE_PATCH_TRACE_PORT="http")
    assert warned.stdout == "stdlib ok\nran False\n", warned.stderr
    assert warned.stderr == f"source-patch: warning: {line} (SOURCE_PATCH_ON_ERROR=warn: running UNPATCHED)\n"


def test_activate_refuses_a_bad_setting(write_spec, monkeypatch):
    monkeypatch.setenv("SOURCE_PATCH_ROUTING_MODE", "record")
    with pytest.raises(ActivationError, match=r"^SOURCE_PATCH_ROUTING_MODE='record': expected one of off, "
                                              r"capture, replay, got 'record'$"):
        with patched(write_spec(SPEC)):
            pass


MISSING = SPEC.replace("spfix.basic", "spfix.nosuchmodule")


@pytest.mark.parametrize("value", ["TRUE", "on", "Yes"])
def test_strict_accepts_the_usual_spellings_of_true(write_spec, value):
    """They silently meant off."""
    proc = child([sys.executable, "-c", "print('ran')"], SOURCE_PATCH=str(write_spec(MISSING)),
                 SOURCE_PATCH_STRICT=value)
    assert "source-patch: error: " in proc.stderr and "spfix.nosuchmodule, which cannot be found" in proc.stderr


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_strict_refuses_a_value_that_is_neither_on_nor_off(write_spec, value):
    path = str(write_spec(SPEC))
    line = (f"SOURCE_PATCH_STRICT={value!r} is neither on (1, true, yes, on) nor off (0, false, no, off or "
            "empty), in any case")
    proc = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=path, SOURCE_PATCH_STRICT=value)
    assert proc.returncode == 1 and proc.stderr.startswith(f"source-patch: error: {line}\n"), proc.stderr
    checked = child([*CLI, "check", path], SOURCE_PATCH_STRICT=value)
    assert checked.returncode == 2 and checked.stderr == f"source-patch: error: {line}\n"
    off = child([sys.executable, "-c", PROGRAM], SOURCE_PATCH=path, SOURCE_PATCH_STRICT=" OFF ")
    assert off.stdout == "stdlib ok\nran True\n" and off.stderr == ""


# --------------------------------------------------------------------------- 10. terminal escapes


ESCAPES = "\x1b[2J\x1b]0;owned\x07"


def test_list_escapes_control_characters(write_spec):
    text = SPEC.replace("name: s\n", 'name: s\ndescription: "hi \\e[2J\\e]0;owned\\a"\n'
                                     'requires: {"x\\e[31m": ">=0"}\n')
    path = write_spec(text, "spec\x1b[31m.yaml")
    proc = child([*CLI, "list", str(path)])
    assert proc.returncode == 0 and "\x1b" not in proc.stdout and "\x07" not in proc.stdout, proc.stdout
    assert "  hi \\x1b[2J\\x1b]0;owned\\x07\n" in proc.stdout and "spec\\x1b[31m.yaml" in proc.stdout
    assert "  requires x\\x1b[31m>=0" in proc.stdout


def test_matrix_progress_escapes_a_release_name(write_spec, tmp_path, capsys):
    root = tmp_path / f"rel{ESCAPES}"
    (root / "fixpkg-2.0.dist-info").mkdir(parents=True)
    (root / "fixpkg-2.0.dist-info" / "METADATA").write_text(f"Name: fixpkg\nVersion: 2.0{ESCAPES}\n\n")
    (root / "fixpkg").mkdir()
    (root / "fixpkg" / "__init__.py").write_text("")
    (root / "fixpkg" / "mod.py").write_text("def f(x):\n    return x\n")
    spec = write_spec(SPEC.replace("spfix.basic", "fixpkg.mod").replace("target: add", "target: f"))
    assert cli.main(["matrix", str(spec), "--releases", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err, (out, err)
    assert "matrix: 1/1 rel\\x1b[2J\\x1b]0;owned\\x07" in err and "| fixpkg 2.0\\x1b[2J" in out


# --------------------------------------------------------------------------- 10. command-line edges


def one_line_error(proc, start: str, code: int = 2) -> None:
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(start), proc.stderr


def test_new_into_a_missing_folder(tmp_path):
    proc = child([*CLI, "new", "x", "-o", str(tmp_path / "missing" / "x.yaml")])
    one_line_error(proc, f"source-patch: error: cannot write {tmp_path}/missing/x.yaml: No such file or directory")


def test_run_a_command_that_is_not_there(write_spec, tmp_path):
    proc = child([*CLI, "run", "-s", str(write_spec(SPEC)), "--", str(tmp_path / "nonexistent")])
    one_line_error(proc, f"source-patch: error: run: cannot run {tmp_path}/nonexistent: No such file or directory", 127)
    proc = child([*CLI, "run", "-s", str(write_spec(SPEC)), "--", str(tmp_path)])
    one_line_error(proc, f"source-patch: error: run: cannot run {tmp_path}: Permission denied", 126)


@pytest.mark.parametrize("content, says", [
    (None, "source-patch: error: trace recording: cannot open {path}: No such file or directory"),
    (b"not a trace", "source-patch: error: {path}: not a trace recording (no b'SPTRACE1' header)"),
    (b"SPTRACE1\xff\xff\xff\xff", "source-patch: error: {path}: a frame of 4,294,967,295 bytes at offset 8"),
    (b"SPTRACE1\x05\x00\x00\x00abcde", "source-patch: error: {path}: the frame at offset 8: frame of 5 bytes is shorter"),
])
def test_trace_summary_of_a_missing_or_wrong_file(tmp_path, content, says):
    path = tmp_path / "run.sptrace"
    if content is not None:
        path.write_bytes(content)
    for command in ("summary", "show"):
        proc = child([*CLI, "trace", command, str(path)])
        one_line_error(proc, says.format(path=path), 2)  # unusable input


def test_fifos_are_refused_at_once(tmp_path, capsys, no_hang):
    """`trace summary` hung reading a FIFO, `settings --write` writing one."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args, code, says, why in (
            (["trace", "summary", str(fifo)], 2, "source-patch: error: trace recording: ", "is not a regular file"),
            (["settings", "--write", str(fifo)], 2, f"source-patch: error: cannot write {fifo}: ", "not a regular file"),
            (["new", "x", "-o", str(fifo)], 2, f"source-patch: error: {fifo} exists", "choose another name")):
        start = time.perf_counter()
        assert cli.main(args) == code
        assert time.perf_counter() - start < 1
        err = capsys.readouterr().err
        assert err.startswith(says) and why in err and err.count("\n") == 1, err
    assert fifo.exists() and not fifo.is_file()  # left as it was


def test_settings_write_into_a_missing_folder(tmp_path):
    proc = child([*CLI, "settings", "--write", str(tmp_path / "missing" / "settings.md")])
    one_line_error(proc, f"source-patch: error: cannot write {tmp_path}/missing/settings.md: No such file")
