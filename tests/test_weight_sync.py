"""Weight sync (runtime/weight_sync/sync.py, weight_transport.py, weight_megatron.py;
patches/weight_sync.yaml, both sides).

Unit: manifest validation, bucket layout, settings, the call sites' pass-through.
Transport: two processes over gloo (and over NCCL where two GPUs are) run
scenario after scenario on one group (tests/e2e/weight_sync_transport.py).  End to end: Megatron-Core trainers on CPU
(tests/e2e/weight_sync_trainer.py) push to an engine running SGLang's own
weight-update code with its Qwen3MoeForCausalLM (tests/e2e/weight_sync_engine.py).
"""

import dataclasses
import gc
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from source_patch.runtime.core import settings
from source_patch.runtime.weight_sync import sync as weight_sync
from source_patch.runtime.weight_sync import receiver as wt_receiver
from source_patch.runtime.weight_sync import sender as wt_sender
from source_patch.runtime.weight_sync import wire
from source_patch.runtime.weight_sync import transport as wt

E2E = Path(__file__).parent / "e2e"
ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(E2E))
import weight_sync_models as models  # noqa: E402

TIMEOUT_S = 60  # weight_sync.timeout_s in the end-to-end runs: first connections wait for slow starts


# ------------------------------------------------------------------ unit


def test_plan_lays_tensors_out_aligned_and_cuts_buckets_through_them():
    m = wt.plan([("a", (3,), torch.float32), ("b", (100,), torch.bfloat16), ("c", (), torch.int64)],
                bucket_bytes=64, version=5)
    assert [(e.name, e.offset, e.nbytes) for e in m.entries] == [("a", 0, 12), ("b", 16, 200), ("c", 224, 8)]
    assert m.total_bytes == 240 and m.buckets == 4
    assert [m.window(k) for k in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 240)]  # "b" spans 4


def test_manifest_is_json_and_round_trips():
    m = wt.plan([("x.weight", (2, 3), torch.bfloat16), ("y", (4,), torch.bool)], 1 << 20, version=9)
    text = m.to_json()
    assert json.loads(text)["tensors"][0] == ["x.weight", "bfloat16", [2, 3], 0]
    assert wt.Manifest.from_json(text, max_update_bytes=1 << 20) == m


def test_a_receiver_parses_the_same_tensor_list_once():
    first = wt.plan([("a", (4,), torch.float32), ("b", (2, 2), torch.int8)], 64, version=1)
    text = first.to_json()
    known = (wire.split_tensors(text)[1], first.entries)
    again = wt.Manifest.from_json(first.__class__(2, 64, first.total_bytes, True, first.entries).to_json(),
                                  1 << 20, known)
    assert again.version == 2 and again.entries is first.entries
    with pytest.raises(ValueError, match="exceeds max_update_bytes"):  # the head is still checked
        wt.Manifest.from_json(text, 16, known)


@pytest.mark.parametrize("change, error", [
    (lambda d: d["tensors"].append(d["tensors"][0]), "duplicate|out of order"),
    (lambda d: d["tensors"][0].__setitem__(1, "complex64"), "bad dtype"),
    (lambda d: d["tensors"][1].__setitem__(3, 0), "out of order"),
    (lambda d: d["tensors"][1].__setitem__(2, [1 << 40]), "outside the stream"),
    (lambda d: d.__setitem__("total_bytes", 1 << 41), "exceeds max_update_bytes"),
    (lambda d: d.__setitem__("bucket_bytes", 100), "multiples of 16"),
    (lambda d: d.__setitem__("version", "7"), "version: expected a non-negative integer"),
    (lambda d: d.__setitem__("format", 1), "not a format-2 manifest"),
])
def test_a_bad_manifest_is_refused_with_a_reason(change, error):
    doc = json.loads(wt.plan([("a", (4,), torch.float32), ("b", (4,), torch.float32)], 64, 1).to_json())
    change(doc)
    with pytest.raises(ValueError, match=error):
        wt.Manifest.from_json(json.dumps(doc).encode(), max_update_bytes=1 << 40)


def mixed_tensors():
    """Runs of three tensors of one dtype (every dtype; uint8 ones share a copy with the
    byte ranges of split tensors), sizes not multiples of 16 bytes, a tensor over several
    buckets, a 0-d and an empty one: with 256-byte buckets most tensors share or cross
    bucket ends."""
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int8, torch.bool, torch.float64, torch.int64,
              torch.float16]
    out = [(f"t{i}", (torch.randn(int(torch.randint(1, 100, (1,), generator=gen)), generator=gen) * 9)
            .to(dtypes[i // 3 % len(dtypes)])) for i in range(50)]
    out[20:20] = [("big", torch.randn(30, 40, generator=gen)), ("scalar", torch.tensor(1.5)),
                  ("empty", torch.zeros(0, 2))]
    return out


def test_packed_buckets_are_the_bytes_the_receiver_reconstructs():
    data = mixed_tensors()
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=3)
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    wt.send(tx, m, (t for _, t in data))
    received = wt.receive(rx).tensors
    assert [n for n, _ in received] == [n for n, _ in data]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, data))
    stream = rx.staged[1]  # the receiver's staging buffer: the update's byte stream
    packing = wt_sender._Packing(m, torch.device("cpu"))
    packed = 0
    for k, sources in packing.batches(t for _, t in data):
        bucket = packing.pack(k, sources)
        assert torch.equal(bucket, stream[slice(*m.window(k))]), k
        assert torch.equal(bucket, tx.messages[3 + 2 * k]), k  # header, manifest length and body, (bytes, sum) per bucket
        packed += 1
    assert packed == m.buckets > 10
    for e, (_, t) in zip(m.entries, data):  # each tensor's bytes at its planned offset
        assert torch.equal(stream[e.offset: e.offset + e.nbytes], t.reshape(-1).view(torch.uint8)), e.name


def test_bucket_0_is_packed_before_the_handshake_goes_out(monkeypatch):
    """The sender packs the first bucket before the handshake (its copies then run
    while the handshake travels, instead of holding back the first broadcast); the
    receiver still gets every tensor, and an error packing it is raised after the
    votes, with the link still usable."""
    events = []

    class Recording(wt.LoopbackLink):
        def broadcast(self, tensor):
            events.append("broadcast")
            return super().broadcast(tensor)

        def handshake(self, row, what):
            events.append("handshake")
            return super().handshake(row, what)

    pack = wt_sender._Packing.pack
    monkeypatch.setattr(wt_sender._Packing, "pack", lambda self, k, sources: events.append(f"pack {k}") or
                        pack(self, k, sources))
    data = mixed_tensors()
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=1)
    tx = Recording("cpu")
    wt.send(tx, m, (t for _, t in data))
    assert events[:3] == ["pack 0", "handshake", "broadcast"] and events.count("pack 0") == 1, events[:6]
    received = wt.receive(wt.LoopbackLink("cpu", replay=tx)).tensors
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, data))
    wrong = [t.double() if i == 0 else t for i, (_, t) in enumerate(data)]  # bucket 0's first tensor
    with pytest.raises(wt.WeightSyncError, match=data[0][0]):
        wt.send(tx, m, iter(wrong))
    wt.send(tx, m, (t for _, t in data))


