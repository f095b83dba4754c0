"""Replay a rollout's tokens through a Megatron model under the dump spec: the
training side's dumps of the same tokens, for ``source-patch compare``.

    source-patch replay ROLLOUT_DUMPS --checkpoint CKPT [--out sp-replay] [--routes DIR [--replay-probs]]
                        [--tokens FILE] [--builder MODULE:FUNCTION] [--logprobs FILE] [--compare] [--html F]
                        [--json-out F] [--json]

    from source_patch.runtime.verdict import replay
    train = replay.replay(rollout_dumps, checkpoint, out="sp-replay")  # a child process; the new run's folder

Each request of the rollout (its tokens read back from the rollout's ``input_ids`` /
``positions`` / ``row_request`` dumps: the prompt and every generated token the engine
fed back; or, with ``tokens``, the token ids the engine returned: a request whose prompt
prefix came from the engine's radix cache has no rows at those positions, see
:func:`read_tokens`) is one forward pass of the model and one dump step, with ``row_request`` /
``positions`` / ``input_ids`` records in Megatron's ``[s, b]`` layout, so the comparator
pairs every row.  With ``routes`` (the rollout's routing records, ``routing`` capture) each
request is routed as the engine routed it: its expert ids replayed, the combine weights
recomputed from the model's scores, or the engine's own with ``replay_probs``.

The model is the Megatron twin of the checkpoint (``verdict/twin.py``) unless a builder
is given, ``package.module:function`` or ``path/to/file.py:function``: called as
``function(checkpoint)`` once Megatron's parallel state is initialised (world size 1), it
returns a model called as ``model(input_ids, position_ids, attention_mask=None)`` (both
``[1, s]``) that returns logits ``[1, s, vocab]``, as Megatron's ``GPTModel`` does.

The forward runs in a child process under ``SOURCE_PATCH=megatron_cpu,dump`` (plus
``routing`` with routes; the start hook applies them before Megatron imports), into a new run
``replay-<time>`` under ``out`` that also holds ``replay.json``: what was replayed, the
versions and the time, which the comparator's reports show.  This module imports
nothing heavy until the replay runs.

The dumps, the checkpoint and the routes may be someone else's: every input is checked
against the limits below and the checkpoint's ``config.json`` (for the twin, against
its tensors' headers too) before anything is built or allocated, in this process before
the worker starts, and each problem is one line naming the file and the field
(docs/compare.md, "Hostile inputs").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..core import bounded, commands
from ..dump import reader
from . import compare

SPECS = ("megatron_cpu", "dump")
TWIN = "source_patch.runtime.verdict.twin:build"
# Limits of what a replay takes, checked before anything is built or allocated (docs/compare.md):
MAX_TOKENS = 16384              # tokens of one request (and at most the config's max_position_embeddings):
                                # the CPU forward's attention scores grow with its square
MAX_CONFIG_BYTES = 1 << 20      # config.json
MAX_HEADER_BYTES = 100_000_000  # one checkpoint file's safetensors header (safetensors' own limit)
MAX_SIZE = 1 << 31              # any size in config.json (vocabulary, layers, experts, widths)
MAX_TOKENS_FILE_BYTES = 1 << 26  # --tokens: the engine's replies (64 MiB: ~10 million token ids)
MAX_TOKENS_FILE_DEPTH = 8       # a reply's meta_info.output_top_logprobs nests 6 deep in a list of replies
MAX_TOKENS_FILE_ITEMS = 1 << 22  # its arrays and objects (a logprob entry per token is one)
KEPT = 3                        # the worker's exit code: the run is complete, only --logprobs failed
# The worker's entry: a fresh interpreter, so the start hook applies SOURCE_PATCH first.
# Its first statement drops the current folder, which `-c` puts first on sys.path (after
# `site` ran: nothing came from it yet): a json.py or megatron/ where the replay starts
# must not run in it.  PYTHONPATH and the user's site stay (they may be where Megatron is).
_WORKER = ("import sys\nif sys.path[:1] == ['']: del sys.path[0]\n"
           "from source_patch.runtime.verdict.replay import work; sys.exit(work(sys.argv[1]))")


class ReplayError(RuntimeError):
    """The replay cannot run as asked (said in one line)."""


class Stopped(ReplayError):
    """The worker process stopped and has said why on stderr, in one line."""


def main(argv=None, prog: str = "python -m source_patch.runtime.verdict.replay") -> int:
    args = parser(prog).parse_args(argv)
    try:
        rollout = Path(reader.choose_for_cli(args.rollout, args.exp_name)).resolve()
        reader.rank_dirs(rollout)  # dumps there, before anything starts
        reports = args.compare or args.html or args.json_out
        if reports:
            for flag, path in (("--json-out", args.json_out), ("--html", args.html)):
                compare.check_output(flag, path)  # before the replay, not after it
        train = replay(rollout, args.checkpoint, args.out, builder=args.builder, routes=args.routes,
                       replay_probs=args.replay_probs, logprobs=args.logprobs, tokens=args.tokens,
                       stdout=sys.stderr if args.json else None)  # under --json, stdout is one object
    except Stopped:
        return _stopped(args.json)
    except (OSError, ValueError, ReplayError) as exc:
        return _fail(exc, args.json)
    return _then(rollout, train, args) if reports else _next_step(rollout, train, args)


def _then(rollout, train: Path, args) -> int:
    """--compare, --html, --json-out: the comparison's exit code (under --json one object)."""
    print(f"training-side dumps: {train}", file=sys.stderr if args.json else sys.stdout, flush=True)
    said = {"rollout": str(rollout), "training dumps": str(train)}
    return compare.report(rollout, train, args, wrap=lambda report: {**said, "report": report,
                                                                     "exit": report["exit"]})


