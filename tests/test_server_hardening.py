"""Hostile or careless local clients against the runtime's loopback servers: a deep
JSON body is a 400 / a refused hello (never a traceback in the host's stderr, never
counted as the runtime's own error), idle unauthenticated sockets cannot lock out the
legitimate client, and 200 concurrent clients are served (bench: bench/server_load.py)."""

import asyncio
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from source_patch.runtime.core.endpoint import free_port, parse_json

TOKEN = "hardening-token"
DEEP = "[" * 100_000 + "]" * 100_000


def test_parse_json_refuses_deep_nesting_but_not_brackets_in_strings():
    assert parse_json('{"a": "[[[[[[[[" , "b": [1, {"c": 2}]}') == {"a": "[[[[[[[[", "b": [1, {"c": 2}]}
    assert isinstance(parse_json("[" * 32 + "]" * 32), list)
    with pytest.raises(ValueError, match="nested deeper than 32"):
        parse_json("[" * 33 + "]" * 33)
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json(DEEP)


@pytest.fixture
def endpoint(dumper):
    dumper.configure(port=free_port(), token=TOKEN, max_request_bytes=1 << 20)
    return int(dumper.state()["control"].rsplit(":", 1)[1])


def request(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_a_deeply_nested_body_is_a_400_and_not_the_runtimes_error(endpoint, dumper, capfd):
    status, reply = request(endpoint, "POST", "/configure", DEEP)
    assert status == 400 and "nested deeper than 32" in reply["error"]
    assert dumper.state()["counters"]["errors"] == 0
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_200_concurrent_requests_are_all_answered_quickly(endpoint):
    def one(_):
        start = time.perf_counter()
        status, _ = request(endpoint, "GET", "/state")
        return status, time.perf_counter() - start

    with ThreadPoolExecutor(200) as pool:
        results = list(pool.map(one, range(200)))
    assert [s for s, _ in results] == [200] * 200  # backlog 256: nothing refused or timed out
    latencies = sorted(t for _, t in results)
    assert latencies[int(0.99 * len(latencies))] < 3.0  # bench/server_load.py: p99 ~0.1 s here


@pytest.fixture
def hub(tmp_path):
    from source_patch.runtime.trace import control as trace

    port = free_port()
    trace.configure(enable=True, port=port, token=TOKEN, dir=str(tmp_path), ranks=[0], max_clients=2, wait=0)
    yield port
    trace.close()
    trace.configure(enable=False, port=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_deeply_nested_hello_is_refused_quietly(hub, capfd):
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def main():
        async with connect(f"ws://127.0.0.1:{hub}/ws", max_size=None) as ws:
            await ws.send('{"op": "hello", "token": ' + DEEP + "}")
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            return info.value.rcvd.code

    assert run(main()) in (4401, 1009)  # unauthorized, or over max_message: refused either way
    from source_patch.runtime.trace import control as trace

    assert trace.state()["counters"]["errors"] == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err


def test_idle_unauthenticated_sockets_do_not_lock_out_the_client_and_time_out(hub):
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from source_patch.runtime.trace.client import connect as trace_connect

    async def main():
        idle = [await connect(f"ws://127.0.0.1:{hub}/ws") for _ in range(60)]  # never say hello
        async with trace_connect(f"127.0.0.1:{hub}", TOKEN) as client:  # max_clients=2: still gets in
            stats = await client.stats()
        start = time.monotonic()
        codes = []
        for ws in idle:
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            codes.append(info.value.rcvd.code)
        return stats, codes, time.monotonic() - start

    stats, codes, waited = run(main())
    assert stats["errors"] == 0
    assert set(codes) == {4401} and waited < 10  # closed after the 2 s hello timeout


@pytest.mark.slow
def test_200_concurrent_hub_clients_are_served_or_refused_fast(hub):
    """max_clients (2 here) get in; every other client is refused with 1013, at its
    hello or before it (64 may wait to authenticate); none hangs or errs otherwise."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def one():
        start = time.perf_counter()
        try:
            async with connect(f"ws://127.0.0.1:{hub}/ws", open_timeout=30) as ws:
                await ws.send(json.dumps({"op": "hello", "token": TOKEN}))
                reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
                await asyncio.sleep(0.5)  # hold the slot while the others arrive
                outcome = reply.get("op")
        except ConnectionClosed as exc:
            outcome = exc.rcvd.code if exc.rcvd else "closed"
        return outcome, time.perf_counter() - start

    async def main():
        return await asyncio.gather(*(one() for _ in range(200)))

    results = run(main())
    outcomes = [o for o, _ in results]
    assert outcomes.count("welcome") == 2 and outcomes.count(1013) == 198, sorted(map(str, set(outcomes)))
    assert max(t for _, t in results) < 10