class AllHold(wt.LoopbackLink):
    """A loopback link whose handshake holds only the sender's and this end's rows:
    no receiver that never accepted the layout, so no manifest travels once it is
    known (as on a group after the first update)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.votes = []

    def handshake(self, row, what):
        return super().handshake(row, what)[:-1]

    def vote(self, status, what):
        self.votes.append((what, int(status)))
        return super().vote(status, what)


def test_a_known_layout_that_cannot_be_prepared_is_received_and_dropped(monkeypatch):
    """A receiver offers the layouts it accepted before in the handshake, before it
    knows the update's.  Where preparing one then fails (no memory for its buffers),
    it still takes every bucket and its checksum, drops them and votes REJECTED: the
    sender fails at once instead of timing out, and the next update loads."""
    data = mixed_tensors()
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=1)
    tx = wt.LoopbackLink("cpu")
    wt.send(tx, m, (t for _, t in data))
    rx = AllHold("cpu", replay=tx)  # the first update: the manifest travels, the layout is accepted
    assert wt.receive(rx).version == 1 and len(rx.layouts) == 1
    held = AllHold("cpu")  # the next ones: every receiver holds the layout, no manifest
    wt.send(held, dataclasses.replace(m, version=2), (t for _, t in data))
    assert len(held.messages) == 1 + 2 * m.buckets  # the handshake row, then each bucket and its sum
    rx.source, rx.votes, rx.staged = held, [], None  # its buffers gone (another layout took the memory)
    rx.rewind()

    def no_memory(*args):
        raise torch.OutOfMemoryError("out of memory (test)")

    monkeypatch.setattr(wt_receiver._Staged, "__init__", no_memory)
    with pytest.raises(wt.WeightSyncError, match="refused here: OutOfMemoryError"):
        wt.receive(rx)
    assert rx.position == len(held.messages) and rx.votes == [("verdict", wt.REJECTED)]
    monkeypatch.undo()
    rx.rewind()
    update = wt.receive(rx)
    assert update.version == 2 and all(torch.equal(got, want) for (_, got), (_, want) in zip(update.tensors, data))


def test_the_handshake_names_a_peer_of_another_format():
    """A row of another protocol format in the handshake fails the update on every
    rank at once, saying what to do, and the receiver's link is done."""
    row = wt.handshake_row(1, 42)
    assert len(row) == wt.ROW and wt.layout_verdict([row, wt.handshake_row(take=[42])]) == wt.OK
    assert wt.layout_verdict([row, wt.handshake_row(refuse=[42])]) == wt.REJECTED
    assert wt.layout_verdict([row, wt.handshake_row(take=[42]), wt.handshake_row()]) == wt.NEED_MANIFEST
    old = [wt.MAGIC, 2, 0, 0] + [0] * (wt.ROW - 4)
    with pytest.raises(wt.WeightSyncError, match="rank 1 .* format 3 .*same source-patch"):
        wt.layout_verdict([row, old])
    tx = wt.LoopbackLink("cpu")
    tx.messages = [torch.tensor(old)]
    rx = wt.LoopbackLink("cpu", replay=tx)
    with pytest.raises(wt.WeightSyncError, match="rank 0 .* format 3"):
        wt.receive(rx)
    with pytest.raises(wt.WeightSyncError, match="broken"):
        wt.receive(rx)


def test_the_same_link_delivers_update_after_update_in_both_stages():
    data = mixed_tensors()
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=1)
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    for version, stage in enumerate(["update", "bucket", "update", "bucket"], 1):
        data = [(n, t + version if t.dtype != torch.bool else t) for n, t in data]  # new values, same layout
        tx.rewind()
        rx.rewind()
        wt.send(tx, dataclasses.replace(m, version=version), (t for _, t in data))
        update = wt.receive(rx, stage=stage)
        assert update.version == version
        handed = 0
        for (name, got), (_, want) in zip(update.tensors, data):
            assert torch.equal(got, want), (stage, name)  # before the next: streamed buffers are reused
            handed += 1
        assert handed == len(data)


def bumped(data, by):
    """New values, the same layout (bools kept: arithmetic would change their dtype)."""
    return [(n, t + by if t.dtype != torch.bool else t) for n, t in data]


def loopback_update(tx, rx, data, bucket_bytes, version, stage="bucket"):
    """Send ``data`` over a loopback pair; return receive()'s Update (not consumed)."""
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], bucket_bytes, version=version)
    tx.rewind()
    rx.rewind()
    wt.send(tx, m, (t for _, t in data))
    return wt.receive(rx, stage=stage)


def check_streamed(update, data) -> list:
    """Consume a streamed update, comparing each tensor before asking for the next (the
    bucket buffers are reused); returns the names handed out."""
    names, wanted = [], dict(data)
    for name, got in update.tensors:
        want = wanted[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        names.append(name)
    return names


def test_streamed_updates_reuse_their_plan_while_the_layout_holds_and_rebuild_it_when_it_changes():
    a = mixed_tensors()
    # Another layout: 128 bytes in two 64-byte buckets, "y" crossing the bucket end,
    # and empty tensors at offset 0, mid-stream and at offset == total_bytes (after the last bucket).
    b = [("first", torch.zeros(0)), ("x", torch.arange(8.0)), ("y", torch.arange(16.0) + 100),
         ("mid", torch.zeros(0, 3)), ("z", torch.arange(8, dtype=torch.int32)), ("end", torch.zeros(2, 0))]
    planned = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in b], 64, 1)
    assert planned.total_bytes == 128 == planned.entries[-1].offset and planned.buckets == 2
    layouts = [(a, 256), (a, 256), (b, 64), (a, 256), (a, 128), (a, 128)]  # the last two: another bucket size
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    plans = []
    for version, (data, bucket) in enumerate(layouts, 1):
        data = bumped(data, version)
        update = loopback_update(tx, rx, data, bucket, version)
        assert check_streamed(update, data) == [n for n, _ in data]
        assert rx.position == len(tx.messages)  # every message consumed: the protocol finished
        plans.append(rx.streamed)
    assert plans[1] is plans[0] and plans[5] is plans[4]  # same layout: reused
    assert len({id(p) for p in plans}) == 4  # a new plan at each change: a, b, a again, a with 128-byte buckets


def test_a_tensor_crossing_a_bucket_end_is_its_own_allocation_every_update():
    data = mixed_tensors()  # "big" (4800 bytes) spans many 256-byte buckets
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    kept = {}
    for version in (1, 2):
        data = bumped(data, version)
        for name, got in loopback_update(tx, rx, data, 256, version).tensors:
            if name == "big":
                kept[version] = (got, got.clone())
    (first, first_values), (second, _) = kept[1], kept[2]
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert torch.equal(first, first_values)  # update 2 did not write into update 1's tensor


def test_a_streamed_consumer_that_stops_early_finishes_the_protocol_and_the_next_update_works():
    data = mixed_tensors()
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    check_streamed(loopback_update(tx, rx, data, 256, 1), data)  # the plan is cached
    plan = rx.streamed
    update = loopback_update(tx, rx, data, 256, 2)
    stream = iter(update.tensors)
    # Stop mid-update, at "big" (assembled over many buckets): later buckets not yet read.
    taken = [name for name, _ in itertools.takewhile(lambda item: item[0] != "big", stream)]
    assert taken == [n for n, _ in data][:20] and rx.position < len(tx.messages)
    stream.close()
    assert rx.position == len(tx.messages)  # the rest of the buckets were drained
    update.close()  # what the engine's loaded site also calls: nothing more to do
    data = bumped(data, 3)
    update = loopback_update(tx, rx, data, 256, 3)
    assert check_streamed(update, data) == [n for n, _ in data] and rx.streamed is plan


def test_a_streamed_update_that_is_never_consumed_is_finished_by_close():
    data = mixed_tensors()
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    loopback_update(tx, rx, data, 256, 1).close()
    assert rx.position == len(tx.messages)
    assert check_streamed(loopback_update(tx, rx, data, 256, 2), data) == [n for n, _ in data]


def test_close_says_false_when_the_backend_could_not_be_closed(monkeypatch):
    """The contract: close() returns False where it could not finish, never True by rote
    (issue 55's item 3), and drops the backend all the same."""

    class Stuck:
        broken = False

        def close(self):
            raise OSError("the group would not abort")

    monkeypatch.setattr(weight_sync, "_backend", Stuck())
    assert weight_sync.close() is False
    assert weight_sync._backend is None
    assert "the group would not abort" in weight_sync.state()["last_error"]
    weight_sync.reset()
    assert weight_sync.close() is True


