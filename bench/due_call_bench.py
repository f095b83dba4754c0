"""The planned due trace() call (runtime/trace/api.py ``_fast``) on the CPU: the bytecodes
it runs, line by line, and its time warm, with stand-ins for the parts only a GPU has
(the forwarder's pinned ring, the current CUDA stream, Triton's C launch, which does
nothing here).

    python bench/due_call_bench.py [--rounds 15] [--calls 20000] [--cold-rounds 40] [--lines]
    python bench/due_call_bench.py --cuts [--gpu] [--cold-rounds 40]
    python bench/due_call_bench.py --against REV [--gpu] [--cold-rounds 300]
    python bench/due_call_bench.py [--gpu] --compiled [--cold-rounds 300]

The count is exact and the same on every machine: what a change to the call adds or
removes, where a GPU host's timing (compressor_bench.py, trace_bench.py) moves by a few
microseconds from host to host.  Two times: of a warm call (caches hot, back to back),
and of a call after other work (each alone, after compressor_bench.py's other work on
the host: a pass over 32 MiB and a few torch ops), the way a due call runs between a
training step's layers, cold: there each object the call touches is a cache miss
(docs/bench-notes/overhead.md), ~4x the warm time.

``--cuts``: where a cold call's time goes.  The call cut after each of its parts (its
source, cut after the line each part ends with, compiled in api's namespace), each cut
timed alone after other work: a table of the medians and each part's increment, and a
few operations alone (an empty call, a lock, a launch).  ``--gpu``: on a CUDA device
with the runtime's real state (its ring, a plan made by real due calls, Triton's C
launch) and compressor_bench.py's other work (host ops and a small kernel), as
compressor_bench's "after other work" times the whole call.

``--against REV``: the call as git revision REV had it (or as a file holding api.py of
another version has it), compiled in today's api namespace, against today's, cold, the
two alternated round by round: their medians and the paired ratio.  A trim worth a few
percent of the call resolves here, where compressor_bench's hosts differ by more.

``--compiled`` (the native launch built): the native plan's call as api._fast makes it
in Python against the compiled one (native_launch.cpp's ``due``, what api.trace calls
for a native plan), the same way; on the CPU with a stand-in launch (libc's ``abs``).
The state is put back after the other work, before each call, which warms what it
touches: the cold figures read ~2 µs low on the CPU VM, both calls alike.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import collections
import inspect
import linecache
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from unittest import mock

import torch

from compressor_bench import OtherWork, host_loop
from stats import HEADER, bootstrap, cells

from source_patch.runtime.trace import api, device, hub, plan as plan_module, ring as ring_module

LAYOUT = (64, 4, 256)
STATS_SHAPE = (2, 5, 256)  # [splits, statistics, columns]: what the fused kernel writes


class Launch:
    shape = STATS_SHAPE
    compiled = (lambda *arguments: None, (1, 2, 1), (0xF00, False, True, None, None),
                (256, 256, 128, 5, 16, 128, 0, 1))  # (C launch, before, middle, after): fused._launcher's shape


def stand_ins(x: torch.Tensor):
    """api's trace state set for one planned subscription of ``x``'s layout; the plan."""
    sub = hub.parse_subscription({"op": "subscribe", "id": "bench", "names": ["h"], "compressor": {"kind": "tiles"}})
    plan = plan_module.Plan(sub, x, Launch)  # as plan.make builds it
    device.known_streams[(plan.device, 0)] = (object(), 0)
    ring = ring_module.Ring()  # the forwarder's ring, as if pinned: a stand-in device address
    ring.device_address, ring.lock = 1 << 40, api._lock  # (the lock, as lifecycle.py sets it where it serves)
    for name, value in (("_ring", ring), ("_stepping", True), ("_publisher", threading.current_thread()),
                        ("_capturing", lambda: False), ("_stream_of", lambda index: (0, plan.device, 1)),
                        ("_fast_ring", ring), ("_hook_calls", ([], []))):  # what api._arm sets on a GPU
        setattr(api, name, value)
    api._config = {**api._config, "queue": 1 << 30, "device_timing": False}
    return plan


def due_call(plan, x: torch.Tensor) -> tuple:
    """(one due call then the state put back so that the next one is due again, the
    putting back alone)."""
    key, tags, ring, sub = ("h", 1), {"layer": 1}, api._ring, plan.sub

    def put_back() -> None:
        sub.next_step.clear()
        ring.head = ring.tail = 0
        api._pending.clear()
        api._unsealed.clear()
        api._records.clear()
        api._durations.clear()

    def due() -> None:
        if not api._fast(plan, key, x, tags) or not api._records:
            raise RuntimeError("the planned call refused the stand-ins: this bench is out of step with api._fast")

    def call() -> None:
        due()
        put_back()
    return call, put_back, due


def timed(fn, rounds: int, calls: int) -> list:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def cold_round(fn, put_back, other, calls: int = 40) -> float:
    """Microseconds per call of ``fn``, each call timed alone after ``other()`` (the state
    put back untimed): compressor_bench's host_loop, one batch."""
    return host_loop(lambda _: fn(), "cpu", 1, calls, before=lambda: (other(), put_back()))


