"""``source-patch matrix``: every spec against many upstream releases in one run.

Each release (a wheel, unpacked once into a cache, or a directory) is parsed once
per target module for all specs together.  Every patch gets a state:

* ``applies``: every anchor matches;
* ``gated``: its own ``requires`` excludes that release (an alternative patch may cover it);
* ``broken``: an anchor no longer matches, with the engine's message.

A spec whose own ``requires`` excludes a release is ``refused`` there as a whole (at run
time its ``on_unmet`` decides).  Patches whose module is not in a release (the other
framework) are not counted.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import AnchorError, SourcePatchError
from .finder import metadata_fields, unmet
from .locate import NotFound, find_source
from .spec import Patch, Spec

APPLIES, GATED, BROKEN = "applies", "gated", "broken"
CACHE = Path.home() / ".cache" / "source-patch" / "matrix"


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


def release(path: str | Path, cache: Path = CACHE) -> Release:
    """A wheel (unpacked into ``cache`` once) or an unpacked directory."""
    path = Path(path)
    if path.suffix == ".whl":
        root = cache / path.stem
        if not (root / ".complete").exists():
            _unpack(path, root)
    elif path.is_dir():
        root = path
    else:
        raise SourcePatchError(f"not a wheel or a directory: {path}")
    infos = sorted(root.glob("*.dist-info"))
    if len(infos) != 1:
        raise SourcePatchError(f"{root}: expected one *.dist-info, found {len(infos)}")
    meta = metadata_fields(infos[0] / "METADATA", ("Name", "Version"))
    tops = {p.name for p in root.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", ".data"))}
    return Release(meta.get("Name", infos[0].name), meta.get("Version", "?"), str(root), tops)


def _unpack(wheel: Path, root: Path) -> None:
    """Python sources and metadata only: all a dry run reads."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(".py") or ".dist-info/" in name:
                if ".." in Path(name).parts or name.startswith("/"):
                    raise SourcePatchError(f"{wheel}: unsafe path in the archive: {name}")
                zf.extract(name, root)
    (root / ".complete").touch()


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
            # Every patch may drift alone: the engine reports each instead of stopping.
            lenient = [dataclasses.replace(p, on_drift="skip") for _, p in pairs]
            result = rewrite(path.read_text(encoding="utf-8"), lenient, module=module,
                             file=str(path), version=lambda: rel.label)
            dropped = {(p.spec_name, p.id): err for p, err in result.dropped}
            for s, p in pairs:
                err = dropped.get((p.spec_name, p.id))
                cells[s.file].states[p.id] = (BROKEN, _first_problem(err)) if err else (APPLIES, "")
        except (NotFound, AnchorError, SourcePatchError) as exc:
            for s, p in pairs:
                cells[s.file].states[p.id] = (BROKEN, _first_problem(exc))
    return cells


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

    releases, grid = [], {}
    for i, path in enumerate(paths):
        if progress:
            progress(i, len(paths), Path(path).name)
        rel = release(path)
        releases.append(rel)
        for file, cell in check_release(specs, rel).items():
            grid[file, rel.label] = cell
    if progress:
        progress(len(paths), len(paths), "done")
    return sorted(releases, key=order), grid


# --------------------------------------------------------------------------- output


def exit_code(grid: dict) -> int:
    """0: everything applies or is gated; 1: an anchor is broken."""
    return 1 if any(c.count(BROKEN) for c in grid.values()) else 0


def table(specs: list[Spec], releases: list[Release], grid: dict) -> str:
    """A Markdown table, a row per release and a column per spec, then every patch that
    is not ``applies`` with its reason."""
    head = ["release", *(s.name for s in specs)]
    rows = [head, ["---"] * len(head)]
    for r in releases:
        rows.append([r.label, *(grid[s.file, r.label].summary for s in specs)])
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
    details = [f"- {name} / {pid}: **{state}** on {', '.join(versions)}: {why}"
               for (name, pid, state, why), versions in groups.items()]
    return "\n".join(lines + ([""] + details if details else []))


def as_json(specs: list[Spec], releases: list[Release], grid: dict) -> str:
    def cell(c: Cell) -> dict:
        return {"summary": c.summary, "refused": c.refused,
                "patches": {pid: {"state": st, "reason": why} for pid, (st, why) in c.states.items()}}

    doc = {"releases": [dataclasses.asdict(r) | {"tops": sorted(r.tops)} for r in releases],
           "specs": [{"name": s.name, "file": s.file,
                      "cells": {r.label: cell(grid[s.file, r.label]) for r in releases}} for s in specs]}
    return json.dumps(doc, indent=1)


def progress_bar(stream=None):
    """A one-line bar on a terminal, one line per step elsewhere (logs stay readable)."""
    def show(done: int, total: int, what: str) -> None:
        _draw(stream or sys.stderr, done, total, what)  # looked up late: pytest swaps stderr
    return show


def _draw(stream, done: int, total: int, what: str) -> None:
    if stream.isatty():
        filled = int(30 * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what[:50]:<50}")
        if done == total:
            stream.write("\n")
    elif done < total:
        stream.write(f"matrix: {done + 1}/{total} {what}\n")
    stream.flush()
