"""Run by the ``source_patch.pth`` start hook when SOURCE_PATCH is set.

The hook line itself is the whole cost when the variable is unset: one
environment lookup.  Set, the boot record's fast path (boot.py) activates the
specs importing nothing new when it can; otherwise the full activation runs and
leaves a record for the next start-up.  Running twice (a second site directory,
a re-exec) is a no-op.
"""

_done = False


def run() -> None:
    global _done
    if _done:
        return
    _done = True
    from . import boot

    if boot.run():
        return
    from .activation import activate_from_env

    activate_from_env(remember=True)
