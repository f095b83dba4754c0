"""docs/architecture.md's house matches the code, where a statement can be checked.

- the rooms: "has N rooms" counts the rows of the rooms table, and each room is a folder;
- the runtime's subpackages: the table "The runtime, by capability" has one row per
  subpackage of runtime/, and each row names exactly the modules of its subpackage, and
  those of each package nested in it by their path there (`records/file.py` in routing/'s);
- each subpackage's ``__init__.py`` docstring, and each nested package's, names each of
  its modules (and no other), and runtime/__init__.py's names each subpackage;
- the runtime tree names runtime/'s own modules and every subpackage, and the diagram
  ("Direction of the dependencies") every capability;
- "core imports nothing heavy at module level": the core modules that do (a module-level
  import outside the standard library, or of a core module that does) are exactly those
  the page names as the exception.

The code side is read from the files (syntax trees, nothing imported but the facade's
name table).  Each check is a function of the page's text and a source tree that returns
what is wrong; the self-tests at the end show each one failing on a doctored page (and,
for the module lists, on a tree with a module the page does not know).
"""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent  # the folder that stands for the package `source_patch`
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NUMBERS = {word: n for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}


# -- the code side

def subpackages(runtime: Path) -> list:
    """runtime/'s subpackages (folders with an __init__.py), sorted."""
    return sorted(p.name for p in runtime.iterdir() if (p / "__init__.py").is_file())


def nested(package: Path) -> list:
    """The packages inside a package, at any depth, as paths relative to it ("records",
    "a/b"), sorted."""
    return sorted(p.parent.relative_to(package).as_posix() for p in package.rglob("__init__.py")
                  if p.parent != package and "__pycache__" not in p.parts)


def packages(runtime: Path) -> list:
    """runtime/'s subpackages and the packages nested in them ("routing/records"), sorted."""
    return sorted(name for sub in subpackages(runtime) for name in [sub, *(f"{sub}/{rel}" for rel in nested(runtime / sub))])


def modules(package: Path) -> set:
    """What a package holds, as the docs name it: `name.py` for each module but
    __init__.py, `name/` for each subpackage."""
    return ({p.name for p in package.glob("*.py") if p.name != "__init__.py"}
            | {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()})


def unknown(named: set, package: Path) -> set:
    """What a text names that the package does not hold (`name/` may be a folder of
    other files: trace/view/, the browser page)."""
    return {m for m in named - modules(package) if not (m.endswith("/") and (package / m).is_dir())}


def capabilities(runtime: Path) -> list:
    """The runtime's capabilities: its subpackages with a manifest.py."""
    return [sub for sub in subpackages(runtime) if (runtime / sub / "manifest.py").exists()]


def facade_capabilities() -> set:
    """The capabilities the __sp__ facade sends a name to."""
    from source_patch.runtime import facade

    return {target.split(".")[0] for target in facade.exports().values()} - {"core"}


def _module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: not inside a function or a
    class body's methods, nor under ``if TYPE_CHECKING:``."""
    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If):
                test = node.test
                name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
                if name != "TYPE_CHECKING":
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, (ast.Try, ast.With)):
                yield from walk(node.body)
                for handler in getattr(node, "handlers", ()):
                    yield from walk(handler.body)
                yield from walk(getattr(node, "orelse", ()))
                yield from walk(getattr(node, "finalbody", ()))
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body)
    yield from walk(tree.body)


def heavy_core_modules(core: Path) -> set:
    """Core modules that import, at module level, something outside the standard library,
    or a core module that does (`name.py`)."""
    direct, uses = {}, {}
    for path in sorted(core.glob("*.py")):
        outside, inside = set(), set()
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level == 1:  # from . import x / from .x import y: a core module
                    inside |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
                continue
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            outside |= {n.split(".")[0] for n in names if n.split(".")[0] not in sys.stdlib_module_names}
        direct[path.stem], uses[path.stem] = outside, inside
    heavy = {name for name, outside in direct.items() if outside}
    while True:
        more = {name for name, inside in uses.items() if inside & heavy} - heavy
        if not more:
            return {f"{name}.py" for name in heavy if name != "__init__"}
        heavy |= more