def test_a_checksum_mismatch_after_the_plan_was_cached_still_fails_and_hands_out_nothing_of_the_bad_bucket(
        monkeypatch):
    data = mixed_tensors()
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    check_streamed(loopback_update(tx, rx, data, 256, 1), data)
    update = loopback_update(tx, rx, data, 256, 2)
    bad = 3
    monkeypatch.setattr(wt_receiver, "before_verify", lambda k, buf: buf[:8].bitwise_not_() if k == bad else None)
    names = []
    with pytest.raises(wt.ChecksumMismatch, match=f"checksum mismatch in bucket\\(s\\) {bad} of "):
        for name, _ in update.tensors:
            names.append(name)
    end = update.manifest.window(bad - 1)[1]  # exactly the tensors that end in buckets 0 .. bad-1
    assert names == [e.name for e in update.manifest.entries if e.offset < end and e.offset + e.nbytes <= end]
    assert 0 < len(names) < len(data) and rx.position == len(tx.messages)
    monkeypatch.setattr(wt_receiver, "before_verify", None)
    data = bumped(data, 2)
    assert check_streamed(loopback_update(tx, rx, data, 256, 3), data) == [n for n, _ in data]


def test_a_receiver_reuses_its_checksum_tensors_while_the_bucket_count_holds():
    data = mixed_tensors()
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    sums = []
    for version, (bucket, stage) in enumerate([(256, "bucket"), (256, "update"), (128, "bucket")], 1):
        update = loopback_update(tx, rx, data, bucket, version, stage)
        list(update.tensors)
        sums.append(rx.sums)
        assert rx.sums[0].numel() == update.manifest.buckets
    assert sums[1] is sums[0] and sums[2] is not sums[0]


def param_buffers():
    """Two flat buffers laid out as Megatron's DDP lays out parameters with the
    distributed optimizer (views, in reverse order, each start padded to 64 elements),
    one bf16 and one fp32 (a second buffer: experts / another dtype)."""
    gen = torch.Generator().manual_seed(5)
    named, buffers = [], []
    for tag, dtype, sizes in (("dense", torch.bfloat16, [1000, 30, 2048, 7, 500]),
                              ("expert", torch.float32, [300, 64, 129])):
        starts = list(itertools.accumulate([-(-n // 64) * 64 for n in sizes], initial=0))
        flat = torch.zeros(starts[-1] + 64, dtype=dtype)
        buffers.append(flat)
        for i, n in reversed(list(enumerate(sizes))):
            view = flat[starts[i]: starts[i] + n]
            view.copy_(torch.randn(n, generator=gen) * 5)
            named.append((f"{tag}.p{i}", view.view(-1, 1) if n % 2 else view))
    return named, buffers


def test_tensors_planned_from_their_buffers_are_sent_from_the_buffers_own_memory():
    named, buffers = param_buffers()
    m, source = wt.plan_buffers(named, 1024, version=1)
    assert sorted(e.name for e in m.entries) == sorted(n for n, _ in named)
    assert [e.offset for e in m.entries] == sorted(e.offset for e in m.entries)
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    for version, stage in enumerate(["update", "bucket", "update"], 1):
        for flat in buffers:  # an optimizer step: new values in place
            flat.add_(version)
        tx.rewind()
        rx.rewind()
        wt.send(tx, dataclasses.replace(m, version=version), source)
        update = wt.receive(rx, stage=stage)
        assert check_streamed(update, named) == [e.name for e in m.entries], stage
    spans = tx.spans
    inside = [w for w in spans.whole if w is not None]
    ptrs = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in buffers]
    assert inside and all(any(lo <= w.data_ptr() < hi for lo, hi in ptrs) for w in inside)  # slices: no copy
    assert any(p is not None and len(p[0]) == 2 for p in spans.parts)  # the bucket across both buffers


def test_extra_tensors_are_packed_after_the_buffers_and_checked_against_the_plan():
    named, buffers = param_buffers()
    extra = [("qkv.q", torch.randn(7, 3)), ("scalar", torch.tensor(2.5)), ("big", torch.randn(600))]
    m, source = wt.plan_buffers(named, 1024, 1, extra=[(n, tuple(t.shape), t.dtype) for n, t in extra])
    assert [e.name for e in m.entries[-3:]] == ["qkv.q", "scalar", "big"]  # after every buffer's tensors
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    for version in (1, 2):
        extra = [(n, t * 2) for n, t in extra]  # computed anew for each update
        tx.rewind()
        rx.rewind()
        wt.send(tx, dataclasses.replace(m, version=version), source, extra=[t for _, t in extra])
        assert check_streamed(wt.receive(rx, stage="bucket"), named + extra) == [e.name for e in m.entries]
    with pytest.raises(wt.WeightSyncError, match=r"big: got \(599,\) torch.float32, planned \(600,\)"):
        wt.send(wt.LoopbackLink("cpu", record=False), m, source, extra=[extra[0][1], extra[1][1], extra[2][1][:-1]])
    with pytest.raises(wt.WeightSyncError, match="got 2 extra tensors, planned 3"):
        wt.send(wt.LoopbackLink("cpu", record=False), m, source, extra=[extra[0][1], extra[1][1]])


def test_extra_tensors_are_computed_while_the_buckets_before_them_are_on_the_wire():
    """push() splits the fused QKV weights for each update: taking them lazily, when
    the first bucket that holds one is packed, overlaps that host work with the
    transfer of the buckets before (a whole push over two H200 paid it up front)."""
    named, buffers = param_buffers()
    extra = [("qkv.q", torch.randn(7, 3)), ("big", torch.randn(600))]
    m, source = wt.plan_buffers(named, 256, 1, extra=[(n, tuple(t.shape), t.dtype) for n, t in extra])
    first = min(e.offset for e in m.entries[-2:]) // m.bucket_bytes
    assert first >= 2  # the test's premise: buckets of the buffers alone come first
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    sent_before: list = []

    def computed():
        for _, tensor in extra:
            sent_before.append(len(tx.messages))
            yield tensor

    wt.send(tx, m, source, extra=computed())
    assert check_streamed(wt.receive(rx, stage="update"), named + extra) == [e.name for e in m.entries]
    header_and_manifest = 3
    per_bucket = 2  # its bytes and its checksum
    assert sent_before == [header_and_manifest + per_bucket * first] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buffers_on_a_gpu_are_sent_from_device_memory_with_extras_in_both_stages():
    named, _ = param_buffers()
    flats = {}
    for name, t in named:  # the same layout, rebuilt in device buffers
        base = t.untyped_storage().data_ptr()
        flat = flats.setdefault(base, torch.zeros(t.untyped_storage().nbytes(), dtype=torch.uint8, device="cuda"))
        offset = t.data_ptr() - base
        flat[offset: offset + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    views = [(n, flats[t.untyped_storage().data_ptr()][t.data_ptr() - t.untyped_storage().data_ptr():][: t.nbytes]
              .view(t.dtype).view(t.shape)) for n, t in named]
    extra = [("qkv.q", torch.randn(7, 3, device="cuda")), ("big", torch.randn(600, device="cuda"))]
    m, source = wt.plan_buffers(views, 1024, 1, extra=[(n, tuple(t.shape), t.dtype) for n, t in extra])
    tx = wt.LoopbackLink("cuda")
    rx = wt.LoopbackLink("cuda", replay=tx)
    for version, stage in enumerate(["update", "bucket"], 1):
        tx.rewind()
        rx.rewind()
        wt.send(tx, dataclasses.replace(m, version=version), source, extra=[t for _, t in extra])
        assert check_streamed(wt.receive(rx, stage=stage), views + extra) == [e.name for e in m.entries]


def packed_updates(device: str, replay_on_cpu: bool = False):
    """mixed_tensors() on ``device``, their plan, the sender's loopback link and
    update(version): new values into the same tensors (as an optimizer step writes
    them), sent packed, received and checked.  ``replay_on_cpu``: the sender's replays
    are switched on after the first update, as on a GPU."""
    data = [(n, t.to(device)) for n, t in mixed_tensors()]
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=1)
    tx = wt.LoopbackLink(device)
    rx = wt.LoopbackLink(device, replay=tx)

    def update(version: int) -> None:
        for _, t in data:
            t.copy_((torch.rand(t.shape) * 9 + version).to(t.dtype))
        tx.rewind()
        rx.rewind()
        wt.send(tx, dataclasses.replace(m, version=version), (t for _, t in data))
        if replay_on_cpu and version == 1:
            tx.packing.replays.on = True
        received = wt.receive(rx).tensors
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, data)), version

    return data, m, tx, update


def buckets_holding(m, name: str) -> list:
    return [k for k in range(m.buckets) for e in m.entries if e.name == name
            if m.window(k)[0] < e.offset + e.nbytes and m.window(k)[1] > e.offset]


def test_replayed_packing_reads_the_captured_sources_so_a_moved_tensor_is_copied_again(monkeypatch):
    # The replay bookkeeping on CPU: a stand-in "graph" copies from the sources it was
    # captured with, as a CUDA graph reads the captured addresses.  A bucket replayed
    # after its tensor moved would send the old tensor's bytes: the receiver's check
    # catches that.
    captured = []

    def capture(self, k, sources, copy):
        captured.append(k)
        return type("Graph", (), {"replay": lambda _: copy(k, sources)})()

    monkeypatch.setattr(wt_sender._Replays, "_capture", capture)
    data, m, tx, update = packed_updates("cpu", replay_on_cpu=True)
    update(1)
    update(2)  # sources seen
    update(3)  # captured, replayed
    assert sorted(captured) == list(range(m.buckets))
    moved = next(i for i, (n, _) in enumerate(data) if n == "big")
    data[moved] = ("big", data[moved][1].clone())
    captured.clear()
    for version in (4, 5, 6):  # copied, seen, captured again: the moved tensor's buckets only
        update(version)
    assert sorted(captured) == buckets_holding(m, "big")


def test_a_bucket_that_cannot_be_captured_is_copied_and_said_once(monkeypatch, caplog):
    def capture(self, k, sources, copy):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(wt_sender._Replays, "_capture", capture)
    _, _, tx, update = packed_updates("cpu", replay_on_cpu=True)
    for version in (1, 2, 3, 4):
        update(version)
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: operation not permitted" in said[0] and "more" not in said[0]
    assert not tx.packing.replays.on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_buckets_replay_their_copies_while_the_sources_stay_and_copy_where_they_moved():
    data, m, tx, update = packed_updates("cuda")
    for version in (1, 2, 3):  # copied (addresses noted), captured and replayed, replayed
        update(version)
    replays = tx.packing.replays
    assert all(g is not None for g in replays.graphs) and len(replays.graphs) == m.buckets > 10
    moved = next(i for i, (n, _) in enumerate(data) if n == "big")  # crosses buckets
    data[moved] = ("big", data[moved][1].clone())
    update(4)
    assert [k for k, g in enumerate(replays.graphs) if g is None] == buckets_holding(m, "big")
    update(5), update(6)  # the moved tensor's buckets captured again
    assert all(g is not None for g in replays.graphs)


def test_a_corrupted_bucket_sent_from_buffers_fails_the_update(monkeypatch):
    named, _ = param_buffers()
    m, source = wt.plan_buffers(named, 1024, version=1)
    tx = wt.LoopbackLink("cpu")
    rx = wt.LoopbackLink("cpu", replay=tx)
    wt.send(tx, m, source)
    monkeypatch.setattr(wt_receiver, "before_verify", lambda k, buf: buf[:8].bitwise_not_() if k == 2 else None)
    with pytest.raises(wt.ChecksumMismatch, match=r"bucket\(s\) 2 of"):
        wt.receive(rx)


@pytest.mark.parametrize("named, error", [
    (lambda b: [("w", b[:64].view(8, 8).t())], "w: not contiguous"),
    (lambda b: [("w", b[3:19])], "w: at byte 6 of its buffer, not a multiple of 16"),
    (lambda b: [("a", b[:32]), ("b", b[16:48])], "b: overlaps the tensor before it"),
    (lambda b: [("w", b[:99])], "w: its buffer ends 8 bytes short of a multiple of 16"),
    (lambda b: [("w", b[:8].to(torch.complex64))], "w: dtype torch.complex64 cannot be sent"),
])
def test_tensors_that_are_not_ranges_of_a_buffer_are_refused_by_name(named, error):
    with pytest.raises((ValueError, TypeError), match=error):
        wt.plan_buffers(named(torch.zeros(100, dtype=torch.bfloat16)), 1024, version=1)


@pytest.mark.parametrize("change, error", [
    (lambda ts: ts.__setitem__(5, ts[5][:-1]), r"t5: got \(\d+,\) torch.bfloat16, planned \(\d+,\) torch.bfloat16"),
    (lambda ts: ts.__setitem__(7, ts[7].double()), r"t7: got \(\d+,\) torch.float64, planned \(\d+,\) torch.uint8"),
    (lambda ts: ts.__setitem__(20, ts[20].t()), r"big: got \(40, 30\) torch.float32, planned \(30, 40\)"),
    (lambda ts: ts.pop(), "got fewer tensors than the manifest's 53"),
    (lambda ts: ts.append(ts[0]), "got more tensors than the manifest's 53"),
])
def test_a_tensor_that_does_not_match_the_plan_fails_the_send(change, error):
    data = mixed_tensors()
    m = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 256, version=1)
    link = wt.LoopbackLink("cpu", record=False)
    tensors = [t for _, t in data]
    change(tensors)
    with pytest.raises(wt.WeightSyncError, match=error):
        wt.send(link, m, iter(tensors))
    wt.send(link, m, (t for _, t in data))  # the link's packing is still good


