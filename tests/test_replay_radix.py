"""Issue 53, item 2: `source-patch replay` of a rollout served with SGLang's radix cache on.

A prefix-cache hit leaves the positions the engine took from its cache without rows in
the rollout's dumps.  With `--tokens FILE` (the token ids the engine returned: its
/generate replies, or {rid: {input_ids, output_ids}}) replay still runs each request's
whole sequence, checks the engine's tokens against every dumped input_ids row, and says
per request how many positions came from the cache; without it such a rollout is one
line naming --tokens.  The file is someone else's too: each bad one is one line naming
the file, the line, the request and the field, exit 2, nothing under --out, the worker
never started.  At the end (slow) a real SGLang server with the radix cache on serves a
GRPO-shaped group (one prompt, 4 samples at temperature 1, the first alone so the other
three hit the cache), dumps on, and its /generate replies replay through the Megatron
twin: the cached counts equal SGLang's meta_info cached_tokens, the training dumps hold
every position, and the comparison finds no divergence."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from test_hardening_dump import write_dump
from test_hardening_readers import within_a_second
from test_hardening_replay import make_checkpoint, refused

from source_patch.runtime.verdict import compare, replay

# r0: prompt [5, 6, 7] of which positions 0, 1 came from the cache; generated [8, 9] (9 never
# fed back). r1: [11, 12], every row dumped (no --tokens entry needed).
R0 = {"input_ids": [5, 6, 7], "output_ids": [8, 9]}


def rollout_rows(ids=(7, 8, 11, 12), positions=(2, 3, 0, 1), rids=("r0", "r1"), rows=(0, 0, 1, 1)):
    tags = {"step": 0, "rank": 0}
    return [["input_ids", tags, torch.tensor(ids)], ["positions", tags, torch.tensor(positions)],
            ["row_request", {**tags, "rids": list(rids)}, torch.tensor(rows, dtype=torch.int32)]]


@pytest.fixture
def cached(tmp_path):
    """(rollout dumps whose r0 took positions 0, 1 from the cache; a checkpoint of the tiny CONFIG)."""
    return write_dump(tmp_path / "rollout", rollout_rows()), make_checkpoint(tmp_path / "ckpt")


def tokens_file(tmp_path, *values, raw: bytes | None = None, name="tokens.jsonl"):
    """A --tokens file: each value one JSON line (or ``raw`` bytes)."""
    path = tmp_path / name
    path.write_bytes(raw if raw is not None else "".join(json.dumps(v) + "\n" for v in values).encode())
    return path


def reply(rid, prompt, output, **meta):
    """SGLang's /generate reply with return_prompt_token_ids."""
    return {"prompt_token_ids": prompt, "output_ids": output,
            "meta_info": {"id": rid, "prompt_tokens": len(prompt), "completion_tokens": len(output), **meta}}


# ------------------------------------------------------------------ what --tokens takes

@pytest.mark.parametrize("form", ["replies", "mapping", "batch", "sent-input-ids", "verl", "whole-sequence"])
def test_each_form_of_the_engines_tokens_replays_the_whole_sequence(tmp_path, cached, form):
    rollout, ckpt = cached
    values = {"replies": [reply("r0", [5, 6, 7], [8, 9], cached_tokens=2)],
              "mapping": [{"r0": R0}],
              "batch": [[reply("r0", [5, 6, 7], [8, 9], cached_tokens=2)]],
              "sent-input-ids": [{"input_ids": [5, 6, 7], "output_ids": [8, 9], "meta_info": {"id": "r0"}}],
              "verl": [{"rid": "r0", "prompt_ids": [5, 6, 7], "response_ids": [8, 9]}],
              "whole-sequence": [{"r0": {"tokens": [5, 6, 7, 8, 9]}}]}[form]
    requests, records = replay.check_inputs(rollout, ckpt, tokens=tokens_file(tmp_path, *values))
    assert dict(requests) == {"r0": [5, 6, 7, 8, 9], "r1": [11, 12]} and records == {}
    assert requests.cached == {"r0": 2, "r1": 0} and requests.given == {"r0"}
    assert replay.cached_lines(requests) == ["request 'r0': 2 of 5 positions came from the engine's prefix cache: "
                                             "compared on the training side only"]


