"""The meta-path finder and the loader that patch target modules as they import.

The finder sits first on ``sys.meta_path`` and answers every import that is not
a target with one set lookup.  For a target it asks the other finders (editable
installs, pytest's rewriter, ...) where the module is, and wraps the result only
if it is a plain source-file loader.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from types import CodeType, ModuleType

from .cache import CodeCache, _tool_versions, key, settled, signature, stat_key
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
        out = []
        for spec in self.specs:
            mine = [p for p in spec.patches if p.module == fullname]
            if not mine:
                continue
            problem = self._unmet(spec.requires, fullname, origin)
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
                reason = self._unmet(patch.requires, fullname, origin)
                if reason:
                    self.skipped.append(Skipped(patch, reason))
                else:
                    out.append(patch)
                    if spec.requires or patch.requires:
                        self.applied_dists.update(d for d, _ in spec.requires + patch.requires)
        return out

    def _unmet(self, requires, fullname: str, origin: str | None) -> str | None:
        """``unmet(requires)`` near the target's site directory, once per process."""
        if not requires:
            return None
        near = site_dir_of(fullname, origin)
        key = (requires, near)
        if key not in self._checked:
            self._checked[key] = self._verdict(requires, near)
        return self._checked[key]

    def _verdict(self, requires, near: str | None) -> str | None:
        """``unmet(requires, near=near)``, remembered across processes in the code cache
        (``requires/``) while what it rests on holds: the stat signatures of the site
        directory (installing, removing or upgrading a distribution there changes it)
        and of each METADATA file the versions came from.  Not remembered where a
        version came from elsewhere on sys.path, or with SOURCE_PATCH_CACHE_CHECK=content."""
        cache = self.cache
        if near is None or not cache.stat_keys:
            return unmet(requires, near=near)
        k = _verdict_key(requires, near)
        stored = cache.get_data(k, "requires")
        try:  # (format, requires, near, basis, verdict), each file of basis as it was
            if (stored is not None and stored[0] == _VERDICT_FORMAT and stored[1] == requires
                    and stored[2] == near and len(stored[3]) >= 2
                    and (stored[4] is None or isinstance(stored[4], str))
                    and all(_signature_of(path) == tuple(sig) for path, sig in stored[3])):
                return stored[4]
        except (TypeError, ValueError, IndexError):
            pass  # another layout: judge again
        verdict, basis = judge(requires, near)
        if basis is not None and all(settled(sig) for _, sig in basis) and all(
                _signature_of(path) == sig for path, sig in basis):  # unchanged while read
            cache.put(k, (_VERDICT_FORMAT, requires, near, basis, verdict), "requires")
        return verdict

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
    path = _metadata_beside(dist, site_dir)
    return metadata_fields(path, ("Version",)).get("Version") if path else None


def _metadata_beside(dist: str, site_dir: str) -> str | None:
    """The path of ``<site_dir>/<dist>-*.dist-info/METADATA`` (the first such folder listed)."""
    wanted = _normalize(dist) + "-"
    n = len(wanted)
    try:
        entries = os.listdir(site_dir)
    except OSError:
        return None
    for entry in entries:  # `<name>-<version>.dist-info`, the name in any spelling
        if entry.endswith(".dist-info") and _normalize(entry[:n - 1]) + entry[n - 1:n] == wanted:
            return os.path.join(site_dir, entry, "METADATA")
    return None


_VERDICT_FORMAT = 1


def _signature_of(path: str):
    try:
        return signature(os.stat(path))
    except OSError:
        return None


def _verdict_key(requires, near: str) -> bytes:
    text = repr((_VERDICT_FORMAT, requires, near)).encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"requires\0" + text + _tool_versions()).digest()


