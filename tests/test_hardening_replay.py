"""Issue 57, item 6 (and replay's part of item 5): `source-patch replay` fed hostile data.

Every bad input is refused before anything is built or allocated, in one line on
stderr naming the file and the field, exit 2, nothing made under --out: a position of
2**40, a request longer than the limit or the config's context, token ids outside the
vocabulary or not integers, a config.json missing a key, of the wrong type or with
absurd sizes, garbage weights, a checkpoint tensor of another shape than the config
says (before: zero-padded and replayed with rc 0), routes that do not fit the model.
Outputs are checked up front: --logprobs into a missing folder (before: the finished
run deleted), and a FIFO anywhere we read or write answers within a second.  These
fail in the parent process, before the worker (and Megatron) starts; the builder's
failures, which only the worker can see, are the slow tests at the end."""

import json
import os
import time

import pytest
import torch
from test_hardening_dump import named, records, write_dump
from test_hardening_readers import within_a_second

from source_patch.patcher import cli
from source_patch.runtime.verdict import replay

# A tiny Qwen3-MoE config.json the twin could build; its tensors from the same sizes.
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 64, "norm_topk_prob": True}


def tensors(config):
    """Zero tensors of every name and shape a Qwen3-MoE checkpoint of ``config`` holds."""
    v, h, layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts, width = config["num_experts"], config["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h], "model.norm.weight": [h]}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                    p + "self_attn.q_proj.weight": [heads * dim, h], p + "self_attn.k_proj.weight": [groups * dim, h],
                    p + "self_attn.v_proj.weight": [groups * dim, h], p + "self_attn.o_proj.weight": [h, heads * dim],
                    p + "self_attn.q_norm.weight": [dim], p + "self_attn.k_norm.weight": [dim],
                    p + "mlp.gate.weight": [experts, h]})
        for e in range(experts):
            out.update({f"{p}mlp.experts.{e}.gate_proj.weight": [width, h],
                        f"{p}mlp.experts.{e}.up_proj.weight": [width, h],
                        f"{p}mlp.experts.{e}.down_proj.weight": [h, width]})
    return {name: torch.zeros(shape) for name, shape in out.items()}


def make_checkpoint(folder, config=CONFIG, weights=None):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors(CONFIG) if weights is None else weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def inputs(tmp_path):
    """(rollout dumps: r0 = [5, 6], r1 = [7, 8]; a checkpoint of CONFIG)."""
    return write_dump(tmp_path / "rollout", records(False)), make_checkpoint(tmp_path / "ckpt")


def refused(tmp_path, capture, *args, said, limit=None, worker=False):
    """`source-patch replay ARGS --out tmp/out` exits 2 with one line on stderr holding
    ``said`` (within ``limit`` seconds), before anything is made under --out; with
    ``worker``, said by the worker process (``capture``: capfd), no run left under --out."""
    started = time.monotonic()
    code = cli.main(["replay", *map(str, args), "--out", str(tmp_path / "out")])
    took = time.monotonic() - started
    captured = capture.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("source-patch: error: "), captured.err[-3000:]
    assert said in lines[0], lines[0]
    assert "Traceback" not in captured.err
    assert not (tmp_path / "out").exists() or worker and not any((tmp_path / "out").iterdir())
    assert limit is None or took < limit, took
    return lines[0]


def rollout_with(tmp_path, tensor_name, tensor, rids=("r0", "r1")):
    recs = records(False)
    named(recs, tensor_name)[2] = tensor
    named(recs, "row_request")[1]["rids"] = list(rids)
    return write_dump(tmp_path / "hostile", recs)


# ------------------------------------------------------------------ the rollout's tokens

def test_a_position_of_2_40_is_refused_before_anything_its_size_is_made(tmp_path, capsys, inputs):
    rollout = rollout_with(tmp_path, "positions", torch.tensor([0, 2 ** 40, 0, 1]))
    said = refused(tmp_path, capsys, rollout, "--checkpoint", inputs[1], said="position 1099511627776 outside "
                   "0..16383", limit=5)
    assert str(rollout) in said


