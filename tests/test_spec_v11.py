"""Spec format 1.1: per-patch requires and on_drift, scoped runtime settings, PEP 678
notes, authoring messages, aliases of the old bundled names, and a v1 file unchanged."""

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from source_patch.patcher import AnchorError, SpecError, activate, patched
from source_patch.patcher.activation import installed_finder
from source_patch.patcher.errors import ActivationError, SourcePatchWarning
from source_patch.patcher.spec import loads

ADD = """
  - id: {pid}
    module: spfix.basic
    target: add
    {extra}
    edits:
      - {{at: {at}, match: "{match}", code: "__sp__.emit('{pid}', total)"}}
"""


def spec(*patches: str, version: str = "1.1") -> str:
    return f"source_patch: {version}\nname: s\npatches:\n" + "".join(patches)


def add_patch(pid, extra="", at="after", match="total = a + b"):
    return ADD.format(pid=pid, extra=extra, at=at, match=match)


def applied(module) -> list[str]:
    return [a.patch for a in module.__source_patches__]


@pytest.fixture
def emitted():
    from source_patch.runtime import capture

    with capture() as events:
        yield events


# --------------------------------------------------------------------------- the format


def test_a_version_1_file_still_loads_and_applies(write_spec, emitted):
    path = write_spec(spec(add_patch("p"), version="1").replace("name: s", "name: s\nrequires: {pyyaml: '>=5'}"))
    with patched(path):
        from spfix import basic
        assert basic.add(2, 3) == 5 and applied(basic) == ["p"]
    assert [e.name for e in emitted] == ["p"]


def test_a_version_1_file_may_not_use_the_new_patch_keys():
    with pytest.raises(SpecError) as err:
        loads(spec(add_patch("p", extra="on_drift: warn"), version="1"), "v1.yaml")
    assert str(err.value) == "v1.yaml:8:5: patches[0].on_drift: 'on_drift' on a patch needs source_patch: 1.1"


@pytest.mark.parametrize("version, message", [
    ("2", "unsupported format version 2 (this tool reads 1, 1.1)"),
    ("1.2", "unsupported format version 1.2 (this tool reads 1, 1.1)"),
    ("[1]", "expected a format version such as 1.1, got a list"),
])
def test_unknown_format_versions_are_refused(version, message):
    with pytest.raises(SpecError, match="source_patch: " + __import__("re").escape(message)):
        loads(spec(add_patch("p"), version=version), "x.yaml")


def test_on_drift_must_be_a_known_policy():
    with pytest.raises(SpecError, match=r"x.yaml:8:15: patches\[0\].on_drift: must be one of error, warn, skip"):
        loads(spec(add_patch("p", extra="on_drift: maybe")), "x.yaml")


# --------------------------------------------------------------------------- requires per patch


def test_an_unmet_patch_requirement_skips_that_patch_with_a_reason(write_spec, emitted):
    path = write_spec(spec(add_patch("new", extra="requires: {pyyaml: '>=99'}"),
                           add_patch("old", extra="requires: {pyyaml: '>=5,<99'}")))
    with patched(path) as activation:
        from spfix import basic
        basic.add(1, 1)
        assert applied(basic) == ["old"]
        skipped = [(k.patch.id, k.reason) for k in installed_finder().skipped]
        version = importlib.metadata.version("pyyaml")
        assert skipped == [("new", f"requires pyyaml>=99, found {version}")]
        assert activation.report().splitlines() == [
            f"spec s ({path}):", f"  new (spfix.basic): skipped: requires pyyaml>=99, found {version}",
            "  old (spfix.basic): applied"]
    assert [e.name for e in emitted] == ["old"]


def test_a_two_framework_spec_applies_the_installed_side_only(write_spec):
    """The other framework's patch names a distribution that is not installed: no
    warning at activation (that is the other side), no error, nothing applied there."""
    other = add_patch("engine", extra="requires: {no-such-framework: '>=1'}").replace(
        "spfix.basic", "no_such_framework.layers")
    path = write_spec(spec(add_patch("trainer", extra="requires: {pyyaml: '>=5'}"), other))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patched(path):
            from spfix import basic
            assert applied(basic) == ["trainer"]


