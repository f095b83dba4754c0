"""Read dumps written by ``source_patch.runtime.dump.api``: manifests in, tensors lazily.

    import source_patch.runtime.dump.reader as reader   # reader.load(...)
    for r in load("sp-dumps/default", name="attn_*", layer=3, step=0):
        print(r.name, r.tags, r.shape, r.tensor.float().norm())

Nothing is unpickled and no file name is parsed: every record comes from a line of
``rank-<r>/manifest.jsonl``; its tensor is read from the safetensors file on first
access.  CLI summary::

    python -m source_patch.runtime.dump.reader sp-dumps/default [--name 'attn_*'] [--step 0]
"""

from __future__ import annotations

import fnmatch
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

MANIFEST = "manifest.jsonl"


@dataclass
class Record:
    name: str
    tags: dict
    file: Path          # the safetensors file holding the tensor
    key: str            # its key in that file
    shape: tuple
    dtype: str          # torch dtype name without "torch.", e.g. "bfloat16"
    seq: int            # per-process order of dump() calls
    session: str = ""   # the writing process (several when an exp dir is reused)
    line: dict = field(default_factory=dict, repr=False)  # the manifest line as written

    @property
    def step(self):
        return self.tags.get("step")

    @property
    def rank(self):
        return self.tags.get("rank")

    @property
    def layer(self):
        return self.tags.get("layer")

    @property
    def phase(self):
        return self.tags.get("phase")

    @property
    def microbatch(self):
        return self.tags.get("microbatch")

    @property
    def tensor(self):
        """The tensor, read from disk now (each access reads again: keep the result)."""
        return self.load()

    def load(self, device: str = "cpu"):
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt", device=device) as handle:
            return handle.get_tensor(self.key)


def rank_dirs(path: str | Path, exp_name: str | None = None) -> list[Path]:
    """The rank directories under ``path``: a rank directory itself, an experiment
    directory, or a dump root (then ``exp_name``, or its only experiment)."""
    root = Path(path)
    if (root / MANIFEST).is_file():
        return [root]
    if exp_name is not None:
        root = root / exp_name
    found = _with_manifest(root)
    if not found and exp_name is None:
        experiments = sorted(d for d in root.iterdir() if d.is_dir() and _with_manifest(d)) \
            if root.is_dir() else []
        if len(experiments) == 1:
            found = _with_manifest(experiments[0])
        elif len(experiments) > 1:
            names = ", ".join(d.name for d in experiments)
            raise ValueError(f"{root} holds several experiments ({names}): pass exp_name= or a deeper path")
    if not found:
        raise FileNotFoundError(f"no dump manifests under {Path(path)} (looked for */{MANIFEST}: "
                                "rank-<r>/ or engine_<r>/ folders)")
    return sorted(found, key=_rank_number)


def _with_manifest(folder: Path) -> list:
    """Process folders (``rank-<r>``, ``engine_<r>``: the ``rank_dir`` setting) of one experiment."""
    return [d for d in folder.iterdir() if (d / MANIFEST).is_file()] if folder.is_dir() else []


def _rank_number(folder: Path):
    suffix = folder.name.rpartition("-" if "-" in folder.name else "_")[2]
    return (0, int(suffix)) if suffix.isdigit() else (1, suffix)


def read_manifest(rank_dir: Path) -> Iterable[dict]:
    """Lines of one manifest; a torn last line (a crash mid-append) is skipped."""
    with open(rank_dir / MANIFEST, "rb") as lines:
        for raw in lines:
            if not raw.endswith(b"\n"):
                break
            try:
                yield json.loads(raw)
            except ValueError:
                continue


def _matches(value: Any, wanted: Any, glob: bool = False) -> bool:
    if wanted is None:
        return True
    if callable(wanted):
        return bool(wanted(value))
    if isinstance(wanted, (list, tuple, set, frozenset, range)):
        return any(_matches(value, w, glob) for w in wanted)
    if glob and isinstance(wanted, str) and isinstance(value, str):
        return fnmatch.fnmatchcase(value, wanted)
    if isinstance(value, bool) != isinstance(wanted, bool):
        return False  # True is not layer 1
    return value == wanted


