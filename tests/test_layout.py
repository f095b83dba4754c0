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


def import_cycles(root: Path = RUNTIME, package: str = PACKAGE) -> list:
    """Cycles among the modules under ``root`` (lazy imports inside functions included):
    each as 'a -> b -> a', module names relative to ``package``."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in _sources(root)}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, target, _ in _imports(path, root):
            if target.startswith(package + "."):
                target = target[len(package) + 1:]
                # `from . import x` names a module or a symbol: take the longest module prefix
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + ".") and modules[target].name != "__init__.py":
                    edges.add(target)
        graph[name] = edges
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_runtime_has_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles in the runtime:\n" + "\n".join(cycles)


def test_the_cycle_check_can_fail(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "core" / "b.py").write_text("from .a import f\n")
    assert import_cycles(tmp_path) == ["core.a -> core.b -> core.a"]
