"""Read dumps written by ``source_patch.runtime.dump.api``: manifests in, tensors lazily.

    import source_patch.runtime.dump.reader as reader   # reader.load(...)
    for r in load("sp-dumps/default", name="attn_*", layer=3, step=0):
        print(r.name, r.tags, r.shape, r.tensor.float().norm())

Nothing is unpickled and no file name is parsed: every record comes from a line of
``rank-<r>/manifest.jsonl``; its tensor is read from the safetensors file on first
access.  Both go through the bounded reader (core/bounded.py): a manifest line or a
tensor header that is too large, too deep, malformed or points outside its rank
directory, and a FIFO, device or symlink where a file should be, are a
:class:`DumpError` naming the file, never a hang, a ``RecursionError`` or a crash.
CLI summary (of a dump root's latest run, or ``--exp-name NAME``; ``--json``: the same as
JSON on stdout; exit 2 with one line when the dumps cannot be read)::

    source-patch dumps sp-dumps [--exp-name NAME] [--name 'attn_*'] [--step 0] [--json]
    python -m source_patch.runtime.dump.reader ...      # the same
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..core import bounded, commands

MANIFEST = "manifest.jsonl"
MAX_LINE = 1 << 20              # bytes in one manifest line (ours: a few hundred)
MAX_LINE_ITEMS = 10_000         # arrays and objects in one line (its tags)
MAX_HEADER = 100_000_000        # bytes of a safetensors header (the safetensors library's own limit)
MAX_HEADER_ITEMS = 1_000_000    # arrays and objects in it: 3 per tensor
MAX_DIMS = 64


class DumpError(ValueError):
    """An unreadable or malformed dump: a manifest line, the file it names, a tensor header."""


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
        tensor = read_tensors(self.file, [self.key])[self.key]
        return tensor if device == "cpu" else tensor.to(device)


def rank_dirs(path: str | Path, exp_name: str | None = None) -> list[Path]:
    """The rank directories under ``path``: a rank directory itself, an experiment
    directory, or a dump root (then ``exp_name``, or its latest run: :func:`choose`)."""
    folder, _ = choose(path, exp_name)
    found = [folder] if (folder / MANIFEST).exists() else _with_manifest(folder)
    if not found:
        raise FileNotFoundError(f"no dump manifests under {folder} (looked for */{MANIFEST}: "
                                "rank-<r>/ or engine_<r>/ folders)")
    return sorted(found, key=_rank_number)


# A run's name is its kind plus, when it is one of several, a start time (train_moe-20261124-094143).
_STAMP = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")  # -2, -3: a second run started in the same second


@dataclass
class Run:
    """One experiment directory of a dump root."""

    name: str
    path: Path
    time: float     # its newest manifest's modification time
    ranks: int      # process folders

    @property
    def kind(self) -> str:
        return _STAMP.sub("", self.name)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time))
        return f"{self.name} ({when}, {self.ranks} rank{'s' if self.ranks != 1 else ''})"


class RunsError(ValueError):
    """A dump root holds runs of different kinds: which one to read is the caller's choice."""

    def __init__(self, root: Path, runs: list, flag: str = "exp_name="):
        self.root, self.runs, self.flag = root, runs, flag
        super().__init__(f"{root} holds {len(runs)} runs of different kinds: {_listing(runs)}; "
                         f"pick one with {flag}NAME or pass its folder")


def runs(root: str | Path) -> list[Run]:
    """The experiment directories of a dump root (those with process folders), oldest first:
    by the start time in their names, then by their last write."""
    root = Path(root)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        ranks = _with_manifest(folder)
        if ranks:
            found.append(Run(folder.name, folder, max(_mtime(d / MANIFEST) for d in ranks), len(ranks)))
    return sorted(found, key=lambda r: (*_started(r.name), r.time))


def _started(name: str) -> tuple:
    """(start time, number within that second) from a run's name; ("", 0) without them."""
    m = _STAMP.search(name)
    return (m[1], int(m[2] or 1)) if m else ("", 0)


def choose(path: str | Path, exp_name: str | None = None) -> tuple[Path, list]:
    """The folder to read under ``path`` and the runs it was chosen from (empty unless a
    dump root held several).  A rank or experiment directory is itself; ``exp_name``
    picks ``path/exp_name``; of a dump root's runs the latest is taken when all are runs
    of one kind (their names differ in the start time only), else :class:`RunsError`
    lists them."""
    root = Path(path)
    if (root / MANIFEST).exists() or _with_manifest(root):  # not is_file(): a FIFO there is an error later
        return root, []
    if exp_name is not None:
        if not (root / exp_name).is_dir() and (found := runs(root)):
            raise FileNotFoundError(f"no run {exp_name!r} under {root} (its runs: {_listing(found)})")
        return root / exp_name, []
    found = runs(root)
    if len(found) <= 1:
        return (found[0].path if found else root), []
    if len({r.kind for r in found}) > 1:
        raise RunsError(root, found)
    return found[-1].path, found


