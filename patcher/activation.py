"""Turning patching on: the explicit API, the environment variable, and test helpers.

``SOURCE_PATCH`` holds one or more spec references separated by ',' (or the
path separator); each is a file path or a bundled spec name.  Activation from
the environment rewrites the variable with absolute paths, so children started
in another working directory find the same specs.

At start-up this module is imported only when the start hook's fast path
(startup.py) cannot activate from its boot record; a successful activation here
writes that record (boot.write).
"""

from __future__ import annotations

import _thread
import contextlib
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterable, Iterator

from . import boot
from . import spec as spec_mod
from .boot import DEBUG, ENV, ON_ERROR, OTHER_VARIABLES, REPORT, REPORT_DIR, STRICT, VARIABLES, flag, split_refs, switch
from .cache import CodeCache
from .errors import ActivationError, NotActivatedError, SourcePatchError, shorten, show, warn
from .finder import PatchFinder, PatchingLoader, Skipped, missing_calls, refuse_if_results_change
from .locate import NotFound, find_source, nearest_modules
from .requires import installed_version


class Activation:
    """Specs made active by one ``activate`` call; ``deactivate()`` undoes it."""

    def __init__(self, finder: PatchFinder, specs: list[spec_mod.Spec], found: dict | None = None):
        self.finder, self.specs = finder, specs
        self.found = found  # target -> its file (None: missing, gated); None when one was reported

    @property
    def modules(self) -> list[str]:
        return sorted({m for s in self.specs for m in s.modules})

    def report(self) -> str:
        return report(self.finder, self.specs)

    def deactivate(self) -> None:
        for spec in self.specs:
            if spec in self.finder.specs:
                self.finder.remove(spec)
        if not self.finder.specs and self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)


def installed_finder() -> PatchFinder | None:
    """The PatchFinder on sys.meta_path; a BootFinder there (a start-up from the boot
    record: startup.py, known by its ``hand_over``) hands over to its PatchFinder first."""
    for f in sys.meta_path:
        if isinstance(f, PatchFinder):
            return f
        if getattr(f, "_source_patch_finder", False) and hasattr(f, "hand_over"):
            return f.hand_over().finder
    return None


def adopt_boot(pending) -> Activation:
    """The full activation of what the start hook's BootFinder (``pending``) activated:
    the same spec texts, rebuilt from the code cache as activate_from_env would, in a
    PatchFinder that takes the BootFinder's place on sys.meta_path."""
    error = environment_error()
    if error:
        return _refuse_boot(pending, error)
    recorded = pending.recorded
    cache = CodeCache(Path(recorded.cache_dir))
    specs = list(dict.fromkeys(spec_mod.compiled(t, p, cache) for p, t in zip(recorded.paths, recorded.texts)))
    finder = PatchFinder(cache)
    for s in specs:
        finder.add(s)
    if pending in sys.meta_path:
        sys.meta_path[sys.meta_path.index(pending)] = finder
    else:
        sys.meta_path.insert(0, finder)
    _installed(finder)
    return Activation(finder, specs)


def _refuse_boot(pending, error: ActivationError) -> Activation:
    """A boot-record start-up (which reads no settings) refused at its hand-over, as
    activate_from_env refuses: armed and raised (the import that handed over fails
    too), or under ON_ERROR=warn said and left unpatched (an Activation of nothing)."""
    if pending in sys.meta_path:
        sys.meta_path.remove(pending)
    policy = os.environ.get(ON_ERROR, "error").strip().lower()
    _fail(error, policy)
    if policy != "warn":
        raise FailedActivation(error).refusal("this module")
    return Activation(PatchFinder(CodeCache(Path(pending.recorded.cache_dir))), [])


_KNOWN = frozenset(VARIABLES) | frozenset(OTHER_VARIABLES)  # known without the settings schemas


def environment_error(environ=os.environ) -> ActivationError | None:
    """SOURCE_PATCH_STRICT and every ``SOURCE_PATCH_<COMPONENT>_<KEY>`` checked at
    activation, so that a bad value stops the job at once with one line instead of a
    traceback at its first call site (settings.environ_errors); and every other
    SOURCE_PATCH_* variable, which is a typo (it would do nothing, silently): one warning
    each, an error under SOURCE_PATCH_STRICT=1."""
    errors, strict = [], False
    old = renamed_variables(environ)
    others = sorted(name for name in environ if name.startswith("SOURCE_PATCH_") and name not in _KNOWN
                    and name not in old)
    if others:
        errors = spec_mod.settings_errors(environ)  # else no import of the schemas (~5 ms)
    try:
        strict = switch(environ, STRICT)
    except ValueError as exc:
        errors.insert(0, str(exc))
    unknown = unknown_variables(others)
    if strict:
        errors += unknown
    else:
        _say_unknown(unknown)
    return ActivationError("; ".join(errors)) if errors else None


