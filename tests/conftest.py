import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
sys.path.insert(0, str(FIXTURES))
# Child processes started by tests find the fixture package the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))
# As the session began (_isolated_cache sets one a test): see shared_code_cache.
from source_patch.patcher.boot import cache_dir  # noqa: E402  (light: the start hook's module)

_SESSION_CODE_CACHE = Path(cache_dir())


# Session fixtures that start a real SGLang server: the files that use one run on the same
# pytest-xdist worker, so it starts once (make test: -n 2 --dist loadgroup).
_SHARED_SERVERS = {"instrumented_sglang", "hf_qwen3"}
# Files whose module fixtures start sglang_server with equal arguments: one worker, one start.
_SAME_SERVER = {"test_hardening_weights.py": "sglang-weight-sync-server",
                "test_weight_sync_backends.py": "sglang-weight-sync-server",
                "test_weight_sync_engine.py": "sglang-weight-sync-server"}
# Work units (groups, or files of single tests) that take a minute or more on CI's 2 cores,
# longest first: a worker takes the next unit when it runs out, so these start first and
# the short ones fill in at the end (a long unit handed out last leaves the other worker
# idle). Units not named here keep their order, after these.
# The two upstream runs wait for seconds at a time (pushes to no engine time out, say): they
# run apart, each beside busy units.
_LONGEST_FIRST = ("sglang-session-servers", "test_weight_sync.py", "test_upstream_tests.py::sglang",
                  "sglang-weight-sync-server", "test_ray_example.py", "test_rl_loop.py",
                  "test_routing_prefix_cache.py", "test_upstream_tests.py::megatron",
                  "test_replay_cli.py", "test_verdict_e2e.py", "test_replay_radix.py", "test_verdict_runs.py",
                  "test_batch_rows.py", "test_features_e2e.py", "test_dump_e2e.py", "test_megatron_cpu.py",
                  "test_engine_regions.py", "test_overhead_bench.py", "test_weight_sync_request_backends.py",
                  "test_trace_e2e.py", "test_trace_view.py", "test_trace_benches.py")


_UNIT_OF: dict = {}  # under loadgroup: node id -> its work unit (group, else its own id)
_ENGINE_FACTORIES: list = []  # this worker's sglang_server and sglang_engine
_CLOSING: list = []  # threads closing the engines of units that are done


def _group(item, shared) -> str | None:
    """The xdist group of a test: its file's when a module (or class) fixture of the file would
    otherwise be built on both workers, else None (the test is a unit of its own)."""
    if item.path in shared:
        return "sglang-session-servers"
    if item.path.name in _SAME_SERVER:
        return _SAME_SERVER[item.path.name]
    if item.path.name == "test_upstream_tests.py":  # two long harness runs: one on each worker
        return "test_upstream_tests.py::" + ("sglang" if "sglang" in item.name else "megatron")
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # pytest without it: group by file, as a module fixture needs
        return item.path.name
    scopes = {d.scope for defs in info.name2fixturedefs.values() for d in defs}
    return item.path.name if scopes & {"module", "class", "package"} else None


def _loadgroup(config) -> bool:
    """Under pytest-xdist --dist loadgroup (the controller's option; its workers' flag)."""
    return config.getoption("dist", "no") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def pytest_configure(config):
    if _loadgroup(config):
        config.option.loadscopereorder = False  # the controller's scheduler: keep _LONGEST_FIRST's order


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist --dist loadgroup: tests that share a module fixture, or a session
    SGLang server, form one group (one worker, one start); the longest groups come first."""
    shared = {item.path for item in items if _SHARED_SERVERS & set(getattr(item, "fixturenames", ()))}
    groups = {item: _group(item, shared) for item in items}
    for item, group in groups.items():
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    if _loadgroup(config):
        for item in items:
            group = groups.get(item)
            if group and "@" not in item.nodeid.rpartition("]")[2]:
                # xdist names the group in the node id by setting item._nodeid, which pytest
                # 9.2 no longer reads: without this every test would be a unit of its own.
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{group}")
        _UNIT_OF.update((item.nodeid, groups[item] or item.nodeid) for item in items)
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        order = {item: i for i, item in enumerate(items)}
        items.sort(key=lambda item: (rank.get(groups[item], rank.get(item.path.name, len(rank))),
                                     groups[item] is None, order[item]))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Under loadgroup a unit's tests run one after another on one worker, and the SGLang
    engines a unit starts serve only it: after its last test they are closed (idle, one
    still takes ~2% of a core; a worker would keep ten of them to the end)."""
    result = yield
    unit = _UNIT_OF.get(item.nodeid)
    if unit is not None and (nextitem is None or _UNIT_OF.get(nextitem.nodeid) != unit):
        for factory in _ENGINE_FACTORIES:  # SGLang takes seconds to shut down: the next unit need not wait
            _CLOSING.append(factory.close_all(background=True))
    return result