def load(path: str | Path, name=None, layer=None, step=None, rank=None, phase=None, *,
         exp_name: str | None = None, session: str | None = None, **tags) -> list[Record]:
    """Records under ``path`` that match every given criterion, in (rank, seq) order.

    Each criterion is a value, a list/tuple/set/range of values, or a predicate;
    ``name`` also takes fnmatch globs.  Other keyword arguments match other tags
    (``microbatch=0``, ``tp=1``).  The tensors are not read until ``.tensor``."""
    out = []
    for rank_dir in rank_dirs(path, exp_name):
        for line in read_manifest(rank_dir):
            record_tags = line.get("tags", {})
            if not (_matches(line.get("name"), name, glob=True)
                    and _matches(record_tags.get("layer"), layer)
                    and _matches(record_tags.get("step"), step)
                    and _matches(record_tags.get("rank"), rank)
                    and _matches(record_tags.get("phase"), phase)
                    and _matches(line.get("session"), session)
                    and all(_matches(record_tags.get(k), v) for k, v in tags.items())):
                continue
            out.append(Record(name=line["name"], tags=record_tags, file=rank_dir / line["file"],
                              key=line["key"], shape=tuple(line["shape"]), dtype=line["dtype"],
                              seq=line["seq"], session=line.get("session", ""), line=line))
    return out


def _ranges(values) -> str:
    numbers = sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool)})
    others = sorted({str(v) for v in values if not (isinstance(v, int) and not isinstance(v, bool))})
    parts, start, prev = [], None, None
    for n in numbers:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts + others) or "-"


def summary(records: list[Record]) -> str:
    """A table: one row per name, with its steps, ranks, layers, count, shapes, dtypes."""
    if not records:
        return "no records"
    rows: dict = {}
    for r in records:
        row = rows.setdefault(r.name, {"n": 0, "steps": set(), "ranks": set(), "layers": set(),
                                       "shapes": set(), "dtypes": set(), "bytes": 0})
        row["n"] += 1
        row["steps"].add(r.step)
        row["ranks"].add(r.rank)
        if r.layer is not None:
            row["layers"].add(r.layer)
        row["shapes"].add(r.shape)
        row["dtypes"].add(r.dtype)
        row["bytes"] += int(r.line.get("bytes", 0))
    header = ("name", "records", "steps", "ranks", "layers", "shape", "dtype", "MiB")
    table = [header]
    for name in sorted(rows):
        row = rows[name]
        shapes = (str(list(next(iter(row["shapes"])))) if len(row["shapes"]) == 1
                  else f"{len(row['shapes'])} shapes")
        table.append((name, str(row["n"]), _ranges(row["steps"]), _ranges(row["ranks"]),
                      _ranges(row["layers"]), shapes, ",".join(sorted(row["dtypes"])),
                      f"{row['bytes'] / 2**20:.2f}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    sessions: dict = {}  # rank directory -> writing processes
    for r in records:
        sessions.setdefault(r.file.parent, set()).add(r.session)
    reused = max(len(v) for v in sessions.values())
    files = {r.file for r in records}
    total = sum(int(r.line.get("bytes", 0)) for r in records)
    foot = (f"{len(records)} records, {len(rows)} names, {len(files)} files, {total / 2**20:.2f} MiB"
            + (f"; up to {reused} sessions in one rank directory (it was reused: see load(session=...))"
               if reused > 1 else ""))
    return "\n".join(lines + [foot])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.dump.reader",
                                     description="Summarise a dump directory.")
    parser.add_argument("dir", help="a dump root, an experiment directory or a rank directory")
    parser.add_argument("--exp-name")
    parser.add_argument("--name", action="append", help="fnmatch glob (repeatable)")
    parser.add_argument("--step", type=int, action="append")
    parser.add_argument("--rank", type=int, action="append")
    parser.add_argument("--layer", type=int, action="append")
    parser.add_argument("--phase", action="append")
    args = parser.parse_args(argv)
    try:
        records = load(args.dir, name=args.name, step=args.step, rank=args.rank, layer=args.layer,
                       phase=args.phase, exp_name=args.exp_name)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
