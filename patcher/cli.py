"""``source-patch``: dry-run diffs, anchor checks, listings, and a command wrapper.

Dry runs (diff, check, list) never import the target packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import site
import sys
import sysconfig
from pathlib import Path

from . import spec as spec_mod
from typing import NamedTuple

from .boot import ENV, STRICT, switch
from .errors import AnchorError, SourcePatchError, printable, shorten
from .locate import dist_version, find_source_hinted
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
    parser.add_argument("--version", action="version", version=f"source-patch {_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name, func, help_text, specs=True, against=True):
        p = sub.add_parser(name, help=help_text, description=help_text)
        if specs:
            p.add_argument("specs", nargs="+", metavar="SPEC", help="spec file or bundled spec name")
        if against:
            p.add_argument("--against", metavar="DIR", type=_directory,
                           help="look for target modules only under DIR (e.g. an unpacked wheel)")
        p.set_defaults(func=func)
        return p

    command("diff", _diff, "print the unified diff each spec makes to its target modules") \
        .add_argument("--color", choices=("auto", "always", "never"), default="auto")
    command("check", _check, "check that every anchor still matches: exit 1 if one does not, "
            "3 if a spec's requirement is unmet (the import would fail or skip it)") \
        .add_argument("--json", action="store_true", help="one JSON object instead of lines")
    command("list", _list, "list specs, their patches, targets and anchors", against=False) \
        .add_argument("--json", action="store_true", help="a JSON list instead of lines")
    anchors = command("anchors", _anchors, "list a function's statements, calls and returns with "
                      "their lines, as patterns ready to paste into a spec", specs=False)
    anchors.add_argument("target", metavar="MODULE:QUALNAME", help="e.g. megatron.core.transformer."
                         "moe.router:TopKRouter.routing (or MODULE:<module>)")
    anchors.add_argument("--json", action="store_true", help="one JSON object (line, pattern, matches per anchor)")
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
    delegated("dumps", _dumps, "summarise a dump directory (python -m source_patch.runtime.dump.reader)")
    delegated("trace", _trace, "record a live trace stream, or read a recording back "
              "(python -m source_patch.runtime.trace.client)")
    delegated("stream-status", _stream_status, "the feature stream's counts "
              "(python -m source_patch.runtime.features.stream status)")
    completion = command("completion", _completion, "print a shell completion script: "
                         "eval \"$(source-patch completion bash)\"", specs=False, against=False)
    completion.add_argument("shell", choices=("bash",))
    settings = command("settings", _settings, "print every runtime setting (key, environment variable, "
                       "default, meaning) as Markdown", specs=False, against=False)
    settings.add_argument("--write", metavar="FILE", help="write it to FILE instead (docs/settings.md)")
    native = command("build-native", _build_native, "compile the trace's native launch for this torch "
                     "(the setting trace.triton_launch: native; a C++ compiler, nothing downloaded)",
                     specs=False, against=False)
    native.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    return parser


def _build_native(args) -> int:
    from source_patch.runtime.trace import native  # torch: only this command pays for it

    if native.load() is not None:
        print(f"already built: {native.build_dir()}")
        return 0
    print(f"compiling {native.SOURCE.name} against torch into {native.build_dir()} (~20 s)",
          file=sys.stderr, flush=True)
    try:
        print(f"built {native.build(args.verbose)}")
    except native.BuildError as exc:
        print(f"source-patch build-native: {exc}", file=sys.stderr)
        return 2
    return 0


def _settings(args) -> int:
    from source_patch.runtime.core.settings_doc import markdown

    if args.write:
        _write_file(args.write, markdown())
    else:
        sys.stdout.write(markdown())
    return 0


def _write_file(path: str, text: str) -> None:
    """An output the user named, written whole (core/private.write_file): a FIFO, a folder
    or a device there is refused at once instead of hanging or being replaced."""
    from source_patch.runtime.core.private import write_file

    try:
        write_file(path, text.encode("utf-8"))
    except OSError as exc:
        raise SourcePatchError(f"cannot write {shorten(path)}: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    """An OSError's reason without the path it may repeat."""
    return exc.strerror or shorten(exc)


def _compare(args) -> int:
    from source_patch.runtime.dump import compare  # torch: only this command pays for it

    return compare.main(args.args, prog="source-patch compare")


