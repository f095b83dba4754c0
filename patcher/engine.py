"""The libcst anchor engine: locate every edit of a module, then rewrite it.

``rewrite(source, patches, ...)`` returns a code object compiled from the patched
source whose line numbers are remapped to the original file: every original
line keeps its number, and inserted code reports the line of its anchor.  All
edits of a patch are located and counted before any is applied, so a patch
applies whole or not at all; a patch that no longer matches stops the module
(``on_drift: error``) or is left out while the others apply (``warn``, ``skip``).
Inserted statements run inside ``try``, whose handler adds a PEP 678 note naming
the spec, patch and YAML line to any exception they raise (free until one does).

Only the defs the patches target are parsed and rewritten (``_rewrite_regions``);
the whole module is, where that path cannot be sure to give the same result, and
to build every error.

This module imports libcst; the loader imports it only on a cache miss.
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import textwrap
import tokenize
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from .errors import AnchorError
from .patterns import Pattern
from .spec import CALL_PLACEHOLDER, MODULE_TARGET, Edit, Patch

_DefNode = (cst.FunctionDef, cst.ClassDef)


@dataclass
class Rewritten:
    """The outcome of patching one module."""

    source: str  # the patched source text (for diffs)
    tree: ast.Module  # its ast, line numbers already mapped to the original file
    line_map: list[int]  # patched line -> original line (index 0 unused)
    hits: list[tuple[Patch, Edit, list[int]]]  # each edit with the original lines it matched
    dropped: list[tuple[Patch, AnchorError]] = field(default_factory=list)  # drifted, on_drift warn|skip


@dataclass
class _Plan:
    """What to do at each anchor, keyed by id() of original libcst nodes."""

    entry: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    before: dict[int, list[str]] = field(default_factory=dict)
    after: dict[int, list[str]] = field(default_factory=dict)
    replace: dict[int, tuple[cst.CSTNode, str]] = field(default_factory=dict)
    returns: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    calls: dict[int, list[str]] = field(default_factory=dict)
    hits: list = field(default_factory=list)

    def merge(self, other: "_Plan") -> list[int]:
        """Add another patch's plan; the keys of statements both would replace."""
        for name in ("entry", "before", "after", "returns", "calls"):
            mine = getattr(self, name)
            for key, items in getattr(other, name).items():
                mine.setdefault(key, []).extend(items)
        clashes = [key for key in other.replace if key in self.replace]
        self.replace.update({k: v for k, v in other.replace.items() if k not in self.replace})
        self.hits += other.hits
        return clashes


_REGIONS = True  # private switch: False forces the whole-module path (tests compare the two)


def rewrite(source: str, patches: Sequence[Patch], *, module: str, file: str,
            version: Callable[[], str] = lambda: "unknown version",
            regions: bool | None = None) -> Rewritten:
    if _REGIONS if regions is None else regions:
        done = _rewrite_regions(source, patches, file)
        if done is not None:
            return done
    return _rewrite_module(source, patches, module=module, file=file, version=version)


def _rewrite_module(source: str, patches: Sequence[Patch], *, module: str, file: str,
                    version: Callable[[], str]) -> Rewritten:
    """The whole-module path: parse, locate, transform and line-map the entire file."""
    tree = cst.parse_module(source)
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    locator = _Locator(tree, positions)
    plan, problems, dropped = _Plan(), [], []
    problems += _handle_problems(source, patches)
    for patch in patches:
        own = _Plan()
        drift = locator.plan_patch(patch, own)
        if drift and patch.on_drift != "error":
            dropped.append((patch, AnchorError(module, file, version(), drift)))
            continue
        problems += drift
        problems += [f"  line {locator.line(plan.replace[k][0])} is replaced by two patches "
                     f"(one is {patch.id!r}); only one edit may replace a statement"
                     for k in plan.merge(own)]
    problems += locator.replace_conflicts(plan)
    if problems:
        raise AnchorError(module, file, version(), problems)
    transformer = _Transformer(plan, positions)
    new_tree = tree.visit(transformer)
    line_map = _line_map(new_tree, positions, transformer.origin, transformer.inserted)
    patched = new_tree.code
    return Rewritten(patched, _remap(patched, source, file, line_map), line_map, plan.hits, dropped)


def _handle_problems(source: str, patches: Sequence[Patch]) -> list[str]:
    return [f"  the module already uses the name {handle!r}, the runtime handle "
            f"of the patches; set another with the spec's 'handle' field"
            for handle in sorted({p.handle for p in patches})
            if re.search(rf"\b{re.escape(handle)}\b", source)]


