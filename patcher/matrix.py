"""``source-patch matrix``: every spec against many upstream releases in one run.

Each release (a wheel, unpacked once into a cache, or a directory) is parsed once
per target module for all specs together.  Every patch gets a state:

* ``applies``: every anchor matches;
* ``gated``: its own ``requires`` excludes that release (an alternative patch may cover it);
* ``broken``: an anchor no longer matches, with the engine's message.

A spec whose own ``requires`` excludes a release is ``refused`` there as a whole (at run
time its ``on_unmet`` decides).  Patches whose module is not in a release (the other
framework) are not counted.

A wheel is untrusted input: opened as a regular file only, its declared sizes checked
against :class:`Limits` before anything is read, and only the sources the specs target
(and its METADATA) unpacked, into a folder named by the wheel's sha256, never by its
file name.  A wheel or directory that cannot be used is a :class:`ReleaseError`
(exit 2; 1 means an anchor is broken).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.core.bounded import open_regular, read_regular
from .errors import AnchorError, SourcePatchError, printable, shorten
from .locate import NotFound, find_source
from .requires import metadata_fields, unmet
from .spec import Patch, Spec

APPLIES, GATED, BROKEN = "applies", "gated", "broken"
CACHE = Path.home() / ".cache" / "source-patch" / "matrix"


class ReleaseError(SourcePatchError):
    """A wheel or directory that cannot be read as a release (the CLI exits 2)."""


@dataclass(frozen=True)
class Limits:
    """What a wheel may be or declare; checked before anything is decompressed."""

    wheel_bytes: int = 512 << 20  # the file (its central directory is parsed in memory)
    members: int = 100_000  # entries in the archive
    total_bytes: int = 2 << 30  # declared uncompressed size of all entries together
    member_bytes: int = 32 << 20  # one unpacked file (a source or METADATA), uncompressed
    ratio: int = 200  # uncompressed / compressed, for an entry over 1 MiB


LIMITS = Limits()
# What a broken, truncated or exotic archive raises from zipfile (encrypted entries:
# RuntimeError; unknown compression: NotImplementedError; bad names: UnicodeDecodeError).
_BAD_ZIP = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, ValueError,
            RuntimeError, NotImplementedError, OverflowError, struct.error, OSError)


@dataclass
class Release:
    dist: str
    version: str
    root: str  # a directory holding the release's packages and dist-info
    tops: set[str] = field(default_factory=set)  # top-level packages it ships

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


@dataclass
class Cell:
    """One spec against one release."""

    states: dict[str, tuple[str, str]] = field(default_factory=dict)  # patch id -> (state, reason)
    refused: str = ""  # the spec's own requires excludes the release (on_unmet decides at run time)

    def count(self, state: str) -> int:
        return sum(s == state for s, _ in self.states.values())

    @property
    def summary(self) -> str:
        if self.refused:
            return "refused"
        if not self.states:
            return "-"
        n, ok, gated = len(self.states), self.count(APPLIES), self.count(GATED)
        if self.count(BROKEN):
            return f"BROKEN {n - ok - gated}/{n}"
        return f"ok {ok}/{n}" + (f", {gated} gated" if gated else "") if ok else f"gated {gated}/{n}"


# --------------------------------------------------------------------------- releases


def release(path: str | Path, cache: Path | None = None, modules=None,
            limits: Limits | None = None) -> Release:
    """A wheel (unpacked into ``cache`` once: the sources of ``modules``, or every ``.py``
    when None) or an unpacked directory."""
    path = Path(path)
    if path.suffix == ".whl":
        root = _unpacked(path, cache or CACHE, modules, limits or LIMITS)
    elif path.is_dir():
        root = path
    else:
        raise ReleaseError(f"not a wheel or a directory: {_text(path)}")
    infos = sorted(root.glob("*.dist-info"))
    if len(infos) != 1:
        raise ReleaseError(f"{_text(root)}: expected one *.dist-info, found {len(infos)}")
    meta = metadata_fields(infos[0] / "METADATA", ("Name", "Version"))
    tops = {p.name for p in root.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", ".data"))}
    return Release(meta.get("Name", infos[0].name), meta.get("Version", "?"), str(root), tops)


def _text(value) -> str:
    """User text (a path, a member name) on one line: escapes shown, cut to 200 characters."""
    return shorten(repr(str(value))[1:-1])


def _unpacked(wheel: Path, cache: Path, modules, limits: Limits) -> Path:
    what = f"wheel {_text(wheel)}"
    with open_regular(wheel, what=what, error=ReleaseError) as f:  # a FIFO or folder: refused, no hang
        digest, size = hashlib.sha256(), 0
        try:
            while chunk := f.read(1 << 20):
                size += len(chunk)
                if size > limits.wheel_bytes:
                    raise ReleaseError(f"{what}: larger than {limits.wheel_bytes:,} bytes")
                digest.update(chunk)
            f.seek(0)
        except OSError as exc:
            raise ReleaseError(f"{what}: cannot read it ({exc.strerror or exc})") from None
        # Named by the wheel's content and what is unpacked, never by its file name: another
        # wheel under the same name is another folder.
        wanted = "*" if modules is None else "\n".join(sorted(modules))
        folder = _private_dir(cache)
        root = folder / f"{digest.hexdigest()}-{hashlib.sha256(wanted.encode()).hexdigest()[:16]}"
        if root.is_dir():
            return root
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=folder))  # 0700
        try:
            _unpack(f, what, tmp, modules, limits)
            try:
                os.rename(tmp, root)  # atomic: a crash mid-unpack leaves a temp folder, never an entry
            except OSError:
                if not root.is_dir():  # else another run unpacked the same wheel first
                    raise
        except OSError as exc:
            raise SourcePatchError(f"matrix cache {_text(folder)}: cannot write "
                                   f"({exc.strerror or exc})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _private_dir(path: Path) -> Path:
    """``path``, its missing levels created 0700; refused if another user owns it or others
    can write to it (they could plant a folder under a wheel's hash)."""
    try:
        _mkdirs(path)
        st = os.stat(path)
    except OSError as exc:
        raise SourcePatchError(f"matrix cache {_text(path)}: {exc.strerror or exc}") from None
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        raise SourcePatchError(f"matrix cache {_text(path)}: owned by another user or writable by "
                               "others; remove it or make it yours with mode 700")
    return path


def _mkdirs(path: Path) -> None:
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for level in reversed(missing):  # os.makedirs gives the upper levels the umask's mode
        level.mkdir(mode=0o700, exist_ok=True)


def _unpack(f, what: str, root: Path, modules, limits: Limits) -> None:
    """The wheel's METADATA and the sources ``modules`` resolve through, into ``root``."""
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except _BAD_ZIP as exc:
        raise ReleaseError(f"{what}: not a readable zip archive ({_reason(exc)})") from None
    if len(infos) > limits.members:
        raise ReleaseError(f"{what}: {len(infos):,} entries, more than {limits.members:,}")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise ReleaseError(f"{what}: an entry name appears twice")
    total = 0
    for info in infos:
        parts = info.filename.replace("\\", "/").split("/")
        if info.filename.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
            raise ReleaseError(f"{what}: unsafe path in the archive: {_text(info.filename)}")
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):  # a symlink (or device) entry
            raise ReleaseError(f"{what}: {_text(info.filename)} is not a regular file in the archive")
        total += info.file_size
        if total > limits.total_bytes:
            raise ReleaseError(f"{what}: declares more than {limits.total_bytes:,} bytes uncompressed")
        if info.file_size > 1 << 20 and info.file_size > limits.ratio * max(info.compress_size, 1):
            raise ReleaseError(f"{what}: {_text(info.filename)} expands more than {limits.ratio} times")
    metadata = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if len(metadata) != 1:
        raise ReleaseError(f"{what}: expected one *.dist-info/METADATA, found {len(metadata)}")
    for name in metadata + [n for n in names if _wanted(n, modules)]:
        info = zf.getinfo(name)
        if info.file_size > limits.member_bytes:
            raise ReleaseError(f"{what}: {_text(name)} is {info.file_size:,} bytes, more than "
                               f"{limits.member_bytes:,}")
        try:
            data = zf.read(info)  # stops at the declared size; checks the CRC
        except _BAD_ZIP as exc:
            raise ReleaseError(f"{what}: {_text(name)} cannot be read ({_reason(exc)})") from None
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReleaseError(f"{what}: {_text(name)} is not UTF-8 "
                               f"({exc.reason} at byte {exc.start})") from None
        dest = root.joinpath(*name.split("/"))
        _mkdirs(dest.parent)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with open(fd, "wb") as out:
            out.write(data)
    # Top-level packages as folders: what ``release`` counts as the frameworks it ships.
    for top in {n.split("/")[0] for n in names if "/" in n}:
        if top.isidentifier():
            (root / top).mkdir(mode=0o700, exist_ok=True)


