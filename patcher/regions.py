"""The region path of the rewrite: parse, plan, transform and line-map only the def of
each target, and splice the result back into the untouched text.

The whole-module path (engine.py) spends most of its time on code that no patch touches:
resolving positions (which generates the module's code), visiting every node, and
generating the patched module.  A patch that names a function changes only that
function's lines, so the region path below parses, plans, transforms and line-maps
just the def of each target (decorators included) and splices the result back into
the untouched text.  It must give exactly what the whole-module path gives (source,
line map, hits): tests/test_engine_regions.py compares the two.  Wherever it cannot
be sure of that, or anything is wrong (a target missing, defined twice, a class; an
edit that does not match; a handle clash), it returns None and the whole-module path
runs, which also builds every error.

Part of the rewrite (engine.py); names with an underscore are shared by the rewrite
modules, not a public API.
"""

from __future__ import annotations

import ast
import io
import tokenize
import warnings
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .anchors import _handle_problems, _Locator, _Plan, _qualnames
from .linemap import _carry, _line_map
from .spec import MODULE_TARGET, Patch
from .transform import _Transformer


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


def rewrite_regions(source: str, patches: Sequence[Patch]) -> tuple[str, list[int], list] | None:
    """(patched source, line map, hits), or None: the whole-module path must run."""
    checked = _checked(source, patches)
    if checked is None:
        return None
    module_ast, pieces = checked
    found = _regions(module_ast, pieces, patches)
    default_indent = _first_indent(source) if found is not None else None
    if not default_indent:
        return None
    ordered, region_of = found
    parsed: dict[int, _Parsed] = {}
    for r in ordered:
        one = _parse_region(r, pieces, default_indent)
        if one is None:
            return None
        parsed[id(r)] = one
    plan = _plan(patches, region_of, parsed)
    if plan is None or parsed[id(ordered[0])].locator.replace_conflicts(plan):
        return None
    spliced = _splice(source, pieces, ordered, parsed, plan, _unclaimed(module_ast, ordered, pieces))
    return None if spliced is None else (*spliced, plan.hits)


def _checked(source: str, patches: Sequence[Patch]) -> tuple[ast.Module, list[str]] | None:
    """(the module's ast, its lines) where the region path may try it, else None."""
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
    return module_ast, pieces


def _regions(module_ast: ast.Module, pieces: list[str], patches: Sequence[Patch]):
    """(the regions in file order, each patch's region and its def's name in it), or
    None where a target or its region does not fit the region path."""
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
            region = _region(node, chain, pieces)
            if region is None:
                return None
            regions[id(node)] = region
        region_of.append((regions[id(node)], inner))
    ordered = sorted(regions.values(), key=lambda r: r.start)
    if any(b.start <= a.end for a, b in zip(ordered, ordered[1:])):
        return None
    return ordered, region_of


def _region(node: ast.AST, chain: tuple, pieces: list[str]) -> _Region | None:
    """The lines of a target's def, or None where the region path cannot take it."""
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
    return _Region(node, chain, start, end, indent)


def _parse_region(r: _Region, pieces: list[str], default_indent: str) -> _Parsed | None:
    """Parse a region alone.  A scaffold puts the def at its own indentation (no text
    is re-indented, so strings spanning lines are untouched) and gives the region
    module the file's default indent, which inserted blocks are written with."""
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
    return _Parsed(prefix, tree, fn, positions, offset, _Locator(tree, positions, offset, defs={}))


def _plan(patches: Sequence[Patch], region_of: list, parsed: dict[int, _Parsed]) -> _Plan | None:
    """Every edit located in its region; None on drift or a statement replaced twice
    (the whole-module path reports them)."""
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
            return None
    return plan


def _unclaimed(module_ast: ast.Module, ordered: list[_Region], pieces: list[str]) -> set[int]:
    """Lines the whole-module line map leaves unclaimed outside the regions (it carries
    the line above into them).  It maps an untouched statement by its range, which
    leaves out, of the statements in the blocks that enclose a region, the comments
    between the decorators of a def or class and its `def`/`class` line, and the
    comment lines after a compound statement that its blocks own."""
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
    return unclaimed


def _splice(source: str, pieces: list[str], ordered: list[_Region], parsed: dict[int, _Parsed], plan: _Plan,
            unclaimed: set[int]) -> tuple[str, list[int]] | None:
    """(patched source, line map): each region transformed along the plan and put back
    between the untouched lines; None where the result would not be the whole path's."""
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
    return patched, _carry(mapping)


_NOT_SIGNIFICANT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                    tokenize.ENDMARKER)
