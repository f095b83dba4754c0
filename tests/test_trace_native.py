"""The trace's native launch (runtime/trace/native.py, native_launch.cpp): built with
the machine's compiler against the installed torch, loaded only where built, and the
checks it makes before it launches.  Its launches themselves need a GPU:
test_trace_compress.py's planned-call test runs them (gpu-marked)."""

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections import deque

import pytest
import torch

from source_patch.runtime.core import tags as ambient
from source_patch.runtime.trace import native, ring as ring_module


class StandInLaunch:
    """cuLaunchKernel's stand-in (ctypes), so that the built launch runs on the CPU: it
    keeps what each launch was given (the function, grid, block, stream, and the first
    ``count`` parameter slots: input, output, ...) and answers ``status``."""

    PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)), ctypes.c_void_p)

    def __init__(self, count: int = 2):
        self.calls, self.status, self.count, self.during = [], 0, count, None
        self.function = self.PROTOTYPE(self._launch)  # kept alive with this object
        self.address = ctypes.cast(self.function, ctypes.c_void_p).value

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
                           "stream": stream or 0, "input": params[0][0], "output": params[1][0],
                           "rest": tuple(params[i][0] for i in range(2, self.count))})
        if self.during is not None:
            self.during()
        return self.status


def test_the_built_launch_refuses_what_it_was_not_planned_for(native_launch):
    t = torch.zeros(4, 8)
    stand_in = StandInLaunch(count=5)
    plan = native_launch.plan(t, stand_in.address, 0x1234, (2, 1, 1), 128, 16, "ppiil", (4, 8, 9))
    assert native_launch.launch(plan, torch.zeros(4, 9), 0, 0) == 1  # another layout: nothing launched
    assert native_launch.launch(plan, torch.zeros(8, 4).t(), 0, 0) == 1  # not contiguous
    assert native_launch.launch(plan, torch.zeros(4, 8, dtype=torch.float64), 0, 0) == 1
    assert native_launch.launch(plan, "not a tensor", 0, 0) == 1
    assert stand_in.calls == []
    assert native_launch.launch(plan, t, 0xABC0, 7) == 0  # the plan's layout: launched, as planned
    assert native_launch.launch(plan, t, 0xABD0) == 0  # (a CPU plan's stream: null)
    assert stand_in.calls == [
        {"function": 0x1234, "grid": (2, 1, 1), "block": (128, 1, 1), "shared": 16, "stream": stream,
         "input": t.data_ptr(), "output": output, "rest": (4, 8, 9)} for output, stream in ((0xABC0, 7), (0xABD0, 0))]
    stand_in.status = 700
    assert native_launch.launch(plan, t, 0, 0) == -700  # the driver's error, as it gave it
    with pytest.raises(ValueError, match="unknown parameter type x"):
        native_launch.plan(t, stand_in.address, 0, (1, 1, 1), 128, 0, "ppx", (4,))
    with pytest.raises(ValueError, match="types must start with the input and output pointers"):
        native_launch.plan(t, stand_in.address, 0, (1, 1, 1), 128, 0, "ppi", (4, 5))
    with pytest.raises(ValueError, match="a launch function is needed"):
        native_launch.plan(t, 0, 0, (1, 1, 1), 128, 0, "pp", ())
    with pytest.raises(TypeError, match="a plain torch.Tensor"):
        native_launch.plan([1], stand_in.address, 0, (1, 1, 1), 128, 0, "pp", ())
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


class Layout:
    """What plan.Plan reads of fused.py's planned launch (its shape and compiled call)."""
    shape = (2, 5, 8)  # [splits, statistics, columns]: the float32 result the kernel writes
    compiled = (lambda *arguments: None, (), (), ())