# -- the page side

def section(text: str, heading: str) -> str:
    """The text under a heading of the page, up to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"docs/architecture.md has no heading {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def table(text: str, first_header: str) -> list:
    """The rows (lists of cells) of the table whose first header cell is ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and line.strip("| ").split(" | ")[0].strip() == first_header:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip().strip("|").split(" | ")])
            return rows
    raise AssertionError(f"docs/architecture.md has no table starting with {first_header!r}")


def blocks(text: str) -> list:
    """The indented code blocks of a section, each as its lines."""
    found, block = [], []
    for line in text.splitlines():
        if line.startswith("    "):
            block.append(line)
        elif block and line.strip():
            found.append(block)
            block = []
    return found + ([block] if block else [])


def named_modules(text: str, sub: str) -> set:
    """The modules of runtime/<sub>/ a row names: `name.py` or `sub/name.py` (a path into
    another subpackage names none of sub's), and `name/` for a subpackage."""
    named = set()
    for token in re.findall(r"`([\w/]+(?:\.py)?/?)`", text):
        head, _, tail = token.rpartition("/") if token.endswith(".py") else ("", "", token)
        if token.endswith(".py") and head in ("", sub):
            named.add(tail)
        elif token.endswith("/") and token.count("/") == 1 and token != f"{sub}/":
            named.add(token)
    return named


def nested_named_modules(text: str, rel: str) -> set:
    """The modules of a package nested in a row's subpackage that the row names, by their
    path from the subpackage: `rel/name.py`, and `rel/name/` for a package inside it."""
    named = set()
    for token in re.findall(r"`([\w/]+(?:\.py)?/?)`", text):
        head, _, tail = token.rstrip("/").rpartition("/")
        if head == rel and (token.endswith(".py") or token.endswith("/")):
            named.add(tail + ("/" if token.endswith("/") else ""))
    return named


def docstring_modules(doc: str) -> set:
    """The modules a package docstring names: each bare `name.py`; `name/` at the start of a
    listing line names a subpackage."""
    named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", doc))
    named |= {m + "/" for m in re.findall(r"^\s+(\w+)/\s", doc, re.M)}
    return named


# -- the checks: each returns what is wrong

def room_problems(text: str, root: Path = ROOT, others: dict | None = None) -> list:
    """``others``: more pages (name -> text) that count the rooms, README.md and docs/index.md
    by default."""
    others = {name: (root / name).read_text() for name in ("README.md", "docs/index.md")} if others is None else others
    rooms = [row[0].strip("`") for row in table(text, "room")]
    bad = [f"the room {room} is no folder" for room in rooms if not (root / room).is_dir()]
    for page, page_text in {"docs/architecture.md": text, **others}.items():
        for said in re.findall(r"\b(\w+) rooms\b", page_text):
            if said.lower() in NUMBERS and NUMBERS[said.lower()] != len(rooms):
                bad.append(f"{page} says {said} rooms; the rooms table has {len(rooms)}")
    return bad


def subpackage_table_problems(text: str, runtime: Path = ROOT / "runtime") -> list:
    rows = table(section(text, "The runtime, by capability"), "subpackage")
    listed = [row[0].strip("`").rstrip("/") for row in rows]
    bad = []
    if sorted(listed) != subpackages(runtime):
        bad.append(f"the subpackage table lists {sorted(listed)}; runtime/ has {subpackages(runtime)}")
    for sub, row in zip(listed, rows):
        if not (runtime / sub / "__init__.py").is_file():
            continue
        have, named = modules(runtime / sub), named_modules(" | ".join(row[1:]), sub)
        bad += [f"the {sub}/ row does not name {m}" for m in sorted(have - named)]
        bad += [f"the {sub}/ row names {m}, which runtime/{sub}/ does not have"
                for m in sorted(unknown(named, runtime / sub))]
        for rel in nested(runtime / sub):
            have, named = modules(runtime / sub / rel), nested_named_modules(" | ".join(row[1:]), rel)
            bad += [f"the {sub}/ row does not name {rel}/{m}" for m in sorted(have - named)]
            bad += [f"the {sub}/ row names {rel}/{m}, which runtime/{sub}/{rel}/ does not have"
                    for m in sorted(unknown(named, runtime / sub / rel))]
    return bad


