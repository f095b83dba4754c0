"""Weight-sync hardening (issue 36, items 2, 3, 4 and the rendezvous of 10).

A manifest nested 50k levels deep (2), a manifest asking for half a million buckets
(3) and an update that does not match the engine's model (4: a name it does not
have, a shape or dtype it does not hold, a tensor missing, nothing at all) are
refused with a WeightSyncError that says why, and the refusal is a vote: the sender
fails at once instead of waiting timeout_s, the receiver keeps its weights and
version, and the next valid update loads.  Checked on the receiver in process and
on a real SGLang server driven over its own HTTP admin path, as
test_weight_sync_engine.py drives it.  The rendezvous store listens on the host it
was given only (10)."""

import itertools
import re
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from source_patch.runtime.core import settings
from source_patch.runtime.weight_sync import transport as wt
from source_patch.runtime.weight_sync import wire

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "e2e"))
import weight_sync_models as models  # noqa: E402
from test_weight_names import upstreams  # noqa: E402,F401 - its parallel state, for SGLang's models in process

DEEP = 50_000
FLOOD = dict(bucket_bytes=16, total_bytes=8 << 20)  # 524,288 buckets from a ~150-byte manifest
LINK_TIMEOUT_S = 30.0  # the trainer's wait in the engine tests; a refusal comes well before it
FAST_S = 10.0
GROUP = "hardening_weights"
PROMPTS, NEW = [[3, 1, 4, 1, 5], [9, 2, 6]], 5


def manifest_body(tensors: bytes, version: int = 1, head: bytes = b"", bucket_bytes: int = 64,
                  total_bytes: int = 16) -> tuple[bytes, int]:
    """A hand-written manifest (what no sender of ours writes) and the header's digest for it."""
    body = b'{"format":2,"version":%d,"bucket_bytes":%d,"total_bytes":%d,"checksum":true%s,"tensors":%s}' % (
        version, bucket_bytes, total_bytes, head, tensors)
    digest = wt.layout_digest(wt.Manifest(version, bucket_bytes, total_bytes, True, ()), wt.tensors_digest(tensors))
    return body, digest


NESTED = {"tensors": dict(tensors=b"[" * DEEP + b"]" * DEEP),
          "head": dict(tensors=b"[]", head=b',"x":' + b"[" * DEEP + b"]" * DEEP)}
FLOODING = dict(tensors=b'[["w","uint8",[%d],0]]' % FLOOD["total_bytes"], **FLOOD)


def raw_send(link, body: bytes, digest: int, version: int = 1) -> None:
    """The sender's side of the protocol up to the manifest vote, with ``body`` as the
    manifest; WeightSyncError if refused, as a sender's."""
    assert wt.layout_verdict(link.handshake(wt.handshake_row(version, digest), "handshake")) == wt.NEED_MANIFEST
    link.wait(link.broadcast(torch.tensor([len(body)]).to(link.device)), "manifest")
    link.wait(link.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8).to(link.device)), "manifest")
    if link.vote(wt.OK, "manifest vote"):
        raise wt.WeightSyncError(f"update v{version} was refused by an engine rank")
    raise AssertionError("the receiver accepted the manifest")


class Voting(wt.LoopbackLink):
    """A loopback link that records the votes this end casts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.votes = []

    def vote(self, status, what):
        self.votes.append((what, int(status)))
        return super().vote(status, what)


def recorded(body: bytes, digest: int, version: int = 1) -> wt.LoopbackLink:
    """A sender's recording of one update whose manifest is ``body``."""
    tx = wt.LoopbackLink("cpu")
    tx.messages = [torch.tensor(wt.handshake_row(version, digest)), torch.tensor([len(body)]),
                   torch.frombuffer(bytearray(body), dtype=torch.uint8)]
    return tx


def valid_recording(version: int) -> tuple:
    data = [("a", torch.arange(6.0)), ("b", torch.ones(3, dtype=torch.int64) * version)]
    tx = wt.LoopbackLink("cpu")
    wt.send(tx, wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], 64, version), [t for _, t in data])
    return tx, data


# ------------------------------------------------------------------ in process