def _dumps(args) -> int:
    from source_patch.runtime.dump import reader

    return reader.main(args.args, prog="source-patch dumps")


def _trace(args) -> int:
    from source_patch.runtime.trace import client

    return client.main(args.args, prog="source-patch trace")


def _stream_status(args) -> int:
    from source_patch.runtime.features import stream

    return stream.main(["status", *args.args], prog="source-patch stream-status")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("source-patch")
    except metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "(not installed)"


_BASH = """_source_patch() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}}
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{commands} --version --help" -- "$cur"))
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "--help --against --json --color" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o filenames -F _source_patch source-patch
"""


def _completion(args) -> int:
    """Commands from the parser itself, so the script never lists a stale one."""
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    sys.stdout.write(_BASH.format(commands=" ".join(commands)))
    return 0


def _replay(args) -> int:
    from source_patch.runtime import replay  # light; its worker process imports Megatron

    return replay.main(args.args, prog="source-patch replay")


def _load_all(refs: list[str]) -> list[spec_mod.Spec]:
    return [spec_mod.load(r) for r in refs]


class _Plan(NamedTuple):
    """What an import of the installed (or ``against``) upstream would do with the specs."""

    by_module: dict  # module -> the patches that apply to it (on_drift: error, to see every problem)
    notes: list  # one line per spec or patch left out, with its reason
    unmet: bool  # a spec's own requires is unmet, or (strict) a module gets none of a spec's patches


def _directory(path: str) -> str:
    """--against: a folder (a wheel file is read by ``matrix``, or unpack it first)."""
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a directory"
        hint = (f"; unpack the wheel first (python -m zipfile -e {path} DIR) or give it to "
                "`source-patch matrix`") if path.endswith(".whl") else ""
        raise argparse.ArgumentTypeError(f"{path} {what}{hint}")
    return path


def _plan(specs: list[spec_mod.Spec], against: str | None) -> _Plan:
    """Patches by target module, as the import decides them: a spec whose own ``requires``
    is unmet is left out (on_unmet: error makes the import fail), and a patch whose own
    ``requires`` is unmet is gated; when that leaves a module none of a spec's patches,
    the import warns (an error under SOURCE_PATCH_STRICT=1)."""
    by_module: dict[str, list[spec_mod.Patch]] = {}
    notes, unmet_any, strict = [], False, _strict()
    for s in specs:
        problem = unmet_requirement(s, against)
        if problem:
            effect = "importing a target fails" if s.on_unmet == "error" else "skipped"
            notes.append(f"skipped spec {shorten(s.name)} ({shorten(s.file)}): {problem} "
                         f"(on_unmet: {s.on_unmet}: {effect})")
            unmet_any = True
        mine: dict[str, list] = {}
        for p in s.patches:
            mine.setdefault(p.module, []).append((p, unmet(p.requires, against)))
        for module, patches in mine.items():
            applies = [dataclasses.replace(p, on_drift="error") for p, reason in patches if not reason]
            word = "gated" if applies or problem else "skipped"  # skipped: the import says so
            notes += [f"{word} {shorten(p.id)} ({shorten(module)}): {reason}" for p, reason in patches if reason]
            if problem:
                continue
            if applies:
                by_module.setdefault(module, []).extend(applies)
            elif strict:
                unmet_any = True
    return _Plan(by_module, notes, unmet_any)


def _strict() -> bool:
    """SOURCE_PATCH_STRICT as the import reads it; a value that is neither on nor off is an error."""
    try:
        return switch(os.environ, STRICT)
    except ValueError as exc:
        raise SourcePatchError(str(exc)) from None


def _rewrite(module: str, patches, against: str | None):
    from .engine import rewrite  # imports libcst: only commands that rewrite pay for it

    path = find_source_hinted(module, against)
    source = path.read_text(encoding="utf-8")
    top = module.partition(".")[0]
    result = rewrite(source, patches, module=module, file=str(path),
                     version=lambda: dist_version(top, against))
    return path, source, result


def _diff(args) -> int:
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    plan = _plan(_load_all(args.specs), args.against)
    for note in plan.notes:
        print(f"source-patch: {note}", file=sys.stderr)
    status = UNMET if plan.unmet else 0
    for module, patches in plan.by_module.items():
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


