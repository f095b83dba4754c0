"""Line numbers of the patched module: every original line keeps its number and
inserted code reports the line of its anchor (``_line_map``), and the patched
module's ast carries them (``_remap``), so tracebacks point into the original file.

Part of the rewrite (engine.py); names with an underscore are shared by the rewrite
modules, not a public API.
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider


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
