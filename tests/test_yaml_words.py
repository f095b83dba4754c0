"""patcher.yaml_words: PyYAML syntax errors in plain words, at a line inside the file.

Every case is a small broken spec fed to the real PyYAML (the loader spec.py uses),
so the phrases matched are the ones PyYAML really produces."""

import pytest
import yaml

from source_patch.patcher.yaml_words import explain

INDENT = ("this line's indentation does not line up with the lines above it: keys of one mapping"
          " must start in the same column, and so must the '- ' items of one list")
COLON = ("a ': ' inside a plain value; put the value in quotes"
         " (or, if this line is a key, indent it like the keys above it)")
NO_KEY = ("a line without 'key: value' where a key was expected"
          " (or a quote that is never closed above it)")
TAB = "a tab character: YAML indents with spaces only"
END = "at the end of the file: "


def error(text, loader=yaml.SafeLoader, construct=False):
    with pytest.raises(yaml.MarkedYAMLError) as info:
        yaml.load(text, Loader=loader) if construct else yaml.compose(text, Loader=loader)
    return info.value


def lines(text):
    return max(1, len(text.splitlines()))


CASES = {
    "key not lined up": (
        "source_patch: '1.1'\nname: s\npatches:\n  - id: a\n    module: m\n   target: f\n",
        f"{INDENT} (expected <block end>, but found '<block mapping start>')", 6, 4),
    "list item out of line": (
        "patches:\n  - id: a\n  module: m\n",
        f"{INDENT} (expected <block end>, but found '?')", 3, 3),
    "list item in a mapping": (
        "name: s\n- id: a\n",
        f"{INDENT} (expected <block end>, but found '-')", 2, 1),
    "colon in plain value": (
        "name: s\ndescription: fix: the router\n",
        f"{COLON} (mapping values are not allowed here)", 2, 17),
    "key indented deeper": (
        "name: s\n  patches: []\n",
        f"{COLON} (mapping values are not allowed here)", 2, 10),
    "bare word": (
        "name: s\npatches\nhandle: h\n",
        f"{NO_KEY} (could not find expected ':')", 2, 1),
    "tab indent": (
        "name: s\npatches:\n\t- id: a\n",
        f"{TAB} (found character '\\t' that cannot start any token)", 3, 1),
    "undefined alias": (
        "name: s\nhandle: *h\n",
        "'*' starts an alias, but no anchor '&' of that name is defined above it;"
        " put the value in quotes if the '*' is meant literally (found undefined alias 'h')", 2, 9),
    "two documents": (
        "name: a\n---\nname: b\n",
        "a second document starts here; a spec file is one YAML document, so remove this '---'"
        " (expected a single document in the stream, but found another document)", 2, 1),
    "duplicate anchor": (
        "a: &x 1\nb: &x 2\n",
        "an anchor name '&' used twice (first at line 1); give each anchor its own name"
        " (found duplicate anchor 'x'; first occurrence, second occurrence)", 2, 4),
    "text after block indicator": (
        "edits:\n  - at: entry\n    code: | x = 1\n      y = 2\n",
        "text after '|' or '>' on the same line; start the block's text on the next line,"
        " indented under its key (expected a comment or a line break, but found 'x')", 3, 13),
    "flow mapping missing comma": (
        "runtime: {dump: on trace: off}\n",
        "the '{' mapping opened at line 1 needs a ',' between entries and a closing '}'"
        " (expected ',' or '}', but got ':')", 1, 25),
    "flow sequence wrong closer": (
        "requires: [a, b}\n",
        "the '[' list opened at line 1 needs a ',' between items and a closing ']'"
        " (expected ',' or ']', but got '}')", 1, 16),
    "unknown escape": (
        'match: "re.sub(\'\\d\', x)"\n',
        "an unknown backslash escape inside double quotes; write '\\\\' for a backslash,"
        " or use single quotes (found unknown escape character 'd')", 1, 18),
    "decorator unquoted": (
        "match: @torch.no_grad\n",
        "'@' cannot start a plain value; put the value in quotes"
        " (found character '@' that cannot start any token)", 1, 8),
    "anything else": (
        "name: &\n",
        "expected alphabetic or numeric character, but found '\\n'", 1, 8),
}

AT_END = {
    "unclosed quote": (
        "name: 's\npatches: []\n",
        f"{END}a quote that is never closed; it opened at line 1 (found unexpected end of stream)",
        2, 12),
    "unclosed quote, no trailing newline": (
        'name: s\ndescription: "abc',
        f"{END}a quote that is never closed; it opened at line 2 (found unexpected end of stream)",
        2, 18),
    "unclosed flow sequence": (
        "name: s\nrequires: [a, b\n",
        f"{END}the '[' list opened at line 2 needs a ',' between items and a closing ']'"
        " (expected ',' or ']', but got '<stream end>')", 2, 16),
    "unclosed flow sequence, no trailing newline": (
        "name: s\nrequires: [a, b",
        f"{END}the '[' list opened at line 2 needs a ',' between items and a closing ']'"
        " (expected ',' or ']', but got '<stream end>')", 2, 16),
    "unclosed flow mapping, blank lines after": (
        "name: s\nruntime: {dump: on\n\n  \n",
        f"{END}the '{{' mapping opened at line 2 needs a ',' between entries and a closing '}}'"
        " (expected ',' or '}', but got '<stream end>')", 2, 19),
}


@pytest.mark.parametrize("text, message, line, column", CASES.values(), ids=CASES.keys())
def test_phrases(text, message, line, column):
    assert explain(error(text), text) == (message, line, column)


@pytest.mark.parametrize("text, message, line, column", AT_END.values(), ids=AT_END.keys())
def test_end_of_stream_is_clamped_into_the_file(text, message, line, column):
    exc = error(text)
    assert exc.problem_mark.line + 1 > lines(text) or exc.problem_mark.index >= len(text)
    assert explain(exc, text) == (message, line, column)
    assert 1 <= line <= lines(text)


def test_unhashable_key_from_the_constructor():
    text = "name: s\n? [a, b]\n: c\n"
    assert explain(error(text, construct=True), text) == (
        "a key that is a list or a mapping; keys must be plain values (put it in quotes)"
        " (found unhashable key)", 2, 3)


def test_empty_text_and_no_mark():
    mark = yaml.Mark("<s>", 0, 3, 0, None, None)  # a mark past the end of an empty stream
    assert explain(yaml.MarkedYAMLError(problem="odd", problem_mark=mark), "") == (
        "at the end of the file: odd", 1, 1)
    assert explain(yaml.MarkedYAMLError(problem="odd"), "a: 1\n") == ("odd", 1, 1)


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="libyaml words need CSafeLoader")
@pytest.mark.parametrize("text, message, line, column", [
    ("name: s\n- id: a\n",
     "this line should be a 'key: value' lined up with the keys above it"
     " (a '- ' item or a bare word cannot go there) (did not find expected key)", 2, 1),
    ("patches:\n  - id: a\n  module: m\n",
     "this line should be a '- ' item lined up with the other items of the list above it"
     " (did not find expected '-' indicator)", 3, 3),
    ("name: s\nrequires: [a, b",
     f"{END}the '[' list opened at line 2 needs a ',' between items and a closing ']'"
     " (did not find expected ',' or ']')", 2, 16),
])
def test_libyaml_words(text, message, line, column):
    assert explain(error(text, yaml.CSafeLoader), text) == (message, line, column)


def test_every_line_is_inside_the_file():
    for text, *_ in [*CASES.values(), *AT_END.values()]:
        _, line, column = explain(error(text), text)
        assert 1 <= line <= lines(text) and column >= 1
