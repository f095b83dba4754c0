"""Routing capture / replay on real Megatron-Core modules (CPU), patches/routing.yaml.

End-to-end: tests/e2e/routing_run.py trains the tiny GPT-MoE of examples/train_moe.py
in subprocesses under SOURCE_PATCH=megatron_cpu,routing.  In-process: the runtime's
replay checks with a stand-in router (no Megatron import).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing
from source_patch.runtime.routing.megatron import replay as routing_replay
from source_patch.runtime.routing.megatron.files import RoutingReplayError
from source_patch.runtime.routing.records.record import load

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "e2e" / "routing_run.py"
STEPS, MICROBATCHES, LAYERS = 2, 2, (1, 2)

pytest.importorskip("megatron.core")


def drive(out: Path, *scenarios) -> tuple[dict, list]:
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,routing", "PYTHONWARNINGS": "ignore"}
    env.pop("SOURCE_PATCH_ROUTING_MODE", None)
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), *scenarios, "--steps", str(STEPS),
                           "--micro-batches", str(MICROBATCHES)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_file(f"{out}.safetensors"), json.loads(Path(f"{out}.json").read_text())


def keys():
    return [(s, m) for s in range(STEPS) for m in range(MICROBATCHES)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    cap = tmp / "cap"
    out, status = drive(tmp / "run1", f"capture:{cap}", f"replay:{cap}")
    assert status == [{"ok": True}, {"ok": True}], status
    return tmp, cap, out


def rewrite(src: Path, dst: Path, change):
    """Copy a capture dir, passing each record through change(record) -> record."""
    dst.mkdir(parents=True)
    for folder in src.iterdir():
        (dst / folder.name).mkdir()
        shutil.copy(folder / "index.json", dst / folder.name / "index.json")
        for f in folder.glob("*.safetensors"):
            change(load(f)).save(dst / folder.name / f.name)
    return dst


def corrupt_raw(path: Path, layer: int, row: int, value_from_col: int):
    """Write a duplicate expert id straight into the file (a RoutingRecord refuses to hold one)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    t = tensors[f"layer.{layer}.indices"]
    t[row, 1] = t[row, value_from_col]
    save_file(tensors, str(path), metadata=meta)


def test_capture_matches_router_and_replay_is_identical(captured):
    _, cap, out = captured
    index = json.loads((cap / "rank-0" / "index.json").read_text())
    assert [(e["step"], e["microbatch"]) for e in index["records"]] == keys()
    for step, mb in keys():
        rec = load(cap / "rank-0" / f"step-{step}-mb-{mb}.safetensors")
        assert rec.token_order == "megatron-sbh" and rec.parallel is None  # full length (cp=1)
        assert rec.extra == {"step": step, "microbatch": mb} and rec.layers == list(LAYERS)
        for layer in LAYERS:
            routed = out[f"0/route/{step}/{mb}/{layer}"]
            assert torch.equal(rec.indices[layer].sort(dim=1).values, routed)   # capture == router's map
            assert torch.equal(out[f"1/route/{step}/{mb}/{layer}"], routed)      # replay == capture
    for step in range(STEPS):
        assert torch.equal(out[f"0/loss/{step}"], out[f"1/loss/{step}"])
    # replay slices the full-length record for this rank (cp=1, tp=1)


