"""The layout stays true, checked on the sources' syntax trees (nothing is imported).

One import graph over patcher/, runtime/, testing/ and integrations/ serves every check.
It holds what Python runs, not only what the top of a file shows: imports inside
functions, `importlib.import_module` / `__import__` with a name built from literals,
`__name__` and `__package__`, relative imports, and the package `__init__` modules an
import runs on its way (`import a.b.c` runs `a` and `a.b`; `from . import x` reads the
package when `x` is not a module).  An import whose name only exists at run time is
declared in DYNAMIC, and a module handing itself to others (`sys.modules[__name__]`) in
HAND_OVERS, so that nothing the graph cannot see goes unsaid.

On that graph: no import cycle (CYCLE_EDGES may allow an edge, with its reason).  The
runtime's capabilities depend on core only, core on no capability, and imports inside
the runtime are relative.  The patcher reaches the runtime only along PATCHER_TO_RUNTIME
(docs/architecture.md's table), the runtime the patcher only along RUNTIME_TO_PATCHER,
and neither imports testing/ or integrations/.  Every check has a self-test that builds a
throw-away tree and shows it failing."""

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parent.parent  # the folder that stands for the package `source_patch`
TOP = "source_patch"
PACKAGES = ("patcher", "runtime", "testing", "integrations")  # source_patch.patches holds no Python
RUNTIME = ROOT / "runtime"
def capabilities(top: Path) -> list:
    """The runtime's capabilities under ``top``: the folders with a manifest.py."""
    return sorted(p.parent.name for p in (top / "runtime").glob("*/manifest.py"))


CAPABILITIES = capabilities(ROOT)
# Rooms of the runtime above the capabilities, read after the fact: they may import any
# capability, and nothing but the CLI imports them (no call-site process loads them).
TOOL_ROOMS = ("verdict",)
ARCHITECTURE = ROOT / "docs" / "architecture.md"
IMPORTERS = ("import_module", "__import__")  # importlib.import_module, import_module, __import__

# Modules whose importlib calls take a name only known at run time: module -> (the
# module-level tables whose string values name the modules it can import, relative to
# its package; why).  The tables' modules become edges of the graph.
DYNAMIC = {
    "patcher": (("_EXPORTS",),
                "the public API loads its submodule on first use (PEP 562), so the start hook's "
                "import of the package imports nothing"),
    "patcher.activation": ((), "import_patched_copy imports the user's target's parent package first"),
    "runtime.facade": (("CORE",), "each __sp__ name loads the module that defines it on its first call: core's "
                                  "from CORE, a capability's from its manifest (MANIFEST_EDGES)"),
    "runtime.core.capability": ((), "reads each runtime/<name>/manifest.py it finds; a manifest imports core's "
                                    "declaration and parsers only (test_manifests_import_core_only)"),
    "runtime.verdict.replay": ((), "`--builder package.module:function` imports the user's model builder"),
}

# Modules that import what the capabilities' manifests name (their `control=` modules and
# `call_sites` keys), each on first use: the graph gets one edge per named module.
MANIFEST_EDGES = ("runtime.facade",)

# Modules that hand themselves over (`sys.modules[__name__]` given to another module,
# which then reads the giver's state: an arrow back up that no import shows).
# Issue 55 (build, item 2) removes both; drop each line with its hand-over.
HAND_OVERS = {
}

# Edges allowed to close an import cycle: (module, module it imports) -> why.
CYCLE_EDGES = {}

# The only arrows from the patcher into the runtime: (patcher module, runtime module),
# each explained in docs/architecture.md ("Arrows out of the patcher").
PATCHER_TO_RUNTIME = {
    ("boot", "core/private"),  # the boot record, read and written as every private file
    ("cache", "core/private"),  # the code cache's private files, written and checked as every file we write
    ("spec", "core/settings"),  # validates a spec's `runtime:` sections against the schemas
    ("finder", "facade"),  # the __sp__ handle resolves each name there, on first use
    ("finder", "core/control"),  # which settings change results (a skipped patch then fails closed)
    ("matrix", "core/bounded"),  # size-limited reads of wheels and their members
    ("cli", "core/settings_doc"),  # the `settings` command
    ("cli", "core/commands"),  # the grammar every verb shares: exit codes, the error line, the parser, printed commands
    ("cli", "core/private"),  # outputs the user named (`new -o`, `settings --write`), written whole
    ("cli", "verdict/compare"),  # the `compare` command's entry
    ("cli", "verdict/replay"),  # the `replay` command's entry
    ("cli", "dump/reader"),  # the `dumps` command's entry
    ("cli", "trace/client"),  # the `trace` command's entry
    ("cli", "features/stream"),  # the `stream-status` command's entry
    ("cli", "trace/native"),  # the `build-native` command
    ("cli", "sentinels/watch"),  # the `watch` command's entry
}

