"""The user-facing edges (issue 33): no patch fails to apply without a word, `check` and
`diff` agree with the import (exit codes included), `new` derives its requirement, the
dry runs suggest the nearest names, and the command line's own flags."""

import importlib
import json
import importlib.metadata
import os
import subprocess
import sys
import warnings

import pytest
import yaml

from source_patch.patcher import RequirementError, cli, patched
from source_patch.patcher.authoring import derived_requirement
from source_patch.patcher.errors import SourcePatchWarning

PYYAML = importlib.metadata.version("pyyaml")


def spec(*patches: str, head: str = "") -> str:
    return f"source_patch: 1.1\nname: s\n{head}patches:\n" + "".join(patches)


def patch(pid: str, requires: str = "", target: str = "add", module: str = "spfix.basic") -> str:
    extra = f"    requires: {requires}\n" if requires else ""
    return (f"  - id: {pid}\n    module: {module}\n    target: {target}\n{extra}"
            f"    edits:\n      - {{at: entry, code: pass}}\n")


def import_basic():
    sys.modules.pop("spfix.basic", None)
    return importlib.import_module("spfix.basic")


# --------------------------------------------------------------------------- no silent skip at import


@pytest.mark.parametrize("requires, reason", [
    ("{pyyaml: '>=99'}", f"requires pyyaml>=99, found {PYYAML}"),
    ("{no-such-dist: '>=1'}", "requires no-such-dist>=1, which is not installed"),
])
def test_a_patch_that_applies_nowhere_in_an_imported_module_warns_once(write_spec, requires, reason):
    path = write_spec(spec(patch("p", requires)))
    with patched(path), pytest.warns(SourcePatchWarning) as caught:
        import_basic()
        import_basic()  # a second import of the module: said once
    (message,) = [str(w.message) for w in caught]
    assert message == (f"source-patch: patch 'p' of spec 's' ({path}:4) does not apply to spfix.basic: "
                       f"{reason}; no patch of that spec applies to the module "
                       f"(SOURCE_PATCH_STRICT=1 makes this an error)")


def test_strict_makes_a_patch_that_applies_nowhere_an_error(write_spec, monkeypatch):
    monkeypatch.setenv("SOURCE_PATCH_STRICT", "1")
    path = write_spec(spec(patch("p", "{pyyaml: '>=99'}")))
    with patched(path), pytest.raises(RequirementError, match="patch 'p' of spec 's' .* does not apply"):
        import_basic()