def test_the_benchs_phase_breakdown_runs_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("weight_sync_bench", ROOT / "bench" / "weight_sync_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--phases", "--cpu", "--gb", "0.004", "--small-frac", "0.5", "--bucket-mb", "1",
                    "--rounds", "1", "--warmup", "0"])
    finally:
        torch.set_num_threads(threads)  # the bench runs on one thread
    out = capsys.readouterr().out
    assert "check: packed buckets == broadcast bytes; both stages hand out all" in out
    for _, label in bench.PHASE_ROWS:
        assert label in out


def _program_case():
    """Sources over a parameter, a slot a gather fills, and strided q-like views of a
    fused tensor: (manifest, sources, expected tensors, gather calls)."""
    from source_patch.runtime.weight_sync import program

    param = torch.arange(100, dtype=torch.float32)
    fused = torch.arange(64, dtype=torch.float32).view(2, 4, 8) + 1000
    slot, calls = torch.zeros(40), []

    def gather():  # what a window gather does: new bytes in a kept slot
        calls.append(len(calls))
        slot.copy_(torch.arange(40, dtype=torch.float32) + 100 * len(calls))

    ops = [("out", param, True), ("gather", gather), ("out", slot, False), ("out", fused[:, :2], True),
           ("out", fused[:, 2], True)]
    specs = [("p", (100,), torch.float32), ("s", (40,), torch.float32), ("q", (32,), torch.float32),
             ("k", (16,), torch.float32)]
    manifest = wt.plan(specs, 128, 0, True)  # 128-byte buckets: every tensor crosses bucket ends
    return manifest, program.Sources(ops, [], (None, None)), calls, \
        lambda: {"p": param, "s": slot, "q": fused[:, :2].reshape(-1), "k": fused[:, 2].reshape(-1)}


def test_a_packed_program_copies_views_after_its_gathers_bitwise_and_drains_them_when_a_send_fails():
    """program.py on CPU: a slot filled by a gather is read after it (in walk order,
    also where its tensor crosses bucket ends: a carry), strided views are packed as
    the engine's contiguous tensors, a second send with new values sends them (the
    program is kept on the link), and a send the sender refuses still runs the push's
    gathers, so a peer waiting in them does not hang."""
    manifest, sources, calls, expected = _program_case()
    for version in (1, 2):
        tx = wt.LoopbackLink("cpu")
        wt.send(tx, dataclasses.replace(manifest, version=version), sources)
        got = dict(wt.receive(wt.LoopbackLink("cpu", replay=tx)).tensors)
        assert set(got) == {"p", "s", "q", "k"} and all(torch.equal(got[n], t) for n, t in expected().items())
        assert got["s"][0] == 100 * version  # this push's gather, not the last one's
    assert calls == [0, 1]
    huge = wt.plan([("p", (70000,), torch.float32)], 16, 3, True)  # more than 16,384 buckets: refused
    with pytest.raises(wt.WeightSyncError, match="refused"):
        wt.send(wt.LoopbackLink("cpu"), huge, type(sources)([("gather", lambda: calls.append("drained"))], [],
                                                             (None, None)))
    assert calls[-1] == "drained"


