"""The start hook's fast path: SOURCE_PATCH activated from a boot record.

The full activation (``activation.activate_from_env``) resolves and reads the
specs, rebuilds them from the code cache (or validates them), checks that every
target module can be found and installs the PatchFinder.  That needs dataclasses,
typing, ast, hashlib, json and the patcher's own modules: ~20 ms of start-up on
the 2-core dev VM, in every process of a job, most of which never import a target
(a torchrun launcher, a dataloader worker, a compile subprocess).

So once a full activation at start-up has succeeded, it leaves a *boot record* in
the code cache directory (``boot/<name>.spb``): the spec files' paths and texts,
the names of their target modules, where each target was found (or that it may be
missing: the distribution its patches require is not installed), and what those
answers rest on: ``sys.path`` with a stat signature of each entry, the other
meta-path finders, and stat signatures of the patcher's sources and of the runtime
settings schemas (what the specs were validated with).

A later start-up with the same SOURCE_PATCH reads the spec files and the record
with nothing but modules every interpreter has already imported (os, sys, stat,
marshal).  If the texts are equal and every signature still holds, it installs a
:class:`BootFinder` that knows only the target names and stops there.  The full
patcher is imported when a target is first imported (the BootFinder hands over to
a PatchFinder holding the same specs), when the runtime's settings are imported
(they look the activation up in ``sys.modules``), or when the activation API asks
for the installed finder.  Anything else (no record, another text, a moved
target, a changed ``sys.path`` entry, a bundled alias name, an error of any kind)
falls back to the full activation, unchanged, which reports what it must and
writes a fresh record.

Stat signatures (inode, size, mtime and ctime, in nanoseconds) stand in for
content hashes here, which would cost a hashlib import and a read of every
source: Python's own ``.pyc`` check trusts mtime and size alone.  ctime cannot
be set by a program (on POSIX; Windows reports the creation time), so a rebuilt
file with a reproduced mtime and size still differs; a record is not written
while a signed file is younger than ``RACY_NS`` (a change within the same clock
tick as the record could otherwise go unseen).  Spec texts are compared whole.
The code cache's own keys still hash contents: this record only decides whether
the full activation must run again.
"""

from __future__ import annotations

import _thread
import marshal
import os
import stat
import sys

ENV = "SOURCE_PATCH"
REPORT = "SOURCE_PATCH_REPORT"
MAGIC = b"SPB1"
FORMAT = 1  # of the record's fields; another value is a miss
MAX_SPEC_BYTES = 8 << 20  # as spec.MAX_SPEC_BYTES (a larger file is the full path's error)
RACY_NS = 2_000_000_000

_HERE = os.path.dirname(os.path.realpath(__file__))
BUNDLED_DIR = os.path.join(os.path.dirname(_HERE), "patches")
SETTINGS_FILE = os.path.join(os.path.dirname(_HERE), "runtime", "core", "settings.py")
SETTINGS_MODULE = "source_patch.runtime.core.settings"
# Old bundled names (spec.ALIASES): resolving them warns, which only the full path does.
ALIASES = frozenset({"moe_sglang", "dump_sglang", "trace_sglang", "weight_sync_sglang"})


