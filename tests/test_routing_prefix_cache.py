"""Routing capture keyed by KV slot under SGLang's radix cache (issue 31, build item 3),
in one real SGLang server on CPU (radix cache on, routing capture on, SGLang's own
``--enable-return-routed-experts`` on for an independent check).

A GRPO-shaped rollout: one prompt, 4 sampled completions. Every sample after the first
gets its prompt prefix from the radix cache (SGLang reports ``cached_tokens`` > 0), so
its prefix rows were computed by another request; prompts are prefilled in chunks of 8
tokens. Every record must still start at
position 0 with ``prompt + generated - 1`` rows, equal to SGLang's own
``meta_info["routed_experts"]`` and to a run of the same samples with nothing cached
(the cache flushed before each request, ``cached_tokens`` == 0)."""

import base64
import importlib.util

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from source_patch.runtime.routing.sglang.files import wait_record  # noqa: E402
from source_patch.runtime.routing.sglang.slot_store import SlotStore  # noqa: E402

PROMPT = [11, 23, 5, 88, 140, 7, 301, 42, 9, 64, 17, 3, 250, 77]
NEW, SAMPLES, LAYERS, TOPK = 6, 4, 2, 2
BIAS = [5, 600, 321, 900]  # one favoured token per sample


@pytest.fixture(scope="module")
def cached_server(sglang_cpu, sglang_server, tmp_path_factory):
    routes = tmp_path_factory.mktemp("prefix-routes")
    # chunked prefill of 8 tokens: the 14-token prompt is prefilled in two chunks (cache off too)
    server = sglang_server(specs=["routing"], args=["--enable-return-routed-experts", "--skip-server-warmup",
                                                    "--chunked-prefill-size", "8"],
                           env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture",
                                "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(routes)})
    return server, routes


def _theirs(meta):
    raw = base64.b64decode(meta["routed_experts"])
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, LAYERS, TOPK).long()


def _generate(server, rids, samples, **fields):
    """One /generate of PROMPT for each sample index in ``samples``. Greedy with a
    per-sample logit bias: distinct completions that a second run reproduces exactly
    (this engine's seeded sampling needs --enable-deterministic-inference, which
    refuses the torch-native attention backend that runs on CPU)."""
    params = [{"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True,
               "logit_bias": {str(BIAS[i]): 4.0}} for i in samples]
    status, out = server.post("/generate", {"input_ids": [PROMPT] * len(rids), "rid": rids,
                                            "sampling_params": params, "return_routed_experts": True, **fields})
    assert status == 200, out
    return out


def _grpo(server):
    """Sample 0 alone (it fills the cache), then samples 1-3 together, as a rollout
    worker sends a group once the prompt is warm."""
    server.post("/flush_cache")
    first = _generate(server, ["grpo-0"], [0])
    rest = _generate(server, [f"grpo-{i}" for i in range(1, SAMPLES)], range(1, SAMPLES))
    return first + rest


def _uncached(server):
    out = []
    for i in range(SAMPLES):
        assert server.post("/flush_cache")[0] == 200
        out += _generate(server, [f"nocache-{i}"], [i])
    return out


def _stacked(rec):
    return torch.stack([rec.indices[layer] for layer in rec.layers], dim=1)


@pytest.mark.slow
def test_grpo_samples_with_prefix_hits_have_whole_records(cached_server):
    server, routes = cached_server
    status, info = server.get("/get_server_info")
    assert status == 200 and info["chunked_prefill_size"] == 8 < len(PROMPT) and not info["disable_radix_cache"]
    cached, uncached = _grpo(server), _uncached(server)
    assert [r["meta_info"]["cached_tokens"] for r in uncached] == [0] * SAMPLES
    hits = [r["meta_info"]["cached_tokens"] for r in cached[1:]]
    assert all(h >= len(PROMPT) - 2 for h in hits), hits  # the prefix really came from the cache
    outputs = {tuple(r["output_ids"]) for r in cached}
    assert len(outputs) == SAMPLES  # the completions differ, the prompt is shared
    for i, (hit, miss) in enumerate(zip(cached, uncached)):
        assert hit["output_ids"] == miss["output_ids"]
        rec, ref = wait_record(routes, f"grpo-{i}"), wait_record(routes, f"nocache-{i}")
        assert rec.extra["start_pos"] == 0 and rec.layers == [0, 1] and rec.sample_ids == [f"grpo-{i}"]
        assert rec.num_tokens == rec.seq_lens[0] == len(PROMPT) + NEW - 1
        assert torch.equal(_stacked(rec), _theirs(hit["meta_info"]))   # SGLang's own capturer
        assert torch.equal(_stacked(rec), _stacked(ref))                 # the run with nothing cached
        assert torch.equal(_stacked(ref), _theirs(miss["meta_info"]))
        assert rec.probs is not None and all(torch.allclose(rec.probs[k], ref.probs[k], atol=1e-5)
                                             for k in rec.layers)
    # The prefix rows of every cached sample are sample 0's: one computation, one route.
    first = _stacked(wait_record(routes, "grpo-0"))
    for i in range(1, SAMPLES):
        assert torch.equal(_stacked(wait_record(routes, f"grpo-{i}"))[:len(PROMPT) - 1], first[:len(PROMPT) - 1])


