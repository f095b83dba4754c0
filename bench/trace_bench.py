"""Step time of the real Megatron training example while its hidden states are traced
live: no trace spec vs. the trace spec with no client (idle call sites) vs. one client
subscribed to every layer's output (TransformerLayer output) with the tiles
compressor, reading every frame, vs. a client that subscribes to raw router logits
and never reads (the hub must drop it without slowing the step).

Each variant is its own process (patching happens at import), run in alternating
rounds; the first `--warmup` steps are discarded.  With a client the process waits at
its hub's start (SOURCE_PATCH_TRACE_WAIT) until the client has subscribed, so every
timed step is traced.

    python bench/trace_bench.py            # GPU: a mid-size GPT-MoE
    python bench/trace_bench.py --quick    # CPU smoke run
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import tempfile
import threading
from pathlib import Path

import training

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

from source_patch.runtime.trace_client import connect  # noqa: E402

TOKEN = "trace-bench"
VARIANTS = ["no trace spec", "trace spec, no client", "one client, tiles", "stalled client"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def reading_client(port: int, report: dict) -> None:
    """Subscribe to every layer's output with tiles and read every frame until the end."""
    async with connect(f"127.0.0.1:{port}", TOKEN, client="bench", retry=300) as c:
        await c.subscribe(["layer_output"], compressor={"kind": "tiles"}, id="tiles")
        seqs = [frame.seq async for frame in c]
        report.update(frames=len(seqs), gaps=(seqs[-1] + 1 - len(seqs)) if seqs else 0,
                      client_dropped=c.dropped)


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


def main() -> None:
    p = training.parser(__doc__)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 6, 2
    training.header(args)
    reports: dict = {}

    with tempfile.TemporaryDirectory() as root:
        def run(name: str) -> list[float]:
            port = free_port()
            env = {"SOURCE_PATCH": "megatron_cpu" if name == "no trace spec" else "megatron_cpu,trace",
                   "SOURCE_PATCH_TRACE_PORT": str(port), "SOURCE_PATCH_TRACE_TOKEN": TOKEN,
                   "SOURCE_PATCH_TRACE_DIR": root, "SOURCE_PATCH_TRACE_STALL_TIMEOUT": "1",
                   # a raw router-logits frame of the GPU model is 4M elements
                   "SOURCE_PATCH_TRACE_RAW_MAX_ELEMENTS": str(1 << 24)}
            client = {"one client, tiles": reading_client, "stalled client": stalled_client}.get(name)
            report: dict = {}
            thread = None
            if client is not None:
                env["SOURCE_PATCH_TRACE_WAIT"] = "300"
                thread = threading.Thread(target=lambda: asyncio.run(client(port, report)), daemon=True)
                thread.start()
            times = training.train(args, training.environment("SOURCE_PATCH_TRACE", **env), name)
            if thread is not None:
                thread.join(60)
                reports.setdefault(name, []).append(report)
            return times[args.warmup:]

        training.rounds(args, VARIANTS, run)
    for name, runs in reports.items():
        print(f"{name}: {runs}")


if __name__ == "__main__":
    main()
