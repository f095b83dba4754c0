import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
sys.path.insert(0, str(FIXTURES))
# Child processes started by tests find the fixture package the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own code cache, so no test sees another's patched code."""
    monkeypatch.setenv("SOURCE_PATCH_CACHE", str(tmp_path / "spcache"))
    monkeypatch.delenv("SOURCE_PATCH", raising=False)


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(text) -> path of a spec file holding that YAML."""
    counter = iter(range(1000))

    def write(text: str, name: str | None = None) -> Path:
        path = tmp_path / (name or f"spec{next(counter)}.yaml")
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def sglang_cpu():
    """Let sglang import on a CPU torch: the only torchvision on the index is a CUDA
    build, whose import needs these operator schemas (see /work/shared/sglang.md)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    import torch

    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}",
                                 "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined


@pytest.fixture(scope="module")
def sglang_topk(sglang_cpu, tmp_path_factory):
    """A patched copy of sglang.srt.layers.moe.topk under the moe_sglang spec."""
    from source_patch.patcher import import_patched_copy

    return import_patched_copy("sglang.srt.layers.moe.topk", "moe_sglang",
                               cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def check_sglang_spec(capsys):
    """check_sglang_spec(spec) -> the output of `source-patch check spec`, asserting it
    passed and imported no sglang module (a dry run locates modules, never imports them)."""
    from source_patch.patcher import cli

    def check(spec: str) -> str:
        before = {m for m in sys.modules if m.split(".")[0] == "sglang"}
        assert cli.main(["check", spec]) == 0
        out = capsys.readouterr().out
        assert {m for m in sys.modules if m.split(".")[0] == "sglang"} == before
        return out

    return check
