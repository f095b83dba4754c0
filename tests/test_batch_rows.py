"""``source_patch.batch``: one call per micro-batch names its rows (runtime/core/rows.py).

In-process: the row maps of padded and packed batches against a direct computation,
context-parallel (zigzag) and sequence-parallel slices against Megatron-Core's own
helpers, the dump runtime writing the map at the first dump of a micro-batch.
End to end (tests/e2e/batch_schedule.py, subprocesses): Megatron's real schedule, two
micro-batches, a forward-only and a forward-backward pass per step; the dumps carry one
row map per micro-batch and pass, two runs compare row for row, and routing replay of
request records routes every token as its record says.
"""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from source_patch.runtime.core import rows as batch_rows

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "e2e" / "batch_schedule.py"


@pytest.fixture(autouse=True)
def _fresh_rows():
    batch_rows.clear()
    yield
    batch_rows.clear()


def direct(rids, lengths, seq_len, side="right"):
    """[s, b] row_request and positions of a padded batch, written out by hand."""
    rows = [[-1] * len(rids) for _ in range(seq_len)]
    pos = [[-1] * len(rids) for _ in range(seq_len)]
    for b, n in enumerate(lengths):
        start = 0 if side == "right" else seq_len - n
        for k in range(n):
            rows[start + k][b], pos[start + k][b] = b, k
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


# --------------------------------------------------------------------------- the row map


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_row_map_equals_direct(side):
    rids, prompts, responses = ["a", "b", 7], [3, 1, 2], [2, 4, 1]
    ids = torch.randint(1, 100, (3, 8))
    got = batch_rows.batch(rids, prompts, responses, seq_len=8, padding_side=side, input_ids=ids,
                           cp_size=1, cp_rank=0, tp_size=1, tp_rank=0)
    rows, pos = direct(rids, [5, 5, 3], 8, side)
    assert torch.equal(got.row_request, rows) and torch.equal(got.positions, pos)
    assert torch.equal(got.input_ids, ids.t())
    assert got.row_request.shape == (8, 3) and got.row_request.dtype == torch.int32
    assert got.rows()[:3] == ([("a", 0), ("b", 0), (7, 0)] if side == "right" else [None, None, None])
    # default seq_len: the longest sample
    assert batch_rows.batch(rids, prompts, responses, cp_size=1, cp_rank=0).row_request.shape == (5, 3)


def test_packed_row_map_equals_direct():
    rids, lengths = ["x", "y", "z"], [3, 5, 2]
    got = batch_rows.batch(rids, [1, 2, 1], [2, 3, 1], layout="packed", seq_len=12, input_ids=torch.arange(12),
                           cp_size=1, cp_rank=0)
    want_rows = [0] * 3 + [1] * 5 + [2] * 2 + [-1] * 2
    want_pos = list(range(3)) + list(range(5)) + list(range(2)) + [-1] * 2
    assert got.row_request.reshape(-1).tolist() == want_rows and got.row_request.shape == (12, 1)
    assert got.positions.reshape(-1).tolist() == want_pos
    assert got.input_ids.reshape(-1).tolist() == list(range(12))
    # cu_seqlens (padded slots, as PackedSeqParams.cu_seqlens_q): each sample from its offset
    got = batch_rows.batch(rids, [1, 2, 1], [2, 3, 1], layout="packed", cu_seqlens=[0, 4, 12, 16],
                           cp_size=1, cp_rank=0)
    flat = got.row_request.reshape(-1).tolist()
    assert flat == [0, 0, 0, -1] + [1] * 5 + [-1] * 3 + [2, 2, -1, -1] and got.seq_len == 16
    assert got.positions.reshape(-1).tolist()[4:9] == [0, 1, 2, 3, 4]


