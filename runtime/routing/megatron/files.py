"""Where Megatron's captured routes live on disk (this process's rank: core/ranks.py).

    <dir>/rank-<r>/step-<S>-mb-<M>.safetensors   one RoutingRecord (token_order megatron-sbh)
    <dir>/rank-<r>/index.json                     {"format", "version", "rank", "records": [...]}

Capture writes this layout (``capture.py``), replay reads it back
(``load_dir``): the one place both sides agree on it.  ``RoutingReplayError`` is the
error of both sides.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...core import private, ranks
from ..records.file import RoutingRecordError
from ..records.record import load

INDEX_FORMAT = "source-patch-routing-index"


class RoutingReplayError(RuntimeError):
    """Replay cannot route as recorded (names step, microbatch and layer)."""


def record_name(key) -> str:
    """The file name of (step, microbatch) ``key``'s record."""
    return f"step-{key[0]}-mb-{key[1]}.safetensors"


def write_index(folder: Path, rank: int, entries: list) -> None:
    """Rewrite ``folder/index.json`` whole and atomically, through core/private.py's writer
    of plain files (a temporary file ``O_EXCL|O_NOFOLLOW``, synced, renamed: a link or a
    name planted at the temporary name is never written through).  Compact JSON: json's
    C encoder (``indent`` takes the pure-Python one, 7x slower)."""
    data = json.dumps({"format": INDEX_FORMAT, "version": 1, "rank": rank, "records": entries},
                      separators=(",", ":")).encode()
    try:
        private.write_file(Path(folder) / "index.json", data)
    except FileNotFoundError:  # the folder went missing since capture made it (no record written since)
        Path(folder).mkdir(parents=True, exist_ok=True)
        private.write_file(Path(folder) / "index.json", data)


def load_dir(dir: str | os.PathLike) -> dict:
    """``{(step, microbatch): RoutingRecord}`` from ``dir`` (its ``rank-<r>/index.json`` for this
    rank, else ``rank-0``, else ``dir/index.json``)."""
    root = Path(dir)
    rank = ranks.global_rank()
    for folder in (root / f"rank-{rank}", root / "rank-0", root):
        if (folder / "index.json").is_file():
            break
    else:
        raise RoutingReplayError(f"routing replay: no index.json under {root} (rank-{rank}/, rank-0/ or .)")
    index = json.loads((folder / "index.json").read_text())
    out = {}
    for entry in index["records"]:
        key = (int(entry["step"]), int(entry["microbatch"]))
        try:
            out[key] = load(folder / entry["file"])
        except RoutingRecordError as exc:
            raise RoutingReplayError(f"step {key[0]}, microbatch {key[1]}: bad record {entry['file']}: {exc}") from None
    return out
