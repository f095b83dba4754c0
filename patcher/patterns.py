"""Structural matching of code patterns against source, on Python's ``ast``.

A pattern is ordinary Python in which

* the name ``_`` matches any expression (and, as an attribute or keyword name,
  any identifier): ``_, top_indices = compute_topk(...)``;
* ``...`` inside a call's arguments matches any further arguments, positional
  or keyword: ``torch.topk(scores, ...)``;
* a compound statement header ending in ``:`` matches on its header alone:
  ``for _ in range(_):``.

Formatting, comments and parentheses never matter: both sides are compared as
syntax trees.
"""

from __future__ import annotations

import ast

WILDCARD = "_"
_COMPOUND = tuple(getattr(ast, name) for name in (
    "If", "For", "AsyncFor", "While", "With", "AsyncWith", "Try", "TryStar", "Match",
    "FunctionDef", "AsyncFunctionDef", "ClassDef") if hasattr(ast, name))
_IDENTIFIER_FIELDS = {"id", "attr", "arg", "name", "module"}
_IGNORED_FIELDS = {"ctx", "type_comment", "kind"}
_BODY_FIELDS = {"body", "orelse", "finalbody", "handlers"}


class Pattern:
    """A compiled pattern; ``matches(code)`` takes the source text of one candidate."""

    def __init__(self, text: str, *, call: bool):
        self.text = text
        self.tree = parse_pattern(text, call=call)
        self.header_only = not call and text.rstrip().endswith(":")
        self.compound = isinstance(self.tree, _COMPOUND)

    def matches(self, code: str) -> bool:
        try:
            module = ast.parse(code)
        except SyntaxError:
            return False
        if len(module.body) != 1:
            return False
        node = module.body[0]
        if isinstance(self.tree, ast.expr):
            if not isinstance(node, ast.Expr):
                return False
            node = node.value
        return _match(self.tree, node, skip=_BODY_FIELDS if self.header_only else ())


def parse_pattern(text: str, *, call: bool) -> ast.AST:
    """Parse a match pattern: a statement (or compound header ending in ':') or a call."""
    if call:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.Call):
            raise ValueError("a call pattern must be a call expression such as 'torch.topk(...)'")
        return tree
    module = ast.parse(_complete_header(text))
    if len(module.body) != 1:
        raise ValueError("a statement pattern must be exactly one statement")
    return module.body[0]


def _complete_header(text: str) -> str:
    return text + "\n    pass" if text.rstrip().endswith(":") else text


def _match(pattern, node, skip=()) -> bool:
    if isinstance(pattern, ast.Name) and pattern.id == WILDCARD and isinstance(node, ast.expr):
        return True
    if type(pattern) is not type(node):
        return False
    if isinstance(pattern, ast.Call):
        return _match(pattern.func, node.func) and _match_arguments(pattern, node)
    for name in pattern._fields:
        if name in _IGNORED_FIELDS or name in skip:
            continue
        want, have = getattr(pattern, name, None), getattr(node, name, None)
        if name in _IDENTIFIER_FIELDS and want == WILDCARD and isinstance(have, str):
            continue
        if not _match_value(want, have):
            return False
    return True


def _match_value(want, have) -> bool:
    if isinstance(want, ast.AST):
        return isinstance(have, ast.AST) and _match(want, have)
    if isinstance(want, list):
        return isinstance(have, list) and _match_list(want, have)
    return want == have and type(want) is type(have)


def _is_ellipsis(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _match_list(want: list, have: list) -> bool:
    """Element-wise match where a ``...`` element matches zero or more elements."""
    if not want:
        return not have
    head, rest = want[0], want[1:]
    if _is_ellipsis(head):
        return any(_match_list(rest, have[i:]) for i in range(len(have) + 1))
    return bool(have) and _match_value(head, have[0]) and _match_list(rest, have[1:])


def _match_arguments(pattern: ast.Call, node: ast.Call) -> bool:
    """Positional arguments in order; with ``...`` present, keywords may be extra."""
    if not _match_list(pattern.args, node.args):
        return False
    loose = any(_is_ellipsis(a) for a in pattern.args)
    if not loose and len(node.keywords) != len(pattern.keywords):
        return False
    unused = list(node.keywords)
    # Named keywords first, so a wildcard name (`_=...`) cannot take their partner.
    for kw in sorted(pattern.keywords, key=lambda k: k.arg == WILDCARD):
        partner = next((k for k in unused if (kw.arg == WILDCARD and k.arg is not None
                                               or k.arg == kw.arg) and _match(kw.value, k.value)),
                       None)
        if partner is None:
            return False
        unused.remove(partner)
    return True
