"""The capability contract implemented once (runtime/core/control.py): what every
control module gets from it, shown on a throw-away component and on the real ones."""

import importlib
import threading
import time

import pytest

from source_patch.runtime.core import capability, settings
from source_patch.runtime.core.control import Control


@pytest.fixture
def probe(monkeypatch):
    """A component 'probe' with two settings, and a Control whose hooks record their calls."""
    monkeypatch.setitem(settings.SCHEMAS, "probe", {
        "level": settings.Setting(1, settings.integer(low=0), "a number"),
        "token": settings.Setting("", settings.text, "a secret"),
    })
    calls = {"applied": [], "counters": {"seen": 0}, "error": None, "stop_s": 0.0, "drain": True}

    def apply(config, extra=None):
        if config["level"] == 13:
            raise ValueError("unlucky")
        calls["applied"].append((dict(config), extra))

    def stop(timeout):
        time.sleep(calls["stop_s"])
        return True

    def drain(timeout):
        if isinstance(calls["drain"], Exception):
            raise calls["drain"]
        return calls["drain"]

    control = Control("probe", apply=apply, enabled=lambda: bool(calls["applied"]),
                      counters=lambda: calls["counters"], last_error=lambda: calls["error"],
                      details=lambda: {"mine": 1}, clear=lambda: calls["counters"].update(seen=0),
                      drain=drain, stop=stop, inputs=("extra",))
    return control, calls


def test_configure_validates_every_change_before_applying_any(probe):
    control, calls = probe
    assert control.configure(level=3, token="s3cret") == {"level": 3, "token": "<set>"}
    with pytest.raises(KeyError, match="valid keys: level, token"):
        control.configure(level=4, lvel=5)
    with pytest.raises(ValueError, match=">= 0"):
        control.configure(token="other", level=-1)
    assert control.config == {"level": 3, "token": "s3cret"} and len(calls["applied"]) == 1
    with pytest.raises(ValueError, match="unlucky"):  # apply refused: the settings stay as they were
        control.configure(level=13)
    assert control.config["level"] == 3
    control.configure(extra="not a setting")  # an input, handed to apply, not validated as a setting
    assert calls["applied"][-1] == ({"level": 3, "token": "s3cret"}, "not a setting")


def test_configure_from_settings_reads_the_environment(probe):
    control, _ = probe
    assert control.configure_from_settings({"SOURCE_PATCH_PROBE_LEVEL": "9"})["level"] == 9


def test_state_has_one_shape_and_reset_clears_the_failure(probe):
    control, calls = probe
    control.configure(level=2)
    calls["counters"]["seen"] = 5
    state = control.state()
    assert capability.state_violations(state) == []
    assert state == {"mine": 1, "enabled": True, "config": {"level": 2, "token": ""}, "counters": {"seen": 5},
                     "last_error": None}
    calls["drain"] = OSError("disk full")
    assert control.flush(1.0) is False and "OSError: disk full" in control.state()["last_error"]
    assert control.reset()["counters"] == {"seen": 0} and control.state()["last_error"] is None


def test_close_honours_its_timeout_and_never_raises(probe):
    control, calls = probe
    assert control.close(timeout=1.0) is True
    calls["stop_s"] = 0.3
    start = time.monotonic()
    assert control.close(timeout=0.1) is False  # it did not finish in time: said, not hidden
    assert time.monotonic() - start < 1.0
    calls["drain"] = False
    calls["stop_s"] = 0.0
    assert control.close(timeout=1.0) is False  # what was handed over was not all written
    calls["drain"] = True
    control._stop = lambda timeout: 1 / 0
    assert control.close() is False and "ZeroDivisionError" in control.state()["last_error"]


@pytest.mark.parametrize("component", sorted(capability.controls()))
def test_every_control_module_is_built_on_the_one_implementation(component):
    module = importlib.import_module(f"source_patch.runtime.{capability.controls()[component]}")
    control = next(v for v in vars(module).values() if isinstance(v, Control))
    assert control.component == component == module.SETTINGS
    for name in ("configure_from_settings", "state", "reset", "flush", "close"):
        assert getattr(module, name) == getattr(control, name), f"{component}: {name} is its own"
    assert module.close.__self__ is control


def test_a_control_module_closes_within_its_timeout_while_a_flush_is_stuck(monkeypatch):
    """dump's writer blocked on a slow disk: close(timeout) comes back in time, and says False."""
    from source_patch.runtime.dump import api

    release = threading.Event()
    monkeypatch.setattr(api._pipeline, "flush", lambda timeout: release.wait(timeout))
    start = time.monotonic()
    assert api.close(timeout=0.3) is False
    assert time.monotonic() - start < 2.0
    release.set()