def _next_step(rollout, train: Path, args) -> int:
    """Where the dumps went, and the one command that compares them, as printed."""
    next_step = compare_command(rollout, args.out)
    if args.json:
        print(json.dumps({"rollout": str(rollout), "training dumps": str(train), "compare": next_step,
                          "exit": commands.OK}, indent=1))
    else:
        print(f"training-side dumps: {train}\ncompare them:\n  {next_step}", flush=True)
    return commands.OK


def compare_command(rollout, out) -> str:
    """The one command that compares a rollout with its replay under ``out`` (the latest run
    there: the one just made), as printed by `source-patch replay` and by `make rollout`
    (examples/rollout_sglang.py) alike, runnable as printed (core/commands.py)."""
    out = Path(out).resolve()
    return commands.command("compare", Path(rollout).resolve(), out, "--html", out / "report.html")


def parser(prog: str = "python -m source_patch.runtime.verdict.replay"):
    p = commands.Parser(prog=prog, description="Replay a rollout's tokens through the Megatron twin of "
                        "its checkpoint (or your model) under the dump spec: training-side dumps for "
                        "`source-patch compare`; compare them too with --compare, --html or --json-out. "
                        "Exit 0 (with a comparison: 0 no divergence, 1 divergence), 2 on an error.")
    p.add_argument("rollout", help="the rollout's dumps: a dump root (its latest run), a run or a rank folder")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="the Hugging Face checkpoint the engine served")
    p.add_argument("--exp-name", metavar="NAME", help="the rollout's run to read under a dump root")
    p.add_argument("--out", default="sp-replay", metavar="DIR",
                   help="dump root of the replay's run (default sp-replay)")
    p.add_argument("--routes", metavar="DIR", help="replay the rollout's routing records (routing capture) from DIR")
    p.add_argument("--replay-probs", action="store_true",
                   help="with --routes: replay the engine's combine weights too, not only its expert ids")
    p.add_argument("--tokens", metavar="FILE",
                   help="each request's token ids as the engine returned them (JSON lines or one JSON object: "
                        "SGLang /generate replies with meta_info.id, prompt_token_ids or input_ids, and "
                        "output_ids; or {rid: {input_ids, output_ids}}): needed where the radix cache served a "
                        "prompt prefix, whose positions have no rows in the rollout's dumps")
    p.add_argument("--builder", metavar="MODULE:FUNCTION",
                   help=f"your model: FUNCTION(checkpoint) -> a Megatron GPTModel (MODULE may be a .py file; "
                        f"default {TWIN})")
    p.add_argument("--logprobs", metavar="FILE", help="write the model's per-token log-probs here as JSON")
    p.add_argument("--compare", action="store_true", help="then compare the rollout with the replay "
                   "(--html and --json-out imply it)")
    compare.add_report_arguments(p)
    return p


def replay(rollout, checkpoint, out="sp-replay", *, builder: str | None = None, routes=None,
           replay_probs: bool = False, logprobs=None, exp_name: str | None = None, stdout=None,
           tokens=None) -> Path:
    """Replay ``rollout`` (a run or rank folder of rollout dumps) through the model of
    ``checkpoint`` in a child process (its output to ``stdout``, by default this process's);
    returns the new run's folder under ``out``.  ``tokens``: a file of the token ids the
    engine returned (:func:`read_tokens`).  The inputs (:func:`check_inputs`) and the
    ``logprobs`` target are checked here first."""
    compare.check_output("--logprobs", logprobs)  # before the replay, not after it
    if routes is not None and not Path(routes).is_dir():
        raise ReplayError(f"--routes {routes}: no such folder")
    # here: one line, before Megatron starts
    check_inputs(rollout, checkpoint, builder=builder, routes=routes, tokens=tokens)
    run = _new_run(Path(out).resolve(), exp_name)
    job = {"rollout": str(Path(rollout).resolve()), "checkpoint": str(Path(checkpoint).resolve()),
           "builder": builder, "routes": routes and str(Path(routes).resolve()), "replay_probs": replay_probs,
           "logprobs": logprobs and str(Path(logprobs).resolve()), "dir": str(run.parent), "exp_name": run.name,
           "tokens": tokens and str(Path(tokens).resolve())}
    env = {**os.environ, "SOURCE_PATCH": ",".join(SPECS + (("routing",) if routes else ()))}
    code = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(job)], env=env, stdout=stdout).returncode
    if code == KEPT:  # the run is whole; only the log-probs could not be written (said on stderr)
        raise Stopped(f"--logprobs {logprobs}: not written; the replayed run is kept: {run}")
    if code:  # no half run left behind to be read as the latest
        shutil.rmtree(run, ignore_errors=True)
    if code == 2:
        raise Stopped("the replay stopped; its reason is on stderr")
    if code:
        raise ReplayError(f"the replay process failed (exit {code})")
    return run


