"""The layout stays true.  The runtime: capabilities depend on core only, never on each
other; core depends on no capability; imports inside the package are relative.  Both
packages: no import cycle, lazy imports inside functions included.  The patcher imports
from the runtime only along the arrows docs/architecture.md lists.  Checked on the
sources' syntax trees (nothing is imported)."""

import ast
from pathlib import Path

RUNTIME = Path(__file__).parent.parent / "runtime"
PACKAGE = "source_patch.runtime"
PATCHER = Path(__file__).parent.parent / "patcher"
PATCHER_PACKAGE = "source_patch.patcher"
CAPABILITIES = sorted(p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file() and p.name != "core")


def _imports(path: Path, root: Path = RUNTIME, package: str = PACKAGE, members: bool = False):
    """(line, absolute dotted name, relative?) of every import in ``path``; ``from m import
    x`` gives ``m``, or with ``members`` ``m.x`` (a module, or something of ``m``'s)."""
    module = ".".join((package, *path.relative_to(root).with_suffix("").parts))
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
            names = [name] if node.module and not members else [
                f"{name}.{a.name}" if a.name != "*" else name for a in node.names]
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
    assert CAPABILITIES == ["dump", "features", "routing", "trace", "weight_sync"]
    architecture = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    for sub in ["core", *CAPABILITIES]:
        assert f"`{sub}/`" in architecture, f"docs/architecture.md does not describe runtime/{sub}/"
    assert "`integrations/`" in architecture, "docs/architecture.md does not describe integrations/"


def imports_of(package: str, *roots: Path) -> list:
    """Imports of source_patch.<package> anywhere under ``roots``, lazy ones included."""
    names = (f"source_patch.{package}", package)
    return [f"{path.relative_to(root.parent)}:{node.lineno}" for root in roots for path in _sources(root)
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and any(n == m or n.startswith(m + ".") for m in names
                    for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]))]


def test_the_runtime_and_the_patcher_import_no_integration(tmp_path):
    bad = imports_of("integrations", RUNTIME, RUNTIME.parent / "patcher")
    assert not bad, "the runtime's core stays free of orchestrators:\n" + "\n".join(bad)
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text("def f():\n    from source_patch.integrations import ray\n")
    assert imports_of("integrations", tmp_path) == [f"{tmp_path.name}/core/x.py:2"]  # the check can fail


