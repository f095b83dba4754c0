"""Cost of dumping activations: no dumping vs the async dump runtime vs a synchronous
one-torch.save-per-tensor baseline (what SGLang's dumper does), plus the cost of a
disabled call site.

A fake model: L layers, each a few matmuls on [tokens, hidden], dumping 5 tensors
per layer (layer input, attention-like output, MLP input, MLP output, layer output)
the way a patched Megatron TransformerLayer would.  Modes run side by side in one
process, interleaved round by round (the order rotates), so drift hits all alike:

  none          the model, no dump call at all
  disabled      dump() called at every site, runtime disabled
  async         this runtime (default settings: on_full=block, gpu_copy=clone)
  async_drop    this runtime with on_full=drop (never waits; reports drops)
  async_direct  (CUDA only) gpu_copy=direct: no device-side clone
  sync          per tensor: .cpu(), then torch.save({"value", "meta"}) to its own file

A step ends by waiting for the current stream (as a real step does in loss.item()),
not for the whole device: the runtime's side-stream copies may still be running.
The async modes' files are drained (flush, timed separately: "drain") and deleted
after each run so the disk does not fill up.

    python bench/dump_bench.py                      # CUDA, realistic sizes
    python bench/dump_bench.py --device cpu --quick  # smoke test
    python bench/dump_bench.py --dir /dev/shm/x      # take the disk out of the picture
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from source_patch.runtime.dump import api as D

import stats  # bench/

SITES = ("layer_input", "attn_output", "mlp_input", "mlp_output", "layer_output")


class Model:
    def __init__(self, layers: int, hidden: int, device: str, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        scale = hidden ** -0.5
        self.weights = [
            ((torch.randn(hidden, hidden, generator=gen) * scale).to(device, dtype),
             (torch.randn(hidden, hidden, generator=gen) * scale).to(device, dtype))
            for _ in range(layers)
        ]

    def step(self, x: torch.Tensor, dump) -> torch.Tensor:
        for i, (w1, w2) in enumerate(self.weights):
            if dump is not None:
                dump("layer_input", x, layer=i)
            h = x @ w1
            if dump is not None:
                dump("attn_output", h, layer=i)
            a = torch.nn.functional.gelu(h)
            if dump is not None:
                dump("mlp_input", a, layer=i)
            o = a @ w2
            if dump is not None:
                dump("mlp_output", o, layer=i)
            x = x + o
            if dump is not None:
                dump("layer_output", x, layer=i)
        return x


class SyncDumper:
    """The baseline: synchronous .cpu() + torch.save of a dict per tensor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.index = 0
        self.step = 0

    def __call__(self, name, value, **tags):
        self.index += 1
        cpu = value.detach().cpu()
        meta = {"name": name, "step": self.step, "rank": 0, "dump_index": self.index, **tags}
        file = self.folder / (f"step={self.step}___rank=0___dump_index={self.index}___name={name}"
                              + "".join(f"___{k}={v}" for k, v in tags.items()) + ".pt")
        torch.save({"value": cpu, "meta": meta}, file)
        return value


