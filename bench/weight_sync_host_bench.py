"""Weight sync: the sender's host time per push (CPU time of the pushing thread, the
wire excluded), at 7,239 and 36,169 tensors, side by side in one run, before and after.

    python bench/weight_sync_host_bench.py                       # this tree's sender
    python bench/weight_sync_host_bench.py --against HEAD        # and HEAD's sender.py + program.py
    python bench/weight_sync_host_bench.py --wire new --device-work cpu

One process, one thread, CPU.  The sender pushes over a link whose collectives cost
nothing (no process group; ``--wire known``: the receivers hold the layout, the steady
state, so the manifest does not travel; ``--wire new``: a receiver new to the layout
every push, so it does).  Each push is timed by ``time.thread_time`` (this thread's
CPU), rounds rotated across every (model, code, method), after ``--warmup`` pushes.

``--device-work stub`` (default) models a GPU's steady state, where the device work is
launched, not done, by the host: bucket checksums are not computed; a packed
program's copies are its replayed graphs (program._copy does nothing; on a GPU: one
launch per run of a bucket); the iterator path's buckets go through sender._Replays
as on a GPU (each push compares the sources' addresses with the captured ones, then
"replays": nothing).  ``--device-work cpu``: every copy and checksum done on the CPU
(the host then does the device's work too: it grows with the bytes and the tensors).

Methods: ``planned`` (send() of program.Sources: the packed push of a TP/EP trainer,
planned once per layout); ``packed`` (send() of the tensors as an iterator: taken and
checked tensor by tensor each push, weight_sync_bench.py's ``bucketed``); ``buffers``
(send() of plan_buffers' Buffers).  ``--against REV`` loads REV's
runtime/weight_sync/sender.py and program.py (``git show``; or two paths
``SENDER.py,PROGRAM.py``) beside this tree's, in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402 - bench/
import weight_sync_bench  # noqa: E402 - the models
import weight_sync_phases  # noqa: E402 - in_one_buffer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "source_patch.runtime.weight_sync"
MODELS = {"7k": 0.1, "36k": 0.5}  # --small-frac: 7,239 and 36,169 tensors (weight_sync_bench.py's models)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--warmup", type=int, default=3, help="pushes before timing (a GPU captures at the 2nd)")
    p.add_argument("--against", default=None, help="REV (git) or SENDER.py,PROGRAM.py: the code before")
    p.add_argument("--wire", choices=("known", "new"), default="known")
    p.add_argument("--device-work", choices=("stub", "cpu"), default="stub")
    p.add_argument("--methods", default="planned,packed,buffers")
    p.add_argument("--models", default="7k,36k")
    p.add_argument("--gb", type=float, default=0.5, help="model size, GiB (the tensor counts do not depend on it)")
    return p.parse_args(argv)


def load_against(against: str) -> tuple:
    """(sender, program) modules of the code before, loaded beside this tree's."""
    if "," in against:
        texts = [Path(path).read_text() for path in against.split(",")]
    else:
        texts = [subprocess.check_output(["git", "show", f"{against}:runtime/weight_sync/{name}.py"], cwd=ROOT,
                                         text=True) for name in ("sender", "program")]
    folder = Path(tempfile.mkdtemp(prefix="ws_against_"))
    modules = {}
    for name, text in zip(("program", "sender"), texts[::-1]):
        text = text.replace("from .program import", "from ._against_program import")
        path = folder / f"_against_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"{PACKAGE}._against_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["sender"], modules["program"]


class _Replayed:
    def replay(self):
        pass


def stub_device_work(sender, program) -> None:
    """--device-work stub: see the module doc."""
    sender.bucket_sum = lambda data, out, wide=False: None
    program._copy = lambda run: None
    replays = sender._Replays
    init = replays.__init__

    def on_init(self, buckets, device):
        init(self, buckets, device)
        self.on = True  # the GPU's path: addresses compared each push

    replays.__init__ = on_init
    replays._capture = lambda self, k, sources, copy: _Replayed()


