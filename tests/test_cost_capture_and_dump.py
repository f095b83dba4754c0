"""Issue 59, item 2: two costs the whole-cost profiling found, removed, checked by counting
the work rather than timing it.

- Routing capture's background saver (runtime/routing/megatron/capture.py): each folder
  made once, the ids converted once (pending host copy -> the dtype on disk), a record it
  built itself not validated again, the file's bytes built in one go and written once
  through core/private.py.  The files are byte for byte what the code before wrote: the
  checksums below were taken from it (2026-12-07, safetensors 0.8.0) for the same records.
- A dump call the filter drops (runtime/dump/api.py): decided on the name, rank, step,
  layer and phase before any tag dict is built or any tensor handed on; the ``filtered``
  counter stays exact.
"""

import hashlib
import os
import random
import struct
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save as safetensors_save

from source_patch.runtime.core import private
from source_patch.runtime.dump import api as D
from source_patch.runtime.routing.megatron import capture as megatron_capture, control as rm
from source_patch.runtime.routing.records import file as record_file
from source_patch.runtime.routing.records.record import RoutingRecord, load

# ---------------------------------------------------------------- routing capture's saver

# sha256 of each file as the code before 2026-12-07 wrote it (RoutingRecord.save and capture).
BEFORE = {
    "u8_noprobs": "9ee93b9522c0b73b1a31ef96455f86010829055fbf6c6967ae8c253704d5d503",
    "u8_probs_parallel": "b9e3b4c1a1a977f2ee3f25355550c5fb8fd25969eccb1258fe6d99082a8b9c34",
    "i16": "4dd4e9767ea23082c68b210ed346d4be1203503839406a97399e364a4975a741",
    "i32": "249ac369c9ed4daa1207957d7a26b5dabefe40d546d1ac7a9036e28b8b21844a",
    "empty": "1b9efbd65c6ce621e5766fc9c7d9a425a98fbcacbd6534817b62668a4ba86122",
    "capture/index.json": "6aee936ffa542aabb21c035012c83d16c3fc69802ca9f8011b6b9b915de27937",
    "capture/step-0-mb-0.safetensors": "8214b4fba24fde434969fd871c06775c7be30f6857baa4a8a6d7dd34637fdf12",
    "capture/step-0-mb-1.safetensors": "1dcc214bdf15dae6080c3b848cfb6c137e5946bb18782125456e4736ee26f9c5",
    "capture/step-1-mb-0.safetensors": "16a1d2cc7a5cc8eb9c1b882cd34f9f8fc2ff2a0198210c182bb6203811b405b7",
    "capture/step-1-mb-1.safetensors": "ade74ed8041fb3d598b489e973e2098a8ba44642fa384a723fa98ab67379f345",
}
LAYERS = (1, 2, 3)


def ids(tokens: int, topk: int, experts: int, shift: int = 0) -> torch.Tensor:
    base = (torch.arange(tokens).view(-1, 1) * 3 + shift) % experts
    return (base + torch.arange(topk).view(1, -1)) % experts


def probs(tokens: int, topk: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(tokens * topk, dtype=torch.float32).view(tokens, topk) / (tokens * topk)).to(dtype)


def records():
    yield "u8_noprobs", RoutingRecord(indices={1: ids(16, 2, 8), 3: ids(16, 2, 8, 1)}, num_experts=8,
                                      seq_lens=[8, 8], extra={"step": 3, "microbatch": 1})
    yield "u8_probs_parallel", RoutingRecord(
        indices={0: ids(12, 4, 64), 2: ids(12, 4, 64, 5)}, num_experts=64,
        probs={0: probs(12, 4), 2: probs(12, 4, torch.bfloat16)}, sample_ids=["a", 7], seq_lens=[5, 7],
        padding=[1, 0], parallel={"cp": 2, "sp": True, "tp": 2, "ep": 1, "cp_rank": 1, "tp_rank": 0},
        source="sglang", token_order="requests", extra={"x": [1, 2.5, "é"]})
    yield "i16", RoutingRecord(indices={5: ids(10, 3, 300, 250)}, num_experts=300)
    yield "i32", RoutingRecord(indices={0: ids(6, 2, 40000, 39990).to(torch.int32)}, num_experts=40000,
                               probs={0: probs(6, 2, torch.float16)})
    yield "empty", RoutingRecord(indices={0: torch.zeros(0, 2, dtype=torch.int64)}, num_experts=4)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def capture(tmp_path):
    before = dict(rm._config)
    rm.configure(mode="capture", dir="")  # saved by the test's own save() calls
    rm.reset()
    yield tmp_path
    rm.reset()
    rm.configure(**before)


