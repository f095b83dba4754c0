"""``source-patch``: dry-run diffs, anchor checks, listings, and a command wrapper.

Dry runs (diff, check, list) never import the target packages.  Every verb speaks one
grammar (docs/cli.md, runtime/core/commands.py): ``--json`` is JSON on stdout (errors
too), ``--json-out FILE`` a JSON file, one error prefix, one table of exit codes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shlex
import site
import sys
import sysconfig
from pathlib import Path

from . import spec as spec_mod
from typing import NamedTuple

from ..runtime.core import commands
from ..runtime.core.commands import UNMET
from .boot import BUNDLED_DIR, ENV, OLD_SPEC_NAMES, STRICT, switch
from .errors import AnchorError, SourcePatchError, printable, shorten
from .locate import dist_version, find_source_hinted
from .requires import unmet, unmet_requirement

_COLORS = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m"}
_RESET = "\033[0m"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except SourcePatchError as exc:  # a bad spec, an unusable input: exit 2, as JSON too under --json
        return commands.error(exc, as_json=getattr(args, "json", False) is True)
    except BrokenPipeError:  # `source-patch diff ... | head`
        return 0


JSON_HELP = "JSON on stdout instead of text (an error too: {\"error\": ..., \"exit\": N})"


def _parser() -> argparse.ArgumentParser:
    parser = commands.Parser(prog="source-patch", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=f"source-patch {_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name, func, help_text, specs=True, against=True, json_flag=False):
        p = sub.add_parser(name, help=help_text, description=help_text)
        if specs:
            p.add_argument("specs", nargs="+", metavar="SPEC", help="spec file or bundled spec name")
        if against:
            p.add_argument("--against", metavar="DIR", type=_directory,
                           help="look for target modules only under DIR (e.g. an unpacked wheel)")
        if json_flag:
            p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(func=func)
        return p

    command("diff", _diff, "print the unified diff each spec makes to its target modules; exit 1 if an "
            "anchor does not match, 3 if a spec's requirement is unmet", json_flag=True) \
        .add_argument("--color", choices=("auto", "always", "never"), default="auto")
    command("check", _check, "check that every anchor still matches: exit 1 if one does not, "
            "3 if a spec's requirement is unmet (the import would fail or skip it)", json_flag=True)
    command("list", _list, "list specs, their patches, targets and anchors", against=False, json_flag=True)
    anchors = command("anchors", _anchors, "list a function's statements, calls and returns with "
                      "their lines, as patterns ready to paste into a spec", specs=False, json_flag=True)
    anchors.add_argument("target", metavar="MODULE:QUALNAME", help="e.g. megatron.core.transformer."
                         "moe.router:TopKRouter.routing (or MODULE:<module>)")
    new = command("new", _new, "write a commented skeleton spec", specs=False, against=False)
    new.add_argument("name", help="the spec's name; written to NAME.yaml unless -o is given")
    new.add_argument("--module", help="the module to patch")
    new.add_argument("--target", help="the function or Class.method to patch")
    new.add_argument("-o", "--output", metavar="FILE", help="where to write it ('-': stdout)")
    matrix = command("matrix", _matrix, "check specs against many upstream releases (wheels or "
                     "unpacked dirs); exit 1 if an anchor is broken, 2 if a spec or release is "
                     "unusable", against=False, json_flag=True)
    matrix.add_argument("--releases", nargs="+", required=True, metavar="WHEEL_OR_DIR")
    matrix.add_argument("--json-out", metavar="FILE", help="also write the results as JSON to FILE")
    matrix.add_argument("--write", metavar="FILE", help="also write the table as Markdown (docs/compat.md)")
    run = command("run", _run, "run a command with SOURCE_PATCH set to the given specs",
                  specs=False, against=False)
    run.add_argument("-s", "--spec", action="append", required=True, dest="specs", metavar="SPEC")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args...]")
    hook = command("hook", _hook, "install, remove or show the start hook of this interpreter "
                   "(wheel installs have it; editable installs need 'hook install'); "
                   "status exits 1 where it is not installed", specs=False, against=False)
    hook.add_argument("action", choices=("install", "uninstall", "status"))
    command("report", _report, "collect the patch reports a run's processes wrote to RUN_DIR "
            "(SOURCE_PATCH_REPORT_DIR): which patches applied in which process, which were skipped and "
            "why (docs/reports.md); exit 2 if it holds none", specs=False, against=False, json_flag=True) \
        .add_argument("folder", metavar="RUN_DIR", help="the folder SOURCE_PATCH_REPORT_DIR named")

    def delegated(name, func, help_text, parser_of):
        """A command whose own parser, imported only when it runs, reads every argument
        (`--help` too): prefix_chars no argument starts with passes options through.
        ``parser_of()`` is that parser, for the completion scripts."""
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        p.add_argument("args", nargs="*")
        p.set_defaults(func=func, parser_of=parser_of)

    delegated("compare", _compare, "compare rollout (SGLang) and training (Megatron) dumps layer by layer; "
              "exit 1 past the threshold, 2 if they cannot be compared (see docs/compare.md)", _compare_parser)
    delegated("replay", _replay, "replay a rollout's tokens through the Megatron twin of its checkpoint under "
              "the dump spec: training-side dumps, then compare if asked (see docs/compare.md)", _replay_parser)
    delegated("dumps", _dumps, "summarise a dump directory (python -m source_patch.runtime.dump.reader)",
              _dumps_parser)
    delegated("trace", _trace, "record a live trace stream, or read a recording back "
              "(python -m source_patch.runtime.trace.client)", _trace_parser)
    delegated("stream-status", _stream_status, "the feature stream's counts; exit 1 if the stream is corrupt "
              "(python -m source_patch.runtime.features.stream status)", _stream_status_parser)
    delegated("watch", _watch, "print a sentinels run folder: every rank's events in time order and the "
              "metrics' last values; --follow until Ctrl-C; exit 1 if there are events (see docs/sentinels.md)",
              _watch_parser)
    completion = command("completion", _completion, "print a shell completion script: "
                         "eval \"$(source-patch completion bash)\" (zsh: the same after compinit; "
                         "fish: source-patch completion fish | source)", specs=False, against=False)
    completion.add_argument("shell", choices=tuple(_SHELLS))
    settings = command("settings", _settings, "print every runtime setting (key, environment variable, "
                       "default, meaning) as Markdown", specs=False, against=False)
    settings.add_argument("--write", metavar="FILE", help="write it to FILE instead (docs/settings.md)")
    settings.add_argument("--json", action="store_true", help=JSON_HELP)
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
        return commands.error(f"build-native: {exc}")
    return 0


def _settings(args) -> int:
    from source_patch.runtime.core.settings_doc import as_json, markdown

    text = json.dumps(as_json(), indent=1) + "\n" if args.json else markdown()
    if args.write:
        _write_file(args.write, text)
    else:
        sys.stdout.write(text)
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
    from source_patch.runtime.verdict import compare  # torch: only when it compares

    return compare.main(args.args, prog="source-patch compare")


def _compare_parser():
    from source_patch.runtime.verdict import compare

    return compare.parser("source-patch compare")


def _dumps(args) -> int:
    from source_patch.runtime.dump import reader

    return reader.main(args.args, prog="source-patch dumps")


def _dumps_parser():
    from source_patch.runtime.dump import reader

    return reader.parser("source-patch dumps")


def _trace(args) -> int:
    from source_patch.runtime.trace import client

    return client.main(args.args, prog="source-patch trace")


def _trace_parser():
    from source_patch.runtime.trace import client

    return client.parser("source-patch trace")


def _stream_status(args) -> int:
    from source_patch.runtime.features import stream

    return stream.main(["status", *args.args], prog="source-patch stream-status")


def _stream_status_parser():
    from source_patch.runtime.features import stream

    return _subparsers(stream.parser("source-patch stream-status"))["status"]


def _watch(args) -> int:
    from source_patch.runtime.sentinels import watch

    return watch.main(args.args, prog="source-patch watch")


def _watch_parser():
    from source_patch.runtime.sentinels import watch

    return watch.parser("source-patch watch")


def _replay_parser():
    from source_patch.runtime.verdict import replay

    return replay.parser("source-patch replay")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("source-patch")
    except metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "(not installed)"


# ---- completion: per verb, read from the parsers themselves (no verb or option goes stale)

@dataclasses.dataclass
class _Verb:
    options: list = dataclasses.field(default_factory=list)  # its option strings
    words: list = dataclasses.field(default_factory=list)  # its positionals: sub-commands, choices, spec names
    files: bool = False  # whether a positional argument may be a path too
    values: dict = dataclasses.field(default_factory=dict)  # option -> (the words its value takes, paths too?)


_TOP = ("-h", "--help", "-V", "--version")


def _completion(args) -> int:
    verbs = _completion_table(_parser())
    sys.stdout.write(_SHELLS[args.shell](verbs, _TOP))
    return 0


def _completion_table(parser) -> dict:
    """verb -> _Verb; a delegated verb's from its own parser (``parser_of``)."""
    specs = _bundled_names()
    table = {}
    for name, p in _subparsers(parser).items():
        parser_of = p.get_default("parser_of")
        table[name] = _verb(parser_of() if parser_of else p, specs)
    return table


