"""Content-addressed cache of compiled patched code.

A file per (source, spec slice, tool/libcst/Python version), never inside
``__pycache__``.  Written to a temporary file and renamed, so concurrent
writers race harmlessly; a corrupt, short or foreign file is a miss.

Trust (the code is ``marshal.loads``-ed and executed): the directory is created
0700 and files 0600; a cache directory owned by another user, or writable by
group or others, is not used at all (one warning), as ssh treats its files.
Cold start: the first process to miss a key takes a lock on it, parses and
writes; the others wait on the lock and load what it wrote (a holder that dies
releases the lock with its process; a waiter gives up after LOCK_WAIT_S and
parses itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import marshal
import os
import sys
import time
import warnings
from functools import lru_cache
from pathlib import Path
from types import CodeType

from .boot import cache_dir, untrusted  # shared with the start-up fast path

MAGIC = b"SPC1"
_HEADER = len(MAGIC) + 32 + 8 + 32  # magic, key, payload length, payload sha256


def default_dir() -> Path:
    return Path(cache_dir())


LOCK_WAIT_S = 120.0  # a waiter parses itself after this (the holder is stuck, not dead)


@lru_cache(maxsize=1)
def _tool_versions() -> bytes:
    """What else shapes the compiled code: this tool's sources (their contents: 0.2 ms
    once per process; sizes and mtimes can repeat across builds, e.g. reproducible
    wheels with fixed timestamps), libcst's version file, and the interpreter."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")]
    # libcst's version file, found the way an import would find the package (but
    # without importlib's machinery, which costs more than these few stats).
    files += [v for v in (os.path.join(entry or ".", "libcst", "_version.py") for entry in sys.path)
              if os.path.isfile(v)][:1]
    h = hashlib.sha256(importlib.util.MAGIC_NUMBER + sys.version.encode())
    for f in files:
        try:
            with open(f, "rb") as handle:
                h.update(f"{os.path.basename(f)}\0".encode() + handle.read())
        except OSError:
            h.update(f"{f}:-".encode())
    return h.digest()


def spec_key(text: str, file: str) -> bytes:
    """The key of a compiled spec: its text and file (locations name it), this tool's
    sources, and the runtime settings schemas its `runtime:` sections were checked with."""
    settings = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "runtime", "core", "settings.py")
    try:
        with open(settings, "rb") as f:
            schemas = f.read()
    except OSError:
        schemas = b"-"
    return key(b"spec\0" + text.encode("utf-8", "surrogatepass"), "", file, extra=schemas)


def key(source: bytes, slice_digest: str, file: str, extra: bytes = b"") -> bytes:
    h = hashlib.sha256()
    for part in (source, slice_digest.encode(), file.encode(), _tool_versions(), extra):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


class CodeCache:
    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.writable = True
        self._trusted: bool | None = None  # checked on first use

    def path(self, k: bytes, specs: bool = False) -> Path:
        """Code objects in ``<xx>/``, compiled specs apart in ``specs/<xx>/``."""
        name = k.hex()
        return (self.dir / "specs" if specs else self.dir) / name[:2] / f"{name}.spc"

    def usable(self) -> bool:
        if self._trusted is None:
            reason = untrusted(self.dir)
            self._trusted = reason is None
            if reason:
                warnings.warn(f"source-patch: not using the code cache {self.dir}: {reason} (its files "
                              "would be executed); every patched import parses again. Set SOURCE_PATCH_CACHE "
                              "to a directory only you can write", RuntimeWarning, stacklevel=2)
                self.writable = False
        return self._trusted

    def get(self, k: bytes) -> CodeType | None:
        code = self._load(self.path(k), k)
        return code if isinstance(code, CodeType) else None

    def get_data(self, k: bytes) -> tuple | None:
        """A stored tuple (a compiled spec), or None."""
        data = self._load(self.path(k, specs=True), k)
        return data if isinstance(data, tuple) else None

    def _load(self, path: Path, k: bytes):
        if not self.usable():
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < _HEADER or data[:4] != MAGIC or data[4:36] != k:
            return None
        size = int.from_bytes(data[36:44], "little")
        payload = data[_HEADER:]
        if len(payload) != size or hashlib.sha256(payload).digest() != data[44:76]:
            return None
        try:
            return marshal.loads(payload)
        except (ValueError, EOFError, TypeError):
            return None

    def put(self, k: bytes, value) -> bool:
        """Store a code object or a tuple of plain values; a cache that cannot be
        written is skipped, never an error."""
        if not self.writable or not self.usable():
            return False
        payload = marshal.dumps(value)
        blob = MAGIC + k + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest() + payload
        target = self.path(k, specs=isinstance(value, tuple))
        try:
            import tempfile  # only writes pay for it

            self._mkdir(target.parent)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")  # 0600
            try:
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

    def _mkdir(self, folder: Path) -> None:
        if not folder.is_dir():
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            os.makedirs(folder, mode=0o700, exist_ok=True)

    @contextlib.contextmanager
    def lock(self, k: bytes):
        """Hold the key's lock while compiling it (others wait, then hit the cache).
        Best effort: without a usable directory or fcntl, no lock."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            yield
            return
        handle = None
        if self.writable and self.usable():
            try:
                self._mkdir(self.path(k).parent)
                handle = open(self.path(k).with_suffix(".lock"), "a")
            except OSError:
                handle = None
        if handle is None:
            yield
            return
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break  # stuck holder: parse ourselves, the rename keeps the file whole
                    time.sleep(0.05)
            yield
        finally:
            if self.path(k).exists():  # done: later processes hit the entry and never lock
                with contextlib.suppress(OSError):
                    os.unlink(handle.name)
            handle.close()  # releases the lock
