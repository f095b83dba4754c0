"""``source-patch watch RUN_FOLDER [--follow] [--json]``: what the sentinels wrote
(docs/sentinels.md#source-patch-watch).

A run folder holds ``rank-<r>/events.jsonl`` (what happened) and ``rank-<r>/metrics.jsonl``
(per-step figures), one JSON object a line (runtime/sentinels/events.py).  This prints
every rank's events in time order (kind, step, rank, where) and, per metric kind, the
latest line's figures per rank and layer.  ``--follow`` then keeps reading new lines
(every 0.5 s) until Ctrl-C.

Bounded: files are opened without blocking and only if regular (a FIFO is refused at
once), read in chunks, a line over 1 MiB is skipped and said, a line that is not a JSON
object with a ``kind`` is counted and said; never a traceback.  Exit codes (docs/cli.md):
0 no event, 1 events present, 2 the folder is missing or not a run folder.

Standard library and core only: the CLI imports it without torch.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from ..core import bounded, commands

STREAMS = ("events", "metrics")
MAX_LINE = 1 << 20          # bytes: a longer line is refused
CHUNK = 1 << 16             # bytes read at once
POLL_S = 0.5                # --follow's poll interval
MAX_EVENTS = 100_000        # events kept for the answer (all are counted)
_RANK = re.compile(r"rank-(\d{1,9})")
_META = ("kind", "time", "rank", "step", "layer")


class NotARun(Exception):
    """The folder cannot be read as a run folder (exit 2)."""


# ---------------------------------------------------------------- one file, read incrementally


class _Lines:
    """One JSONL file read from where the last read stopped: whole lines only (a partial
    last line waits for its newline), none longer than MAX_LINE."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = path, label
        self.offset = 0
        self.line = 0                 # lines seen so far
        self.buffer = b""
        self.skipping = False         # inside a line over MAX_LINE: drop up to its newline
        self.refused: str | None = None  # not a regular file, unreadable: said once, not read again
        self.malformed = 0
        self.first_malformed: str | None = None
        self.oversized = 0
        self.first_oversized: str | None = None

    def read(self) -> list:
        """The new whole lines, parsed: [(line number, dict)]."""
        if self.refused:
            return []
        try:
            handle = bounded.open_regular(self.path, what=self.label, missing_ok=True)
        except OSError as exc:
            self.refused = commands.first_line(exc)
            return []
        if handle is None:
            return []
        out = []
        with handle:
            try:
                if os.fstat(handle.fileno()).st_size < self.offset:  # truncated or replaced: start again
                    self.offset, self.buffer, self.skipping = 0, b"", False
                handle.seek(self.offset)
                while True:
                    chunk = handle.read(CHUNK)
                    if not chunk:
                        break
                    self.offset += len(chunk)
                    out += self._take(chunk)
            except OSError as exc:
                self.refused = f"{self.label}: cannot read: {exc.strerror or exc}"
        return out

    def _take(self, chunk: bytes) -> list:
        out = []
        while chunk:
            cut = chunk.find(b"\n")
            if cut < 0:
                if self.skipping:
                    return out
                self.buffer += chunk
                if len(self.buffer) > MAX_LINE:
                    self._oversize(len(self.buffer))
                return out
            piece, chunk = chunk[:cut], chunk[cut + 1:]
            if self.skipping:
                self.skipping = False
                continue
            line, self.buffer = self.buffer + piece, b""
            if len(line) > MAX_LINE:
                self._oversize(len(line))
                self.skipping = False  # its newline is already read
                continue
            self.line += 1
            record = self._parse(line)
            if record is not None:
                out.append((self.line, record))
        return out

    def _oversize(self, seen: int) -> None:
        self.line += 1
        self.oversized += 1
        self.first_oversized = self.first_oversized or \
            f"{self.label} line {self.line}: over {MAX_LINE:,} bytes ({seen:,} read), skipped"
        self.buffer, self.skipping = b"", True

    def _parse(self, line: bytes):
        if not line.strip():
            return None
        try:
            record = bounded.load_json(line, what=f"line {self.line}", max_bytes=MAX_LINE, kind=dict)
            if not isinstance(record.get("kind"), str):
                raise ValueError(f"line {self.line}: no \"kind\"")
            return record
        except ValueError as exc:
            self.malformed += 1
            self.first_malformed = self.first_malformed or f"{self.label} {commands.first_line(exc)}"
            return None

    def finish(self) -> None:
        """The end of a one-shot read: a last line without its newline is malformed."""
        if self.buffer and not self.skipping:
            self.line += 1
            self.malformed += 1
            self.first_malformed = self.first_malformed or \
                f"{self.label} line {self.line}: no newline at its end (still being written?)"
            self.buffer = b""

    def problems(self) -> list:
        said = []
        if self.refused:
            said.append(self.refused)
        if self.malformed:
            said.append(f"{self.label}: {self.malformed} malformed line{'s' * (self.malformed > 1)} "
                        f"(the first: {self.first_malformed})")
        if self.oversized:
            said.append(f"{self.label}: {self.oversized} line{'s' * (self.oversized > 1)} over "
                        f"{MAX_LINE:,} bytes refused (the first: {self.first_oversized})")
        return said