# --------------------------------------------------------------------------- regions
#
# The whole-module path above spends most of its time on code that no patch touches:
# resolving positions (which generates the module's code), visiting every node, and
# generating the patched module.  A patch that names a function changes only that
# function's lines, so the region path below parses, plans, transforms and line-maps
# just the def of each target (decorators included) and splices the result back into
# the untouched text.  It must give exactly what the whole-module path gives (source,
# line map, hits): tests/test_engine_regions.py compares the two.  Wherever it cannot
# be sure of that, or anything is wrong (a target missing, defined twice, a class; an
# edit that does not match; a handle clash), it returns None and the whole-module path
# runs, which also builds every error.

_AST_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_AST_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


@dataclass
class _Region:
    node: ast.AST  # the target's def in the original file's ast
    chain: tuple  # the statements enclosing it, outermost first
    start: int  # its first line: the first decorator's
    end: int
    indent: str


class _Parsed(NamedTuple):
    """A region parsed alone (``_rewrite_regions``)."""

    prefix: str  # the scaffold before the region's lines
    tree: cst.Module
    fn: cst.FunctionDef  # the region's def
    positions: Mapping  # node -> CodeRange in ``tree``
    offset: int  # what to add to a line of ``tree`` to get the original file's
    locator: _Locator


def _ast_defs(module: ast.Module) -> dict[str, list[tuple[ast.AST, tuple]]]:
    """Every def and class by dotted qualified name, as ``_qualnames`` names them, each
    with the statements (and ``except``/``case`` clauses) enclosing it."""
    found: dict[str, list[tuple[ast.AST, tuple]]] = {}

    def walk(stmts, prefix: str, chain: tuple) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + stmt.name
                found.setdefault(name, []).append((stmt, chain))
                walk(stmt.body, name + ".", chain + (stmt,))
                continue
            for block in _AST_BLOCKS:  # defs sit only in statement lists
                inner = getattr(stmt, block, None)
                if isinstance(inner, list):
                    walk(inner, prefix, chain + (stmt,))

    walk(module.body, "", ())
    return found


def _one_line_header(line: str) -> bool:
    """Whether a class or def line holds its whole header, up to the colon."""
    try:
        tokens = list(tokenize.generate_tokens(iter([line.lstrip(" \t") + "\n"]).__next__))
    except (tokenize.TokenError, SyntaxError):
        return False
    significant = [t for t in tokens if t.type not in _NOT_SIGNIFICANT]
    return bool(significant) and significant[-1].type == tokenize.OP and significant[-1].string == ":"


def _indent(text: str) -> str:
    return text[:len(text) - len(text.lstrip(" \t"))]


def _last_block(stmt: ast.AST, pieces: list[str]) -> list | None:
    """The statements of a compound statement's last clause (``else``, ``finally``, ...)."""
    if (isinstance(stmt, ast.If) and len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
            and pieces[stmt.orelse[0].lineno - 1].lstrip(" \t").startswith("elif")):
        return _last_block(stmt.orelse[0], pieces)
    for name in ("finalbody", "orelse"):
        block = getattr(stmt, name, None)
        if block:
            return block
    if getattr(stmt, "handlers", None):
        return stmt.handlers[-1].body
    if getattr(stmt, "cases", None):
        return stmt.cases[-1].body
    return getattr(stmt, "body", None)


def _footer_end(stmt: ast.AST, pieces: list[str]) -> int:
    """The last line libcst gives a compound statement: its last statement's, or past it
    the last of the comment lines after it that its blocks own (their footers: every
    blank or comment line up to the last one indented as deep as its last block)."""
    end = stmt.end_lineno
    block = _last_block(stmt, pieces) if isinstance(stmt, ast.stmt) else None
    if not block:
        return end
    first = block[0]
    line = first.decorator_list[0].lineno if getattr(first, "decorator_list", None) else first.lineno
    text = pieces[line - 1]
    if line == first.lineno and text.encode()[:first.col_offset].strip(b" \t"):
        return end  # a one-line body (`if x: pass`): no block, no footer
    indent = _indent(text)
    for k in range(end + 1, len(pieces) + 1):
        text = pieces[k - 1]
        rest = text.lstrip(" \t")
        if rest and not rest.startswith("#"):
            break
        if text.startswith(indent):
            end = k
    return end