def test_one_pretty_printed_object_and_the_engines_own_count(tmp_path, cached):
    rollout, ckpt = cached
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"r0": reply("r0", [5, 6, 7], [8, 9], cached_tokens=1)}, indent=2))
    requests, _ = replay.check_inputs(rollout, ckpt, tokens=path)
    assert requests.reported == {"r0": 1}
    assert replay.cached_lines(requests)[0].endswith("(the engine reported cached_tokens 1)")


def test_without_tokens_a_cached_prefix_is_one_line_naming_the_option(tmp_path, capsys, cached):
    rollout, ckpt = cached
    said = refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, said="request 'r0': the rollout's dumps have "
                   "no rows at positions [0, 1] (the engine's prefix cache?)")
    assert "--tokens FILE" in said
    other = tokens_file(tmp_path, {"r1": {"input_ids": [11], "output_ids": [12]}, "r2": R0})
    refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", other,
            said=f"request 'r0': the rollout's dumps have no rows at positions [0, 1] (the engine's prefix "
                 f"cache?): --tokens {other} has no entry for it")


@pytest.mark.parametrize("entry, said", [
    ({"input_ids": [5, 6, 4], "output_ids": [8, 9]}, "request 'r0' position 2: token id 7 in the rollout's "
                                                     "input_ids, 4 in --tokens"),
    ({"input_ids": [5, 6, 7], "output_ids": [9, 9]}, "request 'r0' position 3: token id 8 in the rollout's "
                                                     "input_ids, 9 in --tokens"),
    ({"input_ids": [5, 6, 7], "output_ids": []}, "request 'r0': the rollout's dumps have a row at position 3, "
                                                 "--tokens"),
    ({"input_ids": [5, 6, 7], "output_ids": [8, 9, 10]}, "request 'r0': the rollout's dumps have no rows at "
                                                         "positions [4], after its first row at position 2: not a "
                                                         "prefix-cache hit"),
])
def test_tokens_that_disagree_with_the_dumps_name_the_request_and_position(tmp_path, capsys, cached, entry, said):
    rollout, ckpt = cached
    refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", tokens_file(tmp_path, {"r0": entry}),
            said=said)


def test_a_gap_after_the_first_row_is_no_cache_hit(tmp_path, capsys):
    rollout = write_dump(tmp_path / "gap", rollout_rows(ids=(5, 8), positions=(0, 3), rids=("r0",), rows=(0, 0)))
    refused(tmp_path, capsys, rollout, "--checkpoint", make_checkpoint(tmp_path / "ckpt"), "--tokens",
            tokens_file(tmp_path, {"r0": R0}), said="request 'r0': the rollout's dumps have no rows at positions "
                                                   "[1, 2], after its first row at position 0")


# ------------------------------------------------------------------ hostile --tokens files

