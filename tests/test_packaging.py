"""The wheel users install carries the start hook, the bundled specs and the entry points."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.slow
def test_wheel_contents(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(REPO)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = tmp_path.glob("source_patch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        hook = z.read("source_patch.pth").decode()
        moe, routing = z.read("source_patch/patches/moe.yaml"), z.read("source_patch/patches/routing.yaml")
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert hook == (REPO / "patcher" / "source_patch.pth").read_text()
    assert hook.startswith("import os;")  # site only executes .pth lines that start with import
    assert {"source_patch/patcher/cli.py", "source_patch/patches/megatron_topk.yaml"} <= names
    assert moe == routing  # patches/moe.yaml, a link in the tree, ships as the routing spec's text
    # Every runtime file in the tree (each capability subpackage, the trace view) ships.
    runtime = {f"source_patch/runtime/{p.relative_to(REPO / 'runtime').as_posix()}"
               for p in (REPO / "runtime").rglob("*") if p.suffix in (".py", ".html", ".js", ".css")}
    assert "source_patch/runtime/core/events.py" in runtime and runtime <= names, sorted(runtime - names)
    assert not any(n.startswith(("patcher/", "runtime/", "tests/")) for n in names)  # no generic top-level names
    assert "source-patch = source_patch.patcher.cli:main" in entry_points
    assert "source_patch = source_patch.testing.pytest_plugin" in entry_points
    assert "source_patch/testing/sglang.py" in names


def test_the_hook_costs_one_lookup_when_unset():
    """With SOURCE_PATCH unset, the hook line imports nothing."""
    line = (REPO / "patcher" / "source_patch.pth").read_text().strip()
    code = (f"import sys, os; os.environ.pop('SOURCE_PATCH', None); before = set(sys.modules); "
            f"exec({line!r}); print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