# The only arrows from the runtime into the patcher: (runtime module, patcher module) ->
# (how, why).  The patcher imports the runtime (spec -> core/settings), so an import the
# other way closes a cycle; a sys.modules lookup runs nothing.  docs/architecture.md
# ("Without an import") says each.
RUNTIME_TO_PATCHER = {
    ("core/settings", "activation"): ("lookup", "the active specs' `runtime:` sections, from the installed "
                                                "finder, where the patcher has been imported"),
    ("core/control", "activation"): ("lookup", "call sites whose patch did not apply, from the installed finder: "
                                               "a setting that changes results is refused for them"),
}


# -- the graph: one scan of the sources, used by every check below

@dataclass(frozen=True)
class Import:
    """One import (or sys.modules lookup) in a module of ours."""
    source: str  # the importing module, named relative to source_patch: "runtime.core.settings"
    where: str  # "runtime/core/settings.py:93"
    name: str | None  # the absolute dotted name; None: known at run time only
    how: str  # "import" (a statement), "importlib" (a call), "lookup" (sys.modules: runs nothing)
    relative: bool
    target: str | None  # the module of ours it names (the longest prefix of `name` that is one)


@dataclass(frozen=True)
class Tree:
    top: Path  # the folder that stands for source_patch
    modules: dict  # module name -> path; a package by its own name for its __init__.py
    imports: tuple  # every Import, in file and line order

    def file(self, module: str) -> str:
        """A module as its path inside its package without '.py' ("core/settings", "__init__")."""
        package = module.split(".")[0]
        return self.modules[module].relative_to(self.top / package).with_suffix("").as_posix()