def step(step_: int, microbatches: int = 2, tokens: int = 8) -> None:
    """One optimizer step through LAYERS, the way the spec calls the runtime."""
    rm.routing_schedule(False)
    for mb in range(microbatches):
        rm.routing_microbatch_begin()
        for layer in LAYERS:
            router = SimpleNamespace(layer_number=layer, config=SimpleNamespace(sequence_parallel=False,
                                                                                num_moe_experts=8))
            rm.routing_enter(router, torch.zeros(tokens // 2, 2, 8))
            rm.routing_topk(None, (None, ids(tokens, 2, 8, layer + step_ + mb)))
            rm.routing_exit()
        rm.routing_microbatch_end()
    rm.routing_schedule_end()
    rm.routing_step(True)


def test_record_files_are_byte_for_byte_what_the_code_before_wrote(tmp_path):
    for name, rec in records():
        path = rec.save(tmp_path / f"{name}.safetensors")
        assert sha(path) == BEFORE[name], name
        assert load(path).equals(rec)
        assert rec.encode() == path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == sorted(f"{name}.safetensors" for name in dict(records()))


def test_captured_files_and_index_are_byte_for_byte_what_the_code_before_wrote(capture):
    for s in range(2):
        step(s)
    megatron_capture.save(capture)
    folder = capture / "rank-0"
    written = {f"capture/{f.name}": sha(f) for f in folder.iterdir()}
    assert written == {k: v for k, v in BEFORE.items() if k.startswith("capture/")}
    assert {oct(os.stat(folder / f).st_mode & 0o777) for f in os.listdir(folder) if f.endswith(".safetensors")} \
        == {"0o600"}  # what tempfile.mkstemp gave them


def test_the_encoder_writes_what_the_safetensors_library_writes():
    """Every dtype the encoder knows, all in one file (the library orders tensors by dtype,
    then name), and a dtype it does not know (handed to the library)."""
    dtypes = [d for d, _ in record_file._ENCODED if d is not None]
    rng = torch.Generator().manual_seed(0)
    tensors = {f"t.{i}.{str(d)[6:]}": torch.randint(0, 2, (3, i + 1), generator=rng).to(d)
               for i, d in enumerate(dtypes * 2)}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["strided"] = torch.arange(12, dtype=torch.int16).view(3, 4).t()  # not contiguous
    meta = {"format": "source-patch-routing", "layers": [1, 2]}
    want = safetensors_save({k: v.contiguous() for k, v in tensors.items()},
                            metadata={record_file.METADATA_KEY: '{"format":"source-patch-routing","layers":[1,2]}'})
    assert record_file.encode(tensors, meta) == want
    odd = {"c": torch.zeros(2, dtype=torch.complex64), "a": torch.ones(2)}
    assert record_file.encode(odd, meta) == safetensors_save(odd, metadata={
        record_file.METADATA_KEY: '{"format":"source-patch-routing","layers":[1,2]}'})


def test_the_saver_makes_each_folder_once(capture, monkeypatch):
    made = []
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        made.append(os.fspath(path))  # tried, made or not
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    root = capture / "routes"
    for s in range(5):
        step(s)
        megatron_capture.save(root, {s}, index=s == 4)
    # the code before: two a record (capture's folder, then the writer's), 20 here
    assert sorted(set(made)) == [str(root), str(root / "rank-0")] and len(made) <= 3
    assert len(load_index(root)) == 10


def load_index(root) -> list:
    import json

    return json.loads((root / "rank-0" / "index.json").read_text())["records"]


def test_the_saver_converts_ids_once_and_does_not_validate_what_it_built(capture, monkeypatch):
    for s in range(2):
        step(s)
    conversions, validations = [], []
    real_to, real_validate = torch.Tensor.to, RoutingRecord.validate
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (conversions.append(a), real_to(self, *a, **k))[1])
    monkeypatch.setattr(RoutingRecord, "validate", lambda self: (validations.append(1), real_validate(self))[1])
    megatron_capture.save(capture)
    monkeypatch.undo()
    # 4 records x 3 layers: one conversion each, int64 -> uint8 (the code before: two, and
    # two validations a record, each a dozen tensor ops a layer)
    assert conversions == [(torch.uint8,)] * 12 and validations == []
    back = load(capture / "rank-0" / "step-1-mb-1.safetensors")  # a file read back is validated
    assert back.layers == list(LAYERS) and torch.equal(back.indices[2], ids(8, 2, 8, 2 + 1 + 1))


def test_the_saver_writes_each_file_once_through_the_private_writer(capture, monkeypatch):
    writes = []
    real_private, real_file = private.write_private, private.write_file
    monkeypatch.setattr(private, "write_private",
                        lambda root, parts, data, **k: (writes.append((parts[-1], k)), real_private(root, parts, data, **k))[1])
    monkeypatch.setattr(private, "write_file", lambda path, data: (writes.append((os.path.basename(path), {})),
                                                                    real_file(path, data))[1])
    step(0)
    megatron_capture.save(capture)
    assert writes == [("step-0-mb-0.safetensors", {"check_root": False, "sync": False}),
                      ("step-0-mb-1.safetensors", {"check_root": False, "sync": False}), ("index.json", {})]
    assert sorted(os.listdir(capture / "rank-0")) == ["index.json", "step-0-mb-0.safetensors",
                                                       "step-0-mb-1.safetensors"]  # no temporary file left


def test_the_index_is_written_again_where_its_folder_went_missing(capture):
    step(0)
    megatron_capture.save(capture)
    for f in (capture / "rank-0").iterdir():
        f.unlink()
    (capture / "rank-0").rmdir()
    megatron_capture.save(capture)  # nothing pending: the index alone, in a folder made again
    assert len(load_index(capture)) == 2


def test_a_trusted_record_is_the_record_validation_would_have_built():
    rec = RoutingRecord(indices={2: ids(6, 2, 8), 0: ids(6, 2, 8, 3)}, num_experts=8, seq_lens=[3, 3],
                        extra={"step": 1})
    same = RoutingRecord.trusted(indices={2: ids(6, 2, 8), 0: ids(6, 2, 8, 3)}, num_experts=8, seq_lens=[3, 3],
                                 extra={"step": 1})
    assert same.layers == [0, 2] and same.topk == 2 and same.equals(rec)
    assert same.encode(check=False) == rec.encode()
    with pytest.raises(TypeError, match="no field"):
        RoutingRecord.trusted(indices={0: ids(6, 2, 8)}, num_experts=8, layer=[0])


# ---------------------------------------------------------------- a filtered dump call


@pytest.fixture
def dumper(tmp_path, monkeypatch):
    """Dumping on, into tmp_path, with an initialised (fake) Megatron parallel_state: its
    ranks are what a record's tags read, and what a filtered call must not."""
    fake = types.ModuleType("megatron.core.parallel_state")
    fake._TENSOR_MODEL_PARALLEL_GROUP = fake._PIPELINE_MODEL_PARALLEL_GROUP = fake._DATA_PARALLEL_GROUP = object()
    fake.model_parallel_is_initialized = lambda: True
    for group in ("tensor_model", "pipeline_model", "context", "expert_model", "data"):
        setattr(fake, f"get_{group}_parallel_rank", lambda: 0)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake)
    D.configure_from_settings({})
    D.reset()
    D.configure(enable=True, dir=str(tmp_path))
    restore = D.dump_context(phase="fwd_bwd", microbatch=0)
    yield D
    restore.__exit__(None, None, None)
    D.flush(10)
    D.configure_from_settings({})
    D.reset()


