"""The run folder the sentinels write and `source-patch watch` reads: per rank,
``<dir>/rank-<r>/events.jsonl`` (one JSON object a line: what happened, e.g. the first
non-finite site) and ``metrics.jsonl`` (per-step figures).  Lines are written whole at a
step's end (a few a step), appended through core/private.py's checked folders: the
rank folder is made 0700, it and the files are checked on their descriptors (owned by
this user, not writable by others, never a symbolic link).  A full disk or an
unwritable folder is counted (``write_errors``) and said (last_error), never raised
into training; the line is lost.

    event(kind, **fields) -> dict   a line in events.jsonl: {"kind", "time", "rank", **fields}
    metric(kind, **fields) -> dict  a line in metrics.jsonl
    metrics(kind, [fields, ...])    several metrics lines, one write (a step's per-layer figures)

Each line is also handed to core/events.emit, as ``("sentinels.event", line)`` or
``("sentinels.metric", line)``, whether or not a run folder is open: another capability
(the trace view: runtime/trace) subscribes there, never imported from here.  With no
subscriber that is one truthiness test.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..core import events as core_events, private, ranks

_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT

_folder: Path | None = None       # <dir>/rank-<r>, while a run is open
_fds: dict = {}                   # stream -> its file's descriptor, opened on the first line
_error: str | None = None
_ENCODER = json.JSONEncoder(default=str, allow_nan=False)  # one for every line: no encoder made a line
_counts = {"event_lines": 0, "metric_lines": 0, "write_errors": 0, "emit_errors": 0}
_EMITTED = {"events": "sentinels.event", "metrics": "sentinels.metric"}  # core/events names


def open_run(directory: str) -> None:
    global _folder
    folder = Path(directory).expanduser().resolve() / f"rank-{ranks.global_rank()}"
    if folder != _folder:
        close_run()
        _folder = folder


def close_run() -> None:
    global _folder
    for fd in _fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _fds.clear()
    _folder = None


def folder() -> str | None:
    """The run folder (``dir``), or None when no run is open."""
    return None if _folder is None else str(_folder.parent)


def event(kind: str, **fields) -> dict:
    return _write("events", kind, [fields])[0]


def metric(kind: str, **fields) -> dict:
    return _write("metrics", kind, [fields])[0]


def metrics(kind: str, rows: list) -> list:
    """Several metrics lines of one kind (a step's per-layer figures) in one write."""
    return _write("metrics", kind, rows) if rows else []


def _write(stream: str, kind: str, rows: list) -> list:
    global _error
    now, rank = time.time(), ranks.global_rank()
    records = [{"kind": kind, "time": now, "rank": rank, **fields} for fields in rows]
    for record in records:
        try:
            core_events.emit(_EMITTED[stream], record)  # with no subscriber: one truthiness test
        except Exception as exc:  # noqa: BLE001 - a subscriber's failure is not training's
            _counts["emit_errors"] += 1
            _error = f"a subscriber of {_EMITTED[stream]}: {type(exc).__name__}: {exc}"
    if _folder is None:
        return records
    try:
        data = "".join(_ENCODER.encode(record) + "\n" for record in records).encode()
        fd = _fds.get(stream)
        if fd is None:
            fd = _fds[stream] = _open(stream)
        # One write of whole lines (O_APPEND): a reader never sees half of one, unless
        # the disk filled mid-line, which is counted below.
        if os.write(fd, data) != len(data):
            raise OSError(f"short write ({len(data)} bytes)")
        _counts["event_lines" if stream == "events" else "metric_lines"] += len(records)
    except (OSError, ValueError) as exc:
        _counts["write_errors"] += 1
        _error = f"{stream}.jsonl in {_folder}: {type(exc).__name__}: {exc}"
    return records


def _open(stream: str) -> int:
    """The stream's file under the checked, 0700 rank folder (made if missing)."""
    folder_fd = private.open_folder(str(_folder.parent), [_folder.name], create=True, check_root=False)
    try:
        return private.open_file(folder_fd, f"{stream}.jsonl", f"its file {_folder.name}/{stream}.jsonl",
                                 flags=_APPEND, mode=0o600)
    finally:
        os.close(folder_fd)


def flush() -> bool:
    """Lines are written whole as they come; this puts them on disk."""
    ok = True
    for fd in _fds.values():
        try:
            os.fsync(fd)
        except OSError:
            ok = False
    return ok


def counters() -> dict:
    return dict(_counts)


def clear() -> None:
    global _error
    _error = None
    for key in _counts:
        _counts[key] = 0


def last_error():
    return _error
