"""The trace's native launch (runtime/trace/native.py, native_launch.cpp): built with
the machine's compiler against the installed torch, loaded only where built, and the
checks it makes before it launches.  Its launches themselves need a GPU:
test_trace_compress.py's planned-call test runs them (gpu-marked)."""

import os
import subprocess
import sys

import pytest
import torch

from source_patch.runtime.trace import native


def test_the_built_launch_refuses_what_it_was_not_planned_for(native_launch):
    t = torch.zeros(4, 8)
    plan = native_launch.plan(t, 0, 0, (1, 1, 1), 128, 0, "ppiil", (4, 8, None))
    assert native_launch.launch(plan, t, 0, 0) == 1  # on the CPU: nothing it could launch
    assert native_launch.launch(plan, t, 0) == 1
    assert native_launch.launch(plan, "not a tensor", 0, 0) == 1
    with pytest.raises(ValueError, match="unknown parameter type x"):
        native_launch.plan(t, 0, 0, (1, 1, 1), 128, 0, "ppx", (4,))
    with pytest.raises(ValueError, match="types must start with the input and output pointers"):
        native_launch.plan(t, 0, 0, (1, 1, 1), 128, 0, "ppi", (4, 5))
    with pytest.raises(TypeError, match="a plain torch.Tensor"):
        native_launch.plan([1], 0, 0, (1, 1, 1), 128, 0, "pp", ())
    with pytest.raises(TypeError, match=r"launch\(plan, tensor, output\[, stream\]\)"):
        native_launch.launch(plan, t)
    with pytest.raises(ValueError):  # not a plan of this module
        native_launch.launch(object(), t, 0, 0)


def test_a_process_loads_only_a_launch_built_for_its_torch_and_source(tmp_path, monkeypatch, native_build):
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(tmp_path))
    native._loaded.clear()
    assert native.load() is None  # nothing built there: nothing compiled either
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build))
    name = native.module_name()
    assert native.build_dir() == native_build / name
    changed = tmp_path / "native_launch.cpp"
    changed.write_text(native.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    assert native.module_name() != name  # a changed source is another build
    native._loaded.clear()
    assert native.load() is None
    native._loaded.clear()


def test_build_native_says_what_went_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "source_patch.patcher", "build-native"], capture_output=True,
                          text=True, env={**os.environ, "CXX": "no-such-compiler"})
    assert done.returncode == 2 and "no C++ compiler: no-such-compiler (set CXX)" in done.stderr
    broken = tmp_path / "native_launch.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(native.BuildError, match="exited 1") as error:
        native.build()
    assert "native_launch.cpp" in str(error.value)  # the compiler's own words
    assert not list(native.build_dir().glob("*.so")) and not list(native.build_dir().glob("*.tmp"))
    native._loaded.clear()


def test_build_native_twice_builds_once(native_build, monkeypatch, capsys):
    from source_patch.patcher.cli import main

    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build))
    native._loaded.clear()
    assert main(["build-native"]) == 0
    assert capsys.readouterr().out.startswith(f"already built: {native.build_dir()}")
    native._loaded.clear()


def test_the_native_launch_is_taken_where_built_and_asked_for_by_name_it_says_when_not(
        tmp_path, monkeypatch, capsys, native_build):
    """auto (the default): native where built, else direct, silently; native: the same,
    said once where not built; direct, triton, or tracing off: never native."""
    from source_patch.runtime.core import settings
    from source_patch.runtime.trace import api, compress, control, lifecycle  # noqa: F401 - api: the state

    monkeypatch.setattr(lifecycle, "_native_said", False)
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(tmp_path))
    native._loaded.clear()
    assert settings.SCHEMAS["trace"]["triton_launch"].default == "auto"
    try:
        control.configure(enable=True, triton_launch="auto")  # (port 0: no hub, nothing served)
        assert not compress.NATIVE_LAUNCH and compress.DIRECT_LAUNCH and capsys.readouterr().err == ""
        control.configure(triton_launch="native")
        assert not compress.NATIVE_LAUNCH and compress.DIRECT_LAUNCH
        control.configure(triton_launch="native")
        said = capsys.readouterr().err
        assert said.count("triton_launch: native: none built for this torch") == 1  # once a process
        assert "source-patch build-native" in said
        monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build))
        native._loaded.clear()
        for launch, native_launch, direct in (("native", True, True), ("auto", True, True),
                                              ("direct", False, True), ("triton", False, False)):
            control.configure(triton_launch=launch)
            assert (compress.NATIVE_LAUNCH, compress.DIRECT_LAUNCH) == (native_launch, direct), launch
        control.configure(enable=False, triton_launch="auto")
        assert not compress.NATIVE_LAUNCH  # tracing off: nothing loaded for it
    finally:
        control.configure(enable=False, triton_launch="auto")
        native._loaded.clear()
    assert not compress.NATIVE_LAUNCH