PROGRAM_TABLES = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_weight_sync as t
from source_patch.runtime.weight_sync import program, transport as wt
buckets, sums = [], []
for tables in (False, True):
    manifest, sources, _, _ = t._program_case()
    packing = program.Program(manifest, sources, torch.device("cpu"), tables=tables)
    buckets.append([packing.pack(k).clone() for k, _ in packing.batches()])
    if tables:
        kinds = [type(group).__name__ for runs in packing.runs for run in runs if not callable(run) for group in run]
        summed = sorted(packing.summing)
        sums = [[int(packing.sums[k]), int(b.view(torch.int64).sum())] for k, b in enumerate(buckets[1]) if k in summed]
# A Table whose rows are longer than a block: whole blocks, then the tail.
from source_patch.runtime.weight_sync import copysum
g = torch.Generator().manual_seed(1)
src = torch.randint(-2**62, 2**62, (5000,), dtype=torch.int64, generator=g)
dst = torch.randint(-2**62, 2**62, (8000,), dtype=torch.int64, generator=g)
big = copysum.Table([(dst[:5000], src)], torch.device("cpu"), 3, (dst[5000:],))
big.into = torch.zeros(1, dtype=torch.int64)
big()
big_ok = torch.equal(dst[:5000], src) and int(big.into) == int(dst.sum())
# A strided view (as the fused QKV's k) cut into its contiguous runs; one of single elements is not.
fused = torch.arange(64, dtype=torch.float32).view(2, 4, 8)
k_pieces = copysum.Table.split(torch.empty(2, 8), fused[:, 2])
split = [[tuple(f.shape) for _, f in k_pieces], torch.equal(torch.cat([f for _, f in k_pieces]), fused[:, 2].reshape(-1)),
         copysum.Table.split(torch.empty(2, 8, 4), fused.transpose(1, 2)) is None]
# A whole send with the summing program (the link keeps it): the receiver checks every bucket's sum.
manifest, sources, _, expected = t._program_case()
tx = wt.LoopbackLink("cpu")
tx.program = program.Program(manifest, sources, torch.device("cpu"), tables=True)
for _ in range(2):  # the second send sums into the same slots again
    tx.rewind()
    wt.send(tx, manifest, sources)
    got = dict(wt.receive(wt.LoopbackLink("cpu", replay=tx)).tensors)
print(json.dumps({"equal": len(buckets[0]) == len(buckets[1]) and all(map(torch.equal, *buckets)),
                  "buckets": len(buckets[0]), "tables": kinds.count("Table"), "torch": kinds.count("tuple"),
                  "summed": summed, "sums": sums, "kept": tx.program.summing == set(summed), "big": big_ok, "split": split,
                  "received": sorted(got) == sorted(expected()) and all(torch.equal(got[n], v) for n, v in expected().items())}))
