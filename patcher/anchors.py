"""Where each edit of a patch goes: the target def, the statements, returns and calls
in its scope, the ones a pattern matches, and the plan of what to insert at each
(``_Plan``, keyed by the id of the original libcst nodes).  A patch that does not
match is said here, in words: the target not found (with the nearest names), found
twice, or an edit's count of matches off (with the nearest candidates).

Inserted code is planned wrapped in ``try`` (``_noted``): its handler adds a PEP 678
note naming the spec, patch and YAML line to any exception the code raises.

Part of the rewrite (engine.py); names with an underscore are shared by the rewrite
modules, not a public API.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from dataclasses import dataclass, field
from typing import Sequence

import libcst as cst

from .patterns import Pattern
from .spec import MODULE_TARGET, Edit, Patch

_DefNode = (cst.FunctionDef, cst.ClassDef)


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


def _handle_problems(source: str, patches: Sequence[Patch]) -> list[str]:
    return [f"  the module already uses the name {handle!r}, the runtime handle "
            f"of the patches; set another with the spec's 'handle' field"
            for handle in sorted({p.handle for p in patches})
            if re.search(rf"\b{re.escape(handle)}\b", source)]


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
            return "a module has no return statements; use 'after' on its last statement"
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