def counting(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("criterion", [dict(names=["attn_*"]), dict(layers=[7]), dict(steps=["100-"]),
                                       dict(phases=["fwd_only"]), dict(ranks=[3])])
def test_a_filtered_call_builds_no_tags_and_hands_on_no_tensor(dumper, monkeypatch, criterion):
    dumper.configure(**criterion)
    parallel = counting(monkeypatch, D.ranks, "parallel_tags")
    built = counting(monkeypatch, D, "_record_tags")
    enqueued = counting(monkeypatch, D._pipeline, "enqueue")
    x = torch.zeros(3)
    for layer in range(4):
        assert dumper.dump("mlp_output", x, layer=layer) is x
        dumper.dump("qkv", (x, None, x), layer=layer)
    assert (parallel, built, enqueued) == ([], [], [])  # the code before built every call's tags
    assert dumper.state()["counters"]["filtered"] == 4 * 3


def test_a_name_is_matched_once(dumper, monkeypatch):
    dumper.configure(names=["attn_*"])
    matched = counting(monkeypatch, D._filter, "names")
    for _ in range(5):
        dumper.dump("mlp_output", torch.zeros(1), layer=1)
        dumper.dump("attn_output", torch.zeros(1), layer=1)
    assert sorted(a[0] for a in matched) == ["attn_output", "mlp_output"]
    dumper.flush(10)
    st = dumper.state()["counters"]
    assert (st["records"], st["filtered"]) == (5, 5)


def reference(tags: dict, config: dict) -> bool:
    """The filter's criteria on a record's built tags (what _record checked before)."""
    for key, tag in (("steps", "step"), ("layers", "layer")):
        if config.get(key) is not None and tags.get(tag) not in D.settings.IntSet(config[key]):
            return False
    return config.get("phases") is None or tags.get("phase") in config["phases"]


def test_the_filter_decides_as_on_the_built_tags(dumper):
    """Step, layer and phase read where the record's tags take them from (the call's own tag
    over the ambient one over the default), for every mix of the three, a tensor-valued
    tag and a step set by the ambient tags or counted by dump_step."""
    rng = random.Random(0)
    configs = [dict(steps=None, layers=None, phases=None), dict(steps=[1, "3-4"]), dict(layers=["2-3", 7]),
               dict(phases=["fwd_bwd"]), dict(steps=["2-"], layers=[1], phases=["eval", "inference"])]
    values = {"step": [None, 0, 2, 3, torch.tensor(3), True], "layer": [None, 1, 3, 7, torch.tensor(7), "1"],
              "phase": [None, "eval", "fwd_bwd", "inference"]}
    for _ in range(300):
        config = {**dict(steps=None, layers=None, phases=None), **rng.choice(configs)}
        dumper.configure(**config)
        D.dump_step(step=rng.choice([0, 1, 3, 5]))
        ambient = {key: rng.choice(choices) for key, choices in values.items()}  # None: not set
        call = {key: rng.choice(choices) for key, choices in values.items()}
        call = {key: value for key, value in call.items() if value is not None}
        with D.dump_context(**ambient):
            expected = reference(D._record_tags(call, 0), config)
            assert D._filter.admits(call) is expected, (config, D._step, D.ambient.context(), call)


def test_filtered_counts_stay_exact_for_structured_values(dumper):
    dumper.configure(names=["qkv.1", "attn_*"], layers=[1])
    x = torch.zeros(2)
    for layer in (0, 1):
        dumper.dump("qkv", (x, x, x), layer=layer)           # element 1 kept on layer 1
        dumper.dump("attn_out", {"a": x, "b": None}, layer=layer)  # the name matches: every element
        dumper.dump("mlp", [x, [x, x]], layer=layer)          # nothing matches
        dumper.dump("loss", 2.5, layer=layer)                 # a number: one element
    dumper.flush(10)
    st = dumper.state()["counters"]
    assert st["records"] == 2 and st["filtered"] == 2 * (3 + 1 + 3 + 1) - 2