def test_slot_store_reads_by_slot_and_refuses_unwritten_rows():
    """The host store: rows land at their KV slots (a later owner overwrites), read back in
    the order of the slots asked; a slot never written is an error naming the position."""
    store = SlotStore()
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    store.pending(torch.tensor([7, 2, 40]), {0: (ids, ids.float() / 10)}, "first")
    store.pending(torch.tensor([2]), {0: (torch.tensor([[6, 7]]), torch.tensor([[0.5, 0.5]]))}, "second")
    store.settle(keep=lambda tag: tag == "second")  # a reader that does not need the latest forward
    assert store.read(torch.tensor([2]), "r")[0][0].tolist() == [[2, 3]]
    store.settle()  # slot 2 reused by the second forward
    layers, weights = store.read(torch.tensor([40, 2, 7]), "request 'r'")
    assert layers[0].tolist() == [[4, 5], [6, 7], [0, 1]] and layers[0].dtype == torch.int64
    assert torch.allclose(weights[0], torch.tensor([[0.4, 0.5], [0.5, 0.5], [0.0, 0.1]]))
    assert store.capacity >= 41 and store.bytes_per_slot() == 2 * 8 + 1
    with pytest.raises(LookupError, match=r"request 'r': layer 0 has no routes at position 1 \(KV slot 3\)"):
        store.read(torch.tensor([7, 3]), "request 'r'")
    with pytest.raises(LookupError, match=r"position 0 \(KV slot 500\)"):
        store.read(torch.tensor([500]), "request 'r'")


@pytest.fixture(scope="module")
def replayed(cached_server, sglang_server, tmp_path_factory):
    """Sample 2 of a GRPO group (its prompt prefix came from the radix cache), replayed in a
    second server: as recorded ("rp-same"), and with only its prompt-prefix rows moved to
    other experts ("rp-prefix-moved"), which changes the model's output only if those rows,
    the ones a start_pos > 0 record used to lack, are replayed."""
    server, routes = cached_server
    out = _grpo(server)[2]
    assert out["meta_info"]["cached_tokens"] > 0
    rec = wait_record(routes, "grpo-2")
    folder = tmp_path_factory.mktemp("prefix-replay")
    prefix = len(PROMPT) - 1
    moved = {k: torch.cat([(v[:prefix] + 3) % rec.num_experts, v[prefix:]]) for k, v in rec.indices.items()}
    rec.replace(sample_ids=["rp-same"], probs=None).save(folder / "same.safetensors")
    rec.replace(sample_ids=["rp-prefix-moved"], indices=moved, probs=None).save(folder / "moved.safetensors")
    replay = sglang_server(specs=["routing"], args=["--disable-radix-cache", "--skip-server-warmup"],
                           env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "replay",
                                "SOURCE_PATCH_ROUTING_SGLANG_REPLAY": str(folder)})
    return replay, out["output_ids"]


@pytest.mark.slow
def test_replaying_a_cached_samples_record_reproduces_its_tokens(replayed):
    server, tokens = replayed
    same = _generate(server, ["rp-same"], [2], return_logprob=True)[0]
    moved = _generate(server, ["rp-prefix-moved"], [2], return_logprob=True)[0]
    assert same["output_ids"] == tokens
    # the prompt-prefix rows are in the record and replayed: other experts, other log-probs
    # (the sample's logit bias may still pick the same tokens)
    logp = [[entry[0] for entry in r["meta_info"]["output_token_logprobs"]] for r in (same, moved)]
    assert len(logp[0]) == len(logp[1]) == NEW
    assert max(abs(a - b) for a, b in zip(*logp)) > 1e-3