def choose_for_cli(path, exp_name, flag: str = "--exp-name ") -> Path:
    """:func:`choose` for a command line: errors name ``flag``, and when it took the latest
    of several runs a note on stderr says which and lists the others."""
    try:
        folder, found = choose(path, exp_name)
    except RunsError as exc:
        raise RunsError(exc.root, exc.runs, flag) from None
    if found:
        others = [r for r in found if r.path != folder]
        commands.note(f"{Path(path)} holds {len(found)} runs; reading the latest, {folder.name} "
                      f"(others: {_listing(others)}; pick one with {flag}NAME)")
    return folder


def _listing(found: list, most: int = 8) -> str:
    """Runs for a one-line message, the newest first."""
    shown_runs = [r.describe() for r in reversed(found)]
    more = len(shown_runs) - most
    return ", ".join(shown_runs[:most]) + (f" and {more} older" if more > 0 else "")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _with_manifest(folder: Path) -> list:
    """Process folders (``rank-<r>``, ``engine_<r>``: the ``rank_dir`` setting) of one experiment."""
    return [d for d in folder.iterdir() if (d / MANIFEST).exists()] if folder.is_dir() else []


def _rank_number(folder: Path):
    suffix = folder.name.rpartition("-" if "-" in folder.name else "_")[2]
    return (0, int(suffix)) if suffix.isdigit() else (1, suffix)