def _bundled_names() -> list:
    """The bundled specs a SPEC argument takes by name (not the deprecated old names)."""
    return sorted(p.stem for p in Path(BUNDLED_DIR).glob("*.yaml") if p.stem not in OLD_SPEC_NAMES)


def _subparsers(parser) -> dict:
    """name -> parser of a parser's sub-commands ({} without any)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _verb(p, specs: list) -> _Verb:
    """What one parser's arguments complete to; a parser with sub-commands (trace record|
    summary|show) offers their names and all their options."""
    verb = _Verb()
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            verb.words.extend(action.choices)
            for inner in (_verb(sub, specs) for sub in action.choices.values()):
                verb.options.extend(o for o in inner.options if o not in verb.options)
                verb.values.update(inner.values)
                verb.files = verb.files or inner.files
        elif action.option_strings:
            verb.options.extend(action.option_strings)
            taken = _option_values(action, specs)
            verb.values.update(dict.fromkeys(action.option_strings, taken) if taken else {})
        elif action.choices:
            verb.words.extend(action.choices)
        else:
            verb.files = True
            verb.words.extend(specs if action.metavar == "SPEC" else ())
    return verb


def _option_values(action, specs: list):
    """What an option's value completes to: its choices, spec names and paths, or paths
    (a number or a name is the user's to type); None for a flag."""
    if action.nargs == 0:
        return None
    if action.choices:
        return list(action.choices), False
    return (specs if action.metavar == "SPEC" else []), True


def _words(items) -> str:
    return shlex.quote(" ".join(items))


def _bash(verbs: dict, top) -> str:
    cases = [f"        {shlex.quote(name)}) opts={_words(v.options)}; words={_words(v.words)}; files={int(v.files)};;"
             for name, v in verbs.items()]
    values = [f"        {shlex.quote(f'{name} {option}')}) values={_words(words)}; valued=1; files={int(files)};;"
              for name, v in verbs.items() for option, (words, files) in v.values.items()]
    return _BASH.replace("@TOP@", _words([*verbs, *top])).replace("@VERBS@", "\n".join(cases)) \
        .replace("@VALUES@", "\n".join(values) or "        '') ;;")


_BASH = """# source-patch completion for bash: eval "$(source-patch completion bash)"
_source_patch() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local opts="" words="" values="" files=0 valued=0
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W @TOP@ -- "$cur"))
        return
    fi
    case "${COMP_WORDS[1]}" in
@VERBS@
    esac
    case "${COMP_WORDS[1]} $prev" in
@VALUES@
    esac
    if [ "$valued" = 1 ]; then
        COMPREPLY=($(compgen -W "$values" -- "$cur"))
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
        return
    else
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    fi
    if [ "$files" = 1 ]; then
        COMPREPLY+=($(compgen -f -- "$cur"))
    fi
}
complete -o filenames -F _source_patch source-patch
"""


def _zsh(verbs: dict, top) -> str:
    def array(items) -> str:
        return "(" + " ".join(map(shlex.quote, items)) + ")"

    cases = [f"        {shlex.quote(name)}) opts={array(v.options)}; args={array(v.words)}; files={int(v.files)};;"
             for name, v in verbs.items()]
    values = [f"        {shlex.quote(f'{name} {option}')}) values={array(words)}; valued=1; files={int(files)};;"
              for name, v in verbs.items() for option, (words, files) in v.values.items()]
    return _ZSH.replace("@TOP@", " ".join(map(shlex.quote, [*verbs, *top]))).replace("@VERBS@", "\n".join(cases)) \
        .replace("@VALUES@", "\n".join(values) or "        '') ;;")


_ZSH = """# source-patch completion for zsh: autoload -U compinit && compinit; eval "$(source-patch completion zsh)"
_source_patch() {
    local -a opts args values
    local files=0 valued=0
    if (( CURRENT == 2 )); then
        compadd -- @TOP@
        return
    fi
    case ${words[2]} in
@VERBS@
    esac
    case "${words[2]} ${words[CURRENT-1]}" in
@VALUES@
    esac
    if (( valued )); then
        compadd -a values
    elif [[ ${words[CURRENT]} == -* ]]; then
        compadd -a opts
        return
    else
        compadd -a args
    fi
    if (( files )); then
        _files
    fi
    return 0
}
compdef _source_patch source-patch
"""


def _fish(verbs: dict, top) -> str:
    lines = ["# source-patch completion for fish: source-patch completion fish | source",
             "complete -c source-patch -f",
             f"complete -c source-patch -n __fish_use_subcommand -a {_fish_quote(' '.join(verbs))}",
             "complete -c source-patch -n __fish_use_subcommand -s h -l help",
             "complete -c source-patch -n __fish_use_subcommand -s V -l version"]
    for name, v in verbs.items():
        when = f"-n {_fish_quote(f'__fish_seen_subcommand_from {name}')}"
        if v.words or v.files:
            lines.append(f"complete -c source-patch {when}{' -F' if v.files else ''} -a {_fish_quote(' '.join(v.words))}")
        for option in v.options:
            flag = f"-l {option[2:]}" if option.startswith("--") else f"-s {option[1:]}"
            words, files = v.values.get(option, (None, False))
            takes = "" if words is None else f" -r{' -F' if files else ''} -a {_fish_quote(' '.join(words))}"
            lines.append(f"complete -c source-patch {when} {flag}{takes}")
    return "\n".join(lines) + "\n"


def _fish_quote(text: str) -> str:
    """fish's single quotes: only a backslash and a quote are escaped."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


_SHELLS = {"bash": _bash, "zsh": _zsh, "fish": _fish}


def _replay(args) -> int:
    from source_patch.runtime.verdict import replay  # light; its worker process imports Megatron

    return replay.main(args.args, prog="source-patch replay")


def _load_all(refs: list[str]) -> list[spec_mod.Spec]:
    return [spec_mod.load(r) for r in refs]


class _Plan(NamedTuple):
    """What an import of the installed (or ``against``) upstream would do with the specs."""

    by_module: dict  # module -> the patches that apply to it (on_drift: error, to see every problem)
    notes: list  # one line per spec or patch left out, with its reason
    left_out: list  # the same as data (check/diff --json): kind, state, spec, patch, module, reason
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
    notes, left_out, unmet_any, strict = [], [], False, _strict()
    for s in specs:
        problem = unmet_requirement(s, against)
        if problem:
            effect = "importing a target fails" if s.on_unmet == "error" else "skipped"
            notes.append(f"skipped spec {shorten(s.name)} ({shorten(s.file)}): {problem} "
                         f"(on_unmet: {s.on_unmet}: {effect})")
            left_out.append({"kind": "spec", "state": "skipped", "spec": s.name, "file": s.file, "patch": None,
                             "module": None, "reason": problem, "on_unmet": s.on_unmet})
            unmet_any = True
        mine: dict[str, list] = {}
        for p in s.patches:
            mine.setdefault(p.module, []).append((p, unmet(p.requires, against)))
        for module, patches in mine.items():
            applies = [dataclasses.replace(p, on_drift="error") for p, reason in patches if not reason]
            word = "gated" if applies or problem else "skipped"  # skipped: the import says so
            notes += [f"{word} {shorten(p.id)} ({shorten(module)}): {reason}" for p, reason in patches if reason]
            left_out += [{"kind": "patch", "state": word, "spec": s.name, "file": s.file, "patch": p.id,
                          "module": module, "reason": reason} for p, reason in patches if reason]
            if problem:
                continue
            if applies:
                by_module.setdefault(module, []).extend(applies)
            elif strict:
                unmet_any = True
    return _Plan(by_module, notes, left_out, unmet_any)


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
    plan = _plan(_load_all(args.specs), args.against)
    modules = [_diff_module(module, patches, args.against) for module, patches in plan.by_module.items()]
    status = BROKEN if any(m["error"] for m in modules) else UNMET if plan.unmet else 0
    if args.json:
        print(json.dumps({"notes": plan.notes, "left_out": plan.left_out, "modules": modules, "exit": status},
                         indent=1))
        return status
    for note in plan.notes:
        commands.note(note)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    for m in modules:
        if m["error"]:
            commands.error(m["error"], code=BROKEN)
        for line in m["diff"].splitlines(True):
            if color and line[:1] in _COLORS and not line.startswith(("+++", "---")):
                line = _COLORS[line[0]] + line.rstrip("\n") + _RESET + "\n"
            sys.stdout.write(line)
    return status


def _diff_module(module: str, patches, against: str | None) -> dict:
    """One module's unified diff (every line ends in a newline), or its error."""
    try:
        path, source, result = _rewrite(module, patches, against)
    except SourcePatchError as exc:
        return {"module": module, "path": None, "error": str(exc), "diff": ""}
    rel = _relative(path, module)
    lines = difflib.unified_diff(source.splitlines(True), result.source.splitlines(True), f"a/{rel}", f"b/{rel}")
    return {"module": module, "path": str(path), "error": None,
            "diff": "".join(line if line.endswith("\n") else line + "\n" for line in lines)}


def _relative(path: Path, module: str) -> str:
    """``megatron/core/.../moe_utils.py``: the path as the package lays it out."""
    depth = module.count(".") + 1 + (path.name == "__init__.py")
    return "/".join(path.parts[-depth:])


BROKEN = commands.FINDINGS  # check and diff: an anchor does not match (UNMET, 3: a requirement)


def _check(args) -> int:
    from .requires import unknown_distributions

    specs = _load_all(args.specs)
    plan = _plan(specs, args.against)
    # A distribution that is not installed but whose name is close to one that is: most
    # likely misspelled, and it would gate its patches off everywhere, so it is unmet.
    unknown = unknown_distributions(specs, args.against)
    status = UNMET if plan.unmet or unknown else 0
    modules = []
    for module, patches in plan.by_module.items():
        modules.append(_check_module(module, patches, args.against))
        status = BROKEN if modules[-1]["error"] else status
    report = {"specs": [{"name": s.name, "file": s.file, "unmet": unmet_requirement(s, args.against)}
                        for s in specs], "notes": plan.notes + [u["note"] for u in unknown],
              "left_out": plan.left_out, "unknown_distributions": unknown, "modules": modules, "exit": status}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_check(specs, report)
    return status


def _report(args) -> int:
    """``source-patch report RUN_DIR``: every process's patch report in one answer."""
    from .activation import collect, describe, read_reports, who

    if not os.path.isdir(args.folder):
        raise SourcePatchError(f"{args.folder}: no such folder (give the folder SOURCE_PATCH_REPORT_DIR named)")
    reports, problems = read_reports(args.folder)
    if not reports:
        raise SourcePatchError(f"no patch report in {args.folder} (a process writes one there at its first "
                               f"target import when SOURCE_PATCH_REPORT_DIR names it)"
                               + "".join(f"; {p}" for p in problems[:5]))
    specs = collect(reports)
    if args.json:
        processes = [{k: r.get(k) for k in ("pid", "host", "argv0", "process", "time", "signal")} for r in reports]
        print(json.dumps({"folder": os.path.abspath(args.folder), "processes": processes, "specs": specs,
                          "unreadable": problems, "exit": 0}, indent=1))
        return 0
    for problem in problems:
        commands.note(f"not a report: {problem}", "warning")
    hosts = len({r.get("host") for r in reports}) > 1
    print(f"{len(reports)} process{'es' if len(reports) > 1 else ''} reported in {os.path.abspath(args.folder)}:")
    for r in reports:
        print(f"  {who(r)}" + (f" on {printable(str(r.get('host')))}" if hosts else ""))
    for s in specs:
        print(f"spec {printable(str(s['name']))} ({printable(str(s['file']))}):")
        for p in s["patches"]:
            print(f"  {printable(str(p['id']))} ({printable(str(p['module']))}): {printable(describe(p))}")
    return 0


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
    print(f"wrote {path}; check it with: {commands.command('check', path)}")
    return 0


def _matrix(args) -> int:
    from . import matrix

    specs = _load_all(args.specs)
    releases, grid = matrix.run(specs, args.releases, matrix.progress_bar())
    text = matrix.table(specs, releases, grid)
    data = matrix.as_json(specs, releases, grid, matrix.exit_code(grid))
    print(data if args.json else text)
    if args.write:
        _write_file(args.write, _COMPAT_HEAD + text + "\n")
    if args.json_out:
        _write_file(args.json_out, data)
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
        return commands.error("run: give a command after --")
    specs = _load_all(args.specs)  # fail now, not in the child
    if not _hook_installed():
        commands.note(f"run: the source_patch.pth start hook is not installed in {sys.prefix}; only "
                      "interpreters that have it will be patched", "warning")
    env = dict(os.environ, **{ENV: ",".join(s.file for s in specs)})
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:  # the shell's codes: 127 not found, 126 found but not runnable
        return commands.error(f"run: cannot run {printable(shorten(command[0]))}: {_reason(exc)}",
                              code=127 if isinstance(exc, FileNotFoundError) else 126)


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
