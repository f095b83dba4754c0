"""Replay a rollout's tokens through a Megatron model under the dump spec: the
training side's dumps of the same tokens, for ``source-patch compare``.

    source-patch replay ROLLOUT_DUMPS --checkpoint CKPT [--out sp-replay] [--routes DIR [--replay-probs]]
                        [--builder MODULE:FUNCTION] [--logprobs FILE] [--compare] [--html F] [--json F]

    from source_patch.runtime import replay
    train = replay.replay(rollout_dumps, checkpoint, out="sp-replay")  # a child process; the new run's folder

Each request of the rollout (its tokens read back from the rollout's ``input_ids`` /
``positions`` / ``row_request`` dumps: the prompt and every generated token the engine
fed back) is one forward pass of the model and one dump step, with ``row_request`` /
``positions`` / ``input_ids`` records in Megatron's ``[s, b]`` layout, so the comparator
pairs every row.  With ``routes`` (the rollout's routing records, ``routing`` capture) each
request is routed as the engine routed it: its expert ids replayed, the combine weights
recomputed from the model's scores, or the engine's own with ``replay_probs``.

The model is the Megatron twin of the checkpoint (``weight_sync/twin.py``) unless a builder
is given, ``package.module:function`` or ``path/to/file.py:function``: called as
``function(checkpoint)`` once Megatron's parallel state is initialised (world size 1), it
returns a model called as ``model(input_ids, position_ids, attention_mask=None)`` (both
``[1, s]``) that returns logits ``[1, s, vocab]``, as Megatron's ``GPTModel`` does.

The forward runs in a child process under ``SOURCE_PATCH=megatron_cpu,dump`` (plus
``routing`` with routes; the start hook applies them before Megatron imports), into a new run
``replay-<time>`` under ``out`` that also holds ``replay.json``: what was replayed, the
versions and the time, which the comparator's reports show.  This module imports
nothing heavy until the replay runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .dump import compare, reader

SPECS = ("megatron_cpu", "dump")
TWIN = "source_patch.runtime.weight_sync.twin:build"
# The worker's entry: a fresh interpreter, so the start hook applies SOURCE_PATCH first.
_WORKER = "import sys; from source_patch.runtime.replay import work; sys.exit(work(sys.argv[1]))"


class ReplayError(RuntimeError):
    """The replay cannot run as asked (said in one line)."""


class Stopped(ReplayError):
    """The worker process stopped and has said why on stderr, in one line."""


def main(argv=None, prog: str = "python -m source_patch.runtime.replay") -> int:
    args = parser(prog).parse_args(argv)
    try:
        rollout = reader.choose_for_cli(args.rollout, args.exp_name, "replay")
        reader.rank_dirs(rollout)  # dumps there, before anything starts
        reports = args.compare or args.html or args.json
        if reports:
            for flag, path in (("--json", args.json), ("--html", args.html)):
                compare.check_output(flag, path)  # before the replay, not after it
        train = replay(rollout, args.checkpoint, args.out, builder=args.builder, routes=args.routes,
                       replay_probs=args.replay_probs, logprobs=args.logprobs)
    except Stopped:
        return 2
    except (OSError, ValueError, ReplayError) as exc:
        return _fail(exc)
    print(f"training-side dumps: {train}", flush=True)
    if not reports:
        print(f"compare: source-patch compare {rollout} {train} --html {train / 'report.html'}")
        return 0
    return compare.report(rollout, train, args)


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Replay a rollout's tokens through the Megatron twin of "
                                "its checkpoint (or your model) under the dump spec: training-side dumps for "
                                "`source-patch compare`; compare them too with --compare, --html or --json. "
                                "Exit 0 (with a comparison: 0 no divergence, 1 divergence), 2 on an error.")
    p.add_argument("rollout", help="the rollout's dumps: a dump root (its latest run), a run or a rank folder")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="the Hugging Face checkpoint the engine served")
    p.add_argument("--exp-name", metavar="NAME", help="the rollout's run to read under a dump root")
    p.add_argument("--out", default="sp-replay", metavar="DIR",
                   help="dump root of the replay's run (default sp-replay)")
    p.add_argument("--routes", metavar="DIR", help="replay the rollout's routing records (routing capture) from DIR")
    p.add_argument("--replay-probs", action="store_true",
                   help="with --routes: replay the engine's combine weights too, not only its expert ids")
    p.add_argument("--builder", metavar="MODULE:FUNCTION",
                   help=f"your model: FUNCTION(checkpoint) -> a Megatron GPTModel (MODULE may be a .py file; "
                        f"default {TWIN})")
    p.add_argument("--logprobs", metavar="FILE", help="write the model's per-token log-probs here as JSON")
    p.add_argument("--compare", action="store_true", help="then compare the rollout with the replay "
                   "(--html and --json imply it)")
    compare.add_report_arguments(p)
    return p


def replay(rollout, checkpoint, out="sp-replay", *, builder: str | None = None, routes=None,
           replay_probs: bool = False, logprobs=None, exp_name: str | None = None) -> Path:
    """Replay ``rollout`` (a run or rank folder of rollout dumps) through the model of
    ``checkpoint`` in a child process; returns the new run's folder under ``out``."""
    if not (Path(checkpoint) / "config.json").is_file():
        raise ReplayError(f"--checkpoint {checkpoint}: no config.json there (a Hugging Face checkpoint folder)")
    if routes is not None and not Path(routes).is_dir():
        raise ReplayError(f"--routes {routes}: no such folder")
    run = _new_run(Path(out).resolve(), exp_name)
    job = {"rollout": str(Path(rollout).resolve()), "checkpoint": str(Path(checkpoint).resolve()),
           "builder": builder, "routes": routes and str(Path(routes).resolve()), "replay_probs": replay_probs,
           "logprobs": logprobs and str(Path(logprobs).resolve()), "dir": str(run.parent), "exp_name": run.name}
    env = {**os.environ, "SOURCE_PATCH": ",".join(SPECS + (("routing",) if routes else ()))}
    code = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(job)], env=env).returncode
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
    line on stderr when it cannot run."""
    import warnings

    job = json.loads(job)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no TE/Apex on CPU, said 7 times
    try:
        logps = replay_here(job["rollout"], job["checkpoint"], builder=job["builder"], routes=job["routes"],
                            replay_probs=job["replay_probs"], dir=job["dir"], exp_name=job["exp_name"])
    except (OSError, ValueError, ReplayError) as exc:  # DumpError, RoutingRecordError: ValueErrors
        return _fail(exc)
    if job["logprobs"]:
        Path(job["logprobs"]).write_text(json.dumps(logps))
    return 0


def replay_here(rollout, checkpoint, *, builder: str | None = None, routes=None, replay_probs: bool = False,
                dir=None, exp_name: str | None = None) -> dict:
    """The replay in this process, which Megatron must import into patched by ``megatron_cpu``
    and ``dump`` (and ``routing`` with routes).  Dumps into ``dir``/``exp_name`` (else where the
    dump settings say); returns ``{rid: [log p(token i | tokens before it) for i >= 1]}``."""
    from .dump import api as dump

    started = time.monotonic()
    requests = sequences(rollout)
    records = _routes(routes, requests) if routes else {}
    model = _build(builder, checkpoint)
    selection = dict.fromkeys(("names", "layers", "steps", "ranks", "phases"), "")  # the comparator needs all
    dump.configure(enable=True, **selection, **({"dir": str(dir), "exp_name": exp_name} if dir else {}))
    logps = _forwards(dump, model, requests, records, replay_probs)
    routed = f"{'ids and weights' if replay_probs else 'expert ids'} of {len(records)} of {len(requests)} " \
             f"requests replayed from {routes}" if routes else "not replayed (the model routes)"
    inputs = _inputs(rollout, checkpoint, builder, routed, requests)
    (Path(dump.state()["exp_dir"]) / compare.INPUTS).write_text(json.dumps(inputs, indent=1))
    print(f"replayed {len(requests)} requests ({inputs['tokens']} tokens) through {inputs['model builder']} "
          f"in {time.monotonic() - started:.1f} s; routes: {routed}", flush=True)
    return logps


def _forwards(dump, model, requests: dict, records: dict, replay_probs: bool) -> dict:
    """One forward and one dump step per request (by request id); their log-probs."""
    import torch

    from .dump.logprobs import token_logprobs

    dump.dump_context(phase="fwd_only")
    logps = {}
    for step, (rid, tokens) in enumerate(sorted(requests.items())):
        dump.dump_step(step=step)
        _dump_rows(dump, rid, tokens)
        with _replaying(records.get(rid), len(tokens), replay_probs):
            logits = _forward(model, tokens)
        # dtype: a one-token request (SGLang's health probe) has no targets, still token ids
        logps[rid] = token_logprobs(logits[:-1], torch.tensor(tokens[1:], dtype=torch.long)).tolist()
    dump.flush()
    return logps


def _fail(exc: BaseException) -> int:
    print(f"replay: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return 2


def sequences(rollout) -> dict:
    """``{rid: token ids by position}`` of every request the rollout's dumps hold rows of."""
    rows = compare.index_rows(compare.load(rollout, ["input_ids", "positions", "row_request"]))
    by_request: dict = {}
    for (rid, position), token in rows.get(("input_ids", None), {}).items():
        by_request.setdefault(rid, {})[position] = int(token.reshape(-1)[0])
    if not by_request:
        raise ReplayError(f"{rollout}: no input_ids, positions and row_request records (dumped under "
                          "patches/dump.yaml?)")
    for rid, tokens in by_request.items():
        if len(tokens) != max(tokens) + 1:
            gaps = sorted(set(range(max(tokens) + 1)) - set(tokens))
            raise ReplayError(f"request {rid!r}: the rollout's dumps have no rows at positions {gaps[:8]} "
                              "(a prefix-cache hit? serve with --disable-radix-cache)")
    return {rid: [tokens[p] for p in range(len(tokens))] for rid, tokens in by_request.items()}


