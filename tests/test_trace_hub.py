"""The trace runtime and its hub with real WebSocket clients on 127.0.0.1
(runtime/trace/api.py, trace_hub.py, trace_client.py): auth, limits, subscriptions
changed at run time, several clients, a client that never reads, the CLI."""

import asyncio
import json
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from source_patch.runtime.trace import compress as tc
from source_patch.runtime.trace import hub as trace_hub
from source_patch.runtime.trace import close, configure, flush, names, reset, state, trace, trace_step, url
from source_patch.runtime.trace.client import TraceError, connect, read_recording, summary
from source_patch.runtime.core.endpoint import free_port

TOKEN = "test-token"


@pytest.fixture(params=["process", "thread"])
def hub(tmp_path, request):
    """A running hub on a free port, in a forwarder process or in a thread (the
    protocol is the same code); tracing off again afterwards."""
    port = free_port()
    configure(enable=True, port=port, token=TOKEN, dir=str(tmp_path / "sp-trace"), ranks=[0], client_queue=64,
              stall_timeout=5.0, max_message=65536, max_clients=8, raw_max_elements=65536, wait=0,
              hub=request.param)
    reset()
    yield port
    close()
    configure(enable=False, port=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def frames(c, n: int, timeout: float = 10.0) -> list:
    return [await c.next_frame(timeout) for _ in range(n)]


def step(*tensors, name="hidden"):
    """One training step: trace every tensor as a layer, then advance the step."""
    for layer, t in enumerate(tensors):
        trace(name, t, layer=layer)
    trace_step()


# ---------------------------------------------------------------- off and on


def test_disabled_trace_is_a_flag_test_and_serves_nothing():
    configure(enable=False, port=0)
    reset()
    x = torch.ones(3)
    assert trace("hidden", x, layer=0) is x
    assert trace("anything", "not even a tensor") == "not even a tensor"  # not looked at
    assert url() is None and state()["series"] == 0 and state()["hub"] is None


def test_a_rank_outside_ranks_serves_no_hub(tmp_path):
    configure(enable=True, port=free_port(), token=TOKEN, ranks=[1], dir=str(tmp_path))
    try:
        assert url() is None and not state()["enabled"]
    finally:
        configure(enable=False, port=0, ranks=[0])


def test_frames_carry_the_compressor_output_and_the_tags(hub):
    torch.manual_seed(0)
    xs = [torch.randn(4, 2, 32) for _ in range(3)]

    async def main():
        async with connect(url()) as c:  # the token from the URL's fragment
            assert c.welcome["version"] == 2 and c.welcome["rank"] == 0
            assert c.welcome["compressors"] == tc.defaults(65536)
            sub = await c.subscribe(["hid*"], layers="1-2", compressor={"kind": "tiles", "tiles": 4},
                                    every=2, id="s1")
            assert sub == {"id": "s1", "names": ["hid*"], "layers": ["1-2"], "every": 2,
                           "compressor": {"kind": "tiles", "stats": ["mean", "absmax", "rms"], "tiles": 4,
                                          "dim": -1}}
            for s in range(4):
                step(*[x + s for x in xs])
            got = await frames(c, 4)
            listing = await c.list()
            return got, listing

    got, listing = run(main())
    assert [(f.step, f.layer) for f in got] == [(0, 1), (0, 2), (2, 1), (2, 2)]  # every 2 steps, layers 1-2
    assert [f.seq for f in got] == [0, 1, 2, 3]
    for f in got:
        assert f.meta["sub"] == "s1" and f.meta["name"] == "hidden" and f.meta["rank"] == 0
        assert f.meta["kind"] == "tiles" and f.meta["params"]["tiles"] == 4
        assert f.meta["source_shape"] == [4, 2, 32] and f.meta["source_dtype"] == "torch.float32"
        want = tc.parse({"kind": "tiles", "tiles": 4})(xs[f.layer] + f.step)
        assert f.array.shape == (3, 4) and np.array_equal(f.array, want.numpy())
    assert listing == [{"name": "hidden", "layers": [0, 1, 2], "shape": [4, 2, 32], "dtype": "torch.float32"}]


def test_the_frames_of_a_step_travel_together_in_few_messages(hub):
    """Protocol v2: the hub sends the frames queued for a client as one message (one
    send per batch, not per frame); trace_frame.split cuts it back into frames."""
    from source_patch.runtime.trace.frame import decode, split

    async def main():
        async with ws_connect(f"ws://127.0.0.1:{hub}/ws") as ws:
            await ws.send(json.dumps({"op": "hello", "token": TOKEN}))
            assert json.loads(await ws.recv())["version"] == 2
            await ws.send(json.dumps({"op": "subscribe", "id": "s", "names": ["hidden"]}))
            assert json.loads(await ws.recv())["op"] == "subscribed"
            step(*[torch.full((2, 8), float(layer)) for layer in range(8)])
            messages, got = 0, []
            while len(got) < 8:
                message = await asyncio.wait_for(ws.recv(), 10)
                messages += 1
                got += [decode(bytes(part)) for part in split(message)]
            return messages, got

    messages, got = run(main())
    assert [f.seq for f in got] == list(range(8)) and [f.layer for f in got] == list(range(8))
    assert [f.array[0].tolist() for f in got] == [[float(layer)] * 8 for layer in range(8)]  # tiles' means
    assert messages < 8


def test_a_non_tensor_is_the_call_sites_error(hub):
    with pytest.raises(TypeError, match="takes a tensor, got list"):
        trace("hidden", [1, 2], layer=0)


# ---------------------------------------------------------------- auth and limits


@pytest.mark.parametrize("hello", [
    {"op": "hello", "token": "wrong", "client": "t"},
    {"op": "hello", "client": "t"},
    {"op": "subscribe", "id": "s1", "names": ["x"]},
    "not json",
])
def test_bad_or_missing_token_closes_with_4401(hub, hello):
    async def main():
        async with ws_connect(f"ws://127.0.0.1:{hub}/ws") as ws:
            await ws.send(hello if isinstance(hello, str) else json.dumps(hello))
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            return info.value.rcvd

    rcvd = run(main())
    assert (rcvd.code, rcvd.reason) == (4401, "unauthorized")
    assert state()["hub"]["rejected"] == 1


def test_no_hello_in_time_closes_with_4401(hub, monkeypatch):
    monkeypatch.setattr(trace_hub, "HELLO_TIMEOUT_S", 0.2)  # (a forwarder keeps its 2 s)

    async def main():
        async with ws_connect(f"ws://127.0.0.1:{hub}/ws") as ws:
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            return info.value.rcvd

    assert run(main()).code == 4401


def test_the_client_api_reports_a_wrong_token(hub):
    async def main():
        async with connect(f"127.0.0.1:{hub}", "nope"):
            pass

    with pytest.raises(TraceError, match="4401 unauthorized"):
        run(main())


def test_an_oversized_message_closes_with_1009(hub):
    configure(max_message=1024)  # restarts the hub with the new limit
    assert state()["hub"]["clients"] == 0

    async def main():
        async with connect(url()) as c:
            await c.send_raw(json.dumps({"op": "list", "pad": "x" * 2000}))
            with pytest.raises(StopAsyncIteration):
                await c.next_frame(10)
            return c.close_code

    assert run(main()) == 1009


def test_more_clients_than_max_clients_are_turned_away(hub):
    """max_clients counts authenticated clients: the second one, with the token, is refused."""
    configure(max_clients=1)
    token = url().split("#token=")[1]

    async def main():
        async with connect(url()):
            async with ws_connect(f"ws://127.0.0.1:{hub}/ws") as second:
                await second.send(json.dumps({"op": "hello", "token": token}))
                with pytest.raises(ConnectionClosed) as info:
                    await second.recv()
                return info.value.rcvd.code

    assert run(main()) == 1013


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize("request_, error", [
    ("{not json", "malformed JSON"),
    ('["op", "list"]', "expected a JSON object"),
    ({"op": "explode"}, "unknown op 'explode' (valid: subscribe, unsubscribe, list, stats)"),
    ({"op": "subscribe", "id": "s1"}, "names must be a list"),
    ({"op": "subscribe", "id": "s1", "names": ["h"], "compressor": {"kind": "eval", "expr": "1"}},
     "unknown kind 'eval'"),
    ({"op": "subscribe", "id": "s1", "names": ["h"], "layers": "3-1"}, "bad range '3-1'"),
    ({"op": "subscribe", "id": "s1", "names": ["h"], "every": 0}, "every must be an integer >= 1"),
    ({"op": "subscribe", "id": "s1", "names": ["h"], "filter": "x > 0"}, "unknown key 'filter'"),
    ({"op": "subscribe", "names": ["h"]}, "id must be a string"),
    ({"op": "unsubscribe", "id": "zz"}, "no subscription 'zz'"),
    ({"op": "hello", "token": TOKEN}, "already authenticated"),
    (b"\x00binary", "expected JSON text messages"),
])
def test_a_malformed_request_gets_an_error_and_the_connection_stays_usable(hub, request_, error):
    async def main():
        async with connect(url()) as c:
            await c.send_raw(json.dumps(request_) if isinstance(request_, dict) else request_)
            await c.subscribe(["hidden"], compressor={"kind": "raw"}, id="after")  # still works
            step(torch.arange(3.0))
            frame = await c.next_frame(10)
            return c.errors, frame

    errors, frame = run(main())
    assert len(errors) == 1 and errors[0]["op"] == "error" and error in errors[0]["error"]
    assert frame.array.tolist() == [0.0, 1.0, 2.0]


def test_subscribe_errors_raise_in_the_client(hub):
    async def main():
        async with connect(url()) as c:
            with pytest.raises(TraceError, match="tiles must be in 1..4096"):
                await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": -1})
            return await c.stats()

    assert run(main())["clients"] == 1


def test_resubscribing_the_same_id_changes_the_compressor_at_run_time(hub):
    x = torch.randn(6, 16)

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 2}, id="s1")
            step(x)
            first = await c.next_frame(10)
            await c.subscribe(["hidden"], compressor={"kind": "topk", "k": 3}, id="s1")
            step(x)
            second = await c.next_frame(10)
            await c.unsubscribe("s1")
            step(x)
            await c.subscribe(["other"], compressor={"kind": "raw"}, id="s2")
            trace("other", torch.zeros(2))
            third = await c.next_frame(10)
            return first, second, third

    first, second, third = run(main())
    assert first.meta["kind"] == "tiles" and first.array.shape == (3, 2)
    assert second.meta["kind"] == "topk" and second.array.shape == (2, 3)
    assert np.array_equal(second.array, tc.parse({"kind": "topk", "k": 3})(x).numpy())
    assert third.name == "other" and third.step == 3  # nothing for 'hidden' after unsubscribing
    assert third.seq == 2


