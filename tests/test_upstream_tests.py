"""Megatron-Core's and SGLang's own unit tests behave the same under every source-patch
configuration (issue 30): bench/upstream_tests.py --cpu runs them plain and under each
configuration, on CPU with megatron_cpu (sglang_cpu) everywhere, and finds no outcome that
differs from plain (in CI: plain, inert, every capability at once, and replay).

The upstream test files live outside this repository: $SOURCE_PATCH_UPSTREAM_TESTS, else
../shared/upstream next to the checkout (Megatron-LM's tests at the installed release's
tag); $SOURCE_PATCH_UPSTREAM_SGLANG_TESTS, else ../upstream-sglang (SGLang's). Where neither
holds them the test is skipped, and says so.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import upstream_tests  # noqa: E402  (bench/upstream_tests.py)

# On CPU: RouterReplay's 6 tests, MoE-layer init / interleaved block / fp16 forward-backward
# (7), the router's constructor and the sequential MLP's (15 on megatron-core 0.16.1).
MIN_REACHED = 12
# SGLang 0.5.23 on CPU: the native MoE forward and the runner's MTP weight filter (2 of
# SGLang's tests), and the focused runs of select_experts and the weight updaters (9).
MIN_REACHED_SGLANG, MIN_REACHED_SGLANG_UPSTREAM = 10, 2
# Plain, every spec inert, every capability on at once, and replay of that run's capture:
# what CI's time allows (each configuration is a pytest process of upstream's files); the
# harness's default runs each capability alone too (bench/gpu_session.sh upstream).
CI_CONFIGS = ("inert", "all", "replay")


def test_upstream_megatron_tests_have_the_same_outcomes_under_every_configuration(tmp_path):
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed")
    folder = upstream_tests.find_tests(None)
    if folder is None:
        where = os.environ.get(upstream_tests.ENV_TESTS) or str(ROOT.parent / "shared" / "upstream")
        pytest.skip(f"no upstream Megatron-LM tests for megatron-core {version} under {where} "
                    f"(set {upstream_tests.ENV_TESTS} to a folder of them)")
    proc, result = run_harness(tmp_path, folder, timeout=900)
    assert result["reached"] >= MIN_REACHED, proc.stdout[-6000:]
    assert proc.returncode == 0, proc.stdout[-4000:]


def run_harness(tmp_path, folder, *options, timeout):
    """The harness's CPU run over ``folder``: (process, its JSON summary), after checking what
    every run must show: no outcome differs from plain, every configuration ran to its end."""
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "upstream_tests.py"), *options, "--cpu",
                           "--configs", *CI_CONFIGS,
                           "--tests", str(folder), "--work", str(tmp_path / "work"), "--json", str(summary),
                           "--timeout", "300"], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert summary.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["differences"] == [], proc.stdout[-6000:]
    assert all(s.startswith("exit") for s in result["status"].values()), result["status"]
    return proc, result


def test_upstream_sglang_tests_have_the_same_outcomes_under_every_configuration(tmp_path):
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed")
    folder = upstream_tests.find_tests(None, "sglang")
    if folder is None:
        where = os.environ.get(upstream_tests.ENV_SGLANG_TESTS) or str(ROOT.parent / "upstream-sglang")
        pytest.skip(f"no upstream SGLang tests for sglang {version} under {where} "
                    f"(set {upstream_tests.ENV_SGLANG_TESTS} to a folder of them)")
    proc, result = run_harness(tmp_path, folder, "--framework", "sglang", timeout=1200)
    assert result["reached"] >= MIN_REACHED_SGLANG, proc.stdout[-6000:]
    assert result["reached_upstream"] >= MIN_REACHED_SGLANG_UPSTREAM, proc.stdout[-6000:]
    assert result["adaptations_alike"], proc.stdout[-4000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
