"""``source-patch``: dry-run diffs, anchor checks, listings, and a command wrapper.

Dry runs (diff, check, list) never import the target packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import site
import sys
import sysconfig
from pathlib import Path

from . import spec as spec_mod
from .boot import ENV
from .errors import AnchorError, SourcePatchError, shorten
from .locate import dist_version, find_source
from .requires import unmet, unmet_requirement

_COLORS = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m"}
_RESET = "\033[0m"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except SourcePatchError as exc:
        print(f"source-patch: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `source-patch diff ... | head`
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="source-patch", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name, func, help_text, specs=True, against=True):
        p = sub.add_parser(name, help=help_text, description=help_text)
        if specs:
            p.add_argument("specs", nargs="+", metavar="SPEC", help="spec file or bundled spec name")
        if against:
            p.add_argument("--against", metavar="DIR",
                           help="look for target modules only under DIR (e.g. an unpacked wheel)")
        p.set_defaults(func=func)
        return p

    command("diff", _diff, "print the unified diff each spec makes to its target modules") \
        .add_argument("--color", choices=("auto", "always", "never"), default="auto")
    command("check", _check, "check that every anchor still matches: exit 1 if one does not, "
            "3 if a spec's requirement is unmet")
    command("list", _list, "list specs, their patches, targets and anchors", against=False)
    anchors = command("anchors", _anchors, "list a function's statements, calls and returns with "
                      "their lines, as patterns ready to paste into a spec", specs=False)
    anchors.add_argument("target", metavar="MODULE:QUALNAME", help="e.g. megatron.core.transformer."
                         "moe.router:TopKRouter.routing (or MODULE:<module>)")
    new = command("new", _new, "write a commented skeleton spec", specs=False, against=False)
    new.add_argument("name", help="the spec's name; written to NAME.yaml unless -o is given")
    new.add_argument("--module", help="the module to patch")
    new.add_argument("--target", help="the function or Class.method to patch")
    new.add_argument("-o", "--output", metavar="FILE", help="where to write it ('-': stdout)")
    matrix = command("matrix", _matrix, "check specs against many upstream releases (wheels or "
                     "unpacked dirs); exit 1 if an anchor is broken, 2 if a spec or release is "
                     "unusable", against=False)
    matrix.add_argument("--releases", nargs="+", required=True, metavar="WHEEL_OR_DIR")
    matrix.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': stdout)")
    matrix.add_argument("--write", metavar="FILE", help="also write the table as Markdown (docs/compat.md)")
    run = command("run", _run, "run a command with SOURCE_PATCH set to the given specs",
                  specs=False, against=False)
    run.add_argument("-s", "--spec", action="append", required=True, dest="specs", metavar="SPEC")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args...]")
    hook = command("hook", _hook, "install, remove or show the start hook of this interpreter "
                   "(wheel installs have it; editable installs need 'hook install')",
                   specs=False, against=False)
    hook.add_argument("action", choices=("install", "uninstall", "status"))

    def delegated(name, func, help_text):
        """A command whose own parser, imported only when it runs, reads every argument
        (`--help` too): prefix_chars no argument starts with passes options through."""
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        p.add_argument("args", nargs="*")
        p.set_defaults(func=func)

    delegated("compare", _compare, "compare rollout (SGLang) and training (Megatron) dumps layer by layer; "
              "exit 1 past the threshold, 2 if they cannot be compared (see docs/compare.md)")
    delegated("replay", _replay, "replay a rollout's tokens through the Megatron twin of its checkpoint under "
              "the dump spec: training-side dumps, then compare if asked (see docs/compare.md)")
    settings = command("settings", _settings, "print every runtime setting (key, environment variable, "
                       "default, meaning) as Markdown", specs=False, against=False)
    settings.add_argument("--write", metavar="FILE", help="write it to FILE instead (docs/settings.md)")
    return parser


def _settings(args) -> int:
    from source_patch.runtime.core.settings_doc import markdown

    if args.write:
        Path(args.write).write_text(markdown(), encoding="utf-8")
    else:
        sys.stdout.write(markdown())
    return 0


def _compare(args) -> int:
    from source_patch.runtime.dump import compare  # torch: only this command pays for it

    return compare.main(args.args, prog="source-patch compare")


def _replay(args) -> int:
    from source_patch.runtime import replay  # light; its worker process imports Megatron

    return replay.main(args.args, prog="source-patch replay")


def _load_all(refs: list[str]) -> list[spec_mod.Spec]:
    return [spec_mod.load(r) for r in refs]


def _by_module(specs: list[spec_mod.Spec], against: str | None,
               gated: list | None = None) -> dict[str, list[spec_mod.Patch]]:
    """Patches by target module, leaving out (into ``gated``) those whose own
    ``requires`` the installed (or ``against``) upstream does not meet."""
    out: dict[str, list[spec_mod.Patch]] = {}
    for s in specs:
        for p in s.patches:
            reason = unmet(p.requires, against)
            if reason:
                if gated is not None:
                    gated.append((p, reason))
                continue
            out.setdefault(p.module, []).append(dataclasses.replace(p, on_drift="error"))
    return out


def _rewrite(module: str, patches, against: str | None):
    from .engine import rewrite  # imports libcst: only commands that rewrite pay for it

    path = find_source(module, against)
    source = path.read_text(encoding="utf-8")
    top = module.partition(".")[0]
    result = rewrite(source, patches, module=module, file=str(path),
                     version=lambda: dist_version(top, against))
    return path, source, result


def _diff(args) -> int:
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    status = 0
    for module, patches in _by_module(_load_all(args.specs), args.against).items():
        try:
            path, source, result = _rewrite(module, patches, args.against)
        except SourcePatchError as exc:
            print(f"source-patch: {exc}", file=sys.stderr)
            status = 1
            continue
        rel = _relative(path, module)
        lines = difflib.unified_diff(source.splitlines(True), result.source.splitlines(True),
                                     f"a/{rel}", f"b/{rel}")
        for line in lines:
            if not line.endswith("\n"):
                line += "\n"
            if color and line[:1] in _COLORS and not line.startswith(("+++", "---")):
                line = _COLORS[line[0]] + line.rstrip("\n") + _RESET + "\n"
            sys.stdout.write(line)
    return status


def _relative(path: Path, module: str) -> str:
    """``megatron/core/.../moe_utils.py``: the path as the package lays it out."""
    depth = module.count(".") + 1 + (path.name == "__init__.py")
    return "/".join(path.parts[-depth:])


BROKEN, UNMET = 1, 3  # exit codes of check (2: a bad spec or usage, as every command)


def _check(args) -> int:
    status = 0
    specs = _load_all(args.specs)
    for s in specs:
        problem = unmet_requirement(s, args.against)
        ok = "requirements met" if s.requires else "no requirements"
        print(f"spec {shorten(s.name)} ({shorten(s.file)}): {problem or ok}")
        if problem and s.on_unmet == "error":
            status = UNMET
    gated: list = []
    by_module = _by_module(specs, args.against, gated)
    for patch, reason in gated:
        print(f"gated {shorten(patch.id)} ({shorten(patch.module)}): {reason}")
    for module, patches in by_module.items():
        try:
            path, _, result = _rewrite(module, patches, args.against)
        except AnchorError as exc:
            print(f"FAIL {exc}")
            status = BROKEN
            continue
        except SourcePatchError as exc:
            print(f"FAIL {shorten(module)}: {exc}")
            status = BROKEN
            continue
        print(f"ok   {shorten(module)} ({path}, {dist_version(module.partition('.')[0], args.against)})")
        for patch, edit, lines in result.hits:
            print(f"       {shorten(patch.id)}: {edit.describe()} -> line{'s' if len(lines) > 1 else ''} "
                  f"{', '.join(map(str, lines))}")
    return status


def _anchors(args) -> int:
    from .authoring import anchors

    print(anchors(args.target, args.against))
    return 0


def _new(args) -> int:
    from .authoring import skeleton

    text = skeleton(args.name, args.module, args.target)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.output or f"{args.name}.yaml")
    try:
        with open(path, "x", encoding="utf-8") as f:  # never overwrite someone's spec
            f.write(text)
    except FileExistsError:
        raise SourcePatchError(f"{path} exists; choose another name or -o FILE") from None
    print(f"wrote {path}; check it with: source-patch check {path}")
    return 0


def _matrix(args) -> int:
    from . import matrix

    specs = _load_all(args.specs)
    releases, grid = matrix.run(specs, args.releases, matrix.progress_bar())
    text = matrix.table(specs, releases, grid)
    print(text)
    if args.json == "-":
        sys.stdout.write(matrix.as_json(specs, releases, grid) + "\n")
    try:
        if args.write:
            Path(args.write).write_text(_COMPAT_HEAD + text + "\n", encoding="utf-8")
        if args.json and args.json != "-":
            Path(args.json).write_text(matrix.as_json(specs, releases, grid))
    except OSError as exc:  # a missing folder: an error line, not a traceback
        raise SourcePatchError(f"cannot write {shorten(exc.filename)}: {exc.strerror or exc}") from None
    return matrix.exit_code(grid)


_COMPAT_HEAD = """# Compatibility: shipped specs x upstream releases