def _new_run(out: Path, name: str | None) -> Path:
    """A fresh run folder name under ``out`` (created): ``replay-<time>``, ``-2`` ... if taken."""
    base = name or time.strftime("replay-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        run = out / (base if n == 1 else f"{base}-{n}")
        try:
            run.mkdir()
            return run
        except FileExistsError:
            continue
    raise ReplayError(f"{out}: no free run name like {base}")


def work(job: str) -> int:
    """The child process: :func:`replay_here` with the job :func:`replay` passed; 2 and one
    line on stderr when it cannot run, KEPT (3) when only the log-probs cannot be written."""
    import warnings

    job = json.loads(job)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no TE/Apex on CPU, said 7 times
    try:
        logps = replay_here(job["rollout"], job["checkpoint"], builder=job["builder"], routes=job["routes"],
                            replay_probs=job["replay_probs"], dir=job["dir"], exp_name=job["exp_name"],
                            tokens=job["tokens"])
    except (OSError, ValueError, ReplayError) as exc:  # DumpError, RoutingRecordError: ValueErrors
        return _fail(exc)
    except Exception as exc:  # noqa: BLE001 - nothing above foresaw it: still one line, no traceback
        return _fail(f"unexpected {type(exc).__name__}: {exc}")
    if job["logprobs"]:
        from ..core import private

        try:
            private.write_file(job["logprobs"], json.dumps(logps))
        except OSError as exc:
            _fail(f"--logprobs {job['logprobs']}: cannot write it ({exc.strerror or exc}); the replayed run is "
                  f"complete and kept: {Path(job['dir']) / job['exp_name']}")
            return KEPT
    return 0


def replay_here(rollout, checkpoint, *, builder: str | None = None, routes=None, replay_probs: bool = False,
                dir=None, exp_name: str | None = None, tokens=None) -> dict:
    """The replay in this process, which Megatron must import into patched by ``megatron_cpu``
    and ``dump`` (and ``routing`` with routes).  Dumps into ``dir``/``exp_name`` (else where the
    dump settings say); returns ``{rid: [log p(token i | tokens before it) for i >= 1]}``."""
    from ..dump import api as dump

    started = time.monotonic()
    requests, records = check_inputs(rollout, checkpoint, builder=builder, routes=routes, tokens=tokens)
    model = _build(builder, checkpoint)
    selection = dict.fromkeys(("names", "layers", "steps", "ranks", "phases"), "")  # the comparator needs all
    dump.configure(enable=True, **selection, **({"dir": str(dir), "exp_name": exp_name} if dir else {}))
    logps = _forwards(dump, model, requests, records, replay_probs, _who(builder, checkpoint))
    routed = f"{'ids and weights' if replay_probs else 'expert ids'} of {len(records)} of {len(requests)} " \
             f"requests replayed from {routes}" if routes else "not replayed (the model routes)"
    inputs = _inputs(rollout, checkpoint, builder, routed, requests, tokens)
    compare.write_report(Path(dump.state()["exp_dir"]) / compare.INPUTS, json.dumps(inputs, indent=1))
    for line in cached_lines(requests):
        print(line, flush=True)
    print(f"replayed {len(requests)} requests ({inputs['tokens']} tokens) through {inputs['model builder']} "
          f"in {time.monotonic() - started:.1f} s; routes: {routed}", flush=True)
    return logps


def _forwards(dump, model, requests: dict, records: dict, replay_probs: bool, who: str) -> dict:
    """One forward and one dump step per request (by request id); their log-probs."""
    import torch

    from .logprobs import token_logprobs

    dump.dump_context(phase="fwd_only")
    logps = {}
    for step, (rid, tokens) in enumerate(sorted(requests.items())):
        dump.dump_step(step=step)
        _dump_rows(dump, rid, tokens)
        try:
            with _replaying(records.get(rid), len(tokens), replay_probs):
                logits = _forward(model, tokens, who)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model of the user's, or Megatron's: one line, exit 2
            raise ReplayError(f"request {rid!r}: the forward of {who} failed: {_said(exc)}") from None
        # dtype: a one-token request (SGLang's health probe) has no targets, still token ids
        logps[rid] = token_logprobs(logits[:-1], torch.tensor(tokens[1:], dtype=torch.long)).tolist()
    dump.flush()
    return logps


def _fail(exc, as_json: bool = False) -> int:
    return commands.error(commands.first_line(exc), as_json=as_json)


def _stopped(as_json: bool) -> int:
    """The worker stopped and said why on stderr: under --json, stdout still gets its object."""
    if as_json:
        print(json.dumps({"error": "the replay stopped; its reason is on stderr", "exit": commands.USAGE}))
    return commands.USAGE


def _said(exc: BaseException) -> str:
    """An exception in a few words, for a one-line error."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _who(builder: str | None, checkpoint) -> str:
    return f"--builder {builder}" if builder else f"the twin of {checkpoint}"


class Sequences(dict):
    """``{rid: token ids by position}`` of a rollout's requests, and per request how many of
    its positions have no rows in the rollout's dumps because the engine took them from its
    prefix cache (``cached``; requests read from the dumps alone: 0) and what the engine said
    of it (``reported``: its ``meta_info["cached_tokens"]``, where --tokens gave one);
    ``given``: the requests whose tokens came from --tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cached: dict = {}
        self.reported: dict = {}
        self.given: set = set()


def sequences(rollout, tokens=None) -> Sequences:
    """``{rid: token ids by position}`` of every request the rollout's dumps hold rows of:
    integer token ids at positions 0 .. n - 1, n at most MAX_TOKENS.  A request without rows
    at some positions (its prompt prefix came from the engine's radix cache) needs its
    tokens from ``tokens`` (:func:`read_tokens`): they must equal its dumped ``input_ids``
    at every dumped position, and the positions without rows must be a prefix (a cache hit);
    any other request is read from its dumps, which must then hold every position."""
    rows = _dumped_rows(rollout)
    given = read_tokens(tokens) if tokens is not None else {}
    if given and not set(given) & set(rows):
        theirs = ", ".join(repr(r[:40]) for r in sorted(rows)[:3])
        raise ReplayError(f"--tokens {tokens}: none of its {len(given)} requests is in the rollout {rollout} "
                          f"(whose request ids are {theirs}{' ...' if len(rows) > 3 else ''})")
    out = Sequences()
    for rid, dumped in sorted(rows.items()):
        entry = given.get(rid)
        if entry is None:
            high = max(dumped)
            if len(dumped) != high + 1:
                gaps = [p for p in range(high + 1) if p not in dumped][:8]
                how = f"--tokens {tokens} has no entry for it" if tokens is not None else \
                    "give every request's token ids with --tokens FILE (the engine's /generate replies)"
                raise ReplayError(f"{rollout}: request {rid!r}: the rollout's dumps have no rows at positions "
                                  f"{gaps} (the engine's prefix cache?): {how}")
            out[rid] = [dumped[p] for p in range(high + 1)]
            out.cached[rid] = 0
            continue
        full, reported = entry
        _check_dumped_tokens(rollout, tokens, rid, dumped, full)
        out[rid] = full
        out.given.add(rid)
        out.cached[rid] = min(dumped)  # positions 0 .. first dumped - 1: no rows, the cache's
        if reported is not None:
            out.reported[rid] = reported
    return out


def _dumped_rows(rollout) -> dict:
    """``{rid: {position: token id}}`` of the rollout's ``input_ids`` rows, each a checked
    token id, every position in 0 .. MAX_TOKENS - 1."""
    rows = compare.index_rows(compare.load(rollout, ["input_ids", "positions", "row_request"]))
    by_request: dict = {}
    for (rid, position), token in rows.get(("input_ids", None), {}).items():
        by_request.setdefault(rid, {})[position] = _token_id(rollout, rid, position, token)
    if not by_request:
        raise ReplayError(f"{rollout}: no input_ids, positions and row_request records (dumped under "
                          "patches/dump.yaml?)")
    for rid, tokens in by_request.items():
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= MAX_TOKENS:  # before anything the size of a position is made
            raise ReplayError(f"{rollout}: request {rid!r}: position {low if low < 0 else high} outside "
                              f"0..{MAX_TOKENS - 1} (a replay takes requests of at most {MAX_TOKENS} tokens)")
    return by_request


def _check_dumped_tokens(rollout, tokens, rid, dumped: dict, full: list) -> None:
    """The engine-returned ``full`` sequence of ``rid`` agrees with its dumped rows: the same
    token at every dumped position, no row past its end, and the positions without rows a
    prefix 0 .. k - 1 (what a radix-cache hit leaves; the last token is never fed back)."""
    first, high = min(dumped), max(dumped)
    if high >= len(full):
        raise ReplayError(f"{rollout}: request {rid!r}: the rollout's dumps have a row at position {high}, "
                          f"--tokens {tokens} gives it {len(full)} tokens (a misaligned input?)")
    for position in sorted(dumped):
        if dumped[position] != full[position]:
            raise ReplayError(f"{rollout}: request {rid!r} position {position}: token id {dumped[position]} in "
                              f"the rollout's input_ids, {full[position]} in --tokens {tokens} (a misaligned input)")
    gaps = [p for p in range(first, len(full) - 1) if p not in dumped][:8]
    if gaps:
        raise ReplayError(f"{rollout}: request {rid!r}: the rollout's dumps have no rows at positions {gaps}, "
                          f"after its first row at position {first}: not a prefix-cache hit (--tokens {tokens} "
                          f"gives {len(full)} tokens, rows end at position {high})")


def cached_lines(requests) -> list:
    """One line per request some of whose positions came from the engine's prefix cache."""
    lines = []
    for rid, n in sorted(getattr(requests, "cached", {}).items()):
        if n:
            reported = requests.reported.get(rid)
            said = f" (the engine reported cached_tokens {reported})" if reported not in (None, n) else ""
            lines.append(f"request {rid!r}: {n} of {len(requests[rid])} positions came from the engine's prefix "
                         f"cache: compared on the training side only{said}")
    return lines


# Where a request's token ids may stand in one entry of --tokens: SGLang's /generate reply
# (prompt_token_ids with return_prompt_token_ids, or the input_ids that were sent, and
# output_ids), verl's (prompt_ids, response_ids), or the whole sequence (slime's tokens).
_PROMPT_FIELDS = ("input_ids", "prompt_token_ids", "prompt_ids")
_OUTPUT_FIELDS = ("output_ids", "response_ids")
_ENTRY_FIELDS = {"meta_info", "rid", "tokens", *_PROMPT_FIELDS, *_OUTPUT_FIELDS}


def read_tokens(path) -> dict:
    """``{rid: (token ids, the engine's cached_tokens or None)}`` from ``path`` (--tokens), the
    token ids the engine returned per request: JSON values one after another (JSON lines, or
    one value), each one entry, a list of entries (a batch /generate reply) or an object
    ``{rid: entry}``.  An entry is an object with the request id (its key there, else
    ``rid`` or ``meta_info.id``) and its token ids: a prompt (``input_ids``,
    ``prompt_token_ids`` or ``prompt_ids``) followed by an output (``output_ids`` or
    ``response_ids``), or the whole sequence (``tokens``); where ``meta_info`` says
    ``prompt_tokens`` / ``completion_tokens`` they must agree.  Read bounded (a regular
    file of at most MAX_TOKENS_FILE_BYTES); each problem one ReplayError naming the file,
    the line, the request and the field."""
    data = bounded.read_regular(path, max_bytes=MAX_TOKENS_FILE_BYTES, what="--tokens", error=ReplayError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReplayError(f"--tokens {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    bounded.check_nesting(text, what=f"--tokens {path}", error=ReplayError, max_depth=MAX_TOKENS_FILE_DEPTH,
                          max_items=MAX_TOKENS_FILE_ITEMS)  # before parsing: json recurses in C
    out: dict = {}
    for line, value in _json_values(path, text):
        for key, entry in _entries(path, line, value):
            rid, found = _entry(path, line, key, entry)
            if rid in out:
                raise ReplayError(f"--tokens {path} line {line}: request {rid[:80]!r} is there twice")
            out[rid] = found
    if not out:
        raise ReplayError(f"--tokens {path}: no requests there (JSON lines of /generate replies, or one JSON "
                          "object {rid: {input_ids, output_ids}})")
    return out


def _json_values(path, text: str):
    """``(line, value)`` of each JSON value in ``text``, one after another (JSON lines)."""
    import re

    decoder, space, at, line, counted = json.JSONDecoder(), re.compile(r"\s*"), 0, 1, 0
    while True:
        at = space.match(text, at).end()
        if at == len(text):
            return
        line, counted = line + text.count("\n", counted, at), at  # where this value begins
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError as exc:  # a JSONDecodeError, or an integer of more digits than Python converts
            said = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) \
                else commands.first_line(exc, 200)
            raise ReplayError(f"--tokens {path} line {line}: not valid JSON ({said})") from None
        yield line, value
        at = end


def _entries(path, line: int, value):
    """``(key or None, entry)`` of one JSON value of --tokens."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, dict):
            raise ReplayError(f"--tokens {path} line {line}: a JSON {type(item).__name__}, expected an object (a "
                              "/generate reply, or {rid: {input_ids, output_ids}})")
        if _ENTRY_FIELDS & set(item):
            yield None, item
        else:
            yield from item.items()


def _entry(path, line: int, key, entry) -> tuple:
    """``(rid, (token ids, cached_tokens or None))`` of one entry of --tokens."""
    where = f"--tokens {path} line {line}"
    if key is not None:
        where += f": request {key[:80]!r}"
    if not isinstance(entry, dict):
        raise ReplayError(f"{where}: a JSON {type(entry).__name__}, expected an object with input_ids and "
                          "output_ids")
    meta = entry.get("meta_info", {})
    if not isinstance(meta, dict):
        raise ReplayError(f"{where}: meta_info is a JSON {type(meta).__name__}, expected an object")
    named = [(field, value) for field, value in (("rid", entry.get("rid")), ("meta_info.id", meta.get("id")))
             if value is not None]
    for field, value in named:
        if not isinstance(value, str) or not value:
            raise ReplayError(f"{where}: {field} is {json.dumps(value)[:40]}, expected a request id (a string)")
        if key is not None and value != key or value != named[0][1]:
            raise ReplayError(f"{where}: {field} is {value[:80]!r}, another request")
    rid = key if key is not None else named[0][1] if named else None
    if rid is None:
        raise ReplayError(f"{where}: no request id (meta_info.id or rid)")
    where = f"--tokens {path} line {line}: request {rid[:80]!r}"
    if "tokens" in entry:
        prompt, output = _ids(where, "tokens", entry["tokens"]), []
    else:
        prompt, output = _one_of(where, entry, _PROMPT_FIELDS), _one_of(where, entry, _OUTPUT_FIELDS)
        for field, ids in (("prompt_tokens", prompt), ("completion_tokens", output)):
            said = meta.get(field)
            if type(said) is int and said != len(ids):  # the engine's own count: another tokenization?
                raise ReplayError(f"{where}: meta_info.{field} is {said}, its token ids are {len(ids)}")
    full = prompt + output
    if not full:
        raise ReplayError(f"{where}: no token ids")
    if len(full) > MAX_TOKENS:
        raise ReplayError(f"{where}: {len(full)} tokens, more than {MAX_TOKENS} (a replay takes requests of at "
                          f"most {MAX_TOKENS} tokens)")
    cached = meta.get("cached_tokens")
    return rid, (full, cached if type(cached) is int else None)


def _one_of(where: str, entry: dict, fields: tuple) -> list:
    """The token ids of the one field of ``fields`` the entry has (several: all equal)."""
    present = [(field, _ids(where, field, entry[field])) for field in fields if entry.get(field) is not None]
    if not present:
        raise ReplayError(f"{where}: none of {', '.join(fields)}")
    for field, ids in present[1:]:
        if ids != present[0][1]:
            raise ReplayError(f"{where}: {field} and {present[0][0]} differ")
    return present[0][1]


def _ids(where: str, field: str, value) -> list:
    """A list of token ids: integers >= 0 (a float, a bool or a string is refused)."""
    if not isinstance(value, list):
        raise ReplayError(f"{where}: {field} is a JSON {type(value).__name__}, expected a list of token ids")
    if len(value) > MAX_TOKENS:
        raise ReplayError(f"{where}: {field} has {len(value)} tokens, more than {MAX_TOKENS} (a replay takes "
                          f"requests of at most {MAX_TOKENS} tokens)")
    for i, token in enumerate(value):
        if type(token) is not int or token < 0:
            raise ReplayError(f"{where}: {field}[{i}] is {json.dumps(token)[:40]}, expected an integer token id "
                              ">= 0")
    return value


def _token_id(rollout, rid, position, row) -> int:
    """The token id of one input_ids row: one non-negative integer (a float is refused,
    not truncated)."""
    dtype = row.dtype
    if row.numel() != 1 or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise ReplayError(f"{rollout}: input_ids of request {rid!r} position {position}: {row.numel()} "
                          f"{str(dtype).removeprefix('torch.')} value(s), expected one integer token id")
    token = int(row.reshape(()))
    if token < 0:
        raise ReplayError(f"{rollout}: input_ids of request {rid!r} position {position}: token id {token}, "
                          "expected one >= 0")
    return token


def check_inputs(rollout, checkpoint, *, builder: str | None = None, routes=None,
                 tokens=None) -> tuple[Sequences, dict]:
    """``(requests, routing records)`` once every input is checked against the limits and
    the checkpoint's config.json (and, for the twin, its tensors), before anything is
    built: each problem one ReplayError (or ValueError) naming the file and the field.
    ``tokens``: the engine's returned token ids (:func:`read_tokens`)."""
    if builder is not None:
        _builder_parts(builder)
    config = read_config(checkpoint, twin=builder is None)
    if builder is None:
        check_weights(checkpoint, config)
    requests = sequences(rollout, tokens)
    check_tokens(rollout, requests, config, Path(checkpoint) / "config.json")
    records = _routes(routes, requests, config if builder is None else None) if routes else {}
    return requests, records


def read_config(checkpoint, twin: bool = True) -> dict:
    """The checkpoint's config.json (a regular file, bounded), its sizes checked: every
    one the twin reads (``twin``), else ``vocab_size`` and ``max_position_embeddings``
    where given (the tokens are checked against them)."""
    path = Path(checkpoint) / "config.json"
    if not os.path.lexists(path):
        raise ReplayError(f"--checkpoint {checkpoint}: no config.json there (a Hugging Face checkpoint folder)")
    data = bounded.read_regular(path, max_bytes=MAX_CONFIG_BYTES, what="--checkpoint", error=ReplayError)
    config = bounded.load_json(data, what=str(path), error=ReplayError, max_items=10_000, kind=dict)
    for key in ("vocab_size", "max_position_embeddings"):
        _size(path, config, key, required=twin and key == "vocab_size")
    if twin:
        _check_twin_config(path, config)
    return config


def _size(path: Path, config: dict, key: str, required: bool = True):
    """``config[key]``: an integer in 1 .. MAX_SIZE (absent, null or 0 is None where not required)."""
    value = config.get(key)
    if not required and (value is None or (type(value) is int and value == 0)):  # the twin's "use the default"
        return None
    if type(value) is not int or not 1 <= value <= MAX_SIZE:
        said = "missing" if key not in config else f"{str(value)[:40]!r}" if isinstance(value, str) else \
            json.dumps(value)[:40]
        raise ReplayError(f"{path}: {key} is {said}, expected an integer in 1..{MAX_SIZE}")
    return value


_TWIN_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "moe_intermediate_size", "num_experts_per_tok")


