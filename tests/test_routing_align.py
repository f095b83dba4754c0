"""Aligning SGLang per-request routing records to Megatron's [seq, batch] training layout,
the inverse split, and the routing diff report."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from source_patch.runtime.routing.align import (BatchLayout, RoutingAlignError, align_to_megatron,
                                                filler_indices, routing_diff, split_to_requests,
                                                valid_mask)
from source_patch.runtime.routing.records.file import RoutingRecordError
from source_patch.runtime.routing.records.record import RoutingRecord, load
from source_patch.runtime.routing.records.slicing import slice_for_rank

E, K, LAYERS = 8, 2, (1, 3)


def request(sid, n, *, seed=None, layers=LAYERS, num_experts=E, topk=K, probs=True):
    """A SGLang-style record: one request of n tokens; token j of layer L routes to a
    deterministic distinct pair, different per request, token and layer."""
    g = torch.Generator().manual_seed(hash((str(sid), n, seed)) % (2 ** 31))
    idx = {layer: torch.rand(n, num_experts, generator=g).topk(topk, dim=1).indices for layer in layers}
    p = {layer: torch.rand(n, topk, generator=g) for layer in layers} if probs else None
    return RoutingRecord(indices=idx, probs=p, num_experts=num_experts, topk=topk, token_order="requests",
                         sample_ids=[sid], seq_lens=[n], source="sglang")


def at(rec, layer, s, b, batch):
    return rec.indices[layer][s * batch + b]


# --------------------------------------------------------------------------- hand-built examples


def test_right_padded_two_requests():
    a, b = request("a", 5), request("b", 3)
    layout = BatchLayout.padded([("a", 5), ("b", 3)])
    assert (layout.seq_len, layout.batch, layout.sample_order) == (5, 2, ["a", "b"])
    out = align_to_megatron([a, b], layout)
    assert out.token_order == "megatron-sbh" and out.num_tokens == 10
    assert out.sample_ids == ["a", "b"] and out.seq_lens == [5, 5] and out.padding == [0, 2]
    for layer in LAYERS:
        for s in range(5):  # token (s, b) is row s * batch + b
            assert torch.equal(at(out, layer, s, 0, 2), a.indices[layer][s])
            assert torch.equal(out.probs[layer][s * 2], a.probs[layer][s])
        for s in range(3):
            assert torch.equal(at(out, layer, s, 1, 2), b.indices[layer][s])
        for s in (3, 4):  # padding: spread filler, probs 0
            t = s * 2 + 1
            assert at(out, layer, s, 1, 2).tolist() == [(t * K) % E, (t * K + 1) % E]
            assert out.probs[layer][t].tolist() == [0.0, 0.0]
    assert valid_mask(out).tolist() == [True, True] * 3 + [True, False] * 2
    # the aligned record is an ordinary megatron-sbh record: it slices for a rank
    out6 = align_to_megatron([a, b], BatchLayout.padded([("a", 5), ("b", 3)], pad_to_multiple_of=4))
    assert out6.num_tokens == 16 and out6.padding == [3, 5]
    part = slice_for_rank(out6, batch=2, cp_size=2, cp_rank=1)
    # cp rank 1 holds chunks 1 and 2 of 4: positions 2..5; a pads 5..7, b pads 3..7
    assert part.padding == [1, 3]
    assert torch.equal(part.indices[1].view(4, 2, K)[:3, 0], a.indices[1][2:5])
    assert torch.equal(part.indices[1].view(4, 2, K)[:1, 1], b.indices[1][2:3])


def test_left_padding_and_lowest_filler():
    a, b = request("a", 2), request("b", 4)
    layout = BatchLayout.padded([("a", 2), ("b", 4)], seq_len=4, side="left")
    out = align_to_megatron([b, a], layout, filler="lowest")
    assert layout.rows[0] == (("a", 2, 2),)
    for layer in LAYERS:
        assert at(out, layer, 0, 0, 2).tolist() == [0, 1] and at(out, layer, 1, 0, 2).tolist() == [0, 1]
        assert torch.equal(at(out, layer, 2, 0, 2), a.indices[layer][0])
        assert torch.equal(at(out, layer, 3, 0, 2), a.indices[layer][1])
    assert out.padding == [0, 0]  # left padding is not trailing: only the mask knows
    assert valid_mask(out).view(4, 2)[:, 0].tolist() == [False, False, True, True]
    assert out.extra["aligned"]["filler"] == "lowest"


def test_packed_rows():
    recs = [request("a", 3), request("b", 2), request("c", 4)]
    layout = BatchLayout.packed([[("a", 3), ("b", 2)], [("c", 4)]], seq_len=6)
    assert layout.rows == ((("a", 0, 3), ("b", 3, 2)), (("c", 0, 4),))
    out = align_to_megatron(recs, layout)
    assert out.sample_ids == ["a+b", "c"] and out.padding == [1, 2]
    for layer in LAYERS:
        for j in range(3):
            assert torch.equal(at(out, layer, j, 0, 2), recs[0].indices[layer][j])
        for j in range(2):
            assert torch.equal(at(out, layer, 3 + j, 0, 2), recs[1].indices[layer][j])
        for j in range(4):
            assert torch.equal(at(out, layer, j, 1, 2), recs[2].indices[layer][j])
    assert valid_mask(out).view(6, 2).T.tolist() == [[True] * 5 + [False], [True] * 4 + [False] * 2]
    assert BatchLayout.pack_greedy([("a", 3), ("b", 2), ("c", 4)], seq_len=6) == layout
    assert BatchLayout.pack_greedy([("a", 3)], seq_len=6, batch=3).rows[1:] == ((), ())


def test_sample_order_permuted():
    a, b, c = request("a", 4), request("b", 2), request("c", 3)
    fwd = align_to_megatron([a, b, c], BatchLayout.padded([("a", 4), ("b", 2), ("c", 3)]))
    rev = align_to_megatron([a, b, c], BatchLayout.padded([("c", 3), ("a", 4), ("b", 2)]))
    assert rev.sample_ids == ["c", "a", "b"]
    for layer in LAYERS:  # row b of fwd is row perm[b] of rev
        f, r = fwd.indices[layer].view(4, 3, K), rev.indices[layer].view(4, 3, K)
        for fb, rb, n in ((0, 1, 4), (1, 2, 2), (2, 0, 3)):
            assert torch.equal(f[:n, fb], r[:n, rb])
    # records given as a dict and in any order, with extra requests not in the batch
    again = align_to_megatron({"x": c, "y": request("zz", 7), "z": b, "w": a},
                              BatchLayout.padded([("c", 3), ("a", 4), ("b", 2)]))
    assert again.equals(rev)


def test_multi_request_record_and_int_ids():
    one, two = request(7, 3), request(9, 2)
    both = RoutingRecord(indices={k: torch.cat([one.indices[k], two.indices[k]]) for k in LAYERS},
                         num_experts=E, token_order="requests", sample_ids=[7, 9], seq_lens=[3, 2])
    out = align_to_megatron([both], BatchLayout.padded([(9, 2), (7, 3)]))
    assert out.sample_ids == [9, 7] and out.probs is None
    for k in LAYERS:
        assert torch.equal(out.indices[k].view(3, 2, K)[:3, 1], one.indices[k])
        assert torch.equal(out.indices[k].view(3, 2, K)[:2, 0], two.indices[k])


def test_missing_tail_token():
    # SGLang never forwards the last sampled token: the record may be one short
    a = request("a", 4)
    layout = BatchLayout.padded([("a", 5)], seq_len=6)
    with pytest.raises(RoutingAlignError, match="missing_tail=1"):
        align_to_megatron([a], layout)
    out = align_to_megatron([a], layout, missing_tail=1)
    assert out.padding == [2] and valid_mask(out).tolist() == [True] * 4 + [False] * 2
    back, = split_to_requests(out)
    assert back.seq_lens == [4] and torch.equal(back.indices[1], a.indices[1])


# --------------------------------------------------------------------------- round trip + file


def test_round_trip_and_file(tmp_path):
    recs = [request("a", 3), request("b", 2), request("c", 4)]
    layout = BatchLayout.packed([[("c", 4)], [("a", 3), ("b", 2)]], seq_len=8)
    out = align_to_megatron(recs, layout, extra={"step": 3})
    out.save(tmp_path / "r.safetensors")
    loaded = load(tmp_path / "r.safetensors")
    assert loaded.extra["step"] == 3
    for back in (split_to_requests(out, layout), split_to_requests(loaded)):  # layout from extra
        assert [r.sample_ids for r in back] == [["c"], ["a"], ["b"]]
        by_id = {r.sample_ids[0]: r for r in recs}
        for r in back:
            orig = by_id[r.sample_ids[0]]
            assert r.token_order == "requests" and r.seq_lens == orig.seq_lens
            for k in LAYERS:
                assert torch.equal(r.indices[k].long(), orig.indices[k])
                assert torch.equal(r.probs[k], orig.probs[k])
    assert align_to_megatron(split_to_requests(loaded), layout, extra={"step": 3}).equals(loaded)


# --------------------------------------------------------------------------- errors


def test_error_missing_sample():
    with pytest.raises(RoutingAlignError, match="sample 'b' .* is in no request record"):
        align_to_megatron([request("a", 2)], BatchLayout.padded([("a", 2), ("b", 2)]))


def test_error_sample_longer_than_slot():
    with pytest.raises(RoutingAlignError, match="sample 'a' is longer than its slot: the record has 5"):
        align_to_megatron([request("a", 5)], BatchLayout.padded([("a", 4)], seq_len=6))
    with pytest.raises(RoutingAlignError, match="sample 'a' is longer than its slot"):
        BatchLayout.padded([("a", 7)], seq_len=6)
    with pytest.raises(RoutingAlignError, match="sample 'b' is longer than its slot"):
        BatchLayout.packed([[("a", 4), ("b", 3)]], seq_len=6)
    with pytest.raises(RoutingAlignError, match="longer than its slot"):
        BatchLayout(4, ((("a", 2, 3),),))
    with pytest.raises(RoutingAlignError, match="sample 'a' is longer than its slot"):
        BatchLayout.pack_greedy([("a", 9)], seq_len=6)


def test_error_record_shorter_than_layout():
    with pytest.raises(RoutingAlignError, match="sample 'a': the record has 2 tokens, the layout says 4"):
        align_to_megatron([request("a", 2)], BatchLayout.padded([("a", 4)]))


@pytest.mark.parametrize("other, what", [
    (lambda: request("b", 2, layers=(1, 2)), "layers"),
    (lambda: request("b", 2, num_experts=16), "num_experts"),
    (lambda: request("b", 2, topk=3), "topk"),
    (lambda: request("b", 2, probs=False), "probs"),
])
def test_error_records_disagree(other, what):
    with pytest.raises(RoutingAlignError, match=what):
        align_to_megatron([request("a", 2), other()], BatchLayout.padded([("a", 2), ("b", 2)]))


def test_error_token_count_not_seq_lens():
    with pytest.raises(RoutingRecordError, match="sum\\(seq_lens\\)"):
        RoutingRecord(indices={1: torch.tensor([[0, 1], [2, 3]])}, num_experts=E, token_order="requests",
                      sample_ids=["a"], seq_lens=[3])
    rec = request("a", 3)
    rec.seq_lens = [2]  # mutated after construction: align revalidates
    with pytest.raises(RoutingRecordError, match="sum\\(seq_lens\\)"):
        align_to_megatron([rec], BatchLayout.padded([("a", 2)]))


def test_error_misc():
    a = request("a", 2)
    with pytest.raises(RoutingAlignError, match="'a' is in record 0 and record 1"):
        align_to_megatron([a, request("a", 2)], BatchLayout.padded([("a", 2)]))
    with pytest.raises(RoutingAlignError, match="token_order 'megatron-sbh'"):
        align_to_megatron([a.replace(token_order="megatron-sbh")], BatchLayout.padded([("a", 2)]))
    with pytest.raises(RoutingAlignError, match="appears twice"):
        BatchLayout(4, ((("a", 0, 2),), (("a", 0, 2),)))
    with pytest.raises(RoutingAlignError, match="overlap"):
        BatchLayout(6, ((("a", 0, 3), ("b", 2, 2)),))
    with pytest.raises(RoutingAlignError, match="no sample_ids"):
        align_to_megatron([a.replace(sample_ids=None)], BatchLayout.padded([("a", 2)]))
    with pytest.raises(RoutingAlignError, match="filler"):
        align_to_megatron([a], BatchLayout.padded([("a", 2)]), filler="zeros")
    with pytest.raises(RoutingAlignError, match="rows of 6, batch is 1"):
        BatchLayout.pack_greedy([("a", 4), ("b", 4)], seq_len=6, batch=1)
    with pytest.raises(RoutingAlignError, match="pass layout="):
        split_to_requests(request("a", 2).replace(token_order="megatron-sbh", sample_ids=None, seq_lens=None))


def test_filler_distinct_and_spread():
    rows = torch.arange(64)
    f = filler_indices(rows, 3, 8)
    assert all(len(set(r)) == 3 for r in f.tolist())
    assert torch.bincount(f.reshape(-1), minlength=8).tolist() == [24] * 8
    assert filler_indices(rows[:2], 3, 8, "lowest").tolist() == [[0, 1, 2]] * 2
    assert all(len(set(r)) == 8 for r in filler_indices(rows, 8, 8).tolist())  # topk == num_experts


# --------------------------------------------------------------------------- routing_diff


def test_routing_diff_known_differences():
    a, b = request("a", 4), request("b", 2)
    layout = BatchLayout.padded([("a", 4), ("b", 2)])
    ref = align_to_megatron([a, b], layout)
    # same sets in another order: not a difference
    other = {k: ref.indices[k].flip(1).clone() for k in LAYERS}
    # layer 3: tokens (s=1, b=0) and (s=0, b=1) change their set
    for t in (1 * 2 + 0, 0 * 2 + 1):
        row = other[3][t]
        other[3][t] = torch.tensor([e for e in range(E) if e not in row.tolist()][:K])
    # layer 1: token (s=1, b=0) changes one expert of two; padding (s=3, b=1) changes: ignored
    row = other[1][2].tolist()
    other[1][2] = torch.tensor([row[0], next(e for e in range(E) if e not in row)])
    other[1][7] = torch.tensor([5, 6]) if other[1][7].tolist() != [5, 6] else torch.tensor([6, 7])
    d = routing_diff(ref, ref.replace(indices=other, probs=None))
    assert d.tokens == 6 and d.per_layer == {1: 1, 3: 2} and d.tokens_differing == 2
    assert d.layers_differing == [1, 3] and not d.identical
    assert d.fraction == pytest.approx(2 / 6) and d.layer_fraction(3) == pytest.approx(2 / 6)
    assert d.overlap[1] == pytest.approx(1 - 0.5 / 6) and d.overlap[3] == pytest.approx(1 - 2 / 6)
    text = str(d)
    assert "2 of 6 tokens (33.33%)" in text and "2 of 2 layers differ" in text
    lines = text.splitlines()
    assert lines[1].split() == ["layer", "tokens", "differing", "fraction", "mean", "overlap"]
    assert lines[2].split()[:3] == ["1", "1", "16.67%"] and lines[3].split()[:3] == ["3", "2", "33.33%"]
    # all tokens counted with an explicit mask: padding change now shows
    d_all = routing_diff(ref, ref.replace(indices=other, probs=None), valid_mask=torch.ones(8, dtype=torch.bool))
    assert d_all.tokens == 8 and d_all.per_layer[1] == 2
    assert routing_diff(ref, ref).identical and routing_diff(ref, ref).overlap == {1: 1.0, 3: 1.0}


def test_routing_diff_errors():
    a = request("a", 4)
    with pytest.raises(RoutingAlignError, match="tokens"):
        routing_diff(a, request("a", 3))
    with pytest.raises(RoutingAlignError, match="layers"):
        routing_diff(a, request("a", 4, layers=(1, 2)))
    with pytest.raises(RoutingAlignError, match="valid_mask has 3"):
        routing_diff(a, a, valid_mask=torch.ones(3, dtype=torch.bool))


# --------------------------------------------------------------------------- property


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    ids = draw(st.permutations([f"r{i}" if i % 2 else i for i in range(n)]))
    seq_len = max(lengths + [1]) + draw(st.integers(0, 3))
    rows, row, used = [], [], 0
    for sid, length in zip(ids, lengths):  # random packing with random gaps
        gap = draw(st.integers(0, 2))
        if row and (draw(st.booleans()) or used + gap + length > seq_len):
            rows.append(tuple(row))
            row, used = [], 0
            gap = draw(st.integers(0, seq_len - length))
        gap = min(gap, seq_len - used - length)
        row.append((sid, used + gap, length))
        used += gap + length
    rows.append(tuple(row))
    rows += [()] * draw(st.integers(0, 1))
    order = draw(st.permutations(range(len(rows))))
    return BatchLayout(seq_len, tuple(rows[i] for i in order)), dict(zip(ids, lengths))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.sampled_from(["spread", "lowest"]), st.booleans())
def test_align_split_round_trip(drawn, filler, with_probs):
    layout, lengths = drawn
    recs = [request(sid, n, probs=with_probs) for sid, n in lengths.items()]
    out = align_to_megatron(recs, layout, filler=filler)
    assert out.num_tokens == layout.seq_len * layout.batch
    mask = valid_mask(out)
    assert int(mask.sum()) == sum(lengths.values())
    # every token (s, b) holds what the layout says
    by_id = {r.sample_ids[0]: r for r in recs}
    for b, row in enumerate(layout.rows):
        for sid, start, length in row:
            for layer in LAYERS:
                got = out.indices[layer].view(layout.seq_len, layout.batch, K)[start:start + length, b]
                assert torch.equal(got, by_id[sid].indices[layer])
    for layer in LAYERS:  # padding filler: valid distinct ids
        pad = out.indices[layer][~mask]
        assert all(len(set(r)) == K for r in pad.tolist())
    back = split_to_requests(out)
    assert [r.sample_ids[0] for r in back] == layout.sample_order
    for r in back:
        orig = by_id[r.sample_ids[0]]
        assert r.seq_lens == orig.seq_lens
        for layer in LAYERS:
            assert torch.equal(r.indices[layer], orig.indices[layer])
            if with_probs:
                assert torch.equal(r.probs[layer], orig.probs[layer])
    assert align_to_megatron(back, layout, filler=filler).equals(out.replace(source="sglang"))
    assert routing_diff(out, out).identical
