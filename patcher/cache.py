"""The code cache: every record of what source-patch has seen before, under one invariant.

**A hit is what computing it afresh would give.**  A record is used only if its file
passes the trust and integrity checks and nothing it was computed from has changed:
what its key hashes, and each file it names by stat signature.  Anything else is a
miss, computed again and rewritten, never an error.

The records (code by content key; :class:`StatEntry`, code by stat key; :class:`Verdict`;
compiled specs; boot records, which boot.py keeps for the start hook), their keys,
layout and trust rules are described once, in docs/activation.md#the-code-cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import marshal
import operator
import os
import sys
import time
from functools import lru_cache
from pathlib import Path
from types import CodeType
from typing import Callable, NamedTuple
from zlib import crc32

from ..runtime.core.private import Untrusted, open_file, open_folder, read_private, write_private
from .boot import CHECK_ENV, RACY_NS, cache_dir, refuse, schema_files, signature

MAGIC = b"SPC2"
_HEADER = len(MAGIC) + 32 + 8 + 4  # magic, key, payload length, payload CRC-32
LOCK_WAIT_S = 120.0  # a waiter parses itself after this (the holder is stuck, not dead)
_STAT_FORMAT = 1  # a stat entry with more than code: (_STAT_FORMAT, verdicts, mask, code)
_VERDICT_FORMAT = 1  # a requires/ entry: (_VERDICT_FORMAT, *Verdict)


def default_dir() -> Path:
    return Path(cache_dir())


# --------------------------------------------------------------------------- records


class Verdict(NamedTuple):
    """Whether a target's ``requires`` hold near its site directory, and what that rests on."""

    requires: tuple  # ((distribution, specifier), ...)
    site_dir: str | None  # where the target's top-level package lies
    basis: tuple | None  # ((path, signature), ...) of the site directory and each METADATA read; None: not kept
    unmet: str | None  # None: they hold; else the sentence saying which does not

    def holds(self) -> bool:
        """Whether a kept verdict may be used: well formed, and each file it rests on as it was."""
        try:
            return ((self.unmet is None or isinstance(self.unmet, str)) and len(self.basis) >= 2
                    and all(signature(path) == tuple(was) for path, was in self.basis))
        except (TypeError, ValueError):
            return False


class StatEntry(NamedTuple):
    """A target's code by its source's stat signature (``stat/``)."""

    verdicts: tuple  # (Verdict, ...): the requirement verdicts that decided which patches apply
    mask: tuple | None  # which of the target's patches the code holds, by position; None: all
    code: CodeType


# --------------------------------------------------------------------------- keys


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


def key(source: bytes, slice_digest: str, file: str, extra: bytes = b"") -> bytes:
    """The content key: a module's source, what its patches do to it, its path, this tool."""
    h = hashlib.sha256()
    for part in (source, slice_digest.encode(), file.encode(), _tool_versions(), extra):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def spec_key(text: str, file: str) -> bytes:
    """The key of a compiled spec: its text and file (locations name it), this tool's
    sources, and the runtime settings schemas its `runtime:` sections were checked with."""
    schemas = b""
    for path in schema_files():
        try:
            with open(path, "rb") as f:
                schemas += path.encode("utf-8", "surrogatepass") + b"\0" + f.read() + b"\0"
        except OSError:
            schemas += b"-\0"
    return key(b"spec\0" + text.encode("utf-8", "surrogatepass"), "", file, extra=schemas)


def stat_key(sig: tuple, patches: bytes, file: str) -> bytes:
    """The key of a source by its stat signature instead of its contents, with what
    the patches do to it (``patches_part``), its path and the tool's fingerprint
    (a different domain from the content ``key``: never equal)."""
    text = f"stat\0{sig[0]}.{sig[1]}.{sig[2]}.{sig[3]}.{sig[4]}\0{file}\0".encode("utf-8", "surrogatepass")
    return hashlib.sha256(text + len(patches).to_bytes(8, "little") + patches + _tool_versions()).digest()


