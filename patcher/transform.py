"""The rewrite of a libcst tree along a plan (anchors.py's ``_Plan``): insert code at
a def's entry, before and after statements, around returns and calls, or in place
of a statement, and record for each new statement which original line it stands
for (the line map: linemap.py).

Part of the rewrite (engine.py); names with an underscore are shared by the rewrite
modules, not a public API.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from .anchors import _Plan
from .spec import CALL_PLACEHOLDER


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
