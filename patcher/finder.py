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
import marshal
import operator
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
        self._index: dict[str, tuple] = {}  # target -> (its (spec, patches), all, requires, names)
        self._checked: dict[tuple, tuple] = {}  # (requires, site dir) -> (unmet message, basis or None)
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
        """Per target: each spec's patches of it; all of them in order (its stat entry
        is keyed by them all); the distinct requirements they name; and the patches'
        names for that key where every spec came from the code cache: the spec's key
        there (its text, file and this tool) and the patch's index, so an import need
        not serialize them (``slice_parts``, the key otherwise)."""
        index: dict[str, tuple] = {}
        for spec in self.specs:
            named = getattr(spec, "cache_key", None)  # set by spec._compiled
            mine: dict[str, list] = {}
            for i, p in enumerate(spec.patches):
                mine.setdefault(p.module, []).append((i, p))
            for module, numbered in mine.items():
                pairs, every, requires, names = index.setdefault(module, ([], [], {}, []))
                pairs.append((spec, [p for _, p in numbered]))
                for i, p in numbered:
                    every.append(p)
                    requires.update((r, None) for r in (spec.requires, p.requires) if r)
                    names.append(named and named + i.to_bytes(4, "little"))
        self._index = {  # the names' prefix is never a marshalled tuple's first bytes
            module: (pairs, every, tuple(requires), b"spec keys\0" + b"".join(names) if all(names) else None)
            for module, (pairs, every, requires, names) in index.items()}
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
        pairs, every, requires, names = entry
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self.imported.add(fullname)
        origin = spec.origin
        plain = isinstance(spec.loader, importlib.machinery.SourceFileLoader)
        near = site_dir_of(fullname, origin) if requires else None
        early = self._early(every, requires, names, origin, near) if plain and requires else None
        patches = self._applicable(fullname, pairs, near)
        if not patches:
            return spec
        if not plain:
            raise ActivationError(
                f"cannot patch {fullname}: it is loaded by {type(spec.loader).__name__} from "
                f"{origin}, not from a Python source file")
        loader = spec.loader = PatchingLoader(fullname, origin, patches, self.cache, self)
        loader.every, loader.names = every, names
        if early is not None and early[2] is not None and early[1] == _mask(patches, every):
            loader.early = early  # the entry read for the verdicts holds this very code
        return spec

    def _early(self, every, requires, names, origin: str | None, near: str | None):
        """Where the target's requirements are not all judged in this process yet: its
        stat entry, read here instead of in get_code.  The entry carries the verdicts
        it was written with (``_records``); each whose basis still holds counts as
        judged, so a warm import reads no ``requires/`` entry.  Returns (stat key, which
        patches the code is of, the code or None, the verdicts not taken), or None."""
        needed = [(r, near) for r in requires if (r, near) not in self._checked]
        if not needed or near is None or not self.cache.stat_keys:
            return None
        try:
            sig = signature(os.stat(origin))
        except OSError:
            return None
        sk = stat_key(sig, names or _slice(every)[1], origin)
        records, mask, code = _stat_entry(self.cache.read(sk, "stat"))
        try:  # ((requires, site dir, basis, verdict), ...), each file of basis as it was
            for requires_, where, basis, verdict in records:
                if ((requires_, where) in needed and (verdict is None or isinstance(verdict, str))
                        and len(basis) >= 2 and all(_signature_of(path) == was for path, was in basis)):
                    self._checked[requires_, where] = (verdict, basis)
                    needed.remove((requires_, where))
        except (TypeError, ValueError):
            pass  # another layout: judge again
        return sk, mask, code, needed

    def _records(self, fullname: str, origin: str) -> tuple:
        """The target's verdicts judged in this process that can be remembered, with
        their bases: what its stat entry carries for ``_early``."""
        entry = self._index.get(fullname)
        if entry is None or not entry[2]:
            return ()
        near = site_dir_of(fullname, origin)
        judged = [(r, self._checked.get((r, near), (None, None))) for r in entry[2]]
        return tuple((r, near, basis, verdict) for r, (verdict, basis) in judged if basis is not None)

    def _applicable(self, fullname: str, pairs, near: str | None) -> list[Patch]:
        """The target's patches whose specs' and own ``requires`` hold.  An unmet spec
        requirement follows the spec's ``on_unmet``; an unmet patch requirement skips
        just that patch (one spec can target several frameworks)."""
        out = []
        for spec, mine in pairs:
            problem = self._unmet(spec.requires, near) if spec.requires else None
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
                reason = self._unmet(patch.requires, near) if patch.requires else None
                if reason:
                    self.skipped.append(Skipped(patch, reason))
                else:
                    out.append(patch)
                    if spec.requires or patch.requires:
                        self.applied_dists.update(d for d, _ in spec.requires + patch.requires)
        return out

    def _unmet(self, requires, near: str | None) -> str | None:
        """``unmet(requires)`` near the target's site directory, once per process."""
        if not requires:
            return None
        key = (requires, near)
        if key not in self._checked:
            self._checked[key] = self._verdict(requires, near)
        return self._checked[key][0]

    def _verdict(self, requires, near: str | None) -> tuple:
        """``unmet(requires, near=near)`` and the basis it is remembered by (or None),
        remembered across processes in the code cache (``requires/``, and in stat
        entries: ``_records``) while what it rests on holds: the stat signatures of the
        site directory (installing, removing or upgrading a distribution there changes
        it) and of each METADATA file the versions came from.  Not remembered where a
        version came from elsewhere on sys.path, or with SOURCE_PATCH_CACHE_CHECK=content."""
        cache = self.cache
        if near is None or not cache.stat_keys:
            return unmet(requires, near=near), None
        k = _verdict_key(requires, near)
        stored = cache.get_data(k, "requires")
        try:  # (format, requires, near, basis, verdict), each file of basis as it was
            if (stored is not None and stored[0] == _VERDICT_FORMAT and stored[1] == requires
                    and stored[2] == near and len(stored[3]) >= 2
                    and (stored[4] is None or isinstance(stored[4], str))
                    and all(_signature_of(path) == tuple(sig) for path, sig in stored[3])):
                return stored[4], stored[3]
        except (TypeError, ValueError, IndexError):
            pass  # another layout: judge again
        verdict, basis = judge(requires, near)
        if basis is not None and all(settled(sig) for _, sig in basis) and all(
                _signature_of(path) == sig for path, sig in basis):  # unchanged while read
            cache.put(k, (_VERDICT_FORMAT, requires, near, basis, verdict), "requires")
            return verdict, basis
        return verdict, None

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
    """A source loader whose code is the patched source, never written to __pycache__.

    Its stat entry is keyed by all the patches the finder has for the module
    (``every``), of which ``patches`` applied here: the entry says which applied and
    carries the requirement verdicts that decided it (``PatchFinder._early``)."""

    every = None  # all the finder's patches of this module (None: just ``patches``)
    names = None  # their names for the stat key (PatchFinder._rebuild), else slice_parts
    early = None  # PatchFinder._early's read of the stat entry, when its code is this one

    def __init__(self, fullname: str, path: str, patches: list[Patch], cache: CodeCache,
                 finder: PatchFinder | None = None):
        super().__init__(fullname, path)
        self.patches = patches
        self.code_cache = cache
        self.finder = finder
        self.applied = patches

    def get_code(self, fullname: str) -> CodeType:
        """The patched code: as the finder read it (``early``), else by the source's stat
        key (no read, no hash), else by its content key (then remembered under the stat
        key), else rewritten and stored."""
        cache = self.code_cache
        early, self.early = self.early, None  # used once: a later call looks again
        if early is not None:
            sk, mask, code, missing = early
            if missing and self.finder is not None:  # judged again here: remember them there
                records = self.finder._records(fullname, self.path)
                if {(r[0], r[1]) for r in records} & set(missing):
                    cache.write(sk, marshal.dumps((_STAT_FORMAT, records, mask, code)), "stat")
            return code
        every = self.every or self.patches
        mask = None if every is self.patches else _mask(self.patches, every)
        sk = None
        if cache.stat_keys:
            try:
                sig = signature(os.stat(self.path))
            except OSError:
                sig = None  # get_data raises the import's error
            if sig is not None:
                sk = stat_key(sig, self.names or _slice(every)[1], self.path)
                _, stored, code = _stat_entry(cache.read(sk, "stat"))
                if code is not None and stored == mask:
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
                records = self.finder._records(fullname, self.path) if self.finder else ()
                if records or mask is not None:  # else the code alone, as the content entry
                    payload = marshal.dumps((_STAT_FORMAT, records, mask, code))
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
        namespace, applied = module.__dict__, []
        for p in self.applied:
            namespace[p.handle] = HANDLE
            applied.append(Applied(p.spec_name, p.id, p.target, p.location.file))
        module.__source_patches__ = tuple(applied)
        importlib._bootstrap._call_with_frames_removed(exec, code, module.__dict__)  # as SourceFileLoader


