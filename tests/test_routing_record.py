"""Routing records: validation, the on-disk format, CP/SP slicing against Megatron-Core's
own helpers, interop with Megatron's native RouterReplay, and the CLI."""

import errno
import json
import os
import struct
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from source_patch.runtime.routing.records import describe, file as record_file, router_replay as megatron_native
from source_patch.runtime.routing.records.file import METADATA_KEY, RoutingRecordError, read_header
from source_patch.runtime.routing.records.record import RoutingRecord, load
from source_patch.runtime.routing.records.slicing import gather_slices, slice_for_rank, token_rows


def random_indices(tokens, topk, num_experts, generator=None):
    """[tokens, topk] distinct expert ids per row."""
    scores = torch.rand(tokens, num_experts, generator=generator)
    return scores.topk(topk, dim=1).indices


def make_record(tokens=12, topk=2, num_experts=8, layers=(1, 2), probs=True, **fields):
    g = torch.Generator().manual_seed(tokens * 31 + num_experts)
    indices = {layer: random_indices(tokens, topk, num_experts, g) for layer in layers}
    p = {layer: torch.rand(tokens, topk, generator=g) for layer in layers} if probs else None
    return RoutingRecord(indices=indices, probs=p, num_experts=num_experts, **fields)


# --------------------------------------------------------------------------- record + validation


def test_defaults_inferred():
    rec = make_record(layers=(5, 1, 3))
    assert rec.layers == [1, 3, 5] and rec.topk == 2 and rec.num_tokens == 12
    assert rec.parallel is None and rec.version == 1 and rec.source == "megatron"


def _bad(match, **changes):
    base = dict(indices={1: torch.tensor([[0, 1], [2, 3], [4, 5]]), 2: torch.tensor([[1, 0], [3, 2], [5, 4]])},
                num_experts=8)
    base.update(changes)
    with pytest.raises(RoutingRecordError, match=match):
        RoutingRecord(**base)


def test_validation_errors():
    good = torch.tensor([[0, 1], [2, 3], [4, 5]])
    _bad(r"layer 2, row 1: expert id 8 out of range \[0, 8\)",
         indices={1: good, 2: torch.tensor([[0, 1], [2, 8], [4, 5]])})
    _bad(r"layer 1, row 2: expert id -1 out of range", indices={1: torch.tensor([[0, 1], [2, 3], [-1, 5]])})
    _bad(r"layer 2, row 0: expert 3 chosen twice \(row \[3, 3\]\)",
         indices={1: good, 2: torch.tensor([[3, 3], [2, 1], [4, 5]])})
    _bad(r"layer 2: 2 tokens, but layer 1 has 3", indices={1: good, 2: good[:2]})
    _bad(r"layer 2: indices must have shape \[tokens, topk=2\], got \[3, 3\]",
         indices={1: good, 2: torch.tensor([[0, 1, 2], [2, 3, 4], [4, 5, 6]])})
    _bad(r"layer 1: indices must have shape", indices={1: torch.tensor([0, 1, 2])}, topk=1)
    _bad(r"layer 1: indices must be an integer tensor, got torch.float32", indices={1: good.float()})
    _bad(r"indices hold 6 tokens but sum\(seq_lens\) = 5", indices={1: torch.arange(12).view(6, 2)},
         num_experts=12, seq_lens=[2, 3])
    _bad(r"topk must be an int in \[1, num_experts=8\]", topk=9)
    _bad(r"num_experts must be a positive int", num_experts=0)
    _bad(r"indices must be a non-empty dict", indices={})
    _bad(r"layer ids must be non-negative ints", indices={"1": good})
    _bad(r"layers \[1\] do not match", layers=[1])
    _bad(r"token_order must be one of", token_order="bsh")
    _bad(r"padding needs seq_lens", padding=[0])
    _bad(r"padding\[1\] = 3 not in \[0, seq_lens\[1\] = 2\]", seq_lens=[1, 2], padding=[0, 3])
    _bad(r"2 sample_ids but 1 seq_lens", seq_lens=[3], sample_ids=["a", "b"])
    _bad(r"sample_ids\[0\] must be a str or int", sample_ids=[1.5])
    _bad(r"probs must have the same layers", probs={1: torch.rand(3, 2)})
    _bad(r"layer 2: probs shape \[3, 3\] != indices shape \[3, 2\]",
         probs={1: torch.rand(3, 2), 2: torch.rand(3, 3)})
    _bad(r"layer 1: probs must be a floating-point tensor", probs={1: good, 2: good})
    _bad(r"layer 1, row 1: non-finite probability",
         probs={1: torch.tensor([[0.5, 0.5], [float("nan"), 1.0], [0.1, 0.2]]), 2: torch.rand(3, 2)})
    _bad(r"parallel must be None or a dict", parallel={"cp": 2})
    _bad(r"parallel\['cp_rank'\] = 2 not in \[0, cp = 2\)",
         parallel={"cp": 2, "sp": False, "tp": 1, "ep": 1, "cp_rank": 2, "tp_rank": 0})
    _bad(r"extra must be JSON-serialisable", extra={"x": object()})
    _bad(r"version 2", version=2)


