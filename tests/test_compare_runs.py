"""Issue 53 items 3 and 4 (compare any two runs): training vs training, rollout vs
rollout, either order; each side's layer numbering read from its own records; tensors
without row maps compared as they are; what cannot be paired said per side; a radix
cache's missing prefix counted; tensor- and expert-parallel shards joined."""

import json

import pytest
import torch

from source_patch.patcher import cli
from source_patch.runtime.dump import files
from source_patch.runtime.verdict import compare, sides
from source_patch.runtime.verdict.compare import Rec

SEQ, BATCH, HIDDEN = 6, 2, 8
RIDS = ["r0", "r1"]


def values(seed=0, layers=2, names=("layer_input", "attention_output", "mlp_output")):
    """{(name, layer from 0): [BATCH, SEQ, HIDDEN]} and the token ids [BATCH, SEQ]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (BATCH, SEQ), generator=g)
    return tokens, {(n, layer): torch.randn(BATCH, SEQ, HIDDEN, generator=g) for layer in range(layers) for n in names}


def megatron(tokens, acts, step=0, rank=0, maps=True, extra=None, base=1):
    """Megatron-style records: [s, b, h] activations, 1-based layer_number, cp/dp tags."""
    tags = {"step": step, "rank": rank, "cp": 0, "dp": 0, **(extra or {})}
    out = []
    if maps:
        out += [Rec("input_ids", tags, tokens.t().contiguous()),
                Rec("positions", tags, torch.arange(SEQ).unsqueeze(1).expand(SEQ, BATCH).contiguous()),
                Rec("row_request", {**tags, "rids": RIDS}, torch.arange(BATCH, dtype=torch.int32).expand(SEQ, BATCH)
                    .contiguous())]
    out += [Rec(n, {**tags, "layer": layer + base}, t.transpose(0, 1).contiguous()) for (n, layer), t in acts.items()]
    return out


def sglang(tokens, acts, step=0, positions=None):
    """SGLang-style records: one row per token, request after request, 0-based layer_id."""
    tags = {"step": step, "rank": 0, "forward_mode": "extend"}
    keep = positions if positions is not None else range(SEQ)
    keep = torch.tensor(list(keep))
    rows = torch.arange(BATCH, dtype=torch.int32).repeat_interleave(len(keep))
    out = [Rec("input_ids", tags, tokens[:, keep].reshape(-1)), Rec("positions", tags, keep.repeat(BATCH)),
           Rec("row_request", {**tags, "rids": RIDS, "rows_per_request": [len(keep)] * BATCH}, rows)]
    out += [Rec(n, {**tags, "layer": layer}, t[:, keep].reshape(-1, HIDDEN)) for (n, layer), t in acts.items()]
    return out


def write_run(folder, recs):
    """``recs`` in the dump format (safetensors + manifest), one rank folder per rank tag."""
    by_rank = {}
    for r in recs:
        by_rank.setdefault(r.tags.get("rank", 0), []).append(r)
    for rank, mine in by_rank.items():
        rank_dir = folder / f"rank-{rank}"
        rank_dir.mkdir(parents=True)
        entries = [(f"{i:08d}:{r.name}", r.tensor.contiguous()) for i, r in enumerate(mine)]
        files.write_safetensors(rank_dir / "f.safetensors", entries, {"format": "pt"})
        lines = [{"seq": i, "name": r.name, "tags": r.tags, "file": "f.safetensors", "key": key,
                  "shape": list(r.tensor.shape), "dtype": str(r.tensor.dtype).removeprefix("torch."),
                  "bytes": r.tensor.numel() * r.tensor.element_size(), "session": "s"}
                 for i, (r, (key, _)) in enumerate(zip(mine, entries))]
        (rank_dir / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def run(*args):
    return cli.main(["compare", *map(str, args)])


def test_two_training_runs_compare_and_a_changed_layer_is_found(tmp_path, capsys):
    tokens, acts = values()
    a = write_run(tmp_path / "a", megatron(tokens, acts))
    assert run(a, write_run(tmp_path / "same", megatron(tokens, acts))) == 0
    out = capsys.readouterr().out
    assert "layers numbered from 0 as Megatron's layer_number - 1 (both sides)" in out
    assert out.endswith("no divergence\n") and "12 tokens paired" in out
    changed = dict(acts)
    changed[("mlp_output", 1)] = acts[("mlp_output", 1)] * 1.01  # Megatron's layer_number 2
    assert run(a, write_run(tmp_path / "changed", megatron(tokens, changed))) == 1
    out = capsys.readouterr().out
    assert out.endswith("first divergent: mlp_output layer 1\n"), out
    assert "mlp_output             0     12          0" in out  # layer 0 (layer_number 1) untouched


def test_two_rollouts_compare(tmp_path, capsys):
    tokens, acts = values()
    a, b = write_run(tmp_path / "a", sglang(tokens, acts)), write_run(tmp_path / "b", sglang(tokens, acts))
    assert run(a, b, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layer_numbering"] == "layers numbered from 0 as SGLang's layer_id (both sides)"
    assert {(r["name"], r["layer"]) for r in report["rows"]} == set(acts)
    assert report["tokens_paired"] == BATCH * SEQ and all(r["max_abs"] == 0 for r in report["rows"])


def test_rollout_and_training_pair_in_either_order():
    tokens, acts = values()
    rollout, train = sglang(tokens, acts), megatron(tokens, acts)
    forward, backward = compare.compare(rollout, train), compare.compare(train, rollout)
    assert forward.layer_numbering == "layers numbered from 0 as SGLang's layer_id (A); Megatron's layer_number - 1 (B)"
    assert backward.layer_numbering == "layers numbered from 0 as Megatron's layer_number - 1 (A); SGLang's layer_id (B)"
    assert [(r.name, r.layer, r.rows, r.max_abs) for r in forward.rows] == \
           [(r.name, r.layer, r.rows, r.max_abs) for r in backward.rows]
    assert len(forward.rows) == len(acts) and forward.first_divergent is None and forward.tokens == BATCH * SEQ


def test_the_layer_base_is_read_from_each_sides_records():
    def side(recs):
        return sides.detect(sides.Side("A", None, recs))

    t = torch.zeros(1)
    # SGLang on a later pipeline stage: its layer ids start at 12 and still count from 0
    assert side([Rec("x", {"layer": 12, "forward_mode": "decode"}, t)]).base == 0
    # Megatron's kind with a layer tag 0 (someone's 0-based numbering): the data wins
    assert side([Rec("x", {"layer": 0, "cp": 0}, t), Rec("x", {"layer": 1, "cp": 0}, t)]).base == 0
    assert side([Rec("routing_map", {"layer": 3}, t)]).base == 1  # Megatron's name, a filtered dump
    assert side([Rec("x", {"layer": 2}, t)]).base == 1            # unknown kind, layers from 2: layer_number
    assert side([Rec("x", {"layer": 0}, t)]).base == 0
    with pytest.raises(compare.DumpError, match="tag 'layer' is '1', expected an integer"):
        side([Rec("x", {"layer": "1"}, t)])
    # --layer-offset: B's tag = A's + N, whatever the records say
    report = compare.compare(*(megatron(*values()),) * 2, layer_offset=0)
    assert report.layer_numbering.endswith("(--layer-offset 0)") and {r.layer for r in report.rows} == {1, 2}


def test_training_runs_without_row_maps_compare_tensor_against_tensor():
    """Neither side names its rows: tensors pair by (step, micro-batch, name, layer) and
    compare element by element; the drill-down names step, micro-batch and flat index."""
    tokens, acts = values()
    a = megatron(tokens, acts, maps=False) + megatron(tokens, acts, maps=False, extra={"microbatch": 1})
    changed = {k: v.clone() for k, v in acts.items()}
    changed[("attention_output", 1)][1, 4, 5] += 0.5  # request 1, position 4, hidden 5: [s, b, h] = [4, 1, 5]
    b = megatron(tokens, acts, maps=False) + megatron(tokens, changed, maps=False, extra={"microbatch": 1})
    report = compare.compare(a, b)
    assert report.tokens == 0 and report.first_divergent == ("attention_output", 1)
    row = next(r for r in report.rows if not r.ok)
    assert row.rows == 2 * SEQ * BATCH  # both micro-batches' rows
    assert row.where == {"request": None, "position": None, "index": (4 * BATCH + 1) * HIDDEN + 5, "step": 0,
                         "microbatch": 1, "a": pytest.approx(float(acts[("attention_output", 1)][1, 4, 5])),
                         "b": pytest.approx(float(changed[("attention_output", 1)][1, 4, 5]))}
    assert row.worst[0]["step"] == 0 and row.worst[0]["microbatch"] == 1 and row.worst[0]["row"] == 4 * BATCH + 1
    assert report.to_json()["tokens"] == {"name": "attention_output", "layer": 1, "requests": []}


def test_one_side_without_row_maps_is_named_with_its_folder(tmp_path, capsys):
    tokens, acts = values()
    a = write_run(tmp_path / "named", megatron(tokens, acts))
    b = write_run(tmp_path / "unnamed", megatron(tokens, acts, maps=False))
    assert run(a, b) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"source-patch: error: B ({b}) has no row_request / positions "
                                               "records, A has"), err


def test_what_cannot_be_paired_is_listed_when_something_pairs(tmp_path, capsys):
    tokens, acts = values()
    a = megatron(tokens, acts) + [Rec("layer_output", {"step": 0, "rank": 0, "layer": n}, torch.ones(SEQ, BATCH, 4))
                                  for n in (1, 2)]
    a.append(Rec("expert_scores", {"step": 0, "rank": 0, "layer": 1}, torch.ones(3, 5)))
    b = megatron(tokens, acts) + [Rec("expert_scores", {"step": 0, "rank": 0, "layer": 1}, torch.ones(3, 6))]
    assert run(write_run(tmp_path / "a", a), write_run(tmp_path / "b", b)) == 0
    out = capsys.readouterr().out
    assert f"not compared: layer_output layers 0-1: only in A ({tmp_path / 'a'}) (B lacks it)" in out
    assert (f"not compared: expert_scores layer 0: shapes differ: A ({tmp_path / 'a'}) [3, 5], "
            f"B ({tmp_path / 'b'}) [3, 6]") in out
    assert out.endswith("no divergence\n")
    # nothing pairs at all: one line naming the first reason
    only = [Rec("layer_output", {"step": 0, "layer": 1}, torch.ones(2))]
    with pytest.raises(compare.LayoutError, match=r"not compared: layer_output layer 0: only in A \(B lacks it\)"):
        compare.compare(only, [Rec("mlp_output", {"step": 0, "layer": 1}, torch.ones(2))])


def test_a_prefix_cache_hit_is_counted_not_an_error():
    """Radix cache on: the engine computed positions 2.. of each request (0 and 1 came from
    its cache); the training side has every position."""
    tokens, acts = values()
    rollout, train = sglang(tokens, acts, positions=range(2, SEQ)), megatron(tokens, acts)
    report = compare.compare(rollout, train)
    assert report.tokens == BATCH * (SEQ - 2) and report.prefix_cache_rows == BATCH * 2
    assert "4 rows the engine took from its prefix cache: not compared (A has no rows for them, B has)" \
           in report.table()
    assert report.first_divergent is None and all(r.rows == BATCH * (SEQ - 2) for r in report.rows)
    assert report.to_json()["prefix_cache_rows"] == 4
    # the self-test runs on the paired rows: a wrong token there stops the comparison ...
    wrong = tokens.clone()
    wrong[1, 3] += 1
    with pytest.raises(compare.LayoutError, match="request 'r1' position 3: token"):
        compare.compare(rollout, megatron(wrong, acts))
    # ... one in the cached prefix is not compared
    wrong = tokens.clone()
    wrong[1, 0] += 1
    assert compare.compare(rollout, megatron(wrong, acts)).prefix_cache_rows == 4


# ------------------------------------------------------------------ joining shards


def tp_shards(tokens, acts, tp=2, modes=None):
    """A Megatron side over ``tp`` TP ranks: layer_input replicated, attention_output
    column-parallel (last dim split), mlp_output row-parallel partial sums."""
    out = []
    for rank in range(tp):
        shard = {}
        for (name, layer), t in acts.items():
            if name == "attention_output":
                shard[(name, layer)] = t.chunk(tp, dim=-1)[rank]
            elif name == "mlp_output":
                shard[(name, layer)] = t / tp + (0.25 if rank == 0 else -0.25)  # parts that sum to t
            else:
                shard[(name, layer)] = t
        recs = megatron(tokens, shard, rank=rank, extra={"tp": rank})
        out += [r._replace(tags={**r.tags, "tp_mode": modes[r.name]}) if modes and r.name in modes else r
                for r in recs]
    return out


def test_tensor_parallel_shards_are_joined_by_the_rule(tmp_path, capsys):
    tokens, acts = values()
    rollout = sglang(tokens, acts)
    report = compare.compare(rollout, tp_shards(tokens, acts))
    assert report.first_divergent is None and len(report.rows) == len(acts)
    assert all(r.max_abs < 1e-6 and r.rows == BATCH * SEQ for r in report.rows), report.table()
    assert report.joined == ["B: joined tensor-parallel shards of 5 replicated (one kept), 2 concatenated, "
                             "2 summed tensors"]
    # the same through the files and the CLI (tp tags survive the manifest)
    assert run(write_run(tmp_path / "a", rollout), write_run(tmp_path / "b", tp_shards(tokens, acts))) == 0
    assert "B (" in capsys.readouterr().out
    # a tp_mode tag decides: partial sums declared column-parallel are concatenated (then a width
    # that matches nothing on A is an error naming both sides' widths)
    with pytest.raises(compare.DumpError, match=r"mlp_output layer 0: rows of 8, 16 values"):
        compare.compare(rollout, tp_shards(tokens, acts, modes={"mlp_output": "concat"}))
    with pytest.raises(compare.DumpError, match="tag 'tp_mode' is 'columns'"):
        compare.compare(rollout, tp_shards(tokens, acts, modes={"mlp_output": "columns"}))


def test_both_sides_sharded_alike_compare_shard_against_shard():
    tokens, acts = values()
    changed = {k: v.clone() for k, v in acts.items()}
    changed[("attention_output", 0)][0, 1, 7] += 1.0  # TP rank 1's half: hidden index 7 of the joined row
    report = compare.compare(tp_shards(tokens, acts), tp_shards(tokens, changed))
    assert report.first_divergent == ("attention_output", 0)
    assert report.rows[1].where["index"] == 7 and report.rows[1].where["request"] == "r0"
    assert report.rows[1].where["position"] == 1


def test_sequence_parallel_slices_with_tp_tags_are_not_joined():
    """TP ranks whose row maps differ hold different rows (sequence parallelism): they
    reassemble by (request, position), no tensor-parallel join."""
    from source_patch.runtime.core import slicing

    tokens, acts = values()
    full = megatron(tokens, acts)
    train = []
    for rank in range(2):
        train += [r._replace(tags={**r.tags, "tp": rank, "rank": rank}, tensor=slicing.sp_split(r.tensor, 2, rank))
                  for r in full]
    report = compare.compare(sglang(tokens, acts), train)
    assert report.joined == [] and report.tokens == BATCH * SEQ and report.first_divergent is None
    assert all(r.max_abs == 0 for r in report.rows)


def test_expert_parallel_outputs_join_in_global_expert_order():
    """4 experts: A holds them all (one record per expert, global ids); B over EP 2, two
    local experts a rank (numbered 0, 1 on each), and [local, ...] tensors too."""
    g = torch.Generator().manual_seed(1)
    experts = torch.randn(4, 3, HIDDEN, generator=g)
    a = [Rec("expert_output", {"step": 0, "rank": 0, "layer": 1, "expert": e}, experts[e]) for e in range(4)]
    a.append(Rec("experts_fc1", {"step": 0, "rank": 0, "layer": 1}, experts * 2))
    b = []
    for ep in range(2):
        tags = {"step": 0, "rank": ep, "dp": ep, "ep": ep, "layer": 1}
        b += [Rec("expert_output", {**tags, "expert": i}, experts[ep * 2 + i]) for i in range(2)]
        b.append(Rec("experts_fc1", {**tags, "local_experts": 2}, experts[ep * 2:ep * 2 + 2] * 2))
    report = compare.compare(a, b)
    assert [(r.name, r.rows, r.max_abs) for r in report.rows] == [("expert_output", 4 * 3, 0.0),
                                                                 ("experts_fc1", 4 * 3, 0.0)]
    assert report.joined == ["A: joined expert-parallel pieces of 1 tensors in global expert order",
                             "B: joined expert-parallel pieces of 2 tensors in global expert order"]
    # the wrong order (EP rank 1's experts first) would differ: the join is what makes them equal
    swapped = [r._replace(tags={**r.tags, "ep": 1 - r.tags["ep"]}) for r in b]
    assert compare.compare(a, swapped).first_divergent == ("expert_output", 0)
