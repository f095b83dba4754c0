"""Content-addressed cache of compiled patched code.

A file per (source, spec slice, tool/libcst/Python version), never inside
``__pycache__``.  Written to a temporary file and renamed, so concurrent
writers race harmlessly; a corrupt, short or foreign file is a miss.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from types import CodeType

MAGIC = b"SPC1"
_HEADER = len(MAGIC) + 32 + 8 + 32  # magic, key, payload length, payload sha256


def default_dir() -> Path:
    if os.environ.get("SOURCE_PATCH_CACHE"):
        return Path(os.environ["SOURCE_PATCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "source-patch"


@lru_cache(maxsize=1)
def _tool_versions() -> bytes:
    """What else shapes the compiled code: this tool's sources, libcst, the interpreter.

    File sizes and modification times, not contents or package metadata: this
    runs once per process on the warm path, where a stat costs microseconds and
    hashing or a metadata scan costs a millisecond.  Editing the patcher in a
    checkout changes its mtimes, so stale entries are never hit.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")]
    # libcst's version file, found the way an import would find the package (but
    # without importlib's machinery, which costs more than these few stats).
    files += [v for v in (os.path.join(entry or ".", "libcst", "_version.py") for entry in sys.path)
              if os.path.isfile(v)][:1]
    parts = [importlib.util.MAGIC_NUMBER, sys.version.encode()]
    for f in files:
        try:
            st = os.stat(f)
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
        except OSError:
            parts.append(f"{f}:-".encode())
    return hashlib.sha256(b"\0".join(parts)).digest()


def key(source: bytes, slice_digest: str, file: str) -> bytes:
    h = hashlib.sha256()
    for part in (source, slice_digest.encode(), file.encode(), _tool_versions()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


class CodeCache:
    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.writable = True

    def path(self, k: bytes) -> Path:
        name = k.hex()
        return self.dir / name[:2] / f"{name}.spc"

    def get(self, k: bytes) -> CodeType | None:
        try:
            data = self.path(k).read_bytes()
        except OSError:
            return None
        if len(data) < _HEADER or data[:4] != MAGIC or data[4:36] != k:
            return None
        size = int.from_bytes(data[36:44], "little")
        payload = data[_HEADER:]
        if len(payload) != size or hashlib.sha256(payload).digest() != data[44:76]:
            return None
        try:
            code = marshal.loads(payload)
        except (ValueError, EOFError, TypeError):
            return None
        return code if isinstance(code, CodeType) else None

    def put(self, k: bytes, code: CodeType) -> bool:
        """Store; a cache that cannot be written is skipped, never an error."""
        if not self.writable:
            return False
        payload = marshal.dumps(code)
        blob = MAGIC + k + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest() + payload
        target = self.path(k)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            try:
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache must be readable
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            self.writable = False
            return False
        return True
