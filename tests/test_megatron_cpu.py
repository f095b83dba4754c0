"""The bundled megatron_cpu spec: Megatron-Core 0.16.1 trains a GPT-MoE on CPU with it,
and every one of its edits is needed.

Children run the venv's interpreter (whose site-packages holds the start hook) with
SOURCE_PATCH set or unset, GPUs hidden and one intra-op thread (steadier on a busy
2-core machine). They share one code cache, so libcst parses each module once.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from source_patch.patcher import cli
from source_patch.patcher.requires import unmet
from source_patch.patcher import spec as spec_mod

try:
    importlib.metadata.version("megatron-core")  # no import: children import it patched
except importlib.metadata.PackageNotFoundError:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_moe.py"
TIMEOUT = 120
CUDA_ERROR = "AssertionError: Torch not compiled with CUDA enabled"
# The same failure from a CUDA build of torch with the GPUs hidden (CUDA_VISIBLE_DEVICES=).
CUDA_HIDDEN_ERROR = "RuntimeError: No CUDA GPUs are available"


@pytest.fixture(scope="module")
def shared_cache(shared_code_cache):
    return shared_code_cache  # tests/conftest.py


def run(args, *, spec: str | None, cache: Path, timeout: int = TIMEOUT, **environ):
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_PATCH"}
    if spec:
        env["SOURCE_PATCH"] = spec
    env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "SOURCE_PATCH_CACHE": str(cache),
                "PYTHONWARNINGS": "ignore", **environ})
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def step_losses(stdout: str, steps: int) -> list[float]:
    found = re.findall(rf"^step (\d+)/{steps} loss (\S+) ", stdout, re.MULTILINE)
    assert [int(n) for n, _ in found] == list(range(1, steps + 1)), stdout
    return [float(x) for _, x in found]


# --------------------------------------------------------------------------- the spec


def test_every_anchor_matches_the_installed_megatron(capsys):
    assert cli.main(["check", "megatron_cpu"]) == 0
    out = capsys.readouterr().out
    assert "requirements met" in out
    spec = spec_mod.load("megatron_cpu")
    for module in spec.modules:
        assert f"ok   {module} " in out
    version = importlib.metadata.version("megatron-core")
    for patch in spec.patches:
        if unmet(patch.requires):  # an alternative for another release: gated, with the reason
            assert f"gated {patch.id} ({patch.module}): requires " in out and f"found {version}" in out
        else:
            assert f"       {patch.id}: " in out


# --------------------------------------------------------------------------- the example


@pytest.mark.slow
def test_example_trains_a_gpt_moe_on_cpu(shared_cache):
    proc = run([str(EXAMPLE), "--steps", "4"], spec="megatron_cpu", cache=shared_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"GPT-MoE: 4 layers, .* 8 experts top-2, .* on cpu \(world 1", proc.stdout)
    losses = step_losses(proc.stdout, 4)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses  # the ramp task is learnt quickly
    assert "done: 4 steps" in proc.stdout


@pytest.mark.slow
def test_the_moe_spec_path_captures_routes_without_a_deprecation_warning(shared_cache, tmp_path):
    """The mission's usage line: `SOURCE_PATCH=patches/moe.yaml` (with megatron_cpu on CPU)."""
    routes = tmp_path / "routes"
    proc = run([str(EXAMPLE), "--steps", "2"], spec="patches/moe.yaml,megatron_cpu", cache=shared_cache,
               SOURCE_PATCH_ROUTING_MODE="capture", SOURCE_PATCH_ROUTING_DIR=str(routes),
               PYTHONWARNINGS="always::DeprecationWarning")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout
    assert "source-patch:" not in proc.stderr, proc.stderr[-3000:]  # no renamed-name warning
    index = json.loads((routes / "rank-0" / "index.json").read_text())
    assert sorted(p.name for p in (routes / "rank-0").glob("*.safetensors")) == \
        ["step-0-mb-0.safetensors", "step-1-mb-0.safetensors"], index


def test_example_refuses_to_run_on_cpu_without_the_spec(shared_cache):
    proc = run([str(EXAMPLE), "--steps", "1"], spec=None, cache=shared_cache)
    assert proc.returncode == 1
    assert "needs the 'megatron_cpu' source patch" in proc.stderr
    assert "SOURCE_PATCH=megatron_cpu" in proc.stderr
    assert "step 1" not in proc.stdout


@pytest.mark.slow
def test_example_trains_expert_parallel_over_gloo(shared_cache):
    """Two ranks, one expert-parallel group: the allgather dispatcher's collectives."""
    proc = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(EXAMPLE), "--steps", "2", "--ep", "2"],
               spec="megatron_cpu", cache=shared_cache, timeout=2 * TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "(world 2, ep 2)" in proc.stdout
    assert all(math.isfinite(x) for x in step_losses(proc.stdout, 2))


# --------------------------------------------------------------------------- each edit

