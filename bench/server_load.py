"""Load on the runtime's two loopback servers: N concurrent clients at once.

    python bench/server_load.py [--clients 200] [--rounds 5]

dump control endpoint: N concurrent authenticated GET /state (one connection each);
trace hub: N concurrent authenticated WebSocket hellos (max_clients get in; the rest
are refused with 1013: at most 64 sockets may wait to say hello, and only
max_clients authenticated ones are served).  Prints min / median / p90 / p99 / max latency per round, and the
failures (anything but a 200, or but welcome/1013).

slowloris: --idle sockets (200) each send half a request and stall, then one
authenticated GET /state is timed; one row per round, and a row of the min / median
over rounds (the endpoint keeps at most 64 unauthenticated sockets, dropping the
oldest, and closes each 2 s after its accept).

floods, beside it: 16 peers send 64 KB escaped-quote messages (an unterminated
string of \\", which the JSON pre-scan once took 11 s over) over and over: token
holders' POST /configure bodies to the endpoint, unauthenticated hellos to the hub;
and 16 token holders that trickle a body a byte every 0.5 s (the endpoint wants a
whole request within 5 s of its accept).  Meanwhile one legitimate request is timed
(GET /state; a hello until its welcome): one row per round, then min / median.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from source_patch.runtime.core.endpoint import free_port  # noqa: E402

TOKEN = "bench-token"
PEERS = 16  # hostile peers of the flood and trickle rows (the endpoint's worker count)


def escaped_quotes(size: int = 64 << 10) -> bytes:
    """A hello-shaped message whose token is an unterminated string of escaped quotes."""
    head = b'{"op": "hello", "token": "'
    return head + b'\\"' * ((size - 1 - len(head)) // 2)


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_state(port: int, timeout: float = 30) -> tuple:
    """(seconds, ok) of one authenticated GET /state."""
    start = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", "/state", headers={"Authorization": f"Bearer {TOKEN}"})
        ok = conn.getresponse().status == 200
        conn.close()
    except OSError:
        ok = False
    return time.perf_counter() - start, ok


def dump_round(port: int, clients: int) -> tuple:
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: timed_state(port), range(clients)))
    return [r[0] for r in results], sum(not r[1] for r in results)


def slowloris_round(port: int, idle: int) -> tuple:
    """The latency of one authenticated GET /state with ``idle`` half-requests open."""
    sockets = []
    try:
        for _ in range(idle):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(b"GET /state HTTP/1.1\r\nHost: x\r\n")  # never finished
            sockets.append(sock)
        return timed_state(port, timeout=120)
    finally:
        for sock in sockets:
            sock.close()


def while_peers(peer, legit) -> tuple:
    """``legit()`` timed while PEERS threads run ``peer(stop)`` until it is done."""
    stop = threading.Event()
    threads = [threading.Thread(target=peer, args=(stop,), daemon=True) for _ in range(PEERS)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # the peers are at it
    try:
        return legit()
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)


def dump_flood_round(port: int) -> tuple:
    """GET /state while token holders post 64 KB escaped-quote bodies."""
    def peer(stop):
        while not stop.is_set():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                conn.request("POST", "/configure", body=escaped_quotes(),
                             headers={"Authorization": f"Bearer {TOKEN}"})
                conn.getresponse().read()
                conn.close()
            except OSError:
                pass

    return while_peers(peer, lambda: timed_state(port, timeout=120))


def dump_trickle_round(port: int) -> tuple:
    """GET /state while token holders send a body's byte every 0.5 s."""
    def peer(stop):
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    sock.sendall(b"POST /configure HTTP/1.0\r\nAuthorization: Bearer " + TOKEN.encode()
                                 + b"\r\nContent-Length: 1000\r\n\r\n")
                    while not stop.wait(0.5):
                        sock.sendall(b" ")
            except OSError:
                pass  # cut at the deadline: again

    return while_peers(peer, lambda: timed_state(port, timeout=120))