def _wanted(name: str, modules) -> bool:
    """A source ``find_source`` may read for one of ``modules``: each level's ``.py`` or
    ``__init__.py`` (every ``.py`` when ``modules`` is None)."""
    if not name.endswith(".py"):
        return False
    if modules is None:
        return True
    stem = name[: -len("/__init__.py")] if name.endswith("/__init__.py") else name[:-3]
    dotted = stem.replace("/", ".")
    return any(m == dotted or m.startswith(dotted + ".") for m in modules)


def _reason(exc: BaseException) -> str:
    return _text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


# --------------------------------------------------------------------------- checking


def check_release(specs: list[Spec], rel: Release) -> dict[str, Cell]:
    """Cells of every spec against one release; each module is parsed once."""
    from .engine import rewrite  # libcst

    cells = {s.file: Cell() for s in specs}
    todo: dict[str, list[tuple[Spec, Patch]]] = {}
    for s in specs:
        mine = [p for p in s.patches if p.module.partition(".")[0] in rel.tops]  # not another framework's
        cells[s.file].refused = (unmet(s.requires, against=rel.root) or "") if mine else ""
        for p in mine if not cells[s.file].refused else ():
            reason = unmet(p.requires, against=rel.root)
            if reason:
                cells[s.file].states[p.id] = (GATED, reason)
            else:
                todo.setdefault(p.module, []).append((s, p))
    for module, pairs in todo.items():
        try:
            path = find_source(module, rel.root)
            source = _source(path)  # a ReleaseError is not a broken anchor: it stops the run
            # Every patch may drift alone: the engine reports each instead of stopping.
            lenient = [dataclasses.replace(p, on_drift="skip") for _, p in pairs]
            result = rewrite(source, lenient, module=module, file=str(path), version=lambda: rel.label)
            dropped = {(p.spec_name, p.id): err for p, err in result.dropped}
            for s, p in pairs:
                err = dropped.get((p.spec_name, p.id))
                cells[s.file].states[p.id] = (BROKEN, _first_problem(err)) if err else (APPLIES, "")
        except ReleaseError:
            raise
        except (NotFound, AnchorError, SourcePatchError) as exc:
            for s, p in pairs:
                cells[s.file].states[p.id] = (BROKEN, _first_problem(exc))
    return cells