def renamed_variables(environ) -> set:
    """The variables of a settings component renamed before 1.0 (boot.RENAMED): each
    still works as its new name, which wins where both are set, with one warning.  Set
    in ``environ`` (the process's, so its children see both).  Returns the old names."""
    found = set()
    for (kind, was), now in boot.RENAMED.items():
        prefix = f"SOURCE_PATCH_{was.upper()}_"
        for name in sorted(n for n in environ if kind == "settings" and n.startswith(prefix)):
            new = f"SOURCE_PATCH_{now.upper()}_{name[len(prefix):]}"
            environ.setdefault(new, environ[name])
            found.add(name)
            if name not in _unknown_said:
                _unknown_said.add(name)
                warn(f"source-patch: {name} is now {new}; the old name goes away in a later release",
                     DeprecationWarning)
    return found


def unknown_variables(names) -> list[str]:
    """One line for each of ``names`` that is no source-patch variable (boot.VARIABLES,
    boot.OTHER_VARIABLES, a runtime setting's), with the nearest known name."""
    if not names:
        return []
    known = _KNOWN | spec_mod.settings_variables()
    lines = []
    for name in names:
        if name not in known:
            near = _nearest(name, known)
            hint = f"did you mean {near}?" if near else "the settings are listed in docs/settings.md"
            lines.append(f"{shorten(name)} is not a source-patch variable ({hint})")
    return lines


def _nearest(name: str, known) -> str | None:
    """The known variable ``name`` most likely misspells: the same words in another order
    (SGLANG_ROUTING_MODE), else the closest by difflib.  Compared without the common
    ``SOURCE_PATCH_``, which would make any two names look alike."""
    import difflib

    cut = len("SOURCE_PATCH_")
    words = sorted(name[cut:].split("_"))
    for other in sorted(known):
        if sorted(other[cut:].split("_")) == words:
            return other
    by_rest = {k[cut:]: k for k in known if k.startswith("SOURCE_PATCH_")}
    near = difflib.get_close_matches(name[cut:], sorted(by_rest), n=1, cutoff=0.6)
    return by_rest[near[0]] if near else None


_unknown_said: set = set()  # lines said in this process


def _say_unknown(lines: list[str]) -> None:
    for line in lines:
        if line not in _unknown_said:
            _unknown_said.add(line)
            warn(f"source-patch: {line}; it does nothing ({STRICT}=1 makes this an error)")


def _finder(cache_dir: str | os.PathLike | None) -> PatchFinder:
    finder = installed_finder()
    if finder is None:
        finder = PatchFinder(CodeCache(Path(cache_dir) if cache_dir else None))
        sys.meta_path.insert(0, finder)
        _installed(finder)
    return finder


def _installed(finder: PatchFinder) -> None:
    """What comes with a new finder: the report writer (SOURCE_PATCH_REPORT_DIR) and the
    excepthook that shows errors at import and in inserted code."""
    _install_hook()
    directory = os.environ.get(REPORT_DIR, "").strip()
    if directory:
        observe(finder, directory)


def activate(specs: Iterable[str | os.PathLike | spec_mod.Spec] | str, *,
             cache_dir: str | os.PathLike | None = None) -> Activation:
    """Patch the targets of these specs from their next import on.

    Raises SpecError for a bad spec and ActivationError if a target is already
    imported (it would silently stay unpatched).  Activating a spec that is
    already active is a no-op.  ``cache_dir`` applies when this call installs the
    finder; later calls share the installed finder's cache.
    """
    warn_env_after_start()
    return _activate(specs, cache_dir)


