"""The import protocol: the meta-path finder and the loader that patch target modules.

The finder sits first on ``sys.meta_path`` and answers every import that is not
a target with one set lookup.  For a target it asks the other finders (editable
installs, pytest's rewriter, ...) where the module is, decides which of its patches
apply (their ``requires``: requires.py, remembered by the code cache), and wraps the
result only if it is a plain source-file loader.  The loader gets its code from the
code cache (cache.py), which rewrites the source (engine.py) only on a miss, and
executes it with the runtime handle in the module's namespace.
"""

from __future__ import annotations

import importlib.machinery
import os
import importlib.util
import sys
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import NamedTuple

from .cache import CodeCache, TargetLookup, slice_parts, spec_names
from .boot import DEBUG, RENAMED, STRICT, flag, renamed
from .errors import ActivationError, RequirementError, SourcePatchError, shorten, warn
from .requires import judge, site_dir_of
from .spec import Patch, Spec


@dataclass(frozen=True)
class Applied:
    """What a patched module records in ``__source_patches__``, one per patch."""

    spec: str
    patch: str
    target: str
    spec_file: str


class RuntimeHandle:
    """The object inserted code calls (``__sp__.emit(...)``).

    Attributes resolve lazily from the runtime's facade (``source_patch.runtime.facade``)
    on first use and are then cached on the instance: the runtime is imported only if a
    patched site actually runs, and later lookups are a plain attribute read.  A renamed
    name (boot.RENAMED) resolves to the name now, with one warning.
    """

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if ("__sp__", name) in RENAMED:
            value = getattr(self, renamed("__sp__", name))
            setattr(self, name, value)
            return value
        from source_patch.runtime import facade

        value = getattr(facade, name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<source_patch runtime handle>"


HANDLE = RuntimeHandle()


@dataclass(frozen=True)
class Skipped:
    """A patch left out of a module, and why (an unmet requirement, or drift)."""

    patch: Patch
    reason: str


def missing_calls(skipped: list[Skipped], applied=()) -> list[tuple[Skipped, frozenset]]:
    """Each skipped patch with the ``__sp__`` names it calls that no applied patch of the
    module calls (a version-gated variant that applies in its place leaves none missing)."""
    present = {name for p in applied for name in _called(p)}
    found = [(s, frozenset(set(_called(s.patch)) - present)) for s in skipped]
    return [(s, names) for s, names in found if names]


def refuse_if_results_change(missing: list[tuple[Skipped, frozenset]], where: str) -> None:
    """Fail closed where behaviour changes: call sites missing (their patch did not apply)
    that the settings in force need for the model to compute what it should (routing
    replay: the router would route by itself) raise now, naming the patch and why.  An
    observer's missing call sites (dump, trace, capture) keep their warning."""
    if not missing:
        return
    from ..runtime.core import control  # the manifests say which settings change results

    for s, names in missing:
        at_stake = control.results_at_stake(names)
        if at_stake:
            raise RequirementError(
                f"{s.patch.location.file}:{s.patch.location.line}: {', '.join(at_stake)} needs patch "
                f"{s.patch.id!r} of spec {s.patch.spec_name!r}, which did not apply to {where}: "
                f"{shorten(s.reason.splitlines()[0], 160)} (stopped: the run would compute something else; "
                f"make the patch apply, or turn the setting off)")


def _called(patch: Patch) -> list[str]:
    """The ``<handle>.name`` attributes a patch's inserted code uses (``__sp__.routing_topk``)."""
    import re

    pattern = re.compile(rf"(?<![\w.]){re.escape(patch.handle)}\.(\w+)")
    return [name for edit in patch.edits for name in pattern.findall(edit.code)]


class TargetPatches(NamedTuple):
    """What the finder holds for one target module."""

    by_spec: list  # (spec, its patches of the module), in activation order
    patches: list  # all of them, in order: its stat entry is keyed by them all
    requires: tuple  # the distinct requirements they name (the specs' and their own)
    patches_part: bytes  # how the stat key names them (cache.spec_names, else cache.slice_parts)


class PatchFinder:
    _source_patch_finder = True  # lets locate.py and others skip us

    def __init__(self, cache: CodeCache):
        self.cache = cache
        self.specs: list[Spec] = []
        self.targets: frozenset[str] = frozenset()  # the one lookup every import pays
        self._index: dict[str, TargetPatches] = {}
        self.imported: set[str] = set()  # targets seen by an import
        self.skipped: list[Skipped] = []
        self.missing: list[tuple[Skipped, frozenset]] = []  # skipped patches' call sites no applied one has
        self.applied_dists: set[str] = set()  # distributions required by applied patches
        self._warned: set[int] = set()  # patches whose skip was said (once per process)
        # Called with the finder after each target import (SOURCE_PATCH_REPORT_DIR: the
        # activation's report writer); must not raise.  report_dir: that folder.
        self.observer = None
        self.report_dir: str | None = None

    # -- registry

    def add(self, spec: Spec) -> None:
        self.specs.append(spec)
        self._rebuild()

    def remove(self, spec: Spec) -> None:
        self.specs.remove(spec)
        self._rebuild()

    def _rebuild(self) -> None:
        index: dict[str, tuple] = {}
        for spec in self.specs:
            named = getattr(spec, "cache_key", None)  # set by spec.compiled
            mine: dict[str, list] = {}
            for i, p in enumerate(spec.patches):
                mine.setdefault(p.module, []).append((i, p))
            for module, numbered in mine.items():
                by_spec, patches, requires, names = index.setdefault(module, ([], [], {}, []))
                by_spec.append((spec, [p for _, p in numbered]))
                for i, p in numbered:
                    patches.append(p)
                    requires.update((r, None) for r in (spec.requires, p.requires) if r)
                    names.append(named and named + i.to_bytes(4, "little"))
        self._index = {
            module: TargetPatches(by_spec, patches, tuple(requires), spec_names(names) or slice_parts(patches))
            for module, (by_spec, patches, requires, names) in index.items()}
        self.targets = frozenset(self._index)

    # -- import protocol

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets:
            return None
        return self._patched_spec(fullname, path, target)

    def _patched_spec(self, fullname, path, target):
        entry = self._index.get(fullname)
        if entry is None:  # removed by a deactivation in another thread meanwhile
            return None
        spec = self._found_by_others(fullname, path, target)
        if spec is None:
            return None
        self.imported.add(fullname)
        origin = spec.origin
        plain = isinstance(spec.loader, importlib.machinery.SourceFileLoader)
        site_dir = site_dir_of(fullname, origin) if entry.requires else None
        lookup = None
        if plain:
            lookup = TargetLookup(self.cache, origin, entry.patches, entry.patches_part, entry.requires, site_dir)
            if entry.requires:
                lookup.recall_verdicts()  # one read of the stat entry, which also holds the code
        patches = self._applicable(fullname, entry.by_spec, site_dir)
        if not patches:
            self.changed()  # every patch skipped: no loader of ours runs to say it
            return spec
        if not plain:
            raise ActivationError(
                f"cannot patch {fullname}: it is loaded by {type(spec.loader).__name__} from "
                f"{origin}, not from a Python source file")
        spec.loader = PatchingLoader(fullname, origin, patches, self.cache, self, lookup)
        return spec

    def _found_by_others(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _applicable(self, fullname: str, by_spec, site_dir: str | None) -> list[Patch]:
        """The target's patches whose specs' and own ``requires`` hold.  An unmet spec
        requirement follows the spec's ``on_unmet``; an unmet patch requirement skips
        just that patch (one spec can target several frameworks)."""
        out = []
        for spec, mine in by_spec:
            problem = self._unmet(spec.requires, site_dir)
            if problem and spec.on_unmet == "error":
                raise RequirementError(f"{spec.file}: spec {spec.name!r}: {problem}; "
                                       f"{fullname} would be imported unpatched (set on_unmet: "
                                       f"skip in the spec to allow that)")
            if problem:
                self._left_out([Skipped(p, problem) for p in mine], (), fullname)
                warn(f"source-patch: skipping spec {spec.name!r} for {fullname}: {problem}")
                self.skipped += [Skipped(p, problem) for p in mine]
                continue
            skipped = []
            for patch in mine:
                reason = self._unmet(patch.requires, site_dir)
                if reason:
                    skipped.append(Skipped(patch, reason))
                else:
                    out.append(patch)
                    if spec.requires or patch.requires:
                        self.applied_dists.update(d for d, _ in spec.requires + patch.requires)
            self._left_out(skipped, [p for p in mine if all(p is not k.patch for k in skipped)], fullname)
            self.skipped += skipped
            if skipped and len(skipped) == len(mine):
                self._say_skipped(fullname, skipped)
        return out

    def _left_out(self, skipped: list[Skipped], applied, where: str) -> None:
        """Patches of ``where`` that do not apply: their missing call sites are kept (the
        runtime refuses a setting that changes results for them later: core/control.py)
        and refused now where the settings in force change results."""
        missing = missing_calls(skipped, applied)
        self.missing += missing
        refuse_if_results_change(missing, where)

    def _say_skipped(self, fullname: str, skipped: list[Skipped]) -> None:
        """None of a spec's patches of an imported module applies: a gate that leaves
        the module untouched is most likely a wrong ``requires``, so say it (once)."""
        for s in skipped:
            if id(s.patch) in self._warned:
                continue
            self._warned.add(id(s.patch))
            message = (f"source-patch: patch {s.patch.id!r} of spec {s.patch.spec_name!r} "
                       f"({s.patch.location.file}:{s.patch.location.line}) does not apply to {fullname}: {s.reason}; "
                       f"no patch of that spec applies to the module")
            if flag(os.environ, STRICT):
                raise RequirementError(message)
            warn(f"{message} ({STRICT}=1 makes this an error)")

    def _unmet(self, requires, site_dir: str | None) -> str | None:
        """Why ``requires`` do not hold near the target's site directory (None: they do),
        decided once per process and remembered by the code cache."""
        return self.cache.verdict(requires, site_dir, judge).unmet if requires else None

    def changed(self) -> None:
        """A target was imported (its patches applied, skipped or failed): tell the observer."""
        if self.observer is not None:
            self.observer(self)

    def invalidate_caches(self) -> None:
        pass


class PatchingLoader(importlib.machinery.SourceFileLoader):
    """A source loader whose code is the patched source, never written to __pycache__.

    ``patches`` are those that apply here, of all the finder's patches of the module
    (``lookup.patches``): the code cache keeps which applied (cache.TargetLookup)."""

    def __init__(self, fullname: str, path: str, patches: list[Patch], cache: CodeCache,
                 finder: PatchFinder | None = None, lookup: TargetLookup | None = None):
        super().__init__(fullname, path)
        self.patches = patches
        self.code_cache = cache
        self.finder = finder
        self.applied = patches
        self.lookup = lookup or TargetLookup(cache, path, patches, slice_parts(patches))

    def get_code(self, fullname: str) -> CodeType:
        """The patched code, from the code cache, else rewritten (and then cached)."""
        return self.lookup.code(self.patches, read=lambda: self.get_data(self.path),
                                rewrite=lambda source: self._rewrite(source, fullname))

    def _rewrite(self, source: bytes, fullname: str) -> tuple[CodeType, bool]:
        """The code, and whether it may be cached: not when a patch drifted (degraded:
        every run says so again)."""
        code, dropped = patch_source(source, self.patches, fullname, self.path)
        if dropped:
            self._drifted(dropped)
        return code, not dropped

    def _drifted(self, dropped) -> None:
        left_out = {id(p) for p, _ in dropped}
        self.applied = [p for p in self.patches if id(p) not in left_out]
        if self.finder is not None:
            self.finder._left_out([Skipped(p, f"anchor drifted: {e}") for p, e in dropped], self.applied, self.name)
        for patch, error in dropped:
            if self.finder is not None:
                self.finder.skipped.append(Skipped(patch, f"anchor drifted: {error}"))
            if patch.on_drift == "warn":
                warn(f"source-patch: patch {patch.id!r} of spec {patch.spec_name!r} left out "
                     f"(on_drift: warn; the module's other patches apply): {error}", UserWarning)

    def exec_module(self, module: ModuleType) -> None:
        __tracebackhide__ = not flag(os.environ, DEBUG)  # noqa: F841 - pytest leaves the frame out
        try:
            code = self._code(module.__name__)
            namespace, applied = module.__dict__, []
            for p in self.applied:
                namespace[p.handle] = HANDLE
                applied.append(Applied(p.spec_name, p.id, p.target, p.location.file))
            module.__source_patches__ = tuple(applied)
            importlib._bootstrap._call_with_frames_removed(exec, code, module.__dict__)  # as SourceFileLoader
        finally:
            if self.finder is not None:
                self.finder.changed()

    def _code(self, fullname: str) -> CodeType:
        """get_code; an error of ours (an anchor that no longer matches) is recorded as
        the module's patches not applying, and raised without the rewrite's own frames
        (the cache's, the engine's, libcst's: SOURCE_PATCH_DEBUG=1 keeps them), so its
        message is not buried under them."""
        __tracebackhide__ = not flag(os.environ, DEBUG)  # noqa: F841 - pytest leaves the frame out
        try:
            return self.get_code(fullname)
        except SourcePatchError as exc:
            if self.finder is not None:
                reason = f"the import failed: {str(exc).splitlines()[0]}"
                self.finder.skipped += [Skipped(p, reason) for p in self.applied]
            if flag(os.environ, DEBUG):
                raise
            raise exc.with_traceback(None)

    def inserted_line(self, code: CodeType, lasti: int) -> str | None:
        """For a traceback: the inserted line that the instruction at ``lasti`` of
        ``code`` (one of this module's) comes from, or None.  Read from a twin of the
        code that says it in its columns (linemap._remap's ``mark``), compiled from the
        module rewritten again: the code may have come from the code cache, which keeps
        no source, so only an error being shown pays for that."""
        if getattr(self, "_twin", None) is None:
            from .engine import rewrite
            from .linemap import _remap, inserted_text

            source = importlib.util.decode_source(self.get_data(self.path))
            result = rewrite(source, self.patches, module=self.name, file=self.path)
            twin = compile(_remap(result.source, source, self.path, result.line_map, mark=True), self.path, "exec",
                           dont_inherit=True)
            self._twin = (inserted_text, source.splitlines(), result.source.splitlines(), result.line_map, twin)
        inserted_text, original, patched, line_map, twin = self._twin
        same = _same_code(twin, code)
        if same is None:
            return None
        line, end, col, end_col = list(same.co_positions())[lasti // 2]
        if line is None or end != line or col != 0 or end_col is None:
            return None
        return inserted_text(original, patched, line_map, line, end_col)


def _same_code(top: CodeType, code: CodeType) -> CodeType | None:
    """The code object in ``top`` (at any depth) with ``code``'s name, first line and bytecode."""
    todo = [top]
    while todo:
        c = todo.pop()
        if (c.co_qualname, c.co_firstlineno, c.co_code) == (code.co_qualname, code.co_firstlineno, code.co_code):
            return c
        todo += [k for k in c.co_consts if isinstance(k, CodeType)]
    return None


def patch_source(source: bytes, patches: list[Patch], module: str, path: str):
    """Rewrite and compile (the cache-miss path: the only one that imports libcst);
    returns the code and the drifted patches left out."""
    from .engine import rewrite
    from .locate import dist_version

    result = rewrite(importlib.util.decode_source(source), patches, module=module, file=path,
                     version=lambda: dist_version(module.partition(".")[0]))
    return compile(result.tree, path, "exec", dont_inherit=True), result.dropped
