"""pytest plugin (entry point ``source_patch``).

    pytest --source-patch patches/moe.yaml     # the whole session runs patched

and the ``source_patch_import`` fixture for patched-module tests:

    def test_capture(source_patch_import):
        moe_utils = source_patch_import("megatron.core.transformer.moe.moe_utils", "moe")
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
    from .activation import activate
    from .errors import SourcePatchError

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
    from .activation import import_patched_copy

    cache_dir = tmp_path_factory.mktemp("source-patch-cache")

    def load(module: str, *specs):
        return import_patched_copy(module, *specs, cache_dir=cache_dir)

    return load
