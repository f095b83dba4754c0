"""bench/code_swap.py: a process's patched functions swapped in place to the code fewer
specs make and back (overhead_bench.py --swap measures an inert spec's call sites inside
one process with it)."""

import sys
import textwrap
from pathlib import Path

import pytest

from source_patch.patcher import patched

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import functools

CALLS = []


def plain(x):
    return x + 1


def decorate(f):
    @functools.wraps(f)
    def wrapper(*a):
        return f(*a)
    return wrapper


@decorate
def wrapped(x):
    return x * 2


def untouched(x):
    return x


class Box:
    def __init__(self):
        self.v = 1

    def method(self, x):
        return super().__repr__() and x + self.v

    @property
    def value(self):
        return self.v

    @staticmethod
    def static(x):
        return x - 1

    @classmethod
    def klass(cls, x):
        return x

    class Inner:
        def deep(self, x):
            scale = 3

            def helper(y):
                return y * scale
            return helper(x)
'''

DROP = """
source_patch: 1
name: dropme
patches:
""" + "".join(f"""
  - id: p{i}
    module: swapfix.mod
    target: {target}
    edits:
      - {{at: entry, code: "CALLS.append('{target}')"}}
""" for i, target in enumerate(("plain", "wrapped", "Box.method", "Box.value", "Box.static", "Box.klass",
                                 "Box.Inner.deep.helper")))

KEEP = """
source_patch: 1
name: keepme
patches:
  - id: k
    module: swapfix.mod
    target: plain
    edits:
      - {at: return, code: "result = result + 100"}
"""


@pytest.fixture
def code_swap(tmp_path, write_spec, monkeypatch):
    package = tmp_path / "pkg" / "swapfix"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import code_swap

    with patched(write_spec(DROP)), patched(write_spec(KEEP)):
        from swapfix import mod
        yield code_swap, mod
    for name in ("swapfix.mod", "swapfix"):
        sys.modules.pop(name, None)


def exercise(mod) -> list:
    del mod.CALLS[:]
    box = mod.Box()
    results = [mod.plain(1), mod.wrapped(2), box.method(3), box.value, mod.Box.static(4), mod.Box.klass(5),
               mod.Box.Inner().deep(2), mod.untouched(6)]
    return results, list(mod.CALLS)


def test_the_kept_code_runs_no_call_site_of_a_dropped_spec_and_keeps_the_kept_specs_edits(code_swap):
    code_swap, mod = code_swap
    want = [102, 4, 4, 1, 3, 5, 6, 6]  # plain's +100 is the kept spec's
    results, calls = exercise(mod)
    assert results == want and len(calls) == 7, calls
    swap = code_swap.CodeSwap(keep={"keepme"})
    assert {f.__qualname__ for f, _, _ in swap.pairs} == {
        "plain", "wrapped", "Box.method", "Box.value", "Box.static", "Box.klass", "Box.Inner.deep"}, swap.describe()
    assert swap.skipped == [] and swap.modules == ["swapfix.mod"]
    swap.use("kept")
    assert exercise(mod) == (want, [])  # the same results, no call site of dropme, keepme's edit still there
    swap.use("patched")
    assert exercise(mod) == (want, calls)
    swap.use("kept")
    swap.use("kept")  # idempotent
    assert exercise(mod)[1] == []
    swap.use("patched")


def test_keeping_every_spec_swaps_nothing_and_keeping_none_runs_the_source_as_written(code_swap):
    code_swap, mod = code_swap
    assert code_swap.CodeSwap(keep={"keepme", "dropme"}).pairs == []
    swap = code_swap.CodeSwap(keep=set())
    swap.use("kept")
    try:
        assert exercise(mod) == ([2, 4, 4, 1, 3, 5, 6, 6], [])  # plain without the +100
    finally:
        swap.use("patched")
    assert exercise(mod)[0][0] == 102
    with pytest.raises(KeyError):
        swap.use("other")
