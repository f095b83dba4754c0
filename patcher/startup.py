"""Run by the ``source_patch.pth`` start hook when SOURCE_PATCH is set.

The hook line itself is the whole cost when the variable is unset: one
environment lookup.  Running twice (a second site directory, a re-exec) is a
no-op.
"""

_done = False


def run() -> None:
    global _done
    if _done:
        return
    _done = True
    from .activation import activate_from_env

    activate_from_env()
