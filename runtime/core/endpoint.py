"""What the runtime's local network endpoints (the dump control endpoint, the trace
hub) share: a port offset by the process's LOCAL_RANK, and a private file that tells
a user on the same machine the endpoint's URL and token; and a free port for a
server started later (tests, benches, the SGLang harness, a Mooncake master)."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

from . import bounded, private

_handed: set = set()


def free_port() -> int:
    """A port to listen on later, from below the kernel's ephemeral range: a port the
    kernel picked (bind to 0) can be taken by any outgoing connection (gloo, NCCL and
    HTTP clients open many) between this call and the listen, and the server then fails
    with EADDRINUSE.  Never the same port twice in one process."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(low, 10001))
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # a crowded range: what the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank() -> int:
    """LOCAL_RANK of this process (torchrun and friends set it), 0 when unset or malformed."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        return 0


def write_private_json(path: Path, info: dict) -> None:
    """Write ``info`` as JSON readable by the owner only (0600), atomically, in a private
    folder (made 0700 where missing; one another user owns or can write is refused:
    the file holds a token).  Raises OSError; a failed write leaves no temp file."""
    private.write_private_file(path, json.dumps(info))


MAX_INFO_BYTES = 64 << 10  # a URL + token file (a few hundred bytes)


def read_private_json(folder, name: str, refused: list) -> dict | None:
    """A URL + token file as ``write_private_json`` wrote it, read back only where its
    folder and the file are this user's and no one else can write them: never through
    a link, never a FIFO (it would hang), at most MAX_INFO_BYTES, bounded JSON.  A file
    planted there must not choose the URL a token is sent to.  None where it is gone
    (its process ended); any other failure is one line appended to ``refused``."""
    path = os.path.join(folder, name)
    try:
        if os.stat(path, follow_symlinks=False).st_size > MAX_INFO_BYTES:
            raise ValueError(f"larger than {MAX_INFO_BYTES:,} bytes")
        data = private.read_private(os.fspath(folder), [name])  # no link, regular, this user's
        return bounded.load_json(data, what="its content", max_bytes=MAX_INFO_BYTES, kind=dict)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        refused.append(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")
        return None


MAX_JSON_DEPTH = bounded.MAX_DEPTH  # client JSON nests no deeper (json.loads recurses: a deep body is a crash)


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` for a client's input, refusing nesting deeper than ``max_depth``
    first (ValueError) instead of letting the parser recurse into a RecursionError."""
    text = data.decode() if isinstance(data, (bytes, bytearray)) else data
    bounded.check_nesting(text, max_depth=max_depth)
    return json.loads(text)
