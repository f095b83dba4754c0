"""Content-addressed cache of compiled patched code, with a stat-keyed shortcut.

A file per (source, spec slice, tool/libcst/Python version), never inside
``__pycache__``.  Written to a temporary file and renamed, so concurrent
writers race harmlessly; a corrupt, short or foreign file is a miss.

Warm imports do not read or hash the source: each entry is also stored under a
*stat key* (``stat/``), which replaces the source's contents by its path and
stat signature (device, inode, size, mtime and ctime in nanoseconds), as
CPython's timestamp ``.pyc`` files do (they trust mtime and size alone).  ctime
cannot be set by a program, so a rewrite that restores size and mtime still
misses.  A stat entry is written only once the source is older than
``RACY_NS`` (a change within the same clock tick could keep its signature);
until then, and whenever the signature is new, the loader reads and hashes the
source and looks the content key up (a touched or copied, unchanged file is
still a hit, and gets a stat entry).  ``SOURCE_PATCH_CACHE_CHECK=content``
turns the shortcut off (every import hashes the source, like CPython's checked
hash-based pycs).

Integrity: each payload carries its length and CRC-32, against torn or
corrupted files (a write is a rename of a complete file, so that takes a
crash, a full disk or a bad disk).  The CRC is not an authenticity check; the
trust check below is: only this user can write the directory.

Trust (the code is ``marshal.loads``-ed and executed): every folder is created
0700 and every file 0600, whatever the umask; every read and write walks down
from the top folder by folder descriptors and checks each folder and the file on
use (``boot.open_folder``): one owned by another user, writable by group or
others, or a symbolic link is not read (one warning per process), as ssh treats
its files.
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
from functools import lru_cache
from pathlib import Path
from types import CodeType
from zlib import crc32

from .boot import RACY_NS, Untrusted, cache_dir, open_folder, read_private, refuse, write_private

MAGIC = b"SPC2"
_HEADER = len(MAGIC) + 32 + 8 + 4  # magic, key, payload length, payload CRC-32
CHECK_ENV = "SOURCE_PATCH_CACHE_CHECK"  # "content": no stat keys (hash every source)
KINDS = ("", "specs", "stat", "requires")  # code by content key; compiled specs; code by stat key; verdicts


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


def signature(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a stat key trusts a file by: device, inode, size, mtime and ctime (ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(sig, now_ns: int | None = None) -> bool:
    """A signature old enough to key by: no change within the last RACY_NS (a
    rewrite within the same clock tick could otherwise keep mtime and ctime)."""
    return (now_ns if now_ns is not None else time.time_ns()) - max(sig[3], sig[4]) >= RACY_NS


def stat_key(sig: tuple, patches: bytes, file: str) -> bytes:
    """The key of a source by its stat signature instead of its contents, with what
    the patches do to it (``finder.slice_parts``), its path and the tool's fingerprint
    (a different domain from the content ``key``: never equal)."""
    text = f"stat\0{sig[0]}.{sig[1]}.{sig[2]}.{sig[3]}.{sig[4]}\0{file}\0".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text + len(patches).to_bytes(8, "little") + patches + _tool_versions()).digest()


class CodeCache:
    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self._root = os.fspath(self.dir)
        self.writable = True  # False after a failed write: no more attempts
        # Stat keys unless SOURCE_PATCH_CACHE_CHECK=content (read once, as the directory).
        self.stat_keys = os.environ.get(CHECK_ENV, "").strip().lower() != "content"

    def path(self, k: bytes, specs: bool = False, kind: str = "") -> Path:
        """Code objects in ``<xx>/``; compiled specs in ``specs/<xx>/``, stat-keyed code
        in ``stat/<xx>/``, requirement verdicts in ``requires/<xx>/``."""
        return Path(self._root, *self._parts(k, "specs" if specs else kind))

    @staticmethod
    def _parts(k: bytes, kind: str = "") -> tuple[str, ...]:
        name = k.hex()
        return (kind, name[:2], f"{name}.spc") if kind else (name[:2], f"{name}.spc")

    def _refuse(self, exc: Untrusted) -> None:
        refuse(self._root, str(exc))  # once per process: checked on every use all the same

    def get(self, k: bytes, kind: str = "") -> CodeType | None:
        """The code stored under a content key (``kind`` "stat": under a stat key)."""
        payload = self.read(k, kind)
        code = _loads(payload) if payload is not None else None
        return code if isinstance(code, CodeType) else None

    def get_data(self, k: bytes, kind: str = "specs") -> tuple | None:
        """A stored tuple (a compiled spec, a verdict), or None."""
        payload = self.read(k, kind)
        data = _loads(payload) if payload is not None else None
        return data if isinstance(data, tuple) else None

    def read(self, k: bytes, kind: str = "") -> memoryview | None:
        """An entry's checked payload (marshalled; a view, not a copy, as importlib
        reads a .pyc), or None: missing, short, foreign, corrupt or not private."""
        try:
            data = read_private(self._root, self._parts(k, kind))
        except Untrusted as exc:
            self._refuse(exc)
            return None
        except OSError:
            return None
        if len(data) < _HEADER or data[:4] != MAGIC or data[4:36] != k:
            return None
        payload = memoryview(data)[_HEADER:]
        if (len(payload) != int.from_bytes(data[36:44], "little")
                or crc32(payload) != int.from_bytes(data[44:48], "little")):
            return None
        return payload

    def put(self, k: bytes, value, kind: str | None = None) -> bool:
        """Store a code object or a tuple of plain values (by default: a tuple is a
        compiled spec); a cache that cannot be written is skipped, never an error."""
        if not self.writable:
            return False
        if kind is None:
            kind = "specs" if isinstance(value, tuple) else ""
        return self.write(k, marshal.dumps(value), kind)

    def write(self, k: bytes, payload, kind: str = "") -> bool:
        """Store a marshalled payload (as ``read`` returns it) under a key."""
        if not self.writable:
            return False
        blob = MAGIC + k + len(payload).to_bytes(8, "little") + crc32(payload).to_bytes(4, "little") + payload
        try:
            write_private(self._root, self._parts(k, kind), blob)
        except Untrusted as exc:
            self._refuse(exc)
            return False
        except OSError:
            self.writable = False
            return False
        return True

    def _mkdir(self, folder) -> None:
        """Make the folders down to ``folder`` (inside the cache), each 0700 and checked."""
        os.close(open_folder(self._root, Path(folder).relative_to(self._root).parts, create=True))

    @contextlib.contextmanager
    def lock(self, k: bytes):
        """Hold the key's lock while compiling it (others wait, then hit the cache).
        Best effort: without a usable directory or fcntl, no lock."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            yield
            return
        *folders, name = self._parts(k)
        lock_name = name[:-len(".spc")] + ".lock"
        folder = handle = None
        if self.writable:
            try:
                folder = open_folder(self._root, folders, create=True)
                handle = os.open(lock_name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=folder)
            except Untrusted as exc:
                self._refuse(exc)
            except OSError:
                pass
        if handle is None:
            if folder is not None:
                os.close(folder)
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
            with contextlib.suppress(OSError):
                os.stat(name, dir_fd=folder, follow_symlinks=False)  # done: later processes
                os.unlink(lock_name, dir_fd=folder)  # hit the entry and never lock
            os.close(handle)  # releases the lock
            os.close(folder)


def _loads(payload):
    try:
        return marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None