async def hub_flood_round(port: int) -> tuple:
    """A legitimate hello's welcome while unauthenticated peers send 64 KB escaped-quote hellos."""
    from websockets.asyncio.client import connect

    url, stop = f"ws://127.0.0.1:{port}/ws", asyncio.Event()

    async def peer():
        while not stop.is_set():
            try:
                async with connect(url, open_timeout=120) as ws:
                    await ws.send(escaped_quotes().decode())
                    await ws.recv()  # the hub closes it (4401)
            except Exception:  # noqa: BLE001 - closed, as it should be
                pass

    async def legit():
        start = time.perf_counter()
        try:
            async with connect(url, open_timeout=120) as ws:
                await ws.send(json.dumps({"op": "hello", "token": TOKEN}))
                ok = json.loads(await asyncio.wait_for(ws.recv(), 120)).get("op") == "welcome"
        except Exception:  # noqa: BLE001 - counted as a failure
            ok = False
        return time.perf_counter() - start, ok

    peers = [asyncio.create_task(peer()) for _ in range(PEERS)]
    await asyncio.sleep(0.3)
    try:
        return await legit()
    finally:
        stop.set()
        await asyncio.gather(*peers)


async def hub_round(port: int, clients: int, max_clients: int) -> tuple:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def one():
        start = time.perf_counter()
        try:
            async with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=30) as ws:
                await ws.send(json.dumps({"op": "hello", "token": TOKEN}))
                try:
                    reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    outcome = "welcome" if reply.get("op") == "welcome" else "other"
                    await asyncio.sleep(0.5)  # hold the slot while the others arrive
                except ConnectionClosed as exc:
                    outcome = exc.rcvd.code if exc.rcvd else "closed"
        except ConnectionClosed as exc:  # refused before its hello (more than 64 waiting to say it)
            outcome = exc.rcvd.code if exc.rcvd else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - counted as a failure
            outcome = type(exc).__name__
        return time.perf_counter() - start, outcome

    results = await asyncio.gather(*(one() for _ in range(clients)))
    outcomes = [r[1] for r in results]
    welcomed = outcomes.count("welcome")
    refused = outcomes.count(1013)
    failures = clients - welcomed - refused
    if failures:
        from collections import Counter
        print('  outcomes:', Counter(map(str, outcomes)).most_common(4))
    return [r[0] for r in results], failures, welcomed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle", type=int, default=200, help="idle half-requests in the slowloris rows")
    args = p.parse_args()
    from source_patch.runtime.dump import api as dump
    from source_patch.runtime.trace import control as trace

    tmp = tempfile.mkdtemp(prefix="sp-load-")
    dump.configure(enable=True, dir=tmp, port=free_port(), token=TOKEN)
    dump_port = int(dump.state()["control"].rsplit(":", 1)[1])
    hub_port = free_port()
    trace.configure(enable=True, port=hub_port, token=TOKEN, dir=tmp, max_clients=8)
    print(f"{args.clients} concurrent clients, {args.rounds} rounds (latency in ms)")
    print(f"{'server':22} {'round':>5} {'min':>7} {'median':>7} {'p90':>7} {'p99':>7} {'max':>7} {'failed':>6}")
    for r in range(args.rounds):
        lat, failed = dump_round(dump_port, args.clients)
        row("dump /state", r, lat, failed)
    lone = {f"dump, {args.idle} idle": ("slowloris", lambda: slowloris_round(dump_port, args.idle)),
            f"dump, {PEERS} floods": ("dump flood", lambda: dump_flood_round(dump_port)),
            f"dump, {PEERS} trickling": ("trickle", lambda: dump_trickle_round(dump_port)),
            f"hub, {PEERS} floods": ("hub flood", lambda: asyncio.run(hub_flood_round(hub_port)))}
    for name, (total, one) in lone.items():
        results = []
        for r in range(args.rounds):
            results.append(one())
            row(name, r, [results[-1][0]], int(not results[-1][1]))
        lat = [x for x, _ in results]
        print(f"{total + ', all rounds':22} {'-':>5} {min(lat) * 1000:7.1f} {statistics.median(lat) * 1000:7.1f}"
              f" {'':>7} {'':>7} {max(lat) * 1000:7.1f} {sum(not ok for _, ok in results):>6}", flush=True)
    for r in range(args.rounds):
        lat, failed, welcomed = asyncio.run(hub_round(hub_port, args.clients, 8))
        row(f"hub hello ({welcomed} in)", r, lat, failed)
    trace.close()
    dump.close()
    return 0


def row(name, r, lat, failed):
    ms = [x * 1000 for x in lat]
    print(f"{name:22} {r:>5} {min(ms):7.1f} {statistics.median(ms):7.1f} {percentile(ms, 0.9):7.1f} "
          f"{percentile(ms, 0.99):7.1f} {max(ms):7.1f} {failed:>6}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