def load_builder(spec: str | None):
    """The model builder ``package.module:function`` or ``file.py:function`` names (the twin's
    by default)."""
    import importlib
    import importlib.util

    module_name, _, function = (spec or TWIN).rpartition(":")
    if not module_name or not function:
        raise ReplayError(f"--builder {spec}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if module_name.endswith(".py"):
        found = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if found is None or not Path(module_name).is_file():
            raise ReplayError(f"--builder {spec}: no file {module_name}")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not callable(getattr(module, function, None)):
        raise ReplayError(f"--builder {spec}: {module_name} has no function {function!r}")
    return getattr(module, function)


def _build(builder: str | None, checkpoint):
    """Megatron's parallel state (world size 1, if not yet), then the model.  Megatron
    must have imported patched by the dump spec, else nothing would be dumped."""
    import megatron.core.transformer.transformer_layer as layer
    import torch.distributed as dist
    from megatron.core import parallel_state

    build = load_builder(builder)
    if "__sp__" not in vars(layer):
        raise ReplayError("Megatron's TransformerLayer is not patched: SOURCE_PATCH=megatron_cpu,dump must apply "
                          "before Megatron imports (is the start hook installed? `source-patch hook status`)")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return build(checkpoint).eval()


def _dump_rows(dump, rid: str, tokens: list) -> None:
    """The row map of a one-request batch, in the activations' [s, b=1] layout."""
    import torch

    column = torch.tensor(tokens).unsqueeze(1)
    dump.dump("input_ids", column)
    dump.dump("positions", torch.arange(len(tokens)).unsqueeze(1))
    dump.dump("row_request", torch.zeros_like(column, dtype=torch.int32), rids=[rid])


def _forward(model, tokens: list):
    """Logits ``[s, vocab]`` (float32, on the CPU) of one sequence."""
    from .weight_sync import twin

    return twin.logits(model, [tokens])[0].float().cpu()


def _routes(folder, requests: dict) -> dict:
    """``{rid: RoutingRecord}`` of the rollout's requests that have one (SGLang's own
    probes, for one, have none: they run as the model routes them)."""
    from .routing.sglang import merge_rank_files

    records = merge_rank_files(folder)
    found = {rid: records[rid] for rid in requests if rid in records}
    if not found:
        raise ReplayError(f"--routes {folder}: no routing record of any of the rollout's {len(requests)} requests")
    return found


@contextlib.contextmanager
def _replaying(record, length: int, probs: bool):
    """Megatron's routers route the next forward as ``record`` says (nothing without one)."""
    if record is None:
        yield
        return
    from .routing import megatron as routing
    from .routing.align import BatchLayout, align_to_megatron

    layout = BatchLayout.padded([(record.sample_ids[0], length)])
    # The engine never feeds back its last token: a record may be one token short.
    routing.set_replay({(0, 0): align_to_megatron([record], layout, layer_offset=1, missing_tail=1)})
    routing.set_position(step=0, microbatch=0)
    routing.configure(mode="replay", replay_probs=probs)
    try:
        yield
    finally:
        routing.configure(mode="off")


def _inputs(rollout, checkpoint, builder, routed, requests: dict) -> dict:
    """What ``replay.json`` records (shown in the comparator's reports)."""
    return {"replayed rollout": str(rollout), "checkpoint": str(checkpoint), "model builder": builder or TWIN,
            "routes": routed,
            "requests": len(requests), "tokens": sum(map(len, requests.values())),
            "replay versions": compare.versions(), "replayed at": time.strftime("%Y-%m-%d %H:%M:%S %z")}


if __name__ == "__main__":
    sys.exit(main())