# (part, the line of api._fast it ends with, the launch it is part of): --cuts times the
# call cut after each (the native launch checks the tensor itself: no getters before it)
CUTS = (("the call, the due test", "return True  # not due", "both"),
        ("the ring, the native plan", "native = plan.native", "both"),
        ("isinstance", "return False  # (a value", "direct"),
        ("tensor.data_ptr()", "address = tensor.data_ptr()", "direct"),
        ("the layout (four torch getters)", "plan.stale = True  # plan again", "direct"),
        ("Triton's launch hooks", "return False  # a profiler", "both"),
        ("the current stream (the capture test off stream 0)", "return False  # no Python runs", "direct"),
        ("the tags", "context = ambient._context", "both"),
        ("the lock, the queue's length, the ring's head", "head = ring.head", "both"),
        ("the ring's arithmetic", "end = head + plan.padded", "both"),
        ("the stream cache", "stream, raw = _known_streams", "direct"),
        ("the launch's arguments", "args[plan.at_stream], args[at]", "direct"),
        ("the launch", "plan.call(*args)", "direct"),
        ("the native launch (the layout, the stream read in it)", "status = plan.native_launch(native, tensor, output)",
         "native"),
        ("the record queued", "_tracer = _get_ident()", "both"))


def cut(marker: str):
    """api._fast ending after the line that holds ``marker`` (an exception it raises
    from then on propagates); where that line is in a branch, the cut falls through."""
    lines = textwrap.dedent(inspect.getsource(api._fast)).split("\n")
    at = [i for i, line in enumerate(lines) if marker in line]
    if len(at) != 1:
        raise SystemExit(f"--cuts: {marker!r} is in {len(at)} lines of api._fast: this bench is out of step with it")
    i = at[0]
    return fast_from("\n".join(lines[: i + 1] + [" " * indent_of(lines[i]) + "return True"] + closers(lines, i)))


def fast_from(source: str):
    """The ``_fast`` that ``source`` defines, compiled in today's api namespace."""
    namespace: dict = {}
    exec(compile(source, api.__file__, "exec"), vars(api), namespace)
    return namespace["_fast"]


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def closers(lines: list, i: int) -> list:
    """What closes each ``try:`` still open at line ``i``, innermost first: its own
    ``finally:`` block where it has one (the lock given back), else a re-raise."""
    out = []
    for t in reversed(range(i)):
        indent = indent_of(lines[t])
        if lines[t].strip() != "try:" or any(indent_of(line) == indent and line.strip().startswith(("except", "finally"))
                                             for line in lines[t + 1: i + 1]):
            continue  # not a try, or one closed before the cut
        after = next(k for k in range(i + 1, len(lines)) if lines[k].strip() and indent_of(lines[k]) == indent)
        if lines[after].strip() == "finally:":
            end = next((k for k in range(after + 1, len(lines)) if lines[k].strip() and indent_of(lines[k]) <= indent),
                       len(lines))
            out += lines[after:end]
        else:
            out += [" " * indent + "except Exception:", " " * indent + "    raise"]
    return out