def _verdict_key(requires, site_dir: str) -> bytes:
    text = repr((_VERDICT_FORMAT, requires, site_dir)).encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"requires\0" + text + _tool_versions()).digest()


def settled(sig, now_ns: int | None = None) -> bool:
    """A signature old enough to key by: no change within the last RACY_NS (a
    rewrite within the same clock tick could otherwise keep mtime and ctime)."""
    return (now_ns if now_ns is not None else time.time_ns()) - max(sig[3], sig[4]) >= RACY_NS


def slice_digest(patches) -> str:
    """What a set of patches does to one module, for the content key: a stable digest."""
    doc = [[p.spec_name, p.id, p.module, p.target, p.handle, p.on_drift, p.location.file,
             p.location.line,
            [[e.at, e.code, e.match, e.wrap, e.bind, e.count] for e in p.edits]]
           for p in patches]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def slice_parts(patches) -> bytes:
    """What the patches do to their module, for the stat key: at least every field
    ``slice_digest`` covers (a test checks), as a tuple of strings, ints and None
    marshalled in format 2, which is canonical (format 3 and later mark interned
    strings and back-references, which differ between equal values).  Cheaper than
    that digest's JSON and SHA-256, which only a stat-key miss pays."""
    return marshal.dumps(tuple(
        (p.spec_name, p.id, p.module, p.target, p.handle, p.on_drift, p.location.file, p.location.line,
         tuple((e.at, e.code, e.match, e.wrap, e.bind, e.count) for e in p.edits))
        for p in patches), 2)


def spec_names(names: list) -> bytes | None:
    """The patches' part of a stat key where every spec came from the code cache: each
    patch named by its spec's key (its text, file and this tool) and its index, so an
    import need not serialize them; None where one has no name (``slice_parts`` then)."""
    if not all(names):
        return None
    return b"spec keys\0" + b"".join(names)  # this prefix is never a marshalled tuple's first bytes


_DIGESTS: dict[tuple[int, ...], tuple] = {}  # ids of a set of patches -> (those patches, slice_digest)


def _digest(patches) -> str:
    """slice_digest, once per set of patch objects (held, so their ids stay theirs)."""
    ids = tuple(map(id, patches))
    hit = _DIGESTS.get(ids)
    if hit is None or not _same(hit[0], patches):
        if len(_DIGESTS) >= 4096:  # specs activated again and again (tests): start over
            _DIGESTS.clear()
        hit = _DIGESTS[ids] = (tuple(patches), slice_digest(patches))
    return hit[1]


def _mask(patches, every) -> tuple[int, ...] | None:
    """Which of ``every`` (by position) are ``patches``; None: all of them."""
    if _same(patches, every):
        return None
    ids = set(map(id, patches))
    return tuple(i for i, p in enumerate(every) if id(p) in ids)


