"""Roll out with a real SGLang engine under source patches, then show what it recorded.

    make rollout          # or: python examples/rollout_sglang.py [--prompts 4] [--new-tokens 8]

Starts the offline ``sglang.Engine`` (scheduler and detokenizer as spawned processes)
on a tiny random Qwen3-MoE checkpoint, on CPU, with three specs active in every engine
process:

    sglang_cpu   lifts SGLang's CUDA assumptions (patches/sglang_cpu.yaml)
    moe          captures each request's routed experts (patches/moe.yaml)
    dump         dumps every forward pass's activations (patches/dump.yaml)

then generates a few prompts and prints the dump summary and one request's routing
record.  Everything lands under --out (default ./sp-rollout).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Hello world", "Megatron trains, SGLang serves", "this is a test"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sp-rollout", help="where dumps, routes and logs go")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    cli = p.parse_args()

    from source_patch.patcher.sglang_harness import SGLangEngine, tiny_checkpoint
    from source_patch.runtime.dump import reader
    from source_patch.runtime.routing import record

    out = Path(cli.out).resolve()
    run = out / time.strftime("rollout-%Y%m%d-%H%M%S")
    print(f"checkpoint: {(model := tiny_checkpoint())}")
    env = {"SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "rollout",
           "SOURCE_PATCH_SGLANG_ROUTING_MODE": "capture", "SOURCE_PATCH_SGLANG_ROUTING_DIR": str(run / "routes")}
    started = time.monotonic()
    print("starting sglang.Engine (sglang_cpu, moe, dump) ...", flush=True)
    with SGLangEngine(model, specs=["moe", "dump"], env=env, workdir=run,
                      engine_args={"skip_tokenizer_init": False, "disable_radix_cache": True}) as engine:
        print(f"engine ready in {time.monotonic() - started:.1f} s (log: {run / 'engine.log'})")
        prompts = (PROMPTS * cli.prompts)[:cli.prompts]
        started = time.monotonic()
        outputs = engine.call("generate", prompt=prompts, sampling_params={
            "temperature": 0.0, "max_new_tokens": cli.new_tokens, "ignore_eos": True})
        print(f"generated {cli.prompts} x {cli.new_tokens} tokens in {time.monotonic() - started:.2f} s")
        for prompt, result in zip(prompts, outputs):  # random weights: the tokens, not noise text
            ids = result.get("output_ids") or result["meta_info"].get("output_ids")
            print(f"  {prompt!r} -> {ids if ids else repr(result['text'])}  (rid {result['meta_info']['id'][:8]})")
    print(f"\ndumps: {run / 'dumps' / 'rollout'}")
    print(reader.summary(reader.load(run / "dumps" / "rollout")))
    routes = sorted((run / "routes").rglob("*.safetensors"))
    print(f"\nrouting records: {len(routes)} (one per request) in {run / 'routes'}")
    if routes:
        print(record.describe(routes[0]))
    return 0 if routes else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
