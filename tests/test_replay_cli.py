"""From a rollout to a verdict (issue 33, item 2): `make rollout`'s dumps (examples/
rollout_sglang.py, a real sglang.Engine on CPU from the session's engine fixture) through
the commands the example prints, `source-patch replay` (the Megatron twin of the
checkpoint, the engine's routes replayed) and `source-patch compare --html`: no
divergence, and the inputs in the page; with one twin weight perturbed (a builder of
one's own), the right first divergent layer.  And the command lines themselves:
`--help` shows every option, options may come first, errors are one line, exit 2."""

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from source_patch.patcher import cli
from source_patch.runtime.verdict import replay
from source_patch.runtime.verdict import compare

REPO = Path(__file__).resolve().parent.parent
PERTURBED = REPO / "tests" / "e2e" / "twin_replay.py"
pytestmark = pytest.mark.usefixtures("in_shared_code_cache")  # its replays: tests/conftest.py


def source_patch(*args, timeout=600):
    """The real `source-patch` command line, in a child process."""
    return subprocess.run([sys.executable, "-m", "source_patch.patcher", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("command", ["compare", "replay"])
def test_help_shows_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: source-patch {command} ")
    for option in ("--exp-name", "--rtol", "--layer-offset", "--json", "--json-out", "--html"):
        assert option in out, option
    if command == "replay":
        for option in ("--checkpoint", "--out", "--routes", "--replay-probs", "--builder", "--logprobs", "--compare",
                       "--tokens"):
            assert option in out, option


def test_options_may_come_before_the_folders(tmp_path, capsys):
    """Before, `compare --rtol 1 A B` lost --rtol (argparse.REMAINDER): now it reaches compare."""
    assert cli.main(["compare", "--rtol", "1", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("source-patch: error: no dump manifests under ") and err.count("\n") == 1


def test_replay_errors_are_one_line_before_anything_runs(tmp_path, capsys):
    rollout = tmp_path / "rollout" / "rank-0"
    rollout.mkdir(parents=True)
    (rollout / "manifest.jsonl").write_text("")
    cases = [([str(rollout), "--checkpoint", str(tmp_path)], f"no config.json there"),
             ([str(tmp_path / "none"), "--checkpoint", str(tmp_path)], "no dump manifests under"),
             ([str(rollout), "--checkpoint", str(tmp_path), "--html", str(tmp_path / "no" / "r.html")], "no folder")]
    for args, said in cases:
        assert cli.main(["replay", *args]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("source-patch: error: ") and captured.err.count("\n") == 1 and said in captured.err, args
    assert not (tmp_path / "sp-replay").exists()  # nothing started, nothing made


@pytest.fixture(scope="module")
def rollout(sglang_engine, sglang_checkpoint, tmp_path_factory):
    """examples/rollout_sglang.py's rollout, on the session's engine of its specs and settings;
    its run folder once every request's dumps and routing record are on disk."""
    pytest.importorskip("megatron.core")
    found = importlib.util.spec_from_file_location("rollout_sglang", REPO / "examples" / "rollout_sglang.py")
    example = importlib.util.module_from_spec(found)
    found.loader.exec_module(example)
    run = tmp_path_factory.mktemp("sp-rollout") / "rollout-20261125-120000"
    engine = sglang_engine(specs=example.SPECS, args=example.ENGINE_ARGS, env=example.engine_env(run))
    outputs = example.roll_out(engine, 4, 8)
    wait_for(run, {o["meta_info"]["id"]: o["meta_info"]["prompt_tokens"] + 8 - 1 for o in outputs})
    return example, run


def wait_for(run, lengths: dict, timeout=60.0):
    """Until each request's rows (its prompt and fed-back tokens) and routing record are written:
    the engine keeps serving, its writer writes as it goes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = {rid: len(tokens) for rid, tokens in replay.sequences(run / "dumps" / "rollout").items()}
        except (OSError, ValueError):
            got = {}
        routes = {p.stem for p in (run / "routes").rglob("*.safetensors")}
        if all(got.get(rid) == n for rid, n in lengths.items()) and set(lengths) <= routes:
            return
        assert time.monotonic() < deadline, (got, lengths, routes)
        time.sleep(0.2)


@pytest.mark.slow
def test_the_printed_commands_take_the_rollout_to_no_divergence(rollout, sglang_checkpoint, capsys, tmp_path,
                                                                shared_code_cache):
    """What `make rollout` prints, run as printed from a fresh shell (tests/test_printed_commands.py)."""
    from test_printed_commands import fresh_shell, printed

    example, run = rollout
    assert example.show(run, sglang_checkpoint) == 0
    report, *lines = printed(capsys.readouterr().out)
    reported = fresh_shell(report, Path.cwd(), tmp_path)  # every engine process's patches, the schedulers' too
    assert reported.returncode == 0 and "applied" in reported.stdout, reported.stdout + reported.stderr
    assert len(lines) == 2 and " replay " in lines[0]
    assert lines[1] == replay.compare_command(run / "dumps" / "rollout", run / "replay")
    replayed = fresh_shell(lines[0], Path.cwd(), tmp_path, shared_code_cache, timeout=600)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert re.search(r"^replayed 4 requests \(\d+ tokens\) through source_patch\.runtime\.verdict\.twin:build in "
                     r"[\d.]+ s; routes: expert ids of 4 of 4 requests replayed from ", replayed.stdout, re.M)
    assert "Traceback" not in replayed.stderr and "UserWarning" not in replayed.stderr

    assert printed(replayed.stdout) == lines[1:]  # the same compare command as the rollout's
    compared = fresh_shell(lines[1], Path.cwd(), tmp_path, shared_code_cache)
    assert compared.returncode == 0 and compared.stdout.endswith("no divergence\n"), compared.stdout + compared.stderr
    assert "routing agreement      0     " in compared.stdout and "100.00%" in compared.stdout
    page = (run / "replay" / "report.html").read_text()
    assert "no divergence past rtol" in page
    inputs = dict(re.findall(r"<tr><td>([^<]+)</td><td class='input'>([^<]*)</td></tr>", page))
    (train,) = [folder for folder in (run / "replay").iterdir() if folder.is_dir()]
    assert inputs["rollout dumps"] == str(run / "dumps" / "rollout") and inputs["training dumps"] == str(train)
    assert inputs["checkpoint"] == str(sglang_checkpoint)
    assert inputs["model builder"] == "source_patch.runtime.verdict.twin:build"
    assert inputs["routes"] == f"expert ids of 4 of 4 requests replayed from {run / 'routes'}"
    assert inputs["requests"] == "4" and "replayed rollout" not in inputs  # the one compared
    for key in ("replay versions", "compare versions"):
        assert re.fullmatch(r"source-patch \S+, torch \S+, megatron-core \S+, sglang \S+", inputs[key]), inputs
    for key in ("replayed at", "compared at"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}", inputs[key]), inputs


@pytest.mark.slow
def test_a_perturbed_twin_weight_is_placed_at_its_layer(rollout, sglang_checkpoint, tmp_path):
    """A builder of one's own (layer 2's attention projection x 1.01), replayed and compared
    in one command: SGLang layer 1's attention output is the first to diverge."""
    _, run = rollout
    dumps = run / "dumps" / "rollout"
    out = tmp_path / "sp-replay"
    result = source_patch("replay", dumps, "--checkpoint", sglang_checkpoint, "--out", out, "--builder",
                          f"{PERTURBED}:perturbed", "--logprobs", tmp_path / "logps.json",
                          "--json-out", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "first divergent: attention_output layer 1" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergent"] == ["attention_output", 1]
    assert report["inputs"]["model builder"] == f"{PERTURBED}:perturbed"
    assert all(row["ok"] for row in report["rows"] if row["layer"] == 0)
    assert "first divergent: attention_output layer 1" in (tmp_path / "r.html").read_text()
    logps = json.loads((tmp_path / "logps.json").read_text())  # log p(token i | the tokens before it), i >= 1
    assert {rid: len(v) + 1 for rid, v in logps.items()} == {rid: len(t) for rid, t in replay.sequences(dumps).items()}
    assert compare.main([str(dumps), str(out)]) == 1  # the run the replay made: the latest under --out
