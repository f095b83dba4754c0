"""The trace hub in a forwarder process (runtime/trace/forwarder.py): what runs
where, and what happens when either side of the socket goes away.  The hub's
protocol itself is tested in both placements by tests/test_trace_hub.py."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from source_patch.runtime.trace import close, compress as tc, configure, reset, state, trace, trace_step, url
from source_patch.runtime.trace import forwarder
from source_patch.runtime.trace.client import connect
from source_patch.runtime.core.endpoint import free_port

TOKEN = "forwarder-token"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def served(tmp_path):
    port = free_port()
    configure(enable=True, port=port, token=TOKEN, dir=str(tmp_path), ranks=[0], hub="process", wait=0)
    reset()
    yield port
    close()
    configure(enable=False, port=0, hub="process")


def traced(x, tiles: int, layer: int, steps: int) -> tuple:
    """Subscribe to tiles of "hidden", trace ``x`` for ``steps`` steps: (frames, stats)."""
    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": tiles})
            for _ in range(steps):
                trace("hidden", x, layer=layer)
                trace_step()
            return [await c.next_frame(10) for _ in range(steps)], await c.stats()

    return asyncio.run(main())


def test_frames_are_encoded_and_served_by_another_process(served):
    x = torch.randn(16, 4, 32)
    frames, stats = traced(x, tiles=8, layer=2, steps=3)
    want = tc.parse({"kind": "tiles", "tiles": 8})(x).numpy()
    assert all(np.array_equal(f.array, want) and f.layer == 2 for f in frames)
    assert [f.step for f in frames] == [0, 1, 2] and stats["results"] == 3 and stats["step"] == 3
    assert sum(state()["due_call_us"]) == 3 and stats["due_call_us"] == state()["due_call_us"]  # by duration
    pid = state()["hub"]["forwarder_pid"]
    assert pid != os.getpid() and alive(pid)
    assert state()["hub"]["frames_sent"] == 3  # asked of the forwarder, not a stale copy


def test_results_reach_the_forwarder_through_the_shared_ring_and_are_released(served):
    from source_patch.runtime.trace import api

    ring = api._ring
    assert ring is not None, "hub: process on Linux shares a ring with its forwarder"
    before = ring.head
    x = torch.randn(32, 64)
    frames, _ = traced(x, tiles=4, layer=1, steps=5)
    want = tc.parse({"kind": "tiles", "tiles": 4})(x).numpy()
    assert all(np.array_equal(f.array, want) for f in frames)
    assert ring.head > before  # the five results went through the ring, not the socket
    deadline = time.monotonic() + 10
    while ring.released < ring.head and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.released == ring.head  # the forwarder gave every slice back (in the ring's shared memory)
    assert ring.refresh() == ring.tail == ring.head  # where the publisher takes it from before each batch


def test_the_planned_call_runs_only_where_every_condition_for_a_step_holds(served, monkeypatch):
    """What the planned due call does not check at each call (api._arm, at each
    trace_step and wherever one of them changes): the ring taking kernel writes at a
    device address, trace_step having run, one event per batch, no device_timing,
    Triton's direct launch; the ring's claims take the trace queue's lock, so that the
    call takes one lock for its slice and its place in the queue."""
    import types

    from source_patch.runtime.trace import api

    ring = api._ring
    assert ring.lock is api._lock
    monkeypatch.setattr(ring, "device_address", 1 << 40)  # as pinned on a GPU
    chain = types.SimpleNamespace(calls=[])  # Triton's HookChain: a profiler adds its hook to .calls
    hooks = types.SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=None)  # triton.knobs.runtime
    monkeypatch.setitem(sys.modules, api.__package__ + ".fused",  # Triton's kernel module, as on a GPU
                        types.SimpleNamespace(_hooks=hooks, _direct_ok=True))
    monkeypatch.setattr(api, "_stepping", False)
    api._arm()
    assert api._fast_ring is None  # no trace_step yet: one event per result
    trace_step()
    assert api._fast_ring is ring and api._hook_calls == ([], [])
    chain.calls.append(print)  # a hook added to the chain: seen at the next call, no re-arming
    assert api._hook_calls[0] == [print]
    hooks.launch_exit_hook = print  # a hook set in a chain's place: seen from the next step
    trace_step()
    assert api._hook_calls == ([print], [print])
    hooks.launch_exit_hook = chain.calls[:] = []
    for changes in ({"device_timing": True}, {"triton_launch": "triton"}, {"triton": False}):
        configure(**changes)
        assert api._fast_ring is None, changes
        configure(device_timing=False, triton_launch="direct", triton=True)
        assert api._fast_ring is ring, changes
    with monkeypatch.context() as patch:
        patch.setattr(api, "PER_BATCH_EVENTS", False)
        trace_step()
        assert api._fast_ring is None
    trace_step()
    monkeypatch.setattr(ring, "direct", False)  # a launch refused host memory (device.stage tells api, which re-arms)
    api._arm()
    assert api._fast_ring is None
    monkeypatch.setattr(ring, "direct", True)
    trace_step()
    assert api._fast_ring is ring
    close()
    assert api._fast_ring is None  # no hub, no ring


def test_the_ring_hands_out_slices_in_order_never_wraps_one_and_refuses_when_full():
    from source_patch.runtime.trace.ring import ALIGN, Ring

    ring = Ring(size=4 * ALIGN)
    a = torch.arange(60, dtype=torch.float32)           # 240 bytes: one slice
    offset, end, dtype, shape = ring.put(a)
    assert (offset, end, dtype, shape) == (0, ALIGN, "<f4", [60])
    assert np.array_equal(np.frombuffer(ring.bytes.numpy(), "<f4", 60, 0), a.numpy())
    b = torch.ones(2 * ALIGN, dtype=torch.uint8)
    assert ring.put(b)[:2] == (ALIGN, 3 * ALIGN)
    assert ring.put(torch.ones(2 * ALIGN, dtype=torch.uint8)) is None  # would overwrite unread bytes
    ring.release(ALIGN)
    assert ring.put(torch.ones(2 * ALIGN, dtype=torch.uint8)) is None  # wrapping needs 3 slices free
    ring.release(3 * ALIGN)
    offset, end, *_ = ring.put(torch.full((2 * ALIGN,), 7, dtype=torch.uint8))
    assert (offset, end) == (0, 6 * ALIGN)  # skipped the last slice: a result is never split
    assert ring.bytes[:2 * ALIGN].eq(7).all()
    assert not ring.takes(torch.ones(2, dtype=torch.bfloat16))  # numpy has no bfloat16: the socket path


def test_a_kernel_can_claim_a_slice_to_write_its_result_into():
    from source_patch.runtime.trace.ring import ALIGN, Ring

    ring = Ring(size=4 * ALIGN)
    ring.claim((1,))
    claimed = ring.claim((2, 3))
    view = claimed.tensor()
    view.copy_(torch.arange(6.0).view(2, 3))
    assert claimed.slot == (ALIGN, 2 * ALIGN, "<f4", [2, 3]) and view.shape == (2, 3)
    assert claimed.data_ptr() == view.data_ptr() == ring.bytes.data_ptr() + ALIGN  # what a launcher reads
    assert claimed.device_address is None  # not pinned: no device address
    assert np.array_equal(np.frombuffer(ring.bytes.numpy(), "<f4", 6, ALIGN), np.arange(6.0))
    head = ring.head
    assert ring.claim((4 * ALIGN,)) is None and ring.head == head  # too big now: nothing taken


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback without a CUDA driver")
def test_without_a_cuda_driver_the_ring_is_not_page_locked_and_host_results_still_use_it():
    from source_patch.runtime.trace.ring import ALIGN, Ring, register

    ring = Ring(size=4 * ALIGN)
    assert register(ring.address, ring.size) is False and ring.pin() is False and ring.device_address is None
    assert ring.takes(torch.ones(2))  # a host result needs no page-locking: it still goes through the ring


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_refused_page_lock_leaves_no_cuda_error_for_the_next_kernel():
    """The ring registers through the driver: a refusal (here: memory registered
    already) must not stay behind as the runtime's last error, which torch's next
    launch check would raise in the traced code."""
    import mmap

    from source_patch.runtime.trace.ring import register, unregister

    memory = mmap.mmap(-1, 1 << 20)
    address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    x = torch.ones(4, device="cuda")
    assert register(address, len(memory))
    try:
        assert not register(address, len(memory))  # refused: already registered
        x.mul_(2)  # raised "part or all of the requested memory range is already mapped" with the runtime's call
        torch.cuda.synchronize()
        assert x.tolist() == [2.0] * 4
    finally:
        assert unregister(address)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fused_kernel_writes_its_result_into_the_ring_directly(served):
    from source_patch.runtime.trace import api

    x = torch.randn(256, 4, 1024, device="cuda")
    spec = {"kind": "tiles", "tiles": 16}

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor=spec)
            for _ in range(3):
                trace("hidden", x, layer=0)
                x.mul_(2)  # after the call: the frame must hold the values as traced
                trace_step()
            return [await c.next_frame(10) for _ in range(3)]

    frames = asyncio.run(main())
    for k, frame in enumerate(frames):
        want = tc.parse(spec)((x / 2 ** (3 - k)).cpu()).numpy()
        np.testing.assert_allclose(frame.array, want, rtol=1e-5, atol=1e-5)
    ring = api._ring
    assert ring.pinned and ring.direct, state()["last_error"]  # no fallback to a copy was needed
    assert state()["counters"]["compress_errors"] == 0 and state()["counters"]["errors"] == 0


def test_a_dead_forwarder_stops_tracing_and_training_goes_on(served):
    x = torch.ones(4, 8)

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles"})
            trace("hidden", x, layer=0)
            trace_step()
            await c.next_frame(10)
            os.kill(state()["hub"]["forwarder_pid"], signal.SIGKILL)  # the client is still subscribed
            deadline = time.monotonic() + 10
            while state()["subscriptions"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    asyncio.run(main())
    for _ in range(3):
        assert trace("hidden", x, layer=0) is x
        trace_step()
    s = state()
    assert s["subscriptions"] == 0 and s["counters"]["errors"] == 1 and "trace forwarder" in s["last_error"]


def test_the_forwarder_ends_with_the_traced_process(tmp_path):
    script = textwrap.dedent(f"""
        import json, os, sys
        from source_patch.runtime.trace import configure, state
        configure(enable=True, port={free_port()}, token="t", dir={str(tmp_path)!r}, hub="process")
        print(json.dumps(state()["hub"]["forwarder_pid"]), flush=True)
        os._exit(0)  # no atexit, no goodbye: as if killed
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = json.loads(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_the_token_file_names_the_traced_process(tmp_path):
    configure(enable=True, port=free_port(), token="", dir=str(tmp_path), ranks=[0], hub="process")
    try:
        (path,) = tmp_path.glob("*.json")
        info = json.loads(path.read_text())
        assert info["pid"] == os.getpid() and f"-p{os.getpid()}-" in path.name
        assert info["page"] == url() and info["token"] in url()
    finally:
        close()
        configure(enable=False, port=0)
    assert not list(tmp_path.glob("*.json"))  # removed when the hub stops


def test_when_no_forwarder_can_start_a_thread_serves(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no processes left")

    monkeypatch.setattr(forwarder.subprocess, "Popen", refuse)
    reset()
    configure(enable=True, port=free_port(), token=TOKEN, dir=str(tmp_path), ranks=[0], hub="process")
    try:
        s = state()
        assert url() is not None and "forwarder_pid" not in s["hub"]
        assert s["counters"]["errors"] == 1 and "serving from a thread instead" in s["last_error"]
        assert "no processes left" in s["last_error"]
    finally:
        close()
        configure(enable=False, port=0)
        reset()


def test_a_port_in_use_is_reported_by_the_forwarder_without_a_fallback(tmp_path):
    # Counted from zero here: a hub stopped by an earlier test may still count its
    # own late failure while a loaded machine winds it down (seen once in CI).
    reset()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = state()["counters"]["errors"]
        configure(enable=True, port=taken.getsockname()[1], token=TOKEN, dir=str(tmp_path), ranks=[0],
                  hub="process")
        try:
            s = state()
            assert url() is None and not s["enabled"] and s["counters"]["errors"] == before + 1
            assert "starting the trace hub" in s["last_error"] and "in use" in s["last_error"]
        finally:
            configure(enable=False, port=0)
            reset()


# ---------------------------------------------------------------- what tracing wakes in the traced process (issue 59)


def voluntary_switches(name: str) -> int:
    """The voluntary context switches of this process's thread ``name`` so far (each a
    wake-up after sleeping: on a lock, a condition, a socket, the GIL)."""
    import threading

    thread = next(t for t in threading.enumerate() if t.name == name)
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


PUBLISHER, READER = "source-patch-trace-publisher", "source-patch-trace-forwarder"


def counting(monkeypatch) -> dict:
    """Count the messages the traced process sends its forwarder and receives from it, by op."""
    from source_patch.runtime.trace import api

    counts: dict = {}
    send, receive = api.hub._send, forwarder._recv

    def counted_send(message, payload=None):
        counts["to " + message["op"]] = counts.get("to " + message["op"], 0) + 1
        return send(message, payload)

    def counted_receive(conn):
        message = receive(conn)
        counts["from " + message["op"]] = counts.get("from " + message["op"], 0) + 1
        return message

    monkeypatch.setattr(api.hub, "_send", counted_send)
    monkeypatch.setattr(forwarder, "_recv", counted_receive)
    return counts


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
@pytest.mark.parametrize("stepping", [True, False])
def test_with_no_client_nothing_wakes_in_the_traced_process(served, monkeypatch, stepping):
    """No client: the publisher sleeps without a timeout and the forwarder sends nothing
    unasked, so neither thread of the traced process wakes (they woke ~5 times a second
    each: a timed wait, state pushed to the forwarder, its statistics pushed back), with
    steps ending (trace_step) or not."""
    from source_patch.runtime.trace import api

    monkeypatch.setattr(api, "_stepping", stepping)
    time.sleep(0.3)  # the threads started
    counts = counting(monkeypatch)
    before = voluntary_switches(PUBLISHER), voluntary_switches(READER)
    x = torch.ones(4, 8)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        trace("hidden", x, layer=0)  # nobody subscribes
        if stepping:
            trace_step()
        time.sleep(0.01)
    woke = voluntary_switches(PUBLISHER) - before[0], voluntary_switches(READER) - before[1]
    assert woke[0] <= 2 and woke[1] <= 2, f"publisher, reader woke {woke} times in 2 s; messages {counts}"
    assert counts == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_with_a_client_the_forwarder_sends_nothing_back_per_batch(served, monkeypatch):
    """The forwarder gives the ring's slices back through the ring's shared memory
    (``released``), not a message per batch, and pushes no statistics: the traced
    process's reader thread does not wake while frames flow; the publisher wakes about
    once a step."""
    from source_patch.runtime.trace import api

    ring = api._ring
    x = torch.randn(16, 32)

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 4})
            trace("hidden", x, layer=0)
            trace_step()
            await c.next_frame(10)
            await asyncio.sleep(0.3)
            counts = counting(monkeypatch)
            before = voluntary_switches(PUBLISHER), voluntary_switches(READER)
            for _ in range(20):
                trace("hidden", x, layer=0)
                trace_step()
                await c.next_frame(10)
                await asyncio.sleep(0.05)
            woke = voluntary_switches(PUBLISHER) - before[0], voluntary_switches(READER) - before[1]
            return dict(counts), woke  # (closing the client changes the subscriptions: messages)

    counts, woke = asyncio.run(main())
    assert counts == {"to results": 20}, counts  # and nothing back
    assert woke[1] <= 2 and woke[0] <= 3 * 20, woke  # (the publisher: its step's batch, a GIL wait or two)
    deadline = time.monotonic() + 10
    while ring.released < ring.head and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.released == ring.head