def init_docstring_problems(docs: dict, runtime: Path = ROOT / "runtime") -> list:
    """``docs``: package under runtime/ ('routing', 'routing/records'; '' for runtime/
    itself) -> its __init__.py's docstring."""
    bad = []
    for sub in packages(runtime):
        have, named = modules(runtime / sub), docstring_modules(docs.get(sub) or "")
        bad += [f"runtime/{sub}/__init__.py's docstring does not name {m}" for m in sorted(have - named)]
        bad += [f"runtime/{sub}/__init__.py's docstring names {m}, which is not there"
                for m in sorted(unknown(named, runtime / sub))]
    top = docs.get("") or ""
    bad += [f"runtime/__init__.py's docstring does not name {sub}/" for sub in subpackages(runtime)
            if not re.search(rf"^\s+{sub}/\s", top, re.M)]
    return bad


def tree_problems(text: str, runtime: Path = ROOT / "runtime") -> list:
    tree = [b for b in blocks(section(text, "The runtime, by capability")) if b[0].strip() == "runtime/"]
    if not tree:
        return ["no runtime/ tree under 'The runtime, by capability'"]
    shown = {m.group(1) for line in tree[0][1:] if (m := re.match(r"^ {6}(\S+)", line))}
    have = {p.name for p in runtime.glob("*.py") if p.name != "__init__.py"}
    have |= {sub + "/" for sub in subpackages(runtime)}
    return ([f"the runtime tree does not show {m}" for m in sorted(have - shown)]
            + [f"the runtime tree shows {m}, which runtime/ does not have" for m in sorted(shown - have)])


def diagram_problems(text: str, runtime: Path = ROOT / "runtime", reached: set | None = None) -> list:
    lines = [line for b in blocks(section(text, "Direction of the dependencies")) for line in b]
    caps = set(capabilities(runtime))
    reached = facade_capabilities() if reached is None else reached
    bad = []
    to_core = [line for line in lines if "──> core/" in line]
    facade = [line for line in lines if "──__sp__──>" in line]
    if not to_core or not facade:
        return ["the diagram has no 'capabilities ──> core/' or '__sp__' line"]
    for what, line, want in (("──> core/", to_core[0].split("──> core/")[0], caps),
                             ("__sp__ ──> facade ──>", facade[0].rsplit("──>", 1)[1], reached)):
        shown = {t.rstrip("/") for t in line.split() if t.endswith("/")}
        if shown != want:
            bad.append(f"the diagram's {what} line shows {sorted(shown)}; the code has {sorted(want)}")
    return bad


def heavy_problems(text: str, core: Path = ROOT / "runtime" / "core") -> list:
    bullets = [b for b in re.split(r"\n(?=- )", section(text, "Direction of the dependencies"))
               if b.startswith("- `core` imports no capability")]
    if not bullets:
        return ["no bullet '- `core` imports no capability' under 'Direction of the dependencies'"]
    said = set(re.findall(r"(?<![\w/])`(\w+\.py)`", bullets[0]))  # bare names: the exceptions
    heavy = heavy_core_modules(core)
    return ([f"core/{m} imports something heavy at module level; the page does not say so" for m in sorted(heavy - said)]
            + [f"the page names core/{m} as heavy; it is not" for m in sorted(said - heavy)])


def _docstrings(runtime: Path = ROOT / "runtime") -> dict:
    docs = {"": ast.get_docstring(ast.parse((runtime / "__init__.py").read_text()))}
    for sub in packages(runtime):
        docs[sub] = ast.get_docstring(ast.parse((runtime / sub / "__init__.py").read_text()))
    return docs


# -- the page against the code

def test_the_rooms_are_counted_and_are_folders():
    assert room_problems(ARCHITECTURE.read_text()) == []


def test_the_subpackage_table_lists_each_subpackage_and_its_modules():
    assert subpackage_table_problems(ARCHITECTURE.read_text()) == []