def _activate(specs, cache_dir) -> Activation:
    error = environment_error()
    if error:  # first: nothing is loaded or installed for a run that must not start
        raise error
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    loaded = [s if isinstance(s, spec_mod.Spec) else spec_mod.load(s) for s in specs]
    loaded = list(dict.fromkeys(loaded))  # the same spec named twice applies once
    current = installed_finder()
    active = {(s.file, s) for s in current.specs} if current else set()
    new = [s for s in loaded if (s.file, s) not in active]
    late = sorted({m for s in new for m in s.modules if m in sys.modules})
    if late:
        names = ", ".join(shorten(m) for m in late[:10]) + (f" and {len(late) - 10} more" if len(late) > 10 else "")
        raise ActivationError(
            f"already imported, so they cannot be patched: {names}. Activate earlier "
            f"(SOURCE_PATCH=... in the environment, or activate() before the first import)")
    found = _check_targets(new, strict=flag(os.environ, STRICT))
    finder = _finder(cache_dir)
    for s in new:
        finder.add(s)
    return Activation(finder, new, found)


_env_said = False


def env_after_start(environ=os.environ) -> str | None:
    """Why SOURCE_PATCH as it is now does nothing in this process (None: it does what it
    says): it is read once, by the start hook, so setting or changing it later (say,
    ``os.environ`` in the script) patches only the children started afterwards."""
    startup = sys.modules.get(f"{__package__}.startup")
    ran = startup is not None and startup._done
    if ran and startup.seen is None:
        return None  # the start hook is activating now
    value, seen = environ.get(ENV, ""), startup.seen if ran else ""
    if value == seen or not (split_refs(value) or split_refs(seen)):
        return None
    if not ran:
        return (f"{ENV}={show(value)} is set, but the start hook did not run in this process: it was set "
                f"after the interpreter started (or the hook is not installed: source-patch hook status), "
                f"so nothing is patched by it here, only in children started from now on. Set it before "
                f"Python starts, or call source_patch.patcher.activate(...) before the first import of a target")
    return (f"{ENV} changed after start-up (from {show(seen) or 'unset'} to {show(value) or 'unset'}): this "
            f"process keeps what it activated at start-up; only children started from now on see the change")


def warn_env_after_start() -> None:
    """Say env_after_start's reason once per process."""
    global _env_said
    reason = None if _env_said else env_after_start()
    if reason:
        _env_said = True
        warn(f"source-patch: {reason}")


def _check_targets(specs: list[spec_mod.Spec], strict: bool) -> dict[str, str | None] | None:
    """Report target modules that cannot be found (a misspelled ``module:`` would
    otherwise never apply, silently).  A patch whose required distribution is not
    installed is not reported: that is the other framework of a two-framework spec.
    Returns where each target was found (None: not found, but gated), for the boot
    record; None if one was reported."""
    found: dict[str, str | None] | None = {}
    for s in specs:
        for module in s.modules:
            try:
                origin = str(find_source(module))
                if found is not None:
                    found[module] = origin
                continue
            except NotFound as exc:
                error = exc
            patches = [p for p in s.patches if p.module == module]
            if all(_gated(s.requires + p.requires) for p in patches):
                if found is not None:
                    found.setdefault(module, None)
                continue
            refuse_if_results_change(missing_calls([Skipped(p, f"it cannot be found ({error})") for p in patches]),
                                     shorten(module))
            found = None
            near = nearest_modules(error)
            message = (f"{patches[0].location}: spec {s.name!r} patches {shorten(module)}, which cannot "
                       f"be found ({error}); nearest: {', '.join(near) if near else 'none'}")
            if strict:
                raise ActivationError(message)
            warn(f"source-patch: {message} ({STRICT}=1 makes this an error)")
    return found


def _gated(requires) -> bool:
    return any(installed_version(dist) is None for dist, _ in requires)


def report(finder: PatchFinder, specs: list[spec_mod.Spec]) -> str:
    """What applied, what was skipped and why, and targets never imported.  With a
    report folder (SOURCE_PATCH_REPORT_DIR), a patch not imported here says what the
    other processes that reported there did with it."""
    others = _elsewhere(read_reports(finder.report_dir)[0]) if finder.report_dir else {}
    lines = []
    for row in report_rows(finder, specs):
        lines.append(f"spec {row['name']} ({row['file']}):")
        for p in row["patches"]:
            state = p["state"] + (f": {p['reason'].splitlines()[0]}" if p["reason"] else "")
            if p["state"] == "not imported" and (row["file"], p["id"]) in others:
                state = f"not imported here; {others[row['file'], p['id']]}"
            lines.append(f"  {p['id']} ({p['module']}): {state}")
    return "\n".join(lines)