@pytest.mark.usefixtures("in_shared_code_cache")
def test_replay_permuted_and_error_cases(captured):
    tmp, cap, ref = captured
    perm = torch.tensor([3, 7, 0, 5, 1, 6, 2, 4])

    def permuted(rec):
        return rec.replace(indices={k: perm[v] for k, v in rec.indices.items()})

    def rows(rec):
        return rec.replace(indices={k: v[:-4] for k, v in rec.indices.items()}, seq_lens=None)

    def out_of_range(rec):
        idx = {k: v.clone() for k, v in rec.indices.items()}
        idx[2][5, 0] = 11 if idx[2][5, 1] != 11 else 12
        return rec.replace(indices=idx, num_experts=16)

    def extra_layer(rec):
        return rec.replace(indices={**rec.indices, 3: rec.indices[2]})

    def missing_layer(rec):
        return rec.replace(indices={1: rec.indices[1]})

    def sliced_cp2(rec):
        from source_patch.runtime.routing.records.slicing import slice_for_rank
        return slice_for_rank(rec, batch=4, cp_size=2, cp_rank=0)

    dirs = {name: rewrite(cap, tmp / name, fn) for name, fn in [
        ("perm", permuted), ("rows", rows), ("range", out_of_range), ("extra", extra_layer),
        ("missing", missing_layer), ("cp2", sliced_cp2)]}
    dup = rewrite(cap, tmp / "dup", lambda r: r)
    corrupt_raw(dup / "rank-0" / "step-0-mb-0.safetensors", layer=1, row=3, value_from_col=0)
    dirs["dup"] = dup
    names = list(dirs)
    out, status = drive(tmp / "run2", *[f"replay:{dirs[n]}" for n in names])
    result = dict(zip(names, status))

    # permuted: routed exactly as recorded, and the loss changes
    assert result["perm"] == {"ok": True}
    i = names.index("perm")
    for step, mb in keys():
        rec = load(dirs["perm"] / "rank-0" / f"step-{step}-mb-{mb}.safetensors")
        for layer in LAYERS:
            assert torch.equal(out[f"{i}/route/{step}/{mb}/{layer}"], rec.indices[layer].sort(dim=1).values)
            assert not torch.equal(out[f"{i}/route/{step}/{mb}/{layer}"], ref[f"0/route/{step}/{mb}/{layer}"])
    assert not torch.equal(out[f"{i}/loss/0"], ref["0/loss/0"])

    def error(name, *needles):
        r = result[name]
        assert r.get("error") == "RoutingReplayError", (name, r)
        for needle in needles:
            assert needle in r["message"], (name, needle, r["message"])

    error("rows", "step 0, microbatch 0, layer 1", "60 rows", "64 tokens", "row-count mismatch")
    error("range", "step 0, microbatch 0, layer 2, row 5", "out of range [0, 8)")
    error("dup", "step 0, microbatch 0", "layer 1, row 3", "chosen twice")
    error("extra", "step 0, microbatch 0", "layers [1, 2, 3]", "layer count mismatch", "never used: [3]")
    error("missing", "step 0, microbatch 0, layer 2", "no layer 2", "layer mismatch")
    error("cp2", "step 0, microbatch 0", "slice for", "cp 0/1")


# ---------------------------------------------------------------- in-process (no Megatron)


class FakeRouter:
    def __init__(self, layer, experts=8):
        self.layer_number = layer
        self.config = type("C", (), {"sequence_parallel": False, "num_moe_experts": experts})()


@pytest.fixture
def rt():
    routing.reset()
    yield routing
    routing.configure(mode="off")
    routing.reset()


