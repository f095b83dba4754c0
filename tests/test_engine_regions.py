"""The engine's region path (parse and rewrite only the defs the patches target) gives
exactly what the whole-module path gives: the same source, line map, hits, dropped
patches and errors, byte for byte, for every shipped spec, the bench spec, the fixture
specs of the tests, and modules shaped to hit its edges."""

import ast
import glob
from pathlib import Path

import pytest

from source_patch.patcher import engine, regions
from source_patch.patcher.engine import rewrite
from source_patch.patcher.errors import AnchorError
from source_patch.patcher.locate import NotFound, find_source
from source_patch.patcher.spec import MODULE_TARGET, Edit, Patch, load, loads

REPO = Path(__file__).parent.parent


def outcome(source, patches, regions, module="m", file="m.py"):
    try:
        r = rewrite(source, patches, module=module, file=file, regions=regions)
    except AnchorError as exc:
        return ("error", str(exc))
    return (r.source, r.line_map, [(p.id, e, lines) for p, e, lines in r.hits],
            [(p.id, str(err)) for p, err in r.dropped], ast.dump(r.tree, include_attributes=True))


class _Handed(Exception):
    pass


def _handed_on_as_is(source, patches, module, file) -> bool:
    """Whether rewrite(regions=True) calls the whole-module path with these very arguments
    (stopped there: the caller has that path's outcome already)."""
    calls = []

    def whole_module(*args, **kwargs):
        calls.append((args, {k: v for k, v in kwargs.items() if k != "version"}))
        raise _Handed

    real, engine._rewrite_module = engine._rewrite_module, whole_module
    try:
        rewrite(source, patches, module=module, file=file, regions=True)
    except _Handed:
        pass
    finally:
        engine._rewrite_module = real
    return calls == [((source, patches), {"module": module, "file": file})]


def same(source, patches, *, fast, module="m", file="m.py"):
    """Assert both paths agree; ``fast``: whether the region path must take the case
    (True), must leave it to the whole-module path (False), or either (None)."""
    full = outcome(source, patches, False, module, file)
    took = engine._rewrite_regions(source, patches, file) is not None
    if took:
        regional = outcome(source, patches, True, module, file)
        if full[0] == "error" or regional[0] == "error":
            assert regional == full
        else:
            for name, mine, theirs in zip(("source", "line_map", "hits", "dropped", "tree"), regional, full):
                assert mine == theirs, f"{name} differs"
    else:
        # Declined: rewrite() hands the case to the whole-module path, whose outcome ``full`` is
        # (checked, not computed twice: on a real module that path is most of this file's time).
        assert _handed_on_as_is(source, patches, module, file), "not handed to the whole-module path as is"
    if fast is not None:
        assert took == fast, "region path taken" if took else "region path not taken"
    return full


def patch(target, *edits, pid="p", on_drift="error"):
    return Patch(pid, "m", target, tuple(edits), spec_name="s", on_drift=on_drift)


ENTRY = Edit("entry", code="__sp__.emit('in', None)")
RETURNS = Edit("return", code="result = result", count=None)


# --------------------------------------------------------------------------- real specs


def _spec_cases():
    # bench/import_bench_spec.yaml: test_bench_spec_takes_the_region_path compares the same, and more
    files = sorted(glob.glob(str(REPO / "patches" / "*.yaml"))) + \
        sorted(glob.glob(str(REPO / "tests" / "**" / "*.yaml"), recursive=True))
    return [pytest.param(f, id=str(Path(f).relative_to(REPO))) for f in files]


def _by_module(patches):
    out = {}
    for p in patches:
        out.setdefault(p.module, []).append(p)
    return out


def _compare_modules(patches, *, fast=None):
    compared = 0
    for module, mine in _by_module(patches).items():
        try:
            path = find_source(module)
        except NotFound:
            continue  # not installed here
        same(path.read_text(encoding="utf-8"), mine, fast=fast, module=module, file=str(path))
        compared += 1
    return compared


@pytest.mark.parametrize("spec_file", _spec_cases())
def test_shipped_and_bench_specs(spec_file):
    spec = load(spec_file)
    if _compare_modules(spec.patches) == 0:
        pytest.skip("none of its modules is installed")


def test_bench_spec_takes_the_region_path():
    """The point of the region path: the bench modules (one entry edit each) use it."""
    patches = load(REPO / "bench" / "import_bench_spec.yaml").patches
    assert _compare_modules(patches, fast=True) == 4


