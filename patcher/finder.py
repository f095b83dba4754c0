"""The meta-path finder and the loader that patch target modules as they import.

The finder sits first on ``sys.meta_path`` and answers every import that is not
a target with one set lookup.  For a target it asks the other finders (editable
installs, pytest's rewriter, ...) where the module is, and wraps the result only
if it is a plain source-file loader.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import warnings
from dataclasses import dataclass
from types import CodeType, ModuleType

from .cache import CodeCache, key
from .errors import ActivationError, RequirementError
from .spec import Patch, Spec, slice_digest


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
    patched site actually runs, and later lookups are a plain attribute read.
    """

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
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


class PatchFinder:
    _source_patch_finder = True  # lets locate.py and others skip us

    def __init__(self, cache: CodeCache):
        self.cache = cache
        self.specs: list[Spec] = []
        self.targets: frozenset[str] = frozenset()  # the one lookup every import pays
        self._checked: dict[tuple, str | None] = {}  # (requires, site dir) -> unmet message
        self.imported: set[str] = set()  # targets seen by an import
        self.skipped: list[Skipped] = []
        self.applied_dists: set[str] = set()  # distributions required by applied patches

    # -- registry

    def add(self, spec: Spec) -> None:
        self.specs.append(spec)
        self._rebuild()

    def remove(self, spec: Spec) -> None:
        self.specs.remove(spec)
        self._rebuild()

    def _rebuild(self) -> None:
        self.targets = frozenset(p.module for spec in self.specs for p in spec.patches)

    # -- import protocol

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets:
            return None
        return self._patched_spec(fullname, path, target)

    def _patched_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self.imported.add(fullname)
        patches = self._applicable(fullname, spec.origin)
        if not patches:
            return spec
        if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            raise ActivationError(
                f"cannot patch {fullname}: it is loaded by {type(spec.loader).__name__} from "
                f"{spec.origin}, not from a Python source file")
        spec.loader = PatchingLoader(fullname, spec.origin, patches, self.cache, self)
        return spec

    def _applicable(self, fullname: str, origin: str | None) -> list[Patch]:
        """The target's patches whose specs' and own ``requires`` hold.  An unmet spec
        requirement follows the spec's ``on_unmet``; an unmet patch requirement skips
        just that patch (one spec can target several frameworks)."""
        near = site_dir_of(fullname, origin)
        out = []
        for spec in self.specs:
            mine = [p for p in spec.patches if p.module == fullname]
            if not mine:
                continue
            problem = self._unmet(spec.requires, near)
            if problem and spec.on_unmet == "error":
                raise RequirementError(f"{spec.file}: spec {spec.name!r}: {problem}; "
                                       f"{fullname} would be imported unpatched (set on_unmet: "
                                       f"skip in the spec to allow that)")
            if problem:
                warnings.warn(f"source-patch: skipping spec {spec.name!r} for {fullname}: {problem}",
                              stacklevel=2)
                self.skipped += [Skipped(p, problem) for p in mine]
                continue
            for patch in mine:
                reason = self._unmet(patch.requires, near)
                if reason:
                    self.skipped.append(Skipped(patch, reason))
                else:
                    out.append(patch)
                    self.applied_dists.update(d for d, _ in spec.requires + patch.requires)
        return out

    def _unmet(self, requires, near: str | None) -> str | None:
        if not requires:
            return None
        key = (requires, near)
        if key not in self._checked:
            self._checked[key] = unmet(requires, near=near)
        return self._checked[key]

    def invalidate_caches(self) -> None:
        pass


def unmet_requirement(spec: Spec, against: str | None = None, near: str | None = None) -> str | None:
    """None when every ``requires`` range of the spec holds, else a sentence saying which does not."""
    return unmet(spec.requires, against, near)


