"""The activation API: timing errors, idempotence, requirements, patched copies."""

import importlib
import sys

import pytest

from source_patch.patcher import (ActivationError, RequirementError, activate,
                                  import_patched_copy, patched)
from source_patch.patcher.activation import installed_finder

SPEC = """
source_patch: 1
name: a
{extra}
patches:
  - id: p
    module: spfix.basic
    target: add
    edits:
      - {{at: return, code: "result = -result"}}
"""


def spec_text(extra=""):
    return SPEC.format(extra=extra)


def test_a_target_already_imported_is_an_error(write_spec):
    importlib.import_module("spfix.basic")
    try:
        with pytest.raises(ActivationError, match="already imported.*spfix.basic"):
            activate(write_spec(spec_text()))
    finally:
        del sys.modules["spfix.basic"], sys.modules["spfix"].basic
    assert installed_finder() is None


def test_activate_twice_is_a_no_op_and_deactivate_cleans_up(write_spec):
    spec = write_spec(spec_text())
    first = activate(spec)
    second = activate(spec)
    try:
        assert second.specs == [] and len(installed_finder().specs) == 1
    finally:
        second.deactivate()
        first.deactivate()
    assert installed_finder() is None


def test_non_targets_are_left_alone(write_spec):
    with patched(write_spec(spec_text())):
        from spfix import notpatched
        assert notpatched.VALUE == 42
        assert not hasattr(notpatched, "__source_patches__")
    del sys.modules["spfix.notpatched"], sys.modules["spfix"].notpatched


def test_unmet_requirement_errors_by_default(write_spec):
    spec = write_spec(spec_text("requires: {pyyaml: '>=99'}"))
    with patched(spec), pytest.raises(RequirementError, match=r"requires pyyaml>=99, found 6"):
        importlib.import_module("spfix.basic")


def test_unmet_requirement_can_skip(write_spec):
    spec = write_spec(spec_text("requires: {not-a-real-dist: '>=1'}\non_unmet: skip"))
    with patched(spec), pytest.warns(UserWarning, match="not-a-real-dist>=1, which is not installed"):
        from spfix import basic
        assert basic.add(1, 2) == 3


def test_met_requirement_patches(write_spec):
    with patched(write_spec(spec_text("requires: {pyyaml: '>=5'}"))):
        from spfix import basic
        assert basic.add(1, 2) == -3


def test_import_patched_copy_leaves_sys_modules_alone(write_spec):
    original = importlib.import_module("spfix.basic")
    try:
        copy = import_patched_copy("spfix.basic", write_spec(spec_text()))
        assert copy is not original and sys.modules["spfix.basic"] is original
        assert copy.add(1, 2) == -3 and original.add(1, 2) == 3
    finally:
        del sys.modules["spfix.basic"], sys.modules["spfix"].basic


def test_the_runtime_handle_is_lazy_and_cached():
    from source_patch.patcher.finder import RuntimeHandle
    from source_patch.runtime import emit

    handle = RuntimeHandle()
    assert "emit" not in vars(handle)
    assert handle.emit is emit and vars(handle)["emit"] is emit
    with pytest.raises(AttributeError, match=r"has no .no_such_thing. \(available: .*emit"):
        handle.no_such_thing


def test_a_renamed_call_site_name_resolves_to_its_name_now_with_one_warning(monkeypatch):
    from source_patch.patcher import boot
    from source_patch.patcher.finder import RuntimeHandle
    from source_patch.runtime import emit, facade

    monkeypatch.setitem(boot.RENAMED, ("__sp__", "old_emit"), "emit")
    handle = RuntimeHandle()
    with pytest.warns(DeprecationWarning, match=r"__sp__\.old_emit is now __sp__\.emit"):
        assert handle.old_emit is emit
    assert vars(handle)["old_emit"] is emit  # cached: the warning once
    renamed = [new for (kind, _), new in boot.RENAMED.items() if kind == "__sp__" and new != "emit"]
    assert renamed and all(new in facade.exports() for new in renamed)  # each names a call site now
