"""The start hook: what ``source_patch.pth`` runs in an interpreter started with SOURCE_PATCH set.

The hook line itself is the whole cost when the variable is unset: one environment
lookup.  Set, a start-up whose boot record still holds (boot.py) installs a
:class:`BootFinder` that knows only the target names and imports nothing new; the
full patcher loads when a target is first imported (the BootFinder hands over to a
PatchFinder holding the same specs), when the runtime's settings are imported (they
look the activation up in ``sys.modules``), or when the activation API asks for the
installed finder.  Anything else (no record, another text, a moved target, an error
of any kind) runs the full activation, unchanged, which reports what it must and
writes a fresh record.  Running twice (a second site directory, a re-exec) is a no-op.
"""

from __future__ import annotations

import _thread
import os
import sys

from . import boot

_done = False
seen = None  # SOURCE_PATCH as the start-up left it (activation.py tells a later change by it)


def run() -> None:
    global _done, seen
    if _done:
        return
    _done = True
    try:
        if from_record(os.environ):
            return
        from .activation import activate_from_env

        activate_from_env(remember=True)
    finally:
        seen = os.environ.get(boot.ENV, "")


def from_record(environ) -> bool:
    """Activate SOURCE_PATCH from its boot record.  False: nothing was done, and the
    caller runs the full activation (which also reports every error)."""
    try:
        if any(getattr(f, "_source_patch_finder", False) for f in sys.meta_path):
            return False  # a second activation: the full path merges it
        recorded = boot.recorded(environ.get(boot.ENV, ""))
        if recorded is None or any(t in sys.modules for t in recorded.targets):
            return False  # no record, or too late to patch a target: the full path raises (and arms) the error
        environ[boot.ENV] = ",".join(recorded.paths)  # absolute, for children started elsewhere
        reports = environ.get(boot.REPORT_DIR, "").strip()
        if reports:  # the same: every process of a run reports to one folder (activation.observe)
            environ[boot.REPORT_DIR] = os.path.abspath(os.path.expanduser(reports))
        finder = BootFinder(recorded)
        sys.meta_path.insert(0, finder)
        if boot.flag(environ, boot.REPORT):
            import atexit

            atexit.register(finder.report_at_exit)
        return True
    except Exception:  # noqa: BLE001 - whatever it was, the full activation decides and says it
        return False


class BootFinder:
    """First on ``sys.meta_path`` after a boot-record start-up: answers every import
    with one set lookup, and hands over to the full PatchFinder at the first target."""

    _source_patch_finder = True  # locate.py, the activation and a second start-up skip or see it

    def __init__(self, recorded: boot.Recorded):
        self.recorded, self.targets = recorded, recorded.targets
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
        if fullname in boot.HAND_OVER_MODULES and self._busy != _thread.get_ident():
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