# ---------------------------------------------------------------- the run folder


class Run:
    """A run folder: every rank's two files, read as they grow."""

    def __init__(self, folder: str):
        path = Path(folder)
        if not path.exists():
            raise NotARun(f"{folder}: no such folder (give the folder SOURCE_PATCH_SENTINELS_DIR named)")
        if not path.is_dir():
            raise NotARun(f"{folder} is not a folder (give the folder SOURCE_PATCH_SENTINELS_DIR named)")
        self.folder = path.resolve()
        self.files: dict = {}         # (rank, stream) -> _Lines
        self.events: list = []        # every event kept (time order once sorted)
        self.events_total = 0
        self.metrics: dict = {}       # (kind, rank, layer) -> the latest line
        self._discover()
        if not self.files:
            raise NotARun(f"{folder} is not a sentinels run folder: no rank-<r>/events.jsonl or metrics.jsonl "
                          "in it (give the folder SOURCE_PATCH_SENTINELS_DIR named)")

    def _discover(self) -> None:
        try:
            entries = sorted(os.listdir(self.folder))
        except OSError as exc:
            raise NotARun(f"{self.folder}: cannot list it: {exc.strerror or exc}") from None
        for name in entries:
            match = _RANK.fullmatch(name)
            if not match:
                continue
            rank = int(match.group(1))
            for stream in STREAMS:
                if (rank, stream) not in self.files and os.path.lexists(self.folder / name / f"{stream}.jsonl"):
                    self.files[rank, stream] = _Lines(self.folder / name / f"{stream}.jsonl",
                                                      f"{name}/{stream}.jsonl")

    def poll(self) -> list:
        """Read what is new in every file; the new events, in time order."""
        try:
            self._discover()
        except NotARun:
            pass  # the folder went away while followed: what was read stays
        new = []
        for (rank, stream), lines in sorted(self.files.items()):
            for number, record in lines.read():
                record = dict(record)
                if not isinstance(record.get("rank"), int) or isinstance(record.get("rank"), bool):
                    record["rank"] = rank
                if stream == "events":
                    new.append(record)
                else:
                    layer = record.get("layer")
                    key = (record["kind"], record["rank"], layer if _hashable(layer) else str(layer))
                    self.metrics[key] = record
        new.sort(key=_when)
        self.events_total += len(new)
        self.events.extend(new)
        if len(self.events) > MAX_EVENTS:
            del self.events[:len(self.events) - MAX_EVENTS]
        return new

    def finish(self) -> None:
        for lines in self.files.values():
            lines.finish()
        self.events.sort(key=_when)

    def problems(self) -> list:
        return [p for _, lines in sorted(self.files.items()) for p in lines.problems()]

    def ranks(self) -> list:
        return sorted({rank for rank, _ in self.files})

    def last_metrics(self) -> dict:
        """kind -> [{"rank", "layer", "step", "time", "figures"}], by rank then layer."""
        out: dict = {}
        for (kind, rank, layer), record in sorted(self.metrics.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                      _order(kv[0][2]))):
            out.setdefault(kind, []).append({
                "rank": rank, "layer": record.get("layer"), "step": record.get("step"), "time": record.get("time"),
                "figures": {k: v for k, v in record.items() if k not in _META}})
        return out

    def answer(self, code: int) -> dict:
        return {"folder": str(self.folder), "ranks": self.ranks(), "events": self.events,
                "events_total": self.events_total, "metrics": self.last_metrics(), "problems": self.problems(),
                "exit": code}


def _hashable(value) -> bool:
    return value is None or isinstance(value, (int, float, str))


def _order(layer):
    return (0, layer, "") if isinstance(layer, (int, float)) and not isinstance(layer, bool) else (1, 0, str(layer))


def _when(record: dict):
    t = record.get("time")
    return (t if isinstance(t, (int, float)) and not isinstance(t, bool) else float("inf"), record.get("rank", 0))


# ---------------------------------------------------------------- printing


def where(record: dict) -> str:
    """Where an event happened: its ``where``, else what it names (site, name, layer, request)."""
    if record.get("where") is not None:
        return _text(record["where"])
    parts = [f"{key} {_text(record[key])}" for key in ("site", "name", "layer", "expert", "request_id")
             if record.get(key) is not None]
    return ", ".join(parts) or "-"


