"""The spec's `runtime:` section and the environment feed runtime components' settings."""

import pytest

from source_patch.patcher import SpecError, patched
from source_patch.patcher.spec import loads
from source_patch.runtime.core import settings

SPEC = """source_patch: 1
name: r
runtime:
  probe:
    every: 5
    label: spec
patches:
  - id: p
    module: spfix.basic
    target: add
    edits:
      - {at: entry, code: "pass"}
"""


@pytest.fixture
def probe_schema(monkeypatch):
    """A component registered for the test, as real components register theirs."""
    monkeypatch.setitem(settings.SCHEMAS, "probe", {
        "every": settings.Setting(1, settings.integer(low=1), "period"),
        "label": settings.Setting("default", settings.text, "a label"),
        "on": settings.Setting(False, settings.boolean, "switch"),
    })


def test_spec_values_are_validated_and_kept(probe_schema):
    assert loads(SPEC, "s.yaml").runtime == {"probe": {"every": 5, "label": "spec"}}


@pytest.mark.parametrize("old,new,where,message", [
    ("every: 5", "every: 0", "s.yaml:5:12: runtime.probe.every", "expected an integer >= 1"),
    ("every: 5", "evry: 5", "s.yaml:5:5: runtime.probe.evry", "valid keys: every, label, on"),
    ("label: spec", "label: [1]", "s.yaml:6:12: runtime.probe.label", "expected a string"),
    ("  probe:", "  prob:", "s.yaml:4:3: runtime.prob", "unknown runtime component 'prob'"),
])
def test_bad_runtime_settings_are_located(probe_schema, old, new, where, message):
    with pytest.raises(SpecError) as info:
        loads(SPEC.replace(old, new), "s.yaml")
    assert str(info.value).startswith(where) and message in str(info.value)


def test_environment_over_spec_over_default(probe_schema, write_spec):
    with patched(write_spec(SPEC)):
        assert settings.resolve("probe", {}) == {"every": 5, "label": "spec", "on": False}
        env = {"SOURCE_PATCH_PROBE_EVERY": "7", "SOURCE_PATCH_PROBE_ON": "yes"}
        assert settings.resolve("probe", env) == {"every": 7, "label": "spec", "on": True}
        with pytest.raises(ValueError, match="SOURCE_PATCH_PROBE_EVERY='x': expected an integer"):
            settings.resolve("probe", {"SOURCE_PATCH_PROBE_EVERY": "x"})
    assert settings.resolve("probe", {})["every"] == 1  # no active spec: the default
