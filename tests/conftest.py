import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
sys.path.insert(0, str(FIXTURES))
# Child processes started by tests find the fixture package the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))


# Session fixtures that start a real SGLang server: the files that use one run on the same
# pytest-xdist worker, so it starts once (make test: -n 2 --dist loadgroup).
_SHARED_SERVERS = {"instrumented_sglang", "hf_qwen3"}
# Files whose module fixtures start sglang_server with equal arguments: one worker, one start.
_SAME_SERVER = {"test_hardening_weights.py": "sglang-weight-sync-server",
                "test_weight_sync_engine.py": "sglang-weight-sync-server"}


def pytest_collection_modifyitems(config, items):
    """Group tests by file for pytest-xdist (module fixtures are built once), and the
    files that share a session server into one group."""
    shared = {item.path for item in items if _SHARED_SERVERS & set(getattr(item, "fixturenames", ()))}
    for item in items:
        group = "sglang-session-servers" if item.path in shared else \
            _SAME_SERVER.get(item.path.name, item.path.name)
        item.add_marker(pytest.mark.xdist_group(group))


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
    build, whose import needs these operator schemas (see the shared notes, sglang.md)."""
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
    """A patched copy of sglang.srt.layers.moe.topk under the moe spec."""
    from source_patch.patcher import import_patched_copy

    return import_patched_copy("sglang.srt.layers.moe.topk", "routing",
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


@pytest.fixture
def dumper(tmp_path, monkeypatch):
    """The dump runtime (source_patch.runtime.dump.api), enabled, writing under
    tmp_path/dumps/t; clean before and after."""
    from source_patch.runtime.core import ranks
    from source_patch.runtime.dump import api as dump_api

    for key in list(os.environ):
        if key.startswith("SOURCE_PATCH_DUMP_"):
            monkeypatch.delenv(key)
    dump_api.close()
    dump_api.configure_from_settings({})
    dump_api.configure(enable=True, dir=str(tmp_path / "dumps"), exp_name="t")
    dump_api.reset()
    dump_api.dump_context(phase=None, microbatch=None)
    ranks.forget()
    yield dump_api
    dump_api.close()
    dump_api.configure_from_settings({})
    dump_api.reset()
    dump_api.dump_context(phase=None, microbatch=None)
    ranks.forget()


@pytest.fixture(scope="session")
def instrumented_sglang(sglang_cpu, sglang_server, tmp_path_factory):
    """One real SGLang HTTP server for the session with routing capture (the routing spec),
    inference dumps (dump, /dumper/* mounted on SGLang's server), live tracing
    (trace) and feature capture (features, into a shared-directory store) active in
    its scheduler, plus SGLang's own routed-experts capture for an independent check.
    Radix caching is off: every request's prompt is prefilled whole, so its routes
    and features cover every token."""
    from types import SimpleNamespace

    from source_patch.testing.sglang import free_port

    root = tmp_path_factory.mktemp("instrumented")
    trace_port, token = free_port(), "instrumented-test-token"
    env = {"SOURCE_PATCH_SGLANG_ROUTING_MODE": "capture", "SOURCE_PATCH_SGLANG_ROUTING_DIR": str(root / "routes"),
           "SOURCE_PATCH_DUMP_DIR": str(root / "dumps"), "SOURCE_PATCH_DUMP_EXP_NAME": "serve",
           "DUMPER_SERVER_PORT": "reuse", "SOURCE_PATCH_TRACE_PORT": str(trace_port),
           "SOURCE_PATCH_TRACE_TOKEN": token, "SOURCE_PATCH_TRACE_DIR": str(root / "trace"),
           "SOURCE_PATCH_FEATURES_ENABLE": "1", "SOURCE_PATCH_FEATURES_STORE": f"dir://{root / 'features'}",
           "SOURCE_PATCH_FEATURES_STREAM": str(root / "features.jsonl"),
           # Every request of the session is a sample; only one test consumes them.
           "SOURCE_PATCH_FEATURES_HIGH_WATERMARK": "1000000"}
    server = sglang_server(specs=["routing", "dump", "trace", "features"],
                           args=["--enable-return-routed-experts", "--disable-radix-cache", "--skip-server-warmup"],
                           env=env)
    return SimpleNamespace(server=server, routes=root / "routes", dumps=root / "dumps" / "serve",
                           features=root / "features", stream=root / "features.jsonl",
                           trace_url=f"http://127.0.0.1:{trace_port}/#token={token}")


@pytest.fixture(scope="session")
def hf_qwen3(sglang_cpu, sglang_checkpoint):
    """transformers' Qwen3MoeForCausalLM on the engine's checkpoint (fp32, eval): the
    independent reference for what the engine computes."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(sglang_checkpoint, torch_dtype=torch.float32).eval()