def report_rows(finder: PatchFinder, specs: list[spec_mod.Spec]) -> list[dict]:
    """Each spec and each of its patches' state in this process: ``applied``,
    ``skipped`` (with the reason: an unmet requirement, a drifted anchor, a failed
    import) or ``not imported`` (its target was not imported here)."""
    skipped = {id(k.patch): k.reason for k in finder.skipped}
    rows = []
    for s in specs:
        patches = []
        for p in s.patches:
            state = "skipped" if id(p) in skipped else "applied" if p.module in finder.imported else "not imported"
            patches.append({"id": p.id, "module": p.module, "state": state, "reason": skipped.get(id(p))})
        rows.append({"name": s.name, "file": s.file, "patches": patches})
    return rows


# --------------------------------------------------------------------------- reports on disk
#
# SOURCE_PATCH_REPORT_DIR: every patched process writes its report, ``<host>-<pid>-<ms>.json``
# (the first write's time tells a reused pid apart), after each target import, so a
# process killed later (SGLang's schedulers are, at shutdown) has already reported.

REPORT_FORMAT = 1
REPORT_MAX_BYTES = 4 << 20  # a report file read back (a spec of ~10,000 patches)
REPORT_MAX_FILES = 10_000  # report files read from one folder


def observe(finder: PatchFinder, directory: str) -> None:
    """Write this process's report to ``directory`` from now on (absolute, and so in the
    environment for children started elsewhere); chain a SIGTERM handler the program
    installed."""
    import json  # noqa: F401 - now, not first inside the writer's lock, at an import

    directory = os.path.abspath(os.path.expanduser(directory))
    os.environ[REPORT_DIR] = directory
    finder.report_dir, finder.observer = directory, _Reporter(directory)
    _chain_sigterm(finder)


class _Reporter:
    """The finder's observer: the report, written whole (boot.write_report) after each
    target import.  It never raises: a folder that cannot be written (a full disk, no
    permission) is said once, and the run goes on."""

    def __init__(self, directory: str):
        self.directory = directory
        self.names: dict[int, str] = {}  # pid -> its file (a forked child writes its own)
        self.lock = _thread.allocate_lock()
        self.said = False

    def __call__(self, finder: PatchFinder, signal_name: str | None = None) -> None:
        # From a signal handler, the main thread may hold the lock: skip, its write goes on.
        if not self.lock.acquire(blocking=signal_name is None):
            return
        try:
            self._write(finder, signal_name)
        except Exception as exc:  # noqa: BLE001 - an observer never breaks the run
            self._say(exc)
        finally:
            self.lock.release()

    def _say(self, exc: Exception) -> None:
        if self.said:
            return
        self.said = True
        with contextlib.suppress(Exception):  # a warning filter set to "error": still never raised
            warn(f"source-patch: cannot write the patch report to {self.directory}: "
                 f"{type(exc).__name__}: {shorten(exc)} (the run goes on without it)", RuntimeWarning)

    def _write(self, finder: PatchFinder, signal_name: str | None) -> None:
        import json

        pid = os.getpid()
        if pid not in self.names:
            self.names[pid] = f"{_host()}-{pid}-{time.time_ns() // 1_000_000}.json"
        record = {"format": REPORT_FORMAT, "pid": pid, "host": _host(), "argv0": (sys.argv or [""])[0],
                  "process": _process_name(), "time": time.time(), "signal": signal_name,
                  "specs": report_rows(finder, finder.specs)}
        boot.write_report(self.directory, self.names[pid], json.dumps(record, indent=1))


def _host() -> str:
    return os.uname().nodename if hasattr(os, "uname") else os.environ.get("COMPUTERNAME", "host")


def _process_name() -> str | None:
    """What the process calls itself: its title (setproctitle, as SGLang's schedulers
    set it), else its multiprocessing name; only from modules already imported."""
    title = sys.modules.get("setproctitle")
    if title is not None:
        with contextlib.suppress(Exception):
            return title.getproctitle()
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        with contextlib.suppress(Exception):
            return mp.current_process().name
    return None