def _first_indent(source: str) -> str | None:
    """The whitespace of the file's first indented block: libcst's default indent."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.INDENT:
                return token.string
    except (tokenize.TokenError, SyntaxError):
        pass
    return None


def _rewrite_regions(source: str, patches: Sequence[Patch], file: str) -> Rewritten | None:
    if (not patches or any(c in source for c in "\r\f\v") or _handle_problems(source, patches)
            or any(p.target == MODULE_TARGET or not p.edits for p in patches)):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the patched module's compile warns, once
            module_ast = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    pieces = source.split("\n")  # line k is pieces[k - 1]; never str.splitlines (\f, \x1c, ...)
    for text in reversed(pieces):
        rest = text.lstrip(" \t")
        if rest and not rest.startswith("#"):
            break
        if text[:1] in (" ", "\t"):
            # An indented line in the comments ending the file: libcst can drop a blank
            # line above it (its code is then not the source), which only the whole
            # module's parse reproduces.
            return None
    defs = _ast_defs(module_ast)
    located = []
    for patch in patches:
        found = defs.get(patch.target, ())
        if len(found) != 1 or not isinstance(found[0][0], _AST_DEFS):
            return None  # missing, defined twice, a class: the whole-module path says so
        located.append(found[0])
    targeted = {id(node) for node, _ in located}
    regions: dict[int, _Region] = {}
    region_of: list[tuple[_Region, str | None]] = []  # each patch's region, and its def's name in it
    for patch, (node, chain) in zip(patches, located):
        # A target inside another target's def is found in that def's region.
        outer = next((i for i, a in enumerate(chain) if id(a) in targeted), None)
        inner = None
        if outer is not None:
            inner = ".".join(a.name for a in chain[outer:] if isinstance(a, (ast.ClassDef, *_AST_DEFS)))
            inner += "." + node.name
            node, chain = chain[outer], chain[:outer]
        if id(node) not in regions:
            # Only classes and defs may enclose it, each with its header on one line:
            # other lines of an enclosing statement (`try:`, `else:`, `):`) are lines
            # the whole-module line map carries over from the line above.
            if not all(isinstance(a, (ast.ClassDef, *_AST_DEFS)) and _one_line_header(pieces[a.lineno - 1])
                       for a in chain):
                return None
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            first = pieces[start - 1]
            indent = _indent(first)
            keyword = "@" if node.decorator_list else ("async" if isinstance(node, ast.AsyncFunctionDef) else "def")
            end = _footer_end(node, pieces)  # its blocks' trailing comments are its own
            if not first[len(indent):].startswith(keyword) or end >= len(pieces):
                return None
            regions[id(node)] = _Region(node, chain, start, end, indent)
        region_of.append((regions[id(node)], inner))
    ordered = sorted(regions.values(), key=lambda r: r.start)
    if any(b.start <= a.end for a, b in zip(ordered, ordered[1:])):
        return None
    default_indent = _first_indent(source)
    if not default_indent:
        return None

    # Parse each region alone.  A scaffold puts the def at its own indentation (no text
    # is re-indented, so strings spanning lines are untouched) and gives the region
    # module the file's default indent, which inserted blocks are written with.
    parsed: dict[int, _Parsed] = {}
    for r in ordered:
        prefix = f"if 1:\n{default_indent}pass\n" + ("if 1:\n" if r.indent else "")
        try:
            tree = cst.parse_module(prefix + "\n".join(pieces[r.start - 1:r.end]) + "\n")
        except cst.ParserSyntaxError:
            return None
        fn = tree.body[-1] if len(tree.body) == 2 else None
        if r.indent and isinstance(fn, cst.If) and fn.orelse is None and len(fn.body.body) == 1:
            fn = fn.body.body[0]
        if (not isinstance(fn, cst.FunctionDef) or fn.name.value != r.node.name
                or tree.default_indent != default_indent or tree.default_newline != "\n"):
            return None
        positions = MetadataWrapper(tree, unsafe_skip_copy=True).resolve(PositionProvider)
        offset = r.start - 1 - prefix.count("\n")
        parsed[id(r)] = _Parsed(prefix, tree, fn, positions, offset, _Locator(tree, positions, offset, defs={}))

    plan = _Plan()
    nested: dict[int, dict] = {}
    for patch, (r, inner) in zip(patches, region_of):
        own = _Plan()
        locator, fn = parsed[id(r)].locator, parsed[id(r)].fn
        if inner is not None:
            if id(r) not in nested:
                nested[id(r)] = _qualnames(parsed[id(r)].tree)
            found = nested[id(r)].get(inner, ())
            if len(found) != 1 or not isinstance(found[0], cst.FunctionDef):
                return None
            fn = found[0]
        if locator.plan_edits(fn, patch, own) or plan.merge(own):
            return None  # drift, or a statement replaced twice: the whole path reports it
    if parsed[id(ordered[0])].locator.replace_conflicts(plan):
        return None

    # Lines the whole-module line map leaves unclaimed outside the regions (it carries
    # the line above into them).  It maps an untouched statement by its range, which
    # leaves out, of the statements in the blocks that enclose a region, the comments
    # between the decorators of a def or class and its `def`/`class` line, and the
    # comment lines after a compound statement that its blocks own.
    enclosing = {id(a): a for r in ordered for a in r.chain}
    targets = {id(r.node) for r in ordered}
    unclaimed = set()
    for block in [module_ast, *enclosing.values()]:
        for stmt in block.body:
            if id(stmt) in targets or id(stmt) in enclosing:
                continue
            if isinstance(stmt, (ast.ClassDef, *_AST_DEFS)) and stmt.decorator_list:
                unclaimed.update(range(stmt.decorator_list[-1].end_lineno + 1, stmt.lineno))
            unclaimed.update(range(stmt.end_lineno + 1, _footer_end(stmt, pieces) + 1))

    lines: list[str] = []
    mapping = [0]
    at = 1  # the next original line to copy
    for r in ordered:
        prefix, tree, _, positions, offset, _ = parsed[id(r)]
        transformer = _Transformer(plan, positions, offset)
        new_tree = tree.visit(transformer)
        code = new_tree.code
        if not code.startswith(prefix) or not code.endswith("\n"):
            return None
        local = _line_map(new_tree, positions, transformer.origin, transformer.inserted, offset, carry=False)
        new_lines = code[len(prefix):-1].split("\n")
        skip = prefix.count("\n")
        lines += pieces[at - 1:r.start - 1]
        mapping += [0 if k in unclaimed else k for k in range(at, r.start)]
        lines += new_lines
        mapping += local[skip + 1:skip + 1 + len(new_lines)]
        at = r.end + 1
    lines += pieces[at - 1:]
    real = len(pieces) - (1 if source.endswith("\n") else 0)  # lines with text (or a newline)
    mapping += [0 if k in unclaimed else k for k in range(at, real + 1)]
    patched = "\n".join(lines)
    total = patched.count("\n")
    mapping += [0] * (total + 3 - len(mapping))
    if len(mapping) != total + 3:
        return None
    last = total + (0 if source.endswith("\n") else 1)  # the patched file's last line
    if mapping[last] and not pieces[real - 1].lstrip(" \t")[:1].strip("#"):
        # A comment or blank last line is an EmptyLine, whose range ends on the next line.
        mapping[last + 1] = mapping[last] + 1
    line_map = _carry(mapping)
    return Rewritten(patched, _remap(patched, source, file, line_map), line_map, plan.hits, [])


_NOT_SIGNIFICANT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                    tokenize.ENDMARKER)


# --------------------------------------------------------------------------- locate


def _qualnames(tree: cst.Module) -> dict[str, list[cst.CSTNode]]:
    """Every def and class by dotted qualified name (``Outer.Inner.method``)."""
    found: dict[str, list[cst.CSTNode]] = {}

    class Visitor(cst.CSTVisitor):
        def __init__(self):
            self.stack: list[str] = []

        def _enter(self, node):
            self.stack.append(node.name.value)
            found.setdefault(".".join(self.stack), []).append(node)

        def _leave(self, node):
            self.stack.pop()

        visit_FunctionDef = visit_ClassDef = _enter
        leave_FunctionDef = leave_ClassDef = _leave

    tree.visit(Visitor())
    return found


class _ScopeCollector(cst.CSTVisitor):
    """Statements, returns and calls of one function, not of the defs nested in it."""

    def __init__(self, root: cst.FunctionDef | cst.Module):
        self.root = root
        self.statements: list[cst.CSTNode] = []
        self.returns: list[cst.Return] = []
        self.calls: list[cst.Call] = []
        self.elifs: set[int] = set()

    def on_visit(self, node) -> bool:
        if node is not self.root and isinstance(node, _DefNode):
            self.statements.append(node)  # matchable as a statement, not entered
            return False
        if isinstance(node, cst.If) and isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))
        # An `elif` clause is an If node but no statement: nothing can go before it.
        if (isinstance(node, (cst.BaseSmallStatement, cst.BaseCompoundStatement))
                and node is not self.root and id(node) not in self.elifs):
            self.statements.append(node)
        if isinstance(node, cst.Return):
            self.returns.append(node)
        elif isinstance(node, cst.Call):
            self.calls.append(node)
        return True


class _Subtree(cst.CSTVisitor):
    def __init__(self):
        self.ids: set[int] = set()

    def on_visit(self, node) -> bool:
        self.ids.add(id(node))
        return True


class _Locator:
    def __init__(self, tree: cst.Module, positions, offset: int = 0, defs: dict | None = None):
        """``offset``: what to add to a line of ``tree`` to get the line of the original
        file (a region's tree starts further down it); ``defs``: given, not collected."""
        self.tree, self.positions, self.offset = tree, positions, offset
        self.defs = _qualnames(tree) if defs is None else defs
        self.scopes: dict[int, _ScopeCollector] = {}
        self.code_cache: dict[int, str] = {}

    def line(self, node) -> int:
        return self.positions[node].start.line + self.offset

    def code(self, node) -> str:
        key = id(node)
        if key not in self.code_cache:
            self.code_cache[key] = self.tree.code_for_node(node)
        return self.code_cache[key]

    def scope(self, fn) -> _ScopeCollector:
        """What a function (or the module's top level) holds outside nested defs."""
        if id(fn) not in self.scopes:
            collector = _ScopeCollector(fn)
            for stmt in fn.body if isinstance(fn, cst.Module) else [fn.body]:
                stmt.visit(collector)
            self.scopes[id(fn)] = collector
        return self.scopes[id(fn)]

    def plan_patch(self, patch: Patch, plan: _Plan) -> list[str]:
        where = _where(patch)
        defs = [self.tree] if patch.target == MODULE_TARGET else self.defs.get(patch.target, [])
        if not defs:
            near = difflib.get_close_matches(patch.target, list(self.defs), n=5, cutoff=0.5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            return [f"  {where}: target {patch.target!r} not found{hint}"]
        if len(defs) > 1:
            lines = ", ".join(str(self.line(d)) for d in defs)
            return [f"  {where}: target {patch.target!r} is defined {len(defs)} times "
                    f"(lines {lines}); patch a name defined once"]
        fn = defs[0]
        if not isinstance(fn, (cst.FunctionDef, cst.Module)):
            return [f"  {where}: target {patch.target!r} is a class; name a method of it"]
        return self.plan_edits(fn, patch, plan)

    def plan_edits(self, fn, patch: Patch, plan: _Plan) -> list[str]:
        """Locate every edit of a patch in its (found) target."""
        where = _where(patch)
        problems = []
        for edit in patch.edits:
            problem = self.plan_edit(fn, edit, plan, patch)
            if problem:
                problems.append(f"  {where}, edit {edit.describe()} "
                                f"(spec line {edit.location.line}): {problem}")
        return problems

    def replace_conflicts(self, plan: _Plan) -> list[str]:
        """A replaced statement discards whatever other edits sit inside it: refuse."""
        inner = set(plan.calls) | set(plan.returns) | set(plan.entry) | set(plan.before) \
            | set(plan.after) | set(plan.replace)
        problems = []
        for key, (node, code) in plan.replace.items():
            collector = _Subtree()
            node.visit(collector)
            lost = (collector.ids - {key}) & inner | ({key} & (set(plan.returns) | set(plan.calls)))
            if lost:
                problems.append(f"  line {self.line(node)} is replaced by one edit while "
                                f"{len(lost)} other edit(s) target code inside it, which the "
                                f"replacement would silently discard; combine them into the "
                                f"replacement code")
        return problems

    def plan_edit(self, fn, edit: Edit, plan: _Plan, patch: Patch) -> str | None:
        code = _noted(edit.code, patch, edit) if edit.code else ""
        if edit.at == "entry":
            line = 1 if isinstance(fn, cst.Module) else self.line(fn.name)
            plan.entry.setdefault(id(fn), []).append((code, line))
            plan.hits.append((patch, edit, [line]))
            return None
        if edit.at == "return" and isinstance(fn, cst.Module):
            return f"a module has no return statements; use 'after' on its last statement"
        scope = self.scope(fn)
        if edit.at == "return":
            found, candidates = scope.returns, []
        elif edit.at == "call":
            pattern = Pattern(edit.match, call=True)
            candidates = scope.calls
            found = [c for c in candidates if pattern.matches(self.code(c))]
        else:
            pattern = Pattern(edit.match, call=False)
            # Only statements of the pattern's own kind: parsing every compound
            # statement's whole body to compare a one-liner would be wasted work.
            candidates = [s for s in scope.statements
                          if isinstance(s, cst.BaseCompoundStatement) == pattern.compound]
            found = [s for s in candidates if pattern.matches(self.code(s))]
        if (len(found) != edit.count) if edit.count else not found:
            return self.mismatch(edit, found, candidates)
        plan.hits.append((patch, edit, [self.line(n) for n in found]))
        for node in found:
            key = id(node)
            if edit.at == "return":
                plan.returns.setdefault(key, []).append((edit.bind, code))
            elif edit.at == "call":
                plan.calls.setdefault(key, []).append(edit.wrap)
            elif edit.at == "replace":
                if key in plan.replace:
                    return f"line {self.line(node)} is already replaced by another edit"
                plan.replace[key] = (node, code)
            else:
                getattr(plan, edit.at).setdefault(key, []).append(code)
        return None

    def mismatch(self, edit: Edit, found, candidates) -> str:
        expected = "one or more" if edit.count is None else str(edit.count)
        text = f"expected {expected} match{'es' if edit.count != 1 else ''}, found {len(found)}"
        if found:
            text += " at line" + ("s " if len(found) > 1 else " ")
            text += ", ".join(str(self.line(n)) for n in found)
            text += " (set count to match, or make the pattern more specific):"
            return text + "".join(f"\n      line {self.line(n)}: {_first_code_line(self.code(n))}"
                                  for n in found)
        if not candidates:
            return text
        first_lines = {id(c): _first_code_line(self.code(c)) for c in candidates}
        ranked = sorted(candidates, key=lambda c: -difflib.SequenceMatcher(
            None, edit.match, first_lines[id(c)]).ratio())[:3]
        near = "".join(f"\n      line {self.line(c)}: {first_lines[id(c)]}" for c in ranked)
        return text + "; nearest candidates:" + near


NOTE_NAME = "__sp_exc__"  # dunder-suffixed: never name-mangled inside a class body


def note_text(patch: Patch, edit: Edit) -> str:
    return (f"source-patch: raised in code inserted by patch {patch.id!r} of spec "
            f"{patch.spec_name!r} ({patch.location.file}:{edit.location.line})")


def _noted(code: str, patch: Patch, edit: Edit) -> str:
    """The code inside ``try``; its handler notes the patch on the exception (PEP 678)."""
    body = textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", "    ")
    return (f"try:\n{body}except Exception as {NOTE_NAME}:\n"
            f"    {NOTE_NAME}.add_note({note_text(patch, edit)!r})\n    raise\n")


def _where(patch: Patch) -> str:
    return f"patch {patch.id!r} ({patch.location.file}:{patch.location.line})"


def _first_code_line(code: str) -> str:
    lines = [line.strip() for line in code.splitlines()]
    return next((line for line in lines if line and not line.startswith("#")), "")


# --------------------------------------------------------------------------- rewrite


def _parse_code(code: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(textwrap.dedent(code)).body)


def _is_future_import(stmt) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.ImportFrom)
            and isinstance(stmt.body[0].module, cst.Name) and stmt.body[0].module.value == "__future__")