"""


def test_a_program_packs_and_sums_in_tables_as_torch_would_under_tritons_interpreter():
    """program.py's copysum.Table (the bucket copies in one launch on half the
    multiprocessors, leaving NCCL room, bucket 0's on all of them; a GPU's default)
    run by Triton's interpreter on CPU: every bucket holds the bytes torch's copies
    put there, a strided view that crosses no bucket end goes in as its contiguous runs
    (the carries of those that do stay torch's copies); every bucket gets its
    checksum in the same pass (the words the Tables copy, then the rest read where it
    lies), equal to the sum of its words, and a receiver that checks them takes the
    update whole."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", PROGRAM_TABLES, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["equal"] and result["buckets"] > 4 and result["tables"] > 0 and result["torch"] > 0, result
    assert result["summed"] == list(range(result["buckets"])) and result["kept"], result
    assert all(mine == words for mine, words in result["sums"]) and result["big"], result
    assert result["split"] == [[[8], [8]], True, True] and result["received"], result


def test_engine_views_hold_what_the_mapping_copies():
    """names.to_hf_views: the same elements, in order, as to_hf, without copies."""
    from source_patch.runtime.weight_sync import names

    layout = names.Layout(num_attention_heads=4, num_query_groups=2, head_dim=8, gated=True)
    fused = torch.randn(2 * (2 + 2) * 8, 16)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    views = names.to_hf_views(name, fused, layout)
    assert [n for n, _ in views] == [n for n, _ in names.to_hf(name, fused, layout)]
    for (_, view), (_, copy) in zip(views, names.to_hf(name, fused, layout)):
        assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert torch.equal(view.reshape(copy.shape), copy)


@pytest.mark.parametrize("bucket", [[], ["--bucket-kib", "4"]])
def test_the_push_bench_runs_a_real_megatron_model_on_cpu_and_checks_the_bytes(bucket):
    """bench/push_bench.py: push() from DDP's buffers over a loopback wire, bitwise
    checked (its own process: it patches Megatron before importing it); the packed
    push by its program (issue 32, item 2) against tensor by tensor, byte for byte, with
    the parameters redrawn in place and after a buffer moved (planned again); with
    4 KiB buckets most tensors cross a bucket end (the fused QKV's strided views too)."""
    out = subprocess.run([sys.executable, ROOT / "bench" / "push_bench.py", "--cpu", "--layers", "2",
                          "--experts", "4", "--rounds", "1", *bucket], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"check: one push from the buffers, replayed: all \d+ engine tensors equal", out.stdout)
    assert re.search(r"check: the packed push by its program sent the same (\d+) messages as tensor by tensor, "
                     r"byte for byte, with the parameters redrawn in place and after a buffer moved", out.stdout)
    assert "push(), from DDP's buffers" in out.stdout and "push(), buffers, walk redone (before)" in out.stdout


@pytest.mark.parametrize("stage", ["update", "bucket"])
def test_the_push_bench_pushes_to_a_receiver_process_and_gets_the_bytes_back(stage):
    """bench/push_bench.py --engine (two gloo processes here, two GPUs there): the
    whole push, transfer included, from the buffers and packed; the receiver sends
    back what it got and the trainer compares it byte for byte."""
    out = subprocess.run([sys.executable, ROOT / "bench" / "push_bench.py", "--engine", "--cpu", "--stage", stage,
                          "--layers", "2", "--experts", "4", "--rounds", "2"], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"check: pushed from the buffers and packed, the receiver got all \d+ engine tensors equal",
                     out.stdout)
    for label in ("raw broadcast, same bytes", "push(), from DDP's buffers", "push(), packed",
                  "push(), packed unplanned"):
        assert re.search(rf"^  {re.escape(label)}\s+[\d.]+ [\d.]+$", out.stdout, re.M), out.stdout  # every round


@pytest.mark.parametrize("parallel, collectives", [
    # EP 2: a layout check and one window of the expert buffer, against 8 expert parameters.
    (["--ep", "2"], {"gathers per parameter (before)": 8, "buffer windows": 2}),
    # TP 2 (expert TP 2): a layout check and one window each for the dense shards and the
    # experts', against the 22 tensor-parallel parameters (6 dense, 16 expert); 4 KiB buckets
    # (109 of them): the windows' gathers fall between buckets, shards joined in kept staging
    # and tensors read from it cut over bucket ends.  (The default bucket, all in one, is
    # the simpler case of the same walk: left out for CI's time.)
    (["--tp", "2", "--bucket-kib", "4"], {"gathers per parameter (before)": 22, "buffer windows": 4}),
    # TP 2 and EP 2 (expert TP 2), four processes: the experts' windows gathered over the
    # EP x expert-TP group at once, against a gather over expert TP and one over EP each.
    (["--tp", "2", "--ep", "2", "--bucket-kib", "4"], {"gathers per parameter (before)": 22, "buffer windows": 4}),
])
def test_the_push_bench_gathers_buffer_windows_and_checks_them_against_per_parameter_gathers(parallel, collectives):
    """bench/push_bench.py --ep 2 / --tp 2 (two processes) / both (four): both ways of
    gathering broadcast the same bytes (checked by the bench), with far fewer collectives.
    The windowed push is the packed push's program (program.py: gathers into two kept
    slots, joins into kept staging); the per-parameter one is mapped tensor by tensor."""
    out = subprocess.run([sys.executable, ROOT / "bench" / "push_bench.py", *parallel, "--layers", "2",
                          "--experts", "4", "--rounds", "1"], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"check: both variants broadcast the same \d+ messages, byte for byte", out.stdout)
    rows = {m.group(1).strip(): int(m.group(2))
            for m in re.finditer(r"^((?:gathers|buffer) .+?)\s+(\d+)\s+[\d.]+", out.stdout, re.M)}
    assert rows == collectives, out.stdout


def test_the_bundled_specs_anchor_in_the_installed_upstreams():
    from source_patch.patcher import cli

    assert all(importlib.util.find_spec(u) for u in ("megatron.core", "sglang"))
    assert cli.main(["check", "weight_sync"]) == 0


def test_settings_schema():
    assert settings.check("weight_sync", "bucket_bytes", "256M") == 256 << 20
    assert settings.check("weight_sync", "timeout_s", "2.5") == 2.5
    with pytest.raises(ValueError, match="update, bucket"):
        settings.check("weight_sync", "stage", "all")
    with pytest.raises(ValueError, match="positive"):
        settings.check("weight_sync", "timeout_s", 0)
    env = {"SOURCE_PATCH_WEIGHT_SYNC_PORT": "29600", "SOURCE_PATCH_WEIGHT_SYNC_ON_ERROR": "raise"}
    resolved = settings.resolve("weight_sync", env)
    assert resolved["port"] == 29600 and resolved["on_error"] == "raise" and resolved["enable"] is False


def test_call_sites_pass_results_through_and_do_nothing_unless_due(monkeypatch):
    calls = []
    monkeypatch.setattr(weight_sync, "push", lambda chunks, version=None: calls.append(version))
    monkeypatch.setitem(weight_sync._trainer, "step", 0)
    opt, other, result = type("Opt", (), {})(), type("Opt", (), {})(), (True, 1.0, 0)
    assert weight_sync.weight_sync_attach(opt, ["chunk"]) is opt
    monkeypatch.setattr(weight_sync, "_enabled", False)
    assert weight_sync.weight_sync_step(opt, result) is result and calls == []  # disabled: one flag test
    monkeypatch.setattr(weight_sync, "_enabled", True)
    assert weight_sync.weight_sync_step(other, result) is result and calls == []  # not attached
    assert weight_sync.weight_sync_step(opt, (False, None, None))[0] is False and calls == []  # skipped step
    weight_sync.weight_sync_step(opt, result)
    weight_sync.weight_sync_step(opt, result)
    assert calls == [1, 2]
    monkeypatch.setitem(weight_sync._config, "every", 2)
    weight_sync.weight_sync_step(opt, result)
    weight_sync.weight_sync_step(opt, result)
    assert calls == [1, 2, 4]
    request = type("Req", (), {"load_format": None, "weight_version": "w"})()
    assert weight_sync.weight_sync_version(request) == "w"  # SGLang's own updates: untouched


def test_a_failed_push_is_logged_or_raised(monkeypatch, caplog):
    def fail(chunks, version=None):
        raise wt.WeightSyncError("engine gone")

    monkeypatch.setattr(weight_sync, "push", fail)
    monkeypatch.setattr(weight_sync, "_enabled", True)
    opt = type("Opt", (), {})()
    weight_sync.weight_sync_attach(opt, ["chunk"])
    result = (True, 1.0, 0)
    assert weight_sync.weight_sync_step(opt, result) is result
    assert "engine gone" in caplog.text and "training continues" in caplog.text
    monkeypatch.setitem(weight_sync._config, "on_error", "raise")
    with pytest.raises(wt.WeightSyncError, match="engine gone"):
        weight_sync.weight_sync_step(opt, result)


def test_push_pauses_the_garbage_collector_and_leaves_it_as_it_was(monkeypatch):
    """A packed push's tens of thousands of short-lived objects drove full collections
    of the trainer's heap every few pushes (0.3-0.5 s each); push() runs with the
    collector off, and leaves it on or off as it found it, also when it fails."""
    from source_patch.runtime.weight_sync import megatron as weight_megatron

    seen, collections, inside = [], [], []

    def gather(chunks):  # push()'s first step: allocate as a push does, then stop
        seen.append(gc.isenabled())
        inside.append(True)
        kept = [[] for _ in range(100)]  # with a threshold of 1, each would start a collection
        inside.clear()
        raise wt.WeightSyncError(f"stop after {len(kept)} lists")

    def counted(phase, info):
        if inside:
            collections.append(phase)

    monkeypatch.setattr(weight_megatron, "finish_param_gather", gather)
    monkeypatch.setattr(weight_sync, "_trainer", dict(weight_sync._trainer))
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(counted)
    try:
        for on in (True, False):
            gc.enable() if on else gc.disable()
            with pytest.raises(wt.WeightSyncError, match="stop after 100 lists"):
                weight_sync.push([], version=1)
            assert gc.isenabled() is on
    finally:
        gc.callbacks.remove(counted)
        gc.set_threshold(*threshold)
        gc.enable()
    assert seen == [False, False] and collections == []


def test_the_parameter_walk_is_kept_until_a_parameter_or_module_is_registered():
    """push() walks named_parameters() once, not at every step (~2 us per parameter);
    a replaced parameter or a new module is seen at the next push."""
    from source_patch.runtime.weight_sync import megatron as weight_megatron

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    wrapped = torch.nn.Module()
    wrapped.module = model
    first = weight_megatron.named_params(wrapped)
    assert [name for name, _ in first] == ["0.weight", "0.bias", "1.weight", "1.bias"]  # wrapper stripped
    assert weight_megatron.named_params(wrapped) is first

    replaced = torch.nn.Parameter(torch.zeros(2, 2))
    model[0].weight = replaced
    second = weight_megatron.named_params(wrapped)
    assert second is not first and second[0][1] is replaced
    assert weight_megatron.named_params(wrapped) is second

    model.append(torch.nn.Linear(1, 1))
    assert [name for name, _ in weight_megatron.named_params(wrapped)][-2:] == ["2.weight", "2.bias"]


def test_buffer_windows_are_kept_across_pushes_until_a_buffer_moves():
    """The windows of parameters to gather (views of one DDP-like buffer) are built
    once per walk and kept while the buffer stays put; their state is reset per push."""
    from source_patch.runtime.weight_sync import megatron as weight_megatron

    buffer = torch.zeros(4 * 1024)
    params = []
    for i in range(4):
        param = torch.nn.Parameter(buffer[i * 1024: (i + 1) * 1024].view(32, 32))
        param.tensor_model_parallel = True
        params.append((f"decoder.layers.{i}.self_attention.linear_proj.weight", param))
    walked = weight_megatron.MegatronParams.__new__(weight_megatron.MegatronParams)
    walked.chunk, walked.params = torch.nn.Module(), params
    windows, digest = walked._local_windows(False, "shards")
    assert len(windows.spans) == 1 and len(digest) == 4  # one window over the buffer
    windows.current, windows.gathers = (0, ["gathered bytes"]), 3  # what a push leaves
    again, same = walked._local_windows(False, "shards")
    assert again is windows and same == digest and again.current == (None, None) and again.gathers == 0
    walked.params = list(params)  # a new walk of the same parameters: built anew
    assert walked._local_windows(False, "shards")[0] is not windows
    for _, param in params:  # the buffer moved: each parameter now has a storage of its own
        param.data = param.data.clone()
    assert walked._local_windows(False, "shards") == (None, None)  # no gain from windows now


def test_a_push_plan_is_kept_while_the_walk_and_layout_hold():
    from source_patch.runtime.weight_sync import names as weight_names
    from source_patch.runtime.weight_sync import planning

    layout = weight_names.Layout(num_attention_heads=2, num_query_groups=1, head_dim=2, gated=True)
    walk = [("decoder.final_layernorm.weight", torch.nn.Parameter(torch.ones(4)))]
    chunk = torch.nn.Module()
    params = type("Params", (), {"params": walk, "shapes": lambda self: [(walk[0][0], (4,), torch.float32)]})()
    plan = planning.plan_for(chunk, params, layout)
    assert planning.plan_for(chunk, params, layout) is plan
    assert planning.plan_for(chunk, params, dataclasses.replace(layout, vocab_size=8)) is not plan
    plan = planning.plan_for(chunk, params, layout)
    params.params = list(walk)  # walked again (something registered), the same parameters
    assert planning.plan_for(chunk, params, layout) is plan
    params.params = [(walk[0][0], torch.nn.Parameter(torch.ones(4)))]  # the parameter was replaced
    replanned = planning.plan_for(chunk, params, layout)
    assert replanned is not plan and replanned.params is params.params

# ------------------------------------------------------------------ processes
TRAINER_SPECS = f"megatron_cpu,weight_sync,{E2E / 'weight_sync_distopt_cpu.yaml'}"


def start(args, env, log):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
               "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.Popen([sys.executable, *map(str, args)], env=environ, stdout=log, stderr=subprocess.STDOUT)


def finish(procs, deadline):
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("timeout")
    return codes


def transport_pair(tmp, common, backend="gloo"):
    port = models.free_port()
    return [start([E2E / "weight_sync_transport.py", role, port, tmp / f"transport.{role}.json", backend], common,
                  open(tmp / f"transport.{role}.log", "w")) for role in ("send", "receive")]


def receiver(tmp, name, common, port, receiver_args):
    """The transport's receiving end alone (SGLang's side: tests/test_weight_sync_engine.py)."""
    return start([E2E / "weight_sync_receiver.py", tmp / f"{name}.engine", "--port", port, *receiver_args],
                 common, open(tmp / f"{name}.engine.log", "w"))


def trainers(tmp, name, common, port, trainer_args):
    """Two Megatron ranks: data parallel, distributed optimizer with overlap_param_gather."""
    master = models.free_port()
    return [start([E2E / "weight_sync_trainer.py", tmp / f"{name}.trainer", "--distributed-optimizer",
                   *trainer_args],
                  {**common, "SOURCE_PATCH": TRAINER_SPECS, "SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1",
                   "SOURCE_PATCH_WEIGHT_SYNC_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)},
                  open(tmp / f"{name}.rank{r}.log", "w"))
            for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run at once (separate ports), so the slow starts overlap.
    transport: weight_transport's two ends, scenario after scenario on one group.
    main: ep 2, 3 steps, distributed optimizer, the transport's receiver (the SGLang
    side, corrupted buckets and a dying trainer run against a real server in
    tests/test_weight_sync_engine.py).
    control: ep 1, the runtime's forced param gather switched off, a receiver that
    dies while receiving update 2.
    buffers: ep 1, 3 steps: sent from the distributed optimizer's parameter buffers.
    tp: tensor-parallel gathering checked against Megatron's sharded modules."""
    for upstream in ("megatron.core", "sglang"):
        if importlib.util.find_spec(upstream) is None:  # not imported here: the children do
            pytest.skip(f"{upstream} is not installed")
    tmp = tmp_path_factory.mktemp("weight_sync")
    common = {"SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": str(TIMEOUT_S), "SOURCE_PATCH_WEIGHT_SYNC_BUCKET_BYTES": "4K",
              "SOURCE_PATCH_CACHE": str(tmp / "cache")}
    ports = {"main": models.free_port(), "control": models.free_port(), "buffers": models.free_port()}
    procs = {
        "transport": transport_pair(tmp, common),
        "main": [receiver(tmp, "main", common, ports["main"], ["--updates", "3"])],
        "control": [receiver(tmp, "control", common, ports["control"], ["--updates", "2", "--die-after", "2:1"])],
        "buffers": [receiver(tmp, "buffers", common, ports["buffers"], ["--updates", "3"])],
    }
    # Four trainers would each parse (libcst) the same Megatron modules: one process
    # patches and caches them first.
    warm = start(["-c", "import megatron.core.optimizer, megatron.core.models.gpt, megatron.core.distributed"],
                 {**common, "SOURCE_PATCH": TRAINER_SPECS}, open(tmp / "warm.log", "w"))
    warm.wait(120)
    procs["main"] += trainers(tmp, "main", common, ports["main"], ["--steps", "3", "--ep", "2"])
    procs["control"] += trainers(tmp, "control", common, ports["control"], ["--steps", "2", "--skip-param-gather"])
    procs["buffers"] += trainers(tmp, "buffers", common, ports["buffers"], ["--steps", "3"])
    master = models.free_port()
    procs["tp"] = [start([E2E / "weight_sync_tp.py", tmp / "tp.json"],
                         {**common, "SOURCE_PATCH": "megatron_cpu", "RANK": str(r), "WORLD_SIZE": "2",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}, open(tmp / f"tp.rank{r}.log", "w"))
                   for r in range(2)]
    deadline = time.monotonic() + 300
    codes = {name: finish(p, deadline) for name, p in procs.items()}
    logs = {p.name: p.read_text()[-2000:] for p in tmp.glob("*.log")}
    return tmp, codes, logs


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                 reason="needs two GPUs")]


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=TWO_GPUS)])
def transport(request, tmp_path_factory):
    """The transport's scenarios (tests/e2e/weight_sync_transport.py) on one group:
    over gloo with the other CPU runs, or over NCCL with one GPU per end."""
    if request.param == "gloo":
        tmp, codes, logs = request.getfixturevalue("runs")
    else:
        tmp = tmp_path_factory.mktemp("transport_nccl")
        gpus = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
        codes = {"transport": finish(transport_pair(tmp, gpus, "nccl"), time.monotonic() + 180)}
        logs = {p.name: p.read_text()[-2000:] for p in tmp.glob("*.log")}
    assert codes["transport"] == [0, 0], logs
    sent, received = (json.loads((tmp / f"transport.{r}.json").read_text()) for r in ("send", "receive"))
    return {s["scenario"]: (s, r) for s, r in zip(sent, received)}