@pytest.mark.parametrize("where", sorted(NESTED))
def test_a_deeply_nested_manifest_is_refused_by_a_vote_and_the_next_update_loads(where):
    body, digest = manifest_body(**NESTED[where])
    rx = Voting("cpu", replay=recorded(body, digest))
    with pytest.raises(wt.WeightSyncError, match="refused here: ManifestError: .*nested deeper than 4 levels"):
        wt.receive(rx)
    assert rx.votes == [("manifest vote", wt.REJECTED)]  # the sender hears it at once
    tx, data = valid_recording(2)
    rx.source, rx.votes = tx, []
    rx.rewind()
    update = wt.receive(rx)
    assert update.version == 2 and [(n, t.tolist()) for n, t in update.tensors] == [(n, t.tolist()) for n, t in data]


def test_the_manifest_parser_bounds_depth_and_count_before_parsing(monkeypatch):
    for case in NESTED.values():
        with pytest.raises(wt.ManifestError, match="nested deeper than 4 levels"):
            wt.Manifest.from_json(manifest_body(**case)[0], 1 << 40)
    monkeypatch.setattr(wire, "MAX_TENSORS", 2)
    three = b'[["a","uint8",[16],0],["b","uint8",[16],16],["c","uint8",[16],32]]'
    with pytest.raises(wt.ManifestError, match="more than 5 arrays and objects"):
        wt.Manifest.from_json(manifest_body(three, total_bytes=48)[0], 1 << 40)
    assert isinstance(wt.ManifestError("x"), ValueError)  # from_json's callers catch ValueError


def test_a_bucket_flood_is_refused_before_anything_is_allocated():
    body, digest = manifest_body(**FLOODING)
    assert len(body) < 160
    rx = Voting("cpu", replay=recorded(body, digest))
    start = time.perf_counter()
    with pytest.raises(wt.WeightSyncError, match=r"524,288 buckets of 16 bytes, more than the 16,384 a receiver "
                                                 r"accepts: bucket_bytes must be at least 512"):
        wt.receive(rx)
    assert time.perf_counter() - start < 1.0
    assert rx.votes == [("manifest vote", wt.REJECTED)] and rx.staged is None and rx.streamed is None


def test_a_sender_refuses_a_bucket_flood_in_the_votes_without_packing_it():
    tx = Voting("cpu")
    tensor = torch.zeros(FLOOD["total_bytes"], dtype=torch.uint8)
    start = time.perf_counter()
    with pytest.raises(wt.WeightSyncError, match="v3 refused: 524,288 buckets of 16 bytes"):
        wt.send(tx, wt.plan([("w", tuple(tensor.shape), tensor.dtype)], 16, 3), [tensor])
    assert time.perf_counter() - start < 1.0 and tx.packing is None
    assert tx.votes == [("manifest vote", wt.REJECTED)]  # receivers that needed the manifest learn it at once


def test_bucket_bytes_has_a_floor():
    with pytest.raises(ValueError, match=">= 4096"):
        settings.check("weight_sync", "bucket_bytes", 16)
    assert settings.check("weight_sync", "bucket_bytes", "4K") == 4096


