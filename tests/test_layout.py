"""The runtime's layout stays true: capabilities depend on core only, never on each
other; core depends on no capability; imports inside the package are relative.
Checked on the sources' syntax trees (nothing is imported)."""

import ast
from pathlib import Path

RUNTIME = Path(__file__).parent.parent / "runtime"
PACKAGE = "source_patch.runtime"
CAPABILITIES = sorted(p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file() and p.name != "core")


def _imports(path: Path, root: Path = RUNTIME):
    """(line, absolute dotted name, relative?) of every import in ``path``."""
    module = ".".join((PACKAGE, *path.relative_to(root).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            for each in names:
                yield node.lineno, each, bool(node.level)


def _owner(name: str) -> str | None:
    """The runtime subpackage that ``name`` lies in (None outside the runtime)."""
    if not name.startswith(PACKAGE + "."):
        return None
    return name[len(PACKAGE) + 1:].split(".")[0]


def _sources(root: Path = RUNTIME):
    return sorted(root.rglob("*.py"))


def cross_imports(root: Path = RUNTIME) -> list:
    """Imports that break the layout: a capability importing another capability, or
    core importing a capability."""
    capabilities = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} - {"core"}
    bad = []
    for path in _sources(root):
        parts = path.relative_to(root).parts
        here = parts[0] if len(parts) > 1 else None  # None: the facade and the package root
        for line, name, _ in _imports(path, root):
            owner = _owner(name)
            if here is None or owner is None or owner == here:
                continue
            if owner in capabilities or here == "core":
                bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


def test_the_layout_has_the_documented_subpackages():
    assert CAPABILITIES == ["dump", "features", "routing", "trace", "weights"]
    architecture = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    for sub in ["core", *CAPABILITIES]:
        assert f"`{sub}/`" in architecture, f"docs/architecture.md does not describe runtime/{sub}/"


def test_capabilities_depend_on_core_only():
    bad = cross_imports()
    assert not bad, "a capability may import core only:\n" + "\n".join(bad)


def test_imports_inside_the_runtime_are_relative():
    absolute = [f"{path.relative_to(RUNTIME)}:{line} {name}" for path in _sources()
                for line, name, relative in _imports(path)
                if _owner(name) is not None and not relative]
    assert not absolute, "use relative imports inside source_patch.runtime:\n" + "\n".join(absolute)


def test_the_check_catches_a_cross_capability_import(tmp_path):
    """The checker itself can fail: trace importing dump, and core importing trace."""
    for sub in ("core", "trace", "dump"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "trace" / "api.py").write_text("from ..dump import api\nfrom ..core import tags\nfrom . import hub\n")
    (tmp_path / "core" / "tags.py").write_text("import os\nfrom ..trace.api import trace\n")
    assert cross_imports(tmp_path) == ["core/tags.py:2 imports source_patch.runtime.trace.api",
                                       "trace/api.py:1 imports source_patch.runtime.dump"]