def _same(a, b) -> bool:
    """The same objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


# --------------------------------------------------------------------------- the store


class CodeCache:
    """The records in one cache directory, and the verdicts this process has decided."""

    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self._root = os.fspath(self.dir)
        self.writable = True  # False after a failed write: no more attempts
        # Stat keys unless SOURCE_PATCH_CACHE_CHECK=content (read once, as the directory).
        self.stat_keys = os.environ.get(CHECK_ENV, "").strip().lower() != "content"
        self.verdicts: dict[tuple, Verdict] = {}  # (requires, site dir) -> decided in this process

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
        code = _loads(self.read(k, kind))
        return code if isinstance(code, CodeType) else None

    def get_data(self, k: bytes, kind: str = "specs") -> tuple | None:
        """A stored tuple (a compiled spec, a verdict), or None."""
        data = _loads(self.read(k, kind))
        return data if isinstance(data, tuple) else None

    def stat_entry(self, k: bytes) -> StatEntry | None:
        """The stat entry under a stat key: the code alone (every patch applied, no
        verdict), or the tuple; None if neither."""
        value = _loads(self.read(k, "stat"))
        if isinstance(value, CodeType):
            return StatEntry((), None, value)
        if (isinstance(value, tuple) and len(value) == 4 and value[0] == _STAT_FORMAT
                and isinstance(value[1], tuple) and isinstance(value[3], CodeType)):
            try:
                verdicts = tuple(Verdict(*v) for v in value[1])
            except TypeError:
                verdicts = ()  # another layout: judged again
            return StatEntry(verdicts, value[2], value[3])
        return None

    def put_stat_entry(self, k: bytes, entry: StatEntry, payload=None) -> bool:
        """Store a stat entry: the code alone where it holds every patch and carries no
        verdict (``payload``: its marshalled form, when at hand), else the tuple."""
        if entry.verdicts or entry.mask is not None:
            payload = marshal.dumps((_STAT_FORMAT, tuple(map(tuple, entry.verdicts)), entry.mask, entry.code))
        return self.write(k, payload if payload is not None else marshal.dumps(entry.code), "stat")

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
            write_private(self._root, self._parts(k, kind), blob, sync=False)  # a torn entry fails its CRC
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
                # Checked like every private file: a FIFO planted there hung the import.
                # Anything but a regular file of ours: no lock (the key is computed all the same).
                handle = open_file(folder, lock_name, "its lock", os.O_WRONLY | os.O_CREAT)
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

    # -- requirement verdicts

    def verdict(self, requires, site_dir: str | None, judge: Callable) -> Verdict:
        """Whether ``requires`` hold near ``site_dir``, decided once per process: a kept
        verdict (``requires/``; a stat entry's: ``TargetLookup.recall_verdicts``) whose
        basis still holds, else ``judge(requires, site_dir)`` -> (unmet, basis), kept
        when its basis is settled and did not change while it was judged."""
        known = self.verdicts.get((requires, site_dir))
        if known is None:
            known = self._kept_verdict(requires, site_dir) or self._judged(requires, site_dir, judge)
            self.verdicts[requires, site_dir] = known
        return known

    def _kept_verdict(self, requires, site_dir: str | None) -> Verdict | None:
        if site_dir is None or not self.stat_keys:
            return None
        stored = self.get_data(_verdict_key(requires, site_dir), "requires")
        if not stored or stored[0] != _VERDICT_FORMAT:
            return None
        try:
            verdict = Verdict(*stored[1:])
        except TypeError:
            return None  # another layout: judged again
        if verdict.requires == requires and verdict.site_dir == site_dir and verdict.holds():
            return verdict
        return None

    def _judged(self, requires, site_dir: str | None, judge: Callable) -> Verdict:
        unmet, basis = judge(requires, site_dir)
        verdict = Verdict(requires, site_dir, basis, unmet)
        if (site_dir is not None and self.stat_keys and basis is not None
                and all(settled(sig) for _, sig in basis) and verdict.holds()):  # unchanged while read
            self.put(_verdict_key(requires, site_dir), (_VERDICT_FORMAT, *verdict), "requires")
            return verdict
        return verdict._replace(basis=None)

    def kept_verdicts(self, requires, site_dir: str | None) -> tuple[Verdict, ...]:
        """The verdicts on these requirements decided in this process that are kept:
        what a target's stat entry carries."""
        found = (self.verdicts.get((r, site_dir)) for r in requires)
        return tuple(v for v in found if v is not None and v.basis is not None)


# --------------------------------------------------------------------------- one import


class TargetLookup:
    """One import of a target module through the cache.  Its stat entry is read at
    most once per ``code`` call: by ``recall_verdicts`` (the finder, for the
    requirement verdicts it carries) or by ``code`` (the loader)."""

    def __init__(self, cache: CodeCache, path: str, patches, patches_part: bytes, requires=(),
                 site_dir: str | None = None):
        """``patches``: all the finder's patches of the module, in order; ``patches_part``:
        how the stat key names them (``spec_names`` or ``slice_parts``)."""
        self.cache, self.path, self.patches, self.patches_part = cache, path, patches, patches_part
        self.requires, self.site_dir = requires, site_dir
        self.sig = self.key = self.entry = None
        self._read = False
        self._judged_here: set = set()  # verdicts the entry lacked: kept in it from now on

    def _stat_entry(self) -> StatEntry | None:
        if not self._read:
            self._read = True
            self.sig = self.key = self.entry = None
            if self.cache.stat_keys:
                self.sig = signature(self.path)
                if self.sig is not None:  # else reading the source raises the import's error
                    self.key = stat_key(self.sig, self.patches_part, self.path)
                    self.entry = self.cache.stat_entry(self.key)
        return self.entry

    def recall_verdicts(self) -> None:
        """Before the finder judges the target's requirements: take those its stat entry
        carries whose basis still holds, so a warm import reads no ``requires/`` entry."""
        wanted = {(r, self.site_dir) for r in self.requires} - self.cache.verdicts.keys()
        if not wanted or self.site_dir is None or not self.cache.stat_keys:
            return
        entry = self._stat_entry()
        for verdict in entry.verdicts if entry is not None else ():
            try:
                pair = (verdict.requires, verdict.site_dir)
                if pair in wanted and verdict.holds():
                    self.cache.verdicts[pair] = verdict
                    wanted.remove(pair)
            except TypeError:
                pass  # another layout (an unhashable value): judged again
        self._judged_here = wanted

    def code(self, applied, read: Callable[[], bytes], rewrite: Callable) -> CodeType:
        """The code of the module with ``applied`` (those of its patches that apply):
        the stat entry's, if it holds this very code; else by content key (``read()``
        gives the source), then kept under the stat key too; else ``rewrite(source)``
        -> (code, keep), stored if ``keep``."""
        entry, mask = self._stat_entry(), _mask(applied, self.patches)
        self._read, judged_here, self._judged_here = False, self._judged_here, set()  # a later call reads again
        if entry is not None and entry.mask == mask:
            if judged_here:  # verdicts the entry lacked, judged here: keep them there
                self._carry(entry, judged_here)
            return entry.code
        code, payload, keep = self._by_content(read(), applied, rewrite)
        if keep:
            self._keep(code, mask, payload)
        return code

    def _carry(self, entry: StatEntry, judged_here: set) -> None:
        carried = self.cache.kept_verdicts(self.requires, self.site_dir)
        if {(v.requires, v.site_dir) for v in carried} & judged_here:
            self.cache.put_stat_entry(self.key, entry._replace(verdicts=carried))

    def _by_content(self, source: bytes, applied, rewrite: Callable) -> tuple:
        """(code, its stored payload or None, keep): the entry under the content key, else
        rewritten by one process while the others wait on the key's lock, then hit."""
        k = key(source, _digest(applied), self.path)
        payload = self.cache.read(k)
        code = _code(payload)
        if code is None:
            with self.cache.lock(k):
                payload = self.cache.read(k)
                code = _code(payload)
                if code is None:
                    code, keep = rewrite(source)
                    if keep:
                        self.cache.put(k, code)
                    return code, None, keep
        return code, payload, True

    def _keep(self, code: CodeType, mask, payload) -> None:
        """Keep code read or made from the source under the stat signature it was read
        with, if that is settled and still the file's (a change while reading: the next
        import looks again)."""
        if self.key is not None and settled(self.sig) and signature(self.path) == self.sig:
            carried = self.cache.kept_verdicts(self.requires, self.site_dir)
            self.cache.put_stat_entry(self.key, StatEntry(carried, mask, code), payload)


def _loads(payload):
    if payload is None:
        return None
    try:
        return marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None


def _code(payload) -> CodeType | None:
    code = _loads(payload)
    return code if isinstance(code, CodeType) else None