def test_a_gated_alternative_beside_one_that_applies_is_quiet(write_spec):
    path = write_spec(spec(patch("new", "{pyyaml: '>=99'}"), patch("old", "{pyyaml: '>=5,<99'}")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patched(path):
            assert [a.patch for a in import_basic().__source_patches__] == ["old"]


# --------------------------------------------------------------------------- check, diff and the import agree


def test_a_spec_skipped_by_on_unmet_skip_is_skipped_by_check_diff_and_import(write_spec, capsys):
    path = write_spec(spec(patch("p"), head="requires: {pyyaml: '>=99'}\non_unmet: skip\n"))
    reason = f"requires pyyaml>=99, found {PYYAML}"
    assert cli.main(["check", str(path)]) == 3
    out = capsys.readouterr().out
    assert f"skipped spec s ({path}): {reason} (on_unmet: skip: skipped)" in out and "ok " not in out
    assert cli.main(["diff", str(path)]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "skipped spec s" in captured.err
    with patched(path), pytest.warns(SourcePatchWarning, match=f"skipping spec 's' for spfix.basic: {reason}"):
        assert not hasattr(import_basic(), "__source_patches__")


def test_a_spec_with_on_unmet_error_fails_check_diff_and_import_alike(write_spec, capsys):
    path = write_spec(spec(patch("p"), head="requires: {pyyaml: '>=99'}\n"))
    assert cli.main(["check", str(path)]) == 3
    assert "(on_unmet: error: importing a target fails)" in capsys.readouterr().out
    assert cli.main(["diff", str(path)]) == 3
    assert capsys.readouterr().out == ""
    with patched(path), pytest.raises(RequirementError):
        import_basic()


def test_a_module_left_without_patches_is_skipped_in_check_and_diff(write_spec, capsys, monkeypatch):
    path = write_spec(spec(patch("p", "{pyyaml: '>=99'}")))
    assert cli.main(["check", str(path)]) == 0  # the import warns and goes on
    assert f"skipped p (spfix.basic): requires pyyaml>=99, found {PYYAML}" in capsys.readouterr().out
    assert cli.main(["diff", str(path)]) == 0
    assert capsys.readouterr().out == ""  # no diff the import would not apply
    monkeypatch.setenv("SOURCE_PATCH_STRICT", "1")  # the import raises: check says so too
    assert cli.main(["check", str(path)]) == 3


def test_a_gated_alternative_stays_gated_in_check(write_spec, capsys):
    path = write_spec(spec(patch("new", "{pyyaml: '>=99'}"), patch("old", "{pyyaml: '>=5,<99'}")))
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gated new (spfix.basic): requires pyyaml>=99" in out and "       old: at entry" in out


# --------------------------------------------------------------------------- new derives requires


@pytest.mark.parametrize("module, dist", [
    ("megatron.core.transformer.moe.router", "megatron-core"),
    ("sglang.srt.layers.moe.topk", "sglang"),
])
def test_new_derives_the_distribution_and_a_lower_bound(module, dist, capsys):
    major, minor = importlib.metadata.version(dist).split(".")[:2]
    assert derived_requirement(module) == (dist, f">={major}.{minor}")
    assert cli.main(["new", "x", "--module", module, "-o", "-"]) == 0
    (p,) = yaml.safe_load(capsys.readouterr().out)["patches"]
    assert p["requires"] == {dist: f">={major}.{minor}"}


def test_new_writes_no_requirement_for_the_standard_library_or_an_unknown_module(capsys):
    for module, comment in [("json.decoder", "# requires: none (the standard library)"),
                            ("spfix.basic", "# requires:                     # none derived")]:
        assert derived_requirement(module) is None
        assert cli.main(["new", "x", "--module", module, "-o", "-"]) == 0
        text = capsys.readouterr().out
        assert comment in text and "requires" not in yaml.safe_load(text)["patches"][0]


# --------------------------------------------------------------------------- nearest names


def test_check_and_diff_suggest_the_nearest_module(write_spec, capsys):
    path = write_spec(spec(patch("p", module="spfix.basik")))
    assert cli.main(["check", str(path)]) == 1
    assert ("FAIL spfix.basik: module spfix.basik not found on the search path; nearest: spfix.basic"
            in capsys.readouterr().out)
    assert cli.main(["diff", str(path)]) == 1
    assert "nearest: spfix.basic" in capsys.readouterr().err


def test_check_and_anchors_suggest_the_nearest_function(write_spec, capsys):
    path = write_spec(spec(patch("p", target="ad")))
    assert cli.main(["check", str(path)]) == 1
    assert "target 'ad' not found; nearest: add" in capsys.readouterr().out
    assert cli.main(["anchors", "spfix.basik:add"]) == 2
    assert "not found on the search path; nearest: spfix.basic" in capsys.readouterr().err
    assert cli.main(["anchors", "spfix.basic:ad"]) == 2
    assert "nearest: add" in capsys.readouterr().err


# --------------------------------------------------------------------------- SOURCE_PATCH after start


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SOURCE_PATCH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})


def test_source_patch_set_inside_the_script_is_explained(write_spec):
    path = write_spec(spec(patch("p")))
    out = run_python(f"import os; os.environ['SOURCE_PATCH'] = {str(path)!r}\n"
                     "from source_patch.patcher import activate\nimport spfix.basic")
    assert out.returncode == 0, out.stderr
    assert "is set, but the start hook did not run in this process: it was set after the interpreter " \
           "started" in out.stderr
    assert out.stderr.count("SourcePatchWarning") == 1


def test_source_patch_changed_after_start_is_explained(write_spec):
    first, second = write_spec(spec(patch("p"))), write_spec(spec(patch("q")))
    out = run_python(f"import os; os.environ['SOURCE_PATCH'] = {str(second)!r}\n"
                     "from source_patch.patcher import activate\n", SOURCE_PATCH=str(first))
    assert out.returncode == 0, out.stderr
    assert f"SOURCE_PATCH changed after start-up (from '{first}' to '{second}')" in out.stderr


def test_an_unchanged_source_patch_says_nothing(write_spec):
    path = write_spec(spec(patch("p")))
    out = run_python("from source_patch.patcher import activate\nimport spfix.basic", SOURCE_PATCH=str(path))
    assert out.returncode == 0 and "SourcePatchWarning" not in out.stderr, out.stderr


# --------------------------------------------------------------------------- one command line


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"source-patch {importlib.metadata.version('source-patch')}\n"


def test_check_json_carries_the_verdict_and_exit_code(write_spec, capsys):
    import json

    path = write_spec(spec(patch("new", "{pyyaml: '>=99'}"), patch("old", "{pyyaml: '>=5,<99'}")))
    assert cli.main(["check", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit"] == 0 and report["specs"] == [{"name": "s", "file": str(path), "unmet": None}]
    assert report["notes"] == [f"gated new (spfix.basic): requires pyyaml>=99, found {PYYAML}"]
    (module,) = report["modules"]
    assert module["module"] == "spfix.basic" and module["error"] is None
    assert [h["patch"] for h in module["hits"]] == ["old"]


def test_list_json(write_spec, capsys):
    import json

    path = write_spec(spec(patch("p", "{pyyaml: '>=5'}")))
    assert cli.main(["list", "--json", str(path)]) == 0
    (s,) = json.loads(capsys.readouterr().out)
    assert s["name"] == "s" and s["patches"][0]["requires"] == {"pyyaml": ">=5"}
    assert s["patches"][0]["edits"] == [{"at": "entry", "anchor": "at entry", "count": "1"}]


@pytest.mark.parametrize("verb, words", [
    ("dumps", "usage: source-patch dumps"), ("trace", "usage: source-patch trace"),
    ("stream-status", "usage: source-patch stream-status"),
])
def test_the_runtime_tools_are_verbs(verb, words, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    assert capsys.readouterr().out.startswith(words)


def test_the_old_module_entry_points_keep_working():
    out = run_python("from source_patch.runtime.dump import reader; reader.main(['--help'])")
    assert out.stdout.startswith("usage: python -m source_patch.runtime.dump.reader")


def test_stream_status_reads_a_missing_db_as_an_error(tmp_path, capsys):
    assert cli.main(["stream-status", "--db", str(tmp_path / "none.db")]) == 2  # unusable input
    assert capsys.readouterr().err.startswith("source-patch: error: no control db at ")


def test_bash_completion_lists_every_command(capsys):
    assert cli.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert script.endswith("complete -o filenames -F _source_patch source-patch\n")
    (top,) = [line for line in script.splitlines() if "COMP_CWORD\" -eq 1" not in line and "compgen -W '" in line]
    offered = top.split("'")[1].split()
    assert {"check", "diff", "anchors", "dumps", "trace", "stream-status", "completion", "--version", "-V"} <= set(offered)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_anchors_json_holds_what_the_listing_shows(capsys):
    from source_patch.patcher import cli

    assert cli.main(["anchors", "--json", "json.decoder:JSONDecoder.decode"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "function" and data["target"] == "JSONDecoder.decode"
    assert data["statements"][0]["pattern"] is None and "docstring" in data["statements"][0]["note"]
    assert [r["pattern"] for r in data["returns"]] == ["return obj"] and data["returns"][0]["matches"] == 1
    assert cli.main(["anchors", "json.decoder:JSONDecoder.decode"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {a['line']}  " in listing for a in data["statements"] + data["calls"])
    assert cli.main(["anchors", "--json", "json.decoder:JSONDecoder"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)["methods"]] == [
        "JSONDecoder.__init__", "JSONDecoder.decode", "JSONDecoder.raw_decode"]