@pytest.fixture
def compiled_due(native_launch, monkeypatch):
    """api's trace state armed for the compiled due call of one planned (name, layer) =
    ("h", 1), on the CPU: a real ring (its device address a stand-in), the native plan
    launching through StandInLaunch; (api, plan, ring, stand-in)."""
    from source_patch.runtime.trace import api, hub, plan as plan_module, ring as ring_module

    x = torch.zeros(4, 8)
    sub = hub.parse_subscription({"op": "subscribe", "id": "t", "names": ["h"], "compressor": {"kind": "tiles"},
                                  "every": 2})
    stand_in = StandInLaunch()
    plan = plan_module.Plan(sub, x, Layout)
    plan.native = native_launch.plan(x, stand_in.address, 0x1234, (1, 1, 1), 128, 0, "pp", (), plan.nbytes,
                                     plan.padded)
    plan.native_launch, plan.due, plan.stream = native_launch.launch, native_launch.due, "the default stream"
    ring = ring_module.Ring(size=4 * plan.padded)
    ring.device_address, ring.lock = 1 << 40, api._lock  # (the lock, as lifecycle.py sets it where it serves)
    table = api._Table((sub,))
    table.routes[("h", 1)], table.plans[("h", 1)] = (sub,), plan
    for name, value in (("_enabled", True), ("_table", table), ("_ring", ring), ("_fast_ring", ring),
                        ("_stepping", True), ("_hook_calls", ([], [])), ("_step", 0), ("_pending", deque()),
                        ("_records", []), ("_unsealed", []), ("_durations", []),
                        ("_publisher", threading.current_thread()),  # alive: nothing sealed before a batch fills
                        ("_config", {**api._config, "queue": 100})):
        monkeypatch.setattr(api, name, value)
    monkeypatch.setattr(ambient, "_context", {})  # (an SGLang test's forward leaves its tags set)
    api._arm_compiled(ring)
    yield api, plan, ring, stand_in, x
    api._arm_compiled(None)
    api._counters.reset()  # the failures these tests provoke are not a later test's (test_server_hardening's hub)


def test_the_compiled_due_call_claims_launches_and_queues_what_the_python_one_does(compiled_due, monkeypatch):
    api, plan, ring, stand_in, x = compiled_due
    handed = []
    python_fast = api._fast
    monkeypatch.setattr(api, "_fast", lambda *a: handed.append(a) or python_fast(*a))
    assert api.trace("h", x, layer=1) is x
    assert handed == []  # the whole call compiled
    assert stand_in.calls == [{"function": 0x1234, "grid": (1, 1, 1), "block": (128, 1, 1), "shared": 0,
                               "stream": 0, "input": x.data_ptr(), "output": 1 << 40, "rest": ()}]
    (record,) = api._records
    assert record[:4] == (plan, "h", {"layer": 1}, 0) and record[5:] == (0, plan.padded, "the default stream")
    assert abs(record[4] - time.time()) < 5  # the epoch's clock, as _fast stamps it
    assert (ring.head, plan.sub.next_step[("h", 1)], len(api._durations)) == (plan.padded, 2, 1)
    assert not api._lock.locked()
    api.trace("h", x, layer=1)  # every 2 steps: not due again at step 0 or 1
    api._step = 1
    api.trace("h", x, layer=1)
    assert len(stand_in.calls) == 1 and len(api._records) == 1
    # the same call by api._fast, from the same state: the same launch and record
    api._step = 2
    compiled = plan.due
    with ambient.set_context(microbatch=3):
        plan.due = None  # api.trace calls api._fast
        api.trace("h", x, layer=1)
        plan.due = compiled
        api._step = 4
        api.trace("h", x, layer=1)
    assert len(handed) == 1 and len(stand_in.calls) == 3
    for record, call, step, offset in zip(api._records[1:], stand_in.calls[1:], (2, 4), (1, 2)):
        offset *= plan.padded
        assert record[:4] == (plan, "h", {"microbatch": 3, "layer": 1}, step)  # the context copied in
        assert record[5:] == (offset, offset + plan.padded, "the default stream")
        assert (call["input"], call["output"]) == (x.data_ptr(), (1 << 40) + offset)
    assert ring.head == 3 * plan.padded and plan.sub.next_step[("h", 1)] == 6


