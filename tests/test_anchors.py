"""Each anchor kind, applied at import time to the fixture package spfix.basic."""

import importlib
import linecache
import sys
import traceback

import pytest

from source_patch.patcher import AnchorError, patched
from source_patch.runtime import capture

HEAD = """
source_patch: 1
name: t
patches:
"""


def patch_spec(write_spec, target, edits, module="spfix.basic", pid="p"):
    return write_spec(HEAD + f"""
  - id: {pid}
    module: {module}
    target: {target}
    edits:
""" + "".join(f"      - {e}\n" for e in edits))


def load(spec):
    """Import spfix.basic under the spec; the context removes it afterwards."""
    return patched(spec)


def test_entry_runs_after_the_docstring(write_spec):
    spec = patch_spec(write_spec, "add", ['{at: entry, code: "__sp__.emit(\'add\', (a, b))"}'])
    with load(spec), capture("add") as events:
        from spfix import basic
        assert basic.add(2, 3) == 5
        assert basic.add.__doc__ == "Add two numbers."
    assert [e.value for e in events] == [(2, 3)]


def test_return_binds_the_value_and_may_replace_it(write_spec):
    spec = patch_spec(write_spec, "branches",
                      ['{at: return, count: 3, bind: out, code: "out = out.upper()"}'])
    with load(spec):
        from spfix import basic
        # One return sits on an `if x: return ...` line: it must be patched too.
        assert [basic.branches(v) for v in (1, -1, 0)] == ["POSITIVE", "NEGATIVE", "ZERO"]


def test_before_after_and_replace_with_wildcards(write_spec):
    spec = patch_spec(write_spec, "loop", [
        '{at: before, match: "for _ in range(_):", code: "__sp__.emit(\'start\', n)"}',
        '{at: replace, match: "acc += math.floor(_)", code: "acc += i"}',
        '{at: after, match: "acc = _", code: "acc = 100"}',
    ])
    with load(spec), capture() as events:
        from spfix import basic
        assert basic.loop(4) == 100 + 0 + 1 + 2 + 3
    assert [(e.name, e.value) for e in events] == [("start", 4)]


def test_call_wrap(write_spec):
    spec = patch_spec(write_spec, "loop", [
        '{at: call, match: "math.floor(...)", wrap: "__sp__.emit(\'floor\', __call__) * 2"}'])
    with load(spec), capture("floor") as events:
        from spfix import basic
        assert basic.loop(3) == 2 * (0 + 1 + 3)
    assert [e.value for e in events] == [0, 1, 3]


def test_nested_class_method_and_nested_function(write_spec):
    spec = write_spec(HEAD + """
  - id: inner
    module: spfix.basic
    target: Outer.Inner.method
    edits:
      - {at: return, code: "result = -result"}
  - id: nested
    module: spfix.basic
    target: with_nested.helper
    edits:
      - {at: entry, code: "z = z + 1"}
""")
    with load(spec):
        from spfix import basic
        assert basic.Outer.Inner().method(2) == -20
        assert basic.Outer().method(2) == 2  # same name, other class: untouched
        assert basic.with_nested(1) == (1 + 1) * 3 + 1


def test_one_line_function_body(write_spec):
    spec = patch_spec(write_spec, "one_liner", ['{at: entry, code: "x = x * 10"}',
                                                '{at: return, code: "result += 1"}'])
    with load(spec):
        from spfix import basic
        assert basic.one_liner(1) == 12


def test_patched_module_records_its_patches(write_spec):
    spec = patch_spec(write_spec, "add", ['{at: entry, code: "pass"}'], pid="record-me")
    with load(spec):
        from spfix import basic
        (applied,) = basic.__source_patches__
        assert (applied.spec, applied.patch, applied.target) == ("t", "record-me", "add")
        assert applied.spec_file == str(spec)


def test_original_line_numbers_survive_insertions_above_a_raise(write_spec):
    """Tracebacks, linecache and co_firstlineno point at the real file and line."""
    plain = _unpatched()
    raise_line = _line_of(plain, "raise ValueError(message)")
    spec = patch_spec(write_spec, "fails", [
        '{at: entry, code: "__sp__.emit(\'a\')\\n__sp__.emit(\'b\')\\nif value:\\n    __sp__.emit(\'c\')"}',
        '{at: before, match: "message = _", code: "x = 1\\ny = 2\\nz = 3"}',
    ])
    with load(spec):
        from spfix import basic
        assert basic.fails.__code__.co_firstlineno == plain.fails.__code__.co_firstlineno
        with pytest.raises(ValueError) as info:
            basic.fails(3)
        frame = traceback.extract_tb(info.tb)[-1]
        assert (frame.filename, frame.lineno) == (basic.__file__, raise_line)
        assert frame.line == "raise ValueError(message)"
        assert linecache.getline(basic.__file__, raise_line).strip() == "raise ValueError(message)"


