"""What a traced tensor costs: device time of each compressor on one hidden-state-
sized tensor, and host time of the trace() call itself.

    python bench/compressor_bench.py            # GPU: [1024, 4, 1024] float32 and bfloat16
    python bench/compressor_bench.py --quick    # CPU smoke run

Table 1: CUDA-event time per call (median of --iters), the input already on the
device, the launches queued behind a sleep so that only the GPU's time is counted;
for the runtime's compressors, the device stage (reduce) only: tiles leaves
its per-tile step to the publisher's host stage.  Two alternatives to the runtime's
tiles run side by side: the reduction over (rows, within-tile) at once that the
runtime used before, and a two-kernel variant (var_mean + aminmax over the rows,
then the tiles).  A second of warm-up
work runs first: the first variant timed used to read high.

Table 2: host time of trace() on the calling thread, the way a training step calls
it: one call per layer (50 "layers"), then trace_step().  Disabled, enabled with no
subscription for the name, and with a tiles subscription (compressor launch, async
copy, queueing).  On a GPU nothing waits for the device there, so this is the launch
cost the training thread pays; "after other work" times each due call alone after
work like a training layer's between two calls (other torch ops on the host and the
device, a pass over 32 MiB), which leaves the call's code and data out of the caches:
in training a due call reads ~4x its back-to-back time.  Two variants tell the parts
of that apart: the same work on one host thread (torch's intra-op threads idle, not
spinning beside the call), and a layer's host side as a GPU step runs it (the ops
launched on device tensors, nothing computed on the host).  Then the CPU time per frame
of the publisher thread
(host stage, encoding) and of the hub thread (sending), with a real hub and a
recording client (trace_client record) in another process: in a training process
these threads take the GIL from the training thread.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

from source_patch.runtime.core.endpoint import free_port  # noqa: E402
from source_patch.runtime.trace import compress as tc  # noqa: E402


def tiles_at_once(x: torch.Tensor, tiles: int = 64) -> torch.Tensor:
    """The runtime's tiles before: each stat one reduction over (rows, within-tile)."""
    part = x.reshape(-1, x.shape[-1]).unflatten(1, (tiles, -1))
    count = part.shape[0] * part.shape[2]
    return torch.stack([part.sum((0, 2), dtype=torch.float32) / count,
                        torch.linalg.vector_norm(part, math.inf, (0, 2), dtype=torch.float32),
                        torch.linalg.vector_norm(part, 2, (0, 2), dtype=torch.float32) / math.sqrt(count)])


def tiles_two_kernels(x: torch.Tensor, tiles: int = 64) -> torch.Tensor:
    """Mean and mean square from one var_mean pass, abs-max from one aminmax pass."""
    rows = x.reshape(-1, x.shape[-1])
    var, mean = torch.var_mean(rows.float() if rows.dtype != torch.float32 else rows, 0, correction=0)
    low, high = torch.aminmax(rows, dim=0)
    by_tile = torch.stack([mean, var + mean * mean, torch.maximum(low.abs(), high.abs()).float()]
                          ).unflatten(1, (tiles, -1))
    stats = torch.cat([by_tile[:2].mean(2), by_tile[2:].amax(2)])
    return torch.cat([stats[:1], stats[2:], stats[1:2].sqrt()])


def torch_tiles(x: torch.Tensor) -> torch.Tensor:
    """The runtime's tiles device stage without the fused Triton kernel (setting triton: false)."""
    tc.USE_TRITON = False
    try:
        return TILES.reduce(x)
    finally:
        tc.USE_TRITON = True


TILES = tc.parse({"kind": "tiles"})


