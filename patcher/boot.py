"""The patcher's import-free base: what the start hook may use before anything is imported.

* the constants the patcher's modules share, each defined here once: the environment
  variables it reads, the spec size limit, where bundled specs and the runtime's
  settings schemas live;
* spec references resolved and spec files read without pathlib (``_resolve``,
  ``read_spec``);
* the code cache's directory and its private files, checked on every read and write;
* the boot record, the code cache's record of a start-up (``recorded``, ``write``).

It imports only modules every interpreter has already imported (os, sys, stat,
marshal), so a start-up whose boot record holds costs ~1 ms (startup.py).  The code
cache, its records and its invariant: cache.py and docs/activation.md#the-code-cache.
"""

from __future__ import annotations

import marshal
import os
import stat
import sys

from ..runtime.core.private import Untrusted, foreign, read_private, write_file, write_private

# --------------------------------------------------------------------------- constants

ENV = "SOURCE_PATCH"  # the spec references to activate in every process
REPORT = "SOURCE_PATCH_REPORT"  # 1: at exit, print what applied, what was skipped and why
STRICT = "SOURCE_PATCH_STRICT"  # 1: a target module that cannot be found is an error
ON_ERROR = "SOURCE_PATCH_ON_ERROR"  # "error" (default) | "warn": what a failed activation does
CACHE_ENV = "SOURCE_PATCH_CACHE"  # the code cache directory
CHECK_ENV = "SOURCE_PATCH_CACHE_CHECK"  # "content": no stat keys (hash every source)
REPORT_DIR = "SOURCE_PATCH_REPORT_DIR"  # a folder: every patched process writes its report there as it patches
DEBUG = "SOURCE_PATCH_DEBUG"  # 1: tracebacks of source-patch's errors keep its own frames
VARIABLES = (ENV, REPORT, STRICT, ON_ERROR, CACHE_ENV, CHECK_ENV, REPORT_DIR, DEBUG)  # the patcher's own
# Every other SOURCE_PATCH_* variable that something reads (or sets for a child) and that is
# not a runtime setting (those are settings.variable(component, key) over settings.SCHEMAS).
# Activation warns about any SOURCE_PATCH_* variable that is none of these (a typo would
# otherwise do nothing, silently: activation.unknown_variables), so a new variable read
# anywhere goes here; tests/test_edges_variables.py checks the sources for it.
OTHER_VARIABLES = {
    "SOURCE_PATCH_NATIVE_DIR": "runtime/trace/native.py: where the trace's native launch is built",
    "SOURCE_PATCH_SGLANG_CACHE": "testing/sglang.py: the tiny SGLang checkpoints tests and examples build",
    "SOURCE_PATCH_WORKDIR": "testing/sglang.py: set for an engine harness's processes, their folder",
    "SOURCE_PATCH_UPSTREAM_TESTS": "bench/upstream_tests.py: Megatron-Core's test files",
    "SOURCE_PATCH_UPSTREAM_SGLANG_TESTS": "bench/upstream_tests.py: SGLang's test files",
    "SOURCE_PATCH_TEST_PERTURB": "tests/e2e/twin_replay.py: the layer whose weights it perturbs",
}

MAX_SPEC_BYTES = 8 << 20  # a spec file's size limit (spec.py has the others)
RACY_NS = 2_000_000_000  # a file changed this recently may change again unseen: not keyed by its stat

_HERE = os.path.dirname(os.path.realpath(__file__))  # the patcher's sources
BUNDLED_DIR = os.path.join(os.path.dirname(_HERE), "patches")
_RUNTIME_DIR = os.path.join(os.path.dirname(_HERE), "runtime")
# The runtime modules whose first import hands a start-up over to the full patcher: the
# settings (they read the specs' runtime: sections) and the capability table, which
# imports the manifests, which import the settings (startup.BootFinder).
HAND_OVER_MODULES = ("source_patch.runtime.core.settings", "source_patch.runtime.core.capability")
# The one table of renamed user-facing names: (kind, old name) -> the name now.  An old
# name still works, with a DeprecationWarning where it is resolved (``renamed``);
# docs/architecture.md ("Renamed names") shows this table.  Modules and internal names
# move without an entry.
#   spec    a bundled spec's name, from when each capability had a file per framework
#           (spec.resolve; `moe`, the mission's name, is a spec file of its own: no rename)
#   __sp__  a call-site name earlier bundled specs inserted, which a user's copy of such a
#           spec still calls (finder.RuntimeHandle)
#   settings  a settings component: its spec section (spec.py) and its environment
#           variables SOURCE_PATCH_<OLD>_<KEY> (activation.renamed_variables)
RENAMED = {
    ("spec", "moe_sglang"): "routing", ("spec", "dump_sglang"): "dump", ("spec", "trace_sglang"): "trace",
    ("spec", "weight_sync_sglang"): "weight_sync",
    ("__sp__", "sglang_routing_topk"): "routing_sglang_topk",
    ("__sp__", "sglang_routing_batch"): "routing_sglang_batch",
    ("__sp__", "sglang_routing_release"): "routing_sglang_release",
    ("settings", "sglang_routing"): "routing_sglang",
}
OLD_SPEC_NAMES = frozenset(old for kind, old in RENAMED if kind == "spec")


