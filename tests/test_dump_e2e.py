"""The Megatron example under megatron_cpu + dump, end to end on CPU (real processes).

Three runs of the same seeded training (tests/e2e/dump_run.py): dumping on, an
unpatched reference that records the same activations with plain module hooks, and
the dump spec active with dumping disabled at run time.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
from safetensors.torch import load_file  # noqa: E402

from source_patch.runtime.dump.reader import load  # noqa: E402

RUN = Path(__file__).parent / "e2e" / "dump_run.py"
STEPS, MICROBATCHES, LAYERS = 2, 2, 4
LAYER_NAMES = ("layer_input", "attention_output", "pre_mlp_residual", "mlp_output", "layer_output", "routing_map")
MODEL_NAMES = ("embedding_output", "final_hidden", "logits")


def train(tmp: Path, cache: Path, tag: str, specs: str, *args, **env) -> dict:
    out = tmp / f"{tag}.safetensors"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_DUMP")}
    environ.update(SOURCE_PATCH=specs, SOURCE_PATCH_CACHE=str(cache),
                   SOURCE_PATCH_DUMP_DIR=str(tmp / "dumps"), SOURCE_PATCH_DUMP_EXP_NAME=tag, **env)
    result = subprocess.run([sys.executable, str(RUN), str(out), "--steps", str(STEPS),
                             "--micro-batches", str(MICROBATCHES), *args],
                            env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return load_file(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_code_cache):
    tmp = tmp_path_factory.mktemp("e2e")
    return tmp, {
        "dumped": train(tmp, shared_code_cache, "dumped", "megatron_cpu,dump"),
        "reference": train(tmp, shared_code_cache, "reference", "megatron_cpu", "--hooks"),
        "disabled": train(tmp, shared_code_cache, "disabled", "megatron_cpu,dump", SOURCE_PATCH_DUMP_ENABLE="0"),
    }


def expected_keys():
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            for name in LAYER_NAMES:
                for layer in range(1, LAYERS + 1):
                    yield name, step, mb, layer
            for name in MODEL_NAMES:
                yield name, step, mb, None


def test_every_name_layer_step_and_microbatch_is_dumped_with_its_tags(runs):
    tmp, _ = runs
    records = load(tmp / "dumps" / "dumped")
    got = sorted((r.name, r.step, r.microbatch, r.layer) for r in records)
    assert got == sorted(expected_keys(), key=lambda k: (k[0], k[1], k[2], k[3] or 0))
    for r in records:
        assert r.phase == "fwd_bwd" and r.rank == 0
        assert {"tp", "pp", "ep", "dp"} <= r.tags.keys()
        if r.name == "routing_map":  # the router's view: [s * b, experts]
            assert r.shape == (32 * 8, 8) and r.dtype == "bool"
            continue
        hidden = 128 if r.name == "logits" else 64  # vocab for logits
        assert r.shape == (32, 8, hidden) and r.dtype == "float32"


def test_dumped_values_equal_the_unpatched_reference(runs):
    tmp, out = runs
    reference = out["reference"]
    records = load(tmp / "dumps" / "dumped")
    for r in records:
        key = f"act/{r.name}/{r.step}/{r.microbatch}/{'-' if r.layer is None else r.layer}"
        assert torch.equal(r.tensor, reference[key]), key
    assert len(records) == sum(k.startswith("act/") for k in reference)


def test_dumping_does_not_change_training(runs):
    _, out = runs
    for key, value in out["reference"].items():
        if not key.startswith("act/"):
            assert torch.equal(out["dumped"][key], value), key


def test_disabled_at_run_time_is_bitwise_identical_and_writes_nothing(runs):
    tmp, out = runs
    train_keys = [k for k in out["reference"] if not k.startswith("act/")]
    assert any(k.startswith("grad/") for k in train_keys) and any(k.startswith("loss/") for k in train_keys)
    assert sorted(out["disabled"]) == sorted(train_keys)
    for key in train_keys:
        assert torch.equal(out["disabled"][key], out["reference"][key]), key
    assert not (tmp / "dumps" / "disabled").exists()


def test_an_unwritable_dump_directory_never_stops_training(tmp_path, shared_code_cache):
    """The example under megatron_cpu + dump, dumping into a path that cannot exist."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_DUMP")}
    environ.update(SOURCE_PATCH="megatron_cpu,dump", SOURCE_PATCH_CACHE=str(shared_code_cache),
                   SOURCE_PATCH_DUMP_DIR=str(blocker / "dumps"))
    example = Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
    result = subprocess.run([sys.executable, str(example), "--steps", "3"], env=environ,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step 3/3 loss" in result.stdout
    assert "no records were written" in result.stdout
    assert "write error(s)" in result.stdout and "Not a directory" in result.stdout
    assert "training continues" in result.stderr  # logged once, not per record
    assert result.stderr.count("training continues") == 1