Written by `make compat` (`source-patch matrix`); do not edit by hand. A row per
release, a column per spec; a cell counts the spec's patches that target that release: `ok n/m` n apply (the others are `gated`: left
out by their own `requires`, usually because an alternative patch covers that release),
`BROKEN` an anchor no longer matches, `refused` the spec's own `requires` excludes the
release, `-` the spec has no patch for that framework. The reasons follow the table.
Upstream's own test suites run plain and under every spec configuration:
[upstream_tests.md](upstream_tests.md).

"""


def _list(args) -> int:
    for s in _load_all(args.specs):
        print(f"{shorten(s.name)}  ({shorten(s.file)})")
        if s.description:
            print(f"  {s.description.strip()}")
        for dist, wanted in s.requires:
            print(f"  requires {dist}{wanted} (on_unmet: {s.on_unmet})")
        for p in s.patches:
            print(f"  {shorten(p.id)}: {shorten(p.module)}:{shorten(p.target)}")
            for e in p.edits:
                count = "" if e.at == "entry" else f" (count: {'all' if e.count is None else e.count})"
                print(f"    {e.describe()}{count}")
    return 0


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("source-patch run: give a command after --", file=sys.stderr)
        return 2
    specs = _load_all(args.specs)  # fail now, not in the child
    if not _hook_installed():
        print("source-patch run: warning: the source_patch.pth start hook is not installed in "
              f"{sys.prefix}; only interpreters that have it will be patched", file=sys.stderr)
    env = dict(os.environ, **{ENV: ",".join(s.file for s in specs)})
    os.execvpe(command[0], command, env)


HOOK_FILE = "source_patch.pth"


def _hook_paths() -> list[Path]:
    dirs = site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()["purelib"]]
    return [Path(d, HOOK_FILE) for d in dict.fromkeys(dirs)]


def _hook_installed() -> bool:
    return any(p.exists() for p in _hook_paths())


def _hook(args) -> int:
    installed = [p for p in _hook_paths() if p.exists()]
    if args.action == "status":
        print("\n".join(f"installed: {p}" for p in installed) or f"not installed in {sys.prefix}")
        return 0 if installed else 1
    if args.action == "uninstall":
        for p in installed:
            p.unlink()
            print(f"removed {p}")
        return 0
    if not installed:
        target = Path(sysconfig.get_paths()["purelib"], HOOK_FILE)
        target.write_text((Path(__file__).parent / HOOK_FILE).read_text())
        installed = [target]
    print(f"installed: {installed[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