class HostLink:
    """A sender's link whose collectives cost nothing: handshake, broadcasts and votes
    return at once (``known``: every receiver holds the layout; else none does)."""

    def __init__(self, wt, known: bool):
        from source_patch.runtime.weight_sync.link import LoopbackLink

        self.link = LoopbackLink("cpu", record=False)
        if known:
            self.link.handshake = lambda row, what: [row, wt.handshake_row(take=(row[3],))]


def build(args, frac: float, wt):
    one = weight_sync_bench.parse_args(["--gb", str(args.gb), "--small-frac", str(frac), "--small-kb", "16",
                                        "--large-mb", "8", "--bucket-mb", "64"])
    layout = weight_sync_bench.model_layout(one)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen, dtype=torch.bfloat16) for _, shape in layout]
    manifest = wt.plan([(name, shape, torch.bfloat16) for name, shape in layout], one.bucket_mb << 20, 0)
    buffers = weight_sync_phases.in_one_buffer(wt, manifest, layout, tensors)
    return layout, tensors, manifest, buffers


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    from source_patch.runtime.weight_sync import program as program_now
    from source_patch.runtime.weight_sync import sender as sender_now
    from source_patch.runtime.weight_sync import transport as wt

    codes = {"after": (sender_now, program_now)}
    if args.against:
        codes = {"before": load_against(args.against), **codes}
    if args.device_work == "stub":
        for sender, program in codes.values():
            stub_device_work(sender, program)
    methods = args.methods.split(",")
    cases, times = [], {}
    for model in args.models.split(","):
        layout, tensors, manifest, (buf_manifest, buffers) = build(args, MODELS[model], wt)
        for code, (sender, program) in codes.items():
            sources = program.Sources([("out", t, True) for t in tensors], [], (None, None))
            for method in methods:
                link = HostLink(wt, args.wire == "known").link
                planned = buf_manifest if method == "buffers" else manifest

                def push(version, sender=sender, link=link, planned=planned, method=method, sources=sources,
                         tensors=tensors, buffers=buffers):
                    m = dataclasses.replace(planned, version=version)
                    source = sources if method == "planned" else buffers if method == "buffers" else iter(tensors)
                    sender.send(link, m, source)

                key = (model, len(layout), method, code)
                cases.append((key, push))
                times[key] = []
    version = 0
    for r in range(args.warmup + args.rounds):
        for key, push in weight_sync_bench.rotation(cases, r):
            version += 1
            start = time.thread_time()
            push(version)
            spent = time.thread_time() - start
            if r >= args.warmup:
                times[key].append(spent)
    report(args, codes, methods, times)


def report(args, codes, methods, times):
    print(f"\nweight sync sender, host CPU time per push (time.thread_time), ms; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread; wire: {args.wire}; device work: {args.device_work}; "
          f"{args.rounds} rounds after {args.warmup} warm-up")
    print("cell: min / median [90% interval of the median]\n")
    models = sorted({key[:2] for key in times}, key=lambda m: m[1])
    head = f"{'method':<9}" + "".join(f"{f'{n:,} tensors, {code}':>34}" for _, n in models for code in codes)
    print(head)
    for method in methods:
        row = f"{method:<9}"
        for model, n in models:
            for code in codes:
                row += f"{stats.cells(times[(model, n, method, code)], 1e3):>34}"
        print(row)
    if len(models) == 2:
        print("\n36k / 7k at the median (1.00: independent of the tensor count):")
        for method in methods:
            parts = []
            for code in codes:
                small, large = (statistics.median(times[(m, n, method, code)]) for m, n in models)
                parts.append(f"{code} {large / small:.2f}x")
            print(f"  {method:<9} " + ", ".join(parts))
    if "before" in codes:
        print("\nafter / before at the median (90% interval, paired by round):")
        for method in methods:
            parts = []
            for model, n in models:
                ratio, low, high = stats.bootstrap(stats.ratio_of_medians, times[(model, n, method, "after")],
                                                   times[(model, n, method, "before")], paired=True)
                parts.append(f"{n:,}: {ratio:.2f} [{low:.2f}..{high:.2f}]")
            print(f"  {method:<9} " + ", ".join(parts))


if __name__ == "__main__":
    main()
