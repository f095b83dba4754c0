"""The sentinels' metric lines and events through the trace hub (issue 54): the
sentinels hand each line to core/events (runtime/sentinels/events.py); the trace
capability, while a client follows records, subscribes there and forwards them (api.post
-> the publisher -> the hub, in a forwarder process or a thread) as JSON records; the
Python client and ``source-patch trace metrics`` read them.  With nobody following,
nothing is queued and nothing wakes (issue 59's rule).  The browser view's drawing of
them: tests/test_trace_view.py."""

import asyncio
import io
import os
import time

import pytest

from source_patch.runtime.core import events as core_events
from source_patch.runtime.core.endpoint import free_port
from source_patch.runtime.sentinels import events
from source_patch.runtime.trace import api, close, configure, reset, state, trace, trace_step, url
from source_patch.runtime.trace import client as trace_client
from source_patch.runtime.trace.client import connect

TOKEN = "series-token"


@pytest.fixture(params=["process", "thread"])
def served(request, tmp_path):
    configure(enable=True, port=free_port(), token=TOKEN, dir=str(tmp_path), ranks=[0], hub=request.param, wait=0)
    reset()
    events.clear()
    yield request.param
    close()
    configure(enable=False, port=0, hub="process")


def steps(first: int, last: int) -> None:
    """What the sentinels write at each step's end: a mismatch line, a routing_health line
    per layer, and at step 3 a non-finite event."""
    for step in range(first, last):
        events.metric("mismatch", step=step, samples=4, k3_mean=0.01 * step, max_abs_diff_max=0.1 * step,
                      k3_max=float("nan"), triggers=0)
        for layer in (1, 2):
            events.metric("routing_health", step=step, layer=layer, tokens=64, imbalance=1.0 + 0.1 * layer,
                          entropy=1.5, per_expert=[16, 16, 16, 16], dead=[], agreement=None)
        if step == 3:
            events.event("nonfinite", step=step, microbatch=0, phase="forward", layer=2, name="mlp_output",
                         site="mlp_output@2", nonfinite_sites=1, first_of_run=True)
        trace_step()


def test_a_client_receives_the_records_in_order(served):
    async def main():
        async with connect(url()) as c:
            reply = await c.follow()
            assert reply["op"] == "following" and reply["names"] == ["*"]
            steps(0, 5)
            got = [await c.next_record(10) for _ in range(5 * 3 + 1)]
            return got, c.metrics(), c.events(), await c.stats()

    got, series, happened, stats = asyncio.run(main())
    first = got[0].n  # numbered from 1 for the process's life (earlier tests' records came first)
    assert [r.n for r in got] == list(range(first, first + 16))  # in order, none lost
    metrics = [r.value for r in got if r.name == "sentinels.metric"]
    assert [(m["kind"], m["step"], m.get("layer")) for m in metrics[:3]] == [
        ("mismatch", 0, None), ("routing_health", 0, 1), ("routing_health", 0, 2)]
    assert metrics[0]["k3_max"] is None  # a non-finite figure is null: strict JSON
    assert metrics[1]["per_expert"] == [16, 16, 16, 16] and metrics[0]["rank"] == 0
    assert happened == [next(r.value for r in got if r.name == "sentinels.event")]
    assert happened[0]["kind"] == "nonfinite" and happened[0]["step"] == 3 and happened[0]["name"] == "mlp_output"
    # One series per (kind, figure, layer), by step; lists, nulls and booleans left out.
    assert series[("mismatch", "k3_mean", None)] == [(s, 0.01 * s) for s in range(5)]
    assert series[("routing_health", "imbalance", 2)] == [(s, 1.2) for s in range(5)]
    assert ("routing_health", "per_expert", 1) not in series and ("mismatch", "k3_max", None) not in series
    assert ("routing_health", "agreement", 1) not in series
    assert stats["records"] == 16 and stats["records_sent"] == 16 and stats["records_dropped"] == 0
    assert state()["counters"]["records"] == 16


def test_a_later_client_gets_the_backlog_then_live_records_and_names_filter(served):
    async def main():
        async with connect(url()) as first:
            await first.follow("sentinels.metric")
            steps(0, 4)  # 12 metric lines and an event the first does not follow
            seen = [await first.next_record(10) for _ in range(12)]
            async with connect(url()) as later:
                reply = await later.follow("sentinels.*", since=seen[0].n + 4)
                backlog = [await later.next_record(10) for _ in range(reply["backlog"])]
                steps(4, 5)
                live = [await later.next_record(10) for _ in range(3)]
            return seen, reply, backlog, live

    seen, reply, backlog, live = asyncio.run(main())
    base = seen[0].n - 1
    assert all(r.name == "sentinels.metric" for r in seen) and [r.n - base for r in seen] == list(range(1, 13))
    assert reply["last"] == base + 13 and reply["backlog"] == 8  # the event (13) too
    assert [r.n - base for r in backlog] == list(range(6, 14)) and [r.n - base for r in live] == [14, 15, 16]