def sync_device(device: str):
    """End of a step: wait for the current stream, as loss.item() does. Not a device-wide
    synchronize, which would also wait for the dump runtime's side-stream copies."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def machine_info(device: str, folder: Path) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        info["cpu"] = platform.processor() or "?"
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    usage = shutil.disk_usage(folder)
    info["dump_dir"] = str(folder)
    info["dump_dir_free_gib"] = round(usage.free / 2**30, 1)
    return info


def disabled_call_cost(calls: int) -> dict:
    """ns per call: a disabled dump() through the __sp__ handle vs no call."""
    from source_patch.patcher.finder import RuntimeHandle

    D.configure(enable=False)
    sp = RuntimeHandle()
    x = torch.zeros(1)
    sp.dump("warm", x)
    results = {}
    for _ in range(3):  # best of 3
        start = time.perf_counter_ns()
        for i in range(calls):
            pass
        empty = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for i in range(calls):
            sp.dump("attn_output", x, layer=i)
        called = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for i in range(calls):
            sp.emit("attn_output", x, layer=i)  # the events runtime, no subscriber: for scale
        emitted = time.perf_counter_ns() - start
        for key, value in (("loop_ns", empty), ("dump_disabled_ns", called), ("emit_no_subscriber_ns", emitted)):
            results[key] = min(results.get(key, float("inf")), value / calls)
    results["dump_disabled_minus_loop_ns"] = results["dump_disabled_ns"] - results["loop_ns"]
    return results


def filtered_call_cost(calls: int, folder: str) -> dict:
    """ns per call: dump() through the __sp__ handle, dumping on and the record filtered out
    by its name, its layer or its step (what the whole-cost bench's "dump on, all filtered"
    pays at each call site; issue 59 item 2), best of 3."""
    from source_patch.runtime.core import tags
    from source_patch.patcher.finder import RuntimeHandle

    sp = RuntimeHandle()
    x = torch.zeros(1)
    results = {}
    restore = tags.set_context(phase="fwd_bwd", microbatch=0)  # as in a training schedule
    try:
        for key, criterion in (("names", ["nothing_*"]), ("layers", [99]), ("steps", ["100000-"])):
            D.configure(enable=True, dir=folder, **{"names": None, "layers": None, "steps": None, key: criterion})
            for _ in range(3):
                start = time.perf_counter_ns()
                for _ in range(calls):
                    sp.dump("attn_output", x, layer=3)
                results[key] = min(results.get(key, float("inf")), (time.perf_counter_ns() - start) / calls)
    finally:
        restore.__exit__(None, None, None)
        D.configure(enable=False, names=None, layers=None, steps=None)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps (smoke test)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--tokens", type=int, help="seq * micro-batch, rows of each activation")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--dtype", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--modes", help="comma-separated subset of the modes")
    parser.add_argument("--dir", help="where dumps go (default: a temp dir); deleted after each run")
    parser.add_argument("--calls", type=int, default=200_000, help="calls for the disabled-call-site timing")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    quick = args.quick
    defaults = dict(layers=2, tokens=256, hidden=256, dtype="fp32", steps=5, rounds=3) if quick else \
        dict(layers=8, tokens=2048, hidden=4096, dtype="bf16", steps=4, rounds=3)
    if args.device == "cpu" and not quick:
        defaults.update(layers=4, tokens=1024, hidden=1024, dtype="fp32")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = args.device

    modes = ["none", "disabled", "async", "async_drop"] + (["async_direct"] if device == "cuda" else []) + ["sync"]
    if args.modes:
        modes = [m for m in args.modes.split(",") if m]
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sp-dump-bench-"))
    root.mkdir(parents=True, exist_ok=True)

    info = machine_info(device, root)
    element = torch.tensor([], dtype=dtype).element_size()
    tensor_bytes = args.tokens * args.hidden * element
    per_step = len(SITES) * args.layers
    info.update(layers=args.layers, tokens=args.tokens, hidden=args.hidden, dtype=args.dtype, steps=args.steps,
                rounds=args.rounds, tensors_per_step=per_step, tensor_mib=round(tensor_bytes / 2**20, 3),
                mib_per_step=round(per_step * tensor_bytes / 2**20, 2),
                queue_gib=round(D.settings.SCHEMAS["dump"]["queue_bytes"].default / 2**30, 2))
    print("# dump_bench")
    for key, value in info.items():
        print(f"  {key}: {value}")

    model = Model(args.layers, args.hidden, device, dtype)
    x0 = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)

    # Warm up kernels, the pinned-memory cache and the writer for every mode.
    D.configure(enable=True, dir=str(root / "warm"), exp_name="w")
    model.step(x0, D.dump)
    D.flush()
    model.step(x0, None)
    sync_device(device)
    shutil.rmtree(root / "warm", ignore_errors=True)

    times = {m: [] for m in modes}
    drains = {m: [] for m in modes}
    extra = {m: {"dropped": 0, "blocked_s": 0.0, "records": 0} for m in modes}
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        for mode in order:
            folder = root / f"{mode}-{rnd}"
            folder.mkdir(parents=True, exist_ok=True)
            dump = None
            if mode == "disabled":
                D.configure(enable=False)
                dump = D.dump
            elif mode.startswith("async"):
                D.configure(enable=True, dir=str(folder), exp_name="e",
                            on_full="drop" if mode == "async_drop" else "block",
                            gpu_copy="direct" if mode == "async_direct" else "clone")
                D.reset()
                dump = D.dump
            elif mode == "sync":
                dump = SyncDumper(folder)
            for step in range(args.steps):
                sync_device(device)
                start = time.perf_counter()
                model.step(x0, dump)
                sync_device(device)
                times[mode].append(time.perf_counter() - start)
                if mode.startswith("async"):
                    D.dump_step()
                elif mode == "sync":
                    dump.step += 1
            if mode.startswith("async"):
                start = time.perf_counter()
                D.flush()
                drains[mode].append(time.perf_counter() - start)
                st = D.state()["counters"]
                extra[mode]["dropped"] += st["dropped"]
                extra[mode]["blocked_s"] += st["blocked_s"]
                extra[mode]["records"] += st["records"]
                if st["errors"]:
                    print(f"  warning: {mode}: {st['errors']} errors, last: {D.state()['last_error']}")
                D.configure(enable=False)
            shutil.rmtree(folder, ignore_errors=True)

    base = statistics.median(times["none"]) if "none" in times else None
    rows = []
    print()
    print(f"per-step time, {args.rounds} rounds x {args.steps} steps per mode, interleaved "
          f"({per_step} tensors, {info['mib_per_step']} MiB dumped per step)")
    print()
    print(f"| mode | ms: {stats.HEADER} | p90 ms | x none | drain s/run | dropped | waited s | written MiB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        ts = sorted(times[mode])
        med = statistics.median(ts)
        p90 = ts[min(len(ts) - 1, int(round(0.9 * (len(ts) - 1))))]
        drain = statistics.mean(drains[mode]) if drains[mode] else 0.0
        written = extra[mode]["records"] * tensor_bytes if mode.startswith("async") else \
            (len(ts) * per_step * tensor_bytes if mode == "sync" else 0)
        wall = sum(ts) + sum(drains[mode])
        rate = f"{written / 2**20 / wall:.0f}" if written else "-"
        row = dict(mode=mode, median_ms=med * 1e3, p90_ms=p90 * 1e3, min_ms=ts[0] * 1e3,
                   ratio=(med / base) if base else None, drain_s=drain, dropped=extra[mode]["dropped"],
                   waited_s=extra[mode]["blocked_s"], mib_per_s=rate)
        rows.append(row)
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        dropped = str(row["dropped"]) if mode.startswith("async") else "-"
        waited = f"{row['waited_s']:.2f}" if mode.startswith("async") else "-"
        print(f"| {mode} | {stats.cells(ts, 1e3)} | {p90 * 1e3:.2f} | {ratio} | "
              f"{drain:.3f} | {dropped} | {waited} | {rate} |")

    cost = disabled_call_cost(args.calls)
    print()
    print(f"disabled call site, {args.calls} calls (best of 3):")
    print(f"  empty loop            {cost['loop_ns']:.1f} ns/iteration")
    print(f"  __sp__.dump disabled  {cost['dump_disabled_ns']:.1f} ns/iteration "
          f"(+{cost['dump_disabled_minus_loop_ns']:.1f} ns per call)")
    print(f"  __sp__.emit, no subscriber {cost['emit_no_subscriber_ns']:.1f} ns/iteration (for scale)")
    if base:
        share = per_step * cost["dump_disabled_minus_loop_ns"] * 1e-9 / base
        print(f"  {per_step} disabled calls per step = {share * 100:.4f}% of the median 'none' step")
    filtered = filtered_call_cost(args.calls, str(root))
    cost["filtered_ns"] = filtered
    print(f"dumping on, the record filtered out, {args.calls} calls (best of 3): " + ", ".join(
        f"by {key} {value:.1f} ns/call" for key, value in filtered.items()))

    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows, "disabled_call": cost}, indent=1))
    D.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