DEEP = b"[" * 100_000 + b"]" * 100_000
CASES = {
    "not-json": (b'{"r0": {"input_ids": [5, 6, 7], "output_ids": [8, 9]}}\n{"r1": \n', "line 2: not valid JSON"),
    "not-utf8": (b'{"r0": "\xff"}', "not UTF-8"),
    "deep": (DEEP, "nested deeper than 8 levels"),
    "a-number": (b"7", "line 1: a JSON int, expected an object"),
    "empty": (b"\n\n", "no requests there"),
    "entry-a-list": (json.dumps({"r0": [5, 6]}).encode(), "request 'r0': a JSON list, expected an object"),
    "float-id": (json.dumps({"r0": {"input_ids": [5, 6.0, 7], "output_ids": [8, 9]}}).encode(),
                 "request 'r0': input_ids[1] is 6.0, expected an integer token id >= 0"),
    "negative-id": (json.dumps({"r0": {"input_ids": [5, 6, 7], "output_ids": [8, -9]}}).encode(),
                    "request 'r0': output_ids[1] is -9, expected an integer token id >= 0"),
    "bool-id": (json.dumps({"r0": {"tokens": [5, True]}}).encode(), "tokens[1] is true"),
    "string-ids": (json.dumps({"r0": {"input_ids": "5 6 7", "output_ids": [8]}}).encode(),
                   "input_ids is a JSON str, expected a list of token ids"),
    "huge-int": (b'{"r0": {"input_ids": [' + b"9" * 5000 + b'], "output_ids": []}}', "line 1: not valid JSON"),
    "no-output": (json.dumps({"r0": {"input_ids": [5, 6, 7]}}).encode(),
                  "request 'r0': none of output_ids, response_ids"),
    "no-rid": (json.dumps({"input_ids": [5], "output_ids": [8]}).encode(), "no request id (meta_info.id or rid)"),
    "rid-a-number": (json.dumps(reply(7, [5], [8])).encode(), "meta_info.id is 7, expected a request id"),
    "rid-disagrees": (json.dumps({"r0": reply("r9", [5, 6, 7], [8, 9])}).encode(),
                      "request 'r0': meta_info.id is 'r9', another request"),
    "twice": (b"".join(json.dumps(reply("r0", [5, 6, 7], [8, 9])).encode() + b"\n" for _ in range(2)),
              "line 2: request 'r0' is there twice"),
    "counts-disagree": (json.dumps({**reply("r0", [5, 6, 7], [8, 9]), "meta_info": {
        "id": "r0", "prompt_tokens": 4, "completion_tokens": 2}}).encode(),
        "request 'r0': meta_info.prompt_tokens is 4, its token ids are 3"),
    "prompts-differ": (json.dumps({"r0": {"input_ids": [5, 6, 7], "prompt_token_ids": [1, 5, 6, 7],
                                          "output_ids": [8, 9]}}).encode(),
                       "request 'r0': prompt_token_ids and input_ids differ"),
    "too-long": (json.dumps({"r0": {"input_ids": [5] * 20_000, "output_ids": [8]}}).encode(),
                 "request 'r0': input_ids has 20000 tokens, more than 16384"),
    "past-vocab": (json.dumps({"r0": {"input_ids": [99, 6, 7], "output_ids": [8, 9]}}).encode(),
                   "request 'r0' position 0: token id 99 is outside"),
    "no-such-request": (json.dumps({"x0": R0}).encode(), "none of its 1 requests is in the rollout"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_tokens_file_is_one_line_naming_it(tmp_path, capsys, cached, case):
    raw, said = CASES[case]
    rollout, ckpt = cached
    path = tokens_file(tmp_path, raw=raw)
    line = refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", path, said=said, limit=10)
    if case != "past-vocab":  # names the rollout and config.json, as a dumped token past the vocabulary does
        assert f"--tokens {path}" in line, line


def test_a_tokens_file_over_the_limit_is_refused_unread(tmp_path, capsys, cached, monkeypatch):
    rollout, ckpt = cached
    monkeypatch.setattr(replay, "MAX_TOKENS_FILE_BYTES", 100)
    path = tokens_file(tmp_path, {"r0": {**R0, "pad": "x" * 200}})
    refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", path,
            said=f"--tokens: {path} is larger than 100 bytes")
    refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", tmp_path / "none.jsonl",
            said=f"--tokens: cannot open {tmp_path / 'none.jsonl'}")
    refused(tmp_path, capsys, rollout, "--checkpoint", ckpt, "--tokens", tmp_path, said="is not a regular file")


