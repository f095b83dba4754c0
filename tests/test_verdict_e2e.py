"""Issue 53's first Show item, end to end: a real SGLang engine with the radix cache on
rolls out a GRPO group, two Megatron-Core ranks (expert parallel 2 over gloo) train on
it through Megatron's own schedule, and `source-patch compare` finds no divergence.

The engine (a real SGLang server on CPU, tiny random Qwen3-MoE, radix cache on: no
--disable-radix-cache) runs with the `routing` (capture) and `dump` specs and serves
one prompt 4 times at temperature 1, the first alone so the other three find the prompt
in its prefix cache, with return_prompt_token_ids.  The trainer
(tests/e2e/verdict_trainer.py, two processes under SOURCE_PATCH=megatron_cpu,routing,dump)
loads the Megatron twin of the same checkpoint, its 8 experts split over the 2 EP ranks,
and runs a forward-only pass (old log-probs) and a forward-backward pass over 2
micro-batches of 2 samples (right-padded [24, 2]) through `get_forward_backward_func()`,
naming each micro-batch's rows with `source_patch.batch(...)` inside forward_step_func.
Rank 0 takes the micro-batches [g0, g1], [g2, g3] and rank 1 [g2, g3], [g0, g1]: every
rank trains the whole group (each rank's dumps alone pair with the rollout), and in each
micro-batch the two ranks' experts exchange other requests' tokens.

Run A: our routing replay (`routing` mode replay, the engine's records given by
`replay.set_requests(folder)`).  Run B: Megatron-Core's own `RouterReplay`
(`moe_enable_routing_replay=True`), fed the engine's routes aligned to each micro-batch
by the trainer, our `routing` spec only capturing.  Either way: every router routes every
token the engine routed as the engine did, the routing agreement is 100% in every layer,
and `source-patch compare ROLLOUT TRAIN --json-out` exits 0 with no divergent row, the
cached prefix rows counted (equal to the sum of SGLang's cached_tokens), not compared.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_replay_radix import wait_for_rows

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "e2e" / "verdict_trainer.py"
PROMPT = [11, 23, 5, 88, 140, 7, 301, 42, 9, 64, 17, 3, 250, 77]
NEW = {"g0": 6, "g1": 4, "g2": 5, "g3": 3}  # GRPO samples end at different lengths (EOS ignored here)
SEQ_LEN = 24                                # the padded row: longer than the longest sample (20)
MICRO_BATCHES = ([["g0", "g1"], ["g2", "g3"]], [["g2", "g3"], ["g0", "g1"]])  # per rank
WORLD = 2
EXPERTS, TOPK = 8, 2  # tiny_checkpoint()'s
TIMEOUT = 420


# ------------------------------------------------------------------ the rollout


def serve_group(server, run: Path) -> list:
    """The GRPO group through /generate (g0 alone, then g1-g3 together: they find the
    prompt in the radix cache); the replies in order, once every computed row and every
    routing record is on disk."""
    assert server.post("/flush_cache")[0] == 200
    replies = []
    for rids in (["g0"], ["g1", "g2", "g3"]):
        body = {"input_ids": [PROMPT] * len(rids), "rid": rids, "return_prompt_token_ids": True,
                "sampling_params": [{"temperature": 1.0, "max_new_tokens": NEW[r], "ignore_eos": True}
                                    for r in rids]}
        status, out = server.post("/generate", body)
        assert status == 200, out
        replies += out
    wait_for_rows(run, replies)
    return replies


@pytest.fixture(scope="module")
def runs(sglang_cpu, sglang_server, sglang_checkpoint, shared_code_cache, tmp_path_factory):
    """(run folder, the engine's /generate replies, {"ours": [rank results], "megatron": ...}).

    Run A (our replay) and run B (Megatron's RouterReplay, our routing capturing) start
    first, side by side (4 processes: importing Megatron and building the twin overlap
    the engine's start), and wait for the plan the rollout makes."""
    pytest.importorskip("megatron.core")
    run = tmp_path_factory.mktemp("sp-verdict-e2e")
    env = {"SOURCE_PATCH_CACHE": str(shared_code_cache)}  # the patched modules compiled once a session
    started = {"ours": train(run, sglang_checkpoint, "train-ours", "ours", "replay", env),
               "megatron": train(run, sglang_checkpoint, "train-megatron", "megatron", "capture", env)}
    try:
        engine_env = {"SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "rollout",
                      "SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture",
                      "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(run / "routes")}
        server = sglang_server(specs=["routing", "dump"], args=["--skip-server-warmup"], env=engine_env)
        status, info = server.get("/get_server_info")
        assert status == 200 and not info["disable_radix_cache"], info
        replies = serve_group(server, run)
        write_plan(run, replies)
        return run, replies, {kind: finish(procs, run, f"train-{kind}") for kind, procs in started.items()}
    finally:
        for proc in [p for procs in started.values() for p in procs]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def write_plan(run: Path, replies: list) -> Path:
    """What the trainers wait for: the engine's routing records folder, and each sample's
    rid and token ids as the engine returned them (written whole: a rename)."""
    plan = {"routes": str(run / "routes"), "seq_len": SEQ_LEN,
            "samples": [{"rid": r["meta_info"]["id"], "prompt_ids": r["prompt_token_ids"],
                         "output_ids": r["output_ids"]} for r in replies],
            "micro_batches": MICRO_BATCHES}
    path = run / "plan.json"
    (run / "plan.json.tmp").write_text(json.dumps(plan))
    os.replace(run / "plan.json.tmp", path)
    return path


# ------------------------------------------------------------------ the trainer


def train(run: Path, checkpoint, name: str, replay: str, routing_mode: str, extra: dict | None = None) -> list:
    """The two ranks of tests/e2e/verdict_trainer.py started, dumping into run/dumps/NAME;
    they wait for run/plan.json."""
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,routing,dump", "PYTHONWARNINGS": "ignore",
           "SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": name,
           "SOURCE_PATCH_DUMP_ENABLE": "1", "SOURCE_PATCH_ROUTING_MODE": routing_mode,
           "SOURCE_PATCH_ROUTING_DIR": str(run / f"{name}-routes") if routing_mode == "capture" else "",
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop("SOURCE_PATCH_DUMP_PORT", None)
    return [subprocess.Popen([sys.executable, str(TRAINER), str(run / "plan.json"), "--checkpoint", str(checkpoint),
                              "--rank", str(rank), "--world", str(WORLD), "--store", str(run / f"{name}.store"),
                              "--replay", replay, "--wait", str(TIMEOUT), "--out", str(run / f"{name}-{rank}.json")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            for rank in range(WORLD)]


def finish(procs, run: Path, name: str) -> list:
    """Both ranks' results (RESULT.json), once they exited 0."""
    logs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"{name} rank {rank} exited {proc.returncode}:\n{log[-6000:]}"
    return [json.loads((run / f"{name}-{rank}.json").read_text()) for rank in range(WORLD)]


def cli_compare(run: Path, name: str, tmp_path: Path) -> tuple:
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "source_patch.patcher", "compare", str(run / "dumps" / "rollout"),
                           str(run / "dumps" / name), "--json-out", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


# ------------------------------------------------------------------ the checks


def expected_routes(run: Path, result: dict) -> dict:
    """{(phase, micro-batch, Megatron layer): (the experts of every token of the router's
    [s, b] seq-major order, whether the engine routed it)}.  Where the engine routed
    nothing (padding, and the last generated token: never fed back) a replay gives the
    filler experts ``(t * topk + j) % experts`` of routing/align.py's ``spread`` (the
    trainer's Megatron feed uses the same): the twin's own router, with the engine's
    weights, would route the real tokens as the engine did anyway, so those positions
    are what shows that a replay ran."""
    from source_patch.runtime.routing.sglang.files import merge_rank_files

    records = merge_rank_files(run / "routes")
    out = {}
    for m, mb in enumerate(result["batches"]):
        for layer in (1, 2):
            want = []
            for s in range(SEQ_LEN):
                for row, rid in enumerate(mb["rids"]):
                    ids = records[rid].indices[layer - 1]
                    t = s * len(mb["rids"]) + row
                    want.append((sorted(ids[s].tolist()), True) if s < ids.shape[0] else
                                (sorted((t * TOPK + j) % EXPERTS for j in range(TOPK)), False))
            for phase in ("fwd_only", "fwd_bwd"):
                out[f"{phase}/{m}/{layer}"] = want
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ours", "megatron"])
def test_two_ep_ranks_replay_the_engines_routes_and_compare_clean(runs, kind, tmp_path):
    run, replies, results = runs
    results = results[kind]
    cached = {r["meta_info"]["id"]: r["meta_info"]["cached_tokens"] for r in replies}
    assert cached["g0"] == 0 and all(cached[g] > 0 for g in ("g1", "g2", "g3")), cached
    assert all(r["prompt_token_ids"] == PROMPT for r in replies)
    assert [len(r["output_ids"]) for r in replies] == list(NEW.values())

    # Two ranks, expert parallel 2 (each a data-parallel rank), every router call replayed.
    for rank, result in enumerate(results):
        assert (result["rank"], result["ep"], result["dp"]) == (rank, 2, 2)
        assert result["grads_finite"] and result["grads"] > 0
        assert result["routing_mode"] == ("replay" if kind == "ours" else "capture")
        want = expected_routes(run, result)
        assert sorted(result["chosen"]) == sorted(want)  # 2 passes x 2 micro-batches x 2 layers
        routed = filled = 0
        for key, experts in want.items():
            got = result["chosen"][key]
            assert len(got) == len(experts) == SEQ_LEN * 2, key
            for t, (g, (w, real)) in enumerate(zip(got, experts)):
                assert g == w, (rank, key, t, "engine's" if real else "filler")
                routed += real
                filled += not real
        assert routed == 2 * 2 * sum(len(PROMPT) + n - 1 for n in NEW.values())  # passes x layers x tokens
        assert routed + filled == len(want) * SEQ_LEN * 2 and filled > 0
        # the old log-probs (forward only) are the training pass's, bitwise
        assert result["logps"]["fwd_only"] == result["logps"]["fwd_bwd"]

    # The verdict through the CLI: no divergence, the cached prefix counted, not compared.
    proc, report = cli_compare(run, f"train-{kind}", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.endswith("no divergence\n"), proc.stdout + proc.stderr
    hits = sum(cached.values())
    check(report, hits, proc.stdout)
    assert f"{len(NEW)} rows only in B ({run / 'dumps' / f'train-{kind}'}): not compared" in report["not_compared"]
    worst = max(row["rel_l2"] for row in report["rows"])

    # Each rank's dumps alone (a rank folder): every row the engine computed, paired again.
    from source_patch.runtime.verdict import compare

    for rank in range(WORLD):
        alone = compare.compare(str(run / "dumps" / "rollout"), str(run / "dumps" / f"train-{kind}" / f"rank-{rank}"))
        check(alone.to_json(), hits, alone.table())
    agreement = {row["layer"]: row["agreement"] for row in report["routing"]["per_layer"]}
    print(f"\n{kind}: routing agreement {agreement}, max rel L2 {worst:.3g}, prefix-cache rows "
          f"{report['prefix_cache_rows']} (cached_tokens {cached}), tokens paired {report['tokens_paired']}, "
          f"log-probs {report['logprobs']['line']}")


def check(report: dict, hits: int, table: str) -> None:
    """No divergent row, 100% routing agreement in both layers, every row the engine
    computed paired, the rows it took from its prefix cache counted (not compared)."""
    assert report["first_divergent"] is None, table
    assert all(row["ok"] for row in report["rows"]), table
    names = {row["name"] for row in report["rows"]}
    assert {"layer_input", "attention_output", "mlp_output", "final_hidden", "logits"} <= names, names
    assert {row["layer"]: row["agreement"] for row in report["routing"]["per_layer"]} == {0: 1.0, 1: 1.0}, table
    assert report["routing"]["tokens_differing_any_layer"] == 0, table
    assert report["prefix_cache_rows"] == hits, table  # SGLang's cached_tokens, summed: not compared
    assert report["requests"] == len(NEW)
    # the rows the engine computed (the last token of each never fed back), all of them paired
    assert report["tokens_paired"] == sum(len(PROMPT) + n - 1 for n in NEW.values()) - hits, table
    assert report["logprobs"]["max_abs_diff"] < 1e-4, table