def cache_dir() -> str:
    """The code cache directory (``cache.default_dir`` is this as a Path)."""
    if os.environ.get("SOURCE_PATCH_CACHE"):
        return os.environ["SOURCE_PATCH_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "source-patch")


def untrusted(directory) -> str | None:
    """Why a cache directory must not be used (None: it may), as ssh judges its files.
    Only its top folder: each read and write checks its whole path (``open_folder``)."""
    try:
        st = os.stat(directory)
    except OSError:  # absent (created 0700 on first write) or unreachable (writes fail: no cache)
        return None
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return _foreign(st, "it")


def _foreign(st, what: str) -> str | None:
    """Why a folder or file another user could have written must not be read (None: it may)."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def split_refs(value: str) -> list[str]:
    """SOURCE_PATCH's spec references, separated by ',' or the path separator."""
    return [r.strip() for r in value.replace(os.pathsep, ",").split(",") if r.strip()]


def flag(environ, name: str) -> bool:
    return environ.get(name, "").strip() in ("1", "true", "yes")


# --------------------------------------------------------------------------- start-up


class BootFinder:
    """First on ``sys.meta_path`` after a boot-record start-up: answers every import
    with one set lookup, and hands over to the full PatchFinder at the first target."""

    _source_patch_finder = True  # locate.py, the activation and a second boot skip or see it

    def __init__(self, paths: tuple[str, ...], texts: tuple[str, ...], targets: frozenset[str],
                 directory: str):
        self.paths, self.texts, self.targets, self.cache_dir = paths, texts, targets, directory
        self.activation = None  # the full Activation, once handed over
        self._lock = _thread.RLock()  # two threads importing their first target at once
        self._busy = None  # the thread handing over (its own imports come back here)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.targets:
            if self._busy == _thread.get_ident():  # only the patcher's own imports run now
                raise RuntimeError(f"source-patch: {fullname} imported while the patcher loads")
            return self.hand_over().finder.find_spec(fullname, path, target)
        # The runtime's settings find the specs' `runtime:` sections through
        # activation.installed_finder(), looked up in sys.modules: make it be there.
        # (Validating a spec again imports the settings too: not then.)
        if fullname == SETTINGS_MODULE and self._busy != _thread.get_ident():
            self.hand_over()
        return None

    def hand_over(self):
        """The full Activation of these specs, whose PatchFinder takes this finder's place."""
        with self._lock:
            if self.activation is None:
                self._busy = _thread.get_ident()
                try:
                    from .activation import adopt_boot  # the full patcher, from here on

                    self.activation = adopt_boot(self)
                finally:
                    self._busy = None
        return self.activation

    def invalidate_caches(self) -> None:
        pass

    def report_at_exit(self) -> None:
        from .activation import print_report

        print_report(self.hand_over())


def run(environ=os.environ) -> bool:
    """Activate SOURCE_PATCH from its boot record.  False: nothing was done, and the
    caller runs the full activation (which also reports every error)."""
    try:
        return _run(environ)
    except Exception:  # noqa: BLE001 - whatever it was, the full activation decides and says it
        return False


def _run(environ) -> bool:
    refs = split_refs(environ.get(ENV, ""))
    if not refs or any(getattr(f, "_source_patch_finder", False) for f in sys.meta_path):
        return False  # nothing to activate, or a second activation (the full path merges it)
    paths = tuple(_resolve(r) for r in refs)
    if None in paths:
        return False
    texts = tuple(_read(p) for p in paths)
    if None in texts:
        return False
    directory = cache_dir()
    if untrusted(directory):
        return False  # the full path warns about it
    record = _load(record_path(directory, paths))
    if record is None or not _holds(record, paths, texts):
        return False
    targets = frozenset(record["targets"])
    if any(t in sys.modules for t in targets):
        return False  # too late to patch it: the full path raises (and arms) the error
    environ[ENV] = ",".join(paths)  # absolute, for children started elsewhere
    finder = BootFinder(paths, texts, targets, directory)
    sys.meta_path.insert(0, finder)
    if flag(environ, REPORT):
        import atexit

        atexit.register(finder.report_at_exit)
    return True


def _resolve(ref: str) -> str | None:
    """spec.resolve without pathlib: a path, or a bundled name.  None where that
    function would warn or fail (it then runs on the full path and says so)."""
    path = os.path.expanduser(ref)
    if os.path.splitext(path)[1] in (".yaml", ".yml") or os.sep in ref or os.path.exists(path):
        path = os.path.realpath(path)
    else:
        path = os.path.join(BUNDLED_DIR, ref + ".yaml")
    if os.path.splitext(os.path.basename(path))[0] in ALIASES:
        return None
    return path


def _read(path: str) -> str | None:
    """spec._read's text, or None where it would fail: a regular file, not too large,
    UTF-8; opened without blocking (a FIFO must not hang the start-up)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SPEC_BYTES:
            return None
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# --------------------------------------------------------------------------- the record


def record_path(directory: str, paths) -> str:
    """``<cache>/boot/<name>.spb``, one per (interpreter, environment, spec paths)."""
    ident = "\0".join([sys.version, sys.prefix, *paths]).encode("utf-8", "surrogatepass")
    # An int's hash is not salted (PYTHONHASHSEED salts only str and bytes), so this
    # name is the same in every process, without importing hashlib.  The record
    # repeats the paths: two settings sharing a name only overwrite each other's record.
    name = hash(int.from_bytes(ident, "little")) & 0xFFFF_FFFF_FFFF_FFFF
    return os.path.join(directory, "boot", f"{name:016x}.spb")


def _signature(path: str):
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _tools() -> tuple:
    """What the compiled specs depend on besides their text: the patcher's sources
    (their names too: a file added or removed counts) and the settings schemas."""
    names = sorted(n for n in os.listdir(_HERE) if n.endswith(".py"))
    return tuple((n, _signature(os.path.join(_HERE, n))) for n in names) + (
        ("settings", _signature(SETTINGS_FILE)),)


def _finders() -> tuple:
    """The other meta-path finders (an editable install's, ...), by class name."""
    return tuple(f"{type(f).__module__}.{type(f).__qualname__}" if not isinstance(f, type) else
                 f"{f.__module__}.{f.__qualname__}"
                 for f in sys.meta_path if not getattr(f, "_source_patch_finder", False))


def _environment() -> dict:
    """Where target modules are looked up: a changed entry (a distribution installed,
    removed or upgraded changes its directory) means looking again."""
    return {"sys_path": tuple(sys.path), "entries": tuple(_signature(p) for p in sys.path),
            "finders": _finders()}


def _holds(record: dict, paths: tuple, texts: tuple) -> bool:
    try:
        return (record["format"] == FORMAT and record["python"] == sys.version
                and record["paths"] == paths and record["texts"] == texts
                and record["environment"] == _environment() and record["tools"] == _tools()
                and all(origin is None or os.path.isfile(origin) for origin in record["found"]))
    except (KeyError, TypeError):
        return False


def _load(path: str) -> dict | None:
    """A record, or None: missing, foreign, truncated or not private (``read_private``:
    a record decides what is patched)."""
    try:
        data = read_private(os.path.dirname(os.path.dirname(path)), ("boot", os.path.basename(path)))
    except OSError:  # missing, or Untrusted: the full path runs (and warns)
        return None
    if not data.startswith(MAGIC):
        return None
    try:
        record = marshal.loads(data[len(MAGIC):])
    except (EOFError, ValueError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def write(paths, texts, found: dict) -> bool:
    """Store the record of a full activation at start-up that found every target
    (``found``: module -> the file found, or None where it may be missing)."""
    directory = cache_dir()
    reason = untrusted(directory)
    if reason:
        refuse(directory, reason)
        return False
    environment, tools = _environment(), _tools()
    import time

    now = time.time_ns()
    signed = [s for s in environment["entries"] + tuple(sig for _, sig in tools) if s is not None]
    if any(now - max(s[2], s[3]) < RACY_NS for s in signed):
        return False  # a change in the same clock tick could keep this signature: wait
    targets = tuple(sorted(found))
    record = {"format": FORMAT, "python": sys.version, "paths": tuple(paths), "texts": tuple(texts),
              "targets": targets, "found": tuple(found[t] for t in targets),
              "environment": environment, "tools": tools}
    try:
        payload = MAGIC + marshal.dumps(record)
    except ValueError:  # a sys.path entry that is not a str (a Path, bytes): no record
        return False
    try:
        write_private(directory, ("boot", os.path.basename(record_path(directory, paths))), payload)
    except Untrusted as exc:
        refuse(directory, str(exc))
        return False
    except OSError:
        return False
    return True


_REFUSED: set = set()  # cache directories warned about in this process


def refuse(directory: str, reason: str) -> None:
    """Warn, once per process and directory, that a cache directory is not used."""
    key = os.path.abspath(directory)
    if key in _REFUSED:
        return
    _REFUSED.add(key)
    import warnings

    warnings.warn(f"source-patch: not using the code cache {directory}: {reason} (its files would be "
                  "executed; the imports they serve parse instead). Set SOURCE_PATCH_CACHE to a directory "
                  "only you can write (or delete this one: it is rebuilt)", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- private files
#
# The code cache's files are executed (marshal.loads), and its boot records decide
# what is patched: every read and write walks the path from the cache's top folder
# down by folder descriptors, checking each opened folder and the file itself
# (owned by this user, not writable by group or others) on every use, so that a
# folder made or swapped by another user since the last look is never read.


class Untrusted(OSError):
    """A cache folder or file that another user could have written (its reason)."""


_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_AT = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd  # POSIX (os.replace too)


def open_folder(root: str, parts, create: bool = False) -> int:
    """A descriptor of the folder ``root/parts...``: each folder opened, then checked
    on its descriptor; none below the root may be a symbolic link.  ``create``: a
    missing folder is made 0700 (the root's parents with the usual modes)."""
    if not _AT:
        raise OSError("no directory descriptors here: the code cache is not used")
    fd = _open_dir(root, None, create, "it")
    try:
        for i, part in enumerate(parts):
            sub = _open_dir(part, fd, create, "its folder " + "/".join(parts[:i + 1]))
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(name: str, at: int | None, create: bool, what: str) -> int:
    flags = _READ | getattr(os, "O_DIRECTORY", 0) | (_NOFOLLOW if at is not None else 0)  # the root may be a link
    try:
        fd = os.open(name, flags, dir_fd=at)
    except FileNotFoundError:
        if not create:
            raise
        if at is None:
            os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
        try:
            os.mkdir(name, 0o700, dir_fd=at)
            os.chmod(name, 0o700, dir_fd=at)  # exactly 0700, whatever the umask
        except FileExistsError:
            pass  # made meanwhile by another process: checked below like any other
        fd = os.open(name, flags, dir_fd=at)
    except OSError as exc:  # the root unreachable (a file on its path): no cache, as when absent
        raise (_refusal(exc, what) if at is not None else exc) from None
    reason = _foreign(os.fstat(fd), what)
    if reason:
        os.close(fd)
        raise Untrusted(reason)
    return fd


def _refusal(exc: OSError, what: str) -> OSError:
    """A symbolic link or a non-folder where a folder or file should be: Untrusted."""
    import errno

    if exc.errno == errno.ELOOP:
        return Untrusted(f"{what} is a symbolic link")
    if exc.errno == errno.ENOTDIR:
        return Untrusted(f"{what} is a symbolic link or not a directory")
    return exc


def read_private(root: str, parts) -> bytes:
    """The bytes of the file ``root/parts...`` (the last part its name), read only
    where it and every folder down to it pass the check.  Raises Untrusted, or
    OSError where it is missing or not a regular file."""
    *folders, name = parts
    folder = open_folder(root, folders)
    what = "its file " + "/".join(parts)
    try:
        fd = os.open(name, _READ | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    except OSError as exc:
        raise _refusal(exc, what) from None
    finally:
        os.close(folder)
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{what} is not a regular file")
        reason = _foreign(st, what)
        if reason:
            raise Untrusted(reason)
        return f.readall()


def write_private(root: str, parts, data) -> None:
    """Write ``data`` to ``root/parts...`` (the folders made 0700 where missing, each
    checked): a temporary file (mode 0600) renamed over the target, so readers see
    the old file or the new one, never a part."""
    *folders, name = parts
    folder = open_folder(root, folders, create=True)
    tmp = f".tmp-{os.urandom(8).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600, dir_fd=folder)
        try:
            with open(fd, "wb") as f:
                os.fchmod(fd, 0o600)  # whatever the umask
                f.write(data)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)