def test_round_trips_are_exact_in_both_stages(transport):
    for name in ("roundtrip-update", "roundtrip-bucket", "roundtrip-after-failures"):
        sent, received = transport[name]
        assert sent["ok"] and received["ok"] and received["handed"] == 203, (sent, received)


def test_a_corrupted_bucket_fails_the_update_on_both_sides(transport):
    sent, received = transport["tamper-update"]
    assert received["error"] == "ChecksumMismatch" and "bucket(s) 1 of" in received["message"]
    assert received["handed"] == 0  # stage "update": nothing before everything is verified
    assert sent["error"] == "ChecksumMismatch" and "checksum mismatch" in sent["message"]
    sent, received = transport["tamper-bucket"]
    assert received["error"] == "ChecksumMismatch" and "bucket(s) 2 of" in received["message"]
    assert 0 < received["handed"] < 203  # stage "bucket": buckets 0-1 were handed out (partial)
    assert sent["error"] == "ChecksumMismatch"


def test_a_consumer_that_stops_or_a_refused_manifest_fail_cleanly(transport):
    sent, received = transport["abandon-bucket"]
    assert received["handed"] == 3 and "receive error" in sent["message"]
    sent, received = transport["refuse-manifest"]
    assert "exceeds max_update_bytes=1000" in received["message"] and "refused" in sent["message"]
    sent, received = transport["roundtrip-after-failures"]
    assert sent["ok"] and received["ok"]  # the group is still in step after all of the above


