"""The pytest plugin of bench/upstream_tests.py: what the harness adapts in upstream's test
environment for this machine, before upstream's conftest imports (``-p upstream_adapt``,
this folder on PYTHONPATH).  Each adaptation applies in every configuration alike; the
plugin writes the keys of those it applied to $SP_UPSTREAM_APPLIED, and the harness's
report lists them (and checks they are alike)."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ADAPTATIONS = {
    "dataset": "tests.test_utils.python_scripts.download_unit_tests_dataset is a stub: the conftest's session "
               "fixture would download test data to /opt/data (no selected test reads it; no network here)",
    "te": "megatron.core.utils.is_te_min_version returns False (transformer_engine is not installed: upstream's "
          "raises TypeError, and the conftest's autouse fixture calls it)",
    "fa": "megatron.core.utils.is_fa_min_version returns False (flash_attn is not installed: upstream's raises)",
    "gemm": "megatron.core.transformer.moe.moe_utils.te_general_gemm = None (unbound without Transformer Engine "
            "before megatron-core 0.17)",
    "six": "six is a stub with PY2/PY3 (not installed; megatron.training's BERT tokenizer imports it, and the "
           "conftest imports megatron.training through tests.unit_tests.dist_checkpointing)",
    "gc": "Python's cyclic garbage collector runs only at the end of each test file (gc.disable(), then "
          "gc.collect()): upstream's MoEModelTestContainer.__del__ destroys the model-parallel state, and left "
          "to the collector it ran wherever a collection happened to fall (how many objects the process had "
          "allocated), failing or passing later tests at random (0.19's static inference engine)",
    "port": "MASTER_PORT is a free port per pytest process (upstream's Utils rendezvous at localhost:6000; "
            "configurations may run at once, --jobs)",
    "cpu-spec": "SOURCE_PATCH holds megatron_cpu in every configuration, plain included; CUDA_VISIBLE_DEVICES=''",
    "cpu-gloo": "tests.unit_tests.test_utilities.Utils.initialize_distributed starts a gloo world of one "
                "(HashStore) instead of NCCL over TCP after torch.cuda.set_device",
    "cpu-cuda": "torch.Tensor.cuda and torch.nn.Module.cuda return the object itself and "
                "torch.cuda.current_device() is 'cpu' (tests move models and inputs with .cuda(), layers "
                "allocate on the current device; tests marked for CUDA are still skipped)",
    "cpu-seed": "tensor_parallel.model_parallel_cuda_manual_seed(seed) seeds the CPU generator and leaves the "
                "CUDA RNG tracker empty (megatron_cpu's fork() then runs on the CPU generator)",
    "datasets": "datasets is a stub whose load_dataset raises (not installed; sglang.test.test_utils imports "
                "sglang.benchmark, which imports it; no selected test loads a dataset)",
    "sglang-cpu": "SOURCE_PATCH holds sglang_cpu in every configuration, plain included (import sglang needs it "
                  "on a CPU-only torch); CUDA_VISIBLE_DEVICES is left unset (sglang.test.test_utils indexes its "
                  "first character; this machine has no GPU)",
    "sglang-path": "the interpreter's folder leads PATH (SGLang's popen_launch_server starts `sglang serve`)",
}


def pytest_load_initial_conftests(early_config, parser, args):
    """Adapt upstream's test environment to this machine before its conftest imports (the
    harness passes -p upstream_adapt)."""
    if os.environ.get("SP_UPSTREAM_FRAMEWORK") == "sglang":
        applied = ["sglang-path"] + _stub_datasets()
        applied += ["sglang-cpu"] if os.environ.get("SP_UPSTREAM_CPU") == "1" else []
    else:
        applied = ["dataset", "gc", "port"]
        _stub_dataset_download()
        applied += _stub_six() + _no_te_no_fa() + _bind_te_general_gemm()
        if os.environ.get("SP_UPSTREAM_CPU") == "1":
            applied += ["cpu-spec"] + _cpu(early_config)
        gc.disable()  # collected at each file's end (pytest_runtest_teardown): the same points in every run
    if os.environ.get("SP_UPSTREAM_APPLIED"):
        Path(os.environ["SP_UPSTREAM_APPLIED"]).write_text("\n".join(applied))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if not gc.isenabled() and (nextitem is None or nextitem.module is not item.module):
        gc.collect()


def _stub_dataset_download():
    import types

    name = "tests.test_utils.python_scripts.download_unit_tests_dataset"
    stub = types.ModuleType(name)

    def download_and_extract_asset(*args, **kwargs):
        raise RuntimeError("test data download disabled by bench/upstream_tests.py (no network)")

    stub.download_and_extract_asset = download_and_extract_asset
    sys.modules[name] = stub


def _stub_six() -> list:
    import types

    if importlib.util.find_spec("six") is not None:
        return []
    six = sys.modules["six"] = types.ModuleType("six")
    six.PY2, six.PY3 = False, True
    return ["six"]


def _stub_datasets() -> list:
    import types

    if importlib.util.find_spec("datasets") is not None:
        return []

    def load_dataset(*args, **kwargs):
        raise RuntimeError("datasets is a stub of bench/upstream_tests.py (not installed)")

    sys.modules["datasets"] = types.ModuleType("datasets")
    sys.modules["datasets"].load_dataset = load_dataset
    return ["datasets"]


def _no_te_no_fa() -> list:
    from megatron.core import utils

    applied = []
    if importlib.util.find_spec("transformer_engine") is None:
        utils.is_te_min_version = lambda *args, **kwargs: False
        applied.append("te")
    if importlib.util.find_spec("flash_attn") is None:
        utils.is_fa_min_version = lambda *args, **kwargs: False
        applied.append("fa")
    return applied


def _bind_te_general_gemm() -> list:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    moe_utils.te_general_gemm = None
    return ["gemm"]


def _cpu(config) -> list:
    import torch

    sys.path.insert(0, str(config.rootpath))  # where pytest's rootdir import finds `tests` too
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                                 world_size=1)
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    _cpu_seed()
    return ["cpu-gloo", "cpu-cuda", "cpu-seed"]


def _cpu_seed():
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    def model_parallel_cuda_manual_seed(seed, *args, **kwargs):
        torch.manual_seed(seed)
        random.get_cuda_rng_tracker().reset()

    random.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