BROKEN, UNMET = 1, 3  # exit codes of check and diff (2: a bad spec or usage, as every command)


def _check(args) -> int:
    specs = _load_all(args.specs)
    plan = _plan(specs, args.against)
    status = UNMET if plan.unmet else 0
    modules = []
    for module, patches in plan.by_module.items():
        modules.append(_check_module(module, patches, args.against))
        status = BROKEN if modules[-1]["error"] else status
    report = {"specs": [{"name": s.name, "file": s.file, "unmet": unmet_requirement(s, args.against)}
                        for s in specs], "notes": plan.notes, "modules": modules, "exit": status}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_check(specs, report)
    return status


def _check_module(module: str, patches, against: str | None) -> dict:
    """One module's verdict: where each edit lands, or the error."""
    out = {"module": module, "error": None, "path": None, "version": None, "hits": []}
    try:
        path, _, result = _rewrite(module, patches, against)
    except AnchorError as exc:
        out["error"] = str(exc)
        return out
    except SourcePatchError as exc:
        out["error"] = f"{shorten(module)}: {exc}"
        return out
    out.update(path=str(path), version=dist_version(module.partition(".")[0], against),
               hits=[{"patch": p.id, "edit": e.describe(), "lines": lines} for p, e, lines in result.hits])
    return out


def _print_check(specs, report: dict) -> None:
    for s, row in zip(specs, report["specs"]):
        ok = "requirements met" if s.requires else "no requirements"
        print(f"spec {shorten(s.name)} ({shorten(s.file)}): {row['unmet'] or ok}")
    for note in report["notes"]:
        print(note)
    for m in report["modules"]:
        if m["error"]:
            print(f"FAIL {m['error']}")
            continue
        print(f"ok   {shorten(m['module'])} ({m['path']}, {m['version']})")
        for hit in m["hits"]:
            lines = hit["lines"]
            print(f"       {shorten(hit['patch'])}: {hit['edit']} -> line{'s' if len(lines) > 1 else ''} "
                  f"{', '.join(map(str, lines))}")


def _anchors(args) -> int:
    from .authoring import anchors

    result = anchors(args.target, args.against, as_json=args.json)
    print(json.dumps(result, indent=1) if args.json else result)
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
    except FileExistsError:  # O_EXCL: a FIFO, a link or a folder there is refused the same way
        raise SourcePatchError(f"{shorten(path)} exists; choose another name or -o FILE") from None
    except OSError as exc:  # a missing folder, no permission
        raise SourcePatchError(f"cannot write {shorten(path)}: {_reason(exc)}") from None
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
    if args.write:
        _write_file(args.write, _COMPAT_HEAD + text + "\n")
    if args.json and args.json != "-":
        _write_file(args.json, matrix.as_json(specs, releases, grid))
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
    specs = _load_all(args.specs)
    if args.json:
        print(json.dumps([_spec_json(s) for s in specs], indent=1))
        return 0
    for s in specs:
        print(f"{shorten(s.name)}  ({printable(shorten(s.file))})")
        for line in s.description.strip().splitlines():
            print(f"  {printable(line)}")
        for dist, wanted in s.requires:
            print(f"  requires {printable(shorten(dist))}{printable(wanted)} (on_unmet: {s.on_unmet})")
        for p in s.patches:
            print(f"  {shorten(p.id)}: {shorten(p.module)}:{shorten(p.target)}")
            for e in p.edits:
                print(f"    {e.describe()}{'' if e.at == 'entry' else f' (count: {_count(e)})'}")
    return 0


def _count(edit) -> str:
    return "all" if edit.count is None else str(edit.count)


def _spec_json(s: spec_mod.Spec) -> dict:
    return {"name": s.name, "file": s.file, "description": s.description, "requires": dict(s.requires),
            "on_unmet": s.on_unmet,
            "patches": [{"id": p.id, "module": p.module, "target": p.target, "requires": dict(p.requires),
                         "edits": [{"at": e.at, "anchor": e.describe(), "count": _count(e)} for e in p.edits]}
                        for p in s.patches]}


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
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:  # the shell's codes: 127 not found, 126 found but not runnable
        print(f"source-patch run: cannot run {printable(shorten(command[0]))}: {_reason(exc)}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


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
