"""The ``source_patch_import`` fixture on SGLang code on a CPU-only machine (issue 56,
item 4): with ``sglang_cpu`` among its specs it activates that spec before SGLang's
package is imported, so a patched copy of ``sglang.srt.layers.moe.topk`` runs for real;
without it, or where SGLang was imported first, the test fails in one line that says
what to do.  Each case runs in a pytest subprocess (pytester): importing SGLang and
activating ``sglang_cpu`` must not leak into this session."""

import importlib.util

import pytest

pytest_plugins = ["pytester"]

if importlib.util.find_spec("sglang") is None:  # locates, never imports (its import needs sglang_cpu)
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow  # each case imports SGLang in a new process (~7 s)

TOPK = "sglang.srt.layers.moe.topk"
SPEC = """
source_patch: 1
name: mine
patches:
  - id: topk-ids
    module: sglang.srt.layers.moe.topk
    target: select_experts
    edits:
      - at: before
        match: "topk_ids, topk_weights, recorder_topk_ids = _post_process_topk_ids(...)"
        code: __sp__.emit("mine.topk_ids", topk_ids, layer=layer_id)
"""

TEST = f"""
import sys

import torch

from source_patch.runtime import capture


def test_select_experts(source_patch_import):
    topk = source_patch_import({TOPK!r}, "sglang_cpu", "mine.yaml")
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    config = topk.TopKConfig(top_k=2, renormalize=True, torch_native=True)
    with capture("mine.topk_ids") as events:
        out = topk.select_experts(hidden_states=torch.zeros(5, 16), router_logits=logits,
                                  topk_config=config, layer_id=3)
    (event,) = events                                   # the inserted call site ran, once
    assert event.tags == {{"layer": 3}}
    assert torch.equal(event.value, out.topk_ids)
    assert torch.equal(out.topk_ids.sort(dim=1).values, logits.topk(2, dim=1).indices.sort(dim=1).values)
    assert [a.patch for a in topk.__source_patches__] == ["topk-ids"]
    assert not hasattr(sys.modules.get({TOPK!r}), "__source_patches__")   # sys.modules' own untouched
    assert "torchvision-schemas" in [a.patch for a in sys.modules["sglang"].__source_patches__]
    again = source_patch_import({TOPK!r}, "sglang_cpu", "mine.yaml")  # sglang_cpu active: no-op
    assert again is not topk and [a.patch for a in again.__source_patches__] == ["topk-ids"]
"""


def _run(pytester, test: str, *args):
    pytester.makefile(".yaml", mine=SPEC)
    pytester.makepyfile(test_it=test)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_the_fixture_runs_a_patched_sglang_function_on_cpu(pytester):
    _run(pytester, TEST).assert_outcomes(passed=1)


def test_the_fixture_with_sglang_cpu_active_for_the_session_too(pytester):
    _run(pytester, TEST, "--source-patch", "sglang_cpu").assert_outcomes(passed=1)


def test_without_sglang_cpu_one_line_says_what_to_do(pytester):
    result = _run(pytester, f"""
def test_it(source_patch_import):
    source_patch_import({TOPK!r}, "mine.yaml")
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"source_patch_import('{TOPK}'): importing SGLang failed "
                                 "(operator torchvision::nms does not exist): on a CPU-only torch add the "
                                 "bundled spec 'sglang_cpu' to the specs*--source-patch sglang_cpu"])
    assert "Traceback" not in result.stdout.str()


def test_sglang_imported_first_one_line_says_what_to_do(pytester):
    result = _run(pytester, f"""
import torch
for op in ("nms", "qnms"):
    torch.library.define(f"torchvision::{{op}}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import sglang  # imported unpatched, before the fixture could apply sglang_cpu


def test_it(source_patch_import):
    source_patch_import({TOPK!r}, "sglang_cpu", "mine.yaml")
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"source_patch_import('{TOPK}'): sglang was imported before spec 'sglang_cpu' "
                                 "could patch it: run pytest with --source-patch sglang_cpu (it applies before any import)"])
