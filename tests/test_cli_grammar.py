"""Issue 56, item 6: one command-line grammar (runtime/core/commands.py, docs/cli.md).

`--json` is JSON on stdout on every verb that prints results, and then an error is JSON
too (`check --json` on an invalid spec printed nothing on stdout); `--json-out FILE` writes
a file (the old `--json FILE` still works, with a warning); one error prefix; one table of
exit codes, in `--help` and in docs/cli.md; `-V`; completion per verb, with the bundled
spec names, for bash, zsh and fish."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hardening_dump import records, write_dump

from source_patch.patcher import cli
from source_patch.runtime.core import commands

REPO = Path(__file__).resolve().parent.parent
SPEC = """source_patch: 1.1
name: g
patches:
  - id: entry
    module: spfix.basic
    target: add
    edits:
      - {at: entry, code: "__sp__.emit('add', a)"}
"""
BAD_SPEC = SPEC.replace("target: add", "target: add\n    colour: red")


def json_error(capsys, argv) -> dict:
    """``source-patch ARGV`` fails: exit 2, one JSON object on stdout, one line on stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # a usage error: argparse exits
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    said = json.loads(out)
    assert said == {"error": said["error"], "exit": 2} and said["error"], out
    assert err.splitlines()[-1] == f"source-patch: error: {said['error']}", err
    return said


def test_check_json_on_an_invalid_spec_is_json(write_spec, capsys):
    path = write_spec(BAD_SPEC)
    said = json_error(capsys, ["check", "--json", str(path)])
    assert said["error"].startswith(f"{path}:7:5: patches[0].colour: unknown key 'colour'")


def test_every_verb_that_prints_json_says_its_errors_as_json(write_spec, tmp_path, capsys):
    bad, missing = str(write_spec(BAD_SPEC)), str(tmp_path / "missing")
    for argv, said in [
        (["diff", bad], "unknown key 'colour'"),
        (["list", bad], "unknown key 'colour'"),
        (["anchors", "spfix.no_such_module:f"], "spfix.no_such_module"),
        (["matrix", bad, "--releases", missing], "unknown key 'colour'"),
        (["dumps", missing], "no dump manifests under"),
        (["compare", missing, missing], "no dump manifests under"),
        (["replay", missing, "--checkpoint", missing], "no dump manifests under"),
        (["stream-status", "--db", missing], "no control db at"),
        (["check"], "the following arguments are required: SPEC"),  # argparse's own, the same way
        (["compare", missing], "the following arguments are required: train"),
    ]:
        assert said in json_error(capsys, [*argv, "--json"])["error"], argv


def test_without_json_an_error_is_one_line_with_the_one_prefix(tmp_path, capsys):
    for argv in (["dumps", str(tmp_path)], ["compare", str(tmp_path), str(tmp_path)],
                 ["trace", "summary", str(tmp_path / "none")], ["run", "-s", "dump"]):
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("source-patch: error: "), (argv, err)


