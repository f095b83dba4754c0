"""Find a module's source file and distribution version without importing it.

Dry runs must not execute any ``__init__``: each package level is resolved with
the meta-path finders' ``find_spec`` (which only looks), passing the parent's
search locations down.  ``against`` restricts the search to one directory, e.g.
an unpacked wheel of another upstream version.
"""

from __future__ import annotations

import importlib.machinery
import sys
from functools import lru_cache
from pathlib import Path

from .errors import SourcePatchError


class NotFound(SourcePatchError):
    def __init__(self, message: str, missing: str = "", locations=None):
        super().__init__(message)
        self.missing, self.locations = missing, locations  # the first level not found, where it was sought


def find_source(module: str, against: str | None = None) -> Path:
    parts = module.split(".")
    locations = [against] if against else None
    spec = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        spec = _find_spec(name, locations, against is not None)
        if spec is None:
            where = f" under {against}" if against else " on the search path"
            raise NotFound(f"module {name} not found{where}", name, locations)
        if i < len(parts) - 1:
            locations = spec.submodule_search_locations
            if locations is None:
                raise NotFound(f"{name} is a module, not a package: cannot find {module}")
            # A namespace package's _NamespacePath recomputes itself from its parent in
            # sys.modules, which a dry run never imports: take the list it holds.
            locations = list(getattr(locations, "_path", locations))
    if not spec.origin or not str(spec.origin).endswith(".py"):
        raise NotFound(f"module {module} has no Python source file ({spec.origin})")
    return Path(spec.origin)


def find_source_hinted(module: str, against: str | None = None) -> Path:
    """find_source, naming the nearest modules when it fails (the CLI's dry runs)."""
    try:
        return find_source(module, against)
    except NotFound as exc:
        near = nearest_modules(exc)
        if not near:
            raise
        raise NotFound(f"{exc}; nearest: {', '.join(near)}", exc.missing, exc.locations) from None


def _find_spec(name: str, locations, only_path: bool):
    if locations is not None:
        spec = _path_entry_spec(name, locations)
        if spec is not None or only_path:
            return spec
    for finder in sys.meta_path:
        if getattr(finder, "_source_patch_finder", False) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(name, locations)
        except (KeyError, ImportError):  # a namespace parent that is not imported
            continue
        if spec is not None:
            return spec
    return None


def _path_entry_spec(name: str, locations):
    """Search path entries directly, as PathFinder does, but without building a
    _NamespacePath: that needs the parent package imported."""
    portions: list[str] = []
    for entry in locations:
        finder = _path_entry_finder(entry)
        spec = finder.find_spec(name) if finder is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions += list(spec.submodule_search_locations or [])
    if not portions:
        return None
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = portions
    return spec


def _path_entry_finder(entry: str):
    for hook in sys.path_hooks:
        try:
            return hook(entry)
        except ImportError:
            continue
    return None


@lru_cache(maxsize=None)
def dist_version(top_level: str, against: str | None = None) -> str:
    """``name version`` of the distribution that ships a top-level package."""
    from importlib import metadata  # only messages and dry runs ask: not the start-up path

    if against is None:
        for dist in metadata.packages_distributions().get(top_level, []):
            try:
                return f"{dist} {metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                continue
        return "no installed distribution"
    for dist in metadata.distributions(path=[against]):
        tops = (dist.read_text("top_level.txt") or "").split()
        files = dist.files or []
        if top_level in tops or any(f.parts and f.parts[0] in (top_level, f"{top_level}.py") for f in files):
            return f"{dist.metadata['Name']} {dist.version} (under {against})"
    return f"unknown version (under {against})"


def nearest_modules(error: NotFound, n: int = 3) -> list[str]:
    """Importable names closest to the level ``find_source`` could not find."""
    import difflib
    import pkgutil

    parent, _, leaf = error.missing.rpartition(".")
    names = [m.name for m in pkgutil.iter_modules(error.locations)]  # None: all of sys.path
    near = difflib.get_close_matches(leaf, names, n=n, cutoff=0.6)
    return [f"{parent}.{name}" if parent else name for name in near]