def test_the_forwarder_imports_no_torch(served, tmp_path):
    """The forwarder parses compressors and runs their host stage with numpy: torch (~3 s
    of a core, ~200-500 MiB) is not in the child, after every kind of compressor served
    a frame, a projection's vector checked there too (bfloat16 included, which numpy
    cannot read)."""
    from safetensors.torch import save_file

    path = tmp_path / "direction.safetensors"
    save_file({"v": torch.randn(32, dtype=torch.bfloat16), "zero": torch.zeros(32, dtype=torch.bfloat16)}, str(path))
    x = torch.randn(8, 32)
    specs = [{"kind": "tiles", "tiles": 4}, {"kind": "histogram", "bins": 8}, {"kind": "topk", "k": 3},
             {"kind": "projection", "file": str(path), "key": "v"}, {"kind": "raw"}]

    async def main():
        async with connect(url()) as c:
            for n, spec in enumerate(specs):
                await c.subscribe(["hidden"], compressor=spec, id=f"s{n}")
            with pytest.raises(Exception, match="has norm 0.0; cannot normalize"):  # checked in the child
                await c.subscribe(["hidden"], compressor={"kind": "projection", "file": str(path), "key": "zero"})
            trace("hidden", x, layer=0)
            trace_step()
            return [await c.next_frame(10) for _ in specs]

    frames = asyncio.run(main())
    by_sub = {f.meta["sub"]: f for f in frames}
    for n, spec in enumerate(specs):
        want = tc.parse(spec)(x).numpy()
        np.testing.assert_allclose(by_sub[f"s{n}"].array, want, rtol=1e-5, atol=1e-6)
    pid = state()["hub"]["forwarder_pid"]
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "/torch/" not in maps


