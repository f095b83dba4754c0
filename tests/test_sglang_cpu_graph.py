"""SGLang's own graph path on CPU (issue 31, Show item 2): can ``CPUGraphRunner``
(``sglang/srt/model_executor/cpu_graph_runner.py``, torch.compile'd decode per batch
size) start on these machines, so that capture can be compared in graph mode against
an eager engine?  Not with sglang 0.5.23 as installed here; this test checks each
reason on the real modules, so it fails (and the comparison must be written) the day
one of them stops holding:

1. ``capture_cuda_graphs`` builds a decode graph runner only when the resolved platform
   has ``capabilities.graph_capture``.  Without ``SGLANG_USE_CPU_ENGINE=1`` (which the CPU
   recipe must leave unset: it routes layers to sgl_kernel's CPU ops) the platform is the
   base ``SRTPlatform``, whose ``graph_capture`` is False: no CPU graph, whatever
   ``enable_torch_compile`` says.  (This is the "further condition" an earlier probe
   with the torch-native rule lifted did not find.)
2. With ``SGLANG_USE_CPU_ENGINE=1`` the platform is ``CpuSRTPlatform`` (``graph_capture``
   True), but ``CPUGraphRunner.__init__`` calls the attention backend's
   ``init_cpu_graph_state``, which only the ``intel_amx`` backend has among the ones a
   Qwen3-MoE can use; the torch-native backend lacks it, and SGLang also turns graphs off
   for it at start ("Cuda graph is disabled because of using torch native attention
   backend").
3. ``intel_amx`` imports ``sgl_kernel`` (its CPU build), which is not installed here.
"""

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)


def test_why_the_cpu_graph_runner_cannot_start_here(sglang_cpu, monkeypatch):
    from sglang.srt import platforms
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor import cpu_graph_runner
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup

    # 1. the decode graph is captured only on a platform with graph_capture
    source = inspect.getsource(cuda_graph_setup.capture_cuda_graphs)
    assert "if current_platform.capabilities.graph_capture:" in source
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    recipe = platforms._resolve_platform()
    assert type(recipe) is platforms.SRTPlatform and recipe.capabilities.graph_capture is False
    # 2. the CPU platform has it, but the runner needs init_cpu_graph_state of the backend
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    cpu = platforms._resolve_platform()
    assert type(cpu).__name__ == "CpuSRTPlatform" and cpu.capabilities.graph_capture is True
    assert "attn_backend.init_cpu_graph_state(" in inspect.getsource(cpu_graph_runner.CPUGraphRunner.__init__)
    assert not hasattr(TorchNativeAttnBackend, "init_cpu_graph_state")
    assert hasattr(IntelAMXAttnBackend, "init_cpu_graph_state")
    # 3. the backend that has it needs sgl_kernel's CPU ops
    assert "import sgl_kernel" in inspect.getsource(IntelAMXAttnBackend.__init__)
    assert importlib.util.find_spec("sgl_kernel") is None
