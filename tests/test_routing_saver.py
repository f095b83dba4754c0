"""Routing capture's saver (runtime/routing/megatron/capture.py): the index is rewritten at most
once a second by the background writer, and flush() / close() complete it; records()
hands out copies, never the buffers a later save recycles.  The call sites are driven
directly, as Megatron's patched router would call them."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from source_patch.runtime.routing.megatron import capture as megatron_capture, control as rm
from source_patch.runtime.routing.records.record import load

LAYERS = (1, 2, 3)


@pytest.fixture
def capture(tmp_path):
    before = dict(rm._config)
    rm.configure(mode="capture", dir=str(tmp_path))
    rm.reset()
    yield tmp_path
    rm.reset()
    rm.configure(**before)


def step(ids: torch.Tensor) -> None:
    """One optimizer step of one microbatch through LAYERS, the way the spec calls."""
    rm.routing_schedule(False)
    rm.routing_microbatch_begin()
    for layer in LAYERS:
        router = SimpleNamespace(layer_number=layer, config=SimpleNamespace(sequence_parallel=False,
                                                                            num_moe_experts=8))
        rm.routing_enter(router, torch.zeros(4, 2, 8))
        rm.routing_topk(None, (None, ids + layer % 2))
        rm.routing_exit()
    rm.routing_microbatch_end()
    rm.routing_schedule_end()
    rm.routing_step(True)


def test_flush_completes_the_index_the_background_writer_rate_limits(capture):
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [5, 6]] * 2)
    for _ in range(5):  # 5 steps well within a second: the writer rewrites the index once at most
        step(ids)
    megatron_capture.flush()
    index = json.loads((capture / "rank-0" / "index.json").read_text())
    assert [(e["step"], e["microbatch"]) for e in index["records"]] == [(s, 0) for s in range(5)]
    rec = load(capture / "rank-0" / "step-4-mb-0.safetensors")
    assert rec.layers == list(LAYERS) and torch.equal(rec.indices[1], ids + 1)
    assert rm.state()["counters"]["pending"] == 0 and rm.state()["last_error"] is None


def test_records_are_copies_of_what_is_pending(capture):
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    rm.configure(mode="capture", dir="")  # nothing saved: records stay pending
    step(ids)
    first = megatron_capture.records()[0]
    first.indices[2].fill_(7)  # a caller's change does not reach the pending record
    assert torch.equal(megatron_capture.records()[0].indices[2], ids)


def test_the_index_is_not_rewritten_at_every_step(capture, monkeypatch):
    writes = []
    real = megatron_capture._write_index
    monkeypatch.setattr(megatron_capture, "_write_index", lambda *a: (writes.append(time.monotonic()), real(*a)))
    ids = torch.tensor([[0, 1]] * 8)
    for _ in range(6):
        step(ids)
    megatron_capture.flush()
    assert 1 <= len(writes) <= 3, writes  # the first step's, perhaps one more, and flush()'s
