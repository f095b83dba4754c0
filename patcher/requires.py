"""Whether a spec's or a patch's ``requires`` hold: installed distributions' versions.

Judged near a target (``site_dir_of``: one listing of its site directory and a read of
the distribution's METADATA), else on the whole search path, or in an unpacked wheel
(``against``).  The finder remembers verdicts through the code cache (cache.Verdict).
"""

from __future__ import annotations

import os

from .boot import signature


def unmet_requirement(spec, against: str | None = None, near: str | None = None) -> str | None:
    """None when every ``requires`` range of the spec holds, else a sentence saying which does not."""
    return unmet(spec.requires, against, near)


def unmet(requires, against: str | None = None, near: str | None = None) -> str | None:
    """None when every ``(distribution, specifier)`` holds, else a sentence saying which does not.

    ``near`` is a target's site directory, searched first for the distribution's
    metadata: one directory listing instead of a scan of every path entry.
    """
    if not requires:
        return None
    for dist, wanted in requires:
        problem = _against(dist, wanted, installed_version(dist, against, near))
        if problem:
            return problem
    return None


def judge(requires, near: str | None) -> tuple[str | None, tuple | None]:
    """``unmet(requires, near=near)`` and what it rests on: ((path, stat signature), ...)
    of the site directory and of each METADATA file read, each signed before it is
    read; None where a version was looked up elsewhere (no dist-info beside the
    target) or a file could not be stat-ed."""
    basis: list | None = [(near, signature(near))] if near is not None else None
    for dist, wanted in requires:
        path = _metadata_beside(dist, near) if near is not None else None
        sig = signature(path) if path else None
        have = _version_in(path)
        if have and sig is not None and basis is not None:
            basis.append((path, sig))
        else:
            basis = None
            if not have:  # as installed_version(dist, near=near): any other path entry
                have = installed_version(dist)
        problem = _against(dist, wanted, have)
        if problem:
            return problem, _whole(basis)
    return None, _whole(basis)


def _whole(basis: list | None) -> tuple | None:
    if basis is None or any(sig is None for _, sig in basis):
        return None
    return tuple(basis)


def _against(dist: str, wanted: str, have: str | None) -> str | None:
    """Why version ``have`` of ``dist`` does not meet ``wanted`` (None: it does)."""
    if have is None:
        return f"requires {dist}{wanted}, which is not installed"
    from packaging.specifiers import SpecifierSet

    if not SpecifierSet(wanted).contains(have, prereleases=True):
        return f"requires {dist}{wanted}, found {have}"
    return None


def installed_version(dist: str, against: str | None = None, near: str | None = None) -> str | None:
    from importlib import metadata

    if against:
        found = next(iter(metadata.distributions(path=[against], name=dist)), None)
        return found.version if found is not None else None
    if near:
        version = _version_in(_metadata_beside(dist, near))
        if version:
            return version
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


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


def _version_in(metadata: str | None) -> str | None:
    return metadata_fields(metadata, ("Version",)).get("Version") if metadata else None


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


# --------------------------------------------------------------------------- misspelled names

NEAR = 0.85  # difflib ratio from which an absent name is taken for a misspelling of an installed one


def unknown_distributions(specs, against: str | None = None) -> list[dict]:
    """Each ``requires`` distribution (a spec's or a patch's) that is not installed (or in
    ``against``) but whose name is close to one that is: most likely misspelled
    (``megatron-cor``), where a real distribution that is simply absent (the other side of
    a two-framework spec) is close to none.  No package index is asked: only names
    installed here (and in ``against``) are known.  One dict each: the distribution, the
    nearest installed name, where it is named and a sentence (``note``)."""
    names = None  # the installed names, listed on the first absent distribution only
    out, seen = [], set()
    for s in specs:
        for where, requires in [(f"spec {s.name!r} ({s.file})", s.requires),
                                *((f"patch {p.id!r} ({p.location.file}:{p.location.line})", p.requires)
                                  for p in s.patches)]:
            for dist, wanted in requires:
                if (dist, where) in seen or installed_version(dist, against) is not None:
                    continue
                seen.add((dist, where))
                names = installed_names(against) if names is None else names
                nearest = nearest_name(dist, names)
                if nearest:
                    out.append({"distribution": dist, "nearest": nearest, "where": where,
                                "note": f"unknown distribution {dist!r} in the requires of {where}: not installed "
                                        f"here, and no installed distribution has that name; nearest installed: "
                                        f"{nearest} (misspelled? its patches would never apply)"})
    return out


def installed_names(against: str | None = None) -> dict[str, str]:
    """Normalized name -> name of every distribution installed here (and in ``against``)."""
    from importlib import metadata

    found = {}
    for path in ([against], None) if against else (None,):
        for d in metadata.distributions(path=path) if path else metadata.distributions():
            name = d.metadata["Name"] if d.metadata else None
            if name:
                found.setdefault(_canonical(name), name)
    return found


def nearest_name(dist: str, names: dict[str, str]) -> str | None:
    """The installed name ``dist`` is most likely a misspelling of; None when it is an
    installed name (in another spelling) or close to none."""
    import difflib

    wanted = _canonical(dist)
    if wanted in names:
        return None
    close = difflib.get_close_matches(wanted, list(names), n=1, cutoff=NEAR)
    return names[close[0]] if close else None


def _canonical(name: str) -> str:
    """PEP 503's normal form: lower case, each run of ``-``, ``_`` and ``.`` one ``-``."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()