def test_each_init_docstring_names_its_modules():
    assert init_docstring_problems(_docstrings()) == []


def test_the_tree_shows_every_subpackage():
    assert tree_problems(ARCHITECTURE.read_text()) == []


def test_the_diagram_shows_every_capability():
    assert diagram_problems(ARCHITECTURE.read_text()) == []


def test_the_heavy_core_modules_are_the_documented_ones():
    assert heavy_problems(ARCHITECTURE.read_text()) == []


# -- each check can fail (each self-test counts only the problems its doctoring adds, so
# it holds whether or not the live page is right)

def _doctor(text: str, old: str, new: str) -> str:
    assert old in text, f"the self-test's anchor {old!r} is no longer on the page"
    return text.replace(old, new, 1)


def _added(check, before, after, *args) -> set:
    """The problems ``check`` finds in ``after`` and not in ``before``."""
    return set(check(after, *args)) - set(check(before, *args))


def test_the_room_check_catches_a_wrong_count():
    text = ARCHITECTURE.read_text()
    count = re.search(r"has (\w+) rooms", text).group(1)
    wrong = "has three rooms" if count != "three" else "has two rooms"
    assert _added(room_problems, text, _doctor(text, f"has {count} rooms", wrong))
    assert _added(room_problems, text, _doctor(text, "| `patches/` |", "| `recipes/` |"))
    readme = (ROOT / "README.md").read_text()
    doctored = _doctor(readme, f"the {count} rooms", "the two rooms")
    assert (set(room_problems(text, ROOT, {"README.md": doctored})) - set(room_problems(text, ROOT, {"README.md": readme}))
            == {f"README.md says two rooms; the rooms table has {NUMBERS[count]}"})


def test_the_table_check_catches_a_missing_row_and_module_drift(tmp_path):
    text = ARCHITECTURE.read_text()
    features_row = next(line for line in text.splitlines() if line.startswith("| `features/` |"))
    assert _added(subpackage_table_problems, text, _doctor(text, features_row + "\n", ""))
    assert _added(subpackage_table_problems, text, _doctor(text, "`stream_io.py`", "stream_io")) == {
        "the features/ row does not name stream_io.py"}
    assert _added(subpackage_table_problems, text, _doctor(text, "`stream_io.py`", "`stream_io.py`, `gone.py`")) == {
        "the features/ row names gone.py, which runtime/features/ does not have"}
    # the code side: a module added to a copy of runtime/ that the page does not know
    runtime = _copy_runtime(tmp_path)
    before = set(subpackage_table_problems(text, runtime))
    (runtime / "features" / "new_module.py").write_text("")
    assert set(subpackage_table_problems(text, runtime)) - before == {"the features/ row does not name new_module.py"}


def test_the_table_check_sees_the_modules_of_nested_packages(tmp_path):
    """routing/'s row names records/, megatron/ and sglang/ and each of their modules by its
    path there: one left out, one gone, or one new in the code is caught."""
    text = ARCHITECTURE.read_text()
    assert _added(subpackage_table_problems, text, _doctor(text, "`sglang/graphs.py`", "graphs")) == {
        "the routing/ row does not name sglang/graphs.py"}
    assert _added(subpackage_table_problems, text, _doctor(text, "`records/describe.py`",
                                                           "`records/describe.py`, `records/gone.py`")) == {
        "the routing/ row names records/gone.py, which runtime/routing/records/ does not have"}
    runtime = _copy_runtime(tmp_path)
    before = set(subpackage_table_problems(text, runtime))
    (runtime / "routing" / "megatron" / "new_module.py").write_text("")
    assert set(subpackage_table_problems(text, runtime)) - before == {
        "the routing/ row does not name megatron/new_module.py"}