def test_nobody_following_queues_nothing_and_wakes_nothing(served, monkeypatch):
    """No client (or clients that do not follow records): the trace runtime is not
    subscribed to core/events at all, so a sentinel's line costs core/events' one
    truthiness test; nothing is queued or counted, the publisher is not woken, and the
    forwarder gets no message."""
    time.sleep(0.3)  # the threads started
    assert api._on_record not in core_events._subscribers and not api.following()
    sent = []
    if served == "process":
        send = api.hub._send
        monkeypatch.setattr(api.hub, "_send", lambda message, payload=None: (sent.append(message["op"]),
                                                                           send(message, payload)))
    wakes, before = api._wakes, _switches()
    x = __import__("torch").ones(4, 8)
    for step in range(50):
        trace("hidden", x, layer=0)  # nobody subscribes either
        steps(step, step + 1)
    time.sleep(0.3)
    assert api._wakes == wakes and sent == []
    if before is not None:
        assert _switches() - before <= 2, "the publisher woke"
    s = state()  # (asks the forwarder for its statistics: a message)
    assert s["counters"]["records"] == 0 and s["counters"]["records_dropped"] == 0 and s["records_queued"] == 0

    async def subscriber_only():  # a client that subscribes to frames, not records: still nothing
        async with connect(url()) as c:
            await c.subscribe(["nothing"])
            steps(0, 3)
            await asyncio.sleep(0.3)
            return state()["counters"]["records"]

    assert asyncio.run(subscriber_only()) == 0


def test_following_subscribes_and_leaving_unsubscribes(served):
    async def main():
        async with connect(url()) as c:
            await c.follow()
            assert api.following() and api._on_record in core_events._subscribers
            await c.unfollow()
            for _ in range(100):  # (the hub tells a forwarder's traced process asynchronously)
                if not api.following():
                    break
                await asyncio.sleep(0.02)
            assert not api.following() and api._on_record not in core_events._subscribers
            await c.follow()
            assert api.following()
        for _ in range(100):
            if not api.following():
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert not api.following() and api._on_record not in core_events._subscribers


def test_a_full_queue_drops_and_counts_never_waits(served, monkeypatch):
    """The publisher takes records FLUSH_SECONDS after the first (or at a step's end): more
    than RECORD_QUEUE in between are dropped and counted, the emitting thread never waits;
    a record longer than RECORD_BYTES is dropped and counted too."""
    monkeypatch.setattr(api, "RECORD_QUEUE", 3)

    async def main():
        async with connect(url()) as c:
            await c.follow()
            started = time.perf_counter()
            for step in range(10):
                events.metric("mismatch", step=step, k3_mean=0.1)
            took = time.perf_counter() - started
            got = [await c.next_record(10) for _ in range(3)]
            assert [r.n - got[0].n for r in got] == [0, 1, 2]
            events.metric("mismatch", step=10, blob="x" * (api.RECORD_BYTES + 1))
            events.metric("mismatch", step=11, k3_mean=0.2)
            trace_step()
            last = await c.next_record(10)
            assert last.n == got[0].n + 4  # the long line was numbered, then dropped
            return took, got, last

    took, got, last = asyncio.run(main())
    assert took < 0.1
    assert [r.value["step"] for r in got] == [0, 1, 2]
    assert last.value["step"] == 11
    counters = state()["counters"]
    assert counters["records"] == 5 and counters["records_dropped"] == 7 + 1


def test_the_metrics_command_prints_the_records(served, capsys):
    async def main():
        out = io.StringIO()
        task = asyncio.ensure_future(trace_client.print_records(url(), None, records=4, seconds=20, out=out))
        for _ in range(200):
            if api.following():
                break
            await asyncio.sleep(0.02)
        steps(3, 4)
        assert await task == 4
        return out.getvalue()

    text = asyncio.run(main())
    lines = text.splitlines()
    assert lines[0].startswith("step 3 rank 0 mismatch samples=4 k3_mean=0.03 max_abs_diff_max=0.3")
    assert lines[1].startswith("step 3 rank 0 routing_health layer=1 tokens=64 imbalance=1.1")
    assert lines[3].startswith("EVENT step 3 rank 0 nonfinite microbatch=0 phase=forward layer=2 name=mlp_output")
    # the command line (text and --json), against the hub of this process
    steps(4, 5)  # into the hub's backlog: the command gets it first
    assert trace_client.main(["metrics", "--url", url(), "--records", "3", "--seconds", "20", "--json"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and all(line.startswith('{"n":') for line in printed)


def _switches():
    """The publisher thread's voluntary context switches so far (None off Linux)."""
    import threading

    if not os.path.exists("/proc/self/task"):
        return None
    thread = next(t for t in threading.enumerate() if t.name == "source-patch-trace-publisher")
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