def test_the_manifest_travels_only_with_a_layout_the_receiver_has_not_seen(transport):
    manifests = {name: received["manifests"] for name, (_, received) in transport.items()}
    assert manifests["roundtrip-update"] == 1  # the first update
    assert manifests["other-layout"] == 1 and transport["other-layout"][1]["handed"] == 200
    # the same layout again, in either stage, after failures, or after another layout: none
    for name in ("roundtrip-bucket", "tamper-update", "tamper-bucket", "abandon-bucket",
                 "refuse-manifest", "roundtrip-after-failures", "first-layout-again"):
        assert manifests[name] == 0 and transport[name][0].get("error") != "WeightSyncTimeout", name
    sent, received = transport["refuse-new-layout"]  # parsed, then refused: nothing is kept of it
    assert received["manifests"] == 1 and "exceeds max_update_bytes=1000" in received["message"]
    assert "refused" in sent["message"]
    sent, received = transport["first-layout-again"]
    assert sent["ok"] and received["ok"] and received["handed"] == 203


def test_a_silent_peer_times_out_instead_of_hanging(transport):
    _, received = transport["stall"]
    assert received["error"] == "WeightSyncTimeout" and "within 2 s" in received["message"]
    assert 1.5 < received["seconds"] < 10


# ------------------------------------------------------------------ end to end


def received(tmp, name) -> dict:
    """{update: {engine name: tensor}} that the receiver of run ``name`` got."""
    from safetensors.torch import load_file

    per_update = {}
    for key, value in load_file(tmp / f"{name}.engine.safetensors").items():
        update, param = key.split("/", 1)
        per_update.setdefault(int(update), {})[param] = value
    return per_update


def trainer_params(tmp, name, step, ep):
    """Megatron's full parameters after ``step``: both ranks' (experts of EP rank r
    renumbered r * local + i; data-parallel replicas must agree)."""
    from safetensors.torch import load_file

    full = {}
    for rank in range(2):
        for key, value in load_file(tmp / f"{name}.trainer.rank{rank}.safetensors").items():
            s, param = key.split("/", 1)
            if int(s) != step:
                continue
            local = re.search(r"local_experts\.(\d+)\.", param)
            if local and ep > 1:
                param = param.replace(local.group(0), f"local_experts.{rank * models.EXPERTS // ep + int(local.group(1))}.")
            elif rank == 1:
                assert torch.equal(value, full[param]), param
            full[param] = value
    return full


def differ(got, expected):
    assert sorted(got) == sorted(expected)
    return [name for name in got if not torch.equal(got[name], expected[name])]


def three_exact_updates(runs, name: str, ep: int) -> list:
    """After each of three steps the receiver got the trainer's mapped parameters, bit
    for bit, and the steps changed them; returns the trainer's states per step."""
    from source_patch.runtime.weight_sync import names as weight_names

    tmp, codes, logs = runs
    assert codes[name] == [0, 0, 0], logs
    got = received(tmp, name)
    layout = weight_names.Layout.from_config(models.megatron_config("qwen3_moe"))
    for update in (1, 2, 3):
        params = trainer_params(tmp, name, update, ep=ep)
        expected = {n: t for full_name, full in params.items() for n, t in weight_names.to_hf(full_name, full, layout)}
        assert differ(got[update], expected) == []
    assert differ(got[3], got[1]) != []  # the steps do change the weights
    trainer = json.loads((tmp / f"{name}.trainer.rank0.json").read_text())
    assert [s["version"] for s in trainer] == [1, 2, 3] and trainer[-1]["counters"]["pushes"] == 3
    return trainer


def test_after_each_step_the_receiver_gets_the_trainers_weights_bitwise(runs):
    """Gathered over the expert- and data-parallel ranks after the distributed
    optimizer's step (the forced param gather), mapped and bucketed: bit for bit."""
    trainer = three_exact_updates(runs, "main", ep=2)
    assert {s["sent_from"] for s in trainer} == {"tensors"}  # gathered over EP: packed
    # The 8 local expert parameters (2 layers x 2 experts x fc1, fc2) come in windows of
    # DDP's expert buffer: a layout check and one window, not a gather per parameter.
    assert [s["counters"]["gathers"] for s in trainer] == [2, 2, 2]


def test_without_gathers_the_weights_go_from_megatrons_parameter_buffers_bitwise(runs):
    """EP 1, TP 1, distributed optimizer: the parameters are views of DDP's param_data,
    sent from there (the fused QKV, split by copies, as extra tensors)."""
    trainer = three_exact_updates(runs, "buffers", ep=1)
    assert [s["sent_from"] for s in trainer] == ["buffers"] * 3


def test_an_engine_killed_mid_update_fails_the_push_with_a_clear_error(runs):
    tmp, codes, logs = runs
    assert codes["control"] == [17, 0, 0], logs
    trainer = json.loads((tmp / "control.trainer.rank0.json").read_text())
    assert trainer[1]["counters"]["failures"] == 1 and trainer[1]["version"] == 1
    assert "v2: WeightSyncError" in trainer[1]["last_error"] and "a peer failed" in trainer[1]["last_error"]
    assert trainer[1]["step_seconds"] < TIMEOUT_S / 2  # a dead peer is noticed at once, not at the timeout


def test_without_the_forced_param_gather_the_engine_would_get_stale_weights(runs):
    """The control: overlap_param_gather leaves parameters outside rank 0's optimizer
    shard stale after step(); with the runtime's forced gather switched off they are
    sent stale, which the main run's bitwise check would catch."""
    from source_patch.runtime.weight_sync import names as weight_names

    tmp, _, _ = runs
    got = received(tmp, "control")
    params = trainer_params(tmp, "control", 1, ep=1)
    layout = weight_names.Layout.from_config(models.megatron_config("qwen3_moe"))
    expected = {n: t for name, full in params.items() for n, t in weight_names.to_hf(name, full, layout)}
    stale = differ(got[1], expected)
    assert 0 < len(stale) < len(expected)


def test_tensor_parallel_shards_gather_into_what_megatrons_modules_compute(runs):
    """TP 2: the mapped full weights, used by plain torch, give what Megatron's
    vocab-parallel embedding, column-parallel QKV (its own head split) and SwiGLU fc1
    ([gate_r; up_r] per rank) and row-parallel projections give."""
    tmp, codes, logs = runs
    assert codes["tp"] == [0, 0], logs
    result = json.loads((tmp / "tp.json").read_text())
    assert result["embedding"] == result["q_proj"] == result["k_proj"] == result["v_proj"] == 0.0
    assert result["o_proj"] < 1e-5 and result["mlp"] < 1e-5  # a sum over TP ranks: rounding only
    assert result["shapes_planned_as_gathered"]
    assert "model.layers.1.mlp.gate_proj.weight" in result["names"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_trainer_leaves_while_its_receiver_waits_for_the_next_update(tmp_path):
    """The example pushes after every step to a receiver on GPU 1 that loops on receive():
    at its end the receiver waits for the next update.  Before close() aborted the NCCL
    group, torch's destroy_process_group() of every group waited for that receiver for good."""
    port = models.free_port()
    receiver = subprocess.Popen([sys.executable, ROOT / "bench" / "sync_receiver.py", "--port", str(port),
                                 "--device", "cuda:1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,weight_sync", "SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1",
               "SOURCE_PATCH_WEIGHT_SYNC_PORT": str(port), "SOURCE_PATCH_WEIGHT_SYNC_ON_ERROR": "raise",
               "SOURCE_PATCH_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
        trainer = subprocess.run([sys.executable, ROOT / "examples" / "train_moe.py", "--steps", "3", "--hidden", "64"],
                                 env=env, capture_output=True, text=True, timeout=180)
        assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
        assert "done: 3 steps" in trainer.stdout
    finally:
        receiver.terminate()
        out, _ = receiver.communicate(timeout=60)
    assert "sync receiver: 3 updates" in out, out[-2000:]