def judge(requires, near: str) -> tuple[str | None, tuple | None]:
    """``unmet(requires, near=near)`` and what it rests on: ((path, stat signature), ...)
    of the site directory and of each METADATA file read, each signed before it is
    read; None where a version was looked up elsewhere (no dist-info beside the
    target) or a file could not be stat-ed."""
    from packaging.specifiers import SpecifierSet

    basis: list | None = [(near, _signature_of(near))]
    verdict = None
    for dist, wanted in requires:
        path = _metadata_beside(dist, near)
        sig = _signature_of(path) if path else None
        have = metadata_fields(path, ("Version",)).get("Version") if path else None
        if have and sig is not None and basis is not None:
            basis.append((path, sig))
        else:
            basis = None
            if not have:  # as installed_version(dist, near=near): any other path entry
                have = installed_version(dist)
        if have is None:
            verdict = f"requires {dist}{wanted}, which is not installed"
            break
        if not SpecifierSet(wanted).contains(have, prereleases=True):
            verdict = f"requires {dist}{wanted}, found {have}"
            break
    if basis is None or any(sig is None for _, sig in basis):
        return verdict, None
    return verdict, tuple(basis)


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def site_dir_of(fullname: str, origin: str | None) -> str | None:
    """The directory holding a module's top-level package (where its dist-info lives)."""
    if not origin:
        return None
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
        """The patched code: by the source's stat key (no read, no hash), else by its
        content key (then remembered under the stat key), else rewritten and stored."""
        cache = self.code_cache
        sk = None
        if cache.stat_keys:
            try:
                sig = signature(os.stat(self.path))
            except OSError:
                sig = None  # get_data raises the import's error
            if sig is not None:
                sk = stat_key(sig, _slice(self.patches)[1], self.path)
                code = cache.get(sk, "stat")
                if code is not None:
                    return code
        source = self.get_data(self.path)
        k = key(source, _digest(self.patches), self.path)
        payload = cache.read(k)
        code = _loads_code(payload)
        if code is None:
            with cache.lock(k):  # one process parses; the others wait, then hit
                payload = cache.read(k)
                code = _loads_code(payload)
                if code is None:
                    payload = None
                    code, dropped = patch_source(source, self.patches, fullname, self.path)
                    if dropped:  # degraded: not cached, so every run says so again
                        self._drifted(dropped)
                        return code
                    cache.put(k, code)
        # Remember this content under the stat signature it was read with, if that is
        # settled and still the file's (a change while reading: the next import looks again).
        if sk is not None and settled(sig):
            try:
                again = signature(os.stat(self.path))
            except OSError:
                again = None
            if again == sig:
                import marshal

                cache.write(sk, payload if payload is not None else marshal.dumps(code), "stat")
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


def _loads_code(payload) -> CodeType | None:
    if payload is None:
        return None
    import marshal

    try:
        code = marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, CodeType) else None


_SLICES: dict[tuple[int, ...], list] = {}  # ids -> [the patches, slice_parts, slice_digest or None]


def _slice(patches: list[Patch]) -> list:
    """The memo of a set of patch objects (it keeps them alive, so their ids stay
    theirs: equal ids and identical objects are the same set)."""
    ids = tuple(map(id, patches))
    hit = _SLICES.get(ids)
    if hit is None or not all(a is b for a, b in zip(hit[0], patches)):
        if len(_SLICES) >= 4096:  # specs activated again and again (tests): start over
            _SLICES.clear()
        hit = _SLICES[ids] = [tuple(patches), slice_parts(patches), None]
    return hit


def slice_parts(patches: list[Patch]) -> bytes:
    """What the patches do to their module, for the stat key: at least every field
    ``spec.slice_digest`` covers (a test checks), as a tuple of strings, ints and
    None marshalled in format 2, which is canonical (format 3 and later mark
    interned strings and back-references, which differ between equal values).
    Cheaper than that digest's JSON and SHA-256, which only a stat-key miss pays."""
    import marshal

    return marshal.dumps(tuple(
        (p.spec_name, p.id, p.module, p.target, p.handle, p.on_drift, p.location.file, p.location.line,
         tuple((e.at, e.code, e.match, e.wrap, e.bind, e.count) for e in p.edits))
        for p in patches), 2)


def _digest(patches: list[Patch]) -> str:
    """slice_digest, once per set of patch objects."""
    memo = _slice(patches)
    if memo[2] is None:
        memo[2] = slice_digest(patches)
    return memo[2]


def patch_source(source: bytes, patches: list[Patch], module: str, path: str):
    """Rewrite and compile (the cache-miss path: the only one that imports libcst);
    returns the code and the drifted patches left out."""
    from .engine import rewrite
    from .locate import dist_version

    result = rewrite(importlib.util.decode_source(source), patches, module=module, file=path,
                     version=lambda: dist_version(module.partition(".")[0]))
    return compile(result.tree, path, "exec", dont_inherit=True), result.dropped
