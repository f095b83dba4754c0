"""Authoring helpers: ``source-patch anchors`` and ``source-patch new``.

``anchors`` lists, for one function, every place an edit can anchor, each with a
pattern that is known to match it (checked with the same matcher the engine
uses), printed ready to paste into a spec.  ``skeleton`` writes a commented
starting spec.  Neither imports the target module: sources are found with
``locate.find_source`` and read with libcst.
"""

from __future__ import annotations

import ast
import difflib
import json
import sys
from typing import NamedTuple

import libcst as cst
import yaml
from libcst.metadata import MetadataWrapper, PositionProvider

from .anchors import _qualnames, _ScopeCollector
from .errors import SourcePatchError
from .locate import find_source_hinted
from .patterns import Pattern
from .requires import installed_version
from .spec import _DOTTED_RE, _ID_RE, _TARGET_RE, MODULE_TARGET

ARGS_LIMIT = 60  # a call's arguments longer than this print as `...`
_BODY_MARK = "__source_patch_body__"  # stands in for a compound statement's body


# --------------------------------------------------------------------------- anchors


def anchors(target: str, against: str | None = None, as_json: bool = False):
    """The anchors of ``MODULE:QUALNAME`` (``MODULE:<module>`` for top-level code): a
    listing to read, or with ``as_json`` the same as a dict (file, target, lines, and per
    kind the anchors with their line, pattern, how many candidates it matches, or a note)."""
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname:
        raise SourcePatchError(f"expected MODULE:QUALNAME (or MODULE:{MODULE_TARGET}), "
                               f"got {target!r}")
    path = find_source_hinted(module, against)
    tree = cst.parse_module(path.read_bytes())  # bytes: libcst honours a coding declaration
    positions = MetadataWrapper(tree, unsafe_skip_copy=True).resolve(PositionProvider)
    defs = _qualnames(tree)
    node = tree if qualname == MODULE_TARGET else _find(defs, qualname, path, positions)
    lines = (1, max(len(tree.code.splitlines()), 1)) if node is tree else \
        (positions[node].start.line, positions[node].end.line)
    head = {"file": str(path), "target": qualname, "lines": list(lines)}
    if isinstance(node, cst.ClassDef):
        methods = _methods(defs, qualname, positions)
        if as_json:
            return {**head, "kind": "class", "methods": [{"line": l, "name": n} for l, n in methods]}
        return "\n".join([f"{path}: {qualname} (class, lines {lines[0]}-{lines[1]})",
                          f"methods (target one as {qualname}.NAME):", *_rows(methods)]) + "\n"
    listing = _Listing(tree, node, positions)
    if as_json:
        return {**head, "kind": "module" if node is tree else "function", **listing.data()}
    return listing.render(f"{path}: {qualname} (lines {lines[0]}-{lines[1]})")