def test_the_compiled_due_call_drops_when_behind_hands_back_what_it_does_not_plan_and_never_raises(
        compiled_due, monkeypatch, native_launch):
    api, plan, ring, stand_in, x = compiled_due
    handed, sealed = [], []
    monkeypatch.setattr(api, "_fast", lambda *a: handed.append(a[0]) or True)
    monkeypatch.setattr(api, "_seal_and_wake", lambda: sealed.append(len(api._records)) or api._records.clear())
    dropped = api._counts["dropped"]

    def due_at(step, tensor=x):
        api._step = step
        api.trace("h", tensor, layer=1)

    api._config = {**api._config, "queue": 0}  # the publisher is behind: dropped, counted, nothing claimed
    due_at(0)
    assert (api._counts["dropped"], ring.head, stand_in.calls, api._records) == (dropped + 1, 0, [], [])
    api._config = {**api._config, "queue": 100}
    ring.head = ring.size  # the forwarder is behind: it has read nothing of a full ring
    due_at(2)
    assert (api._counts["dropped"], ring.head, stand_in.calls) == (dropped + 2, ring.size, [])
    ring.head = 0
    for step, hand_back in ((4, lambda: monkeypatch.setattr(api, "_hook_calls", ([print], []))),  # a launch hook
                            (6, lambda: monkeypatch.setattr(api, "_fast_ring", None)),  # not armed (_arm)
                            (8, lambda: api._arm_compiled(None))):  # disarmed
        hand_back()
        due_at(step)
        assert handed[-1] is plan and stand_in.calls == []
    monkeypatch.setattr(api, "_hook_calls", ([], []))
    monkeypatch.setattr(api, "_fast_ring", ring)
    api._arm_compiled(ring)
    due_at(10, torch.zeros(4, 9))  # another layout: api._fast plans again
    assert len(handed) == 4 and stand_in.calls == []
    monkeypatch.setattr(api, "_publisher", None)  # no publisher yet: every result sealed and woken at once
    due_at(12)
    assert sealed == [1] and len(stand_in.calls) == 1 and not api._lock.locked()
    with api._lock:  # a thread is in api's lock (here: this one): api._fast takes the call, and waits
        due_at(14)
    assert handed[-1] is plan and len(handed) == 5 and len(stand_in.calls) == 1
    stand_in.status = 700  # the driver refuses: counted, the plan set aside, the step goes on
    errors = api._counts["errors"]
    due_at(16)
    assert api._counts["errors"] == errors + 1 and plan.failed and not api._lock.locked()
    assert api._table.plans[("h", 1)] is False  # the general path from now on
    assert len(api._durations) == 4  # every due call it did itself: two dropped, one sealed, one failed
    assert "CUDA error 700" in api.snapshot()["last_error"] and plan.sub.next_step[("h", 1)] == 18
    with pytest.raises(TypeError, match="key a tuple"):
        native_launch.due(plan, "h", x, {})


@pytest.mark.parametrize("inside", [False, True])
def test_the_compiled_claim_and_another_threads_claims_never_overlap(compiled_due, monkeypatch, native_launch,
                                                                     inside):
    """The compiled due call claims its slice without api's lock where nobody holds it
    (native_launch.cpp: lock_held), with the GIL held and no Python code run until the
    ring's head is written: another thread's claims, under the lock, never take the same
    bytes, however often the GIL changes hands.  ``inside``: a claim made inside that
    window (by a launch that runs Python code, which cuLaunchKernel never does) is seen
    overlapping, every time: what the check would catch."""
    api, plan, _, stand_in, x = compiled_due
    rounds = 3000
    ring = ring_module.Ring(size=4 * rounds * plan.padded)  # nothing wraps
    ring.device_address, ring.lock = 1 << 40, api._lock  # (the lock, as lifecycle.py sets it where it serves)
    for name, value in (("_ring", ring), ("_fast_ring", ring), ("_config", {**api._config, "queue": 1 << 30})):
        monkeypatch.setattr(api, name, value)
    api._arm_compiled(ring)
    sealed: list = []
    monkeypatch.setattr(api, "_seal_and_wake", lambda: (sealed.extend(api._records), api._records.clear()))
    theirs: list = []

    def claim() -> None:
        theirs.append(ring.claim(Layout.shape).end)
    if inside:
        stand_in.during = claim
    else:
        address = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value  # abs(0) == 0: a launch that succeeds
        plan.native = native_launch.plan(x, address, 0, (1, 1, 1), 128, 0, "pp", (), plan.nbytes, plan.padded)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands as often as it can
    try:
        other = threading.Thread(target=lambda: [claim() for _ in range(0 if inside else rounds)])
        other.start()
        for step in range(0, 2 * rounds, 2):  # every 2 steps
            api._step = step
            api.trace("h", x, layer=1)
        other.join()
    finally:
        sys.setswitchinterval(interval)
    ours = [record[6] for record in sealed + api._records]
    assert len(ours) == len(theirs) == rounds
    ends = sorted(ours + theirs)
    overlaps = sum(b - a < plan.padded for a, b in zip(ends, ends[1:]))
    assert overlaps == (rounds if inside else 0)