def test_a_clients_stats_and_list_are_fresh_without_a_timer(served):
    """Nothing is pushed to the forwarder on a timer any more: a client's stats, list and
    hello ask the traced process at once, so they show a step, a name or a frame just
    now, and frames_sent goes up with each frame."""
    x = torch.ones(4, 8)

    async def main():
        trace("first_name", x, layer=0)
        async with connect(url()) as c:
            seen = [sorted(e["name"] for e in await c.list()), c.welcome["step"]]
            first = await c.stats()
            trace_step()
            trace_step()
            trace("second_name", x, layer=1)
            seen.append(sorted(e["name"] for e in await c.list()))
            stats = [first, await c.stats()]
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 2})
            for _ in range(2):
                for _ in range(3):
                    trace("hidden", x, layer=0)
                    trace_step()
                    await c.next_frame(10)
                stats.append(await c.stats())
            return seen, stats

    seen, stats = asyncio.run(main())
    (names, step, later_names), (first, second, third, fourth) = seen[:1] + seen[1:2] + seen[2:], stats
    assert "first_name" in names and step == first["step"]
    assert "second_name" in later_names and second["step"] == first["step"] + 2
    assert (third["frames_sent"], fourth["frames_sent"]) == (first["frames_sent"] + 3, first["frames_sent"] + 6)
    assert (third["results"], fourth["results"]) == (first["results"] + 3, first["results"] + 6)
    assert fourth["step"] == first["step"] + 8
    assert state()["hub"]["frames_sent"] == fourth["frames_sent"]
    assert state()["cost_seconds"]["hub_cpu"] > 0  # the child's CPU clock, read without a message