def real_state(x: torch.Tensor):
    """(a CUDA device) api's trace state as a training process has it (hub: process): the
    shared ring, one tiles subscription, a plan made by real due calls; the plan."""
    from source_patch.runtime.trace import compress

    ring = ring_module.shared()
    if ring is None or not ring.pin():
        raise SystemExit("--gpu: no page-locked ring here")
    compress.NATIVE_LAUNCH = False  # the direct launch's plan (native_twin makes the native one)
    for name, value in (("_ring", ring), ("_enabled", True), ("_stepping", True),
                        ("_publisher", threading.current_thread())):  # alive: no publisher takes the results
        setattr(api, name, value)
    api._config = {**api._config, "queue": 1 << 30, "device_timing": False}
    api.set_subscriptions([hub.parse_subscription({"op": "subscribe", "id": "bench", "names": ["h"],
                                                   "compressor": {"kind": "tiles"}})])
    for _ in range(3):  # the first due call takes the general path and makes the plan
        api.trace("h", x, layer=1)
        api.trace_step()
    plan = api._table.plans.get(("h", 1))
    if not isinstance(plan, plan_module.Plan) or api._fast_ring is not ring:
        raise SystemExit("--gpu: no planned due call here (Triton's direct launch unavailable?)")
    return plan


def native_twin(plan, x: torch.Tensor):
    """(a CUDA device) ``plan``'s twin launched by native.py's launch, or None where it is
    not built (source-patch build-native): both alternate in one run."""
    from source_patch.runtime.trace import compress

    with mock.patch.object(compress, "NATIVE_LAUNCH", True):
        twin = api._make_plan((plan.sub,), x)
    return twin if isinstance(twin, plan_module.Plan) and twin.native is not None else None


def cpu_twin(plan, x: torch.Tensor):
    """(the CPU, after stand_ins) ``plan``'s twin with the native launch and the compiled
    due call, its launch a stand-in (libc's ``abs``: abs(0) is 0, nothing launched); None
    where the native launch is not built for this torch (source-patch build-native)."""
    from source_patch.runtime.trace import native

    module = native.load()
    if module is None:
        return None
    twin = plan_module.Plan(plan.sub, x, Launch)
    launch = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value
    twin.native = module.plan(x, launch, 0, (1, 1, 1), 128, 0, "pp", (), twin.nbytes, twin.padded)
    twin.native_launch, twin.due, twin.stream = module.launch, module.due, "a stand-in stream"
    api._arm_compiled(api._ring)
    return twin


def compiled_rows(twin, x: torch.Tensor, put_back) -> dict:
    """against_table's rows for --compiled: api._fast, and ``twin.due`` checked to make the
    call itself (not hand it to api._fast: tracing not armed, another layout, another
    stream current), else the bench exits."""
    def refused(*args):
        raise SystemExit("--compiled: the compiled call handed the call to api._fast here")
    with mock.patch.object(api, "_fast", refused):
        twin.due(twin, ("h", 1), x, {"layer": 1})
    if not api._records:
        raise SystemExit("--compiled: the compiled call queued nothing (the queue or the ring full?)")
    put_back()
    return {"the call in Python (api._fast)": api._fast, "the call compiled (due)": twin.due}


def fast_at(where: str):
    """api._fast as ``where`` has it: a file (an api.py), else a git revision of this
    checkout (fast_from)."""
    if os.path.isfile(where):
        source = Path(where).read_text()
    else:
        got = subprocess.run(["git", "show", f"{where}:runtime/trace/api.py"], cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True)
        if got.returncode:
            raise SystemExit(f"--against {where}: neither a file nor a revision git knows here: {got.stderr.strip()}")
        source = got.stdout
    found = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_fast"]
    if not found:
        raise SystemExit(f"--against {where}: no _fast in its api.py")
    return fast_from(ast.get_source_segment(source, found[0]))


