"""PyYAML syntax errors in plain words, at a line that exists.

PyYAML says what its parser expected ("expected <block end>, but found
'<block mapping start>'"), not what the author got wrong, and its mark can lie
past the last line.  :func:`explain` maps the error to a sentence saying what is
wrong and how to fix it, keeps PyYAML's own phrase in parentheses (so it can be
searched for), and clamps the line into the file.  Both wordings are matched:
PyYAML's pure-Python parser and libyaml's (CSafeLoader).
"""

from __future__ import annotations

import re

import yaml

_LINE_BREAK = re.compile(r"\r\n|[\n\r\x85\u2028\u2029]")  # what YAML counts as a line break

# (regex searched in "context | problem", words, mark to report: "problem" or "context").
# First match wins, so the specific rows come before the ones they overlap.
_RULES = [
    (r"found character '\\t'|tab character",
     "a tab character: YAML indents with spaces only", "problem"),
    (r"quoted scalar.*end of stream",
     "a quote that is never closed; it opened at line {open}", "problem"),
    (r"expected <block end>",
     "this line's indentation does not line up with the lines above it: keys of one mapping"
     " must start in the same column, and so must the '- ' items of one list", "problem"),
    # libyaml's two words for the same mistake, telling which kind of block it was in
    (r"did not find expected key",
     "this line should be a 'key: value' lined up with the keys above it"
     " (a '- ' item or a bare word cannot go there)", "problem"),
    (r"did not find expected '-' indicator",
     "this line should be a '- ' item lined up with the other items of the list above it", "problem"),
    (r"mapping values are not allowed",
     "a ': ' inside a plain value; put the value in quotes"
     " (or, if this line is a key, indent it like the keys above it)", "problem"),
    # the problem mark is the line after; the context mark is the line without ':'
    (r"could not find expected ':'",
     "a line without 'key: value' where a key was expected"
     " (or a quote that is never closed above it)", "context"),
    (r"found undefined alias",
     "'*' starts an alias, but no anchor '&' of that name is defined above it;"
     " put the value in quotes if the '*' is meant literally", "problem"),
    (r"found unhashable key",
     "a key that is a list or a mapping; keys must be plain values (put it in quotes)", "problem"),
    (r"expected a single document",
     "a second document starts here; a spec file is one YAML document, so remove this '---'", "problem"),
    (r"duplicate anchor",
     "an anchor name '&' used twice (first at line {open}); give each anchor its own name", "problem"),
    (r"block scalar.*(comment or (a )?line break)",
     "text after '|' or '>' on the same line; start the block's text on the next line,"
     " indented under its key", "problem"),
    (r"flow sequence",
     "the '[' list opened at line {open} needs a ',' between items and a closing ']'", "problem"),
    (r"flow mapping",
     "the '{{' mapping opened at line {open} needs a ',' between entries and a closing '}}'", "problem"),
    (r"unknown escape character",
     "an unknown backslash escape inside double quotes; write '\\\\' for a backslash,"
     " or use single quotes", "problem"),
    # '@' and '`' are reserved: a decorator or a code span as a plain value
    (r"found character '(?P<ch>[@`])' that cannot start",
     "'{ch}' cannot start a plain value; put the value in quotes", "problem"),
]
_RULES = [(re.compile(rx, re.S), words, which) for rx, words, which in _RULES]


def explain(exc: yaml.MarkedYAMLError, text: str) -> tuple[str, int, int]:
    """(message in plain words, line, column) for a YAML error in ``text``, 1-based;
    the line is always one of the file's (1 for an empty file)."""
    context, problem = exc.context or "", exc.problem or ""
    # a context that is not "while ..." is half of the sentence ("expected a single document ...")
    phrase = f"{context}, {problem}" if context and problem and not context.startswith("while") \
        else problem or context
    haystack = f"{context} | {problem}"
    words, which = phrase, "problem"  # user text: never a format string
    for rx, template, where in _RULES:
        found = rx.search(haystack)
        if found:
            opened = exc.context_mark.line + 1 if exc.context_mark else 1
            words = f"{template.format(open=opened, **found.groupdict())} ({phrase})"
            which = where
            break
    mark = (exc.context_mark if which == "context" else exc.problem_mark) \
        or exc.problem_mark or exc.context_mark

    lines = _LINE_BREAK.split(text)
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()  # the break ending the last line does not start another
    if mark is None:
        return words, 1, 1
    if mark.index < len(text) and mark.line < len(lines):
        return words, mark.line + 1, mark.column + 1
    # at or past the end of the stream: point just after the last line with text
    last = max((i for i, line in enumerate(lines) if line.strip()), default=0)
    return f"at the end of the file: {words}", last + 1, len(lines[last]) + 1