def _is_docstring(stmt) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


_PASS = cst.SimpleStatementLine([cst.Pass()])


def _line(small: cst.BaseSmallStatement) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine(body=[small])


class _Transformer(cst.CSTTransformer):
    def __init__(self, plan: _Plan, positions, offset: int = 0):
        super().__init__()
        self.plan, self.positions, self.offset = plan, positions, offset
        # id(new statement) -> (statement, original anchor line, whether it is spec code
        # alone: no original node inside); holding the node keeps its id from being
        # reused by another object.
        self.inserted: dict[int, tuple[cst.CSTNode, int, bool]] = {}
        self.planned = set(plan.before) | set(plan.after) | set(plan.replace) | set(plan.returns)
        # libcst rebuilds every node it visits, so identity cannot tell an untouched
        # subtree from an edited one.  Track it: a node is changed when its leave_*
        # returned something else or a descendant changed.  Untouched nodes map to
        # their originals (both held, so ids stay unique).
        self.origin: dict[int, tuple[cst.CSTNode, cst.CSTNode]] = {}
        self._changed_below: list[bool] = []

    def on_visit(self, node) -> bool:
        self._changed_below.append(False)
        return super().on_visit(node)

    def on_leave(self, original, updated):
        result = super().on_leave(original, updated)
        changed = self._changed_below.pop() or result is not updated
        if changed and self._changed_below:
            self._changed_below[-1] = True
        elif not changed:
            self.origin[id(result)] = (result, original)
        return result

    def insert(self, code: str, anchor_line: int) -> list[cst.BaseStatement]:
        stmts = _parse_code(code)
        for stmt in stmts:
            self.inserted[id(stmt)] = (stmt, anchor_line, True)
        return stmts

    def mark(self, stmt: cst.BaseStatement, anchor_line: int) -> cst.BaseStatement:
        self.inserted[id(stmt)] = (stmt, anchor_line, False)
        return stmt

    # -- call wraps

    def leave_Call(self, original, updated):
        for template in self.plan.calls.get(id(original), ()):
            expr = cst.parse_expression(template)
            updated = expr.visit(_Substitute(CALL_PLACEHOLDER, updated))
        return updated

    # -- statement lists

    def leave_IndentedBlock(self, original, updated):
        body = self.expand_all(original.body, updated.body)
        return updated if body is None else updated.with_changes(body=body or [_PASS])

    def leave_SimpleStatementSuite(self, original, updated):
        if not any(id(s) in self.planned for s in original.body):
            return updated
        # A one-line body (``if x: return y``) becomes a block so statements fit in.
        lines = [_line(s) for s in original.body]
        updated_lines = [_line(s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)) for s in updated.body]
        return cst.IndentedBlock(body=self.expand_all(lines, updated_lines) or [_PASS])

    def leave_Module(self, original, updated):
        body = self.expand_all(original.body, updated.body)
        stmts = list(updated.body if body is None else body)
        entries = self.plan.entry.get(id(original))
        if entries:
            at = 1 if stmts and _is_docstring(stmts[0]) else 0
            while at < len(stmts) and _is_future_import(stmts[at]):
                at += 1  # `from __future__` imports must stay first
            stmts[at:at] = [s for code, line in entries for s in self.insert(code, line)]
        return updated if body is None and not entries else updated.with_changes(body=stmts)

    def leave_FunctionDef(self, original, updated):
        entries = self.plan.entry.get(id(original))
        if not entries:
            return updated
        body = updated.body
        if isinstance(body, cst.SimpleStatementSuite):
            body = cst.IndentedBlock(body=[_line(s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT))
                                           for s in body.body])
        stmts = list(body.body)
        at = 1 if stmts and _is_docstring(stmts[0]) else 0
        new = [s for code, line in entries for s in self.insert(code, line)]
        return updated.with_changes(body=body.with_changes(body=stmts[:at] + new + stmts[at:]))

    def expand_all(self, originals, updated):
        """New statement list, or None when nothing in it is planned."""
        out, changed = [], False
        for orig, upd in zip(originals, updated):
            if isinstance(orig, cst.SimpleStatementLine):
                if any(id(s) in self.planned for s in orig.body):
                    out += self.expand_line(upd, orig.body)
                    changed = True
                    continue
            elif id(orig) in self.planned:
                out += self.expand(orig, upd, self.positions[orig].start.line + self.offset)
                changed = True
                continue
            out.append(upd)
        return out if changed else None

    def expand_line(self, upd, smalls) -> list[cst.BaseStatement]:
        """Split a line of small statements so each can be edited on its own."""
        out = []
        last = len(smalls) - 1
        for i, (small_orig, small_upd) in enumerate(zip(smalls, upd.body)):
            if len(smalls) > 1 and small_upd.semicolon is not cst.MaybeSentinel.DEFAULT:
                small_upd = small_upd.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
            line = upd if len(smalls) == 1 else cst.SimpleStatementLine(
                body=[small_upd],
                leading_lines=upd.leading_lines if i == 0 else (),
                trailing_whitespace=upd.trailing_whitespace if i == last else cst.TrailingWhitespace(),
            )
            if id(small_orig) in self.planned:
                out += self.expand(small_orig, line, self.positions[small_orig].start.line + self.offset,
                                   small_upd)
            else:
                out.append(line)
        return out

    def expand(self, orig, upd_stmt, anchor_line, small_upd=None) -> list[cst.BaseStatement]:
        key = id(orig)
        out = [s for code in self.plan.before.get(key, ()) for s in self.insert(code, anchor_line)]
        if key in self.plan.replace:
            out += self.insert(self.plan.replace[key][1], anchor_line)
        elif key in self.plan.returns:
            out += self.expand_return(key, small_upd, anchor_line)
        else:
            out.append(upd_stmt)
        if out and out[0] is not upd_stmt and upd_stmt.leading_lines:
            # The blank lines and comments above the anchor stay above whatever
            # now comes first.
            out = [self.mark(out[0].with_changes(leading_lines=upd_stmt.leading_lines), anchor_line),
                   *(upd_stmt.with_changes(leading_lines=()) if s is upd_stmt else s for s in out[1:])]
        out += [s for code in self.plan.after.get(key, ()) for s in self.insert(code, anchor_line)]
        return out

    def expand_return(self, key: int, ret: cst.Return, anchor_line: int) -> list[cst.BaseStatement]:
        """``return X`` -> ``bind = X``; inserted code; ``return bind``, all on X's line."""
        value = ret.value if ret.value is not None else cst.Name("None")
        out, source = [], value
        for bind, code in self.plan.returns[key]:
            assign = cst.Assign(targets=[cst.AssignTarget(cst.Name(bind))], value=source)
            out.append(self.mark(_line(assign), anchor_line))
            out += self.insert(code, anchor_line)
            source = cst.Name(bind)
        out.append(self.mark(_line(cst.Return(value=source)), anchor_line))
        return out