def test_before_any_step_a_result_still_goes_out_within_the_flush_interval(served, monkeypatch):
    """A process that never calls trace_step (its results wait for no step's end): the
    publisher, asleep without a timeout, is nudged by the first result and hands the
    batch over FLUSH_SECONDS later, all of it at once."""
    from source_patch.runtime.trace import api

    monkeypatch.setattr(api, "_stepping", False)
    x = torch.ones(4, 8)

    async def main():
        async with connect(url()) as c:
            await c.subscribe(["hidden"], compressor={"kind": "tiles", "tiles": 2})
            await asyncio.sleep(0.3)
            counts = counting(monkeypatch)
            started = time.monotonic()
            for layer in range(3):
                trace("hidden", x, layer=layer)
            got = [await c.next_frame(5) for _ in range(3)]
            return got, time.monotonic() - started, dict(counts)

    got, took, counts = asyncio.run(main())
    assert sorted(f.layer for f in got) == [0, 1, 2] and took < 3.0
    assert counts == {"to results": 1}  # one batch


def test_the_forwarder_gives_slices_back_through_the_rings_shared_memory():
    """forwarder.Tail writes how far it has read into the page after the slices, in its
    own mapping of the ring's memory; the traced process takes it as its tail where it
    refreshes (the publisher, before each batch), or where a claim finds the ring full;
    a new forwarder starts from the head."""
    from source_patch.runtime.trace.ring import ALIGN, Ring

    ring = Ring(size=4 * ALIGN)
    tail = forwarder.Tail(ring.fd, ring.released_at)
    for _ in range(4):
        assert ring.claim((1,)) is not None
    assert ring.claim((1,)) is None  # full
    tail.release(2 * ALIGN)
    assert ring.released == 2 * ALIGN and ring.tail == 0  # the due call reads its own copy: not yet
    assert ring.claim((1,)) is not None and ring.tail == 2 * ALIGN  # full: read now, and taken
    tail.release(ALIGN)  # never backwards
    assert ring.released == 2 * ALIGN
    tail.release(4 * ALIGN)
    assert ring.refresh() == 4 * ALIGN and ring.state()["in_use"] == ALIGN
    ring.head = 7 * ALIGN
    ring.reset()
    assert ring.tail == ring.released == 7 * ALIGN