def test_a_request_longer_than_the_limit_or_the_context_is_refused(tmp_path, capsys, inputs):
    n = 20_000  # before: an allocation traceback in the forward
    recs = [["input_ids", {"step": 0, "rank": 0}, torch.arange(n) % 32],
            ["positions", {"step": 0, "rank": 0}, torch.arange(n)],
            ["row_request", {"step": 0, "rank": 0, "rids": ["long"]}, torch.zeros(n, dtype=torch.int32)]]
    long = write_dump(tmp_path / "long", recs)
    refused(tmp_path, capsys, long, "--checkpoint", inputs[1], said="position 19999 outside 0..16383")
    short = write_dump(tmp_path / "short", [[name, tags, t[:100]] for name, tags, t in recs])
    refused(tmp_path, capsys, short, "--checkpoint", inputs[1],
            said="request 'long' has 100 tokens, more than")  # the config's max_position_embeddings: 64


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, capsys, inputs):
    rollout = rollout_with(tmp_path, "input_ids", torch.tensor([5, 99, 7, 8]))
    said = refused(tmp_path, capsys, rollout, "--checkpoint", inputs[1],
                   said="request 'r0' position 1: token id 99 is outside")
    assert "vocab_size 32" in said and "config.json" in said


@pytest.mark.parametrize("ids, said", [(torch.tensor([5.0, 6.7, 7.0, 8.0]), "1 float32 value(s), expected one "
                                        "integer token id"),
                                       (torch.tensor([5, -6, 7, 8]), "token id -6")])
def test_float_or_negative_token_ids_are_refused_not_truncated(tmp_path, capsys, inputs, ids, said):
    refused(tmp_path, capsys, rollout_with(tmp_path, "input_ids", ids), "--checkpoint", inputs[1], said=said)


# ------------------------------------------------------------------ the checkpoint

CONFIG_CASES = {
    "layers-a-million": ({"num_hidden_layers": 1_000_000}, "no tensor model.layers.1.input_layernorm.weight"),
    "vocab-a-float": ({"vocab_size": 1e9}, "vocab_size is 1000000000.0, expected an integer"),
    "vocab-absurd": ({"vocab_size": 10 ** 40}, "vocab_size is 1000000000000000000000"),
    "heads-a-string": ({"num_attention_heads": "2"}, "num_attention_heads is '2', expected an integer"),
    "experts-a-list": ({"num_experts": [4]}, "num_experts is [4], expected an integer"),
    "hidden-missing": ({"hidden_size": KeyError}, "hidden_size is missing"),
    "experts-missing": ({"num_experts": KeyError}, "num_local_experts is missing"),
    "eps-a-string": ({"rms_norm_eps": "tiny"}, 'rms_norm_eps is "tiny", expected a number'),
    "context-negative": ({"max_position_embeddings": -1}, "max_position_embeddings is -1"),
    "not-qwen3-moe": ({"model_type": "llama"}, "model_type is 'llama': the twin is built for qwen3_moe"),
    "vocab-of-the-weights-halved": ({"vocab_size": 16}, "model.embed_tokens.weight is [32, 8], config.json "
                                    "makes it [16, 8]"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_config_missing_keys_of_wrong_types_or_absurd_sizes_is_one_line(tmp_path, capsys, inputs, case):
    changes, said = CONFIG_CASES[case]
    config = {k: v for k, v in {**CONFIG, **changes}.items() if v is not KeyError}
    (inputs[1] / "config.json").write_text(json.dumps(config))
    assert "config.json" in refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], said=said)


def test_a_config_that_is_not_json_or_nests_deeply_is_one_line(tmp_path, capsys, inputs):
    (inputs[1] / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], said="nested deeper than")
    (inputs[1] / "config.json").write_text("{nope")
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], said="config.json: not valid JSON")


def test_an_embedding_of_10_rows_is_refused_not_zero_padded(tmp_path, capsys, inputs):
    weights = tensors(CONFIG)
    weights["model.embed_tokens.weight"] = torch.zeros(10, 8)
    make_checkpoint(inputs[1], weights=weights)
    said = refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1],
                   said="model.embed_tokens.weight is [10, 8], config.json makes it [32, 8]")
    assert str(inputs[1] / "model.safetensors") in said