def test_two_clients_at_once_each_get_their_own_subscription(hub):
    x = torch.randn(8, 8)

    async def main():
        async with connect(url(), client="a") as a, connect(url(), client="b") as b:
            await a.subscribe(["hidden"], compressor={"kind": "histogram", "bins": 4}, id="same")
            await b.subscribe(["hid*"], compressor={"kind": "tiles", "tiles": 8}, id="same")
            for _ in range(3):
                step(x)
            fa, fb = await frames(a, 3), await frames(b, 3)
            stats = await a.stats()
            return fa, fb, stats

    fa, fb, stats = run(main())
    assert [f.seq for f in fa] == [0, 1, 2] and [f.seq for f in fb] == [0, 1, 2]  # per connection
    assert all(f.meta["kind"] == "histogram" and f.array.shape == (6,) for f in fa)
    assert all(f.meta["kind"] == "tiles" and f.array.shape == (3, 8) for f in fb)
    assert np.array_equal(fa[0].array, tc.parse({"kind": "histogram", "bins": 4})(x).numpy())
    assert stats["clients"] == 2 and stats["frames_sent"] >= 6 and stats["you"]["client"] == "a"


def test_compressor_errors_are_reported_once_per_subscription(hub, tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"v": torch.ones(5)}, str(path))

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "projection", "file": str(path)}, id="p")
            await c.subscribe(["hidden"], compressor={"kind": "raw", "max_elements": 4}, id="r")
            for _ in range(3):
                step(torch.ones(2, 6))  # 12 elements, last dim 6: neither fits
            await c.subscribe(["ok"], compressor={"kind": "raw"}, id="ok")
            trace("ok", torch.ones(1))
            frame = await c.next_frame(10)  # everything before it has been delivered
            return c.errors, frame

    errors, frame = run(main())
    assert frame.name == "ok" and frame.seq == 0
    assert sorted(e["id"] for e in errors) == ["p", "r"]
    assert "has 5 elements, the tensor's dim -1 has 6" in next(e for e in errors if e["id"] == "p")["error"]
    assert "over max_elements 4; not sent" in next(e for e in errors if e["id"] == "r")["error"]
    s = state()
    assert s["counters"]["compress_errors"] == 3 and s["counters"]["too_large"] == 3 and s["counters"]["errors"] == 0


