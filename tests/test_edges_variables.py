"""Issue 56, item 2: a SOURCE_PATCH_* variable that is no source-patch variable (a typo:
it would do nothing, silently) is said once at activation, with the nearest known name,
and refused under SOURCE_PATCH_STRICT=1.  Every variable the sources read is known
(patcher/boot.py's VARIABLES and OTHER_VARIABLES, or a runtime setting's), or the
warning would be noise."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from source_patch.patcher import activate, activation
from source_patch.patcher.errors import ActivationError, SourcePatchWarning

ROOT = Path(__file__).parent.parent
SPEC = ("source_patch: 1\nname: v\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
        "    edits:\n      - {at: entry, code: pass}\n")
SAID = "SOURCE_PATCH_DUMP_DIRR is not a source-patch variable (did you mean SOURCE_PATCH_DUMP_DIR?)"


def run(spec, code="import spfix.basic; print('ran')", **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_") or k == "SOURCE_PATCH_CACHE"}
    environ.update(SOURCE_PATCH=str(spec), **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


@pytest.fixture
def fresh(monkeypatch):
    """Each test starts with nothing said yet in this process."""
    monkeypatch.setattr(activation, "_unknown_said", set())
    for name in [n for n in os.environ if n.startswith("SOURCE_PATCH_") and n != "SOURCE_PATCH_CACHE"]:
        monkeypatch.delenv(name)


def test_a_misspelled_setting_is_said_once_at_start_up_with_the_nearest_name(write_spec):
    proc = run(write_spec(SPEC), SOURCE_PATCH_DUMP_DIRR="/x", SOURCE_PATCH_DUMP_ENABLE="0")
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "SOURCE_PATCH_DUMP_DIRR" in line]
    assert len(said) == 1 and SAID in said[0] and "SOURCE_PATCH_STRICT=1 makes this an error" in said[0], proc.stderr
    assert "SOURCE_PATCH_DUMP_ENABLE" not in proc.stderr  # a real setting is not said


def test_under_strict_a_misspelled_variable_stops_the_run(write_spec):
    proc = run(write_spec(SPEC), SOURCE_PATCH_DUMP_DIRR="/x", SOURCE_PATCH_STRICT="1")
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert f"source-patch: error: {SAID}" in proc.stderr
    assert "NotActivatedError" in proc.stderr


def test_from_the_api_a_warning_or_under_strict_an_error(write_spec, fresh, monkeypatch):
    spec = write_spec(SPEC)
    monkeypatch.setenv("SOURCE_PATCH_TRACE_PROT", "1")
    with pytest.warns(SourcePatchWarning) as caught:
        activate(spec).deactivate()
        activate(spec).deactivate()  # said once per process
    assert [str(w.message) for w in caught] == [
        "source-patch: SOURCE_PATCH_TRACE_PROT is not a source-patch variable (did you mean "
        "SOURCE_PATCH_TRACE_PORT?); it does nothing (SOURCE_PATCH_STRICT=1 makes this an error)"]
    monkeypatch.setenv("SOURCE_PATCH_STRICT", "1")
    with pytest.raises(ActivationError, match=r"SOURCE_PATCH_TRACE_PROT is not a source-patch variable \(did you "
                                              r"mean SOURCE_PATCH_TRACE_PORT\?\)"):
        activate(spec)


def test_known_variables_are_not_said(write_spec, fresh, monkeypatch, recwarn):
    for name, value in [("SOURCE_PATCH_DUMP_DIR", "/x"), ("SOURCE_PATCH_REPORT", "0"),
                        ("SOURCE_PATCH_REPORT_DIR", str(write_spec(SPEC).parent / "reports")),
                        ("SOURCE_PATCH_DEBUG", "0"), ("SOURCE_PATCH_NATIVE_DIR", "/x"),
                        ("SOURCE_PATCH_WORKDIR", "/x"), ("SOURCE_PATCH_ROUTING_SGLANG_MODE", "off")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SOURCE_PATCH_NOTHING_LIKE_IT", "1")
    activate(write_spec(SPEC)).deactivate()
    said = [str(w.message) for w in recwarn if "not a source-patch variable" in str(w.message)]
    assert said == ["source-patch: SOURCE_PATCH_NOTHING_LIKE_IT is not a source-patch variable (the settings are "
                    "listed in docs/settings.md); it does nothing (SOURCE_PATCH_STRICT=1 makes this an error)"]


# --------------------------------------------------------------------------- the sources' variables

READERS = ("get", "getenv", "pop", "setdefault")  # environ.get("X"), os.getenv("X"), ...
SCANNED = ("patcher", "runtime", "testing", "integrations", "bench", "examples", "tests/e2e")


def read_variables(top: Path, folders=SCANNED) -> dict[str, str]:
    """Every SOURCE_PATCH_* name the Python sources under ``folders`` read from an
    environment (``environ.get("X")``, ``environ["X"]``, ``getenv("X")``), name in a
    module constant (``ENV = "X"``, read through it) or set for a child (a dict key):
    name -> where."""
    found = {}
    for folder in folders:
        for path in sorted((top / folder).rglob("*.py")):
            if path == top / "patcher" / "boot.py":
                continue  # where the known ones are listed: known by definition
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                for value in _named(node):
                    if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                            and value.value.startswith("SOURCE_PATCH_") and value.value[-1] != "_":
                        found.setdefault(value.value, f"{path.relative_to(top)}:{value.lineno}")
    return found


def _named(node):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READERS:
        yield from node.args[:1]
    elif isinstance(node, ast.Subscript):
        yield node.slice
    elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        yield node.value
    elif isinstance(node, ast.Dict):
        yield from (k for k in node.keys if k is not None)


def test_every_variable_the_sources_read_is_known():
    found = read_variables(ROOT)
    assert "SOURCE_PATCH_NATIVE_DIR" in found and "SOURCE_PATCH_UPSTREAM_TESTS" in found  # the scan sees reads
    unknown = activation.unknown_variables(sorted(found))
    assert not unknown, "\n".join(f"{line} (at {found[line.split()[0]]}): add it to patcher/boot.py's "
                                  f"OTHER_VARIABLES, or read a setting" for line in unknown)


def test_the_source_check_can_fail(tmp_path):
    (tmp_path / "patcher").mkdir()
    (tmp_path / "patcher" / "x.py").write_text('import os\nos.environ.get("SOURCE_PATCH_NEW_THING")\n')
    found = read_variables(tmp_path, ("patcher",))
    assert found == {"SOURCE_PATCH_NEW_THING": "patcher/x.py:2"}
    assert activation.unknown_variables(sorted(found)) == [
        "SOURCE_PATCH_NEW_THING is not a source-patch variable (the settings are listed in docs/settings.md)"]


def test_a_renamed_settings_component_still_works_with_one_warning(monkeypatch):
    """sglang_routing became routing_sglang (one name per capability): its old variables and
    spec section still take effect, as the new name, each with a DeprecationWarning."""
    import warnings

    from source_patch.patcher import activation, spec

    text = ("source_patch: 1\nname: old\npatches:\n  - id: p\n    module: json\n    target: dumps\n"
            "    edits:\n      - at: entry\n        code: pass\nruntime:\n  sglang_routing:\n    mode: capture\n")
    env = {"SOURCE_PATCH_SGLANG_ROUTING_MODE": "replay", "SOURCE_PATCH_SGLANG_ROUTING_DIR": "/r",
           "SOURCE_PATCH_ROUTING_SGLANG_DIR": "/new"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert spec.loads(text, "old.yaml").runtime == {"routing_sglang": {"mode": "capture"}}
        assert activation.environment_error(env) is None  # not an unknown variable
    assert env["SOURCE_PATCH_ROUTING_SGLANG_MODE"] == "replay"
    assert env["SOURCE_PATCH_ROUTING_SGLANG_DIR"] == "/new"  # the new name wins where both are set
    said = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert "the settings component 'sglang_routing' is now 'routing_sglang'" in said[0]
    assert any("SOURCE_PATCH_SGLANG_ROUTING_MODE is now SOURCE_PATCH_ROUTING_SGLANG_MODE" in w for w in said)
