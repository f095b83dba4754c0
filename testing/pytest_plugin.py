"""pytest plugin (entry point ``source_patch``).

    pytest --source-patch patches/routing.yaml     # the whole session runs patched

and the ``source_patch_import`` fixture for patched-module tests:

    def test_capture(source_patch_import):
        moe_utils = source_patch_import("megatron.core.transformer.moe.moe_utils", "routing")
        topk = source_patch_import("sglang.srt.layers.moe.topk", "sglang_cpu", "mine.yaml")

(a spec that patches none of the module, such as ``sglang_cpu``, is activated for the
session before the module's package is imported: docs/authoring.md, "Testing a patch of
SGLang code").

A real SGLang engine with specs active in its processes (testing/sglang.py;
skipped when SGLang is not installed; ``sglang_cpu`` is always added):

    def test_routes(sglang_server):
        server = sglang_server(specs=["routing"], env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture"})
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

    The already-imported module (if any) and ``sys.modules`` are left untouched.  A
    spec among ``specs`` that patches none of ``module`` (``sglang_cpu``, or
    ``megatron_cpu`` beside a module it leaves alone) is the test's environment: it is
    activated for the rest of the session before the module's package is imported, as
    ``--source-patch`` would, since its patches must apply as their modules first import.
    """
    from source_patch.patcher import spec as spec_mod
    from source_patch.patcher.activation import import_patched_copy

    cache_dir = tmp_path_factory.mktemp("source-patch-cache")

    def load(module: str, *specs):
        loaded = [s if isinstance(s, spec_mod.Spec) else spec_mod.load(s) for s in near_caller(specs)]
        if any(p.module == module for s in loaded for p in s.patches):  # else the copy says so
            for environment in [s for s in loaded if all(p.module != module for p in s.patches)]:
                activate_environment(environment, module)
        try:  # the copy imports the module's package first, as a plain import would
            return import_patched_copy(module, *loaded, cache_dir=cache_dir)
        except RuntimeError as exc:
            error = exc
        sglang_without_cpu_spec(module, error)  # outside the except: no chained traceback

    return load


def activate_environment(spec, module: str) -> None:
    """Activate ``spec`` for the session (a no-op where it is active already); fail the
    test in one line where a module it patches was imported without it."""
    import sys

    from source_patch.patcher.activation import activate, installed_finder

    finder = installed_finder()
    if finder and any((s.name, str(s.file)) == (spec.name, str(spec.file)) for s in finder.specs):
        return
    late = sorted({p.module for p in spec.patches if p.module in sys.modules
                   and not _applied(sys.modules[p.module], spec.name, p.id)})
    if late:
        pytest.fail(f"source_patch_import({module!r}): {', '.join(late)} was imported before spec "
                    f"{spec.name!r} could patch it: run pytest with --source-patch {spec.name} "
                    f"(it applies before any import)", pytrace=False)
    activate([spec])


def _applied(module, spec: str, patch: str) -> bool:
    return any((a.spec, a.patch) == (spec, patch) for a in getattr(module, "__source_patches__", ()))


def sglang_without_cpu_spec(module: str, error: RuntimeError) -> None:
    """SGLang's package imported on a CPU-only torch without ``sglang_cpu``: one line
    that says to add it (else the error as it was)."""
    if "torchvision::" not in str(error) or not module.startswith("sglang"):
        raise error
    pytest.fail(f"source_patch_import({module!r}): importing SGLang failed ({error}): on a CPU-only "
                f"torch add the bundled spec 'sglang_cpu' to the specs (source_patch_import({module!r}, "
                f"'sglang_cpu', ...)) or run pytest with --source-patch sglang_cpu", pytrace=False)


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