def read_manifest(rank_dir: Path) -> Iterable[dict]:
    """Lines of one manifest, each a checked record line (:func:`check_line`); a torn
    last line (a crash mid-append) is skipped, any other bad line is a DumpError."""
    path = rank_dir / MANIFEST
    with bounded.open_regular(path, what="manifest", error=DumpError) as lines:
        number = 0
        while True:
            raw = lines.readline(MAX_LINE + 1)
            number += 1
            if len(raw) > MAX_LINE:
                raise DumpError(f"{path}:{number}: a line over {MAX_LINE:,} bytes")
            if not raw.endswith(b"\n"):
                return  # the end, or a torn last line
            where = f"{path}:{number}"
            yield check_line(bounded.load_json(raw, what=where, error=DumpError, max_bytes=MAX_LINE,
                                               max_items=MAX_LINE_ITEMS, kind=dict), where)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plain_name(name) -> bool:
    """A file name inside its folder: no separator, not '.', '..' or empty."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and not any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)))


def check_line(line: dict, where: str) -> dict:
    """``line`` if it has every field a record needs with the right type, else DumpError.
    ``file`` must be a plain name: a line cannot point outside its rank directory."""
    problems = []
    for key, ok, want in (("name", isinstance(line.get("name"), str), "a string"),
                          ("file", plain_name(line.get("file")), "a plain file name in the rank directory"),
                          ("key", isinstance(line.get("key"), str), "a string"),
                          ("dtype", isinstance(line.get("dtype"), str), "a string"),
                          ("seq", _is_int(line.get("seq")), "an integer"),
                          ("tags", isinstance(line.get("tags", {}), dict), "an object"),
                          ("shape", _is_shape(line.get("shape")), "a list of sizes")):
        if not ok:
            problems.append(f"'{key}' is {shown(line.get(key))}, expected {want}")
    if problems:
        raise DumpError(f"{where}: " + "; ".join(problems))
    return line


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(n) and n >= 0 for n in shape)


def shown(value) -> str:
    """A value for a one-line error: repr, cut to 60 characters; None (absent or null) as missing."""
    text = "missing" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_tensors(path: str | Path, keys) -> dict:
    """``{key: tensor}`` for ``keys`` of one safetensors file, on the CPU.  The file must
    be a regular file (not a FIFO, device or symlink); its header goes through the
    bounded reader, and each tensor's dtype, shape and offsets are checked against the
    file before anything is allocated.  Any problem is a DumpError naming the file."""
    import torch

    with bounded.open_regular(path, what="tensor file", error=DumpError, follow_symlinks=False) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > min(MAX_HEADER, size - 8):
            raise DumpError(f"{path}: not a safetensors file (header length {length} in a file of {size} bytes)")
        header = bounded.load_json(f.read(length), what=f"{path}: header", error=DumpError, max_bytes=MAX_HEADER,
                                   max_items=MAX_HEADER_ITEMS, kind=dict)
        data = size - 8 - length
        out = {}
        for key in keys:
            dtype, shape, start, end = _entry(header, key, data, f"{path}: tensor {shown(key)}")
            buffer = torch.empty(end - start, dtype=torch.uint8)
            f.seek(8 + length + start)
            if end > start and f.readinto(buffer.numpy()) != end - start:
                raise DumpError(f"{path}: tensor {shown(key)}: the file ended early")
            out[key] = buffer.view(dtype).reshape(shape)
    return out


def _entry(header: dict, key: str, data: int, where: str) -> tuple:
    """(torch dtype, shape, start, end) of ``key``, checked: a known dtype, a shape of
    at most MAX_DIMS sizes whose bytes are exactly its offsets' span, inside the data."""
    from .files import ST_DTYPES

    entry = header.get(key) if key != "__metadata__" else None
    if not isinstance(entry, dict):
        raise DumpError(f"{where}: not in the file")
    dtype = {code: t for t, code in ST_DTYPES.items()}.get(entry.get("dtype"))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None:
        raise DumpError(f"{where}: unknown dtype {shown(entry.get('dtype'))}")
    if not _is_shape(shape):
        raise DumpError(f"{where}: shape {shown(shape)} is not a list of at most {MAX_DIMS} sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1] <= data):
        raise DumpError(f"{where}: data_offsets {shown(offsets)} outside the file's {data} data bytes")
    start, end = offsets
    if math.prod(shape) * dtype.itemsize != end - start:
        raise DumpError(f"{where}: shape {shown(shape)} of {ST_DTYPES[dtype]} does not fit its "
                        f"{end - start} bytes")
    return dtype, shape, start, end


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
            record_tags = line.get("tags", {})  # check_line: a dict
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


def _rows(records: list[Record]) -> dict:
    """name -> its records' count, steps, ranks, layers, shapes, dtypes and bytes."""
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
    return rows


def _totals(records: list[Record]) -> tuple:
    """(files, bytes, the most writing processes of one rank directory)."""
    sessions: dict = {}  # rank directory -> writing processes
    for r in records:
        sessions.setdefault(r.file.parent, set()).add(r.session)
    reused = max((len(v) for v in sessions.values()), default=0)
    return len({r.file for r in records}), sum(int(r.line.get("bytes", 0)) for r in records), reused


def summary(records: list[Record]) -> str:
    """A table: one row per name, with its steps, ranks, layers, count, shapes, dtypes."""
    if not records:
        return "no records"
    rows = _rows(records)
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
    files, total, reused = _totals(records)
    foot = (f"{len(records)} records, {len(rows)} names, {files} files, {total / 2**20:.2f} MiB"
            + (f"; up to {reused} sessions in one rank directory (it was reused: see load(session=...))"
               if reused > 1 else ""))
    return "\n".join(lines + [foot])


def summary_json(records: list[Record]) -> dict:
    """What :func:`summary` shows, as data (``source-patch dumps --json``): a row per name
    (its steps, ranks and layers as sorted values), then the totals."""
    files, total, reused = _totals(records)
    names = [{"name": name, "records": row["n"], "steps": _values(row["steps"]), "ranks": _values(row["ranks"]),
              "layers": _values(row["layers"]), "shapes": sorted(map(list, row["shapes"])),
              "dtypes": sorted(row["dtypes"]), "bytes": row["bytes"]}
             for name, row in sorted(_rows(records).items())]
    return {"names": names, "records": len(records), "files": files, "bytes": total,
            "most_sessions_in_a_rank_directory": reused}


def _values(values) -> list:
    """A tag's values, sorted: integers first, then the others by their text."""
    def number(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return sorted(filter(number, values)) + sorted((v for v in values if not number(v)), key=str)


def parser(prog: str = "python -m source_patch.runtime.dump.reader"):
    p = commands.Parser(prog=prog, description="Summarise a dump directory: a row per dumped name.")
    p.add_argument("dir", help="a dump root (its latest run, when its runs are of one kind), "
                   "an experiment (run) directory or a rank directory")
    p.add_argument("--exp-name", metavar="NAME", help="the run (experiment directory) to read under a dump root")
    p.add_argument("--name", action="append", help="fnmatch glob (repeatable)")
    p.add_argument("--step", type=int, action="append")
    p.add_argument("--rank", type=int, action="append")
    p.add_argument("--layer", type=int, action="append")
    p.add_argument("--phase", action="append")
    p.add_argument("--json", action="store_true", help="the summary as JSON on stdout (an error too)")
    return p


def main(argv=None, prog: str = "python -m source_patch.runtime.dump.reader") -> int:
    args = parser(prog).parse_args(argv)
    try:
        folder = choose_for_cli(args.dir, args.exp_name)
        records = load(folder, name=args.name, step=args.step, rank=args.rank, layer=args.layer, phase=args.phase)
    except (OSError, ValueError) as exc:  # DumpError is a ValueError: unusable input, exit 2 as compare
        return commands.error(commands.first_line(exc), as_json=args.json)
    if args.json:
        print(json.dumps({"dir": str(folder), **summary_json(records), "exit": commands.OK}, indent=1))
    else:
        print(summary(records))
    return commands.OK


if __name__ == "__main__":
    sys.exit(main())