def event_line(record: dict) -> str:
    t = record.get("time")
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}" \
        if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1e11 else "--:--:--.---"
    step = record.get("step")
    return f"  {stamp}  {_text(record['kind'])}  step {_text(step) if step is not None else '-'}  " \
           f"rank {_text(record.get('rank'))}  {where(record)}"


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return _text(json.dumps(value, separators=(",", ":")), 120)
    return _text(value)


def _text(value, limit: int = 200) -> str:
    """User data as one printable line: control characters escaped, cut to ``limit``."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def print_summary(run: Run, out=None, events: bool = True) -> None:
    out = out or sys.stdout
    ranks = run.ranks()
    if events:
        out.write(f"run folder {run.folder}: {len(ranks)} rank{'s' * (len(ranks) != 1)} "
                  f"({', '.join(f'rank-{r}' for r in ranks)})\n")
        kept = len(run.events)
        more = f", the last {kept} shown" if run.events_total > kept else ""
        out.write(f"events: {run.events_total}{more}\n" if run.events_total else "events: none\n")
        for record in run.events:
            out.write(event_line(record) + "\n")
    metrics = run.last_metrics()
    out.write("last metrics:\n" if metrics else "last metrics: none\n")
    for kind, rows in metrics.items():
        for row in rows:
            layer = f" layer {_text(row['layer'])}" if row["layer"] is not None else ""
            step = f" step {_text(row['step'])}" if row["step"] is not None else ""
            figures = ", ".join(f"{_text(k, 60)} {_figure(v)}" for k, v in row["figures"].items())
            out.write(f"  {_text(kind)}  rank {_text(row['rank'])}{layer}{step}: {figures}\n")


# ---------------------------------------------------------------- the command


def parser(prog: str = "source-patch watch") -> commands.Parser:
    p = commands.Parser(prog=prog, description="print a sentinels run folder: every rank's events in time order "
                        "(kind, step, rank, where) and each metric's last values per rank and layer; exit 1 if "
                        "there are events (docs/sentinels.md)")
    p.add_argument("folder", metavar="RUN_FOLDER", help="the folder SOURCE_PATCH_SENTINELS_DIR named "
                   "(default ./sp-sentinels)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events (polled every "
                   f"{POLL_S} s) until Ctrl-C, then the last metrics")
    p.add_argument("--json", action="store_true", help="one JSON object: folder, ranks, events, events_total, "
                   "metrics, problems, exit (with --follow: each new event as a JSON line, the object at Ctrl-C)")
    return p


def main(argv=None, prog: str = "source-patch watch") -> int:
    args = parser(prog).parse_args(argv)
    try:
        run = Run(args.folder)
        run.poll()
        if args.follow:
            return _follow(run, args.json)
        run.finish()
        return _answer(run, args.json)
    except NotARun as exc:
        return commands.error(exc, as_json=args.json)
    except BrokenPipeError:  # `source-patch watch ... | head`
        return 0
    except Exception as exc:  # noqa: BLE001 - the one error line, never a traceback
        return commands.error(f"watch: {type(exc).__name__}: {commands.first_line(exc)}", as_json=args.json)


def _answer(run: Run, as_json: bool) -> int:
    code = commands.FINDINGS if run.events_total else commands.OK
    if as_json:
        print(json.dumps(run.answer(code), default=str), flush=True)
    else:
        print_summary(run)
    if not as_json:
        for problem in run.problems():
            commands.note(_text(problem, 500), "warning")
    return code


def _follow(run: Run, as_json: bool) -> int:
    said = 0
    if as_json:
        for record in run.events:
            print(json.dumps({"event": record}, default=str), flush=True)
    else:
        print_summary(run)
        sys.stdout.write(f"following {run.folder} (Ctrl-C to stop)\n")
        sys.stdout.flush()
    try:
        while True:
            said = _say_problems(run, said, as_json)
            time.sleep(POLL_S)
            for record in run.poll():
                print(json.dumps({"event": record}, default=str) if as_json else event_line(record), flush=True)
    except KeyboardInterrupt:
        pass
    run.finish()
    code = commands.FINDINGS if run.events_total else commands.OK
    if as_json:
        print(json.dumps(run.answer(code), default=str), flush=True)
    else:
        sys.stdout.write("\n")
        print_summary(run, events=False)
        print(f"{run.events_total} event{'s' * (run.events_total != 1)} in all", flush=True)
        _say_problems(run, 0, False)  # every file's problems, with their final counts
    return code


def _say_problems(run: Run, said: int, as_json: bool) -> int:
    problems = run.problems()
    for problem in problems[said:]:
        if as_json:
            print(json.dumps({"problem": problem}), flush=True)
        else:
            commands.note(_text(problem, 500), "warning")
    return len(problems)


if __name__ == "__main__":
    sys.exit(main())