def renamed(kind: str, name: str, stacklevel: int = 3) -> str:
    """``name``'s name now, with a DeprecationWarning when RENAMED has it; else ``name``."""
    new = RENAMED.get((kind, name))
    if new is None:
        return name
    import warnings

    words = {"spec": "the bundled spec", "settings": "the settings component"}
    was, now = (f"{words[kind]} {name!r}", repr(new)) if kind in words else (f"{kind}.{name}", f"{kind}.{new}")
    warnings.warn(f"source-patch: {was} is now {now}; the old name goes away in a later release",
                  DeprecationWarning, stacklevel=stacklevel)
    return new


def split_refs(value: str) -> list[str]:
    """SOURCE_PATCH's spec references, separated by ',' or the path separator."""
    return [r.strip() for r in value.replace(os.pathsep, ",").split(",") if r.strip()]


ON_WORDS = ("1", "true", "yes", "on")  # a switch variable's values, in any case
OFF_WORDS = ("", "0", "false", "no", "off")


def flag(environ, name: str) -> bool:
    """A switch variable (SOURCE_PATCH_REPORT, _STRICT): on for ON_WORDS in any case, else
    off.  Where a value that is neither must be refused, ``switch`` says why."""
    return environ.get(name, "").strip().lower() in ON_WORDS


def switch(environ, name: str) -> bool:
    """``flag``, but ValueError for a value that is neither on nor off: ``STRICT=2`` or
    ``=enabled`` silently meaning off would hide the very errors it was set to raise."""
    value = environ.get(name, "")
    if value.strip().lower() in OFF_WORDS:
        return False
    if flag(environ, name):
        return True
    raise ValueError(f"{name}={value!r} is neither on ({', '.join(ON_WORDS)}) nor off "
                     f"({', '.join(w for w in OFF_WORDS if w)} or empty), in any case")


def write_report(directory: str, name: str, data: str) -> None:
    """A process's patch report (activation.py) in the folder the user named, as every
    plain file source-patch writes: a temporary file renamed over it
    (``private.write_file``), so a reader (or a kill) never sees half of one.  The folder
    is made where missing.  Raises OSError."""
    os.makedirs(directory, exist_ok=True)
    write_file(os.path.join(directory, name), data)