def _fixture_spec_texts():
    """Every whole spec the tests write out literally (a string, or names and strings
    joined with +), e.g. ``HEAD + \"\"\"...\"\"\"``."""
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = {n.targets[0].id: n.value.value for n in tree.body
                  if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}

        def value(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                return consts.get(node.id)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                left, right = value(node.left), value(node.right)
                return left + right if left is not None and right is not None else None
            return None

        for node in ast.walk(tree):
            text = value(node)
            if text and "source_patch:" in text and "patches:" in text:
                yield path.name, text


def test_fixture_specs_of_the_tests():
    compared = 0
    for name, text in _fixture_spec_texts():
        try:
            spec = loads(text, name)
        except Exception:
            continue  # a deliberately invalid spec
        compared += _compare_modules(spec.patches)
    assert compared >= 30  # the literal specs of test_anchors, test_cache, test_cli, ...


def test_every_def_of_the_fixture_module_and_every_anchor():
    path = find_source("spfix.basic")
    source = path.read_text(encoding="utf-8")
    defs = regions._ast_defs(ast.parse(source))
    fast = 0
    for target, found in defs.items():
        edits = [ENTRY, RETURNS, Edit("before", match="return _", code="x = 0", count=None),
                 Edit("after", match="_ = _", code="x = 0", count=None),
                 Edit("replace", match="return _", code="return None", count=None),
                 Edit("call", match="math._(...)", wrap="(__call__)", count=None)]
        for edit in edits:
            patches = [patch(target, edit, on_drift="skip")]
            same(source, patches, fast=None, module="spfix.basic", file=str(path))
            fast += engine._rewrite_regions(source, patches, str(path)) is not None
    assert fast > 20  # the region path applied many of them (not only refused them all)


# --------------------------------------------------------------------------- edges

SOURCE = '''"""A module shaped to test the region path."""
import functools
from typing import TYPE_CHECKING


def plain(x):
    y = x + 1
    return y


@functools.lru_cache()
# a comment between the decorators and the def
@functools.wraps(plain)
def decorated(x):
    return x


class Outer:
    """Doc."""

    @property
    # between
    def prop(self):
        return 1

    def first(self, a):
        if a:
            return a
            # the footer of the if block
        return -a
        # the footer of first's body
    # a class-level comment

    class Inner:
        def method(self, y):
            scaled = y * 10
            return scaled

    async def second(self, b):
        for i in range(b):
            pass
        return b


@functools.lru_cache()
# between, in an untouched def
def untouched(x):
    if x:
        return 1
        # the footer of an untouched block
    return 2


def one_liner(x): return x + 1


if TYPE_CHECKING:
    def typed(x):
        return x

try:
    def guarded(x):
        return x
except ImportError:
    pass


def outer(x):
    def inner(z):
        return z * 3
    return inner(x)


class Split(
    object,
):
    def method(self):
        return 1
# the last line
'''


def test_the_unpatched_lines_keep_their_text_and_numbers():
    full = same(SOURCE, [patch("Outer.first", ENTRY)], fast=True)
    text, line_map = full[0], full[1]
    first = SOURCE.splitlines().index("    def first(self, a):") + 1
    code = [k for k, line in enumerate(SOURCE.splitlines()[:first], 1) if not line.lstrip().startswith("#")]
    assert [line_map[k] for k in code] == code  # (the whole-module map carries some comment lines)
    assert text.splitlines()[:first] == SOURCE.splitlines()[:first]
    assert text.count("\n") == SOURCE.count("\n") + 5  # the entry's try block


def test_a_decorated_function_region_starts_at_its_first_decorator():
    full = same(SOURCE, [patch("decorated", ENTRY, RETURNS)], fast=True)
    def_line = SOURCE.splitlines().index("def decorated(x):") + 1
    assert full[2][0][2] == [def_line]  # the entry anchors on the def line


def test_a_decorated_method_with_a_comment_between():
    same(SOURCE, [patch("Outer.prop", ENTRY, RETURNS)], fast=True)


def test_a_method_of_a_nested_class():
    same(SOURCE, [patch("Outer.Inner.method", RETURNS, Edit("after", match="scaled = _", code="scaled += 1"))],
         fast=True)


def test_two_patches_on_two_methods_of_one_class():
    full = same(SOURCE, [patch("Outer.first", RETURNS, pid="a"), patch("Outer.second", ENTRY, pid="b")],
                fast=True)
    assert [pid for pid, _, _ in full[2]] == ["a", "b"]


def test_two_patches_on_one_method():
    full = same(SOURCE, [patch("Outer.first", ENTRY, pid="a"), patch("Outer.first", RETURNS, pid="b"),
                         patch("plain", ENTRY, pid="c")], fast=True)
    assert [pid for pid, _, _ in full[2]] == ["a", "b", "c"]


def test_the_footers_of_the_target_and_of_untouched_statements():
    """Trailing comments owned by a block's footer map as the whole-module path maps
    them, in the target and in the untouched def beside it."""
    same(SOURCE, [patch("Outer.first", RETURNS)], fast=True)
    same(SOURCE, [patch("one_liner", ENTRY)], fast=True)  # after `untouched`, footer and all


def test_a_one_line_def():
    full = same(SOURCE, [patch("one_liner", ENTRY, RETURNS)], fast=True)
    assert "def one_liner(x):\n    try:" in full[0]


def test_a_nested_function_and_its_enclosing_function():
    """A target inside another target's def is rewritten in the outer def's region."""
    same(SOURCE, [patch("outer.inner", ENTRY)], fast=True)
    full = same(SOURCE, [patch("outer.inner", ENTRY, RETURNS, pid="b"), patch("outer", ENTRY, RETURNS, pid="a")],
                fast=True)
    assert [pid for pid, _, _ in full[2]] == ["b", "b", "a", "a"]
    same(SOURCE, [patch("Outer.Inner.method", ENTRY, pid="a"), patch("Outer.first", RETURNS, pid="b")], fast=True)
    deeper = SOURCE.replace("    def inner(z):\n        return z * 3\n",
                            "    if x:\n        def inner(z):\n            def leaf():\n                return 1\n"
                            "            return z * 3\n    else:\n        inner = abs\n")
    compile(deeper, "m.py", "exec")
    same(deeper, [patch("outer", ENTRY, pid="a"), patch("outer.inner.leaf", RETURNS, pid="b"),
                  patch("outer.inner", ENTRY, pid="c")], fast=True)


@pytest.mark.parametrize("target", ["typed", "guarded", "Split.method"])
def test_targets_inside_other_statements_or_multi_line_headers_use_the_whole_module(target):
    full = same(SOURCE, [patch(target, ENTRY)], fast=False)
    assert full[0] != "error"


@pytest.mark.parametrize("indent", ["\t", "  ", "   "])
def test_tabs_and_odd_indentation(indent):
    source = SOURCE.replace("    ", indent)
    compile(source, "m.py", "exec")
    full = same(source, [patch("Outer.first", ENTRY, RETURNS, pid="a"), patch("Outer.Inner.method", ENTRY, pid="b"),
                         patch("one_liner", ENTRY, pid="c")], fast=True)
    assert f"\n{indent}{indent}try:\n" in full[0]


def test_a_class_target_a_missing_target_and_a_duplicate_give_the_same_errors():
    full = same(SOURCE, [patch("Outer", ENTRY)], fast=False)
    assert "target 'Outer' is a class" in full[1]
    full = same(SOURCE, [patch("Outer.frist", ENTRY)], fast=False)
    assert "target 'Outer.frist' not found; nearest: Outer.first" in full[1]
    twice = SOURCE + "\n\ndef plain(x):\n    return x\n"
    full = same(twice, [patch("plain", ENTRY)], fast=False)
    assert "is defined 2 times" in full[1]


def test_drift_conflicts_and_handle_clashes_give_the_same_outcome():
    drift = Edit("before", match="no_such_statement()", code="x = 1")
    full = same(SOURCE, [patch("plain", drift, pid="a", on_drift="skip"), patch("Outer.first", ENTRY, pid="b")],
                fast=False)
    assert [pid for pid, _ in full[3]] == ["a"] and "nearest candidates" in full[3][0][1]
    full = same(SOURCE, [patch("plain", drift)], fast=False)
    assert full[0] == "error"
    clash = [patch("Outer.first", Edit("replace", match="if a:", code="pass"), RETURNS)]
    full = same(SOURCE, clash, fast=False)
    assert "would silently discard" in full[1]
    twice = [patch("plain", Edit("replace", match="y = _", code="y = 2"), pid="a"),
             patch("plain", Edit("replace", match="y = _", code="y = 3"), pid="b")]
    assert "replaced by two patches" in same(SOURCE, twice, fast=False)[1]
    full = same(SOURCE.replace("y = x + 1", "y = __sp__"), [patch("plain", ENTRY)], fast=False)
    assert "runtime handle" in full[1]


def test_a_module_target_uses_the_whole_module():
    full = same(SOURCE, [patch(MODULE_TARGET, ENTRY)], fast=False)
    assert full[0] != "error"


def test_comments_ending_the_file_indented_or_unterminated():
    """libcst drops a blank line before an indented comment ending a file: the region
    path leaves such files to the whole-module path, which reproduces that."""
    same(SOURCE + "\n  # odd\n", [patch("plain", ENTRY)], fast=False)
    same(SOURCE.rstrip("\n"), [patch("plain", ENTRY)], fast=True)
    same(SOURCE + "\n\n", [patch("outer", ENTRY)], fast=True)


def test_rewrite_takes_the_region_path_by_default(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the whole-module path ran")

    monkeypatch.setattr(engine, "_rewrite_module", refuse)
    result = rewrite(SOURCE, [patch("Outer.Inner.method", ENTRY)], module="m", file="m.py")
    assert result.hits[0][2] == [SOURCE.splitlines().index("        def method(self, y):") + 1]
    with pytest.raises(AssertionError, match="whole-module path ran"):
        rewrite(SOURCE, [patch("Outer", ENTRY)], module="m", file="m.py")