def _check_twin_config(path: Path, config: dict) -> None:
    """What the twin (weight_sync/twin.py) reads from config.json, of the right type,
    before Megatron is imported: its KeyError or TypeError would be a traceback."""
    if config.get("model_type") != "qwen3_moe":
        raise ReplayError(f"{path}: model_type is {str(config.get('model_type'))[:40]!r}: the twin is built for "
                          "qwen3_moe (give --builder for another model)")
    for key in _TWIN_SIZES:
        _size(path, config, key)
    for key in ("num_key_value_heads", "head_dim"):
        _size(path, config, key, required=False)
    if _size(path, config, "num_experts", required=False) is None:
        _size(path, config, "num_local_experts")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ReplayError(f"{path}: every layer must be an MoE layer for the twin (mlp_only_layers empty, "
                          "decoder_sparse_step 1)")
    eps = config.get("rms_norm_eps")
    if type(eps) not in (int, float) or not 0 < eps < 1:
        raise ReplayError(f"{path}: rms_norm_eps is {json.dumps(eps)[:40]}, expected a number in (0, 1)")


def check_tokens(rollout, requests: dict, config: dict, path: Path) -> None:
    """Every request within the config's context (``max_position_embeddings``) and
    every token id inside its vocabulary (``vocab_size``), where the config says them."""
    vocab, context = config.get("vocab_size"), config.get("max_position_embeddings")
    for rid, tokens in requests.items():
        if isinstance(context, int) and context > 0 and len(tokens) > context:
            raise ReplayError(f"{rollout}: request {rid!r} has {len(tokens)} tokens, more than {path}'s "
                              f"max_position_embeddings {context}")
        top = max(tokens)
        if isinstance(vocab, int) and vocab > 0 and top >= vocab:
            raise ReplayError(f"{rollout}: request {rid!r} position {tokens.index(top)}: token id {top} is "
                              f"outside {path}'s vocabulary (vocab_size {vocab})")


