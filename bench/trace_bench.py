"""Step time of the real Megatron training example while its hidden states are traced
live.

Side by side in one process (the figure the goal is about): a client that reads
every frame toggles its subscription to every layer's output (TransformerLayer
output, tiles compressor) on and off every --phase steps; each step is classed by
the frames that arrived for it: `toggling: traced` (all layers, and the step before
too: a step also publishes the previous step's frames) and `toggling: not traced`
(no frames, none the step before either); transition steps are left out.  This
process runs 4 x --steps steps.  Processes
differ from each other by a few percent in step time, so only this comparison can
resolve a cost near 1%.  The rows also report what tracing cost that process
(state()["cost_seconds"]: time in trace() calls, publisher and hub CPU) per step.

Across processes (each variant its own process: patching happens at import; the
first `--warmup` steps are discarded; rounds alternate the order): no trace spec,
the trace spec with no client (idle call sites), and a client that subscribes to raw
router logits and never reads (the hub must drop it without slowing the step).

The toggling process also times each reduction on the GPU with CUDA events
(the device_timing setting: one more event per traced tensor), so the device cost
per step is known even where wall time is noisy.  `--resolve` runs only the
toggling process, --toggle-steps steps per round, to narrow the interval of the
traced / not-traced ratio (the goal needs its 90% interval within about +-0.5%).

    python bench/trace_bench.py            # GPU: a mid-size GPT-MoE
    python bench/trace_bench.py --resolve --rounds 1 --toggle-steps 1500 --phase 4
    python bench/trace_bench.py --resolve --toggle-steps 1900 --phase 4 --save run1.json   # one device call each
    python bench/trace_bench.py --pool run1.json run2.json                                 # pooled, to resolve 1%
    python bench/trace_bench.py --pool run1.json:before run2.json:toggling                 # one process of each
    python bench/trace_bench.py --quick    # CPU smoke run
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import stats  # bench/
import training

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

from source_patch.runtime.trace.client import TraceError, connect  # noqa: E402
from source_patch.runtime.core.endpoint import free_port  # noqa: E402

TOKEN = "trace-bench"
PROCESSES = ["no trace spec", "trace spec, no client", "toggling client", "stalled client"]
TRACED, UNTRACED = "toggling: traced", "toggling: not traced"
BEFORE = "before"  # toggling with other trace settings (--before-settings; default the hub in a thread, torch reductions)
AA = "A/A client"  # the same toggling traffic, subscribed to a name nothing traces (--aa)
TOGGLING = ("toggling client", BEFORE, AA)
LABELS = {"toggling client": (TRACED, UNTRACED), BEFORE: (f"{BEFORE}: traced", f"{BEFORE}: not traced"),
          AA: ("A/A: subscribed to nothing", "A/A: not subscribed")}


async def toggling_client(port: int, report: dict, phase: int, aa: bool = False) -> None:
    """Subscribe to every layer's output with tiles until frames of `phase` steps have
    arrived, unsubscribe for as long, again until the process ends; count the frames
    of each step and the process's tracing cost over the subscribed phases but the first
    (whose first launches load or compile the kernels).  ``aa``: subscribe to a name
    nothing traces instead, for `phase` steps by the process's step counter (the A/A
    check: the same requests, no tracing; steps are then classed by the requests)."""
    from websockets.exceptions import ConnectionClosed

    frames: dict = {}
    cost = {"steps": 0}
    calls: list = []  # due trace() calls by duration (state()["due_call_us"]), subscribed phases but the first
    control: list = []  # (request, the process's step when it was answered): for --save
    report.update(frames=frames, cost=cost, control=control, calls=calls)
    loop = asyncio.get_running_loop()
    first = True
    async with connect(f"127.0.0.1:{port}", TOKEN, client="bench", retry=300) as c:
        try:
            while True:
                before = await c.stats()
                await c.subscribe(["trace_bench_nothing" if aa else "layer_output"], compressor={"kind": "tiles"},
                                  id="tiles")
                control.append(("subscribe", before["step"]))
                started, steps = loop.time(), set()
                while aa and (await c.stats())["step"] <= before["step"] + phase:
                    await asyncio.sleep(0.02)
                while not aa and len(steps) <= phase:  # the first step seen may be partial
                    frame = await c.next_frame()
                    frames[frame.step] = frames.get(frame.step, 0) + 1
                    steps.add(frame.step)
                await c.unsubscribe("tiles")
                after = await c.stats()
                control.append(("unsubscribe", after["step"]))
                if first:  # its first launches load (or compile) the kernels: a one-off, not per step
                    first = False
                else:
                    for key, seconds in after["cost_seconds"].items():
                        cost[key] = cost.get(key, 0.0) + seconds - before["cost_seconds"][key]
                    cost["steps"] += after["step"] - before["step"]
                    spread = [a - b for a, b in zip(after.get("due_call_us") or [], before.get("due_call_us") or [])]
                    calls[:] = [a + b for a, b in zip(calls, spread)] if calls else spread
                report["ring"] = after.get("ring")
                off_until = loop.time() + (loop.time() - started)
                while (left := off_until - loop.time()) > 0:  # frames still in flight land here
                    try:
                        frame = await c.next_frame(left)
                        frames[frame.step] = frames.get(frame.step, 0) + 1
                    except TimeoutError:
                        break
        except (StopAsyncIteration, TraceError, ConnectionClosed):
            pass  # training ended
        report.update(client_dropped=c.dropped)


def split_steps(times: list[float], frames: dict, layers: int, warmup: int) -> list[tuple[bool, list]]:
    """Runs of consecutive steps, each (traced, times): fully traced steps (and the step
    before), or steps not traced at all (nor the step before); transition steps end a
    run.  Step i (0-based) traces with trace step i."""
    runs: list = []
    for i, t in enumerate(times):
        if i < warmup or i == 0:
            continue
        kind = step_kind(i, frames, layers)
        if kind is None:
            runs.append((None, []))
        elif runs and runs[-1][0] is kind:
            runs[-1][1].append(t)
        else:
            runs.append((kind, [t]))
    return [run for run in runs if run[0] is not None]


def step_kind(i: int, frames: dict, layers: int) -> bool | None:
    """Traced (True), not traced (False) or a transition step (None)."""
    now, before = frames.get(i, 0), frames.get(i - 1, 0)
    return True if now == before == layers else False if now == before == 0 else None


def aa_frames(control: list, layers: int) -> dict:
    """(A/A) The frames the toggling client would have counted: every layer's for each
    step after a subscribe was asked and before the unsubscribe was answered."""
    frames: dict = {}
    asked = None
    for request, step in control:
        if request == "subscribe":
            asked = step
        elif asked is not None:
            frames.update((i, layers) for i in range(asked + 1, step))
            asked = None
    return frames


def call_quantiles(counts: list, seconds: float | None = None) -> str:
    """Quantiles of the due calls' durations from their power-of-two histogram: the
    bucket each falls in, as its upper bound; with ``seconds`` (their total), the mean."""
    total = sum(counts)
    if not total:
        return "none"
    mean = f", mean {seconds / total * 1e6:.1f} us" if seconds is not None else ""
    parts, seen, wanted = [], 0, [(0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (1.0, "max")]
    for i, n in enumerate(counts):
        seen += n
        while wanted and seen >= wanted[0][0] * total:
            parts.append(f"{wanted.pop(0)[1]} <{2 ** i} us")
    return f"{total} calls{mean}: " + ", ".join(parts)


def gc_summary(times: list[float], frames: dict, layers: int, warmup: int, gc: list) -> str:
    """Collections in traced and not-traced steps (classed as split_steps does): ms per
    step, gen-2 collections, and how many of the slowest tenth of the classed steps
    collected generation 2."""
    classed = [(kind, t, gc[i]) for i, t in enumerate(times)
               if i >= max(warmup, 1) and (kind := step_kind(i, frames, layers)) is not None]
    parts = []
    for kind in (True, False):
        steps = [g for k, _, g in classed if k is kind]
        if steps:
            parts.append(f"{'traced' if kind else 'not traced'}: {statistics.fmean(g[0] for g in steps):.2f} ms/step, "
                         f"{sum(g[3] for g in steps)} gen-2 in {len(steps)} steps")
    slowest = sorted(classed, key=lambda c: -c[1])[:max(1, len(classed) // 10)]
    parts.append(f"slowest tenth: {sum(g[3] > 0 for _, _, g in slowest)} of {len(slowest)} collected gen 2")
    return "gc " + "; ".join(parts)


def paired(runs: list[tuple[bool, list]]) -> list[float]:
    """Per traced run: its median over the mean of its neighbouring not-traced runs'
    medians, minus 1.  Slow drift of the step time cancels out."""
    ratios = []
    for i, (traced, times) in enumerate(runs):
        if not traced:
            continue
        near = [statistics.median(runs[j][1]) for j in (i - 1, i + 1) if 0 <= j < len(runs) and not runs[j][0]]
        if near:
            ratios.append(statistics.median(times) / statistics.fmean(near) - 1)
    return ratios


def interval(values: list[float]) -> str:
    """The mean and a bootstrap 90% interval of it, in percent."""
    mean, low, high = stats.bootstrap(statistics.fmean, values)
    return f"{mean * 100:+.2f}% (90% interval {low * 100:+.2f}% .. {high * 100:+.2f}%)"


async def stalled_client(port: int, report: dict) -> None:
    """Subscribe to raw router logits, then never read: the hub has to drop it."""
    from websockets.asyncio.client import connect as ws_connect

    deadline = asyncio.get_running_loop().time() + 300
    while True:
        try:
            ws = await ws_connect(f"ws://127.0.0.1:{port}/ws", max_queue=1, compression=None)
            break
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
    await ws.send(json.dumps({"op": "hello", "token": TOKEN, "client": "stalled"}))
    await ws.send(json.dumps({"op": "subscribe", "id": "raw", "names": ["router_logits"],
                              "compressor": {"kind": "raw", "max_elements": 1 << 24}}))
    await ws.wait_closed()
    report.update(closed=ws.close_code)


def before_settings(text: str) -> dict:
    """``hub=thread,triton=0`` -> {"SOURCE_PATCH_TRACE_HUB": "thread", ...}"""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if not all(len(pair) == 2 for pair in pairs):
        raise ValueError(f"expected name=value,... got {text!r}")
    return {f"SOURCE_PATCH_TRACE_{name.strip().upper()}": value.strip() for name, value in pairs}


def main() -> None:
    p = training.parser(__doc__)
    p.add_argument("--phase", type=int, default=6, help="steps per on/off phase of the toggling client")
    p.add_argument("--toggle-steps", type=int, default=0, help="steps of the toggling process (default 4 x --steps)")
    p.add_argument("--resolve", action="store_true", help="run only the toggling process (traced vs not traced)")
    p.add_argument("--settings", default="device_timing=1", type=before_settings,
                   help="trace settings of the toggling process (default: device_timing=1)")
    p.add_argument("--before-settings", default="hub=thread,triton=0", type=before_settings,
                   help="trace settings of the `before` process (default: hub=thread,triton=0)")
    p.add_argument("--save", metavar="JSON", help="also write the step times, paired ratios and every toggling step's record (index, frames, seconds; the client's requests by step) here")
    p.add_argument("--pool", nargs="+", metavar="JSON", help="run nothing: pool the runs saved with --save "
                   "(several device calls of one setting) and print their comparison")
    p.add_argument("--aa", action="store_true", help="also an A/A process: the toggling client's requests, "
                   "subscribed to a name nothing traces (the protocol's own effect on the step time)")
    p.add_argument("--gc", action="store_true", help="record the garbage collector's time per step "
                   "(bench/gc_probe.py) and say whether the slow steps are the ones that collected")
    p.add_argument("--calls", action="store_true", help="time the parts of each due trace() call in the "
                   "toggling processes (bench/gc_probe.py --calls: the call, device stage, launcher, event)")
    p.add_argument("--before", action="store_true",
                   help="also a toggling process with --before-settings (by default as before issue 18)")
    args = p.parse_args()
    if args.pool:
        return pool(args.pool)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.phase = 1, 10, 2, 2
    processes = ["toggling client"] if args.resolve else list(PROCESSES)
    if args.before:
        processes.insert(1, BEFORE)
    if args.aa:
        processes.insert(1, AA)
    training.header(args)
    reports: dict = {}
    samples: dict = {name: [] for name in ["no trace spec", "trace spec, no client", UNTRACED, TRACED,
                                           "stalled client", *reversed(LABELS[BEFORE]),
                                           *LABELS[AA]]}
    pairs: dict = {}
    records: dict = {}  # per toggling process: every step's (index, frames, seconds) and the client's requests

    with tempfile.TemporaryDirectory() as root:
        def run(name: str) -> None:
            port = free_port()
            env = {"SOURCE_PATCH": "megatron_cpu" if name == "no trace spec" else "megatron_cpu,trace",
                   "SOURCE_PATCH_TRACE_PORT": str(port), "SOURCE_PATCH_TRACE_TOKEN": TOKEN,
                   "SOURCE_PATCH_TRACE_DIR": root, "SOURCE_PATCH_TRACE_STALL_TIMEOUT": "1",
                   "SOURCE_PATCH_TRACE_DEVICE_TIMING": "1" if name in TOGGLING else "0",
                   # a raw router-logits frame of the GPU model is 4M elements
                   "SOURCE_PATCH_TRACE_RAW_MAX_ELEMENTS": str(1 << 24)}
            if name in TOGGLING:
                env.update(args.before_settings if name == BEFORE else args.settings)
            report: dict = {}
            client = {"toggling client": lambda: toggling_client(port, report, args.phase),
                      BEFORE: lambda: toggling_client(port, report, args.phase),
                      AA: lambda: toggling_client(port, report, args.phase, aa=True),
                      "stalled client": lambda: stalled_client(port, report)}.get(name)
            thread = None
            if client is not None:
                # Every timed step has the client: training starts once it has subscribed
                # (a loaded 2-core CI VM connected it after a --quick run's 40 steps).
                env["SOURCE_PATCH_TRACE_WAIT"] = "300" if name == "stalled client" else "60"
                thread = threading.Thread(target=lambda: asyncio.run(client()), daemon=True)
                thread.start()
            steps = (args.toggle_steps or args.steps * 4) if name in TOGGLING else args.steps
            gc = [] if args.gc or args.calls else None
            calls = {} if args.calls and name in TOGGLING else None
            times = training.train(args, training.environment("SOURCE_PATCH_TRACE", **env), name, steps=steps,
                                   gc=gc, calls=calls)
            for part, (n, total, counts, first) in (calls or {}).items():
                print(f"{name}, {part}: first {(first or 0) / 1e3:.1f} ms, then mean {total / max(n, 1):.1f} us; "
                      f"{call_quantiles(counts)}", flush=True)
            if thread is not None:
                thread.join(60)
            if name in TOGGLING:
                frames = aa_frames(report.get("control", []), args.layers) if name == AA else report.get("frames", {})
                runs = split_steps(times, frames, args.layers, args.warmup)
                traced = [t for kind, ts in runs if kind for t in ts]
                untraced = [t for kind, ts in runs if not kind for t in ts]
                on, off = LABELS[name]
                samples[on] += traced
                samples[off] += untraced
                pairs.setdefault(name, []).extend(paired(runs))
                records.setdefault(name, []).append({
                    "steps": [[i, frames.get(i, 0), t] for i, t in enumerate(times)],
                    "control": report.get("control", []), "gc": gc})
                if gc and args.gc:
                    print(f"{name}: " + gc_summary(times, frames, args.layers, args.warmup, gc), flush=True)
                cost = dict(report.get("cost", {}))
                subscribed = max(cost.pop("steps", 0), 1)
                reports.setdefault(name, []).append(
                    {"traced": len(traced), "not traced": len(untraced), "client dropped": report.get("client_dropped"),
                     "ms per subscribed step": {k: round(v / subscribed * 1e3, 3) for k, v in cost.items()},
                     "due trace() calls": call_quantiles(report.get("calls", []), cost.get("trace_calls")),
                     "ring": report.get("ring")})
            else:
                samples[name] += times[args.warmup:]
                if report:
                    reports.setdefault(name, []).append(report)

        for r in range(args.rounds):
            for name in processes[r % len(processes):] + processes[:r % len(processes)]:
                run(name)
            training.table({k: v for k, v in samples.items() if v or not args.resolve},
                           f"after round {r + 1}/{args.rounds}")
            compare(samples, pairs)
    for name, runs in reports.items():
        print(f"{name}: {runs}")
    if args.save:
        Path(args.save).write_text(json.dumps({"samples": samples, "pairs": pairs, "reports": reports,
                                               "records": records}))


def compare(samples: dict, pairs: dict) -> None:
    training.ratio(samples, TRACED, UNTRACED)
    for name in (BEFORE, AA):
        if samples.get(LABELS[name][0]):
            training.ratio(samples, *LABELS[name])
    for name, ratios in pairs.items():
        if len(ratios) >= 3:
            print(f"{name}, paired by toggle cycle ({len(ratios)} traced runs against their "
                  f"neighbours): {interval(ratios)}", flush=True)


def pool(files: list[str]) -> None:
    """Several processes' runs as one sample.  Read the paired figure: each ratio is
    taken within one process, so the processes' different step-time levels cancel;
    the pooled medians mix those levels (their interval is the wider, honestly).
    ``FILE:before`` takes only that run's --before process, counted as a toggling
    one (a run whose two processes had the same settings); ``FILE:toggling`` only
    its first."""
    samples: dict = {}
    pairs: dict = {}
    for arg in files:
        file, _, only = arg.rpartition(":") if arg.endswith((":before", ":toggling")) else (arg, "", "")
        saved = json.loads(Path(file).read_text())
        relabel = {**dict(zip(LABELS[BEFORE], LABELS["toggling client"])), BEFORE: "toggling client"}
        for name, times in saved["samples"].items():
            if only == "before" and name.startswith(BEFORE):
                samples.setdefault(relabel[name], []).extend(times)
            elif only != "before" and not (only == "toggling" and name.startswith(BEFORE)):
                samples.setdefault(name, []).extend(times)
        for name, ratios in saved["pairs"].items():
            if only == "before" and name == BEFORE:
                pairs.setdefault(relabel[name], []).extend(ratios)
            elif only != "before" and not (only == "toggling" and name == BEFORE):
                pairs.setdefault(name, []).extend(ratios)
    training.table({k: v for k, v in samples.items() if v}, f"{len(files)} runs pooled")
    compare(samples, pairs)


if __name__ == "__main__":
    main()