@pytest.mark.usefixtures("in_shared_code_cache")
def test_the_bundled_moe_spec_patches_megatron_and_sglang_each_with_its_own_side():
    """One file, both frameworks: real modules, a fresh interpreter (SOURCE_PATCH set)."""
    code = (
        "import megatron.core.transformer.moe.moe_utils as m, sglang.srt.layers.moe.topk as s\n"
        "print(sorted(a.patch for a in m.__source_patches__))\n"
        "print(sorted(a.patch for a in s.__source_patches__))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SOURCE_PATCH": "sglang_cpu,routing"})
    assert out.returncode == 0, out.stderr
    megatron, sglang = out.stdout.splitlines()[-2:]
    assert megatron == "['topk-capture-replay', 'topk-fused-guard-and-probs']"  # not the 0.14 variant
    assert sglang == "['routing-topk']"


# --------------------------------------------------------------------------- drift


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_drifted_patch_is_left_out_and_the_others_still_apply(write_spec, emitted, policy):
    drifted = add_patch("drifted", extra=f"on_drift: {policy}", match="total = a - b")
    path = write_spec(spec(add_patch("good"), drifted))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with patched(path):
            from spfix import basic
            basic.add(1, 2)
            assert applied(basic) == ["good"]
            (skip,) = installed_finder().skipped
            assert skip.patch.id == "drifted" and skip.reason.startswith("anchor drifted: cannot patch module spfix.basic")
    assert [e.name for e in emitted] == ["good"]
    messages = [str(w.message) for w in caught if "left out" in str(w.message)]
    if policy == "skip":
        assert messages == []
    else:
        (message,) = messages
        assert message.startswith("source-patch: patch 'drifted' of spec 's' left out (on_drift: warn; the "
                                  "module's other patches apply): cannot patch module spfix.basic (")
        assert "edit at after 'total = a - b' (spec line 17): expected 1 match, found 0; nearest candidates:" in message


def test_a_drifted_patch_stops_the_import_by_default(write_spec):
    path = write_spec(spec(add_patch("good"), add_patch("drifted", match="total = a - b")))
    with patched(path), pytest.raises(AnchorError, match="patch 'drifted'"):
        importlib.import_module("spfix.basic")


# --------------------------------------------------------------------------- authoring messages


def test_an_exception_in_inserted_code_names_the_spec_patch_and_line(write_spec):
    path = write_spec(spec("""
  - id: boom
    module: spfix.basic
    target: add
    edits:
      - at: entry
        code: |
          raise KeyError(a)
"""))
    with patched(path):
        from spfix import basic
        with pytest.raises(KeyError) as err:
            basic.add(1, 2)
    assert err.value.__notes__ == [
        f"source-patch: raised in code inserted by patch 'boom' of spec 's' ({path}:9)"]


def test_a_target_module_that_cannot_be_found_is_reported_with_the_nearest_names(write_spec, monkeypatch):
    path = write_spec(spec(add_patch("p").replace("spfix.basic", "spfix.basik")))
    expected = (f"source-patch: {path}:5:5: patches[0]: spec 's' patches spfix.basik, which cannot be found (module "
                f"spfix.basik not found on the search path); nearest: spfix.basic "
                f"(SOURCE_PATCH_STRICT=1 makes this an error)")
    with pytest.warns(SourcePatchWarning) as caught:
        activate(path).deactivate()
    assert [str(w.message) for w in caught] == [expected]
    monkeypatch.setenv("SOURCE_PATCH_STRICT", "1")
    with pytest.raises(ActivationError, match="spec 's' patches spfix.basik, which cannot be found"):
        activate(path)
    assert installed_finder() is None