def test_errors_are_value_errors():
    assert issubclass(RoutingRecordError, ValueError)


# --------------------------------------------------------------------------- file format


@pytest.mark.parametrize("num_experts, code", [(8, "U8"), (256, "U8"), (300, "I16"), (40000, "I32")])
def test_round_trip_compact_dtypes(tmp_path, num_experts, code):
    rec = make_record(tokens=10, topk=3, num_experts=num_experts, layers=(0, 4, 7), seq_lens=[4, 6],
                      sample_ids=["req-a", 17], padding=[1, 0], source="sglang", token_order="requests",
                      extra={"step": 3})
    rec.indices[4][0] = torch.tensor([num_experts - 1, 0, num_experts // 2])  # the extremes survive
    path = rec.save(tmp_path / "sub" / "r.safetensors")
    meta, entries = read_header(path)
    assert meta["format"] == "source-patch-routing" and meta["version"] == 1
    assert {e["dtype"] for k, e in entries.items() if k.endswith(".indices")} == {code}
    assert sorted(entries) == sorted(f"layer.{k}.{w}" for k in (0, 4, 7) for w in ("indices", "probs"))
    back = load(path)
    assert back.equals(rec)
    assert all(t.dtype == torch.int64 for t in back.indices.values())
    assert back.sample_ids == ["req-a", 17] and back.extra == {"step": 3} and back.layers == [0, 4, 7]
    assert RoutingRecord.load(path).equals(rec)
    assert os.listdir(path.parent) == ["r.safetensors"]  # no temp file left


def test_round_trip_without_probs_and_bf16_probs(tmp_path):
    rec = make_record(probs=False)
    assert load(rec.save(tmp_path / "a.st")).probs is None
    rec = make_record()
    rec = rec.replace(probs={k: v.bfloat16() for k, v in rec.probs.items()})
    back = load(rec.save(tmp_path / "b.st"))
    assert back.probs[1].dtype == torch.bfloat16 and back.equals(rec)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = make_record().save(tmp_path / "r.st")
    before = path.read_bytes()

    real_write = os.write

    def broken(fd, data):  # the temporary file gets a part, then the disk is full
        real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "disk full")

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", broken)
        with pytest.raises(OSError, match="disk full"):
            make_record(tokens=20).save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["r.st"]


def _write_raw(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_truncated_and_corrupt_files(tmp_path):
    good = make_record().save(tmp_path / "good.st").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    cases = {
        "empty": (b"", "truncated or not a safetensors file"),
        "4 bytes": (good[:4], "truncated or not a safetensors file"),
        "mid header": (good[:8 + n // 2], r"truncated: header needs"),
        "mid data": (good[:-5], r"truncated: tensors need"),
        "huge header": (struct.pack("<Q", 1 << 40) + good[8:], r"header claims 1099511627776 bytes \(limit"),
        "garbage header": (good[:8] + b"\xff" * n + good[8 + n:], "corrupt safetensors header"),
    }
    for name, (content, match) in cases.items():
        path = tmp_path / f"{name}.st"
        path.write_bytes(content)
        with pytest.raises(RoutingRecordError, match=match):
            load(path)
    with pytest.raises(RoutingRecordError, match="cannot read"):
        load(tmp_path / "missing.st")


def test_foreign_newer_and_inconsistent_files(tmp_path):
    plain = tmp_path / "plain.st"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(RoutingRecordError, match="not a routing record"):
        load(plain)

    rec = make_record()
    meta = rec.metadata()
    tensors = {f"layer.{k}.indices": rec.indices[k].to(torch.uint8) for k in rec.layers}
    tensors.update({f"layer.{k}.probs": rec.probs[k] for k in rec.layers})

    def write(name, meta_changes, tensors=tensors):
        path = tmp_path / name
        save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps({**meta, **meta_changes})})
        return path

    with pytest.raises(RoutingRecordError, match=r"newer source-patch \(routing format version 2\)"):
        load(write("newer.st", {"version": 2}))
    with pytest.raises(RoutingRecordError, match="format is 'other'"):
        load(write("other.st", {"format": "other"}))
    with pytest.raises(RoutingRecordError, match=r"corrupt routing metadata \(version 0\)"):
        load(write("v0.st", {"version": 0}))
    with pytest.raises(RoutingRecordError, match=r"missing \['layer.2.probs'\]"):
        load(write("missing.st", {}, {k: v for k, v in tensors.items() if k != "layer.2.probs"}))
    with pytest.raises(RoutingRecordError, match="layer 1: indices stored as 'F32'"):
        load(write("float.st", {}, {**tensors, "layer.1.indices": rec.indices[1].float()}))
    with pytest.raises(RoutingRecordError, match=r"expert id 9 out of range"):
        bad = {**tensors, "layer.2.indices": torch.tensor([[9, 1]] * 12, dtype=torch.uint8)}
        load(write("range.st", {}, bad))
    without_layers = json.dumps({k: v for k, v in meta.items() if k != "layers"})
    with pytest.raises(RoutingRecordError, match="routing metadata lacks or mangles 'layers'"):
        load(_write_raw(tmp_path / "nolayers.st", {"__metadata__": {METADATA_KEY: without_layers}}))
    with pytest.raises(RoutingRecordError, match="corrupt routing metadata"):
        load(_write_raw(tmp_path / "badjson.st", {"__metadata__": {METADATA_KEY: "{nope"}}))


def test_oversized_metadata_refused_on_save(tmp_path, monkeypatch):
    monkeypatch.setattr(record_file, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(RoutingRecordError, match="metadata is .* bytes: too large"):
        make_record(extra={"blob": "x" * 5000}).save(tmp_path / "big.st")


# --------------------------------------------------------------------------- CP / SP slicing


class FakeGroup:
    """What Megatron's helpers read from a process group: size() and rank()."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(scope="module")
def megatron_cp_helpers():
    """Megatron-Core's own slicing code: ``utils.get_batch_on_this_cp_rank`` (CP zigzag,
    given an explicit ``cp_group``) and ``tensor_parallel.mappings._split_along_first_dim``
    (the forward of ``scatter_to_sequence_parallel_region``).  Both only call
    ``group.size()`` / ``group.rank()``; ``get_pg_size`` / ``get_pg_rank`` also want
    ``torch.distributed.is_initialized()``, so a gloo world of one is started."""
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


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("sp, tp", [(False, 1), (False, 2), (True, 2)])
def test_slice_matches_megatron(megatron_cp_helpers, cp, sp, tp):
    get_batch_on_this_cp_rank, split_first_dim = megatron_cp_helpers
    seq, batch = 32, 3
    # Token id = its row in the [s, b]-flattened full sequence; the batch Megatron slices is [b, s].
    ids_sb = torch.arange(seq * batch).view(seq, batch)
    rec = RoutingRecord(indices={1: ids_sb.reshape(-1, 1), 2: ids_sb.reshape(-1, 1).flip(0)},
                        num_experts=seq * batch, seq_lens=[seq] * batch, sample_ids=["a", "b", "c"])
    seen = {}
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            tokens = get_batch_on_this_cp_rank({"tokens": ids_sb.t().contiguous()},
                                               cp_group=FakeGroup(cp, cp_rank))["tokens"]  # [b, s/cp]
            hidden = tokens.t().contiguous()       # the embedding's transpose to [s, b]
            if sp:
                hidden = split_first_dim(hidden, FakeGroup(tp, tp_rank))
            expected = hidden.reshape(-1)          # the router's view(-1, hidden): seq-major
            mine = slice_for_rank(rec, batch=batch, cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                                  sequence_parallel=sp)
            assert torch.equal(mine.indices[1][:, 0], expected), (cp_rank, tp_rank)
            assert torch.equal(mine.indices[2][:, 0], rec.indices[2][expected, 0])
            assert mine.seq_lens == [seq // cp // (tp if sp else 1)] * batch
            assert mine.parallel == {"cp": cp, "sp": sp, "tp": tp, "ep": 1, "cp_rank": cp_rank, "tp_rank": tp_rank}
            seen[(cp_rank, tp_rank)] = mine
    assert gather_slices(seen.values()).equals(rec)
    assert gather_slices(reversed(list(seen.values()))).equals(rec)


def test_slice_padding_and_probs():
    seq, batch = 8, 2
    rec = make_record(tokens=seq * batch, seq_lens=[seq] * batch, padding=[3, 0])
    parts = [slice_for_rank(rec, batch=batch, cp_size=2, cp_rank=r) for r in range(2)]
    # chunks of 2: rank 0 holds positions 0,1,6,7 ; rank 1 holds 2,3,4,5 ; sample 0 pads 5,6,7
    assert parts[0].padding == [2, 0] and parts[1].padding == [1, 0]
    assert torch.equal(parts[1].probs[2], rec.probs[2][token_rows(torch.tensor([2, 3, 4, 5]), batch)])
    assert gather_slices(parts).equals(rec)


def test_slice_errors():
    rec = make_record(tokens=24, seq_lens=[12, 12])
    with pytest.raises(RoutingRecordError, match="not divisible by 2 \\* cp_size = 8"):
        slice_for_rank(rec, batch=2, cp_size=4, cp_rank=0)
    with pytest.raises(RoutingRecordError, match="CP-local sequence length 6 is not divisible by tp_size = 4"):
        slice_for_rank(rec, batch=2, cp_size=2, cp_rank=0, tp_size=4, tp_rank=0, sequence_parallel=True)
    with pytest.raises(RoutingRecordError, match=r"cp_rank 2 not in \[0, cp_size = 2\)"):
        slice_for_rank(rec, batch=2, cp_size=2, cp_rank=2)
    with pytest.raises(RoutingRecordError, match="do not describe 3 sequences"):
        slice_for_rank(rec, batch=3, cp_size=1, cp_rank=0)
    with pytest.raises(RoutingRecordError, match="only a 'megatron-sbh' record"):
        slice_for_rank(rec.replace(token_order="requests"), batch=2, cp_size=1, cp_rank=0)
    part = slice_for_rank(rec, batch=2, cp_size=2, cp_rank=0, tp_size=2, tp_rank=0, sequence_parallel=True)
    with pytest.raises(RoutingRecordError, match="already a slice"):
        slice_for_rank(part, batch=2, cp_size=1, cp_rank=0)
    with pytest.raises(RoutingRecordError, match="no slice for cp_rank 0/tp_rank 1, cp_rank 1/tp_rank 0"):
        gather_slices([part, slice_for_rank(rec, batch=2, cp_size=2, cp_rank=1, tp_size=2, tp_rank=1,
                                            sequence_parallel=True)])
    with pytest.raises(RoutingRecordError, match="both for cp_rank 0, tp_rank 0"):
        gather_slices([part, part])
    other = slice_for_rank(rec, batch=2, cp_size=3, cp_rank=1)
    with pytest.raises(RoutingRecordError, match=r"parallel\['cp'\]=3"):
        gather_slices([part, other])
    with pytest.raises(RoutingRecordError, match="not a per-rank slice"):
        gather_slices([rec])


def test_gather_without_sp_checks_tp_copies():
    rec = make_record(tokens=16, seq_lens=[8, 8])
    parts = [slice_for_rank(rec, batch=2, cp_size=2, cp_rank=c, tp_size=2, tp_rank=t) for c in (0, 1) for t in (0, 1)]
    assert gather_slices(parts).equals(rec)
    changed = parts[1].replace(indices={k: v.flip(1) for k, v in parts[1].indices.items()})
    with pytest.raises(RoutingRecordError, match="both for cp_rank 0, tp_rank 1 and differ"):
        gather_slices([parts[0], changed, parts[2]])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp=st.sampled_from([1, 2, 3, 4]), tp=st.sampled_from([1, 2, 3]), sp=st.booleans(),
       batch=st.integers(1, 3), chunk=st.integers(1, 3), topk=st.integers(1, 3),
       with_probs=st.booleans(), pads=st.lists(st.integers(0, 100), min_size=3, max_size=3), data=st.data())
def test_slice_gather_round_trip(cp, tp, sp, batch, chunk, topk, with_probs, pads, data):
    seq = 2 * cp * tp * chunk
    rec = make_record(tokens=seq * batch, topk=topk, num_experts=6, layers=(1, 3), probs=with_probs,
                      seq_lens=[seq] * batch, padding=[p % (seq + 1) for p in pads[:batch]])
    ranks = [(c, t) for c in range(cp) for t in range(tp)]
    order = data.draw(st.permutations(ranks))
    parts = [slice_for_rank(rec, batch=batch, cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t,
                            sequence_parallel=sp) for c, t in order]
    total = sum(p.num_tokens for p in parts)
    assert total == rec.num_tokens * (1 if sp else tp)
    assert gather_slices(parts).equals(rec)


# --------------------------------------------------------------------------- Megatron's RouterReplay


@pytest.fixture
def router_replay():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    saved = list(RouterReplay.global_router_replay_instances)
    RouterReplay.clear_global_router_replay_instances()
    yield RouterReplay, RouterReplayAction, topk_routing_with_score_function
    RouterReplay.global_router_replay_instances[:] = saved


def test_native_round_trip(tmp_path, router_replay):
    RouterReplay, Action, route = router_replay
    tokens, experts, topk = 10, 8, 2
    instances = [RouterReplay() for _ in range(3)]   # what TopKRouter makes per MoE layer
    RouterReplay.set_global_router_replay_action(Action.RECORD)
    logits = {i: torch.randn(tokens, experts) for i in range(3)}
    for i, inst in enumerate(instances):
        route(logits[i], topk, score_function="softmax", router_replay=inst)
    rec = megatron_native.from_megatron_native(num_experts=experts, layers=[2, 4, 6], seq_lens=[5, 5])
    assert rec.layers == [2, 4, 6]
    for i, layer in enumerate([2, 4, 6]):
        assert torch.equal(rec.indices[layer], logits[i].topk(topk, dim=1).indices)
    rec = load(rec.save(tmp_path / "native.st"))

    # Replay those routes into fresh logits that would pick other experts.
    RouterReplay.clear_global_indices()
    native = megatron_native.to_megatron_native(rec, install=True)
    assert [t.dtype for t in native] == [torch.int64] * 3
    RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
    for i, (inst, layer) in enumerate(zip(instances, rec.layers)):
        _, routing_map = route(-logits[i], topk, score_function="softmax", router_replay=inst)
        expected = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, rec.indices[layer], True)
        assert torch.equal(routing_map, expected)
    assert all(len(inst.replay_backward_list) == 1 for inst in instances)  # queued for recompute


def test_native_errors_and_layer_map(router_replay):
    RouterReplay, _, _ = router_replay
    instances = [RouterReplay(), RouterReplay()]
    with pytest.raises(RoutingRecordError, match=r"instance 1 \(layer 1\) recorded nothing"):
        megatron_native.from_megatron_native([torch.tensor([[0, 1]]), None], num_experts=4)
    with pytest.raises(RoutingRecordError, match="3 layers for 2 RouterReplay instances"):
        megatron_native.to_megatron_native(make_record(layers=(1, 2, 3)), install=True)
    with pytest.raises(RoutingRecordError, match="record has no layer 9"):
        megatron_native.to_megatron_native(make_record(), layers=[1, 9])

    class Router(torch.nn.Module):
        def __init__(self, replay, layer_number):
            super().__init__()
            self.router_replay, self.layer_number = replay, layer_number

    model = torch.nn.Sequential(Router(instances[1], 7), Router(None, 8), Router(instances[0], 3))
    assert megatron_native.megatron_replay_layers(model) == [3, 7]
    RouterReplay()
    with pytest.raises(RoutingRecordError, match="instance 2 belongs to no router"):
        megatron_native.megatron_replay_layers(model)


# --------------------------------------------------------------------------- CLI


def test_cli(tmp_path, capsys):
    path = make_record(num_experts=300, seq_lens=[6, 6], sample_ids=["a", "b"]).save(tmp_path / "r.st")
    proc = subprocess.run([sys.executable, "-m", "source_patch.runtime.routing.records.describe", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "source-patch-routing v1" in proc.stdout and "num_experts: 300" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "load min" in line).split()
    assert header[:5] == ["layer", "tokens", "topk", "dtype", "probs"]
    row = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["2"]).split()
    assert row[:5] == ["2", "12", "2", "int16", "float32"]

    bad = tmp_path / "bad.st"
    bad.write_bytes(path.read_bytes()[:40])
    assert describe.main([str(bad)]) == 2  # unusable input (the exit-code table, core/commands.py)
    assert "source-patch: error:" in capsys.readouterr().err