@pytest.mark.parametrize("case, said", [
    ("random-bytes", "not a safetensors file"),
    ("header-nested", "nested deeper than 3"),
    ("offsets-strings", "a malformed header entry"),
    ("offsets-past-the-end", "a malformed header entry"),
    ("integer-weights", "is stored as I32"),
    ("a-tensor-too-many", "tensors config.json has no place for: model.layers.7.mlp.gate.weight"),
    ("a-tensor-missing", "no tensor model.layers.0.mlp.experts.3.down_proj.weight"),
    ("no-weights", "no tensors in *.safetensors files"),
])
def test_garbage_weights_are_one_line(tmp_path, capsys, inputs, case, said):
    path = inputs[1] / "model.safetensors"
    weights = tensors(CONFIG)
    if case == "integer-weights":
        weights["model.norm.weight"] = torch.zeros(8, dtype=torch.int32)
    elif case == "a-tensor-too-many":
        weights["model.layers.7.mlp.gate.weight"] = torch.zeros(4, 8)
    elif case == "a-tensor-missing":
        del weights["model.layers.0.mlp.experts.3.down_proj.weight"]
    make_checkpoint(inputs[1], weights=weights)
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    if case == "random-bytes":
        path.write_bytes(os.urandom(4096))
    elif case == "no-weights":
        path.unlink()
    elif case in ("header-nested", "offsets-strings", "offsets-past-the-end"):
        entry = header["model.norm.weight"]
        entry.update({"header-nested": {"shape": [[[[8]]]]}, "offsets-strings": {"data_offsets": ["0", "32"]},
                      "offsets-past-the-end": {"data_offsets": [0, 2 ** 50]}}[case])
        raw = json.dumps(header).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], said=said)