def _chain_sigterm(finder: PatchFinder) -> None:
    """Where the program installed a SIGTERM handler, one that writes the report (saying
    the signal) and then calls it.  The default action and SIG_IGN are left alone: a
    Python handler there would keep a process busy in C code from dying on SIGTERM, and
    the report is on disk since the last target import anyway.  Off the main thread a
    handler cannot be set: nothing is done."""
    import signal

    try:
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous) or getattr(previous, "source_patch", False):
            return

        def on_sigterm(signum, frame):
            if finder.observer is not None:
                finder.observer(finder, "SIGTERM")
            return previous(signum, frame)

        on_sigterm.source_patch = True
        signal.signal(signal.SIGTERM, on_sigterm)
    except (AttributeError, ValueError, OSError):  # no SIGTERM here, or not the main thread
        return


def read_reports(directory: str) -> tuple[list[dict], list[str]]:
    """The reports in ``directory`` (oldest first), and a line for each file that is no
    report (unreadable, too large, another format).  A folder that cannot be listed
    gives ([], [why])."""
    import json

    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except OSError as exc:
        return [], [f"{directory}: {exc.strerror or exc}"]
    reports, problems = [], []
    for name in names[:REPORT_MAX_FILES]:
        path = os.path.join(directory, name)
        try:
            record = json.loads(_read_small(path))
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {shorten(exc)}")
            continue
        if _is_report(record):
            reports.append(record)
        else:
            problems.append(f"{path}: not a patch report of format {REPORT_FORMAT}")
    if len(names) > REPORT_MAX_FILES:
        problems.append(f"{directory}: {len(names) - REPORT_MAX_FILES} more files not read")
    reports.sort(key=lambda r: r["time"])
    return reports, problems


def _read_small(path: str) -> bytes:
    """A regular file's bytes, up to REPORT_MAX_BYTES; a FIFO or a device is refused, never waited on."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError("not a regular file")
        data = f.read(REPORT_MAX_BYTES + 1)
    if len(data) > REPORT_MAX_BYTES:
        raise OSError(f"larger than {REPORT_MAX_BYTES >> 20} MiB")
    return data


def _is_report(record) -> bool:
    """A report as _Reporter writes it, to the types collect() relies on (a file in the
    folder may be anything)."""
    return (isinstance(record, dict) and record.get("format") == REPORT_FORMAT
            and isinstance(record.get("pid"), int) and isinstance(record.get("time"), (int, float))
            and all(isinstance(record.get(k), (str, type(None))) for k in ("host", "argv0", "process", "signal"))
            and isinstance(record.get("specs"), list) and all(_is_spec_row(s) for s in record["specs"]))


def _is_spec_row(row) -> bool:
    return (isinstance(row, dict) and isinstance(row.get("name"), str) and isinstance(row.get("file"), str)
            and isinstance(row.get("patches"), list)
            and all(isinstance(p, dict) and all(isinstance(p.get(k), str) for k in ("id", "module", "state"))
                    and isinstance(p.get("reason"), (str, type(None))) for p in row["patches"]))


def collect(reports: list[dict]) -> list[dict]:
    """Every spec any process reported, each patch with the processes that applied it
    and those that skipped it (and why): ``source-patch report``'s answer."""
    specs: dict = {}
    for r in reports:  # each one _is_report
        process = {"pid": r["pid"], "host": r.get("host"), "argv0": r.get("argv0"), "process": r.get("process")}
        for s in r["specs"]:
            row = specs.setdefault(s["file"], {"name": s["name"], "file": s["file"], "patches": {}})
            for p in s["patches"]:
                entry = row["patches"].setdefault(p["id"], {"id": p["id"], "module": p["module"],
                                                            "applied": [], "skipped": []})
                if p["state"] == "applied":
                    entry["applied"].append(process)
                elif p["state"] == "skipped":
                    entry["skipped"].append({**process, "reason": p.get("reason")})
    return [{**row, "patches": list(row["patches"].values())} for row in specs.values()]


def who(process: dict) -> str:
    """``pid 4242 (sglang::scheduler_TP0)``: a process as the reports name it."""
    name = process.get("process")
    if not name or name == "MainProcess":  # multiprocessing's name for any main process
        name = process.get("argv0")
    return f"pid {process['pid']}" + (f" ({shorten(name, 60)})" if name else "")