def _fold(node, module: str, package: str) -> str | None:
    """The string a name expression makes from literals, ``__name__`` and ``__package__``
    (f-strings and + too); None where it depends on anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("__name__", "__package__"):
        return module if node.id == "__name__" else package
    if isinstance(node, ast.FormattedValue) and node.conversion == -1 and node.format_spec is None:
        return _fold(node.value, module, package)
    if isinstance(node, ast.JoinedStr):
        parts = [_fold(value, module, package) for value in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = [_fold(node.left, module, package), _fold(node.right, module, package)]
        return None if None in parts else "".join(parts)
    return None


def _absolute(name: str, level: int, package: str) -> str:
    """``name`` imported ``level`` dots up from ``package`` (level 0: as written)."""
    if not level:
        return name
    base = package.split(".")
    return ".".join(base[: len(base) - level + 1] + ([name] if name else []))


def _is_importer(node) -> bool:
    return (isinstance(node, ast.Name) and node.id in IMPORTERS
            or isinstance(node, ast.Attribute) and node.attr in IMPORTERS)


def _is_sys_modules(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _statements(nodes, package: str):
    """(line, name, how, relative) of each import statement; `from m import x` gives m.x
    (x may be a submodule: the longest prefix that is a module is what it imports)."""
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, "import", False
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}", "import", bool(node.level)


def _imported_name(call: ast.Call, module: str, package: str) -> str | None:
    """The module an importlib call names: ``import_module(name, package)`` resolves a
    leading dot against ``package``; None when the name is not worked out from the source."""
    args = {**dict(zip(("name", "package"), call.args)), **{k.arg: k.value for k in call.keywords}}
    name = _fold(args.get("name"), module, package)
    if name is None or not name.startswith("."):
        return name
    base = _fold(args.get("package"), module, package)
    level = len(name) - len(name.lstrip("."))
    return _absolute(name[level:], level, base) if base else None


def _calls(nodes, module: str, package: str):
    """(line, name, how, relative) of each importlib call (``threading.Thread(target=
    __import__, args=(name,))`` too) and sys.modules lookup; an importer used any other
    way (aliased, passed on) gives name None: it imports what only the run knows."""
    used = set()
    for node in nodes:
        if isinstance(node, ast.Call):
            keywords = {k.arg: k.value for k in node.keywords}
            if _is_importer(node.func):
                used.add(id(node.func))
                yield node.lineno, _imported_name(node, module, package), "importlib", False
            elif _is_importer(keywords.get("target")):
                used.add(id(keywords["target"]))
                args = keywords.get("args")
                first = args.elts[0] if isinstance(args, (ast.Tuple, ast.List)) and args.elts else None
                yield node.lineno, _fold(first, module, package), "importlib", False
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and _is_sys_modules(node.func.value) and node.args:
                yield node.lineno, _fold(node.args[0], module, package), "lookup", False
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_sys_modules(node.value):
            yield node.lineno, _fold(node.slice, module, package), "lookup", False
    for node in nodes:
        if _is_importer(node) and id(node) not in used:
            yield node.lineno, None, "importlib", False


def _module_of(name: str | None, modules: dict) -> str | None:
    """The module of ours that an absolute name lies in (``m.x`` may name something of m's)."""
    if not name or not name.startswith(TOP + "."):
        return None
    name = name[len(TOP) + 1:]
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def manifest_modules(top: Path) -> set:
    """The modules the manifests under ``top`` name (see ``_manifested``)."""
    tree = scan(top)
    return _manifested(top, tree.modules)


def manifest_breaches(top: Path = ROOT) -> list:
    """Imports of a manifest other than core's declaration and parsers: reading every
    manifest (the spec loader does) must import no capability's code."""
    allowed = {"runtime.core", "runtime.core.capability", "runtime.core.settings"}
    return sorted(f"{imp.where.split(':')[0]} imports {imp.target}" for imp in scan(top).imports
                  if imp.source.endswith(".manifest") and imp.target is not None and imp.target not in allowed)


def _manifested(top: Path, modules: dict) -> set:
    """The modules the manifests name (runtime/<cap>/manifest.py): every string given as
    ``control=`` and every key of ``call_sites=``, relative to the capability's package."""
    found = set()
    for path in sorted((top / "runtime").glob("*/manifest.py")):
        package = f"runtime.{path.parent.name}"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = []
            if isinstance(node, ast.keyword) and node.arg == "control" and isinstance(node.value, ast.Constant):
                named.append(node.value.value)
            if isinstance(node, ast.keyword) and node.arg == "call_sites" and isinstance(node.value, ast.Dict):
                named += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            found |= {f"{package}.{n}" if n else package for n in named}
    return {m for m in found if m in modules}


def _tabled(module: str, tables, path: Path, modules: dict) -> set:
    """The modules a DYNAMIC module's tables name: their values' strings, relative to its package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in tables for t in node.targets):
            values = node.value.values if isinstance(node.value, ast.Dict) else [node.value]
            found |= {f"{package}.{c.value}" for v in values for c in ast.walk(v)
                      if isinstance(c, ast.Constant) and f"{package}.{c.value}" in modules}
    return found


@functools.lru_cache(maxsize=None)  # once per tree: every check reads the same scan
def scan(top: Path) -> Tree:
    """Every import in the four packages under ``top``, wherever it stands (module level,
    functions, classes, try blocks), with the module of ours it names; a DYNAMIC module's
    tables add one import per module they name."""
    modules = {".".join(p.relative_to(top).with_suffix("").parts).removesuffix(".__init__"): p
               for package in PACKAGES if (top / package).is_dir() for p in sorted((top / package).rglob("*.py"))}
    found = []
    for module, path in modules.items():
        full = f"{TOP}.{module}"
        package = full if path.name == "__init__.py" else full.rpartition(".")[0]
        nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))  # one walk, read twice
        where = path.relative_to(top).as_posix()
        rows = sorted([*_statements(nodes, package), *_calls(nodes, full, package)], key=lambda r: r[0])
        found += [Import(module, f"{where}:{line}", name, how, relative, _module_of(name, modules))
                  for line, name, how, relative in rows]
        if module in DYNAMIC:
            found += [Import(module, f"{where} ({', '.join(DYNAMIC[module][0])})", f"{TOP}.{t}", "importlib", False, t)
                      for t in sorted(_tabled(module, DYNAMIC[module][0], path, modules))]
        if module in MANIFEST_EDGES:
            found += [Import(module, f"{where} (manifests)", f"{TOP}.{t}", "importlib", False, t)
                      for t in sorted(_manifested(top, modules))]
    return Tree(top, modules, tuple(found))


def graph(tree: Tree) -> dict:
    """module -> the modules of ours importing it makes Python run: the one named and the
    packages on its way.  A package holding the importer is already running when the
    importer runs, so it is an edge only where named (`from . import name`, a cycle
    through the package's __init__ when that imports the importer).  Lookups run nothing."""
    edges = {module: set() for module in tree.modules}
    for imp in tree.imports:
        if imp.target is None or imp.how == "lookup":
            continue
        parts = imp.target.split(".")
        for on_the_way in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            named = on_the_way == imp.target
            if on_the_way in tree.modules and on_the_way != imp.source \
                    and (named or not imp.source.startswith(on_the_way + ".")):
                edges[imp.source].add(on_the_way)
    return edges


def import_cycles(top: Path = ROOT, allowed=CYCLE_EDGES) -> list:
    """Cycles in the graph without the ``allowed`` edges, each as 'a -> b -> a' (one per
    edge back into the path being walked: every cyclic knot shows at least once)."""
    edges = graph(scan(top))
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if (node, nxt) in allowed:
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def arrows(top: Path, source: str, target: str) -> dict:
    """(module of ``source``, module of ``target``) -> how it gets there ({"import",
    "importlib", "lookup"}), for every import or lookup from one package into the other."""
    tree, found = scan(top), {}
    for imp in tree.imports:
        if imp.source.split(".")[0] == source and imp.target and imp.target.split(".")[0] == target:
            found.setdefault((tree.file(imp.source), tree.file(imp.target)), set()).add(imp.how)
    return found


def reaching(top: Path, sources, target: str) -> list:
    """'where' of every import from one of ``sources`` into ``target`` (a package)."""
    return [imp.where for imp in scan(top).imports if imp.source.split(".")[0] in sources
            and imp.target and imp.target.split(".")[0] == target]


def cross_imports(top: Path = ROOT) -> list:
    """Imports that break the runtime's rooms: core, or a capability, importing anything
    of the runtime outside core and itself (another capability, the facade, replay, the
    runtime's __init__)."""
    tree = scan(top)
    rooms = {m.split(".")[1] for m, p in tree.modules.items() if m.count(".") == 1 and p.name == "__init__.py"
             and m.startswith("runtime.")}
    bad = []
    for imp in tree.imports:
        here, there = (tree.file(m).split("/")[0] if m and m.split(".")[0] == "runtime" else None
                       for m in (imp.source, imp.target))
        if here in TOOL_ROOMS and there not in TOOL_ROOMS:
            continue  # the verdict reads what the capabilities wrote
        if here in rooms and there is not None and there not in (here, "core"):
            bad.append(f"{imp.where} imports {imp.name}")
    return bad


def tool_room_importers(top: Path = ROOT) -> list:
    """Imports of a tool room (verdict/) from anywhere of ours but itself and the CLI."""
    tree = scan(top)
    return [f"{imp.where} imports {imp.name}" for imp in tree.imports
            if imp.target and imp.target.split(".")[0] == "runtime" and tree.file(imp.target).split("/")[0] in TOOL_ROOMS
            and not (imp.source.split(".")[0] == "runtime" and tree.file(imp.source).split("/")[0] in TOOL_ROOMS)
            and imp.source != "patcher.cli"]


def relative_breaches(top: Path = ROOT) -> list:
    """Import statements inside the runtime naming the runtime absolutely."""
    return [f"{imp.where} {imp.name}" for imp in scan(top).imports if imp.source.split(".")[0] == "runtime"
            and imp.how == "import" and imp.target and imp.target.split(".")[0] == "runtime" and not imp.relative]


def runtime_to_patcher_breaches(top: Path = ROOT, allowed=RUNTIME_TO_PATCHER) -> list:
    """Arrows from the runtime into the patcher that the allow-list lacks, or that go
    further than it allows (an import where it allows a lookup)."""
    return sorted(f"{source} -> {target} ({', '.join(sorted(how))})"
                  for (source, target), how in arrows(top, "runtime", "patcher").items()
                  if (source, target) not in allowed or how != {allowed[source, target][0]})


def undeclared(top: Path = ROOT, dynamic=DYNAMIC, hand_overs=HAND_OVERS) -> list:
    """What the graph cannot follow and nobody declared: importlib calls whose name is known
    at run time only, and modules handing themselves over through sys.modules."""
    tree = scan(top)
    bad = [f"{imp.where} imports a name known at run time only" for imp in tree.imports
           if imp.how == "importlib" and imp.name is None and imp.source not in dynamic]
    return bad + [f"{imp.where} hands its module over (sys.modules[__name__])" for imp in tree.imports
                  if imp.how == "lookup" and imp.target == imp.source and imp.source not in hand_overs]


def _write(top: Path, files: dict) -> Path:
    """A throw-away tree: {relative path: source}."""
    for name, text in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)
    return top


# -- the runtime's rooms

def test_the_layout_has_the_documented_subpackages():
    assert CAPABILITIES == ["dump", "features", "routing", "sentinels", "trace", "weight_sync"]
    architecture = ARCHITECTURE.read_text()
    for sub in ["core", *CAPABILITIES, *TOOL_ROOMS]:
        assert f"`{sub}/`" in architecture, f"docs/architecture.md does not describe runtime/{sub}/"
    assert "`integrations/`" in architecture, "docs/architecture.md does not describe integrations/"


def test_manifests_import_core_only():
    assert CAPABILITIES and manifest_breaches() == []


def test_capabilities_depend_on_core_only():
    bad = cross_imports()
    assert not bad, "a capability may import core only:\n" + "\n".join(bad)


def test_the_check_catches_a_cross_capability_import(tmp_path):
    """The checker itself can fail: trace importing dump (once through importlib) and the
    facade (lazily), and core importing trace."""
    _write(tmp_path, {"runtime/__init__.py": "", "runtime/facade.py": "", "runtime/core/__init__.py": "",
                      "runtime/trace/__init__.py": "", "runtime/dump/__init__.py": "", "runtime/dump/api.py": "",
                      "runtime/trace/api.py": "from ..dump import api\nfrom ..core import tags\nfrom . import hub\n"
                                              "import importlib\nimportlib.import_module('source_patch.runtime.dump')\n"
                                              "def f():\n    from ..facade import trace\n",
                      "runtime/core/tags.py": "import os\nfrom ..trace.api import trace\n"})
    assert cross_imports(tmp_path) == ["runtime/core/tags.py:2 imports source_patch.runtime.trace.api.trace",
                                       "runtime/trace/api.py:1 imports source_patch.runtime.dump.api",
                                       "runtime/trace/api.py:5 imports source_patch.runtime.dump",
                                       "runtime/trace/api.py:7 imports source_patch.runtime.facade.trace"]


def test_nothing_but_the_cli_imports_the_verdict():
    bad = tool_room_importers()
    assert not bad, "runtime/verdict/ is imported by nothing at call-site time:\n" + "\n".join(bad)


def test_the_verdict_check_can_fail(tmp_path):
    _write(tmp_path, {"runtime/__init__.py": "", "runtime/dump/__init__.py": "", "runtime/verdict/__init__.py": "",
                      "runtime/verdict/compare.py": "from ..dump import reader\n", "runtime/dump/reader.py": "",
                      "runtime/dump/api.py": "def f():\n    from ..verdict import compare\n",
                      "patcher/__init__.py": "", "patcher/cli.py": "from ..runtime.verdict import compare\n"})
    assert tool_room_importers(tmp_path) == ["runtime/dump/api.py:2 imports source_patch.runtime.verdict.compare"]
    # the verdict may read the dump; the dump may not import the verdict
    assert cross_imports(tmp_path) == ["runtime/dump/api.py:2 imports source_patch.runtime.verdict.compare"]


def test_imports_inside_the_runtime_are_relative():
    absolute = relative_breaches()
    assert not absolute, "use relative imports inside source_patch.runtime:\n" + "\n".join(absolute)


def test_the_relative_check_can_fail(tmp_path):
    _write(tmp_path, {"runtime/core/__init__.py": "", "runtime/core/tags.py": "",
                      "runtime/dump/api.py": "from ..core import tags\ndef f():\n"
                                             "    from source_patch.runtime.core import tags\n"})
    assert relative_breaches(tmp_path) == ["runtime/dump/api.py:3 source_patch.runtime.core.tags"]


# -- what the patcher and the runtime never import

def test_the_runtime_and_the_patcher_import_no_integration(tmp_path):
    bad = reaching(ROOT, ("runtime", "patcher"), "integrations")
    assert not bad, "the runtime's core stays free of orchestrators:\n" + "\n".join(bad)
    _write(tmp_path, {"integrations/ray.py": "", "runtime/core/x.py": "def f():\n    from source_patch.integrations import ray\n"})
    assert reaching(tmp_path, ("runtime",), "integrations") == ["runtime/core/x.py:2"]  # the check can fail


def test_test_support_stays_out_of_the_import_time_package():
    """testing/ (engine harness, pytest plugin) uses the patcher and the runtime; neither imports it."""
    bad = reaching(ROOT, ("runtime", "patcher"), "testing")
    assert not bad, "the patcher and the runtime never import source_patch.testing:\n" + "\n".join(bad)
    assert "`testing/`" in ARCHITECTURE.read_text()


# -- no import cycle, in the one graph over the four packages

def test_the_packages_have_no_import_cycle():
    """patcher/, runtime/, testing/ and integrations/ as one graph: a cycle may run across them."""
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
    edges = graph(scan(ROOT))
    unused = [edge for edge in CYCLE_EDGES if edge[1] not in edges.get(edge[0], ())]
    assert not unused, f"CYCLE_EDGES no longer in the graph (drop them): {unused}"


def test_the_cycle_check_can_fail(tmp_path):
    """A lazy import inside a function closes a cycle as surely as one at the top."""
    _write(tmp_path, {"runtime/core/__init__.py": "", "runtime/core/a.py": "def f():\n    from . import b\n",
                      "runtime/core/b.py": "from .a import f\n"})
    assert import_cycles(tmp_path) == ["runtime.core.a -> runtime.core.b -> runtime.core.a"]


def test_the_patcher_cycle_check_can_fail(tmp_path):
    """The same in the patcher, the lazy import on the far side of the cycle."""
    _write(tmp_path, {"patcher/__init__.py": "", "patcher/boot.py": "import os\n",
                      "patcher/startup.py": "from . import boot\n\ndef run():\n    from .activation import go\n",
                      "patcher/activation.py": "from .boot import ENV\n\ndef go():\n    from . import startup\n"})
    assert import_cycles(tmp_path) == ["patcher.activation -> patcher.startup -> patcher.activation"]


def test_the_cycle_check_sees_package_inits(tmp_path):
    """A package's __init__ runs on the way to its modules, and `from . import name` reads
    it: two cycles through an __init__ that no module-to-module edge shows."""
    _write(tmp_path, {
        "runtime/__init__.py": "",
        "runtime/trace/__init__.py": "from .api import trace\nLIMIT = 3\n",
        "runtime/trace/api.py": "from . import LIMIT\n\ndef trace():\n    pass\n",  # reads the __init__
        "runtime/core/__init__.py": "", "runtime/core/tags.py": "import source_patch.runtime.dump.files\n",
        "runtime/dump/__init__.py": "from ..core import tags\n", "runtime/dump/files.py": ""})
    assert import_cycles(tmp_path) == ["runtime.core.tags -> runtime.dump -> runtime.core.tags",
                                       "runtime.trace -> runtime.trace.api -> runtime.trace"]
    assert import_cycles(tmp_path, allowed={("runtime.trace.api", "runtime.trace"): "why",
                                            ("runtime.dump", "runtime.core.tags"): "why"}) == []


def test_the_cycle_check_sees_importlib(tmp_path):
    """importlib.import_module and __import__ with a name built from literals, __name__ or
    __package__ (relative with package=, or in a thread's target) are edges like any import."""
    _write(tmp_path, {
        "runtime/__init__.py": "", "runtime/core/__init__.py": "",
        "runtime/core/a.py": "import importlib\n\ndef f():\n    importlib.import_module('source_patch.runtime.core.b')\n",
        "runtime/core/b.py": "from importlib import import_module\nimport_module('.c', package=__package__)\n",
        "runtime/core/c.py": "import threading\n"
                             "threading.Thread(target=__import__, args=(f'{__package__}.a',)).start()\n"})
    assert import_cycles(tmp_path) == ["runtime.core.a -> runtime.core.b -> runtime.core.c -> runtime.core.a"]


def test_a_cycle_may_run_across_the_packages(tmp_path):
    """The issue's runtime -> patcher cycle: core/settings -> patcher.activation -> spec ->
    core/settings, lazy on both sides, seen because the four packages are one graph."""
    _write(tmp_path, {
        "runtime/__init__.py": "", "runtime/core/__init__.py": "",
        "runtime/core/settings.py": "def finder():\n    from ...patcher import activation\n",
        "patcher/__init__.py": "", "patcher/activation.py": "from . import spec\n",
        "patcher/spec.py": "def check():\n    from source_patch.runtime.core import settings\n"})
    assert import_cycles(tmp_path) == ["patcher.activation -> patcher.spec -> runtime.core.settings -> "
                                       "patcher.activation"]


# -- arrows between the patcher and the runtime

def test_the_patcher_reaches_the_runtime_only_along_documented_arrows():
    found = set(arrows(ROOT, "patcher", "runtime"))
    assert found <= PATCHER_TO_RUNTIME, f"undocumented patcher -> runtime imports: {found - PATCHER_TO_RUNTIME}"
    assert found == PATCHER_TO_RUNTIME, f"allowed arrows no longer used (drop them): {PATCHER_TO_RUNTIME - found}"
    architecture = ARCHITECTURE.read_text()
    for source, target in sorted(PATCHER_TO_RUNTIME):
        assert f"| `{source}.py` | `runtime/{target}.py` |" in architecture, (source, target)


def test_the_arrow_check_can_fail(tmp_path):
    _write(tmp_path, {
        "patcher/cli.py": "from ..runtime.dump import compare\n\ndef f():\n"
                          "    from source_patch.runtime.core.settings import check\n"
                          "    from source_patch.runtime import facade\n",
        **{f"runtime/{m}.py": "" for m in ("__init__", "facade", "core/__init__", "core/settings",
                                            "dump/__init__", "dump/compare")}})
    assert set(arrows(tmp_path, "patcher", "runtime")) == {
        ("cli", "dump/compare"), ("cli", "core/settings"), ("cli", "facade")}


def test_the_runtime_reaches_the_patcher_only_along_declared_arrows():
    bad = runtime_to_patcher_breaches()
    assert not bad, "undeclared runtime -> patcher arrows (RUNTIME_TO_PATCHER):\n" + "\n".join(bad)
    found = arrows(ROOT, "runtime", "patcher")
    assert set(found) == set(RUNTIME_TO_PATCHER), f"declared arrows no longer used (drop them): " \
                                                  f"{set(RUNTIME_TO_PATCHER) - set(found)}"
    architecture = ARCHITECTURE.read_text()
    for source, target in RUNTIME_TO_PATCHER:
        assert f"`runtime/{source}.py`" in architecture and f"source_patch.patcher.{target}" in architecture


def test_the_runtime_to_patcher_check_can_fail(tmp_path):
    """An import the allow-list lacks, and an import where it allows only a lookup."""
    _write(tmp_path, {
        "runtime/__init__.py": "", "runtime/core/__init__.py": "", "patcher/__init__.py": "",
        "patcher/activation.py": "", "patcher/spec.py": "",
        "runtime/core/settings.py": "import sys\nsys.modules.get('source_patch.patcher.activation')\n"
                                    "def f():\n    from ...patcher import activation\n",
        "runtime/core/events.py": "import sys\nspec = sys.modules['source_patch.patcher.spec']\n"})
    assert runtime_to_patcher_breaches(tmp_path, {}) == ["core/events -> spec (lookup)",
                                                        "core/settings -> activation (import, lookup)"]
    assert runtime_to_patcher_breaches(tmp_path) == ["core/events -> spec (lookup)",
                                                    "core/settings -> activation (import, lookup)"]
    declared = _write(tmp_path / "declared", {"runtime/core/settings.py": "import sys\n"
                                              "sys.modules.get('source_patch.patcher.activation')\n",
                                              "patcher/activation.py": ""})
    assert runtime_to_patcher_breaches(declared) == []


# -- what the graph cannot follow is declared

def test_what_the_graph_cannot_follow_is_declared():
    bad = undeclared()
    assert not bad, "declare these in DYNAMIC or HAND_OVERS, with why:\n" + "\n".join(bad)
    tree = scan(ROOT)
    dynamic = {imp.source for imp in tree.imports if imp.how == "importlib" and imp.name is None}
    handing = {imp.source for imp in tree.imports if imp.how == "lookup" and imp.target == imp.source}
    assert set(DYNAMIC) == dynamic, f"DYNAMIC entries with no run-time import (drop them): {set(DYNAMIC) - dynamic}"
    assert set(HAND_OVERS) == handing, f"HAND_OVERS with no hand-over (drop them): {set(HAND_OVERS) - handing}"
    empty = [(m, t) for m, (tables, _) in DYNAMIC.items() for t in tables
             if not _tabled(m, (t,), tree.modules[m], tree.modules)]
    assert not empty, f"DYNAMIC tables that name no module (gone or renamed: their edges are lost): {empty}"
    edges = graph(tree)
    assert {"runtime.dump.api", "runtime.trace.api", "runtime.core.events"} <= edges["runtime.facade"]
    assert {"patcher.activation", "patcher.spec", "patcher.errors"} <= edges["patcher"]


def test_the_declaration_check_can_fail(tmp_path):
    _write(tmp_path, {
        "runtime/__init__.py": "", "runtime/core/__init__.py": "",
        "runtime/core/loader.py": "import importlib\n\ndef load(name):\n    return importlib.import_module(name)\n",
        "runtime/core/pool.py": "import concurrent.futures as f\n"
                                "f.ThreadPoolExecutor().submit(__import__, 'source_patch.runtime.core.loader')\n",
        "runtime/core/state.py": "import sys\nfrom . import loader\nloader.owner = sys.modules[__name__]\n"})
    assert undeclared(tmp_path) == ["runtime/core/loader.py:4 imports a name known at run time only",
                                    "runtime/core/pool.py:2 imports a name known at run time only",
                                    "runtime/core/state.py:3 hands its module over (sys.modules[__name__])"]
    assert undeclared(tmp_path, {"runtime.core.loader": ((), "why"), "runtime.core.pool": ((), "why")},
                      {"runtime.core.state": "why"}) == []

# -- the capability contract (runtime/core/capability.py), on the imported modules

CONTRACT_CHECK = r"""
import importlib, json, sys
from source_patch.runtime.core import capability
found = {}
for component, module in capability.controls().items():
    mod = importlib.import_module(f"source_patch.runtime.{module}")
    problems = capability.violations(mod)
    if not problems:
        assert mod.SETTINGS == component, (module, mod.SETTINGS)
        config = mod.configure()
        problems += [f"configure() returned {type(config).__name__}"] * (not isinstance(config, dict))
        for call in ("state", "reset"):
            problems += [f"{call}(): {p}" for p in capability.state_violations(getattr(mod, call)())]
        problems += ["enabled() is not a bool"] * (not isinstance(mod.enabled(), bool))
        problems += ["flush() did not return a bool"] * (not isinstance(mod.flush(timeout=1.0), bool))
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
    assert sorted(problems) == sorted(capability.controls().values())
    assert {module: p for module, p in problems.items() if p} == {}


def test_the_contract_check_can_fail():
    import types

    from source_patch.runtime.core import capability

    bad = types.SimpleNamespace(SETTINGS="x", enabled=lambda: True, configure=lambda mode: {},
                                configure_from_settings=lambda: {}, state=lambda: {}, close=lambda: True)
    assert capability.violations(bad) == ["reset(): missing", "configure(): must be callable without arguments "
                                          "(requires mode)", "configure(): must take **changes",
                                          "flush(): missing", "close(): must take timeout="]
    assert capability.state_violations({"enabled": 1, "counters": {"a": "x"}}) == [
        "state: no 'config'", "state: no 'last_error'", "state: 'counters' must map names to numbers",
        "state: 'enabled' must be a bool"]