def test_errors_are_said_at_the_call():
    with pytest.raises(ValueError, match="layout must be one of"):
        batch_rows.batch(["a"], [1], [1], layout="bshd")
    with pytest.raises(ValueError, match="shorter than the longest sample"):
        batch_rows.batch(["a"], [4], [1], seq_len=4)
    with pytest.raises(ValueError, match="request ids repeat"):
        batch_rows.batch(["a", "a"], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp_size = 4"):
        batch_rows.batch(["a"], [3], [3], seq_len=6, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="2 values for 1 requests"):
        batch_rows.batch(["a"], [1, 2], [1])
    with pytest.raises(ValueError, match="slot of 2"):
        batch_rows.batch(["a", "b"], [2, 1], [1, 1], layout="packed", cu_seqlens=[0, 2, 4])


def test_microbatch_keys_follow_the_schedule():
    """Counted from 0; a schedule's start counts again (Rows already named stay); inside a
    schedule's forward step the ambient microbatch tag names it; a step forgets them."""
    from source_patch.runtime.core import tags

    a = batch_rows.batch(["a"], [1], [1])
    b = batch_rows.batch(["b"], [1], [1])
    assert (a.microbatch, b.microbatch) == (0, 1)
    batch_rows.schedule_begin()
    assert batch_rows.current("fwd_only", 0) is a and batch_rows.current("fwd_bwd", 1) is b
    assert batch_rows.current() is b  # outside a schedule: the latest
    with tags.set_context(phase="fwd_bwd", microbatch=1):
        c = batch_rows.batch(["c"], [1], [1])
    assert (c.microbatch, c.phase) == (1, "fwd_bwd")
    assert batch_rows.current("fwd_bwd", 1) is c and batch_rows.current("fwd_only", 1) is b
    batch_rows.step_end()
    assert batch_rows.current() is None and batch_rows.current("fwd_bwd", 1) is None
    assert batch_rows.batch(["d"], [1], [1]).microbatch == 0


def test_public_name():
    """The package's root exports ``batch`` lazily (what ``source_patch.batch`` is once
    the root package is installed; pyproject's package-dir maps ``source_patch`` to the
    repository root)."""
    spec = importlib.util.spec_from_file_location("source_patch_root", ROOT / "__init__.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    assert "batch" not in vars(root)  # nothing imported until used
    assert root.batch is batch_rows.batch and root.Rows is batch_rows.Rows


# --------------------------------------------------------------------------- CP and SP: Megatron's own helpers


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(scope="module")
def megatron_helpers():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tensor_parallel.mappings import _split_along_first_dim
        from megatron.core.utils import get_batch_on_this_cp_rank
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield get_batch_on_this_cp_rank, _split_along_first_dim
    if started:
        torch.distributed.destroy_process_group()


def _codes(rows_sb, pos_sb):
    """One integer per token: which request and position (-1 padding)."""
    return torch.where(rows_sb >= 0, rows_sb.long() * 1000 + pos_sb.long(), torch.full_like(rows_sb, -1).long())


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("sp, tp", [(False, 1), (True, 2)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_slices_match_megatron(megatron_helpers, cp, sp, tp, side):
    get_batch_on_this_cp_rank, split_first_dim = megatron_helpers
    rids, prompts, responses, seq = ["a", "b", "c"], [3, 1, 5], [4, 2, 3], 16
    whole = batch_rows.batch(rids, prompts, responses, seq_len=seq, padding_side=side, cp_size=1, cp_rank=0)
    codes_bs = _codes(whole.row_request, whole.positions).t().contiguous()   # [b, s], as the data loader has it
    ids_bs = torch.randint(1, 100, (3, seq))
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            mine = batch_rows.batch(rids, prompts, responses, seq_len=seq, padding_side=side, input_ids=ids_bs,
                                    cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp)
            got = get_batch_on_this_cp_rank({"codes": codes_bs.clone(), "ids": ids_bs.clone()},
                                            cp_group=FakeGroup(cp, cp_rank))
            codes, ids = got["codes"].t().contiguous(), got["ids"].t().contiguous()   # the embedding's [s, b]
            if sp:
                codes = split_first_dim(codes, FakeGroup(tp, tp_rank))
                ids = split_first_dim(ids, FakeGroup(tp, tp_rank))
            assert torch.equal(_codes(mine.row_request, mine.positions), codes), (cp_rank, tp_rank)
            assert torch.equal(mine.input_ids, ids)
            # the router's rows (view(-1, E) of [s, b]): rows of the whole [s, b] flattened
            assert torch.equal(_codes(whole.row_request, whole.positions).reshape(-1)[mine.local_index],
                               codes.reshape(-1))


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("sp, tp", [(False, 1), (True, 2)])
def test_packed_slices_match_megatron(megatron_helpers, cp, sp, tp):
    """THD: Transformer Engine's thd_get_partitioned_indices (behind Megatron's
    get_thd_batch_on_this_cp_rank; no TE on CPU) zigzags every packed sequence on its
    own: Megatron's get_batch_on_this_cp_rank applied to each padded sequence, joined."""
    get_batch_on_this_cp_rank, split_first_dim = megatron_helpers
    rids, prompts, responses, cu = ["a", "b", "c"], [2, 3, 1], [3, 4, 2], [0, 8, 16, 24]
    whole = batch_rows.batch(rids, prompts, responses, layout="packed", cu_seqlens=cu, cp_size=1, cp_rank=0)
    codes_t = _codes(whole.row_request, whole.positions).t().contiguous()    # [1, t]
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            mine = batch_rows.batch(rids, prompts, responses, layout="packed", cu_seqlens=cu, cp_size=cp,
                                    cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp)
            parts = [get_batch_on_this_cp_rank({"codes": codes_t[:, a:b].clone()},
                                               cp_group=FakeGroup(cp, cp_rank))["codes"] for a, b in zip(cu, cu[1:])]
            codes = torch.cat(parts, dim=1).t().contiguous()                     # [t_local, 1]
            if sp:
                codes = split_first_dim(codes, FakeGroup(tp, tp_rank))
            assert torch.equal(_codes(mine.row_request, mine.positions), codes), (cp_rank, tp_rank)


# --------------------------------------------------------------------------- the dump pulls the map


def test_dump_writes_the_map_once_per_microbatch_and_only_when_enabled(tmp_path):
    from source_patch.runtime.core import tags
    from source_patch.runtime.dump import api as dump, reader

    before = dump.state()["config"]
    try:
        dump.configure(enable=False, dir=str(tmp_path), exp_name="run", port=0)
        batch_rows.batch(["a", "b"], [2, 1], [1, 1], seq_len=4, cp_size=1, cp_rank=0)
        dump.dump("layer_input", torch.zeros(4, 2, 3), layer=1)      # disabled: nothing, no map
        dump.configure(enable=True)
        with tags.set_context(phase="fwd_bwd", microbatch=0):
            rows0 = batch_rows.batch(["a", "b"], [2, 1], [1, 1], seq_len=4, cp_size=1, cp_rank=0)
            for layer in (1, 2):
                dump.dump("layer_input", torch.zeros(4, 2, 3), layer=layer)
        with tags.set_context(phase="fwd_bwd", microbatch=1):
            batch_rows.batch(["c"], [3], [1], seq_len=4, input_ids=[[5, 6, 7, 8]], cp_size=1, cp_rank=0)
            dump.dump("layer_input", torch.zeros(4, 1, 3), layer=1)
        assert dump.flush(timeout=30)
        recs = reader.load(tmp_path / "run")
        maps = [r for r in recs if r.name == "row_request"]
        assert [(r.tags["microbatch"], r.tags["rids"]) for r in maps] == [(0, ["a", "b"]), (1, ["c"])]
        assert torch.equal(maps[0].tensor, rows0.row_request)
        assert [r.name for r in recs].count("input_ids") == 1 and [r.name for r in recs].count("positions") == 2
        assert sum(r.name == "layer_input" for r in recs) == 3
    finally:
        dump.configure(**{k: v for k, v in before.items() if k in ("enable", "dir", "exp_name", "port")})


# --------------------------------------------------------------------------- Megatron's schedule, end to end


def drive(tmp: Path, name: str, *args, specs="megatron_cpu,dump,routing") -> dict:
    env = {**os.environ, "SOURCE_PATCH": specs, "PYTHONWARNINGS": "ignore",
           "SOURCE_PATCH_DUMP_DIR": str(tmp / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": name,
           "SOURCE_PATCH_DUMP_ENABLE": "1"}
    for key in ("SOURCE_PATCH_ROUTING_MODE", "SOURCE_PATCH_ROUTING_DIR", "SOURCE_PATCH_DUMP_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(DRIVER), str(tmp / name), *args], env=env, capture_output=True,
                          text=True, timeout=600, cwd=DRIVER.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / f"{name}.json").read_text())


def groups(path) -> dict:
    from source_patch.runtime.verdict import compare

    out: dict = {}
    for rec in compare.load(path):
        out.setdefault((rec.tags["step"], rec.tags["phase"], rec.tags["microbatch"]), []).append(rec)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("batch")
    return tmp, drive(tmp, "inside", "--feed", "inside"), drive(tmp, "before", "--feed", "before")


def test_schedule_dumps_one_row_map_per_microbatch_and_pass(runs):
    tmp, inside, _ = runs
    for name in ("inside", "before"):
        by = groups(tmp / "dumps" / name)
        assert sorted(by) == [(s, p, m) for s in (0, 1) for p in ("fwd_bwd", "fwd_only") for m in (0, 1)]
        for (step, phase, mb), recs in by.items():
            maps = [r for r in recs if r.name == "row_request"]
            assert len(maps) == 1, (name, step, phase, mb)
            reqs = inside["requests"][f"{step}/{mb}"]
            assert maps[0].tags["rids"] == [r["rid"] for r in reqs]
            want, pos = direct([r["rid"] for r in reqs], [len(r["tokens"]) for r in reqs], 16)
            assert torch.equal(maps[0].tensor, want)
            assert torch.equal(next(r for r in recs if r.name == "positions").tensor, pos)
            ids = next(r for r in recs if r.name == "input_ids").tensor
            for b, r in enumerate(reqs):
                assert ids[: len(r["tokens"]), b].tolist() == r["tokens"]


def test_two_identical_runs_pair_every_row(runs):
    """batch() inside forward_step_func and before the schedule: the same rows, the same
    numbers; compare pairs every real token of every micro-batch and pass."""
    from source_patch.runtime.verdict import compare

    tmp, inside, _ = runs
    a, b = groups(tmp / "dumps" / "inside"), groups(tmp / "dumps" / "before")
    for key in a:
        reqs = inside["requests"][f"{key[0]}/{key[2]}"]
        report = compare.compare(a[key], b[key], layer_offset=0)
        assert report.tokens == sum(len(r["tokens"]) for r in reqs), key
        assert report.requests == len(reqs)
        assert report.first_divergent is None, report.table()
        assert {r.name for r in report.rows} >= {"layer_input", "mlp_output", "logits"}
    whole = compare.compare(str(tmp / "dumps" / "inside"), str(tmp / "dumps" / "before"), layer_offset=0)
    assert whole.first_divergent is None


def _expected(records, rids_lengths, layer, packed):
    """The experts each real token (not the last of a request: SGLang never routed it)
    is replayed with, in the router's [s, b] flattened order; None for the rest."""
    out = []
    if packed:
        for rid, n in rids_lengths:
            out += [sorted(records[rid]["indices"][layer - 1][k]) if k < n - 1 else None for k in range(n)]
        return out + [None] * (48 - len(out))
    for s in range(16):
        for rid, n in rids_lengths:
            out.append(sorted(records[rid]["indices"][layer - 1][s]) if s < n - 1 else None)
    return out


@pytest.mark.parametrize("feed, packed", [("inside", False), ("before", False), ("before", True)])
def test_routing_replay_follows_the_named_rows(tmp_path, feed, packed):
    """Our routing replay with SGLang-style request records (a folder of them): every
    router call of both passes, every micro-batch and step routes each real token to
    the experts its request's record holds (agreement 100%)."""
    pytest.importorskip("megatron.core")
    from source_patch.runtime.routing.records.record import load

    args = ["--feed", feed, "--replay", str(tmp_path / "requests")] + (["--packed"] if packed else [])
    out = drive(tmp_path, "replay", *args)
    records = {}
    for f in (tmp_path / "requests" / "rank0").glob("*.safetensors"):
        rec = load(f)
        records[rec.sample_ids[0]] = {"indices": {k: v.tolist() for k, v in rec.indices.items()}}
    assert len(out["routes"]) == 2 * 2 * 2 * 2  # steps x passes x micro-batches x layers
    compared = 0
    for key, routed in out["routes"].items():
        step, phase, mb, layer = key.split("/")
        reqs = out["requests"][f"{step}/{mb}"]
        want = _expected(records, [(r["rid"], len(r["tokens"])) for r in reqs], int(layer), packed)
        assert len(routed) == len(want), key
        for t, (got, expected) in enumerate(zip(routed, want)):
            if expected is not None:
                assert got == expected, (key, t)
                compared += 1
    assert compared > 0
    # the dumps still carry the row maps under replay
    by = groups(tmp_path / "dumps" / "replay")
    assert all(sum(r.name == "row_request" for r in recs) == 1 for recs in by.values()) and len(by) == 8
