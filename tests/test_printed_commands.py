"""Issue 56, item 1: every command that `make demo`, `make rollout` and `source-patch replay`
print runs as printed from a fresh shell: the virtual environment not activated (PATH is
/usr/bin:/bin), nothing else in the environment but HOME and the code cache.

`make demo` is run as the Makefile runs it (examples/train_moe.py under megatron_cpu,dump),
for 2 steps rather than 5 and with its dumps in a temporary folder.  `make rollout` needs a real SGLang engine (~30 s on
CPU; tests/test_replay_cli.py runs that path on the session's engine): here its printing
function, examples/rollout_sglang.py's ``show``, gets real files of the same layout (rollout
dumps, routing records, a checkpoint the Megatron twin builds), and the replay and compare
it prints run as printed, the replay printing the same compare command.  All three print
through one helper (runtime/core/commands.py); its rule is checked first."""

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hardening_dump import write_dump
from test_hardening_replay import make_checkpoint, save_route

from source_patch.runtime.verdict import replay
from source_patch.runtime.core import commands

REPO = Path(__file__).resolve().parent.parent
BARE_PATH = "/usr/bin:/bin"  # a fresh shell: no virtual environment activated


def fresh_shell(line: str, cwd, home, cache=None, timeout=300) -> subprocess.CompletedProcess:
    """``line`` as a user pastes it into a new shell in ``cwd``."""
    env = {"PATH": BARE_PATH, "HOME": str(home), **({"SOURCE_PATCH_CACHE": str(cache)} if cache else {})}
    return subprocess.run(["/bin/sh", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def printed(text: str) -> list:
    """The commands in ``text``: each runs from the script's words to the end of its line."""
    start = shlex.join(commands.executable()) + " "
    return [line[line.index(start):] for line in text.splitlines() if start in line]


@pytest.fixture
def home(tmp_path):
    folder = tmp_path / "home"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------- the rule

def test_in_a_virtual_environment_the_script_is_printed_by_its_path(monkeypatch, tmp_path, home):
    """In a venv (activating it lasts one shell) the script's path, relative under the
    current folder, absolute elsewhere; either runs from a shell that never activated it."""
    if sys.prefix == sys.base_prefix or not (Path(sys.executable).parent / "source-patch").is_file():
        pytest.skip("the tests run from a virtual environment with the source-patch script (make test)")
    script = Path(sys.executable).parent / "source-patch"
    monkeypatch.chdir(script.parent.parent)
    assert commands.executable() == [os.path.join("bin", "source-patch")]
    monkeypatch.chdir(tmp_path)
    assert commands.executable() == [os.path.abspath(script)]
    version = fresh_shell(shlex.join([*commands.executable(), "--version"]), tmp_path, home)
    assert version.returncode == 0 and version.stdout.startswith("source-patch "), version.stderr


def test_outside_a_virtual_environment_the_bare_name_only_where_path_finds_this_script(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "source-patch"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python3"))
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{BARE_PATH}")
    assert commands.executable() == ["source-patch"]
    monkeypatch.setenv("PATH", BARE_PATH)  # another install, or none, on PATH: this one by its path
    assert commands.executable() == [os.path.join("bin", "source-patch")]
    script.unlink()  # a source tree on sys.path, no script: this interpreter runs the package
    assert commands.executable() == [str(bin_dir / "python3"), "-m", "source_patch.patcher"]
    assert commands.command("dumps", tmp_path / "a b") == shlex.join(
        [str(bin_dir / "python3"), "-m", "source_patch.patcher", "dumps", str(tmp_path / "a b")])


# ---------------------------------------------------------------- make demo

@pytest.mark.slow
def test_the_demo_prints_a_dumps_command_that_runs(tmp_path, home, shared_code_cache):
    """The Makefile's demo command, its dumps under tmp_path; then what it printed."""
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,dump", "SOURCE_PATCH_DUMP_DIR": str(tmp_path / "sp-dumps"),
           "SOURCE_PATCH_CACHE": str(shared_code_cache)}
    demo = subprocess.run([sys.executable, "examples/train_moe.py", "--steps", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    (line,) = printed(demo.stdout)
    assert demo.stdout.splitlines()[-1].endswith(line) and " dumps " in line and "python -m" not in line
    read = fresh_shell(line, REPO, home)
    assert read.returncode == 0, read.stderr
    table = demo.stdout.split("\ndumps: ")[1].splitlines()[1:-1]  # the demo's own summary of its run
    assert read.stdout.splitlines() == table


# ---------------------------------------------------------------- make rollout, then replay

def rollout_run(run: Path) -> Path:
    """examples/rollout_sglang.py's layout under ``run``: the engine's dumps (two requests,
    SGLang's names and 0-based layers; what a checkpoint of zero weights computes: zeros),
    a routing record per request, and that checkpoint (the twin builds it)."""
    zeros = torch.zeros(4, 8)
    records = [["input_ids", {}, torch.tensor([5, 6, 7, 8])], ["positions", {}, torch.tensor([0, 1, 0, 1])],
               ["row_request", {"rids": ["r0", "r1"]}, torch.tensor([0, 0, 1, 1], dtype=torch.int32)],
               ["layer_input", {"layer": 0}, zeros], ["mlp_output", {"layer": 0}, zeros],
               ["logits", {}, torch.zeros(4, 32)]]  # test_hardening_replay.CONFIG: hidden 8, vocab 32
    write_dump(run / "dumps" / "rollout", [[name, {"step": 0, "rank": 0, **tags}, t] for name, tags, t in records])
    for rid in ("r0", "r1"):
        save_route(run / "routes", rid, 2)
    return make_checkpoint(run.parent / "checkpoint")


def patched_process(reports: Path, tmp_path: Path) -> None:
    """A process patched with a small spec, reporting into ``reports`` as the rollout's
    engine processes do (SOURCE_PATCH_REPORT_DIR, examples/rollout_sglang.engine_env)."""
    spec = tmp_path / "small.yaml"
    spec.write_text("source_patch: 1\nname: small\npatches:\n  - id: p\n    module: spfix.basic\n"
                    "    target: add\n    edits:\n      - at: entry\n        code: pass\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")},
           "SOURCE_PATCH": str(spec), "SOURCE_PATCH_REPORT_DIR": str(reports)}
    done = subprocess.run([sys.executable, "-c", "import spfix.basic"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and list(reports.glob("*.json")), done.stderr
    assert example("rollout_sglang").engine_env(reports.parent)["SOURCE_PATCH_REPORT_DIR"] == str(reports)


def example(name: str):
    found = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_rollout_s_commands_and_the_replay_s_run_as_printed(tmp_path, home, capsys, shared_code_cache):
    run = tmp_path / "sp-rollout" / "rollout-20261207-120000"
    checkpoint = rollout_run(run)
    patched_process(run / "reports", tmp_path)  # as the engine's processes report (engine_env)
    assert example("rollout_sglang").show(run, checkpoint) == 0
    report_line, replay_line, compare_line = printed(capsys.readouterr().out)
    reported = fresh_shell(report_line, os.getcwd(), home)
    assert reported.returncode == 0 and "spfix.basic" in reported.stdout, reported.stdout + reported.stderr
    assert shlex.split(replay_line)[len(commands.executable())] == "replay"
    assert compare_line == replay.compare_command(run / "dumps" / "rollout", run / "replay")

    replayed = fresh_shell(replay_line, os.getcwd(), home, shared_code_cache)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "expert ids of 2 of 2 requests replayed" in replayed.stdout
    assert printed(replayed.stdout) == [compare_line]  # one next command on this path

    compared = fresh_shell(compare_line, os.getcwd(), home, shared_code_cache)
    assert compared.returncode == 0 and compared.stdout.endswith("no divergence\n"), compared.stdout + compared.stderr
    assert (run / "replay" / "report.html").is_file()


def test_make_rollout_takes_the_user_s_specs(write_spec, tmp_path):
    """`make rollout SPECS=a.yaml,b` / `--spec`: each once after the example's own, checked
    before any engine starts (a typo is one line, not a minute of start-up)."""
    rollout = example("rollout_sglang")
    mine = write_spec("source_patch: 1.1\nname: mine\npatches:\n  - id: p\n    module: spfix.basic\n"
                      "    target: add\n    edits:\n      - {at: entry, code: pass}\n")
    assert rollout.with_extra(rollout.SPECS, [f"{mine},trace", "dump"]) == ["routing", "dump", str(mine), "trace"]
    from source_patch.patcher import SourcePatchError

    with pytest.raises(SourcePatchError, match="no_such_spec"):
        rollout.with_extra(rollout.SPECS, ["no_such_spec"])
    make = subprocess.run(["make", "-n", "rollout", f"SPECS={mine} trace"], cwd=REPO, capture_output=True, text=True)
    assert make.returncode == 0 and f"--spec {mine} --spec trace" in make.stdout, make.stdout + make.stderr
