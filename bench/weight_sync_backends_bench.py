"""Weight sync's request backends against the physical limit of their path, same bytes,
same run: an engine's whole receive (copy out of the trainer's memory, per-bucket
checksums, views) against a raw copy of those bytes alone.

    python bench/weight_sync_backends_bench.py --ipc --gb 4        # GPUs: trainer on GPU 0, an engine on each GPU
    python bench/weight_sync_backends_bench.py --mooncake --mb 256 # loopback TCP TransferEngines (CPU)

ipc: the trainer process (this one, GPU 0) packs a synthetic model (``--tensors``
tensors, bf16) into its exported memory once; an engine process on each GPU maps it
(CUDA IPC), then per round: ``receive`` (backend.receive_request: device-to-device
copy and checksums, in one pass where source and copy share a device: copysum.py),
the same with the copy and the sums apart, without checksums (``-c``), and ``raw``
(one copy of the same bytes from the mapped memory into a buffer of the engine's),
each timed to a device sync.  The engine on
GPU 0 is the colocated layout; the one on GPU 1 reads over the interconnect.

mooncake: a trainer TransferEngine and an engine TransferEngine in this process
(P2PHANDSHAKE, TCP on loopback): ``receive`` against ``raw``, one
batch_transfer_sync_read of the same bytes into a registered buffer.

Each row: min / median [90% interval] over ``--rounds``, and the median's share of raw
(raw / receive: 100% = at the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402 - bench/

LIMITS = dict(max_metadata_bytes=1 << 28, max_update_bytes=1 << 40)


def model(total_bytes: int, count: int, device) -> list:
    """``count`` bf16 tensors of ``total_bytes`` in all: half the bytes in one large
    tensor per 64, the rest spread over the others (a MoE's many small experts)."""
    per = max(total_bytes // 2 // count, 64)
    large = max((total_bytes - per * count) // max(count // 64, 1), 64)
    sizes = [large if i % 64 == 0 else per for i in range(count)]
    return [torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_() for n in sizes]


def plan(tensors: list, bucket_mb: int, checksum: bool = True):
    from source_patch.runtime.weight_sync import wire

    return wire.plan([(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)], bucket_mb << 20, 1,
                     checksum)


def timed(fn, device) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def rounds(pairs: dict, n: int, device) -> dict:
    """{name: [seconds]}: every method once per round, in rotating order."""
    names, out = list(pairs), {name: [] for name in pairs}
    for r in range(n + 1):
        for name in names[r % len(names):] + names[: r % len(names)]:
            seconds = timed(pairs[name], device)
            if r:  # round 0 warms up
                out[name].append(seconds)
    return out


def engine_main(payload_path: str, gpu: int, n: int) -> None:
    """An engine process: map the trainer's memory, then time receive and raw."""
    from source_patch.runtime.weight_sync import backend, ipc

    device = torch.device("cuda", gpu)
    torch.cuda.set_device(device)
    payloads = {name: Path(payload_path + name).read_bytes() for name in ("", ".nosum")}
    doc = json.loads(payloads[""])
    backend.receive_request(payloads[""], device=device, **LIMITS)  # maps the export, allocates the stream
    source = ipc._map(doc["memory"], doc["total_bytes"])[: doc["total_bytes"]]
    dst = torch.empty_like(source, device=device)
    from source_patch.runtime.weight_sync import copysum

    fused = copysum.usable

    def unfused():  # the copy, then the sums: a second pass over the bytes
        copysum.usable = lambda *_: False
        try:
            backend.receive_request(payloads[""], device=device, **LIMITS)
        finally:
            copysum.usable = fused

    times = rounds({"receive": lambda: backend.receive_request(payloads[""], device=device, **LIMITS),
                    "receive, copy then sums": unfused,
                    "receive -c": lambda: backend.receive_request(payloads[".nosum"], device=device, **LIMITS),
                    "raw": lambda: dst.copy_(source)}, n, device)
    print(json.dumps(times))


def ipc_bench(args) -> list:
    from source_patch.runtime.weight_sync import ipc

    device = torch.device("cuda", 0)
    tensors = model(args.gb << 30, args.tensors, device)
    sender = ipc.IpcSender(["http://127.0.0.1:1"], 60, device=device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "payload")
        for suffix, checksum in (("", True), (".nosum", False)):
            manifest = plan(tensors, args.bucket_mb, checksum)
            Path(path + suffix).write_bytes(sender.stage(manifest, tensors, iter(tensors)))
        pack = [timed(lambda: sender.stage(manifest, tensors, iter(tensors)), device) for _ in range(args.rounds)]
        for gpu in range(torch.cuda.device_count())[:2]:
            out = subprocess.run([sys.executable, __file__, "--engine", path, str(gpu), str(args.rounds)],
                                 capture_output=True, text=True, timeout=600)
            if out.returncode:
                raise SystemExit(f"engine on GPU {gpu} failed:\n{out.stderr[-3000:]}")
            times = json.loads(out.stdout.strip().splitlines()[-1])
            where = "colocated (GPU 0)" if gpu == 0 else f"GPU {gpu} reads GPU 0"
            rows += [(f"ipc {name}, {where}", times[name], times["raw"]) for name in times]
        rows.append(("ipc trainer: pack into the export (no checksums)", pack, None))
    sender.close()
    return rows


def mooncake_bench(args) -> list:
    from source_patch.runtime.weight_sync import backend, mooncake

    cpu = torch.device("cpu")
    tensors = model(args.mb << 20, args.tensors, cpu)
    sender = mooncake.MooncakeSender(["http://127.0.0.1:1"], 60)
    payload = sender.stage(plan(tensors, args.bucket_mb), tensors, iter(tensors))
    doc = json.loads(payload)
    backend.receive_request(payload, device=cpu, **LIMITS)  # starts the engine's TransferEngine
    reader = mooncake._engine(("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
    dst = mooncake._Registered(reader, doc["total_bytes"])
    segment, address, total = doc["memory"]["segment"], doc["memory"]["address"], doc["total_bytes"]

    def raw():
        assert reader.batch_transfer_sync_read(segment, [dst.tensor.data_ptr()], [address], [total]) == 0

    times = rounds({"receive": lambda: backend.receive_request(payload, device=cpu, **LIMITS), "raw": raw},
                   args.rounds, cpu)
    sender.close()
    return [("mooncake receive (loopback TCP)", times["receive"], times["raw"]),
            ("mooncake raw read", times["raw"], times["raw"])]


def table(rows: list, nbytes: int) -> str:
    lines = [f"| path | ms: {stats.HEADER} | GB/s (median) | % of raw (median) |", "| --- | --- | --- | --- |"]
    for name, times, raw in rows:
        share = f"{statistics.median(raw) / statistics.median(times):.1%}" if raw else "-"
        lines.append(f"| {name} | {stats.cells(times, 1e3)} | {nbytes / statistics.median(times) / 1e9:.1f} | "
                     f"{share} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ipc", action="store_true")
    p.add_argument("--mooncake", action="store_true")
    p.add_argument("--gb", type=int, default=4, help="ipc: update size")
    p.add_argument("--mb", type=int, default=256, help="mooncake: update size")
    p.add_argument("--tensors", type=int, default=7000)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--engine", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        return engine_main(args.engine[0], int(args.engine[1]), int(args.engine[2]))
    if args.ipc:
        print(f"ipc, {args.gb} GiB in {args.tensors} tensors, {torch.cuda.get_device_name(0)} x "
              f"{torch.cuda.device_count()}, {args.rounds} rounds")
        print(table(ipc_bench(args), args.gb << 30))
    if args.mooncake:
        print(f"mooncake, {args.mb} MiB in {args.tensors} tensors, {args.rounds} rounds, {os.cpu_count()} CPUs")
        print(table(mooncake_bench(args), args.mb << 20))


if __name__ == "__main__":
    main()
