"""Line numbers of the patched module: every original line keeps its number and
inserted code reports the line of its anchor (``_line_map``), and the patched
module's ast carries them (``_remap``), so tracebacks point into the original file.

Inserted spec code has no columns (``_remap``): no printer draws carets under the
anchor's upstream text for it, and source-patch's excepthook (activation.py) tells it
apart and prints the inserted line instead (``inserted_text``).  Which inserted line an
instruction comes from, the display reads from a twin of the code compiled with
``mark``: the same bytecode, its inserted code spanning the anchor's line and one
column more per patched line before it that stands for the same anchor line.  (Not the
end line: Python 3.11+ moves an attribute's instructions to its end line.)

Part of the rewrite (engine.py); names with an underscore are shared by the rewrite
modules, not a public API.
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from .anchors import NOTE_NAME


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


def _remap(patched: str, original: str, file: str, line_map: list[int], mark: bool = False) -> ast.Module:
    tree = ast.parse(patched, filename=file)
    new_lines = patched.splitlines()
    old_lines = original.splitlines()

    def same_text(k: int) -> bool:
        o = line_map[k]
        return 0 < k <= len(new_lines) and 0 < o <= len(old_lines) and new_lines[k - 1] == old_lines[o - 1]

    spec_code, rank = _spec_code(tree), _ranks(line_map)
    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or node.lineno is None:
            continue
        if id(node) in spec_code:
            # The anchor's line (pdb, coverage and tracebacks keep it), no columns; the
            # twin (mark) spans the line and past its end by 1 + the rank of its patched
            # line among those standing for the anchor: which inserted line it is.
            k = node.lineno
            node.lineno = node.end_lineno = line_map[k]
            node.col_offset = node.end_col_offset = -1
            if mark:
                node.col_offset, node.end_col_offset = 0, len(_line(old_lines, line_map[k]).encode()) + 1 + rank[k]
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        if not (same_text(start) and same_text(end)):
            # Columns on a rewritten line no longer fit the original text: span the
            # original line from its first character to its last, which makes tracebacks
            # (Python's own printer too, which wants exactly that span) print no carets.
            orig = _line(old_lines, line_map[start])
            node.end_col_offset = len(orig.rstrip().encode())
            node.col_offset = min(len(orig.encode()) - len(orig.lstrip().encode()), node.end_col_offset)  # a blank line: 0, 0
            end = start
        node.lineno = line_map[start]
        node.end_lineno = max(line_map[end], node.lineno)
    return tree


def _line(lines: list[str], number: int) -> str:
    return lines[number - 1] if 0 < number <= len(lines) else ""


def _spec_code(tree: ast.Module) -> set[int]:
    """The ids of the nodes of inserted spec code: the body of each ``try`` whose handler
    notes the patch (anchors._noted), which only inserted code has."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and len(node.handlers) == 1 and node.handlers[0].name == NOTE_NAME:
            found.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return found


def _ranks(line_map: list[int]) -> list[int]:
    """For each patched line, how many earlier patched lines stand for the same original line."""
    seen: dict[int, int] = {}
    out = []
    for original in line_map:
        out.append(seen.get(original, 0))
        seen[original] = out[-1] + 1
    return out


def inserted_text(original: list[str], patched: list[str], line_map: list[int], line: int,
                  end_column: int) -> str | None:
    """The inserted line an instruction at ``line`` of the original file, its span in the
    twin (_remap's ``mark``) ending at ``end_column``, comes from, stripped; None where it
    is no inserted code (its span ends within the line, or that patched line is original)."""
    rank = end_column - len(_line(original, line).encode()) - 1
    lines = [k for k in range(1, min(len(line_map), len(patched) + 1)) if line_map[k] == line]
    if not 0 <= rank < len(lines):
        return None
    text = patched[lines[rank] - 1]
    if 0 < line <= len(original) and text == original[line - 1]:
        return None
    return text.strip()