def unmet(requires, against: str | None = None, near: str | None = None) -> str | None:
    """None when every ``(distribution, specifier)`` holds, else a sentence saying which does not.

    ``near`` is a target's site directory, searched first for the distribution's
    metadata: one directory listing instead of a scan of every path entry.
    """
    if not requires:
        return None
    from packaging.specifiers import SpecifierSet

    for dist, wanted in requires:
        have = installed_version(dist, against, near)
        if have is None:
            return f"requires {dist}{wanted}, which is not installed"
        if not SpecifierSet(wanted).contains(have, prereleases=True):
            return f"requires {dist}{wanted}, found {have}"
    return None


def installed_version(dist: str, against: str | None = None, near: str | None = None) -> str | None:
    from importlib import metadata

    if against:
        found = next(iter(metadata.distributions(path=[against], name=dist)), None)
        return found.version if found is not None else None
    if near:
        version = _version_beside(dist, near)
        if version:
            return version
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _version_beside(dist: str, site_dir: str) -> str | None:
    """Read ``Version:`` from ``<site_dir>/<dist>-*.dist-info/METADATA``."""
    import os

    wanted = _normalize(dist) + "-"
    n = len(wanted)
    try:
        entries = os.listdir(site_dir)
    except OSError:
        return None
    for entry in entries:  # `<name>-<version>.dist-info`, the name in any spelling
        if entry.endswith(".dist-info") and _normalize(entry[:n - 1]) + entry[n - 1:n] == wanted:
            return metadata_fields(os.path.join(site_dir, entry, "METADATA"), ("Version",)).get("Version")
    return None


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def site_dir_of(fullname: str, origin: str | None) -> str | None:
    """The directory holding a module's top-level package (where its dist-info lives)."""
    if not origin:
        return None
    import os

    levels = fullname.count(".") + 1 + (os.path.basename(origin) == "__init__.py")
    directory = origin
    for _ in range(levels):
        directory = os.path.dirname(directory)
    return directory


def metadata_fields(path, names) -> dict[str, str]:
    """The first value of each of ``names`` in a METADATA file's header block (read only
    until all are found, or the header ends); missing or unreadable: left out."""
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # end of the header block
                key, _, value = line.partition(":")
                if key in names and key not in out:
                    out[key] = value.strip()
                    if len(out) == len(names):
                        break
    except OSError:
        pass
    return out


class PatchingLoader(importlib.machinery.SourceFileLoader):
    """A source loader whose code is the patched source, never written to __pycache__."""

    def __init__(self, fullname: str, path: str, patches: list[Patch], cache: CodeCache,
                 finder: PatchFinder | None = None):
        super().__init__(fullname, path)
        self.patches = patches
        self.code_cache = cache
        self.finder = finder
        self.applied = patches

    def get_code(self, fullname: str) -> CodeType:
        source = self.get_data(self.path)
        k = key(source, slice_digest(self.patches), self.path)
        code = self.code_cache.get(k)
        if code is None:
            with self.code_cache.lock(k):  # one process parses; the others wait, then hit
                code = self.code_cache.get(k)
                if code is None:
                    code, dropped = patch_source(source, self.patches, fullname, self.path)
                    if dropped:  # degraded: not cached, so every run says so again
                        self._drifted(dropped)
                    else:
                        self.code_cache.put(k, code)
        return code

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
        for handle in {p.handle for p in self.applied}:
            module.__dict__[handle] = HANDLE
        module.__source_patches__ = tuple(
            Applied(p.spec_name, p.id, p.target, p.location.file) for p in self.applied)
        importlib._bootstrap._call_with_frames_removed(exec, code, module.__dict__)  # as SourceFileLoader


def patch_source(source: bytes, patches: list[Patch], module: str, path: str):
    """Rewrite and compile (the cache-miss path: the only one that imports libcst);
    returns the code and the drifted patches left out."""
    from .engine import rewrite
    from .locate import dist_version

    result = rewrite(importlib.util.decode_source(source), patches, module=module, file=path,
                     version=lambda: dist_version(module.partition(".")[0]))
    return compile(result.tree, path, "exec", dont_inherit=True), result.dropped
