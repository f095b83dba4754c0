"""What the runtime's local network endpoints (the dump control endpoint, the trace
hub) share: a port offset by the process's LOCAL_RANK, and a private file that tells
a user on the same machine the endpoint's URL and token."""

from __future__ import annotations

import json
import os
from pathlib import Path


def local_rank() -> int:
    """LOCAL_RANK of this process (torchrun and friends set it), 0 when unset or malformed."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        return 0


def write_private_json(path: Path, info: dict) -> None:
    """Write ``info`` as JSON readable by the owner only (0600), atomically (temp file +
    rename), creating the folder.  Raises OSError; a failed write leaves no temp file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)  # an existing temp file keeps its mode through O_CREAT
            json.dump(info, out)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


MAX_JSON_DEPTH = 32  # client JSON nests no deeper than this (json.loads recurses: a deep body is a crash)


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` for a client's input, refusing nesting deeper than ``max_depth``
    first (ValueError) instead of letting the parser recurse into a RecursionError."""
    text = data.decode() if isinstance(data, (bytes, bytearray)) else data
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
        elif char in "]}":
            depth -= 1
    return json.loads(text)
