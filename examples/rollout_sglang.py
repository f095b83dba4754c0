"""Roll out with a real SGLang engine under source patches, then show what it recorded.

    make rollout [SPECS=my.yaml,other]   # or: python examples/rollout_sglang.py [--spec FILE]... [--prompts 4]

Starts the offline ``sglang.Engine`` (scheduler and detokenizer as spawned processes)
on a tiny random Qwen3-MoE checkpoint, on CPU, with three specs active in every engine
process:

    sglang_cpu   lifts SGLang's CUDA assumptions (patches/sglang_cpu.yaml)
    routing      captures each request's routed experts (patches/routing.yaml)
    dump         dumps every forward pass's activations (patches/dump.yaml)

and any spec of your own given with ``--spec`` (a file or a bundled name, repeatable;
``make rollout SPECS=a.yaml,b.yaml``), then generates a few prompts and prints the dump
summary, one request's routing record and the two commands that replay the rollout
through the Megatron twin of the checkpoint and compare both sides (docs/compare.md),
each runnable as printed from a fresh shell.  Everything lands under --out (default
./sp-rollout).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Hello world", "Megatron trains, SGLang serves", "this is a test"]
SPECS = ["routing", "dump"]  # + sglang_cpu, which the harness adds
ENGINE_ARGS = {"skip_tokenizer_init": False, "disable_radix_cache": True}  # every prompt prefilled whole


def engine_env(run: Path) -> dict:
    """The engine's settings: dumps into run/dumps/rollout, routing records into run/routes,
    every engine process's patch report into run/reports (its schedulers are killed at
    shutdown: they write theirs as they import)."""
    return {"SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "rollout",
            "SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(run / "routes"),
            "SOURCE_PATCH_REPORT_DIR": str(run / "reports")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sp-rollout", help="where dumps, routes and logs go")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--spec", action="append", default=[], metavar="SPEC",
                   help="one more spec for every engine process: a file or a bundled name (repeatable; "
                        "comma-separated lists too)")
    cli = p.parse_args()

    from source_patch.patcher import SourcePatchError
    from source_patch.testing.sglang import SGLangEngine, tiny_checkpoint

    try:
        specs = with_extra(SPECS, cli.spec)
    except SourcePatchError as exc:
        p.error(str(exc))
    run = Path(cli.out).resolve() / time.strftime("rollout-%Y%m%d-%H%M%S")
    print(f"checkpoint: {(model := tiny_checkpoint())}")
    started = time.monotonic()
    print(f"starting sglang.Engine ({', '.join(['sglang_cpu', *specs])}) ...", flush=True)
    with SGLangEngine(model, specs=specs, env=engine_env(run), workdir=run, engine_args=ENGINE_ARGS) as engine:
        print(f"engine ready in {time.monotonic() - started:.1f} s (log: {run / 'engine.log'})")
        roll_out(engine, cli.prompts, cli.new_tokens)
    return show(run, model)


def with_extra(specs: list, extra: list) -> list:
    """``specs`` and the user's own (``--spec``, each a file or a bundled name, or a comma-
    separated list of them: ``make rollout SPECS=a.yaml,b``), each once, files checked here:
    a typo fails now, not in an engine process after a minute of start-up."""
    from source_patch.patcher import load_spec

    added = [ref.strip() for value in extra for ref in value.split(",") if ref.strip()]
    for ref in added:
        load_spec(ref)  # a SpecError names the file, line and column
    return list(dict.fromkeys([*specs, *added]))


def roll_out(engine, prompts: int, new_tokens: int) -> list:
    """Generate ``prompts`` prompts greedily and print their tokens; the outputs."""
    texts = (PROMPTS * prompts)[:prompts]
    started = time.monotonic()
    outputs = engine.call("generate", prompt=texts, sampling_params={
        "temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True})
    print(f"generated {prompts} x {new_tokens} tokens in {time.monotonic() - started:.2f} s")
    for prompt, result in zip(texts, outputs):  # random weights: the tokens, not noise text
        ids = result.get("output_ids") or result["meta_info"].get("output_ids")
        print(f"  {prompt!r} -> {ids if ids else repr(result['text'])}  (rid {result['meta_info']['id'][:8]})")
    return outputs


def show(run: Path, checkpoint) -> int:
    """The dumps' summary, one routing record, and the commands that take them to a verdict
    (each runnable as printed: core/commands.py; the compare command is replay's own)."""
    from source_patch.runtime.verdict import replay
    from source_patch.runtime.core.commands import command
    from source_patch.runtime.dump import reader
    from source_patch.runtime.routing.records.describe import describe

    dumps = run / "dumps" / "rollout"
    print(f"\ndumps: {dumps}")
    print(reader.summary(reader.load(dumps)))
    routes = sorted((run / "routes").rglob("*.safetensors"))
    print(f"\nrouting records: {len(routes)} (one per request) in {run / 'routes'}")
    if routes:
        print(describe(routes[0]))
    if (run / "reports").is_dir():
        print(f"\nwhat each engine process patched: {command('report', run / 'reports')}")
    out = run / "replay"
    print("\nreplay the rollout through the Megatron twin of its checkpoint, then compare:")
    print(f"  {command('replay', dumps, '--checkpoint', checkpoint, '--routes', run / 'routes', '--out', out)}")
    print(f"  {replay.compare_command(dumps, out)}")
    return 0 if routes else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