def test_json_results_carry_the_exit_code(write_spec, tmp_path, capsys):
    spec = str(write_spec(SPEC))
    assert cli.main(["diff", "--json", spec]) == 0
    diff = json.loads(capsys.readouterr().out)
    (module,) = diff["modules"]
    assert diff["exit"] == 0 and module["module"] == "spfix.basic" and module["error"] is None
    assert "+        __sp__.emit('add', a)\n" in module["diff"]

    dumps = write_dump(tmp_path / "rollout", records(False))
    assert cli.main(["dumps", str(dumps), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 7 and summary["exit"] == 0
    assert {"name": "layer_input", "records": 1, "steps": [0], "ranks": [0], "layers": [0], "shapes": [[4, 8]],
            "dtypes": ["float32"], "bytes": 128} in summary["names"]

    train = write_dump(tmp_path / "train", records(True))
    assert cli.main(["compare", str(dumps), str(train), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit"] == 0 and report["first_divergent"] is None and report["inputs"]["rollout dumps"]


def test_check_json_lists_what_is_left_out_as_data(write_spec, capsys):
    gated = SPEC.replace("    target: add\n", "    target: add\n    requires: {pyyaml: '>=99'}\n")
    path = write_spec(gated + SPEC.split("patches:\n")[1].replace("id: entry", "id: other"))
    assert cli.main(["check", "--json", str(path)]) == 0
    (left,) = json.loads(capsys.readouterr().out)["left_out"]
    assert left["kind"] == "patch" and left["state"] == "gated" and left["patch"] == "entry"
    assert left["module"] == "spfix.basic" and left["reason"].startswith("requires pyyaml>=99, found ")


def test_json_out_writes_a_file_and_the_old_json_file_spelling_warns(tmp_path, capsys):
    dumps = [str(write_dump(tmp_path / side, records(side == "train"))) for side in ("rollout", "train")]
    assert cli.main(["compare", *dumps, "--json-out", str(tmp_path / "new.json")]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("no divergence\n") and captured.err == ""  # the table, and the file
    assert json.loads((tmp_path / "new.json").read_text())["first_divergent"] is None
    assert cli.main(["compare", *dumps, "--json", str(tmp_path / "old.json")]) == 0
    assert capsys.readouterr().err == (f"source-patch: warning: --json {tmp_path / 'old.json'} is now --json-out "
                                       f"{tmp_path / 'old.json'} (--json alone prints JSON on stdout)\n")
    old, new = (json.loads((tmp_path / name).read_text()) for name in ("old.json", "new.json"))
    assert old["rows"] == new["rows"] and old["inputs"]["rollout dumps"] == dumps[0]


def test_version_short_and_long(capsys):
    for flag in ("-V", "--version"):
        with pytest.raises(SystemExit) as done:
            cli.main([flag])
        assert done.value.code == 0 and capsys.readouterr().out.startswith("source-patch ")


def test_the_exit_codes_are_in_help_and_in_the_docs(capsys):
    page = (REPO / "docs" / "cli.md").read_text()
    for argv in (["--help"], ["check", "--help"], ["compare", "--help"], ["dumps", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert commands.EPILOG in capsys.readouterr().out, argv
    for code, meaning in commands.EXIT_CODES:
        assert f"| {code} | {meaning} |" in page, code


# ---------------------------------------------------------------- completion

def bash_complete(script: str, *words: str) -> list:
    """What bash offers for ``source-patch WORDS`` (the last one being typed)."""
    probe = (f"{script}\nCOMP_WORDS=(source-patch {' '.join(map(repr, words))}); COMP_CWORD={len(words)}\n"
             "_source_patch; printf '%s\\n' \"${COMPREPLY[@]}\"")
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=REPO / "patches", timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def script(shell: str, capsys) -> str:
    assert cli.main(["completion", shell]) == 0
    return capsys.readouterr().out


def test_bash_completes_each_verb_s_own_options_and_spec_names(capsys):
    bash = script("bash", capsys)
    assert "check" in bash_complete(bash, "ch") and "-V" in bash_complete(bash, "-")
    assert set(bash_complete(bash, "replay", "--c")) == {"--checkpoint", "--compare"}  # not diff's --color
    assert "--json-out" in bash_complete(bash, "compare", "--json") and "--color" in bash_complete(bash, "diff", "--c")
    assert {"routing", "routing.yaml"} <= set(bash_complete(bash, "check", "rout"))  # names and files
    assert {"megatron_cpu", "megatron_topk"} <= set(bash_complete(bash, "run", "-s", "megatron"))
    assert bash_complete(bash, "diff", "--color", "") == ["auto", "always", "never"]
    assert bash_complete(bash, "trace", "")[:3] == ["record", "summary", "show"]  # then files, for a recording
    assert bash_complete(bash, "completion", "") == ["bash", "zsh", "fish"]
    assert "moe_sglang" not in bash  # a deprecated name is not offered


def zsh_complete(zsh: str, *words: str) -> list:
    """What the zsh function offers, its compadd and _files stood in for (no terminal)."""
    probe = ("compdef() {}\n" + zsh + "\ncompadd() { if [[ $1 == -a ]]; then print -l -- ${(P)2}; else shift; "
             "print -l -- \"$@\"; fi }\n_files() { print FILES }\n"
             f"words=(source-patch {' '.join(map(repr, words))}); CURRENT={len(words) + 1}; _source_patch")
    done = subprocess.run(["zsh", "-f", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completes_per_verb(capsys):
    zsh = script("zsh", capsys)
    assert subprocess.run(["zsh", "-n", "-c", zsh]).returncode == 0
    replay = zsh_complete(zsh, "replay", "--c")
    assert "--checkpoint" in replay and "--color" not in replay
    assert zsh_complete(zsh, "diff", "--color", "") == ["auto", "always", "never"]
    assert "routing" in zsh_complete(zsh, "check", "") and zsh_complete(zsh, "check", "")[-1] == "FILES"


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes_per_verb(capsys, tmp_path):
    fish = tmp_path / "source-patch.fish"
    fish.write_text(script("fish", capsys))
    scripts = Path(sys.executable).parent  # `complete -C` completes a command it can find

    def offered(line: str) -> list:
        done = subprocess.run(["fish", "--no-config", "-c", f"source {fish}; complete -C '{line}'"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30, env={"PATH": f"{scripts}:/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        return [words.split("\t")[0] for words in done.stdout.splitlines()]

    assert set(offered("source-patch replay --c")) == {"--checkpoint", "--compare"}
    assert "routing" in offered("source-patch check ") and "--json" in offered("source-patch stream-status --")
    assert set(offered("source-patch trace ")) >= {"record", "summary", "show"}


def test_settings_json_lists_every_setting_of_every_capability(capsys):
    import json

    from source_patch.patcher import cli
    from source_patch.runtime.core import settings

    assert cli.main(["settings", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out) == sorted(settings.SCHEMAS)
    assert out["routing_sglang"]["capability"] == "routing"
    assert out["dump"]["settings"]["port"] == {"variable": "SOURCE_PATCH_DUMP_PORT", "default": 0,
                                               "help": settings.SCHEMAS["dump"]["port"].help}