def signature(path) -> tuple | None:
    """What the code cache trusts a file or folder by (docs/activation.md#the-code-cache): its
    device, inode, size, mtime and ctime (ns); None if it cannot be stat-ed."""
    try:
        st = os.stat(path)
    except (OSError, ValueError, TypeError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# --------------------------------------------------------------------------- spec files


class NotASpecFile(Exception):
    """A path that is no readable spec file: not a regular file, or too large."""


def read_spec(path) -> str:
    """A spec file's text: a regular file of at most MAX_SPEC_BYTES, UTF-8.  Opened
    without blocking, so a FIFO or a device is refused instead of hanging or filling
    memory.  Raises NotASpecFile, OSError or UnicodeDecodeError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NotASpecFile("not a regular file")
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise NotASpecFile(f"larger than {MAX_SPEC_BYTES >> 20} MiB")
    return data.decode("utf-8")


def _resolve(ref: str) -> str | None:
    """spec.resolve without pathlib: a path, or a bundled name.  None where that
    function would warn or fail (it then runs on the full path and says so)."""
    path = os.path.expanduser(ref)
    if os.path.splitext(path)[1] in (".yaml", ".yml") or os.sep in ref or os.path.exists(path):
        path = os.path.realpath(path)
    else:
        path = os.path.join(BUNDLED_DIR, ref + ".yaml")
    if os.path.splitext(os.path.basename(path))[0] in OLD_SPEC_NAMES:
        return None
    return path


def _text(path: str) -> str | None:
    try:
        return read_spec(path)
    except (NotASpecFile, OSError, ValueError):  # ValueError: not UTF-8, a NUL in the path
        return None


# --------------------------------------------------------------------------- the cache directory


def cache_dir() -> str:
    """The code cache directory (``cache.default_dir`` is this as a Path)."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "source-patch")


def untrusted(directory) -> str | None:
    """Why a cache directory must not be used (None: it may), as ssh judges its files.
    Only its top folder: each read and write checks its whole path (``private.open_folder``)."""
    try:
        st = os.stat(directory)
    except OSError:  # absent (created 0700 on first write) or unreachable (writes fail: no cache)
        return None
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return foreign(st, "it")


_REFUSED: set = set()  # cache directories warned about in this process


def refuse(directory: str, reason: str) -> None:
    """Warn, once per process and directory, that a cache directory is not used."""
    key = os.path.abspath(directory)
    if key in _REFUSED:
        return
    _REFUSED.add(key)
    from .errors import warn  # filed under the user's frame, not a line of ours

    warn(f"source-patch: not using the code cache {directory}: {reason} (its files would be "
         "executed; the imports they serve parse instead). Set SOURCE_PATCH_CACHE to a directory "
         "only you can write (or delete this one: it is rebuilt)", RuntimeWarning)


# The cache's files are executed and its boot records decide what is patched: each read
# and write checks every folder on the way down and the file itself, on every use
# (docs/activation.md#the-code-cache, "trust"), through the runtime's one writer of files.


# --------------------------------------------------------------------------- the boot record
#
# ``boot/<name>.spb``: MAGIC, then a marshalled dict of FORMAT: the start-up's spec
# paths and texts, the target modules' names, where each was found (None: it may be
# missing, its distribution is not installed), and what those answers rest on:
# sys.path with each entry's signature, the other meta-path finders, the signatures
# of the patcher's sources and of the runtime settings schemas.

MAGIC = b"SPB1"
FORMAT = 2  # of the record's fields; another value is a miss


class Recorded:
    """What a boot record that still holds tells a start-up."""

    __slots__ = ("paths", "texts", "targets", "cache_dir")

    def __init__(self, paths: tuple, texts: tuple, targets: frozenset, directory: str):
        self.paths, self.texts, self.targets, self.cache_dir = paths, texts, targets, directory


def recorded(value: str) -> Recorded | None:
    """The boot record of a SOURCE_PATCH value, if one holds for its spec files as they
    are now and for this environment; None: the full activation must run."""
    paths = tuple(_resolve(r) for r in split_refs(value))
    if not paths or None in paths:
        return None
    texts = tuple(_text(p) for p in paths)
    if None in texts:
        return None
    directory = cache_dir()
    if untrusted(directory):
        return None  # the full path warns about it
    record = _load(record_path(directory, paths))
    if record is None or not _holds(record, paths, texts):
        return None
    return Recorded(paths, texts, frozenset(record["targets"]), directory)


def record_path(directory: str, paths) -> str:
    """``<cache>/boot/<name>.spb``, one per (interpreter, environment, spec paths)."""
    ident = "\0".join([sys.version, sys.prefix, *paths]).encode("utf-8", "surrogatepass")
    # An int's hash is not salted (PYTHONHASHSEED salts only str and bytes), so this
    # name is the same in every process, without importing hashlib.  The record
    # repeats the paths: two settings sharing a name only overwrite each other's record.
    name = hash(int.from_bytes(ident, "little")) & 0xFFFF_FFFF_FFFF_FFFF
    return os.path.join(directory, "boot", f"{name:016x}.spb")


def _tools() -> tuple:
    """What the compiled specs depend on besides their text: the patcher's sources
    (their names too: a file added or removed counts) and the settings schemas."""
    names = sorted(n for n in os.listdir(_HERE) if n.endswith(".py"))
    return tuple((n, signature(os.path.join(_HERE, n))) for n in names) + (
        tuple((f, signature(f)) for f in schema_files()))


def schema_files() -> list:
    """The files the settings schemas are read from: core's parsers and each capability's
    manifest (runtime/<name>/manifest.py; a capability added or removed counts)."""
    files = [os.path.join(_RUNTIME_DIR, "core", "settings.py")]
    for name in sorted(os.listdir(_RUNTIME_DIR)):
        manifest = os.path.join(_RUNTIME_DIR, name, "manifest.py")
        if os.path.isfile(manifest):
            files.append(manifest)
    return files


def _finders() -> tuple:
    """The other meta-path finders (an editable install's, ...), by class name."""
    return tuple(f"{type(f).__module__}.{type(f).__qualname__}" if not isinstance(f, type) else
                 f"{f.__module__}.{f.__qualname__}"
                 for f in sys.meta_path if not getattr(f, "_source_patch_finder", False))


def _environment() -> dict:
    """Where target modules are looked up: a changed entry (a distribution installed,
    removed or upgraded changes its directory) means looking again."""
    return {"sys_path": tuple(sys.path), "entries": tuple(signature(p) for p in sys.path),
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
    if any(now - max(s[3], s[4]) < RACY_NS for s in signed):
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
        write_private(directory, ("boot", os.path.basename(record_path(directory, paths))), payload, sync=False)
    except Untrusted as exc:
        refuse(directory, str(exc))
        return False
    except OSError:
        return False
    return True