_FLOATS = ("F16", "BF16", "F32", "F64")  # what the twin's float32 parameters copy from


def check_weights(checkpoint, config: dict) -> None:
    """The checkpoint's tensors (their safetensors headers, read bounded) are exactly the
    twin's, each of the shape config.json makes it and floating-point: a wrong size would
    be an allocation the size of a bad number, or silently zero-padded rows."""
    found = _checkpoint_tensors(Path(checkpoint))
    used = set()
    for name, shape in _twin_tensors(config):  # stops at the first one missing: bounded by what is found
        if name not in found:
            raise ReplayError(f"--checkpoint {checkpoint}: no tensor {name} in its *.safetensors files, which "
                              f"config.json calls for ({_shape_fields(config)})")
        got, dtype, file = found[name]
        if got != shape:
            raise ReplayError(f"{file}: {name} is {got}, config.json makes it {shape} ({_shape_fields(config)})")
        if dtype not in _FLOATS:
            raise ReplayError(f"{file}: {name} is stored as {str(dtype)[:20]}, expected one of {list(_FLOATS)}")
        used.add(name)
    unused = sorted(n for n in found if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ReplayError(f"--checkpoint {checkpoint}: tensors config.json has no place for: "
                          f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''} ({_shape_fields(config)})")


def _shape_fields(config: dict) -> str:
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_local_experts")
    return ", ".join(f"{k} {config[k]}" for k in keys if config.get(k) is not None)


def _twin_tensors(c: dict):
    """``(name, shape)`` of every tensor the twin loads, by its Hugging Face name (Qwen3-MoE)."""
    vocab, hidden, heads = c["vocab_size"], c["hidden_size"], c["num_attention_heads"]
    groups, dim = c.get("num_key_value_heads") or heads, c.get("head_dim") or hidden // heads
    experts, width = c.get("num_experts") or c["num_local_experts"], c["moe_intermediate_size"]
    yield from [("model.embed_tokens.weight", [vocab, hidden]), ("lm_head.weight", [vocab, hidden]),
                ("model.norm.weight", [hidden])]
    bias = [("q_proj.bias", [heads * dim]), ("k_proj.bias", [groups * dim]), ("v_proj.bias", [groups * dim])]
    attention = [("q_proj.weight", [heads * dim, hidden]), ("k_proj.weight", [groups * dim, hidden]),
                 ("v_proj.weight", [groups * dim, hidden]), ("o_proj.weight", [hidden, heads * dim]),
                 ("q_norm.weight", [dim]), ("k_norm.weight", [dim])] + (bias if c.get("attention_bias") else [])
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield from [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                    (p + "mlp.gate.weight", [experts, hidden])]
        yield from ((p + "self_attn." + k, shape) for k, shape in attention)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            yield from [(q + "gate_proj.weight", [width, hidden]), (q + "up_proj.weight", [width, hidden]),
                        (q + "down_proj.weight", [hidden, width])]


def _checkpoint_tensors(folder: Path) -> dict:
    """``{name: (shape, dtype, file)}`` of the ``*.safetensors`` files the twin loads."""
    found: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name, (shape, dtype) in _safetensors_entries(path).items():
            if name in found:
                raise ReplayError(f"{path}: tensor {name[:80]!r} is in {found[name][2]} too")
            found[name] = (shape, dtype, path)
    if not found:
        raise ReplayError(f"--checkpoint {folder}: no tensors in *.safetensors files there")
    return found


def _safetensors_entries(path: Path) -> dict:
    """``{name: (shape, dtype)}`` of one safetensors file, from its header alone: a
    regular file (a FIFO is refused, not waited on), the header bounded, each entry's
    bytes inside the file and as many as its shape needs."""
    from ..routing.records.file import safetensors_entry_ok

    with bounded.open_regular(path, what="--checkpoint", error=ReplayError) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise ReplayError(f"{path}: not a safetensors file (its header length {n}, the file {size} bytes)")
        raw = f.read(n)
    header = bounded.load_json(raw, what=f"{path}: its safetensors header", error=ReplayError,
                               max_bytes=MAX_HEADER_BYTES, max_depth=3, kind=dict)
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        if not safetensors_entry_ok(entry) or entry["data_offsets"][1] > size - 8 - n:
            raise ReplayError(f"{path}: tensor {name[:80]!r}: a malformed header entry (a dtype, a shape, "
                              f"data_offsets its bytes apart and inside the file's {size} bytes)")
        out[name] = (entry["shape"], entry["dtype"])
    return out


def load_builder(spec: str | None):
    """The model builder ``package.module:function`` or ``file.py:function`` names (the twin's
    by default); whatever its import raises is one ReplayError."""
    import importlib
    import importlib.util

    module_name, function = _builder_parts(spec)
    try:
        if module_name.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: a SyntaxError, an ImportError ... one line
        raise ReplayError(f"--builder {spec}: importing {module_name} failed: {_said(exc)}") from None
    if not callable(getattr(module, function, None)):
        raise ReplayError(f"--builder {spec}: {module_name} has no function {function!r}")
    return getattr(module, function)


def _builder_parts(spec: str | None) -> tuple[str, str]:
    """(module or .py file, function) of a builder spec, the file a regular one (checked
    before the replay starts: reading a FIFO would wait forever)."""
    module_name, _, function = (spec or TWIN).rpartition(":")
    if not module_name or not function:
        raise ReplayError(f"--builder {spec}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if module_name.endswith(".py") and not Path(module_name).is_file():
        raise ReplayError(f"--builder {spec}: no file {module_name}")
    return module_name, function


def _build(builder: str | None, checkpoint):
    """Megatron's parallel state (world size 1, if not yet), then the model.  Megatron
    must have imported patched by the dump spec, else nothing would be dumped."""
    build = load_builder(builder)  # first: a builder that cannot import fails before Megatron loads
    import megatron.core.transformer.transformer_layer as layer
    import torch.distributed as dist
    from megatron.core import parallel_state

    if "__sp__" not in vars(layer):
        raise ReplayError("Megatron's TransformerLayer is not patched: SOURCE_PATCH=megatron_cpu,dump must apply "
                          f"before Megatron imports (is the start hook installed? {commands.command('hook', 'status')})")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    try:
        return build(checkpoint).eval()
    except Exception as exc:  # noqa: BLE001 - the user's builder, or the twin on odd weights: one line, exit 2
        raise ReplayError(f"{_who(builder, checkpoint)}: building the model failed: {_said(exc)}") from None


def _dump_rows(dump, rid: str, tokens: list) -> None:
    """The row map of a one-request batch, in the activations' [s, b=1] layout."""
    import torch

    column = torch.tensor(tokens).unsqueeze(1)
    dump.dump("input_ids", column)
    dump.dump("positions", torch.arange(len(tokens)).unsqueeze(1))
    dump.dump("row_request", torch.zeros_like(column, dtype=torch.int32), rids=[rid])


def _forward(model, tokens: list, who: str):
    """Logits ``[s, vocab]`` (float32, on the CPU) of one sequence; a model that returns
    anything else is a ReplayError (its log-probs would be an IndexError)."""
    import torch

    from . import twin

    out = twin.logits(model, [tokens])
    if not (isinstance(out, torch.Tensor) and out.dim() == 3 and tuple(out.shape[:2]) == (1, len(tokens))
            and out.shape[2] > max(tokens) and out.is_floating_point()):
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ReplayError(f"{who}: the model returned {got} for {len(tokens)} tokens, expected float logits "
                          f"[1, {len(tokens)}, vocab] with vocab > {max(tokens)}")
    return out[0].float().cpu()


def _routes(folder, requests: dict, config: dict | None = None) -> dict:
    """``{rid: RoutingRecord}`` of the rollout's requests that have one (SGLang's own
    probes, for one, have none: they run as the model routes them), each checked against
    its request's length and, for the twin, the config's experts and layers."""
    from ..routing.sglang.files import merge_rank_files

    try:
        records = merge_rank_files(folder)
    except ValueError:
        raise  # RoutingRecordError: already one line naming the file
    except Exception as exc:  # noqa: BLE001 - a record nothing foresaw: one line, not a traceback
        raise ReplayError(f"--routes {folder}: unreadable routing records ({_said(exc)})") from None
    found = {rid: records[rid] for rid in requests if rid in records}
    if not found:
        raise ReplayError(f"--routes {folder}: no routing record of any of the rollout's {len(requests)} requests")
    for rid, record in found.items():
        _check_route(folder, rid, record, len(requests[rid]), config)
    return found


def _check_route(folder, rid, record, length: int, config: dict | None) -> None:
    """A request's routing record fits its tokens (the engine never feeds back its last
    one: one fewer is fine) and, for the twin, the model's experts, top-k and layers."""
    said = f"--routes {folder}: request {rid!r}'s record"
    if not length - 1 <= record.num_tokens <= length:
        raise ReplayError(f"{said} has {record.num_tokens} tokens, the rollout {length}")
    if config is None:
        return
    experts = config.get("num_experts") or config["num_local_experts"]
    if record.num_experts > experts or record.topk != config["num_experts_per_tok"] or \
            max(record.layers) >= config["num_hidden_layers"]:
        raise ReplayError(f"{said} (num_experts {record.num_experts}, topk {record.topk}, layers up to "
                          f"{max(record.layers)}) does not fit config.json (num_experts {experts}, "
                          f"num_experts_per_tok {config['num_experts_per_tok']}, "
                          f"num_hidden_layers {config['num_hidden_layers']})")


@contextlib.contextmanager
def _replaying(record, length: int, probs: bool):
    """Megatron's routers route the next forward as ``record`` says (nothing without one)."""
    if record is None:
        yield
        return
    from ..routing.align import BatchLayout, align_to_megatron
    from ..routing.megatron import control as routing, replay as routing_replay

    layout = BatchLayout.padded([(record.sample_ids[0], length)])
    # The engine never feeds back its last token: a record may be one token short.
    routing_replay.set_replay({(0, 0): align_to_megatron([record], layout, layer_offset=1, missing_tail=1)})
    routing.set_position(step=0, microbatch=0)
    routing.configure(mode="replay", replay_probs=probs)
    try:
        yield
    finally:
        routing.configure(mode="off")


def _inputs(rollout, checkpoint, builder, routed, requests: dict, tokens=None) -> dict:
    """What ``replay.json`` records (shown in the comparator's reports; a few short values:
    the comparator reads at most 64 KiB of it)."""
    hits = {rid: n for rid, n in getattr(requests, "cached", {}).items() if n}
    return {"replayed rollout": str(rollout), "checkpoint": str(checkpoint), "model builder": builder or TWIN,
            "routes": routed,
            "requests": len(requests), "tokens": sum(map(len, requests.values())),
            **({"token ids": f"from --tokens {tokens} ({len(getattr(requests, 'given', ()))} of the requests), "
                             "else from the rollout's dumps"}
               if tokens else {}),
            **({"prefix cache": f"{sum(hits.values())} of {sum(len(requests[r]) for r in hits)} positions of "
                                f"{len(hits)} requests came from the engine's prefix cache: compared on the "
                                "training side only"} if hits else {}),
            "replay versions": compare.versions(), "replayed at": time.strftime("%Y-%m-%d %H:%M:%S %z")}


if __name__ == "__main__":
    sys.exit(main())