def test_the_docstring_check_catches_a_module_left_out(tmp_path):
    docs = _docstrings()
    assert _added(init_docstring_problems, docs, {**docs, "dump": docs["dump"].replace("reader.py", "reader")}) == {
        "runtime/dump/__init__.py's docstring does not name reader.py"}
    assert _added(init_docstring_problems, docs, {**docs, "trace": docs["trace"] + "\n    old.py  gone\n"}) == {
        "runtime/trace/__init__.py's docstring names old.py, which is not there"}
    assert _added(init_docstring_problems, docs, {**docs, "": docs[""].replace("    features/", "    ")}) == {
        "runtime/__init__.py's docstring does not name features/"}
    runtime = _copy_runtime(tmp_path)
    before = set(init_docstring_problems(docs, runtime))
    (runtime / "core" / "new_module.py").write_text("")
    assert set(init_docstring_problems(docs, runtime)) - before == {
        "runtime/core/__init__.py's docstring does not name new_module.py"}


def test_the_docstring_check_sees_nested_packages(tmp_path):
    """A package inside a subpackage (routing/sglang/) is held to the same rule: a module
    its docstring leaves out, or one it names that is gone, and a new nested package
    without a docstring that names its modules."""
    docs = _docstrings()
    assert {"routing/records", "routing/megatron", "routing/sglang"} <= set(docs)
    assert _added(init_docstring_problems, docs, {**docs, "routing/sglang": docs["routing/sglang"].replace(
        "graphs.py", "graphs")}) == {"runtime/routing/sglang/__init__.py's docstring does not name graphs.py"}
    assert _added(init_docstring_problems, docs, {**docs, "routing/records": docs["routing/records"] + "\n    old.py  gone\n"}) == {
        "runtime/routing/records/__init__.py's docstring names old.py, which is not there"}
    assert _added(init_docstring_problems, docs, {**docs, "routing": docs["routing"].replace("    records/", "    ")}) == {
        "runtime/routing/__init__.py's docstring does not name records/"}
    runtime = _copy_runtime(tmp_path)
    before = set(init_docstring_problems(docs, runtime))
    (runtime / "routing" / "sglang" / "deeper").mkdir()
    (runtime / "routing" / "sglang" / "deeper" / "__init__.py").write_text("")
    (runtime / "routing" / "sglang" / "deeper" / "part.py").write_text("")
    assert set(init_docstring_problems(docs, runtime)) - before == {
        "runtime/routing/sglang/__init__.py's docstring does not name deeper/",
        "runtime/routing/sglang/deeper/__init__.py's docstring does not name part.py"}


def test_the_tree_and_diagram_checks_catch_a_missing_subpackage():
    text = ARCHITECTURE.read_text()
    assert _added(tree_problems, text, re.sub(r"^ {6}features/.*\n", "", text, flags=re.M)) == {
        "the runtime tree does not show features/"}
    assert _added(diagram_problems, text, _doctor(text, "weight_sync/ features/ ──> core/", "weight_sync/ ──> core/"))
    sp_line = next(line for line in text.splitlines() if "──__sp__──>" in line)
    assert _added(diagram_problems, text, text.replace(sp_line, sp_line.replace(" features/", ""), 1))


def test_the_heavy_check_catches_an_undocumented_import(tmp_path):
    text = ARCHITECTURE.read_text()
    bullet = "- `core` imports no capability. Its own modules"
    assert _added(heavy_problems, text, _doctor(text, bullet, bullet + " (`tags.py`)")) == {
        "the page names core/tags.py as heavy; it is not"}
    core = tmp_path / "core"
    core.mkdir()
    for path in (ROOT / "runtime" / "core").glob("*.py"):
        (core / path.name).write_text(path.read_text())
    before = set(heavy_problems(text, core))
    (core / "tags.py").write_text("import numpy\n" + (core / "tags.py").read_text())
    (core / "lazy.py").write_text("def f():\n    import numpy\n")  # inside a function: light
    (core / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n")
    assert set(heavy_problems(text, core)) - before == {
        "core/tags.py imports something heavy at module level; the page does not say so"}


def _copy_runtime(tmp_path: Path) -> Path:
    """runtime/'s shape (its folders and .py files, empty) under tmp_path."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    for path in sorted((ROOT / "runtime").rglob("*")):
        if "__pycache__" in path.parts:
            continue
        target = runtime / path.relative_to(ROOT / "runtime")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".py":
            target.write_text("")
    return runtime