def timed(fn, x, iters: int) -> float:
    """Median milliseconds per call.  On a GPU the stream first sleeps (~0.5 ms) so that
    the start event, the launches and the end event are all queued before the GPU
    reaches them: the events then time the kernels, not the host's launch latency
    (which an idle GPU would wait through, and which Table 2 reports)."""
    for _ in range(3):
        fn(x)
    samples = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(x)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def host_loop(fn, device: str, reps: int, calls: int, between=None, before=None) -> float:
    """Median host microseconds per call of ``fn(i)`` over batches of ``calls`` calls;
    after each batch the device is synchronised and ``between()`` runs (untimed).
    With ``before``: it runs ahead of each call, untimed, and each call is timed alone."""
    samples = []
    for _ in range(reps):
        if before is None:
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            elapsed = time.perf_counter() - t0
        else:
            elapsed = 0.0
            for i in range(calls):
                before()
                t0 = time.perf_counter()
                fn(i)
                elapsed += time.perf_counter() - t0
        samples.append(elapsed / calls * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
        if between is not None:
            between()
    return statistics.median(samples)


class OtherWork:
    """What runs between two due calls in training, untimed.  ``host`` (the bench's
    first measure): other torch ops on the host (their dispatch code, on torch's
    intra-op threads), a few small device kernels, and a pass over 32 MiB of memory;
    ``one thread``: the same on one host thread (torch's other threads idle, not
    spinning beside the call); ``gpu``: a layer's host side as a GPU step runs it, the
    ops launched on device tensors (norm, matmul, softmax, gelu, reductions, a sort)
    and nothing computed on the host."""

    def __init__(self, device: str, elements: int = 8 << 20, kind: str = "host"):
        self.kind = kind
        self.memory = torch.ones(elements) if kind != "gpu" else None
        on = device if kind == "gpu" else "cpu"
        self.small = torch.randn(64, 64, device=on)
        self.device = torch.randn(4096, device=device) if device == "cuda" else None

    def __call__(self) -> None:
        threads = torch.get_num_threads()
        if self.kind == "one thread":
            torch.set_num_threads(1)
        try:
            if self.memory is not None:
                self.memory.sum()
            x = torch.nn.functional.layer_norm(self.small, (64,))
            x = torch.nn.functional.gelu(torch.softmax(x @ self.small, -1)).sum(0)
            torch.sort(torch.cumsum(x, 0))
            if self.device is not None:
                torch.nn.functional.relu_((self.device * 2).add_(1))
        finally:
            if self.kind == "one thread":
                torch.set_num_threads(threads)


def triton_launch(direct: bool):
    """Within the block, the fused kernel's launches as the trace setting
    ``triton_launch`` makes them: direct, or through Triton's dispatch (``triton``)."""
    return mock.patch.object(tc, "DIRECT_LAUNCH", direct)


class Variant(NamedTuple):
    """A way of making due trace() calls: one event per batch (the runtime's way) or
    one per result, direct launches or Triton's dispatch, back to back or each after
    other work; ``against``: the variant it differs from in one thing."""
    label: str
    row: str  # its row in the host-time table
    per_batch: bool = True
    direct: bool = True
    after_other_work: bool | str = False  # True: OtherWork "host"; else its kind
    against: str | None = None
    gpu_only: bool = False
    planned: bool = True  # the runtime's planned due call (api._fast) where it applies; False: the general path
    native: bool | str = False  # the planned call through the native launch (triton_launch: native; where
    # built): the whole call compiled (native_launch.cpp's due); "python": api._fast calls the native launch


VARIANTS = (
    Variant("due", "tiles subscription, due"),
    Variant("due, general path", "  the same, the general path (no plan)", planned=False, against="due",
            gpu_only=True),
    Variant("due, an event per result", "  the same, an event per result", per_batch=False, against="due"),
    Variant("due, Triton's dispatch each call", "  the same, Triton's dispatch each call", direct=False,
            against="due", gpu_only=True),
    Variant("after other work", "  the same, after other work", after_other_work=True, against="due"),
    Variant("after other work, general path", "  after other work, the general path", after_other_work=True,
            planned=False, against="after other work", gpu_only=True),
    Variant("after other work, an event per result", "  after other work, an event per result", per_batch=False,
            after_other_work=True, against="after other work"),
    Variant("after other work, one host thread", "  after other work on one host thread",
            after_other_work="one thread", against="after other work"),
    Variant("after a layer's GPU launches", "  after a layer's GPU launches (no host compute)",
            after_other_work="gpu", against="after other work", gpu_only=True),
    Variant("after other work, native launch", "  after other work, the native launch", after_other_work=True,
            against="after other work", gpu_only=True, native=True),
    Variant("after other work, native launch from Python", "  after other work, the native launch from Python",
            after_other_work=True, against="after other work, native launch", gpu_only=True, native="python"),
    Variant("after a layer's GPU launches, native launch", "  after a layer's GPU launches, the native launch",
            after_other_work="gpu", against="after a layer's GPU launches", gpu_only=True, native=True),
)
_native_plans: dict = {}  # the native variants' own plans, made at their first due calls and kept
_python_plans: dict = {}  # ... and those of the native launch from Python (api._fast)


def native_built() -> bool:
    """The native launch is built for this torch (source-patch build-native)."""
    try:
        from source_patch.runtime.trace import native
    except ImportError:  # a wheel from before it (bench/ab_wheels.sh)
        return False
    return native.load() is not None


def path(rt, planned: bool, native: bool = False):
    """Within the block, due calls take the planned path (the runtime's own way), through
    the native launch with plans of their own (``native``; "python": its plans' compiled
    due call set aside, api._fast launches), or, with the plans set aside, the general
    one (_emit, _compress, _device_stage, ...)."""
    if planned and not native:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if native:
        stack.enter_context(mock.patch.object(tc, "NATIVE_LAUNCH", True))
        stack.enter_context(mock.patch.object(rt._table, "plans", _python_plans if native == "python" else _native_plans))
        if native == "python":
            make = rt._make_plan

            def from_python(*args):
                plan = make(*args)
                if plan and hasattr(type(plan), "due"):  # (a wheel from before the compiled call has none)
                    plan.due = None
                return plan
            stack.enter_context(mock.patch.object(rt, "_make_plan", from_python))
    else:
        stack.enter_context(mock.patch.object(rt._table, "plans", {}))
        stack.enter_context(mock.patch.object(rt, "_make_plan", lambda *args: False))
    return stack


def due_variants(rt, x: torch.Tensor, device: str, reps: int, layers: int, step_end, others: dict) -> dict:
    """{Variant: microseconds per due trace() call, one sample per round of ``layers``
    calls (then trace_step)}, the variants alternated round by round so that drift
    hits them alike (Triton's dispatch and the general path on a GPU only)."""
    gpu = x.is_cuda and tc.fused_kernel() is not None
    native = gpu and native_built()
    samples: dict = {v: [] for v in VARIANTS if (gpu or not v.gpu_only) and (native or not v.native)}
    for _ in range(reps):
        for v in samples:
            with mock.patch.object(rt, "PER_BATCH_EVENTS", v.per_batch), triton_launch(v.direct), \
                    path(rt, v.planned, v.native):
                # what the runtime checks once a step, for this variant (a wheel from before _arm
                # checks it at each call: bench/ab_wheels.sh runs this bench against one)
                getattr(rt, "_arm", lambda: None)()
                samples[v].append(host_loop(lambda layer: rt.trace("traced", x, layer=layer), device, 1, layers,
                                            step_end, before=others.get(v.after_other_work)))
    return samples


def print_variants(samples: dict, hub: str, layers: int) -> None:
    """min, median and its 90% interval per variant; against the variant it differs
    from in one thing, the paired ratio of medians and its interval."""
    from stats import bootstrap, ratio_of_medians

    by_label = {v.label: values for v, values in samples.items()}
    reps = len(next(iter(samples.values())))
    print(f"\n-- due trace() calls, hub: {hub}: us per call, {reps} rounds of {layers} calls, alternated")
    print(f"{'variant':40}{'min':>8}{'median':>9}{'90% interval':>18}   against")
    for v, values in samples.items():
        _, low, high = bootstrap(statistics.median, values)
        line = f"{v.label:40}{min(values):8.1f}{statistics.median(values):9.1f}{low:9.1f} ..{high:6.1f}"
        if v.against is not None:
            ratio, r_low, r_high = bootstrap(ratio_of_medians, values, by_label[v.against], paired=True)
            line += f"   {ratio:.3f}x ({r_low:.3f} .. {r_high:.3f}) of '{v.against}'"
        print(line)


def due_call_parts(rt, x: torch.Tensor, reps: int, calls: int, others: dict | None = None) -> list[tuple[str, float]]:
    """Host microseconds of each call a due trace() makes on a CUDA tensor with the
    forwarder's ring (hub: process), timed alone the way host_loop times trace(): where
    a due call's time goes, without a profiler's own cost per call (~1 us, as much as
    most of the parts)."""
    fused = tc.fused_kernel()
    ring, index, stats = rt._ring, x.device.index, tuple(TILES.params["stats"])
    stream = rt._current_stream(index)
    pool = rt._events.setdefault((index, False), collections.deque())
    fused.column_stats(x, stats)  # the layout's first launch (Triton's): the direct ones follow
    launch = next(v for k, v in fused._launches.items() if k[0] == x.shape and k[4] == stats)
    call, head, middle, tail = launch.compiled
    out = torch.empty(launch.shape, device=x.device)
    raw_stream = torch._C._cuda_getCurrentRawStream(index)

    def timed(fn, between=None, before=None) -> float:
        return host_loop(lambda _: fn(), "cuda", reps, calls, between, before)

    def launch_alone() -> None:
        call(*head, raw_stream, *middle, x.data_ptr(), out.data_ptr(), *tail)

    def event() -> None:
        event = pool.pop() if pool else torch.cuda.Event()
        event.record(stream)
        pool.append(event)

    return [
        ("torch.cuda.is_current_stream_capturing()", timed(torch.cuda.is_current_stream_capturing)),
        ("torch._C._cuda_getDevice()", timed(torch._C._cuda_getDevice)),
        ("torch._C._cuda_getCurrentRawStream(i)", timed(lambda: torch._C._cuda_getCurrentRawStream(index))),
        ("torch._C._cuda_getCurrentStream(-1)", timed(lambda: torch._C._cuda_getCurrentStream(-1))),
        ("api._current_stream(i)", timed(lambda: rt._current_stream(index))),
        ("pooled event.record(stream)", timed(event)),
        ("ring.claim(shape)", timed(lambda: ring.claim(launch.shape), ring.reset)),
        ("the launch alone (arguments ready)", timed(launch_alone)),
        # what no Python on our side can remove: the launch's own cost, cold (item 3's floor)
        *([row for kind, after in (("", others[True]), (", one host thread", others["one thread"]),
                                   (", GPU launches", others["gpu"]))
           for row in ((f"the launch alone, after other work{kind}", timed(launch_alone, before=after)),
                       (f"torch.cuda.current_stream(), after other work{kind}",
                        timed(torch.cuda.current_stream, before=after)),
                       (f"torch._C._cuda_getCurrentStream(-1), after other work{kind}",
                        timed(lambda: torch._C._cuda_getCurrentStream(-1), before=after)))]
          if others else []),
        ("fused.column_stats(x) into device memory", timed(lambda: fused.column_stats(x, stats))),
        ("fused.column_stats(x, ring.claim)", timed(lambda: fused.column_stats(x, stats, ring.claim), ring.reset)),
        ("TILES.reduce(x, ring.claim)", timed(lambda: TILES.reduce(x, ring.claim), ring.reset)),
        ("api._device_stage(TILES, x, ring)", timed(lambda: rt._device_stage(TILES, x, ring, rt._copying), ring.reset)),
    ]


def host_costs(device: str, shape, tmp: str, hub: str, reps: int = 30, layers: int = 50,
               profile: bool = False, other_elements: int = 8 << 20) -> list[tuple[str, float]]:
    """Microseconds per trace() call on the calling thread (see the module doc), and
    the CPU time per frame of the publisher and hub threads, with a real hub and a
    recording client (trace_client record) in another process."""
    import importlib
    import os
    import subprocess

    rt = importlib.import_module("source_patch.runtime.trace.api")
    control = importlib.import_module("source_patch.runtime.trace.control")
    x = torch.randn(shape, device=device)

    def step_end() -> None:
        rt.trace_step()
        control.flush(10)

    def per_call(name: str, enabled: bool) -> float:
        rt._enabled = enabled
        try:
            return host_loop(lambda layer: rt.trace(name, x, layer=layer), device, reps, layers, step_end)
        finally:
            rt._enabled = True

    port = free_port()
    # the variants' own launch (direct, or the native variants'), not the default's choice
    launch = {"triton_launch": "direct"} if native_built() else {}
    control.configure(enable=True, port=port, token="bench", dir=tmp, client_queue=1 << 14, hub=hub, **launch)
    recorder = subprocess.Popen([sys.executable, "-m", "source_patch.runtime.trace.client", "record",
                                 "--url", f"127.0.0.1:{port}", "--token", "bench", "--name", "traced",
                                 "--out", os.path.join(tmp, "rec.sptrace"), "--retry", "30"],
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not control.state()["subscriptions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not control.state()["subscriptions"]:  # no hub, or no client: every call would time a flag test
            error = control.state()["last_error"] or "no error"
            raise SystemExit(f"no client subscribed within 60 s (the hub: {error})")
        rows = [("disabled", per_call("traced", False)),
                ("enabled, name not subscribed", per_call("idle", True))]
        before = control.state()
        others = {True: OtherWork(device, other_elements),
                  **{kind: OtherWork(device, other_elements, kind) for kind in ("one thread", "gpu")}}
        samples = due_variants(rt, x, device, reps, layers, step_end, others)
        print_variants(samples, hub, layers)
        rows += [(v.row, statistics.median(values)) for v, values in samples.items()]
        if profile and x.is_cuda and hub == "process" and tc.fused_kernel() is not None:
            print(f"\n-- the parts of a due call, timed alone (hub: {hub}), us")
            for label, micros in due_call_parts(rt, x, reps, layers, others):
                print(f"{label:44}{micros:8.2f}")
        if profile:  # where a due call's time goes, by function (own time)
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(per_call, "traced", True)
            print(f"\n-- cProfile of {reps * layers} due calls, hub: {hub}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        # The parts of a due call as trace() runs them: the device stage (into the
        # forwarder's ring with hub: process; its slices forgotten after each batch,
        # nothing reads them), and an event taken from the pool and given back to it
        # (as the publisher does; without that every call would create one).
        ring = rt._ring
        stage = host_loop(lambda _: rt._device_stage(TILES, x, ring, rt._copying), device, reps, layers,
                          ring.reset if ring is not None else None)
        rows.append(("  of which: device stage (process: into the ring)", stage))
        if x.is_cuda:  # a CPU result needs no event
            pool = rt._events.setdefault((x.device.index, False), collections.deque())
            rows.append(("  of which: event (from the pool)",
                         host_loop(lambda _: pool.append(rt._record(x.device.index, False)), device, reps, layers)))
        rows.append(("  device stage, torch reductions", host_loop(lambda _: torch_tiles(x), device, reps, layers)))
        if x.is_cuda and tc.fused_kernel() is not None:
            with triton_launch(False):
                rows.append(("  device stage, Triton's dispatch each call",
                             host_loop(lambda _: rt._device_stage(TILES, x, ring, rt._copying), device, reps, layers,
                                       ring.reset if ring is not None else None)))
        after = control.state()
        results = after["counters"]["results"] - before["counters"]["results"]
        frames = after["hub"]["frames_sent"] - before["hub"]["frames_sent"]
        cost = {k: after["cost_seconds"][k] - before["cost_seconds"][k] for k in after["cost_seconds"]}
        rows += [("publisher CPU per result (this process)", cost["publisher_cpu"] / max(results, 1) * 1e6),
                 (f"hub CPU per frame sent ({frames})", cost["hub_cpu"] / max(frames, 1) * 1e6)]
    finally:
        recorder.terminate()
        recorder.wait(10)
        control.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=30, help="rounds of due calls per variant (each a sample)")
    p.add_argument("--profile", action="store_true", help="where a due trace() call's host time goes: its parts "
                   "timed alone (GPU, hub: process) and a cProfile, per hub kind")
    p.add_argument("--hub", choices=("process", "thread"), action="append",
                   help="time due calls with this hub kind only (repeatable; default: both)")
    args = p.parse_args()
    if args.quick:  # a smoke run: every row, few samples (the suite runs it on a loaded 2-core VM)
        args.iters = 5
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shape = (1024, 4, 1024) if device == "cuda" else (64, 4, 256)
    with tempfile.TemporaryDirectory() as tmp:
        vector = Path(tmp) / "v.safetensors"
        save_file({"v": torch.randn(shape[-1])}, str(vector))
        fused = "fused Triton kernel" if device == "cuda" and tc.fused_kernel() is not None else "no Triton"
        variants = {f"tiles ({fused})": TILES,
                    "tiles, torch reductions": torch_tiles,
                    "tiles, rows x tile at once": tiles_at_once,
                    "tiles, var_mean + aminmax": tiles_two_kernels,
                    "histogram, 64 bins": tc.parse({"kind": "histogram"}),
                    "topk 16": tc.parse({"kind": "topk"}),
                    "projection": tc.parse({"kind": "projection", "file": str(vector)})}
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        print(f"device {name}, torch {torch.__version__}, input {list(shape)}, median of {args.iters} calls\n")
        dtypes = (torch.float32, torch.bfloat16)
        print(f"{'compressor':28}" + "".join(f"{str(d).replace('torch.', ''):>12}" for d in dtypes))
        inputs = [torch.randn(shape, device=device, dtype=d) for d in (torch.float32, torch.bfloat16)]
        warm_until = time.perf_counter() + (0.1 if args.quick else 1.0)
        while time.perf_counter() < warm_until:  # clocks up, caches and allocator warm
            for fn in variants.values():
                getattr(fn, "reduce", fn)(inputs[0])
        for label, fn in variants.items():
            stage = getattr(fn, "reduce", fn)  # the runtime's compressors: the device stage only
            print(f"{label:28}" + "".join(f"{timed(stage, x, args.iters):10.3f}ms" for x in inputs))
        check = inputs[0]
        reference = TILES(check)
        by_torch = torch.from_numpy(TILES.finish(torch_tiles(check).cpu().numpy(), check.shape))
        assert torch.allclose(by_torch, reference, rtol=1e-4, atol=1e-5), "torch reductions"
        for label in ("tiles, rows x tile at once", "tiles, var_mean + aminmax"):
            assert torch.allclose(variants[label](check).cpu(), reference, rtol=1e-3, atol=1e-5), label
        hubs = tuple(args.hub or ("process", "thread"))
        sizes = dict(reps=4, layers=8, other_elements=1 << 18) if args.quick else dict(reps=args.rounds)
        costs = [host_costs(device, shape, tmp, hub, profile=args.profile, **sizes) for hub in hubs]
    print(f"\n{'host time, float32 input, us':48}" + "".join(f"{'hub: ' + hub:>16}" for hub in hubs))
    for i, (label, _) in enumerate(costs[0]):
        print(f"{label:48}" + "".join(f"{rows[i][1]:16.2f}" for rows in costs))


if __name__ == "__main__":
    main()
