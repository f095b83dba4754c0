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

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Iterable, Iterator

from . import boot
from . import spec as spec_mod
from .boot import ENV, ON_ERROR, REPORT, STRICT, flag, split_refs, switch
from .cache import CodeCache
from .errors import ActivationError, NotActivatedError, SourcePatchError, SourcePatchWarning, shorten, show
from .finder import PatchFinder, PatchingLoader
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


_PATCHER_VARIABLES = frozenset((REPORT, STRICT, ON_ERROR, boot.CACHE_ENV, boot.CHECK_ENV))


def environment_error(environ=os.environ) -> ActivationError | None:
    """SOURCE_PATCH_STRICT and every ``SOURCE_PATCH_<COMPONENT>_<KEY>`` checked at
    activation, so that a bad value stops the job at once with one line instead of a
    traceback at its first call site (settings.environ_errors)."""
    errors = []
    if any(name.startswith("SOURCE_PATCH_") and name not in _PATCHER_VARIABLES for name in environ):
        errors = spec_mod.settings_errors(environ)  # else no import of the schemas (~5 ms)
    try:
        switch(environ, STRICT)
    except ValueError as exc:
        errors.insert(0, str(exc))
    return ActivationError("; ".join(errors)) if errors else None


def _finder(cache_dir: str | os.PathLike | None) -> PatchFinder:
    finder = installed_finder()
    if finder is None:
        finder = PatchFinder(CodeCache(Path(cache_dir) if cache_dir else None))
        sys.meta_path.insert(0, finder)
    return finder


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
        warnings.warn(f"source-patch: {reason}", SourcePatchWarning, stacklevel=3)


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
            found = None
            near = nearest_modules(error)
            message = (f"{patches[0].location}: spec {s.name!r} patches {shorten(module)}, which cannot "
                       f"be found ({error}); nearest: {', '.join(near) if near else 'none'}")
            if strict:
                raise ActivationError(message)
            warnings.warn(f"source-patch: {message} ({STRICT}=1 makes this an error)",
                          SourcePatchWarning, stacklevel=3)
    return found


def _gated(requires) -> bool:
    return any(installed_version(dist) is None for dist, _ in requires)


def report(finder: PatchFinder, specs: list[spec_mod.Spec]) -> str:
    """What applied, what was skipped and why, and targets never imported."""
    lines = []
    skipped = {id(k.patch): k.reason for k in finder.skipped}
    for s in specs:
        lines.append(f"spec {s.name} ({s.file}):")
        for p in s.patches:
            if id(p) in skipped:
                state = f"skipped: {skipped[id(p)].splitlines()[0]}"
            elif p.module in finder.imported:
                state = "applied"
            else:
                state = "not imported"
            lines.append(f"  {p.id} ({p.module}): {state}")
    return "\n".join(lines)


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


def _trimmed_hook(previous):
    """sys.excepthook showing a NotActivatedError with the user's frames only: the
    import statement that was refused, not importlib's frames and ours."""

    def hook(kind, value, tb):
        if isinstance(value, NotActivatedError):
            tb = _user_frames(tb)
            value = value.with_traceback(tb)
        previous(kind, value, tb)

    hook.source_patch = True
    return hook


_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frames(tb):
    """The traceback without importlib's frames and this package's own."""
    import types

    kept = []
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith("<frozen importlib") or name.startswith(_OURS)):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for frame in reversed(kept):
        out = types.TracebackType(out, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return out


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
    if not getattr(sys.excepthook, "source_patch", False):
        sys.excepthook = _trimmed_hook(sys.excepthook)
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