def test_a_count_mismatch_shows_each_matched_line(write_spec):
    path = write_spec(spec(add_patch("p", at="return", match="").replace(', match: ""', ", count: 2")))
    with patched(path), pytest.raises(AnchorError) as err:
        importlib.import_module("spfix.basic")
    assert str(err.value).splitlines()[-2:] == [
        "  patch 'p' (" + str(path) + ":5), edit at return (spec line 10): expected 2 matches, found 1 at "
        "line 11 (set count to match, or make the pattern more specific):",
        "      line 11: return total"]


def test_the_report_lists_targets_never_imported(write_spec, tmp_path):
    path = write_spec(spec(add_patch("p")))
    script = tmp_path / "run.py"
    script.write_text("import spfix\n")
    fixtures = str(Path(__file__).parent / "fixtures")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SOURCE_PATCH": str(path), "SOURCE_PATCH_REPORT": "1",
                              "PYTHONPATH": fixtures})
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-2:] == [f"spec s ({path}):", "  p (spfix.basic): not imported"]


def test_old_bundled_names_are_aliases_with_a_deprecation_warning():
    from source_patch.patcher import boot
    from source_patch.patcher.spec import BUNDLED_DIR, bundled_names, resolve

    with pytest.warns(DeprecationWarning, match="'moe_sglang' is now 'routing'"):
        assert resolve("moe_sglang") == BUNDLED_DIR / "routing.yaml"
    with pytest.warns(DeprecationWarning):
        assert resolve(str(BUNDLED_DIR / "trace_sglang.yaml")) == BUNDLED_DIR / "trace.yaml"
    spec_renames = {old: new for (kind, old), new in boot.RENAMED.items() if kind == "spec"}
    assert set(spec_renames.values()) <= set(bundled_names()) and not set(spec_renames) & set(bundled_names())


def test_moe_is_the_routing_spec_by_name_and_by_path_without_a_warning(monkeypatch):
    """The mission's `SOURCE_PATCH=patches/moe.yaml`: a file of its own (a link to
    routing.yaml, so the patches have one source) and a bundled name, neither renamed."""
    from source_patch.patcher import boot
    from source_patch.patcher.spec import BUNDLED_DIR, load, resolve

    assert (BUNDLED_DIR / "moe.yaml").resolve() == BUNDLED_DIR / "routing.yaml"
    monkeypatch.chdir(BUNDLED_DIR.parent)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ref in ("moe", "patches/moe.yaml", str(BUNDLED_DIR / "moe.yaml")):
            assert resolve(ref).resolve() == BUNDLED_DIR / "routing.yaml", ref
            assert boot._resolve(ref) is not None, ref  # the start hook's fast path takes it as it is
            assert load(ref).patches == load("routing").patches, ref


def test_fixture_spec_paths_resolve_next_to_the_test_file(source_patch_import, tmp_path, monkeypatch):
    here = Path(__file__).parent / "sp_fixture_spec.yaml"
    here.write_text(spec(add_patch("near")))
    try:
        monkeypatch.chdir(tmp_path)  # not found relative to the working directory
        copy = source_patch_import("spfix.basic", "sp_fixture_spec.yaml")
        assert applied(copy) == ["near"]
    finally:
        here.unlink()


# --------------------------------------------------------------------------- scoped runtime settings


def test_runtime_settings_scoped_to_a_distribution_apply_once_its_patch_applied(write_spec):
    from source_patch.runtime.core import settings

    path = write_spec(spec(add_patch("p", extra="requires: {pyyaml: '>=5'}")) + """
runtime:
  dump:
    enable: true
  dump[pyyaml]:
    rank_dir: "engine_{rank}"
""")
    with patched(path):
        assert settings.resolve("dump", {})["rank_dir"] == "rank-{rank}"  # nothing applied yet
        importlib.import_module("spfix.basic")
        assert settings.resolve("dump", {})["rank_dir"] == "engine_{rank}"
        assert settings.resolve("dump", {})["enable"] is True


def test_scoped_runtime_settings_need_format_1_1():
    text = spec(add_patch("p"), version="1") + "runtime:\n  dump[sglang]:\n    enable: true\n"
    with pytest.raises(SpecError, match=r"runtime.dump\[sglang\]: runtime settings for one distribution"):
        loads(text, "x.yaml")