# ---------------------------------------------------------------- slow clients


def test_a_client_that_never_reads_is_dropped_while_trace_keeps_returning(hub):
    configure(client_queue=4, stall_timeout=1.0)
    big = torch.randn(65536)  # 256 KiB raw frames: a burst fills the socket buffers and the queue

    async def main():
        async with connect(url(), client="good") as good:
            await good.subscribe(["big"], compressor={"kind": "tiles", "tiles": 4}, id="g")
            stalled = await ws_connect(f"ws://127.0.0.1:{hub}/ws", max_queue=1, compression=None)
            await stalled.send(json.dumps({"op": "hello", "token": TOKEN, "client": "stalled"}))
            await stalled.send(json.dumps({"op": "subscribe", "id": "s", "names": ["big"],
                                           "compressor": {"kind": "raw"}}))
            await good.stats()  # both subscriptions are in place
            steps = 0
            for _ in range(200):  # the training thread: never waits for either client
                trace("big", big)
                trace_step()
                steps += 1
            deadline = time.monotonic() + 30
            while state()["hub"]["clients_dropped"] == 0 and time.monotonic() < deadline:
                trace("big", big)
                trace_step()
                steps += 1
                await asyncio.sleep(0.01)
            hub_state = state()["hub"]
            assert flush(10)  # the good client's queue is empty again (its socket takes the rest)
            last = steps
            for _ in range(3):  # the good client gets every new step
                trace("big", big)
                trace_step()
                steps += 1
                assert flush(10)
            received = []
            while not received or received[-1].step < steps - 1:
                received.append(await good.next_frame(10))
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(stalled.recv(), 10)
            return last, steps, received, hub_state

    last, steps, received, hub_state = run(main())
    assert hub_state["clients_dropped"] == 1 and hub_state["dropped"] > 0  # its queue overflowed
    assert [c["client"] for c in hub_state["per_client"]] == ["good"]
    assert [f.step for f in received[-3:]] == list(range(last, steps))
    seqs = [f.seq for f in received]
    assert seqs == sorted(set(seqs))  # in order; a gap would only mean frames dropped for it