def topk_call(rt, layer, scores, k=2):
    rt.routing_enter(FakeRouter(layer, scores.shape[1]), scores.view(scores.shape[0] // 2, 2, -1))
    res = rt.routing_topk(scores, torch.topk(scores, k, dim=1))
    rt.routing_exit()
    return res


def test_off_is_identity(rt):
    rt.configure(mode="off")
    res = (torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))
    assert rt.routing_topk(torch.zeros(2, 4), res) is res


def test_capture_replay_in_memory_with_grad(rt, tmp_path):
    rt.configure(mode="capture", dir="", probs=False)
    scores = torch.randn(8, 8)
    rt.routing_microbatch_begin()
    topk_call(rt, 1, scores)
    rt.routing_microbatch_end()
    (rec,) = routing_capture.records()
    assert rec.extra == {"step": 0, "microbatch": 0} and rec.seq_lens == [4, 4]
    assert torch.equal(rec.indices[1], torch.topk(scores, 2, dim=1).indices)
    rt.save(tmp_path)
    rt.reset()
    rt.configure(mode="replay")
    forced = rec.replace(indices={1: (rec.indices[1] + 1) % 8})
    routing_replay.set_replay([forced])
    live = torch.randn(8, 8, requires_grad=True)
    rt.routing_microbatch_begin()
    values, idx = topk_call(rt, 1, live)
    assert torch.equal(idx, forced.indices[1])
    values.sum().backward()
    assert live.grad is not None and live.grad.abs().sum() > 0
    rt.routing_microbatch_end()
    # from disk
    rt.reset()
    routing_replay.set_replay(str(tmp_path))
    rt.routing_microbatch_begin()
    assert torch.equal(topk_call(rt, 1, scores)[1], rec.indices[1])


def test_replay_probs_puts_the_recorded_weights_at_the_recorded_ids(rt):
    """replay_probs: the router's combine weights are the record's, not recomputed; a
    record without weights is a clear error."""
    from source_patch.runtime.routing.records.record import RoutingRecord

    ids = torch.tensor([[1, 2], [3, 0], [7, 6], [4, 5]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    record = RoutingRecord(indices={1: ids}, probs={1: weights}, num_experts=8, token_order="megatron-sbh",
                           seq_lens=[2, 2], extra={"step": 0, "microbatch": 0})
    rt.configure(mode="replay", replay_probs=True)
    routing_replay.set_replay([record])
    rt.routing_microbatch_begin()
    live = torch.randn(4, 8)
    rt.routing_enter(FakeRouter(1), live.view(2, 2, -1))
    assert torch.equal(rt.routing_topk(live, torch.topk(live, 2, dim=1))[1], ids)
    probs = rt.routing_probs(torch.full((4, 8), 0.125))
    rt.routing_exit()
    expected = torch.zeros(4, 8).scatter(1, ids, weights)
    assert torch.equal(probs, expected)
    routing_replay.set_replay([record.replace(probs=None)])
    rt.routing_enter(FakeRouter(1), live.view(2, 2, -1))
    rt.routing_topk(live, torch.topk(live, 2, dim=1))
    with pytest.raises(RoutingReplayError, match="replay_probs is on but the record has no combine weights"):
        rt.routing_probs(torch.zeros(4, 8))


def test_missing_record_and_fused(rt):
    rt.configure(mode="replay")
    routing_replay.set_replay({})
    with pytest.raises(RoutingReplayError, match="step 0, microbatch 0: no routing record"):
        topk_call(rt, 1, torch.randn(4, 8))
    with pytest.raises(RoutingReplayError, match="fused"):
        rt.routing_fused(True)
    rt.routing_fused(False)


@pytest.mark.parametrize("order", ["no-pipelining", "1f1b"])
def test_activation_recompute_uses_its_own_microbatch(rt, order):
    """A recomputed router call in backward (outside forward_step) belongs to the oldest
    forward not yet recomputed: F0 B0 F1 B1 without pipelining, F0 F1 B0 B1 in 1F1B."""
    scores = [torch.randn(8, 8) for _ in range(2)]

    def forward(mb):
        rt.routing_microbatch_begin()
        topk_call(rt, 1, scores[mb])
        rt.routing_microbatch_end()

    def recompute(mb):  # the same input again, as a checkpointed layer recomputes it
        return topk_call(rt, 1, scores[mb] + 100.0 * torch.arange(8.0))  # different live choice

    plan = [("f", 0), ("b", 0), ("f", 1), ("b", 1)] if order == "no-pipelining" else \
        [("f", 0), ("f", 1), ("b", 0), ("b", 1)]
    rt.configure(mode="capture", dir="")
    rt.routing_schedule(False)
    for kind, mb in plan:
        forward(mb) if kind == "f" else recompute(mb)
    rt.routing_schedule_end()
    records = routing_capture.records()
    assert [r.extra for r in records] == [{"step": 0, "microbatch": 0}, {"step": 0, "microbatch": 1}]
    for mb, rec in enumerate(records):  # the forward's choice, not the recompute's
        assert torch.equal(rec.indices[1], torch.topk(scores[mb], 2, dim=1).indices)

    rt.reset()
    rt.configure(mode="replay")
    forced = [r.replace(indices={1: (r.indices[1] + 1 + mb) % 8}) for mb, r in enumerate(records)]
    routing_replay.set_replay(forced)
    rt.routing_schedule(False)
    for kind, mb in plan:
        if kind == "f":
            forward(mb)
        else:
            assert torch.equal(recompute(mb)[1], forced[mb].indices[1]), (order, mb)
    rt.routing_schedule_end()
