"""Swap a running process's patched functions between the code its specs made and the
code fewer specs would have made, in place, both ways, as often as wanted.

A spec's cost when inert is that of its call sites: a flag test each.  Two processes,
one patched and one not, differ by ~1% for their whole lives on a host-bound step
(docs/bench-notes/overhead.md), which buries a +0.5% goal.  Swapping ``__code__``
compares the two codes inside one process, block against block: same memory, same
threads, same allocator state.

    swap = CodeSwap(keep={"megatron_cpu"})   # the code megatron_cpu alone makes
    swap.use("kept")      # every function a dropped spec changed runs the kept code
    swap.use("patched")   # back to what the process imported

Only functions (methods, static and class methods, properties, wrapped functions) of
patched modules are swapped, matched by qualified name and order of definition; what a
patch changed at module level (an import, a statement run once) stays.  Functions
whose free variables differ are left patched and listed in ``skipped``.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict


def code_objects(code: types.CodeType) -> dict:
    """Every function's code under ``code``, by qualified name, in order of definition."""
    found: dict = defaultdict(list)
    queue = [code]
    for current in queue:  # (it grows as it goes: every nested function in turn)
        for const in current.co_consts:
            if isinstance(const, types.CodeType):
                found[const.co_qualname].append(const)
                queue.append(const)
    return found


def live_functions(module: types.ModuleType) -> list:
    """The module's functions, reached through its globals and classes."""
    path, seen, out = module.__spec__.origin, set(), []
    stack = list(vars(module).values())
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if obj.__module__ == module.__name__:
                stack.extend(vars(obj).values())
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType):
            if obj.__code__.co_filename == path:
                out.append(obj)
            if hasattr(obj, "__wrapped__"):
                stack.append(obj.__wrapped__)
    return out


class CodeSwap:
    """The patched modules' functions, each with its patched and its kept code."""

    def __init__(self, keep: set):
        from source_patch.patcher.finder import PatchingLoader, patch_source

        self.pairs: list = []     # (function, patched code, kept code)
        self.skipped: list = []   # qualified names left patched, and why
        self.modules: list = []
        for module in list(sys.modules.values()):
            loader = getattr(getattr(module, "__spec__", None), "loader", None)
            if not isinstance(loader, PatchingLoader):
                continue
            dropped = [p for p in loader.applied if p.spec_name not in keep]
            if not dropped:
                continue
            self.modules.append(module.__name__)
            source = loader.get_data(loader.path)
            patched = code_objects(loader.get_code(module.__name__))
            kept_patches = [p for p in loader.applied if p.spec_name in keep]
            kept = code_objects(patch_source(source, kept_patches, module.__name__, loader.path)[0] if kept_patches
                                else compile(source, loader.path, "exec", dont_inherit=True))
            self._pair(module, patched, kept)

    def _pair(self, module, patched: dict, kept: dict) -> None:
        for function in live_functions(module):
            code = function.__code__
            same_name = patched.get(code.co_qualname, [])
            index = next((i for i, c in enumerate(same_name) if c == code), None)
            twins = kept.get(code.co_qualname, [])
            if index is None or len(twins) != len(same_name):
                self.skipped.append((f"{module.__name__}.{code.co_qualname}", "not matched in the kept code"))
            elif twins[index] != code:
                if twins[index].co_freevars != code.co_freevars:
                    self.skipped.append((f"{module.__name__}.{code.co_qualname}", "free variables differ"))
                else:
                    self.pairs.append((function, code, twins[index]))

    def use(self, which: str) -> None:
        """``"patched"`` or ``"kept"``: the code every swapped function runs from now."""
        column = {"patched": 1, "kept": 2}[which]
        for pair in self.pairs:
            pair[0].__code__ = pair[column]

    def describe(self) -> str:
        names = sorted(f"{f.__module__}.{f.__qualname__}" for f, _, _ in self.pairs)
        text = f"{len(self.pairs)} functions of {len(self.modules)} modules swappable: {', '.join(names)}"
        if self.skipped:
            text += f"; left patched: {', '.join(f'{n} ({why})' for n, why in self.skipped)}"
        return text