def test_the_real_tiny_checkpoint_passes_and_its_10_row_embedding_does_not(tmp_path):
    """The twin's tensors as transformers writes them (the engine tests' checkpoint)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from source_patch.testing.sglang import tiny_checkpoint

    real = tiny_checkpoint()
    config = replay.read_config(real)
    replay.check_weights(real, config)
    weights = load_file(str(real / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:10].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((real / "config.json").read_bytes())
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(replay.ReplayError, match=r"model.embed_tokens.weight is \[10, 64\], config.json makes it "
                                                 r"\[1024, 64\]"):
        replay.check_weights(bad, config)


# ------------------------------------------------------------------ routes

def save_route(folder, rid, tokens, experts=4, topk=2, layer=0):
    from source_patch.runtime.routing.records.record import RoutingRecord

    ids = torch.stack([torch.arange(topk)] * tokens)
    RoutingRecord(indices={layer: ids}, num_experts=experts, token_order="requests", sample_ids=[rid],
                  seq_lens=[tokens], source="sglang").save(folder / "rank0" / f"{rid}.safetensors")
    return folder


@pytest.mark.parametrize("change, said", [
    ({"topk": 1}, "(num_experts 4, topk 1, layers up to 0) does not fit config.json"),
    ({"layer": 5}, "layers up to 5) does not fit"),
    ({"experts": 9}, "(num_experts 9, topk 2"),
    ({"tokens": 7}, "request 'r0''s record has 7 tokens, the rollout 2"),
])
def test_routes_that_do_not_fit_the_model_or_the_request_are_one_line(tmp_path, capsys, inputs, change, said):
    routes = save_route(tmp_path / "routes", "r0", **{"tokens": 2, **change})
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], "--routes", routes, said=said)


def test_a_deeply_nested_routing_file_is_one_line(tmp_path, capsys, inputs):
    routes = save_route(tmp_path / "routes", "r0", 2)
    path = routes / "rank0" / "r0.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    raw = blob[8:8 + n].replace(b"{", b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b",", 1)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], "--routes", routes,
            said="corrupt safetensors header: nested deeper than 3")


# ------------------------------------------------------------------ outputs, and FIFOs

def test_logprobs_into_a_missing_folder_is_refused_before_the_replay(tmp_path, capsys, inputs):
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], "--logprobs", tmp_path / "no" / "l.json",
            said="--logprobs", limit=5)
    refused(tmp_path, capsys, inputs[0], "--checkpoint", inputs[1], "--logprobs", tmp_path,
            said="is a folder")


FIFO_CASES = ["--logprobs", "--html", "--json-out", "config.json", "model.safetensors", "a routing file"]


@pytest.mark.parametrize("where", FIFO_CASES)
def test_a_fifo_read_or_written_by_replay_is_refused_within_a_second(tmp_path, capsys, inputs, where):
    rollout, checkpoint = inputs
    fifo, args = tmp_path / "fifo", []
    if where.startswith("--"):
        args = [where, fifo]
    elif where == "a routing file":
        routes = save_route(tmp_path / "routes", "r0", 2)
        fifo = routes / "rank0" / "r1.safetensors"
        args = ["--routes", routes]
    else:
        fifo = checkpoint / where
        fifo.unlink()
    os.mkfifo(fifo)
    argv = ["replay", str(rollout), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), *map(str, args)]
    assert within_a_second(lambda: cli.main(argv), fifo, grace=20.0) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("source-patch: error: ") and "Traceback" not in err, err
    assert str(fifo) in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the builder (the worker: slow)

BUILDERS = {
    "raises-at-import": ("raise ImportError('no such library')\n", "importing", "ImportError: no such library"),
    "a-syntax-error": ("def build(:\n", "importing", "SyntaxError"),
}
MODEL = '''
import shutil

import torch

class Model(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.out = out

    def forward(self, ids, positions, attention_mask=None):
        return self.out(ids)

def raises(checkpoint):
    raise RuntimeError("the builder broke")

def wrong_logits(checkpoint):  # what a Hugging Face model returns: an output object, not logits
    return Model(lambda ids: {"logits": torch.zeros(1, ids.shape[1], 32)})

def removes_the_logprobs_folder(checkpoint):
    shutil.rmtree("{gone}")
    return Model(lambda ids: torch.zeros(1, ids.shape[1], 32))
'''


@pytest.mark.usefixtures("in_shared_code_cache")  # the worker's start hook compiles there
@pytest.mark.parametrize("case", sorted(BUILDERS))
def test_a_builder_that_cannot_import_is_one_line(tmp_path, capfd, inputs, case):
    source, said, error = BUILDERS[case]
    (tmp_path / "b.py").write_text(source)
    line = refused(tmp_path, capfd, inputs[0], "--checkpoint", inputs[1], "--builder", f"{tmp_path / 'b.py'}:build",
                   said=said, worker=True)
    assert error in line


@pytest.mark.slow
@pytest.mark.usefixtures("in_shared_code_cache")
@pytest.mark.parametrize("function", ["raises", "wrong_logits"])
def test_a_builder_that_fails_or_returns_garbage_is_one_line(tmp_path, capfd, inputs, function):
    pytest.importorskip("megatron.core")
    said = {"raises": "building the model failed: RuntimeError: the builder broke",
            "wrong_logits": "the model returned dict for 2 tokens, expected float logits [1, 2, vocab]"}[function]
    (tmp_path / "m.py").write_text(MODEL)
    refused(tmp_path, capfd, inputs[0], "--checkpoint", inputs[1], "--builder", f"{tmp_path / 'm.py'}:{function}",
            said=said, worker=True)


@pytest.mark.slow
@pytest.mark.usefixtures("in_shared_code_cache")
def test_logprobs_that_cannot_be_written_keep_the_finished_run(tmp_path, capfd, inputs):
    """The folder checked up front goes away during the replay: the run stays, one line says where."""
    pytest.importorskip("megatron.core")
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "m.py").write_text(MODEL.replace("{gone}", str(gone)))
    code = cli.main(["replay", str(inputs[0]), "--checkpoint", str(inputs[1]), "--out", str(tmp_path / "out"),
                     "--builder", f"{tmp_path / 'm.py'}:removes_the_logprobs_folder", "--logprobs",
                     str(gone / "l.json")])
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot write it" in err and "Traceback" not in err, err
    runs = list((tmp_path / "out").iterdir())
    assert len(runs) == 1 and str(runs[0]) in err and (runs[0] / "replay.json").is_file()