# ---------------------------------------------------------------- HTTP, token file, handle


def test_the_page_is_served_without_a_token_and_other_paths_are_404(hub):
    with urllib.request.urlopen(f"http://127.0.0.1:{hub}/", timeout=10) as resp:
        body = resp.read()
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")
    assert body == (trace_hub.VIEW / "index.html").read_bytes()
    for path in ("/state", "/../trace.py", "/trace_view/index.html", "/%2e%2e/trace.py"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{hub}{path}", timeout=10)
        assert info.value.code == 404, path
        info.value.close()


def test_a_generated_token_goes_to_a_private_file(hub, tmp_path):
    configure(token="")  # a new hub with a generated token
    files = list((tmp_path / "sp-trace").glob("*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    info = json.loads(files[0].read_text())
    assert info["token"] != TOKEN and len(info["token"]) >= 32 and info["page"] == url()
    assert info["page"].endswith(f"#token={info['token']}") and info["rank"] == 0

    async def main():
        async with connect(info["ws"], info["token"]) as c:
            return c.welcome["op"]

    assert run(main()) == "welcome"
    close()
    assert not files[0].exists()  # removed with the hub


def test_the_handle_and_the_package_both_reach_trace(hub):
    import importlib

    from source_patch.patcher.finder import RuntimeHandle

    package = importlib.import_module("source_patch.runtime.trace")  # the subpackage, imported first
    x = torch.ones(2)
    assert RuntimeHandle().trace("handle", x, layer=1) is x  # not shadowed by the subpackage
    assert package.trace("package", x) is x
    assert RuntimeHandle().trace.configure is package.configure  # the function carries the control API
    assert {e["name"] for e in names()} == {"handle", "package"}


# ---------------------------------------------------------------- CLI


def test_cli_records_a_stream_and_reads_it_back(hub, tmp_path):
    out = tmp_path / "run.sptrace"
    token_file = tmp_path / "token.txt"
    token_file.write_text(TOKEN + "\n")
    cmd = [sys.executable, "-m", "source_patch.runtime.trace.client", "record", "--url", f"127.0.0.1:{hub}",
           "--token-file", str(token_file), "--name", "hidden", "--compressor", "tiles", "--param", "tiles=2",
           "--param", 'stats=["min","max"]', "--out", str(out), "--frames", "4", "--retry", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    x = torch.arange(8.0).reshape(2, 4)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        step(x, x + 10)  # a training loop that runs whether or not anyone records
        time.sleep(0.02)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "4 frames written" in err
    recorded = list(read_recording(out))
    assert len(recorded) == 4 and all(f.meta["sub"] == "record" for f in recorded)
    compressor = tc.parse({"kind": "tiles", "tiles": 2, "stats": ["min", "max"]})
    for f in recorded:
        assert f.array.tolist() == compressor(x + 10 * f.layer).tolist()
    assert recorded[0].array.tolist() == [[0, 2], [5, 7]]
    table = subprocess.run([sys.executable, "-m", "source_patch.runtime.trace.client", "summary", str(out)],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert "hidden" in table and "4 frames" in table and summary(recorded).splitlines()[-1] == "4 frames, 2 series"
    shown = subprocess.run([sys.executable, "-m", "source_patch.runtime.trace.client", "show", str(out),
                            "--layer", "1"], capture_output=True, text=True, check=True, timeout=60).stdout
    assert shown.count("hidden layer 1 tiles [2, 2]") == 2 and "min 10 mean 13.5 max 17" in shown


def test_a_torn_recording_stops_at_the_last_whole_frame(tmp_path):
    from source_patch.runtime.trace.client import RECORDING_MAGIC, write_frame
    from source_patch.runtime.trace.frame import encode

    path = tmp_path / "torn.sptrace"
    with open(path, "wb") as f:
        f.write(RECORDING_MAGIC)
        write_frame(f, encode(np.ones(2, np.float32), {"name": "a"}))
        write_frame(f, encode(np.ones(2, np.float32), {"name": "b"}))
    path.write_bytes(path.read_bytes()[:-3])
    assert [f.name for f in read_recording(path)] == ["a"]
    (tmp_path / "bad").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a trace recording"):
        list(read_recording(tmp_path / "bad"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracing_a_cuda_tensor_never_synchronizes(hub):
    x = torch.randn(64, 4, 256, device="cuda")

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 16})
            step(x)  # warm-up: pinned buffers, events
            await c.next_frame(10)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(5):
                    step(x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            return await frames(c, 5)

    got = run(main())
    want = tc.parse({"kind": "tiles", "tiles": 16})(x).cpu().numpy()
    assert all(np.array_equal(f.array, want) for f in got) and [f.step for f in got] == [1, 2, 3, 4, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("timing", [True, False], ids=["event-per-result", "event-per-batch"])
def test_a_cuda_result_is_the_tensor_as_traced_and_its_device_time_is_counted(hub, timing):
    # The publisher copies results on its own stream (or reads the ring) behind the
    # training thread's events: an in-place change right after trace() must not reach
    # the frame, with an event per result (device_timing) or one per batch.
    configure(device_timing=timing)
    x = torch.randn(256, 4, 1024, device="cuda")
    wants = []

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 16})
            for _ in range(6):
                wants.append(tc.parse({"kind": "tiles", "tiles": 16})(x).cpu().numpy())
                trace("hidden", x, layer=0)
                x.mul_(-2).add_(1)  # queued behind the reduction, racing the copy
                trace_step()
            return await frames(c, 6)

    try:
        got = run(main())
        device_seconds = state()["cost_seconds"]["device_reduce"]
    finally:
        configure(device_timing=False)
    assert all(np.array_equal(f.array, want) for f, want in zip(got, wants))
    assert not np.array_equal(wants[0], wants[1])
    assert (device_seconds > 0) == timing


def test_results_waiting_for_their_batch_event_are_held_back_in_order_and_sealed_per_stream(monkeypatch):
    # The bookkeeping of one event per batch (api._defer, _seal, _take), without a
    # GPU: events are stand-ins, recorded on stand-in streams.
    from collections import deque

    from source_patch.runtime.trace import api

    recorded = []
    monkeypatch.setattr(api, "_record", lambda index, timing, stream=None: recorded.append(stream) or object())
    monkeypatch.setattr(api, "_capturing", lambda: False)
    monkeypatch.setattr(api, "_pending", deque())
    monkeypatch.setattr(api, "_unsealed", [])
    monkeypatch.setattr(api, "_tracer", None)

    class Stand:  # hashable, compared by identity, as streams and results are
        def __init__(self, **attrs):
            self.__dict__.update(attrs)

    a, b = Stand(device_index=0), Stand(device_index=1)
    ready = Stand(event="its own", stream=None)        # a result with its own event
    a1, b1, a2 = (Stand(event=None, stream=s) for s in (a, b, a))
    late = Stand(event="its own", stream=None)         # after them: waits to keep the order
    with api._lock:
        api._pending.append(ready)
        for item in (a1, b1, a2):
            api._pending.append(item)
            api._defer(item)
        api._pending.append(late)
        assert api._take() == [ready]  # the publisher stops at the first unsealed result
        other = threading.Thread(target=api._seal)  # another thread's stream may be capturing: no event
        other.start()
        other.join()
        assert recorded == [] and api._take() == []
        api._seal()  # the tracing thread: one event per stream, behind its results
        assert recorded == [a, b] and a1.event is a2.event and a1.event is not b1.event
        assert api._take() == [a1, b1, a2, late] and api._unsealed == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stepping_process_records_one_event_per_batch_and_only_on_its_own_thread(hub, monkeypatch):
    from source_patch.runtime.trace import api

    recorded = []
    record = api._event_record
    monkeypatch.setattr(api, "_event_record", lambda event, stream: recorded.append(stream) or record(event, stream))
    xs = [torch.randn(64, 4, 256, device="cuda") for _ in range(4)]

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 16})
            step(*xs)  # warm-up (and a step has ended: batches have an end from now on)
            await frames(c, 4)
            recorded.clear()
            step(*xs)
            got = await frames(c, 4)
            per_batch = len(recorded)
            for layer, x in enumerate(xs):
                trace("hidden", x, layer=layer)
            # Another thread's flush may not record on this thread's stream: nothing goes out.
            flushed = await asyncio.to_thread(flush, 0.5)
            unsealed = len(api._unsealed) + len(api._records)  # (planned calls' results wait as records)
            trace_step()
            return got, per_batch, flushed, unsealed, await frames(c, 4)

    got, per_batch, flushed, unsealed, after = run(main())
    want = [tc.parse({"kind": "tiles", "tiles": 16})(x).cpu().numpy() for x in xs]
    assert per_batch == 1 and not flushed and unsealed == 4
    assert [f.layer for f in after] == [0, 1, 2, 3] and [f.step for f in after] == [2] * 4
    assert all(np.array_equal(f.array, w) for f, w in zip(got + after, want + want))


def test_a_port_in_use_means_no_hub_and_training_goes_on(tmp_path):
    reset()  # counted from zero here, as in test_trace_forwarder's twin of this test
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = state()["counters"]["errors"]
        configure(enable=True, port=taken.getsockname()[1], token=TOKEN, dir=str(tmp_path), ranks=[0])
        try:
            x = torch.ones(2)
            assert trace("hidden", x, layer=0) is x
            s = state()
            assert not s["enabled"] and url() is None and s["counters"]["errors"] == before + 1
            assert "starting the trace hub" in s["last_error"] and "in use" in s["last_error"]
        finally:
            configure(enable=False, port=0)
            reset()


def test_due_calls_by_duration_fold_the_long_ones_into_the_last_bucket(monkeypatch):
    """The hot path counts a due call under its duration's bit length (no min() per
    call); state() gives CALL_BUCKETS buckets, the last counting everything longer."""
    from source_patch.runtime.trace import api

    counts = [0] * len(api._call_us)
    counts[0], counts[5], counts[api.CALL_BUCKETS - 1], counts[40] = 2, 3, 1, 4  # 40: a call of ~2**39 us
    monkeypatch.setattr(api, "_call_us", counts)
    got = state()["due_call_us"]
    assert len(got) == api.CALL_BUCKETS and got[0] == 2 and got[5] == 3 and got[-1] == 5 and sum(got) == 10
    reset()
    assert sum(state()["due_call_us"]) == 0 and len(api._call_us) == len(counts)