def test_test_support_stays_out_of_the_import_time_package():
    """testing/ (engine harness, pytest plugin) uses the patcher and the runtime; neither imports it."""
    bad = imports_of("testing", RUNTIME, RUNTIME.parent / "patcher")
    assert not bad, "the patcher and the runtime never import source_patch.testing:\n" + "\n".join(bad)
    assert "`testing/`" in (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()


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


def _modules(root: Path) -> dict:
    """Every module under ``root`` by its name relative to the package: path."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in _sources(root)}


def _module_of(name: str, modules: dict, package: str) -> str | None:
    """The module of ``modules`` that an imported name lies in, relative to ``package``
    (the longest prefix that is one: ``m.x`` may name something of ``m``'s)."""
    if not name.startswith(package + "."):
        return None
    name = name[len(package) + 1:]
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_cycles(root: Path = RUNTIME, package: str = PACKAGE) -> list:
    """Cycles among the modules under ``root`` (lazy imports inside functions included):
    each as 'a -> b -> a', module names relative to ``package``."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, target, _ in _imports(path, root, package, members=True):
            target = _module_of(target, modules, package)
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


def test_the_patcher_has_no_import_cycle():
    cycles = import_cycles(PATCHER, PATCHER_PACKAGE)
    assert not cycles, "import cycles in the patcher:\n" + "\n".join(cycles)


def test_the_patcher_cycle_check_can_fail(tmp_path):
    """A lazy import inside a function closes a cycle as surely as one at the top."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "boot.py").write_text("import os\n")
    (tmp_path / "startup.py").write_text("from . import boot\n\ndef run():\n    from .activation import go\n")
    (tmp_path / "activation.py").write_text("from .boot import ENV\n\ndef go():\n    from . import startup\n")
    assert import_cycles(tmp_path, PATCHER_PACKAGE) == ["activation -> startup -> activation"]


# The only arrows from the patcher into the runtime: (patcher module, runtime module),
# each explained in docs/architecture.md ("Arrows out of the patcher").
PATCHER_TO_RUNTIME = {
    ("boot", "core/private"),  # the code cache's private files, written and checked as every file we write
    ("spec", "core/settings"),  # validates a spec's `runtime:` sections against the schemas
    ("finder", "facade"),  # the __sp__ handle resolves each name there, on first use
    ("matrix", "core/bounded"),  # size-limited reads of wheels and their members
    ("cli", "core/settings_doc"),  # the `settings` command
    ("cli", "core/private"),  # outputs the user named (`new -o`, `settings --write`), written whole
    ("cli", "dump/compare"),  # the `compare` command's entry
    ("cli", "replay"),  # the `replay` command's entry
    ("cli", "dump/reader"),  # the `dumps` command's entry
    ("cli", "trace/client"),  # the `trace` command's entry
    ("cli", "features/stream"),  # the `stream-status` command's entry
    ("cli", "trace/native"),  # the `build-native` command
}


def runtime_arrows(root: Path = PATCHER, runtime: Path = RUNTIME) -> set:
    """(patcher module, runtime module) of every import of the runtime in ``root``,
    lazy imports included; module names as paths without '.py'."""
    modules, arrows = _modules(runtime), set()
    for path in _sources(root):
        here = path.relative_to(root).with_suffix("").as_posix()
        for _, name, _ in _imports(path, root, PATCHER_PACKAGE, members=True):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = modules.get(_module_of(name, modules, PACKAGE), runtime / "__init__.py")
                arrows.add((here, target.relative_to(runtime).with_suffix("").as_posix()))
    return arrows


def test_the_patcher_reaches_the_runtime_only_along_documented_arrows():
    arrows = runtime_arrows()
    assert arrows <= PATCHER_TO_RUNTIME, f"undocumented patcher -> runtime imports: {arrows - PATCHER_TO_RUNTIME}"
    assert arrows == PATCHER_TO_RUNTIME, f"allowed arrows no longer used (drop them): {PATCHER_TO_RUNTIME - arrows}"
    architecture = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    for source, target in sorted(PATCHER_TO_RUNTIME):
        assert f"| `{source}.py` | `runtime/{target}.py` |" in architecture, (source, target)


def test_the_arrow_check_can_fail(tmp_path):
    (tmp_path / "patcher").mkdir()
    (tmp_path / "patcher" / "cli.py").write_text(
        "from ..runtime.dump import compare\n\ndef f():\n    from source_patch.runtime.core.settings import check\n"
        "    from source_patch.runtime import facade\n")
    (tmp_path / "runtime" / "core").mkdir(parents=True)
    (tmp_path / "runtime" / "dump").mkdir()
    for module in ("__init__", "facade", "core/__init__", "core/settings", "dump/__init__", "dump/compare"):
        (tmp_path / "runtime" / f"{module}.py").write_text("")
    assert runtime_arrows(tmp_path / "patcher", tmp_path / "runtime") == {
        ("cli", "dump/compare"), ("cli", "core/settings"), ("cli", "facade")}


# -- the capability contract (runtime/core/capability.py), on the imported modules

CONTRACT_CHECK = r"""
import importlib, json, sys
from source_patch.runtime.core import capability
found = {}
for component, module in capability.CONTROL.items():
    mod = importlib.import_module(f"source_patch.runtime.{module}")
    problems = capability.violations(mod)
    if not problems:
        assert mod.SETTINGS == component, (module, mod.SETTINGS)
        config = mod.configure()
        problems += [f"configure() returned {type(config).__name__}"] * (not isinstance(config, dict))
        for call in ("state", "reset"):
            problems += [f"{call}(): {p}" for p in capability.state_violations(getattr(mod, call)())]
        problems += ["enabled() is not a bool"] * (not isinstance(mod.enabled(), bool))
        problems += ["close() did not return a bool"] * (not isinstance(mod.close(timeout=1.0), bool))
    found[module] = problems
print(json.dumps(found))
"""


def _contract_problems(env=None) -> dict:
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CONTRACT_CHECK], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_each_capability_implements_the_contract():
    from source_patch.runtime.core import capability

    problems = _contract_problems()
    assert sorted(problems) == sorted(capability.CONTROL.values())
    assert {module: p for module, p in problems.items() if p} == {}
    assert {c for c in capability.CONTROL} <= set(__import__("source_patch.runtime.core.settings",
                                                             fromlist=["SCHEMAS"]).SCHEMAS)


def test_the_contract_check_can_fail():
    import types

    from source_patch.runtime.core import capability

    bad = types.SimpleNamespace(SETTINGS="x", enabled=lambda: True, configure=lambda mode: {},
                                configure_from_settings=lambda: {}, state=lambda: {}, close=lambda: True)
    assert capability.violations(bad) == ["reset(): missing", "configure(): must be callable without arguments "
                                          "(requires mode)", "configure(): must take **changes",
                                          "close(): must take timeout="]
    assert capability.state_violations({"enabled": 1, "counters": {"a": "x"}}) == [
        "state: no 'config'", "state: no 'last_error'", "state: 'counters' must map names to numbers",
        "state: 'enabled' must be a bool"]