def test_a_fifo_at_tokens_is_refused_within_a_second(tmp_path, capsys, cached):
    from source_patch.patcher import cli

    rollout, ckpt = cached
    fifo = tmp_path / "tokens.fifo"
    os.mkfifo(fifo)
    argv = ["replay", str(rollout), "--checkpoint", str(ckpt), "--tokens", str(fifo), "--out", str(tmp_path / "out")]
    assert within_a_second(lambda: cli.main(argv), fifo, grace=20.0) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("source-patch: error: ") and "Traceback" not in err, err
    assert f"{fifo} is not a regular file" in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ a real engine, radix cache on

PROMPT = [11, 23, 5, 88, 140, 7, 301, 42, 9, 64, 17, 3, 250, 77]
NEW, SAMPLES = 6, 4


@pytest.fixture(scope="module")
def grpo_rollout(sglang_cpu, sglang_server, tmp_path_factory):
    """A real SGLang server (radix cache on: no --disable-radix-cache) with the dump and
    routing specs, serving one prompt 4 times at temperature 1 (sample 0 alone, then 1-3
    together: they find the prompt in the cache); (run folder, the /generate replies in
    order) once every request's rows and routing record are on disk."""
    pytest.importorskip("megatron.core")
    run = tmp_path_factory.mktemp("sp-radix") / "rollout"
    env = {"SOURCE_PATCH_DUMP_DIR": str(run / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "rollout",
           "SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(run / "routes")}
    server = sglang_server(specs=["routing", "dump"], args=["--skip-server-warmup"], env=env)
    status, info = server.get("/get_server_info")
    assert status == 200 and not info["disable_radix_cache"], info
    assert server.post("/flush_cache")[0] == 200
    params = {"temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True}
    replies = []
    for rids in (["grpo-0"], [f"grpo-{i}" for i in range(1, SAMPLES)]):
        status, out = server.post("/generate", {"input_ids": [PROMPT] * len(rids), "rid": rids,
                                                "sampling_params": [params] * len(rids),
                                                "return_prompt_token_ids": True})
        assert status == 200, out
        replies += out
    wait_for_rows(run, replies)
    return run, replies


def wait_for_rows(run, replies, timeout=60.0):
    """Until each request's computed rows (positions cached_tokens .. its length - 2: the
    last generated token is never fed back) and its routing record are written: the
    server keeps serving, its writers write as they go (tests/test_verdict_e2e.py too)."""
    want = {r["meta_info"]["id"]: set(range(r["meta_info"]["cached_tokens"],
                                            len(r["prompt_token_ids"]) + len(r["output_ids"]) - 1))
            for r in replies}
    deadline = time.monotonic() + timeout
    while True:
        try:
            rows = compare.index_rows(compare.load(run / "dumps" / "rollout", ["input_ids", "positions",
                                                                               "row_request"]))
            got = {}
            for rid, position in rows.get(("input_ids", None), {}):
                got.setdefault(rid, set()).add(position)
        except (OSError, ValueError):
            got = {}
        routes = {p.stem for p in (run / "routes").rglob("*.safetensors")}
        if all(got.get(rid) == positions for rid, positions in want.items()) and set(want) <= routes:
            return
        assert time.monotonic() < deadline, ({rid: sorted(p) for rid, p in got.items()}, want, routes)
        time.sleep(0.2)


@pytest.mark.slow
def test_a_grpo_group_served_from_the_radix_cache_replays_with_the_engines_tokens(
        grpo_rollout, sglang_checkpoint, tmp_path, in_shared_code_cache):
    run, replies = grpo_rollout
    cached = {r["meta_info"]["id"]: r["meta_info"]["cached_tokens"] for r in replies}
    assert cached["grpo-0"] == 0 and all(cached[f"grpo-{i}"] > 0 for i in range(1, SAMPLES)), cached
    assert len({tuple(r["output_ids"]) for r in replies}) > 1  # sampled: the completions differ
    full = {r["meta_info"]["id"]: r["prompt_token_ids"] + r["output_ids"] for r in replies}
    assert all(r["prompt_token_ids"] == PROMPT for r in replies)
    tokens = tmp_path / "replies.jsonl"  # the /generate replies as they came, one a line
    tokens.write_text("".join(json.dumps(r) + "\n" for r in replies))
    dumps, out = run / "dumps" / "rollout", tmp_path / "sp-replay"

    # Without the engine's tokens: one line naming --tokens, nothing started.
    refused_run = subprocess.run([sys.executable, "-m", "source_patch.patcher", "replay", str(dumps),
                                  "--checkpoint", str(sglang_checkpoint), "--out", str(out)],
                                 capture_output=True, text=True, timeout=300)
    assert refused_run.returncode == 2 and refused_run.stderr.count("\n") == 1, refused_run.stderr
    assert "(the engine's prefix cache?): give every request's token ids with --tokens FILE" in refused_run.stderr
    assert not out.exists()

    result = subprocess.run([sys.executable, "-m", "source_patch.patcher", "replay", str(dumps), "--checkpoint",
                             str(sglang_checkpoint), "--tokens", str(tokens), "--routes", str(run / "routes"),
                             "--out", str(out), "--json-out", str(tmp_path / "report.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "UserWarning" not in result.stderr, result.stderr
    assert result.stdout.endswith("no divergence\n"), result.stdout
    n = len(PROMPT) + NEW
    for rid, hit in cached.items():  # per request, SGLang's own count
        line = (f"request {rid!r}: {hit} of {n} positions came from the engine's prefix cache: compared on the "
                "training side only\n")
        assert (line in result.stdout) == (hit > 0), (rid, result.stdout)
    assert "(the engine reported" not in result.stdout  # ours equal SGLang's
    rollout_rows = compare.index_rows(compare.load(dumps, ["input_ids", "positions", "row_request"]))
    rollout_rows = rollout_rows[("input_ids", None)]
    rids = {rid for rid, _ in rollout_rows}  # the group, and the server's health probe where it ran one
    assert set(full) <= rids and all(rid.startswith("HEALTH_CHECK") for rid in rids - set(full)), rids
    assert f"expert ids of {SAMPLES} of {len(rids)} requests replayed from" in result.stdout

    # The training side holds every position of every request, the tokens the engine returned.
    (train,) = [folder for folder in out.iterdir() if folder.is_dir()]
    rows = compare.index_rows(compare.load(train, ["input_ids", "positions", "row_request"]))[("input_ids", None)]
    for rid, ids in full.items():
        assert [int(rows[(rid, p)]) for p in range(n)] == ids, rid
    recorded = json.loads((train / compare.INPUTS).read_text())
    hits = sum(cached.values())
    assert recorded["prefix cache"] == (f"{hits} of {(SAMPLES - 1) * n} positions of {SAMPLES - 1} requests came "
                                        "from the engine's prefix cache: compared on the training side only")
    assert recorded["token ids"] == f"from --tokens {tokens} ({SAMPLES} of the requests), else from the rollout's dumps"

    # The comparison: every row the engine computed paired, none of the cached ones, no divergence.
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["first_divergent"] is None and report["requests"] == len(rids), report
    assert report["tokens_paired"] == len(rollout_rows)  # every row the rollout has: paired
    assert report["prefix_cache_rows"] == hits  # the cached positions: counted and said, not compared
    # the group's rows: no last token (never fed back), no cached prefix
    assert sum(rid in full for rid, _ in rollout_rows) == SAMPLES * (n - 1) - hits
    assert all(row["ok"] for row in report["rows"])
    assert {row["layer"]: row["agreement"] for row in report["routing"]["per_layer"]} == {0: 1.0, 1: 1.0}
    assert report["inputs"]["prefix cache"] == recorded["prefix cache"]
