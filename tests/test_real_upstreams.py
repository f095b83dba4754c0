"""The patcher against the real upstreams: megatron-core 0.16.1 runs patched on CPU,
sglang 0.5.23 is checked without being imported."""

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from source_patch.patcher import cli  # noqa: E402
from source_patch.runtime import capture  # noqa: E402

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


@pytest.fixture(scope="module")
def moe_utils_patched(tmp_path_factory):
    from source_patch.patcher import import_patched_copy

    return import_patched_copy(MOE_UTILS, "megatron_topk", cache_dir=tmp_path_factory.mktemp("c"))


@pytest.mark.parametrize("score_function,pre_softmax", [("softmax", False), ("softmax", True),
                                                         ("sigmoid", False)])
def test_megatron_topk_is_captured(moe_utils_patched, score_function, pre_softmax):
    torch.manual_seed(0)
    logits = torch.randn(16, 8)
    with capture("megatron.topk") as events:
        probs, routing_map = moe_utils_patched.topk_routing_with_score_function(
            logits, 2, use_pre_softmax=pre_softmax, score_function=score_function)
    (event,) = events
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    expected = torch.topk(scores, 2, dim=1).indices
    assert torch.equal(event.value, expected)
    assert event.tags == {"score_function": score_function, "topk": 2}
    # The routing itself is unchanged: the map marks exactly the captured experts.
    assert torch.equal(routing_map.nonzero()[:, 1].view(16, 2).sort(1).values,
                       expected.sort(1).values)


def test_patched_copy_leaves_the_imported_module_alone(moe_utils_patched):
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils is not moe_utils_patched
    assert not hasattr(moe_utils, "__source_patches__")
    assert moe_utils_patched.__source_patches__[0].patch == "topk-indices"
    with capture("megatron.topk") as events:
        moe_utils.topk_routing_with_score_function(torch.randn(4, 8), 2)
    assert events == []


def test_megatron_traceback_points_at_the_real_line(moe_utils_patched):
    import traceback

    with pytest.raises(ValueError) as info:
        moe_utils_patched.topk_routing_with_score_function(torch.randn(4, 8), 2,
                                                           score_function="bogus")
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename.endswith("megatron/core/transformer/moe/moe_utils.py")
    with open(frame.filename) as f:
        assert f.readlines()[frame.lineno - 1].strip() == frame.line
    assert frame.line == 'raise ValueError(f"Invalid score_function: {score_function}")'


def test_sglang_spec_checks_without_importing_sglang(check_sglang_spec):
    if importlib.util.find_spec("sglang") is None:  # locates, never imports
        pytest.skip("sglang is not installed")
    out = check_sglang_spec("sglang_topk")
    assert "ok   sglang.srt.layers.moe.topk" in out and "sglang 0.5.23" in out


def test_check_against_another_version_reports_the_drift(tmp_path, capsys):
    """--against DIR: an 'upstream release' where compute_topk was renamed."""
    from source_patch.patcher.locate import find_source

    source = find_source(MOE_UTILS).read_text()
    moe_dir = tmp_path / "megatron" / "core" / "transformer" / "moe"
    moe_dir.mkdir(parents=True)
    for d in (tmp_path / "megatron", *moe_dir.parents[:3][::-1], moe_dir):
        (d / "__init__.py").touch()
    (moe_dir / "moe_utils.py").write_text(source.replace("compute_topk(", "select_topk("))
    # Without a dist-info the patches' requires do not hold there: skipped, as the import would
    assert cli.main(["check", "megatron_topk", "--against", str(tmp_path)]) == 3
    assert "requires megatron-core>=0.14, which is not installed" in capsys.readouterr().out
    info = tmp_path / "megatron_core-0.99.0.dist-info"  # an unpacked wheel has one
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.99.0\n")
    (info / "top_level.txt").write_text("megatron\n")
    assert cli.main(["check", "megatron_topk", "--against", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL cannot patch module megatron.core.transformer.moe.moe_utils" in out
    assert str(moe_dir / "moe_utils.py") in out
    assert "patch 'topk-indices'" in out and "expected 4 matches, found 0" in out
    assert "nearest candidates:" in out and "top_indices = select_topk(" in out
    assert "megatron-core 0.99.0 (under" in out  # the version of the release checked, from its dist-info


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_megatron_topk_captured_on_gpu_without_a_sync(moe_utils_patched):
    """On the device the emitted indices are the live CUDA tensor: no copy, no sync."""
    logits = torch.randn(4096, 64, device="cuda")
    with capture("megatron.topk") as events:
        _, routing_map = moe_utils_patched.topk_routing_with_score_function(logits, 8)
    (event,) = events
    assert event.value.is_cuda
    assert torch.equal(event.value, torch.topk(torch.softmax(logits, -1), 8, dim=1).indices)
    assert int(routing_map.sum()) == 4096 * 8
