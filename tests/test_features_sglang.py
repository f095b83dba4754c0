"""Feature capture in a real SGLang engine (patches/features.yaml, runtime/features/capture.py):
per request of a mixed-length extend batch, the captured tensors equal what the model
computes (transformers on the same checkpoint) and, bitwise, what the dump spec
records at the same points of the same pass."""

import pytest
import torch

from sglang_reference import activations, request_records, wait_for
from source_patch.runtime.features import capture
from source_patch.runtime.features.store import open_store
from source_patch.runtime.features.stream import Consumer

PROMPTS = {"feat-a": [5, 6, 7, 8, 9, 10, 11], "feat-b": [3, 1, 4], "feat-c": [2, 7, 1, 8, 2]}


def test_the_spec_anchors_in_the_installed_sglang_without_importing_it(check_sglang_spec):
    out = check_sglang_spec("features")
    for module in ("qwen3_moe", "qwen2_moe", "qwen2", "llama"):
        assert f"ok   sglang.srt.models.{module} " in out


def test_eagle3_default_layers_stay_in_range():
    assert capture.eagle3_layers(32) == [2, 16, 29]
    assert capture.eagle3_layers(2) == [0, 1]


def _consume(stream, wanted: set, timeout: float = 60.0) -> dict:
    """{sample id: tensors} of the wanted samples, read off the stream and acked."""
    store = open_store(stream.features_url)
    consumer = Consumer(str(stream.path), str(stream.path) + ".db", idle_timeout=timeout)
    got = {}
    try:
        for ref in consumer:
            if ref.sample_id in wanted:
                got[ref.sample_id] = store.get(ref)
            consumer.ack([ref])
            if wanted <= got.keys():
                break
    finally:
        consumer.close()
        store.close()
    return got


@pytest.mark.slow
def test_captured_features_equal_the_model_for_a_mixed_length_batch(instrumented_sglang, hf_qwen3):
    instrumented_sglang.server.generate(input_ids=list(PROMPTS.values()), rid=list(PROMPTS), max_new_tokens=1)
    stream = type("S", (), {"path": instrumented_sglang.stream,
                            "features_url": f"dir://{instrumented_sglang.features}"})
    got = _consume(stream, set(PROMPTS))
    layers = capture.eagle3_layers(hf_qwen3.config.num_hidden_layers)
    for rid, prompt in PROMPTS.items():
        tensors = got[rid]
        n = len(prompt)
        assert sorted(tensors) == sorted(["input_ids", "positions", "loss_mask", "final_hidden",
                                          *(f"hidden_l{k}" for k in layers)])
        assert tensors["input_ids"].tolist() == prompt
        assert tensors["positions"].tolist() == list(range(n))
        assert torch.equal(tensors["loss_mask"], torch.ones(n, dtype=torch.uint8))
        reference = activations(hf_qwen3, prompt)
        for k in layers:
            torch.testing.assert_close(tensors[f"hidden_l{k}"], reference[("layer_input", k)],
                                       rtol=1e-4, atol=1e-5, msg=f"{rid} layer {k}")
        torch.testing.assert_close(tensors["final_hidden"], reference[("final_hidden", None)],
                                   rtol=1e-4, atol=1e-5, msg=f"{rid} final")
        # The dump spec records the same points of the same pass: bitwise equal.
        passes = wait_for(lambda: request_records(instrumented_sglang.dumps, rid),
                          lambda p: any(mode == "extend" for mode, _, _ in p.values()))
        (mode, mask, values), = [p for p in passes.values() if p[0] == "extend"]
        assert len(set(values[("row_request", None)].tolist())) == len(PROMPTS)  # one mixed batch
        for k in layers:
            assert torch.equal(tensors[f"hidden_l{k}"], values[("layer_input", k)][mask])
        assert torch.equal(tensors["final_hidden"], values[("final_hidden", None)][mask])