def _elsewhere(reports: list[dict]) -> dict:
    """(spec file, patch id) -> what the other processes did with it, where one applied
    or skipped it: for a patch this process never imported."""
    me = (_host(), os.getpid())
    others = [r for r in reports if (r.get("host"), r["pid"]) != me]
    return {(row["file"], p["id"]): describe(p) for row in collect(others) for p in row["patches"]
            if p["applied"] or p["skipped"]}


def describe(patch: dict) -> str:
    """A collected patch (``collect``) in words: ``applied in pid 4250 (sglang::scheduler_TP0);
    skipped in pid 4242 (train.py): requires ...``, or ``not imported in any process``."""
    parts = []
    if patch["applied"]:
        parts.append("applied in " + _listed([who(w) for w in patch["applied"]]))
    if patch["skipped"]:
        parts.append("skipped in " + _listed([f"{who(w)}: {str(w['reason']).splitlines()[0]}"
                                              for w in patch["skipped"]]))
    return "; ".join(parts) or "not imported in any process"


def _listed(items: list[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


@contextlib.contextmanager
def patched(*specs: str | os.PathLike | spec_mod.Spec,
            cache_dir: str | os.PathLike | None = None) -> Iterator[Activation]:
    """Activate for a block; on exit deactivate and forget the targets it imported."""
    before = set(sys.modules)
    activation = activate(list(specs), cache_dir=cache_dir)
    try:
        yield activation
    finally:
        activation.deactivate()
        for name in activation.modules:
            if name not in before:
                _forget(name)


def _forget(name: str) -> None:
    """Drop a module from sys.modules and from its parent package's attributes
    (else ``from pkg import mod`` would keep finding the patched copy)."""
    module = sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if module is not None and getattr(sys.modules.get(parent), child, None) is module:
        delattr(sys.modules[parent], child)


def import_patched_copy(module: str, *specs: str | os.PathLike | spec_mod.Spec,
                        cache_dir: str | os.PathLike | None = None) -> ModuleType:
    """A freshly executed, patched copy of ``module``; ``sys.modules`` is left as it was.

    The copy is registered under its name only while it executes (dataclasses and
    relative imports look it up there); an already-imported original is restored.
    """
    loaded = [s if isinstance(s, spec_mod.Spec) else spec_mod.load(s) for s in specs]
    patches = [p for s in loaded for p in s.patches if p.module == module]
    if not patches:
        raise ActivationError(f"none of the given specs patches {module}")
    parent = module.rpartition(".")[0]
    if parent:
        # Import the package first: were the copy the first to run, a package
        # __init__ importing it back would find the copy half-executed.
        importlib.import_module(parent)
    path = str(find_source(module))
    finder = installed_finder()
    cache = finder.cache if finder else CodeCache(Path(cache_dir) if cache_dir else None)
    loader = PatchingLoader(module, path, patches, cache)
    mspec = importlib.util.spec_from_file_location(module, path, loader=loader)
    copy = importlib.util.module_from_spec(mspec)
    missing = object()
    previous = sys.modules.get(module, missing)
    sys.modules[module] = copy
    try:
        loader.exec_module(copy)
    finally:
        if previous is missing:
            sys.modules.pop(module, None)
        else:
            sys.modules[module] = previous
    return copy


# --------------------------------------------------------------------------- environment


def activate_from_env(environ=os.environ, *, remember: bool = False) -> Activation | None:
    """Activate the specs named by SOURCE_PATCH.  Called from the ``.pth`` start hook,
    where ``site`` would swallow an exception, so a failure is *armed* instead: the
    error is printed, and every later import of a non-standard-library module raises
    NotActivatedError carrying it (the program stops at its first real import, never
    runs silently unpatched).  Any failure counts, not only a SourcePatchError (an
    unusable path, a bug): an exception escaping here would be swallowed by ``site``.
    ``SOURCE_PATCH_ON_ERROR=warn`` turns that into a warning and an unpatched run.
    ``remember`` (the start hook): write the boot record that lets the next start-up
    with the same specs skip all this (startup.py)."""
    value = environ.get(ENV, "")
    refs = split_refs(value)
    if not refs:
        if value:  # only separators and blanks: off, as an empty value, but say so
            _say(f"source-patch: warning: {ENV}={show(value)} names no spec file, so nothing is patched "
                 f"(set it empty or unset it to silence this)")
        return None
    try:
        paths = [str(spec_mod.resolve(r)) for r in refs]
        environ[ENV] = ",".join(paths)
        # What spec.load does, keeping each text: the boot record must hold the very
        # text the specs (and so the target names) came from.
        texts, specs = [], []
        for path in paths:
            texts.append(spec_mod.read_text(Path(path)))
            specs.append(spec_mod.compiled(texts[-1], path))
        activation = _activate(specs, None)
        if remember and activation.found is not None and activation.specs == list(dict.fromkeys(specs)):
            boot.write(paths, texts, activation.found)
        if flag(environ, REPORT):
            import atexit

            atexit.register(print_report, activation)
        return activation
    except SourcePatchError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - fail closed on anything
        error = ActivationError(f"{ENV}={show(value)}: {type(exc).__name__}: {shorten(exc, 1000)}")
    _fail(error, environ.get(ON_ERROR, "error").strip().lower())
    return None


class FailedActivation:
    """Installed first on sys.meta_path when SOURCE_PATCH could not be activated:
    every import of a module outside the standard library raises the error."""

    _source_patch_finder = True

    def __init__(self, error: SourcePatchError):
        self.error = error

    def find_spec(self, fullname, path=None, target=None):
        if _is_third_party(fullname):
            raise self.refusal(shorten(fullname)) from None
        return None

    def refusal(self, what: str) -> NotActivatedError:
        return NotActivatedError(
            f"source-patch: {ENV} could not be activated, so importing {what} is refused "
            f"(the program would run unpatched; {ON_ERROR}=warn runs it unpatched anyway):\n{self.error}",
            self.error)


# --------------------------------------------------------------------------- how errors are shown


def _install_hook() -> None:
    if not getattr(sys.excepthook, "source_patch", False):
        sys.excepthook = _hook(sys.excepthook)


def _hook(previous):
    """sys.excepthook for what source-patch is part of; anything else goes to ``previous``
    untouched.  A NotActivatedError shows the user's frames only (the refused import);
    another error of ours its message first, then the user's frames (importlib's and
    the patcher's hidden); an exception raised in inserted code shows the inserted line
    where the traceback printed the anchor's upstream text.  The last two only where
    ``previous`` is Python's own (another hook gets the trimmed traceback, or the
    original).  SOURCE_PATCH_DEBUG=1: everything as Python shows it."""

    def hook(kind, value, tb):
        shown = None
        if not flag(os.environ, DEBUG):
            try:
                shown = _shown(kind, value, tb, previous is sys.__excepthook__)
            except Exception:  # noqa: BLE001 - showing an error must never hide it
                shown = None
        if isinstance(shown, str):
            _say(shown.rstrip("\n"))
        elif shown is not None:
            previous(kind, value.with_traceback(shown[0]), shown[0])
        else:
            previous(kind, value, tb)

    hook.source_patch = True
    return hook


def _shown(kind, value, tb, ours_to_print: bool):
    """What the hook prints: a text, (a trimmed traceback,) for ``previous``, or None."""
    if isinstance(value, NotActivatedError):
        return (_user_frames(tb),)
    if isinstance(value, SourcePatchError):
        return _format(kind, value, tb) if ours_to_print else (_user_frames(tb),)
    if ours_to_print and any(_inserted(t) for t in _chain_tracebacks(value, tb)):
        return _format(kind, value, tb)
    return None


_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(tb) -> bool:
    """A frame of importlib's (import_module's too) or of the patcher's."""
    name = tb.tb_frame.f_code.co_filename
    return (name.startswith("<frozen importlib") or name.startswith(_OURS)
            or tb.tb_frame.f_globals.get("__name__") == "importlib")


def _user_frames(tb):
    """The traceback without importlib's frames and this package's own."""
    import types

    kept = []
    while tb is not None:
        if not _internal(tb):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for frame in reversed(kept):
        out = types.TracebackType(out, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return out


def _chain_tracebacks(value, tb):
    """The tracebacks of an exception and of those it was raised from or during."""
    seen, todo = set(), [(value, tb)]
    while todo:
        exc, tb = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        while tb is not None:
            yield tb
            tb = tb.tb_next
        todo += [(e, e.__traceback__) for e in (exc.__cause__, exc.__context__) if e is not None]


def _format(kind, value, tb) -> str:
    """The traceback as Python prints it, each frame through ``_frame`` (inserted code shows
    its own line).  An error of ours leaves out importlib's and the patcher's frames and
    says its first line first, where a long traceback would otherwise bury it; the full
    message ends the traceback, as always."""
    import traceback

    ours = isinstance(value, SourcePatchError)
    te = traceback.TracebackException(kind, value, tb, compact=True)
    _restack(te, value, tb, ours, set())
    text = "".join(te.format())
    if not ours:
        return text
    lines = str(value).split("\n")
    below = "more below" if len(lines) > 1 else "the traceback below"
    return f"source-patch: error: {lines[0].rstrip(':')} ({below}; {DEBUG}=1 shows source-patch's own frames)\n{text}"


def _restack(te, exc, tb, trim: bool, seen: set) -> None:
    """Each TracebackException of the chain gets the stack ``_frame`` makes."""
    import traceback

    if te is None or exc is None or id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list(
        [_frame(t) for t in _walk(tb) if not (trim and _internal(t))])
    _restack(te.__cause__, exc.__cause__, getattr(exc.__cause__, "__traceback__", None), trim, seen)
    _restack(te.__context__, exc.__context__, getattr(exc.__context__, "__traceback__", None), trim, seen)


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _frame(tb):
    """A traceback entry as the traceback module summarises it; in inserted code, with the
    inserted line as its text (carets need columns, which inserted code has none of)."""
    import linecache
    import traceback

    frame, code = tb.tb_frame, tb.tb_frame.f_code
    _, end, col, end_col = _position(code, tb.tb_lasti)
    text = _inserted(tb) if col is None else None
    linecache.lazycache(code.co_filename, frame.f_globals)
    if text is not None:
        return traceback.FrameSummary(code.co_filename, tb.tb_lineno, code.co_name, lookup_line=False,
                                      line=f"{text}  # inserted by source-patch", end_lineno=tb.tb_lineno)
    return traceback.FrameSummary(code.co_filename, tb.tb_lineno, code.co_name, lookup_line=False,
                                  end_lineno=end, colno=col, end_colno=end_col)


def _position(code, lasti: int) -> tuple:
    """(line, end line, column, end column) of the instruction at ``lasti`` (Python 3.10
    has no columns: nothing is told apart there)."""
    if lasti < 0 or not hasattr(code, "co_positions"):
        return (None, None, None, None)
    for i, position in enumerate(code.co_positions()):
        if i == lasti // 2:
            return position
    return (None, None, None, None)


def _inserted(tb) -> str | None:
    """The inserted line a traceback entry stands at, or None: in a patched module, an
    instruction with a line and no columns may be inserted code (linemap._remap); its
    loader tells which line, if any."""
    line, _, col, _ = _position(tb.tb_frame.f_code, tb.tb_lasti)
    if line is None or col is not None:
        return None
    loader = tb.tb_frame.f_globals.get("__loader__")
    if not isinstance(loader, PatchingLoader) or tb.tb_frame.f_code.co_filename != loader.path:
        return None
    try:
        return loader.inserted_line(tb.tb_frame.f_code, tb.tb_lasti)
    except Exception:  # noqa: BLE001 - the file changed or vanished since: its line as usual
        return None


def _is_third_party(fullname: str) -> bool:
    top = fullname.partition(".")[0]
    return top not in sys.stdlib_module_names and top not in _NEVER_BLOCKED


# Imported by site or by us after the hook ran: blocking them only adds confusing noise.
_NEVER_BLOCKED = ("source_patch", "_distutils_hack", "sitecustomize", "usercustomize")


def _fail(error: SourcePatchError, policy: str) -> None:
    if policy == "warn":
        _say(f"source-patch: warning: {error} ({ON_ERROR}=warn: running UNPATCHED)")
        return
    sys.meta_path.insert(0, FailedActivation(error))  # armed before anything that could fail
    _install_hook()
    if policy != "error":
        _say(f"source-patch: {ON_ERROR}={show(policy)} is not 'error' or 'warn': treated as 'error'")
    _say(f"source-patch: error: {error}")


def print_report(activation: Activation) -> None:
    """SOURCE_PATCH_REPORT=1, at exit."""
    _say(f"source-patch report (pid {os.getpid()}):\n{activation.report()}")


def _say(line: str) -> None:
    with contextlib.suppress(Exception):  # no stderr (pythonw), a closed pipe: the finder still stops the run
        print(line, file=sys.stderr, flush=True)


warn_env_after_start()  # the first import of the activation API (activate, patched, the pytest plugin)