def against_table(plan, x: torch.Tensor, put_back, rounds: int, other, calls: dict) -> None:
    """Two calls, ``{row: call}``, then and now (another version's and today's, or the call
    from Python and compiled), each timed alone after ``other``, cold, alternated round by
    round (the order flipping): medians and the paired ratio, now / then."""
    key, tags = ("h", 1), {"layer": 1}
    samples: dict = {name: [] for name in calls}
    for r in range(rounds):
        for name, fn in list(calls.items())[:: 1 if r % 2 else -1]:
            samples[name].append(cold_round(lambda: fn(plan, key, x, tags), put_back, other))
        if x.is_cuda:
            torch.cuda.synchronize()
    put_back()
    print(f"\n{'the whole call, cold (µs)':44}{HEADER}")
    for name, values in samples.items():
        print(f"{name:44}{cells(values)}")
    then, now = samples.values()
    ratios = [b / a for b, a in zip(now, then)]
    ratio, low, high = bootstrap(statistics.median, ratios)
    print(f"{'now / then, paired by round':44}{ratio:.3f}x ({low:.3f} .. {high:.3f})")


def cuts_table(plan, x: torch.Tensor, put_back, rounds: int, other, twin=None, of_twin: bool = False) -> None:
    """The medians of the call cut after each part (of ``twin``'s, the native launch, with
    ``of_twin``), each cut timed alone after ``other``, the cuts alternated round by
    round; the whole call of ``twin`` too where given; then a few operations alone."""
    key, tags = ("h", 1), {"layer": 1}
    cutting = twin if of_twin else plan
    launch = "native" if of_twin else "direct"
    calls = {label: (cut(marker), cutting) for label, marker, part in CUTS if part in ("both", launch)}
    calls["the whole call"] = (api._fast, plan)
    if twin is not None:
        calls["the whole call, native launch"] = (api._fast, twin)
        if getattr(twin, "due", None) is not None:
            calls["the whole call compiled (native_launch.cpp's due)"] = (twin.due, twin)
    lock = api._lock

    def lock_alone() -> None:  # as the call takes it
        lock.acquire()
        try:
            pass
        finally:
            lock.release()

    def lock_with() -> None:  # as it took it before
        with lock:
            pass
    alone = {"an empty call": lambda: None, "a lock taken and given back": lock_alone,
             "the same by `with`": lock_with}
    if x.is_cuda:  # (the stand-in's launch does nothing: nothing to learn on the CPU)
        args, out = list(plan.args), torch.empty(plan.dims, device=x.device)
        stream = torch._C._cuda_getCurrentRawStream(x.device.index)
        args[plan.at_stream], args[plan.at_input], args[plan.at_input + 1] = stream, x.data_ptr(), out.data_ptr()
        alone["the launch, its arguments ready"] = lambda: plan.call(*args)
        if twin is not None:
            alone["the native launch (the layout checked, the stream read)"] = \
                lambda: twin.native_launch(twin.native, x, out.data_ptr())
    samples: dict = {label: [] for label in [*calls, *alone]}
    for _ in range(rounds):
        for label, (fn, of) in calls.items():
            samples[label].append(cold_round(lambda: fn(of, key, x, tags), put_back, other))
        for label, fn in alone.items():
            samples[label].append(cold_round(fn, lambda: None, other))
        if x.is_cuda:
            torch.cuda.synchronize()
    put_back()
    print(f"\n{'cut after each part, each call alone, cold (µs)':52}{'median':>8}{'part':>8}{'90% interval':>18}")
    before = None
    for label, values in samples.items():
        median = statistics.median(values)
        _, low, high = bootstrap(statistics.median, values)
        part = f"{median - before:8.2f}" if before is not None and label in calls else f"{'':8}"
        print(f"{label:52}{median:8.2f}{part}{low:9.2f} ..{high:6.2f}")
        before = median if label in calls else before


