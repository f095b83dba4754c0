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
import warnings
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import NamedTuple

from .cache import CodeCache, TargetLookup, slice_parts, spec_names
from .boot import RENAMED, STRICT, flag, renamed
from .errors import ActivationError, RequirementError, SourcePatchWarning
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
        self.applied_dists: set[str] = set()  # distributions required by applied patches
        self._warned: set[int] = set()  # patches whose skip was said (once per process)

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
                warnings.warn(f"source-patch: skipping spec {spec.name!r} for {fullname}: {problem}",
                              SourcePatchWarning, stacklevel=2)
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
            self.skipped += skipped
            if skipped and len(skipped) == len(mine):
                self._say_skipped(fullname, skipped)
        return out

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
            warnings.warn(f"{message} ({STRICT}=1 makes this an error)", SourcePatchWarning, stacklevel=2)

    def _unmet(self, requires, site_dir: str | None) -> str | None:
        """Why ``requires`` do not hold near the target's site directory (None: they do),
        decided once per process and remembered by the code cache."""
        return self.cache.verdict(requires, site_dir, judge).unmet if requires else None

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
        for patch, error in dropped:
            if self.finder is not None:
                self.finder.skipped.append(Skipped(patch, f"anchor drifted: {error}"))
            if patch.on_drift == "warn":
                warnings.warn(f"source-patch: patch {patch.id!r} of spec {patch.spec_name!r} left out "
                              f"(on_drift: warn; the module's other patches apply): {error}",
                              stacklevel=2)

    def exec_module(self, module: ModuleType) -> None:
        code = self.get_code(module.__name__)
        namespace, applied = module.__dict__, []
        for p in self.applied:
            namespace[p.handle] = HANDLE
            applied.append(Applied(p.spec_name, p.id, p.target, p.location.file))
        module.__source_patches__ = tuple(applied)
        importlib._bootstrap._call_with_frames_removed(exec, code, module.__dict__)  # as SourceFileLoader


def patch_source(source: bytes, patches: list[Patch], module: str, path: str):
    """Rewrite and compile (the cache-miss path: the only one that imports libcst);
    returns the code and the drifted patches left out."""
    from .engine import rewrite
    from .locate import dist_version

    result = rewrite(importlib.util.decode_source(source), patches, module=module, file=path,
                     version=lambda: dist_version(module.partition(".")[0]))
    return compile(result.tree, path, "exec", dont_inherit=True), result.dropped