def test_inserted_code_reports_its_anchor_line(write_spec):
    plain = _unpatched()
    anchor = _line_of(plain, "message = f")
    def_line = plain.fails.__code__.co_firstlineno
    spec = patch_spec(write_spec, "fails", [
        '{at: before, match: "message = _", code: "if doubled == 8:\\n    1 / 0"}',
        '{at: entry, code: "if value == 0:\\n    [][1]"}',
    ])
    with load(spec):
        from spfix import basic
        with pytest.raises(ZeroDivisionError) as info:
            basic.fails(4)
        assert traceback.extract_tb(info.tb)[-1].lineno == anchor
        with pytest.raises(IndexError) as info:
            basic.fails(0)
        assert traceback.extract_tb(info.tb)[-1].lineno == def_line


def _unpatched():
    """An unpatched spfix.basic, forgotten again so the next import is a fresh one."""
    module = importlib.import_module("spfix.basic")
    del sys.modules["spfix.basic"], sys.modules["spfix"].basic
    return module


def _line_of(module, text):
    with open(module.__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


# ----------------------------------------------------------------------------- failures


def test_wrong_match_count_names_everything_and_patches_nothing(write_spec):
    spec = write_spec(HEAD + """
  - id: good
    module: spfix.basic
    target: add
    edits:
      - {at: entry, code: "pass"}
  - id: off-by-one
    module: spfix.basic
    target: loop
    edits:
      - {at: before, match: "acc += math.ceil(_)", code: "pass"}
""")
    with load(spec):
        with pytest.raises(AnchorError) as info:
            importlib.import_module("spfix.basic")
        assert "spfix.basic" not in sys.modules  # nothing half-patched stays behind
    message = str(info.value)
    assert "patch 'off-by-one'" in message and f"{spec}:" in message
    assert "spfix/basic.py" in message and "spfix.basic" in message
    assert "expected 1 match, found 0" in message
    assert "acc += math.floor(i * 1.5)" in message  # the nearest candidate
    assert "good" not in message


def test_too_many_matches_lists_their_lines(write_spec):
    spec = patch_spec(write_spec, "branches", ['{at: return, code: "pass"}'])
    with load(spec), pytest.raises(AnchorError, match=r"expected 1 match, found 3 at lines"):
        importlib.import_module("spfix.basic")


def test_unknown_target_suggests_near_names(write_spec):
    spec = patch_spec(write_spec, "Outer.Iner.method", ['{at: entry, code: "pass"}'])
    with load(spec), pytest.raises(AnchorError, match=r"not found; nearest: Outer.Inner.method"):
        importlib.import_module("spfix.basic")


def test_handle_name_clash_is_an_error(write_spec):
    spec = write_spec(HEAD.replace("name: t", "name: t\nhandle: math") + """
  - id: p
    module: spfix.basic
    target: add
    edits:
      - {at: entry, code: "pass"}
""")
    with load(spec), pytest.raises(AnchorError, match="already uses the name 'math'"):
        importlib.import_module("spfix.basic")


def test_anchor_error_is_not_an_import_error(write_spec):
    """Upstream `try: import x except ImportError` must not swallow a broken patch."""
    spec = patch_spec(write_spec, "nope", ['{at: entry, code: "pass"}'])
    with load(spec):
        with pytest.raises(AnchorError):
            try:
                importlib.import_module("spfix.basic")
            except ImportError:
                pytest.fail("an anchor error must not be an ImportError")


def test_an_elif_clause_is_not_a_statement_anchor(write_spec):
    """`before: 'if x > 5:'` must not 'match' the elif and then silently do nothing."""
    spec = patch_spec(write_spec, "route", ['{at: before, match: "if x > 5:", code: "pass"}'])
    with load(spec), pytest.raises(AnchorError, match="expected 1 match, found 0"):
        importlib.import_module("spfix.basic")


def test_nearest_candidates_show_code_not_comments(write_spec):
    spec = patch_spec(write_spec, "route", ['{at: before, match: "if x > 1:", code: "pass"}'])
    with load(spec), pytest.raises(AnchorError) as info:
        importlib.import_module("spfix.basic")
    assert "if x > 10:" in str(info.value) and "# Pick the branch." not in str(info.value)


@pytest.mark.parametrize("other", [
    '{at: call, match: "math.floor(_)", wrap: "__call__"}',
    '{at: before, match: "acc += _", code: "pass"}',
])
def test_replace_refuses_to_discard_other_edits_inside_it(write_spec, other):
    spec = patch_spec(write_spec, "loop", [
        '{at: replace, match: "for _ in _:", code: "acc = -1"}', other])
    with load(spec), pytest.raises(AnchorError, match="would silently discard"):
        importlib.import_module("spfix.basic")


def test_replace_and_return_on_one_statement_conflict(write_spec):
    spec = patch_spec(write_spec, "loop", ['{at: replace, match: "return acc", code: "return 0"}',
                                           '{at: return, code: "result = 1"}'])
    with load(spec), pytest.raises(AnchorError, match="would silently discard"):
        importlib.import_module("spfix.basic")


def test_decorators_of_untouched_defs_keep_their_lines(write_spec):
    plain = _unpatched()
    spec = patch_spec(write_spec, "add", ['{at: entry, code: "pass\\npass\\npass"}'])
    with load(spec):
        from spfix import basic
        code = basic.decorated.__code__
        assert code.co_firstlineno == plain.decorated.__code__.co_firstlineno
        # The module-level code that applies the decorator runs on the decorator's line.
        lines = {line for _, _, line in compile_module_lines(basic)}
        assert _line_of(plain, "@passthrough") in lines


def compile_module_lines(module):
    """co_lines of the patched module's top-level code (from the code cache path)."""
    from source_patch.patcher.finder import PatchingLoader

    loader = module.__spec__.loader
    assert isinstance(loader, PatchingLoader)
    return list(loader.get_code(module.__name__).co_lines())


def test_wildcard_keyword_names_in_call_patterns(write_spec):
    spec = patch_spec(write_spec, "keywords", [
        '{at: call, match: "math.prod(_, _=3)", wrap: "__call__ * 10"}'])
    with load(spec):
        from spfix import basic
        assert basic.keywords()["call"] == 60


@pytest.mark.parametrize("edit", [
    '{at: replace, match: "acc = 0", code: "acc = 1"}',
    '{at: before, match: "acc = 0", code: "pass"}',
    '{at: return, code: "pass"}',
])
def test_comments_above_an_anchor_stay_above_the_new_code(write_spec, edit):
    from source_patch.patcher.engine import rewrite
    from source_patch.patcher.spec import load

    source = "def loop(n):\n    x = 1\n\n    # explains acc\n    acc = 0\n\n    # explains return\n    return acc\n"
    (patch,) = load(patch_spec(write_spec, "loop", [edit])).patches
    patched = rewrite(source, [patch], module="m", file="m.py").source
    for comment in ("\n\n    # explains acc\n", "\n\n    # explains return\n"):
        assert patched.count(comment) == 1


def test_module_level_code_is_a_target(write_spec):
    """`target: <module>` edits top-level code, e.g. the except branch of an optional import."""
    spec = write_spec(HEAD + """
  - id: bind-fallback
    module: spfix.basic
    target: <module>
    edits:
      - {at: after, match: "HAVE_NO_SUCH = False", code: "no_such_function = None"}
      - {at: entry, code: "__sp__.emit('top')"}
      - {at: call, match: "math.floor(...)", count: all, wrap: "__call__"}
""")
    with load(spec):
        with pytest.raises(AnchorError, match="expected one or more matches, found 0"):
            importlib.import_module("spfix.basic")  # math.floor is only called inside defs
    spec.write_text(spec.read_text().replace("      - {at: call", "#"))
    with load(spec), capture("top") as events:
        from spfix import basic
        assert basic.no_such_function is None and basic.HAVE_NO_SUCH is False
    assert len(events) == 1


def test_module_entry_goes_after_docstring_and_future_imports(write_spec):
    from source_patch.patcher.engine import rewrite
    from source_patch.patcher.spec import load

    source = '"""Doc."""\nfrom __future__ import annotations\nimport os\n'
    (patch,) = load(patch_spec(write_spec, "<module>", ['{at: entry, code: "x = 1"}'])).patches
    patched = rewrite(source, [patch], module="m", file="m.py").source
    lines = patched.splitlines()
    assert lines[:4] == ['"""Doc."""', "from __future__ import annotations", "try:", "    x = 1"]
    assert lines[-1] == "import os"
