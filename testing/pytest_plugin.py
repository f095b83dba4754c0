"""pytest plugin (entry point ``source_patch``).

    pytest --source-patch patches/routing.yaml     # the whole session runs patched

and the ``source_patch_import`` fixture for patched-module tests:

    def test_capture(source_patch_import):
        moe_utils = source_patch_import("megatron.core.transformer.moe.moe_utils", "routing")

A real SGLang engine with specs active in its processes (testing/sglang.py;
skipped when SGLang is not installed; ``sglang_cpu`` is always added):

    def test_routes(sglang_server):
        server = sglang_server(specs=["routing"], env={"SOURCE_PATCH_SGLANG_ROUTING_MODE": "capture"})
        server.generate(input_ids=[1, 2, 3], max_new_tokens=4)

``sglang_server(specs, args, env, model)`` starts ``python -m sglang.launch_server``,
``sglang_engine(specs, engine_args, env, model)`` the offline ``sglang.Engine`` in a
driver process; equal arguments share one engine for the whole test session (start-up
costs ~20-30 s on 2 cores; ``sglang_server.close_all()`` ends those started so far).
``sglang_checkpoint`` is the tiny Qwen3-MoE they serve by default (cached in
$SOURCE_PATCH_SGLANG_CACHE or ~/.cache/source-patch/sglang).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("source-patch")
    group.addoption("--source-patch", action="append", default=[], metavar="SPEC",
                    help="activate a source-patch spec (file or bundled name) for the session; "
                         "repeatable")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before conftest.py files load: they may import a target.
    refs = early_config.known_args_namespace.source_patch
    if not refs:
        return
    from source_patch.patcher.activation import activate
    from source_patch.patcher.errors import SourcePatchError

    try:
        early_config._source_patch_activation = activate(refs)
    except SourcePatchError as exc:
        raise pytest.UsageError(f"--source-patch: {exc}") from None


def pytest_report_header(config):
    activation = getattr(config, "_source_patch_activation", None)
    if activation:
        names = ", ".join(f"{s.name} ({s.file})" for s in activation.specs)
        return f"source-patch: {names}"


@pytest.fixture
def source_patch_import(tmp_path_factory):
    """``source_patch_import(module, *specs)``: a fresh patched copy of ``module``.

    The already-imported module (if any) and ``sys.modules`` are left untouched.
    """
    from source_patch.patcher.activation import import_patched_copy

    cache_dir = tmp_path_factory.mktemp("source-patch-cache")

    def load(module: str, *specs):
        return import_patched_copy(module, *near_caller(specs), cache_dir=cache_dir)

    return load


def near_caller(specs, depth: int = 2) -> list:
    """Spec paths relative to the calling test file, where a file of that name exists
    there (else as given: the working directory, or a bundled spec name)."""
    import os
    import sys
    from pathlib import Path

    base = Path(sys._getframe(depth).f_code.co_filename).parent
    out = []
    for spec in specs:
        if isinstance(spec, (str, os.PathLike)) and not Path(spec).is_absolute() \
                and (base / spec).is_file():
            spec = str(base / spec)
        out.append(spec)
    return out


def _need_sglang():
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")


@pytest.fixture(scope="session")
def sglang_checkpoint():
    """The tiny random Qwen3-MoE checkpoint (and tokenizer) the engine fixtures serve."""
    _need_sglang()
    from .sglang import tiny_checkpoint

    return tiny_checkpoint()


def _shared(kind: str, checkpoint, tmp_path_factory):
    """A factory of engines of ``kind`` shared by equal arguments; all closed at the end."""
    from . import sglang as harness

    started: dict = {}

    def start(specs=(), args=(), env=None, model=None, **options):
        specs = near_caller(specs)
        key = (tuple(specs), tuple(args), tuple(sorted((env or {}).items())), str(model),
               repr(sorted(options.items())))
        if key not in started:
            workdir = tmp_path_factory.mktemp(f"sglang-{kind}")
            cls = harness.SGLangServer if kind == "server" else harness.SGLangEngine
            extra = {"args": args} if kind == "server" else {"engine_args": dict(args or {})}
            started[key] = cls(model or checkpoint, specs=specs, env=env, workdir=workdir, **extra, **options)
        return started[key]

    def close_all(background: bool = False):
        """Close every engine started so far (a later call starts a new one); with
        ``background``, in a thread, which this returns."""
        engines = list(started.values())
        started.clear()
        if not background:
            return _close_all(engines)
        import threading

        thread = threading.Thread(target=_close_all, args=(engines,), name=f"close-sglang-{kind}s")
        thread.start()
        return thread

    start.close_all = close_all
    return started, start


def _close_all(engines) -> None:
    """Close every engine at once: each waits seconds for SGLang's own shutdown."""
    from concurrent.futures import ThreadPoolExecutor

    engines = list(engines)
    with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
        for future in [pool.submit(engine.close) for engine in engines]:
            future.result()


@pytest.fixture(scope="session")
def sglang_server(sglang_checkpoint, tmp_path_factory):
    """``sglang_server(specs=(), args=(), env=None, model=None)``: a real SGLang HTTP
    server on 127.0.0.1 (SGLangServer), shared by equal arguments for the session."""
    started, start = _shared("server", sglang_checkpoint, tmp_path_factory)
    yield start
    _close_all(started.values())


@pytest.fixture(scope="session")
def sglang_engine(sglang_checkpoint, tmp_path_factory):
    """``sglang_engine(specs=(), args={engine kwargs}, env=None, model=None)``: the offline
    sglang.Engine in a driver process (SGLangEngine), shared by equal arguments."""
    started, start = _shared("engine", sglang_checkpoint, tmp_path_factory)
    yield start
    _close_all(started.values())