# One probe per blocker: the smallest call into Megatron-Core that reaches it. Run
# unpatched, each must fail the way upstream does on CPU; patched, each must pass.
PROBES = textwrap.dedent('''
    import json, warnings
    warnings.simplefilter("ignore")
    import torch
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    parallel_state.initialize_model_parallel()
    CONFIG = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                  moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True)

    def router_gemm_without_te():
        from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction
        inp, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
        RouterGatingLinearFunction.apply(inp, w, None, torch.float32).sum().backward()

    def ddp_grad_buffer_device():
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        DistributedDataParallel(TransformerConfig(**CONFIG), DistributedDataParallelConfig(),
                                torch.nn.Linear(4, 4))

    def fp32_optimizer_scale():
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import FP32Optimizer
        params = [torch.nn.Parameter(torch.ones(2))]
        FP32Optimizer(torch.optim.SGD(params, lr=0.1), OptimizerConfig(lr=0.1), None)

    def schedule_token_count():
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import get_forward_backward_func
        model = torch.nn.Linear(4, 4)
        model.config, model.model_type = TransformerConfig(**CONFIG), ModelType.encoder_or_decoder
        model.set_input_tensor = lambda tensor: None
        def step(batches, m):
            return m(next(batches)), lambda out: (out.sum(), {"loss": out.sum()})
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([torch.ones(2, 4)]), model=[model],
            num_microbatches=1, seq_length=2, micro_batch_size=1, forward_only=True)

    def rope_inv_freq_device():
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True).get_emb(4)

    def global_memory_buffer_device():
        from megatron.core.utils import GlobalMemoryBuffer
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")

    def default_causal_mask_device():
        from megatron.core.transformer.utils import get_default_causal_mask
        get_default_causal_mask(4)

    def rng_tracker_fork_without_cuda():
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
        with CudaRNGStatesTracker().fork():
            torch.rand(1)

    def router_weight_device():
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.router import TopKRouter
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        TopKRouter(TransformerConfig(**CONFIG), pgs).gating(torch.randn(4, 8))

    def grad_norm_device():
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        get_grad_norm_fp32([torch.ones(3)],
                           grad_stats_parallel_group=parallel_state.get_model_parallel_group())

    def local_l2_norm_device():
        from megatron.core.utils import local_multi_tensor_l2_norm
        local_multi_tensor_l2_norm(2048, None, [[torch.ones(3)]], False)

    def clip_grads_device():
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=10.0)

    results = {}
    for name, probe in list(globals().items()):
        if callable(probe) and getattr(probe, "__module__", "") == "__main__":
            try:
                probe()
                results[name] = "ok"
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))
''')

# probe -> (the patch ids it covers, how upstream fails without them)
EXPECTED = {
    "router_gemm_without_te": (
        ["router-gemm-without-te"],
        "NameError: name 'te_general_gemm' is not defined"),
    "ddp_grad_buffer_device": (["ddp-grad-buffer-device"], CUDA_ERROR),
    "fp32_optimizer_scale": (["fp32-optimizer-scale"], CUDA_ERROR),
    "schedule_token_count": (["schedule-token-count"], CUDA_ERROR),
    "rope_inv_freq_device": (["rope-inv-freq-device"], CUDA_ERROR),
    "global_memory_buffer_device": (["global-memory-buffer-device"], CUDA_ERROR),
    "default_causal_mask_device": (["default-causal-mask-device"], CUDA_ERROR),
    "rng_tracker_fork_without_cuda": (
        ["rng-tracker-fork-without-cuda"],
        "Exception: cuda rng state model-parallel-rng is not added"),
    "router_weight_device": (["router-weight-device"], CUDA_ERROR),
    "grad_norm_device": (["grad-norm-device", "grad-norm-zero-device"], CUDA_ERROR),
    "local_l2_norm_device": (["local-l2-norm-device"], CUDA_ERROR),
    "clip_grads_device": (["clip-grads-device"], "AssertionError: "),  # assert grad is CUDA
}
# Collectives are skipped in a world of one: the expert-parallel example covers these.
COVERED_BY_EXPERT_PARALLEL = {"gather-first-dim-device", "reduce-scatter-first-dim-device"}


def run_probes(spec: str | None, cache: Path) -> dict[str, str]:
    proc = run(["-c", PROBES], spec=spec, cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unpatched(shared_cache):
    return run_probes(None, shared_cache)


@pytest.fixture(scope="module")
def patched(shared_cache):
    return run_probes("megatron_cpu", shared_cache)


def test_every_patch_has_a_probe():
    """Every patch for the installed release has a probe (patches for other releases are
    checked by bench/gpu_session.sh's `newest` part, which trains on CPU with 0.19.2)."""
    patches = spec_mod.load("megatron_cpu").patches
    ids = {p.id for p in patches if not unmet(p.requires)}
    probed = {pid for pids, _ in EXPECTED.values() for pid in pids}
    assert probed | COVERED_BY_EXPERT_PARALLEL == ids


@pytest.mark.parametrize("probe", sorted(EXPECTED))
def test_upstream_fails_on_cpu_without_the_edit(unpatched, probe):
    expected = EXPECTED[probe][1]
    if expected == CUDA_ERROR and torch.version.cuda:
        expected = CUDA_HIDDEN_ERROR
    assert unpatched[probe] == expected


@pytest.mark.parametrize("probe", sorted(EXPECTED))
def test_the_edit_fixes_it(patched, probe):
    assert patched[probe] == "ok"