def bytecodes(call) -> collections.Counter:
    """(function, file, line) -> bytecodes run, in _fast and what it calls in Python."""
    counts: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True

        def local(frame, event, arg):
            if event == "opcode" and frame.f_code.co_filename != __file__:  # not the bench's stand-ins
                counts[(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno)] += 1
            return local
        return local
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20000, help="due calls a round")
    p.add_argument("--lines", action="store_true", help="the bytecodes of every line")
    p.add_argument("--cold-rounds", type=int, default=40, help="rounds of 40 calls, each after other work")
    p.add_argument("--cuts", action="store_true", help="the call cut after each part, cold (see above)")
    p.add_argument("--gpu", action="store_true", help="--cuts on a CUDA device with the runtime's real state; "
                   "with the native launch built (source-patch build-native), its whole call too")
    p.add_argument("--native", action="store_true", help="--gpu: cut the call of the native launch instead")
    p.add_argument("--against", metavar="REV", help="the call at git revision REV (or in an api.py file) against "
                   "today's, cold, alternated (see above)")
    p.add_argument("--compiled", action="store_true", help="the native plan's call in Python (api._fast) against "
                   "the compiled one (native_launch.cpp's due), cold, alternated (the CPU: a stand-in launch)")
    args = p.parse_args()
    before = fast_at(args.against) if args.against else None
    if args.gpu:
        x = torch.randn(1024, 4, 1024, device="cuda")  # compressor_bench's hidden state
        plan = real_state(x)
        twin = native_twin(plan, x)
        if args.native and twin is None:
            raise SystemExit("--native: no native launch built for this torch (source-patch build-native)")
        _, put_back, _ = due_call(plan, x)
        print(f"the planned due call (api._fast) on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"Python {sys.version.split()[0]}; the native launch {'built' if twin else 'not built'}")
        if before is not None:
            against_table(twin or plan, x, put_back, args.cold_rounds, OtherWork("cuda"),
                          {f"the call at {Path(args.against).name}": before, "the call now": api._fast})
        if args.compiled:
            if getattr(twin, "due", None) is None:
                raise SystemExit("--compiled: no compiled due call here (source-patch build-native)")
            against_table(twin, x, put_back, args.cold_rounds, OtherWork("cuda"), compiled_rows(twin, x, put_back))
        if args.cuts or (before is None and not args.compiled):
            cuts_table(plan, x, put_back, args.cold_rounds, OtherWork("cuda"), twin, args.native)
        return
    torch.set_num_threads(1)
    x = torch.randn(LAYOUT)
    plan = stand_ins(x)
    if args.compiled:
        twin = cpu_twin(plan, x)
        if twin is None:
            raise SystemExit("--compiled: no native launch built for this torch (source-patch build-native)")
        _, put_back, _ = due_call(twin, x)
        print(f"the planned due call on {x.device}, torch {torch.__version__}, Python {sys.version.split()[0]}: "
              "the native plan's, its launch a stand-in")
        against_table(twin, x, put_back, args.cold_rounds, OtherWork("cpu"), compiled_rows(twin, x, put_back))
        return
    call, put_back, due = due_call(plan, x)
    call()  # the first call: caches filled, specialised bytecodes in place
    counts = bytecodes(call)
    by_function = collections.Counter()
    for (function, _, _), n in counts.items():
        by_function[function] += n
    print(f"the planned due call (api._fast) on {x.device}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    print("bytecodes a call runs: " + ", ".join(f"{f} {n}" for f, n in by_function.most_common()))
    if args.lines:
        for (function, filename, line), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
            text = linecache.getline(filename, line).strip() if line else ""
            print(f"{n:5}  {function}:{line}  {text[:100]}")
    print(f"\n{'warm, µs a call':44}{HEADER}")
    print(f"{'planned due call, the state put back after':44}{cells(timed(call, args.rounds, args.calls), 1e6)}")
    print(f"{'the state put back alone':44}{cells(timed(put_back, args.rounds, args.calls), 1e6)}")
    print(f"{'after other work (each call alone), µs':44}{HEADER}")
    other = OtherWork("cpu")
    print(f"{'planned due call':44}{cells([cold_round(due, put_back, other) for _ in range(args.cold_rounds)])}")
    if before is not None:
        against_table(plan, x, put_back, args.cold_rounds, other,
                      {f"the call at {Path(args.against).name}": before, "the call now": api._fast})
    if args.cuts:
        cuts_table(plan, x, put_back, args.cold_rounds, other)
    put_back()  # nothing left queued for the runtime's flush at exit (its stream is a stand-in)


if __name__ == "__main__":
    main()