def pytest_sessionfinish(session):
    for thread in _CLOSING:
        thread.join()


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
def shared_code_cache():
    """The code cache (SOURCE_PATCH_CACHE) the session began with, else the default one: what
    the processes of session and module fixtures use already (they start before a test's own
    cache is set). The SGLang engines and the end-to-end tests whose subject is not the cache
    use it too: each test's own cache is empty, so every process it starts compiles its
    patched modules anew (5-25 s a test on 2 cores). The cache's own tests keep their own."""
    return _SESSION_CODE_CACHE


@pytest.fixture(scope="session")
def native_build(tmp_path_factory):
    """The trace's native launch, compiled once per worker into a folder of its own; the
    folder (SOURCE_PATCH_NATIVE_DIR for the tests that use it: see native_launch)."""
    from source_patch.runtime.trace import native

    folder = tmp_path_factory.mktemp("native")
    saved = os.environ.get("SOURCE_PATCH_NATIVE_DIR")
    os.environ["SOURCE_PATCH_NATIVE_DIR"] = str(folder)
    try:
        native.build()
    finally:
        native._loaded.clear()
        if saved is None:
            os.environ.pop("SOURCE_PATCH_NATIVE_DIR")
        else:
            os.environ["SOURCE_PATCH_NATIVE_DIR"] = saved
    return folder


@pytest.fixture
def native_launch(native_build, monkeypatch):
    """native.load() finds the compiled launch; the module it returns."""
    from source_patch.runtime.trace import native

    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build))
    native._loaded.clear()
    yield native.load()
    native._loaded.clear()


@pytest.fixture
def in_shared_code_cache(shared_code_cache, monkeypatch):
    """The processes this test starts compile into shared_code_cache (see there)."""
    monkeypatch.setenv("SOURCE_PATCH_CACHE", str(shared_code_cache))
    return shared_code_cache


def _with_code_cache(start, cache):
    from source_patch.testing.pytest_plugin import near_caller

    def start_with_cache(specs=(), args=(), env=None, model=None, **options):
        return start(near_caller(specs), args, {"SOURCE_PATCH_CACHE": str(cache), **(env or {})}, model, **options)

    start_with_cache.close_all = start.close_all
    _ENGINE_FACTORIES.append(start)
    return start_with_cache


@pytest.fixture(scope="session")
def sglang_server(sglang_server, shared_code_cache):
    """The plugin's sglang_server, its servers compiling into shared_code_cache."""
    return _with_code_cache(sglang_server, shared_code_cache)


@pytest.fixture(scope="session")
def sglang_engine(sglang_engine, shared_code_cache):
    """The plugin's sglang_engine, its engines compiling into shared_code_cache."""
    return _with_code_cache(sglang_engine, shared_code_cache)


@pytest.fixture(scope="session")
def mooncake_metadata(tmp_path_factory):
    """(URL, None) of a real mooncake_master on 127.0.0.1 serving TransferEngines' metadata
    for the session (the weight-sync mooncake backend's), else (None, why there is none)."""
    import importlib

    from source_patch.runtime.core.endpoint import free_port

    try:
        importlib.import_module("mooncake.engine")
    except ImportError as exc:
        yield None, f"could not import 'mooncake.engine': {exc}"
        return
    if not (Path(sys.executable).parent / "mooncake_master").exists():
        yield None, f"no mooncake_master next to {sys.executable}"
        return
    from source_patch.runtime.features import mooncake as feature_mooncake

    port = free_port()
    with feature_mooncake.master(tmp_path_factory.mktemp("mooncake") / "master.log", timeout=30,
                                 metadata_port=port):
        yield f"http://127.0.0.1:{port}/metadata", None


@pytest.fixture(scope="session")
def weight_sync_server_env(mooncake_metadata):
    """The environment of the real SGLang server (patches/weight_sync.yaml) that
    test_hardening_weights, test_weight_sync_backends and test_weight_sync_engine push
    weights into: equal arguments in one group, so it starts once; the mooncake backend's
    metadata URL where there is one (the other backends never read it)."""
    url, _ = mooncake_metadata
    return {"SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "60",
            **({"SOURCE_PATCH_WEIGHT_SYNC_MOONCAKE_METADATA": url} if url else {})}


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
    env = {"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(root / "routes"),
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