def _source(path: Path) -> str:
    """A target's source, from a wheel's folder or a user's directory (a FIFO there: refused)."""
    data = read_regular(path, max_bytes=LIMITS.member_bytes, what="release source", error=ReleaseError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReleaseError(f"{_text(path)}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _first_problem(error: Exception) -> str:
    lines = str(error).splitlines()
    return " ".join(line.strip() for line in lines[1:3]) if len(lines) > 1 else lines[0]


def run(specs: list[Spec], paths: list[str], progress=None) -> tuple[list[Release], dict]:
    """All releases (sorted by distribution and version) and {(spec file, label): Cell}."""
    from packaging.version import InvalidVersion, Version

    def order(rel: Release):
        try:
            return rel.dist, Version(rel.version)
        except InvalidVersion:
            return rel.dist, Version("0")

    # Every release is opened first: a bad one fails the run before minutes of checking.
    modules = {p.module for s in specs for p in s.patches}
    releases, grid = [release(path, modules=modules) for path in paths], {}
    for i, (path, rel) in enumerate(zip(paths, releases)):
        if progress:
            progress(i, len(paths), Path(path).name)
        for file, cell in check_release(specs, rel).items():
            grid[file, rel.label] = cell
    if progress:
        progress(len(paths), len(paths), "done")
    return sorted(releases, key=order), grid


# --------------------------------------------------------------------------- output


def exit_code(grid: dict) -> int:
    """0: everything applies or is gated; 1: an anchor is broken (a ReleaseError: 2)."""
    return 1 if any(c.count(BROKEN) for c in grid.values()) else 0


def table(specs: list[Spec], releases: list[Release], grid: dict) -> str:
    """A Markdown table, a row per release and a column per spec, then every patch that
    is not ``applies`` with its reason."""
    head = ["release", *(s.name for s in specs)]
    rows = [head, ["---"] * len(head)]
    for r in releases:
        rows.append([_text(r.label), *(grid[s.file, r.label].summary for s in specs)])  # METADATA: any text
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    # One line per (patch, state, reason): the releases it holds for, in order.
    groups: dict[tuple, list[str]] = {}
    for s in specs:
        for r in releases:
            cell = grid[s.file, r.label]
            if cell.refused:
                why = re.sub(r", found \S+$", "", cell.refused)
                groups.setdefault((s.name, "(the whole spec)", "refused", why), []).append(r.version)
            for pid, (state, reason) in cell.states.items():
                if state != APPLIES:
                    why = re.sub(r", found \S+$", "", reason)
                    groups.setdefault((s.name, pid, state, why), []).append(r.version)
    details = [f"- {name} / {pid}: **{state}** on {', '.join(map(_text, versions))}: {printable(why)}"
               for (name, pid, state, why), versions in groups.items()]
    return "\n".join(lines + ([""] + details if details else []))


def as_json(specs: list[Spec], releases: list[Release], grid: dict, code: int | None = None) -> str:
    """The grid as JSON (``matrix --json`` / ``--json-out``), with the exit code when given."""
    def cell(c: Cell) -> dict:
        return {"summary": c.summary, "refused": c.refused,
                "patches": {pid: {"state": st, "reason": why} for pid, (st, why) in c.states.items()}}

    doc = {"releases": [dataclasses.asdict(r) | {"tops": sorted(r.tops)} for r in releases],
           "specs": [{"name": s.name, "file": s.file,
                      "cells": {r.label: cell(grid[s.file, r.label]) for r in releases}} for s in specs]}
    return json.dumps(doc if code is None else {**doc, "exit": code}, indent=1)


def progress_bar(stream=None):
    """A one-line bar on a terminal, one line per step elsewhere (logs stay readable)."""
    def show(done: int, total: int, what: str) -> None:
        _draw(stream or sys.stderr, done, total, what)  # looked up late: pytest swaps stderr
    return show


def _draw(stream, done: int, total: int, what: str) -> None:
    what = _text(what)  # a file name's escape sequences would drive the terminal
    if stream.isatty():
        filled = int(30 * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what[:50]:<50}")
        if done == total:
            stream.write("\n")
    elif done < total:
        stream.write(f"matrix: {done + 1}/{total} {what}\n")
    stream.flush()
