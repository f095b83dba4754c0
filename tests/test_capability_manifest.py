"""A capability declares itself once (runtime/<name>/manifest.py) and appears everywhere
from there: the settings schemas, the control table, the facade, `source-patch settings`,
docs/settings.md, the layout test, the spec loader.  One name per capability: its
folder, its settings components, its call sites, its specs, its docs page, its tests."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from source_patch.runtime.core import capability

ROOT = Path(__file__).parent.parent
DECLARED = capability.capabilities()

TOY = {
    "toy/__init__.py": '"""A throw-away capability."""\n',
    "toy/manifest.py": textwrap.dedent('''\
        """toy: a capability added by a test."""
        from ..core.capability import Capability, Component
        from ..core.settings import Setting, integer

        CAPABILITY = Capability(
            name="toy", summary="a capability added by a test",
            components={"toy": Component(control="control", settings={
                "level": Setting(1, integer(low=0), "how loud"),
            })},
            call_sites={"control": ("toy_ping",)},
            specs=(), page="toy.md",
        )
        '''),
    "toy/control.py": textwrap.dedent('''\
        from ..core import settings

        SETTINGS = "toy"
        _config = {}


        def toy_ping():
            return "pong", _config.get("level")


        def enabled():
            return True


        def configure(**changes):
            _config.update(settings.check_all(SETTINGS, changes))
            return dict(_config)


        def configure_from_settings():
            _config.update(settings.resolve(SETTINGS))
            return dict(_config)


        def state():
            return {"enabled": True, "config": dict(_config), "counters": {}, "last_error": None}


        def reset():
            return state()


        def flush(timeout=None):
            return True


        def close(timeout=None):
            return True
        '''),
}

# Run in a child: the toy joins the runtime package's path before anything reads the manifests.
PROBE = r"""
import io, json, sys, contextlib
import source_patch.runtime as runtime
runtime.__path__.append(sys.argv[1])
from source_patch.runtime.core import capability, settings, settings_doc
from source_patch.runtime import facade
from source_patch.patcher import cli, errors, spec
out = {}
control = __import__("source_patch.runtime.toy.control", fromlist=["x"])
out["schemas"] = sorted(settings.SCHEMAS)
out["resolved"] = control.configure_from_settings()
out["controls"] = capability.controls().get("toy")
out["ping"] = list(facade.toy_ping())
out["violations"] = capability.violations(control)
out["doc"] = "## `toy`" in settings_doc.markdown()
with contextlib.redirect_stdout(io.StringIO()) as printed:
    cli.main(["settings"])
out["cli"] = "SOURCE_PATCH_TOY_LEVEL" in printed.getvalue()
text = ("source_patch: 1\nname: toy\npatches:\n  - id: p\n    module: json\n    target: dumps\n"
        "    edits:\n      - at: entry\n        code: pass\nruntime:\n  toy:\n    {}\n")
out["spec"] = spec.loads(text.format("level: 3"), "ok.yaml").runtime
try:
    spec.loads(text.format("lvel: 3"), "bad.yaml")
except errors.SpecError as exc:
    out["refused"] = str(exc)
print(json.dumps(out))
"""


def _toy(tmp_path: Path) -> Path:
    for name, text in TOY.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_new_capability_is_one_folder_and_its_manifest(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SOURCE_PATCH_TOY_LEVEL": "7", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", PROBE, str(_toy(tmp_path))], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert "toy" in out["schemas"] and out["resolved"] == {"level": 7}  # the environment reaches it
    assert out["controls"] == "toy.control" and out["violations"] == []
    assert out["ping"] == ["pong", 7]  # the facade found its call site
    assert out["doc"] and out["cli"]  # docs/settings.md and `source-patch settings`
    assert out["spec"] == {"toy": {"level": 3}}  # a spec's runtime: section is validated against it
    assert "unknown key 'lvel'" in out["refused"] and "level" in out["refused"] and "bad.yaml:12" in out["refused"]


def test_the_layout_test_finds_a_new_capability(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import test_layout
    finally:
        sys.path.pop(0)
    top = tmp_path / "tree"
    _toy(top / "runtime")
    (top / "runtime" / "__init__.py").write_text("")
    (top / "runtime" / "core").mkdir()
    for name in ("__init__.py", "capability.py", "settings.py"):
        (top / "runtime" / "core" / name).write_text("")
    (top / "runtime" / "toy" / "control.py").write_text("from ...runtime.dump import api\n")  # a breach
    (top / "runtime" / "dump").mkdir()
    (top / "runtime" / "dump" / "__init__.py").write_text("")
    (top / "runtime" / "dump" / "api.py").write_text("")
    assert test_layout.capabilities(top) == ["toy"]  # dump/ has no manifest: no capability
    assert "runtime.toy.control" in test_layout.manifest_modules(top)
    assert test_layout.manifest_breaches(top) == []
    bad = tmp_path / "bad"  # another tree: the layout test reads each tree once
    shutil.copytree(top, bad)
    (bad / "runtime" / "toy" / "manifest.py").write_text("from ..dump import api\n" + TOY["toy/manifest.py"])
    assert test_layout.manifest_breaches(bad) == ["runtime/toy/manifest.py imports runtime.dump.api"]


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_one_name_per_capability(name):
    cap = DECLARED[name]
    assert all(component == name or component.startswith(name + "_") for component in cap.components)
    names = [n for module, group in cap.call_sites.items() for n in group]
    assert names and all(n == name or n.startswith(name + "_") for n in names), names
    assert cap.page and (ROOT / "docs" / cap.page).is_file() and cap.page == f"{name}.md", cap.page
    assert f"({cap.page})" in (ROOT / "docs" / "index.md").read_text(), "docs/index.md does not link it"
    for spec in cap.specs:
        assert (ROOT / "patches" / spec).is_file(), spec
    assert list(ROOT.glob(f"tests/test_{name}*.py")), f"no tests/test_{name}_*.py"


def test_no_test_file_spells_a_capability_another_way():
    import difflib

    prefixes = {p.stem.split("_")[1] for p in ROOT.glob("tests/test_*.py")}
    names = {n.split("_")[0] for n in DECLARED}
    near = {p: difflib.get_close_matches(p, names, n=1, cutoff=0.8) for p in prefixes - names}
    assert {p: m for p, m in near.items() if m} == {}


def test_the_manifests_are_read_once_and_import_no_capability_code():
    code = ("import sys; from source_patch.runtime.core import settings; settings.SCHEMAS; "
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('source_patch.runtime.'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout)
    allowed = {"source_patch.runtime.core", "source_patch.runtime.core.settings",
               "source_patch.runtime.core.capability"}
    for name in DECLARED:
        allowed |= {f"source_patch.runtime.{name}", f"source_patch.runtime.{name}.manifest"}
    assert set(loaded) == allowed
