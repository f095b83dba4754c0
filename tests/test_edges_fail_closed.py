"""Fail closed where behaviour changes (issue 56): with a setting that changes what the
model computes (routing replay), a call site whose patch did not apply in this process
stops the run at that moment, naming the patch and why; an observer's (capture, dump,
trace) keeps its warning.  Real processes with the real finder and the real runtime."""

import os
import subprocess
import sys

import pytest

# A patch of the fixture module whose inserted code is routing's call site, gated on a
# requirement no machine meets, beside one that applies (the version-gated pair a real
# spec has): only when no applied patch inserts the call does a call site go missing.
SPEC = """source_patch: 1.1
name: gated
patches:
  - id: router-old
    module: spfix.basic
    target: add
    requires: {{packaging: "<0.1"}}
    edits:
      - at: entry
        code: __sp__.routing_step()
{other}"""
OTHER_VARIANT = """  - id: router-new
    module: spfix.basic
    target: add
    edits:
      - at: entry
        code: __sp__.routing_step()
"""

IMPORT = "import json; print('stdlib ok', flush=True); import spfix.basic; print('imported', flush=True)"
CONFIGURE = IMPORT + ("\nfrom source_patch.runtime.routing.megatron import control\n"
                      "try:\n    control.configure(mode='replay')\nexcept RuntimeError as exc:\n"
                      "    print('REFUSED', exc)\nprint('mode', control.state()['config']['mode'])")


def run(code, spec, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    environ.update(SOURCE_PATCH=os.fspath(spec), CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


@pytest.fixture
def gated(write_spec):
    return write_spec(SPEC.format(other=""), "gated.yaml")


def test_replay_with_a_missing_router_call_site_stops_at_the_import(gated):
    proc = run(IMPORT, gated, SOURCE_PATCH_ROUTING_MODE="replay")
    assert proc.returncode == 1 and "stdlib ok" in proc.stdout and "imported" not in proc.stdout, proc.stderr
    assert ("routing mode=replay needs patch 'router-old' of spec 'gated', which did not apply to spfix.basic: "
            "requires packaging<0.1") in proc.stderr
    assert "stopped: the run would compute something else" in proc.stderr
    assert f"{gated}:" in proc.stderr  # where the patch is


@pytest.mark.parametrize("mode", ["capture", "off"])
def test_an_observer_missing_its_call_site_keeps_going(gated, mode):
    proc = run(IMPORT, gated, SOURCE_PATCH_ROUTING_MODE=mode)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
    assert "does not apply to spfix.basic" in proc.stderr  # said, as before


def test_a_variant_that_applies_in_its_place_leaves_nothing_missing(write_spec):
    spec = write_spec(SPEC.format(other=OTHER_VARIANT), "pair.yaml")
    proc = run(IMPORT, spec, SOURCE_PATCH_ROUTING_MODE="replay")
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr


def test_turning_replay_on_later_is_refused_while_the_call_site_is_missing(gated):
    proc = run(CONFIGURE, gated)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED routing mode=replay changes what the model computes, but patch 'router-old'" in proc.stdout
    assert "requires packaging<0.1" in proc.stdout and "refused (nothing changed)" in proc.stdout
    assert "mode off" in proc.stdout  # the settings stayed as they were


def test_a_missing_target_module_fails_closed_under_replay(write_spec):
    spec = write_spec(SPEC.format(other="").replace("module: spfix.basic", "module: spfix.basik")
                      .replace('    requires: {packaging: "<0.1"}\n', ""), "typo.yaml")
    proc = run(IMPORT, spec, SOURCE_PATCH_ROUTING_MODE="replay")
    assert proc.returncode != 0 and "imported" not in proc.stdout, proc.stdout
    assert "needs patch 'router-old' of spec 'gated', which did not apply to spfix.basik: it cannot be found" \
        in proc.stderr
    ok = run(IMPORT, spec, SOURCE_PATCH_ROUTING_MODE="capture")
    assert ok.returncode == 0 and "which cannot be found" in ok.stderr  # an observer: the warning, as before