def _find(defs: dict, qualname: str, path, positions) -> cst.CSTNode:
    nodes = defs.get(qualname, [])
    if not nodes:
        near = difflib.get_close_matches(qualname, list(defs), n=5, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise SourcePatchError(f"target {qualname!r} not found in {path}{hint}")
    if len(nodes) > 1:  # the engine refuses such a target, so listing one copy would mislead
        lines = ", ".join(str(positions[n].start.line) for n in nodes)
        raise SourcePatchError(f"target {qualname!r} is defined {len(nodes)} times in {path} "
                               f"(lines {lines}); patch a name defined once")
    return nodes[0]


def _methods(defs: dict, qualname: str, positions) -> list[tuple[int, str]]:
    """A class is no target: (line, name) of what inside it is."""
    prefix = qualname + "."
    children = sorted((positions[n].start.line, name, n) for name, nodes in defs.items()
                      if name.startswith(prefix) and "." not in name[len(prefix):] for n in nodes)
    return [(line, name + ("  (class)" if isinstance(n, cst.ClassDef) else "")) for line, name, n in children]


def _section(title: str, rows: list[tuple[int, str]], empty: str = "") -> list[str]:
    return [f"{title}:", *_rows(rows)] if rows else [empty or f"{title.split()[0]}: none"]


def _rows(rows: list[tuple[int, str]]) -> list[str]:
    width = max((len(str(line)) for line, _ in rows), default=1)
    return [f"  {line:>{width}}  {text}" for line, text in rows]


class Anchor(NamedTuple):
    """One anchor of a listing: its line, the pattern that matches it (None: none can,
    ``note`` says why) and how many candidates of the scope that pattern matches."""

    line: int
    pattern: str | None
    matches: int
    note: str | None


class _Listing:
    """Statements, calls and returns of one function's own scope, with their patterns."""

    def __init__(self, tree: cst.Module, fn, positions):
        self.tree, self.positions = tree, positions
        self.scope = _ScopeCollector(fn)
        for stmt in fn.body if isinstance(fn, cst.Module) else [fn.body]:
            stmt.visit(self.scope)
        self.counts: dict[tuple[str, bool], int] = {}
        self.docstring = _docstring(fn)

    def render(self, header: str) -> str:
        returns = self.scope.returns
        out = [header]
        out += _section("statements (at: before | after | replace)",
                        [self.row(s, call=False) for s in self.scope.statements])
        out += _section("calls (at: call)", [self.row(c, call=True) for c in self.scope.calls])
        out += _section(f"returns (at: return, count: {len(returns)})",
                        [self.row(r, call=False) for r in returns],
                        "returns: none (use at: after on the last statement)")
        return "\n".join(out) + "\n"

    def data(self) -> dict:
        """The listing as data: {"statements", "calls", "returns"}: [Anchor as a dict]."""
        kinds = {"statements": (self.scope.statements, False), "calls": (self.scope.calls, True),
                 "returns": (self.scope.returns, False)}
        return {kind: [self.anchor(n, call)._asdict() for n in nodes] for kind, (nodes, call) in kinds.items()}

    def row(self, node, call: bool) -> tuple[int, str]:
        a = self.anchor(node, call)
        if a.pattern is None:
            return a.line, f"# {a.note}"
        shown = json.dumps(a.pattern)
        if a.matches > 1:
            kind = "calls" if call else "statements"
            shown += f"   # matches {a.matches} {kind}: use count: {a.matches} or a more specific pattern"
        return a.line, shown

    def anchor(self, node, call: bool) -> "Anchor":
        line = self.positions[node].start.line
        if node is self.docstring:  # its pattern would be the whole text: say what it is
            return Anchor(line, None, 0, "docstring (at: entry goes after it)")
        text = pattern_for(node, self.tree.code_for_node(node), call)
        if text is None:  # the matcher cannot express `try:` / `match x:` headers, nor a
            # call whose source does not parse alone (a method chain broken across lines)
            note = ("no pattern can match this call; anchor on its statement" if call else
                    "no pattern can match this statement; anchor on one inside it")
            return Anchor(line, None, 0, note)
        return Anchor(line, text, self.count(text, call), None)

    def count(self, text: str, call: bool) -> int:
        """How many candidates of this scope the pattern matches, as the engine counts them."""
        if (text, call) not in self.counts:
            pattern = Pattern(text, call=call)
            candidates = self.scope.calls if call else [
                s for s in self.scope.statements
                if isinstance(s, cst.BaseCompoundStatement) == pattern.compound]
            self.counts[text, call] = sum(pattern.matches(self.tree.code_for_node(c))
                                          for c in candidates)
        return self.counts[text, call]


def _docstring(fn) -> cst.CSTNode | None:
    """The docstring's expression statement, if the body starts with one."""
    body = fn.body if isinstance(fn, cst.Module) else fn.body.body
    first = body[0] if body else None
    if isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1:
        expr = first.body[0]
        if isinstance(expr, cst.Expr) and isinstance(expr.value, (cst.SimpleString,
                                                                   cst.ConcatenatedString)):
            return expr
    return None


# --------------------------------------------------------------------------- patterns


def pattern_for(node: cst.CSTNode, code: str, call: bool) -> str | None:
    """A pattern matching ``node`` (whose source is ``code``): its own text on one line
    when that works, else Python's normalized form; long call arguments become ``...``."""
    compact = node.visit(_CompactCalls())
    if isinstance(compact, cst.BaseCompoundStatement):
        text = _header(compact)
    elif isinstance(compact, cst.BaseSmallStatement):
        text = _code(compact.with_changes(semicolon=cst.MaybeSentinel.DEFAULT))
    else:
        text = _code(compact)
    text = text.strip()
    candidates = [text] if "\n" not in text else []
    candidates.append(_normalized(text))
    for candidate in candidates:
        if candidate and _round_trips(candidate, code, call):
            return candidate
    return None


def _round_trips(text: str, code: str, call: bool) -> bool:
    try:
        return Pattern(text, call=call).matches(code)
    except (SyntaxError, ValueError):
        return False


def _normalized(text: str) -> str:
    """``ast.unparse``: one line per statement, comments and line breaks gone (decorators
    keep their own lines: they are part of what a def pattern must match)."""
    header = text.endswith(":")
    try:
        tree = ast.parse(text + "\n    pass" if header else text)
    except SyntaxError:
        return ""
    lines = ast.unparse(tree).splitlines()
    return "\n".join(lines[:-1] if header else lines)


def _header(node: cst.BaseCompoundStatement) -> str:
    """A compound statement's header ending in ':', without body, clauses or comments."""
    if isinstance(node, cst.Match):
        return f"match {_code(node.subject)}:"
    mark = cst.IndentedBlock([cst.SimpleStatementLine([cst.Expr(cst.Name(_BODY_MARK))])])
    text = _code(node.with_changes(body=mark, leading_lines=()))
    return text[: text.index(_BODY_MARK)].rstrip()


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


class _CompactCalls(cst.CSTTransformer):
    """Write a call's arguments as ``...`` when they span lines or run long: ``...``
    matches any arguments, so the pattern still matches, and stays one short line."""

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        args = _code(updated.with_changes(func=cst.Name("f"), lpar=(), rpar=()))[2:-1]
        if "\n" in args or len(args.strip()) > ARGS_LIMIT:
            return updated.with_changes(args=[cst.Arg(cst.Ellipsis())],
                                        whitespace_before_args=cst.SimpleWhitespace(""))
        return updated


# --------------------------------------------------------------------------- new


def skeleton(name: str, module: str | None = None, target: str | None = None) -> str:
    """A commented starting spec (format 1.1) for ``source-patch new NAME``."""
    module = module or "your_package.your_module"
    target = target or "your_function"
    # Checked here, as the loader would: a bad value could also break the YAML text.
    if not _ID_RE.match(name):
        raise SourcePatchError(f"spec name {name!r}: use letters, digits, '_', '.', '-' "
                               f"(starting with a letter or digit)")
    if not _DOTTED_RE.match(module):
        raise SourcePatchError(f"module {module!r}: expected a dotted module name")
    if not _TARGET_RE.match(target):
        raise SourcePatchError(f"target {target!r}: expected a function, Class.method, "
                               f"or {MODULE_TARGET}")
    pid = (target if target != MODULE_TARGET else "module").lstrip("_") or "patch"
    return _SKELETON.format(name=_scalar(name), module=module, target=target, pid=_scalar(pid),
                            event=name, requires=_requires_block(module))


_DISTRIBUTIONS = {"megatron": "megatron-core", "sglang": "sglang"}  # when no metadata says so


def derived_requirement(module: str) -> tuple[str, str] | None:
    """(distribution, ">=major.minor" of its installed version) for a module's top-level
    package; None for the standard library, or when the distribution or its version is unknown."""
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    top = module.partition(".")[0]
    if top in sys.stdlib_module_names:
        return None
    dists = metadata.packages_distributions().get(top) or [_DISTRIBUTIONS.get(top)]
    for dist in filter(None, dists):
        try:
            release = Version(installed_version(dist) or "").release
        except InvalidVersion:
            continue
        return dist, ">=" + ".".join(map(str, release[:2]))
    return None


def _requires_block(module: str) -> str:
    """The patch's ``requires`` lines: the installed distribution of ``module`` as a lower bound
    (a patch gated on the wrong distribution would never apply), else a commented example."""
    if module.partition(".")[0] in sys.stdlib_module_names:
        return "    # requires: none (the standard library)\n"
    found = derived_requirement(module)
    if found is None:
        return ("    # requires:                     # none derived: the module's distribution or its\n"
                "    #   your-distribution: \">=1.0\"  # version is unknown here; name it if it has one\n")
    dist, wanted = found
    return (f"    requires:                       # this patch only: when unmet, the patch is skipped\n"
            f"      {dist}: \"{wanted}\"          # the installed release, as a lower bound\n")


def _scalar(text: str) -> str:
    """``text`` as a YAML string: quoted where YAML would read it otherwise (1.1, yes, null)."""
    return text if isinstance(yaml.safe_load(text), str) else json.dumps(text)


_SKELETON = """\
# source-patch spec: rewrites {module} as it is imported.
# Reference: docs/spec.md (every field); walk-through: docs/authoring.md.
# List the anchors of the target, with patterns ready to paste:
#   source-patch anchors {module}:{target}
# Verify where each edit lands (run it in CI):  source-patch check THIS_FILE
source_patch: 1.1
name: {name}
description: >
  What this spec observes or changes, and why.
# requires:                         # whole spec: distribution -> PEP 440 specifier (quote it)
#   megatron-core: ">=0.16,<0.17"
# on_unmet: error                   # error | skip, when the spec's requires is unmet
patches:
  - id: {pid}
    module: {module}
    # target: a function, Class.method, outer.inner, or <module> (top-level code)
    target: {target}
    description: What this patch does.
{requires}    on_drift: error                 # anchors no longer match upstream: error (the import
                                    # fails) | warn (skip this patch, warn) | skip (silently)
    edits:
      # Anchor kinds (at:), each described in docs/spec_edits.md#edits:
      #   at: entry    the start of the body, after the docstring (always one site)
      #   at: return   every `return X` of the function itself: `result = X`, your
      #                code, then `return result` (name it with bind:)
      #   at: before   before each statement that matches `match`
      #   at: after    after each statement that matches `match`
      #   at: replace  instead of each matching statement (`code: pass` removes it)
      #   at: call     each matching call C becomes `wrap`, with __call__ standing for C
      # Patterns: `_` matches any expression, `...` any further arguments, and a
      # compound statement matches by its header ending in ':' ("for _ in range(_):").
      # count: how many matches to expect (default 1, or all); any other number
      # fails the import, so upstream drift cannot go unnoticed.
      - at: entry
        code: |
          pass  # your code; __sp__ reaches source_patch.runtime, e.g. __sp__.emit("{event}.entry", x)
      # - at: return
      #   count: 1
      #   code: __sp__.emit("{event}.result", result)
      # - at: after
      #   match: "_, top_indices = compute_topk(...)"
      #   count: 1
      #   code: __sp__.emit("{event}.indices", top_indices)
      # - at: call
      #   match: "torch.topk(...)"
      #   wrap: __sp__.emit("{event}.topk", __call__)
"""