def _loads_code(payload) -> CodeType | None:
    if payload is None:
        return None
    try:
        code = marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, CodeType) else None


_STAT_FORMAT = 1  # a stat entry with more than code: (_STAT_FORMAT, records, mask, code)


def _stat_entry(payload) -> tuple:
    """A stat entry's (verdict records, mask, code): a code object alone (no records,
    every patch applied), or the tuple; ((), None, None) if neither."""
    try:
        value = marshal.loads(payload) if payload is not None else None
    except (ValueError, EOFError, TypeError):
        value = None
    if isinstance(value, CodeType):
        return (), None, value
    if (isinstance(value, tuple) and len(value) == 4 and value[0] == _STAT_FORMAT
            and isinstance(value[1], tuple) and isinstance(value[3], CodeType)):
        return value[1], value[2], value[3]
    return (), None, None


def _mask(patches, every) -> tuple[int, ...] | None:
    """Which of ``every`` (by position) are ``patches``; None: all of them."""
    if _same(patches, every):
        return None
    ids = set(map(id, patches))
    return tuple(i for i, p in enumerate(every) if id(p) in ids)


def _same(a, b) -> bool:
    """The same objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


_SLICES: dict[tuple[int, ...], list] = {}  # ids -> [the patches, slice_parts, slice_digest or None]


def _slice(patches: list[Patch]) -> list:
    """The memo of a set of patch objects (it keeps them alive, so their ids stay
    theirs: equal ids and identical objects are the same set)."""
    ids = tuple(map(id, patches))
    hit = _SLICES.get(ids)
    if hit is None or not _same(hit[0], patches):
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