class _Substitute(cst.CSTTransformer):
    """Replace the placeholder name with a given expression."""

    def __init__(self, name: str, expr: cst.BaseExpression):
        super().__init__()
        self.name, self.expr = name, expr

    def leave_Name(self, original, updated):
        return self.expr if original.value == self.name else updated


# --------------------------------------------------------------------------- line numbers


# Node types whose identity means something: libcst may share leaf whitespace
# objects between parses, so those must never map a line.
_MAPPABLE = (cst.BaseStatement, cst.BaseSmallStatement, cst.BaseExpression, cst.EmptyLine,
             cst.Decorator, cst.Param, cst.Arg)


def _line_map(new_tree: cst.Module, orig_positions, origin: dict, inserted: dict,
              offset: int = 0, carry: bool = True) -> list[int]:
    """Map each line of the patched source to a line of the original source.

    Untouched subtrees map line for line onto their originals; inserted statements
    map to their anchor line.  ``offset`` is added to lines of the original tree;
    without ``carry``, lines no node claimed stay 0.
    """
    positions = MetadataWrapper(new_tree, unsafe_skip_copy=True).resolve(PositionProvider)
    mapping = [0] * (new_tree.code.count("\n") + 3)
    stack: list[cst.CSTNode] = [new_tree]
    while stack:
        node = stack.pop()
        new: CodeRange | None = positions.get(node)
        pair = origin.get(id(node)) if isinstance(node, _MAPPABLE) else None
        if new is not None and pair is not None and pair[0] is node:
            start = orig_positions[pair[1]].start.line + offset
            for k in range(new.start.line, new.end.line + 1):
                mapping[k] = start + (k - new.start.line)
            # Decorators and comment lines lie outside a statement's own range.
            stack.extend(getattr(node, "decorators", ()))
            stack.extend(getattr(node, "leading_lines", ()))
            continue
        if new is not None and id(node) in inserted:
            _, line, alone = inserted[id(node)]
            for k in range(new.start.line, new.end.line + 1):
                mapping[k] = line
            if alone:
                continue  # spec code only: nothing inside maps elsewhere (a walk per node)
        stack.extend(node.children)
    return _carry(mapping) if carry else mapping


def _carry(mapping: list[int]) -> list[int]:
    last = 1
    for k in range(1, len(mapping)):  # lines no node claimed: carry the previous one
        mapping[k] = mapping[k] or last
        last = mapping[k]
    return mapping


def _remap(patched: str, original: str, file: str, line_map: list[int]) -> ast.Module:
    tree = ast.parse(patched, filename=file)
    new_lines = patched.splitlines()
    old_lines = original.splitlines()

    def same_text(k: int) -> bool:
        o = line_map[k]
        return 0 < k <= len(new_lines) and 0 < o <= len(old_lines) and new_lines[k - 1] == old_lines[o - 1]

    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or node.lineno is None:
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        if not (same_text(start) and same_text(end)):
            # Columns on a rewritten line no longer fit the original text: span the
            # whole original line, which makes tracebacks print no misleading carets.
            orig = old_lines[line_map[start] - 1] if 0 < line_map[start] <= len(old_lines) else ""
            node.col_offset, node.end_col_offset = 0, len(orig.encode())
            end = start
        node.lineno = line_map[start]
        node.end_lineno = max(line_map[end], node.lineno)
    return tree
