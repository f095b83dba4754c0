"""What every ``source-patch`` command line shares (docs/cli.md): the exit codes, the one
error line (and, under ``--json``, the error as JSON on stdout), the parser whose own
usage errors follow both, and how a command is printed so that it runs as printed.

The verbs of the patcher's CLI and the runtime's tools (``compare``, ``replay``,
``dumps``, ``trace``, ``stream-status``, also run as ``python -m ...``) all say things
the same way through here.  Standard library only: every CLI imports it first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

OK, FINDINGS, USAGE, UNMET = 0, 1, 2, 3
EXIT_CODES = (
    (OK, "ok"),
    (FINDINGS, "findings: an anchor no longer matches (check, diff, matrix), dumps diverge past --rtol "
               "(compare, replay), a corrupt feature stream (stream-status), no start hook (hook status)"),
    (USAGE, "a usage error or input that cannot be used: a bad spec or option, a missing or unreadable "
            "file or folder, a report that cannot be written"),
    (UNMET, "a spec's requirement is unmet here: the import would fail or skip it (check, diff)"),
)
EPILOG = "exit codes (every command):\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES) + \
         "\n  `run` exits with its command's code (127: not found, 126: not runnable)"
SCRIPT = "source-patch"


def error(message, *, as_json: bool = False, code: int = USAGE) -> int:
    """Say an error: one line ``source-patch: error: ...`` on stderr and, with ``--json``,
    ``{"error": ..., "exit": code}`` on stdout too (a tool reading stdout sees why it got
    no result).  Returns ``code``, the command's exit code."""
    text = str(message).strip() or type(message).__name__
    print(f"{SCRIPT}: error: {text}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps({"error": text, "exit": code}), flush=True)
    return code


def note(message: str, kind: str = "note") -> None:
    """A line on stderr that is not an error (``note``, ``warning``), with the same prefix."""
    print(f"{SCRIPT}: {kind}: {message}", file=sys.stderr, flush=True)


def first_line(message, limit: int = 500) -> str:
    """An exception or text as one line of at most ``limit`` characters (a traceback's
    worth of text would bury what to do)."""
    lines = str(message).strip().splitlines() or [type(message).__name__]
    return lines[0] if len(lines[0]) <= limit else lines[0][:limit - 3] + "..."


# ---- how a printed command starts

def executable() -> list:
    """The words that run ``source-patch`` from a fresh shell, where this process runs it.

    One rule: the bare name only where a new shell finds this very script on PATH, that is
    outside a virtual environment (activating one lasts one shell) and where PATH's
    ``source-patch`` is the script next to this interpreter; otherwise that script's path,
    relative when it is under the current folder (``.venv/bin/source-patch``); and without
    such a script (a source tree on sys.path), this interpreter running the package."""
    script = Path(sys.executable).parent / SCRIPT  # not resolved: a venv's python is a link out of it
    if not script.is_file():
        return [SCRIPT] if shutil.which(SCRIPT) else [sys.executable, "-m", "source_patch.patcher"]
    found = shutil.which(SCRIPT)
    in_venv = sys.prefix != sys.base_prefix
    if not in_venv and found and os.path.samefile(found, script):
        return [SCRIPT]
    return [_shown(script)]


def _shown(path: Path) -> str:
    """``path`` relative to the current folder when it is under it, else absolute; a
    relative path keeps a slash (a bare name would be looked up on PATH)."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    if relative.startswith(os.pardir):
        return absolute
    return relative if os.sep in relative else os.path.join(os.curdir, relative)


def command(verb: str, *args) -> str:
    """The shell command that runs ``source-patch VERB ARGS...``, quoted, as printed."""
    return shlex.join([*executable(), verb, *map(str, args)])


# ---- the parser

class Parser(argparse.ArgumentParser):
    """argparse with the shared grammar: a usage error is ``source-patch: error: ...`` (and
    JSON on stdout when ``--json`` was given), exit 2; the exit codes in every ``--help``;
    and on a parser that has ``--json-out``, the old spelling ``--json FILE`` still works
    with a warning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("epilog", EPILOG)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.wants_json = False

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self.wants_json = "--json" in args
        if "--json-out" in self._option_string_actions:
            args = _renamed_json_out(args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.print_usage(sys.stderr)
        sys.exit(error(message, as_json=self.wants_json))


def _renamed_json_out(args: list) -> list:
    """``--json FILE.json`` / ``--json=FILE`` (before, ``--json`` took a file on compare,
    replay and matrix) as ``--json-out FILE``; ``--json -`` (matrix: stdout) as ``--json``."""
    out, i = [], 0
    while i < len(args):
        word, following = args[i], args[i + 1] if i + 1 < len(args) else None
        if word.startswith("--json="):
            out += _json_out(word.partition("=")[2])
        elif word == "--json" and following is not None and (following == "-" or following.endswith(".json")):
            out += _json_out(following)
            i += 1
        else:
            out.append(word)
        i += 1
    return out


def _json_out(target: str) -> list:
    if target == "-":
        note("--json - is now --json (JSON on stdout)", "warning")
        return ["--json"]
    note(f"--json {target} is now --json-out {target} (--json alone prints JSON on stdout)", "warning")
    return ["--json-out", target]