def listeners(port: int) -> list:
    psutil = pytest.importorskip("psutil")
    return sorted(c.laddr.ip for c in psutil.net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def test_the_rendezvous_store_listens_on_its_host_only(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as under torchrun: rank 0 still serves
    port = models.free_port()
    group = wt.open_group("127.0.0.1", port, 0, 1, "hardening_solo", "gloo", 10)
    try:
        assert listeners(port) == ["127.0.0.1"]  # torch's own server listened on every interface
    finally:
        wt.close_group(group)
    del group
    socket.create_server(("127.0.0.1", port)).close()  # the port is free again: a reconnect can bind it


# ------------------------------------------------------------------ the engine's model, in process


@pytest.fixture(scope="module")
def sglang_models(upstreams):
    """SGLang's Qwen3MoeForCausalLM and Starcoder2ForCausalLM and the Megatron-mapped
    (name, shape, dtype) of every tensor the trainer sends each, as in test_weight_names.py."""
    from source_patch.runtime.weight_sync import names as wn

    out = {}
    for style in ("qwen3_moe", "gpt"):
        torch.manual_seed(0)
        trainer = models.megatron_model(style)
        layout = wn.Layout.from_config(trainer.config)
        specs = list(wn.plan(((n, tuple(p.shape), p.dtype) for n, p in trainer.named_parameters()), layout))
        out[style] = (models.sglang_model(style), specs)
    return out


def changed(specs: list, case: str) -> tuple[list, str]:
    """``specs`` with one defect, and the part of the refusal that names it."""
    specs = list(specs)
    index = {name: i for i, (name, _, _) in enumerate(specs)}
    if case == "unknown":
        specs.append(("model.layers.0.mlp.shared_expert_gate.weight", (1, models.HIDDEN), torch.float32))
        return specs, r"1 not in the model \(model.layers.0.mlp.shared_expert_gate.weight\)"
    if case == "missing":
        del specs[index["model.layers.1.self_attn.o_proj.weight"]]
        return specs, r"1 missing \(model.layers.1.self_attn.o_proj.weight\)"
    if case == "shape":  # larger: SGLang's QKV loader narrows it and loads the first rows
        i = index["model.layers.0.self_attn.q_proj.weight"]
        specs[i] = (specs[i][0], (96, models.HIDDEN), specs[i][2])
        return specs, r"1 wrong shape \(model.layers.0.self_attn.q_proj.weight \[96, 64\], loads \[64, 64\]\)"
    if case == "dtype":  # SGLang's loader would cast it
        i = index["model.norm.weight"]
        specs[i] = (specs[i][0], specs[i][1], torch.int32)
        return specs, r"1 wrong dtype \(model.norm.weight int32, holds float32\)"
    assert case == "empty"
    return [], rf"{len(specs)} missing \(model.embed_tokens.weight, "


DEFECTS = ["unknown", "missing", "shape", "dtype", "empty"]


@pytest.mark.parametrize("style", ["qwen3_moe", "gpt"])
def test_the_model_check_takes_exactly_what_the_trainer_sends(sglang_models, style):
    from source_patch.runtime.weight_sync import names as wn

    model, specs = sglang_models[style]
    wn.check_model(model, specs)  # the mapping of every Megatron parameter: accepted as is
    for case in DEFECTS:
        bad, why = changed(specs, case)
        with pytest.raises(ValueError, match="the update does not match the model: " + why):
            wn.check_model(model, bad)
    cast = [(n, s, torch.bfloat16 if n == "model.norm.weight" else d) for n, s, d in specs]
    wn.check_model(model, cast)  # float widths: SGLang's loaders cast, as its own distributed path does


def test_names_another_pipeline_stage_loads_are_left_to_it(sglang_models, monkeypatch):
    from source_patch.runtime.weight_sync import names as wn

    model, specs = sglang_models["qwen3_moe"]
    extra = specs + [("model.layers.7.mlp.gate.weight", (4, models.HIDDEN), torch.float32)]
    with pytest.raises(ValueError, match=r"1 not in the model \(model.layers.7.mlp.gate.weight\)"):
        wn.check_model(model, extra)
    monkeypatch.setattr(model, "pp_group", SimpleNamespace(world_size=2), raising=False)
    wn.check_model(model, extra)  # layer 7 is another stage's (this one holds layers 0-1)
    with pytest.raises(ValueError, match=r"1 not in the model \(model.layers.1.mlp.bogus.weight\)"):
        wn.check_model(model, specs + [("model.layers.1.mlp.bogus.weight", (4,), torch.float32)])


# ------------------------------------------------------------------ a real SGLang server


@pytest.fixture(scope="module")
def engine(sglang_server, weight_sync_server_env):
    """The server test_weight_sync_engine.py and test_weight_sync_backends.py use (same
    arguments: shared in a session), joined to a group of this test process as the
    trainer, and the checkpoint it serves."""
    from safetensors.torch import load_file

    from source_patch.testing.sglang import tiny_checkpoint

    checkpoint = tiny_checkpoint(**models.checkpoint_config())
    server = sglang_server(specs=["weight_sync"], args=["--skip-server-warmup", "--disable-radix-cache"],
                           env=weight_sync_server_env, model=checkpoint)
    port, joined = models.free_port(), {}
    joiner = threading.Thread(target=lambda: joined.update(reply=server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": GROUP, "backend": "gloo"}, timeout=120)))
    joiner.start()
    group = wt.open_group("127.0.0.1", port, 0, 2, GROUP, "gloo", LINK_TIMEOUT_S)
    joiner.join(120)
    assert joined.get("reply", (0,))[0] == 200 and joined["reply"][1]["success"], joined
    state = SimpleNamespace(server=server, link=wt.Link(group, LINK_TIMEOUT_S), port=port,
                            listeners=listeners(port), weights=load_file(checkpoint / "model.safetensors"),
                            flipped=False, versions=itertools.count(1000))
    yield state
    wt.close_group(group)


def attempt(engine, send) -> SimpleNamespace:
    """One update as an orchestrator drives it, ``send(link)`` playing the trainer:
    the trainer's error and time, the server's reply, then what it generates and serves."""
    server, box = engine.server, {}
    assert server.post("/begin_weight_update")[0] == 200
    request = threading.Thread(target=lambda: box.update(reply=server.post("/update_weights_from_distributed", {
        "names": [], "dtypes": [], "shapes": [], "group_name": GROUP, "load_format": "source_patch"}, timeout=120)))
    request.start()
    start, error = time.monotonic(), None
    try:
        send(engine.link)
    except wt.WeightSyncError as exc:
        error = exc
    took = time.monotonic() - start
    request.join(120)
    assert server.post("/end_weight_update")[0] == 200
    return SimpleNamespace(error=error, took=took, reply=box["reply"][1], **served(engine))


def served(engine) -> dict:
    out = engine.server.generate(input_ids=PROMPTS, max_new_tokens=NEW, sampling={"ignore_eos": True})
    return {"tokens": [o["output_ids"] for o in out], "versions": {o["meta_info"]["weight_version"] for o in out}}


def checkpoint_specs(engine, flip: bool = False) -> tuple[list, list]:
    """The checkpoint's tensors, lm_head negated when ``flip`` (the greedy tokens change)."""
    named = [(n, -t if flip and n == "lm_head.weight" else t) for n, t in engine.weights.items()]
    return [(n, tuple(t.shape), t.dtype) for n, t in named], [t for _, t in named]


def assert_refused(engine, send, reason: str):
    """``send`` fails at once on the trainer, the server says why and keeps its
    weights and version, and the next valid update loads and is served."""
    before = served(engine)
    bad = attempt(engine, send)
    assert bad.error is not None and bad.took < FAST_S, (bad.error, bad.took)
    assert not bad.reply["success"] and reason in bad.reply["message"], bad.reply
    assert (bad.tokens, bad.versions) == (before["tokens"], before["versions"])
    version, engine.flipped = next(engine.versions), not engine.flipped
    specs, tensors = checkpoint_specs(engine, engine.flipped)
    good = attempt(engine, lambda link: wt.send(link, wt.plan(specs, 1 << 20, version), tensors))
    assert good.error is None and good.reply["success"], (good.error, good.reply)
    assert good.versions == {str(version)} and good.tokens != before["tokens"]
    return bad


def test_the_engines_group_rendezvous_listens_on_its_host_only(engine):
    assert engine.listeners == ["127.0.0.1"]


@pytest.mark.parametrize("where", sorted(NESTED))
def test_a_real_engine_refuses_a_deeply_nested_manifest_at_once(engine, where):
    bad = assert_refused(engine, lambda link: raw_send(link, *manifest_body(**NESTED[where])),
                         "nested deeper than 4 levels")
    assert "refused by an engine rank" in str(bad.error)


def test_a_real_engine_refuses_a_bucket_flood_at_once(engine):
    bad = assert_refused(engine, lambda link: raw_send(link, *manifest_body(**FLOODING)),
                         "524,288 buckets of 16 bytes, more than the 16,384 a receiver accepts")
    assert "refused by an engine rank" in str(bad.error)


def test_a_sender_with_too_small_buckets_fails_at_once_on_both_ends(engine):
    specs, tensors = checkpoint_specs(engine)
    manifest = wt.plan(specs, 16, next(engine.versions))
    assert manifest.buckets > wt.MAX_BUCKETS
    bad = assert_refused(engine, lambda link: wt.send(link, manifest, tensors), "buckets of 16 bytes")
    assert f"refused: {manifest.buckets:,} buckets of 16 bytes" in str(bad.error)


@pytest.mark.parametrize("case", DEFECTS)
def test_a_real_engine_refuses_an_update_that_does_not_match_its_model(engine, case):
    """Before: SGLang's load_weights skipped the unknown name (and the missing one was
    simply not loaded), narrowed the larger q_proj, cast the int32 norm, and the
    update was served as the new version."""
    specs, tensors = checkpoint_specs(engine, engine.flipped)  # what the engine serves now
    bad_specs, why = changed(specs, case)
    by_name = dict(zip((n for n, _, _ in specs), tensors))
    bad_tensors = [by_name[n].to(d) if n in by_name and by_name[n].shape == s else torch.zeros(s, dtype=d)
                   for n, s, d in bad_specs]
    manifest = wt.plan(bad_specs, 1 << 20, next(engine.versions))
    bad = assert_refused(engine, lambda link: wt.send(link, manifest, bad_tensors),
                         "the update does not match the model: ")
    assert "refused by an engine rank" in str(bad.error)
    assert re.search(why, bad.reply["message"]), bad.reply["message"]
