"""The trace hub in a process of its own (setting ``hub: process``, the default).

In the traced process only two things stay: the training thread launches the device
stage, whose result lands in a page-locked ring this process maps too (ring.py), and
records an event (api.py); the publisher thread waits for the events and sends a
header naming the ring's slices (results the ring does not take: their bytes).  This process, a child
of the traced one, runs the compressors' host stage, encodes the frames and serves
the WebSocket hub (hub.py): that CPU time no longer competes for the training
process's GIL.

    traced process                            forwarder (python -c ENTRY IN OUT)
    Forwarder.publish(items)  --results-->    read the ring, finish, encode, Hub.deliver
    Ring.released (shared)    <--written---   Tail.release: the slices are free again
    set_subscriptions(...)    <--subs-----    Hub (subscribe / unsubscribe)
    Forwarder.post(records)   --records-->    Hub.post: to the clients that follow records
    set_following(on)         <--follow---    Hub (a client follows records, or none does any more)
    api.snapshot, names       <--want_state-  Mirror.refresh: before a stats, list or hello
                              --state---->    Mirror: names, step, counters
    drain / stats / report    --op------->    Hub.drain / stats / report / config

Nothing goes either way on a timer: with no client the traced process's publisher and
reader threads sleep until a result, a step or a request (docs/bench-notes/overhead.md,
issue 59).  The child imports no torch: the compressors' host stage and their
parameters' checks are numpy (compress.py imports torch at the device stage's first
use, which only the traced process runs).

The wire is two socketpairs, one each way, carrying length-prefixed messages
(``multiprocessing.connection``'s ``send_bytes``, never its pickling ``send``): a
JSON object, and for ``results`` whose bytes are not in the ring one more message with
them back to back.  One way each: a socket's readers and writers sleep on one wait
queue, so on one socket both ways the reader thread here woke (and slept again) each
time the child read a batch, with nothing for it.  The child starts with no
SOURCE_PATCH* variables (it patches and traces nothing itself) and without the current
folder on ``sys.path`` (ENTRY), exits when its inbound socket closes (its parent ended
or stopped it), and writes the token file under the parent's pid.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

log = logging.getLogger("source_patch.trace")

START_TIMEOUT_S = 60.0        # the child starts its hub before it answers (no torch: well under this)
MAX_MESSAGE = 1 << 30         # bytes: the parent is trusted, but every input is bounded
# The child's code.  `python -m` and `-c` put the current folder first on sys.path, and
# every trace-enabled job starts this child wherever it was started: a json.py or a
# source_patch/ planted there would run in it.  The first statement drops that entry
# (Python adds it after `site` has run, so nothing was imported from it yet); the rest
# of sys.path (PYTHONPATH, the user's site) stays the parent's.  `-P` would do the same
# from 3.11 only, and `-I` would drop PYTHONPATH too.
ENTRY = ("import sys\n"
         "if sys.path[:1] == ['']: del sys.path[0]\n"
         "from source_patch.runtime.trace.forwarder import main\n"
         "sys.exit(main())\n")


class ForwarderUnavailable(RuntimeError):
    """The child could not be started or did not answer (not a hub error such as a port in use)."""


def _send(conn: Connection, message: dict, payload: bytes | None = None) -> None:
    conn.send_bytes(json.dumps(message, separators=(",", ":")).encode())
    if payload is not None:
        conn.send_bytes(payload)


def _recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes(MAX_MESSAGE))


# ---------------------------------------------------------------- the traced process's side


class Forwarder:
    """What api.py holds where it would hold a ``hub.Hub``: the same methods, each
    forwarded to the child, and the child's answers cached for ``stats``."""

    def __init__(self, runtime, config: dict):
        from ..core.ranks import global_rank

        from .ring import shared

        self.runtime = runtime
        self.ring = shared()
        out, their_in = socket.socketpair()   # to the child
        their_out, inbox = socket.socketpair()  # from it
        env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
        env["RANK"] = str(global_rank())  # the rank the hub reports, as the parent knows it
        fds = [their_in.fileno(), their_out.fileno()] + ([self.ring.fd] if self.ring else [])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY, str(their_in.fileno()), str(their_out.fileno())],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            out.close()
            inbox.close()
            raise ForwarderUnavailable(f"cannot start the trace forwarder: {exc}") from exc
        finally:
            their_in.close()
            their_out.close()
        self.conn = Connection(out.detach(), readable=False)  # what this process sends
        self.inbox = Connection(inbox.detach(), writable=False)  # what the child sends (_read)
        self._write = threading.Lock()   # publisher, training (report) and control threads all send
        self._subs: dict = {}            # child's subscription number -> parsed Subscription
        self._stats: dict = {}
        self._cpu = 0.0
        self._series_sent = -1         # the names the child has: sent again when more were seen
        self._answers: dict = {}       # request number -> Event with .answer
        self._numbers = itertools.count()
        self.closed = self.stopping = False
        self._config = config
        ready = self._start(config)
        self.url, self.ws_url, self.page_url = ready["url"], ready["ws"], ready["page"]
        self.token = ready["token"]
        self.thread = threading.Thread(target=self._read, name="source-patch-trace-forwarder", daemon=True)
        self.thread.start()

    def _start(self, config: dict) -> dict:
        try:
            ring = {"ring": [self.ring.fd, self.ring.size, self.ring.released_at]} if self.ring else {}
            if self.ring:
                self.ring.reset()
            self._send({"op": "start", "config": config, "pid": os.getpid(), **ring})
            if not self.inbox.poll(START_TIMEOUT_S):
                raise ForwarderUnavailable(f"the trace forwarder did not answer within {START_TIMEOUT_S:g} s")
            ready = _recv(self.inbox)
        except (OSError, EOFError, ValueError) as exc:
            self._kill()
            raise ForwarderUnavailable(f"the trace forwarder failed to start: {exc}") from exc
        if ready.get("op") != "ready":
            self._kill()
            raise RuntimeError(ready.get("error", "the trace forwarder refused to start"))
        return ready

    # -- what api.py calls

    @property
    def config(self) -> dict:
        return self._config

    @config.setter
    def config(self, config: dict) -> None:  # queue sizes and timeouts apply at once
        self._config = config
        self._try_send({"op": "config", "config": config})

    def publish(self, items: list, rank: int) -> None:
        """(publisher thread) Hand fetched results over: one header naming where each
        result's bytes are (a slice of the ring, or the blob that follows), one blob."""
        from ..core.tags import tag_value

        if self.ring is not None:
            self.ring.refresh()  # the slices the child has read since the last batch: free again
        header, blobs, release = [], [], 0
        for item in items:
            meta = {"subs": [sub.client for sub in item.subs], "name": item.name,
                    "tags": {k: tag_value(v) for k, v in item.tags.items()}, "step": item.step,
                    "time": item.time, "shape": list(item.shape), "dtype": str(item.dtype)}
            if item.slot is not None:
                offset, release, dtype, shape = item.slot  # slots come in order: the last end counts
                meta["ring"] = [offset, dtype, shape]
            else:
                array = item.host.numpy()
                meta["array"] = [array.dtype.str, list(array.shape)]
                blobs.append(array.tobytes())
            header.append(meta)
        message = {"op": "results", "items": header, "rank": rank}
        if release:
            message["release"] = release
        if blobs:
            message["blob"] = True  # one message more: the results' bytes
        self._try_send(message, b"".join(blobs) if blobs else None)

    def post(self, records: list) -> None:
        """(publisher thread) Records ``[(number, name, JSON text)]`` for the clients that follow them."""
        if records:
            self._try_send({"op": "records", "records": records})

    def report(self, sub, message: str) -> None:
        self._try_send({"op": "report", "sub": sub.client, "error": message})

    def drain(self, timeout: float) -> bool:
        answer = self._ask({"op": "drain", "timeout": timeout}, timeout + 1)
        return bool(answer and answer["ok"])

    def cpu_seconds(self) -> float:
        """The child's CPU time so far: read from its process CPU clock (no message), else
        the figure of its last answer."""
        try:
            return time.clock_gettime(((~self.proc.pid) << 3) | 2)  # Linux: MAKE_PROCESS_CPUCLOCK(pid, SCHED)
        except (OSError, OverflowError, ValueError):  # ended, or not Linux
            return self._cpu

    def stats(self) -> dict:
        """The child's hub statistics, asked for now (cached ones if it does not answer in 2 s)."""
        self._ask({"op": "stats"}, 2.0)
        return {**self._stats, "forwarder_pid": self.proc.pid}

    def _ask(self, message: dict, timeout: float) -> dict | None:
        """Send a request and wait for its answer (None: no answer in time, or no child)."""
        number = next(self._numbers)
        waiter = self._answers[number] = threading.Event()
        try:
            if not self._try_send({**message, "id": number}) or not waiter.wait(timeout):
                return None
            return waiter.answer
        finally:
            self._answers.pop(number, None)

    def stop(self) -> None:
        self.stopping = True  # the child's EOF that follows is expected
        self._try_send({"op": "stop"})
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self._kill()
        self.closed = True
        self.conn.close()
        self.inbox.close()
        self.thread.join(5)

    def close_sockets(self) -> None:
        """In a forked child: let go of the parent's sockets without a word on them."""
        for conn in (self.conn, self.inbox):
            try:
                os.close(conn.fileno())
            except OSError:
                pass

    # -- internals

    def _send(self, message: dict, payload: bytes | None = None) -> None:
        with self._write:
            _send(self.conn, message, payload)

    def _try_send(self, message: dict, payload: bytes | None = None) -> bool:
        if self.closed:
            return False
        try:
            self._send(message, payload)
            return True
        except (OSError, ValueError) as exc:  # the child is gone: tracing stops, training goes on
            self._lost(exc)
            return False

    def _read(self) -> None:
        """(forwarder thread) Subscriptions, statistics and drain answers from the child."""
        try:
            while True:
                message = _recv(self.inbox)
                op = message.get("op")
                if op == "subs":
                    self._set_subscriptions(message["subs"])
                    self._try_send({"op": "applied", "seq": message["seq"]})
                elif op == "follow":
                    self.runtime.set_following(bool(message["on"]))
                    self._try_send({"op": "applied", "seq": message["seq"]})
                elif op == "want_state":
                    self._share_state(message["id"])
                elif op == "stats":
                    self._stats, self._cpu = message["stats"], message["cpu"]
                elif op == "answer":
                    waiter = self._answers.get(message["id"])
                    if waiter is not None:
                        waiter.answer = message
                        waiter.set()
        except (OSError, EOFError, ValueError) as exc:
            if not (self.closed or self.stopping):
                self._lost(exc)

    def _share_state(self, number: int) -> None:
        """(reader thread) What the child's hub answers ``stats``, ``list`` and a hello with,
        asked for by the child before each (Mirror.refresh): this process's snapshot, and
        its names where more were seen since last sent."""
        try:
            state = self.runtime.snapshot()
            names = None
            if state["series"] != self._series_sent:
                names, self._series_sent = self.runtime.names(), state["series"]
        except Exception as exc:  # noqa: BLE001 - the reader must survive anything
            self.runtime.fail("sharing state with the trace forwarder", exc)
            state, names = None, None
        self._try_send({"op": "state", "id": number, "state": state, "names": names})

    def _set_subscriptions(self, wanted: list) -> None:
        # Subscriptions the child still has keep their objects (and so their
        # every-N-steps state); new ones are parsed here too, for their device stage.
        from .hub import parse_subscription

        subs = {}
        for number, canonical in wanted:
            sub = self._subs.get(number)
            if sub is None:
                try:
                    sub = parse_subscription(canonical, number, self._config["raw_max_elements"])
                except (ValueError, TypeError, OSError) as exc:
                    self.runtime.fail("a subscription from the trace forwarder", exc)
                    continue
            subs[number] = sub
        self._subs = subs
        self.runtime.set_subscriptions(list(subs.values()))

    def _lost(self, exc: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        self.runtime.fail("the trace forwarder process", exc)
        self.runtime.set_subscriptions(())
        self.runtime.set_following(False)
        for waiter in list(self._answers.values()):
            waiter.answer = None
            waiter.set()

    def _kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


# ---------------------------------------------------------------- the forwarder process


REFRESH_TIMEOUT_S = 2.0  # a parent that does not answer a state request: the last copy answers


class Mirror:
    """The runtime as the child's hub sees it: subscriptions go to the parent, and
    names, step and counters come from the parent's snapshot, asked for before each
    request that shows them (refresh), never sent on a timer."""

    def __init__(self, conn: Connection, write: threading.Lock):
        self.conn, self._write = conn, write
        self.shared: dict = {"step": 0, "rank": 0, "results": 0, "dropped": 0, "skipped": 0, "errors": 0,
                             "compress_errors": 0, "too_large": 0, "cost_seconds": {}, "due_call_us": []}
        self.series: list = []
        self.by_number: dict = {}   # subscription number -> the hub's Subscription
        self._numbers = itertools.count()
        self.hub = None
        self.sent = self.acked = 0  # subscription sets sent to / applied by the parent (loop thread)
        self._waiters: list = []
        self.asked = self.answered = 0  # state requests sent to / answered by the parent (loop thread)
        self._fresh = None  # the future of the request in flight, which later askers share

    def set_subscriptions(self, subs) -> None:
        """(hub loop) Number each subscription once; tell the parent the current set."""
        current = {}
        for sub in subs:
            if getattr(sub, "number", None) is None:
                sub.number = next(self._numbers)
            current[sub.number] = sub
        self.by_number = current
        self.sent += 1
        with self._write:
            _send(self.conn, {"op": "subs", "seq": self.sent,
                              "subs": [[n, s.canonical()] for n, s in current.items()]})

    def set_following(self, on: bool) -> None:
        """(hub loop) Tell the parent whether a client follows records (it subscribes to
        them only then: with none, nothing is queued or sent)."""
        self.sent += 1  # acknowledged as a subscription set is (applied): in order with them
        with self._write:
            _send(self.conn, {"op": "follow", "on": bool(on), "seq": self.sent})

    async def applied(self, timeout: float = 5.0) -> None:
        """(hub loop) Until the parent applied the last set sent (at most ``timeout``)."""
        import asyncio

        if self.acked >= self.sent:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((self.sent, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass

    def ack(self, seq: int) -> None:
        """(hub loop) The parent applied set ``seq``."""
        self.acked = max(self.acked, seq)
        waiting = []
        for sent, waiter in self._waiters:
            if sent <= self.acked:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                waiting.append((sent, waiter))
        self._waiters = waiting

    async def refresh(self) -> None:
        """(hub loop) The parent's current state, asked for now: what a ``stats``, ``list``
        or hello answers with (at most REFRESH_TIMEOUT_S; then the last copy).  Requests
        made while one is in flight share its answer."""
        import asyncio

        fresh = self._fresh
        if fresh is None or fresh.done():
            fresh = self._fresh = asyncio.get_running_loop().create_future()
            self.asked += 1
            try:
                with self._write:
                    _send(self.conn, {"op": "want_state", "id": self.asked})
            except (OSError, ValueError):
                fresh.set_result(None)  # the parent is gone: the main loop ends this process
        try:
            await asyncio.wait_for(asyncio.shield(fresh), REFRESH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass

    def refreshed(self, number: int, state: dict | None, names: list | None) -> None:
        """(hub loop) The parent's answer to state request ``number``."""
        if state is not None:
            self.shared = state
        if names is not None:
            self.series = names
        self.answered = max(self.answered, number)
        fresh = self._fresh
        if fresh is not None and not fresh.done() and self.answered >= self.asked:
            fresh.set_result(None)

    def current_step(self) -> int:
        return self.shared["step"]

    def names(self) -> list:
        return self.series

    def snapshot(self) -> dict:
        cost = dict(self.shared.get("cost_seconds", {}))
        cost["hub_cpu"] = time.process_time()  # this whole process is the hub's cost
        return {**self.shared, "cost_seconds": cost}

    def fail(self, where: str, exc: BaseException) -> None:
        log.warning("source-patch trace forwarder: %s: %s: %s", where, type(exc).__name__, exc)


class Tail:
    """How far the forwarder has read a ring, written into the ring's memory (the page
    after the slices: ring.Ring.released), mapped writable here, where the traced
    process's publisher reads it before each batch (Ring.refresh).  Written in place of a
    message per batch, which woke the traced process's reader thread."""

    def __init__(self, fd: int, at: int):
        import numpy as np

        self._map = mmap.mmap(fd, mmap.PAGESIZE, offset=at)
        self._released = np.frombuffer(self._map, dtype=np.int64, count=1)

    def release(self, upto: int) -> None:
        """Slices up to ``upto`` are read (copied out: _frames_of): the traced process may
        reuse them.  One aligned 8-byte store; its only writer while this process runs."""
        if upto > self._released[0]:
            self._released[0] = upto


def _frames_of(mirror: Mirror, header: dict, blob: bytes, ring) -> list:
    import numpy as np

    from .hub import result_frames

    frames, offset = [], 0
    for item in header["items"]:
        if "ring" in item:  # copied: the slice is handed back once this batch is read
            at, dtype, shape = item["ring"]
            dtype = np.dtype(dtype)
            array = np.frombuffer(ring, dtype, math.prod(shape), at).reshape(shape).copy()
        else:
            dtype, shape = item["array"]
            dtype = np.dtype(dtype)
            array = np.frombuffer(blob, dtype, math.prod(shape), offset).reshape(shape)
            offset += array.nbytes
        subs = [mirror.by_number[n] for n in item["subs"] if n in mirror.by_number]
        if not subs:  # unsubscribed meanwhile
            continue
        try:
            frames += result_frames(subs, array, item["name"], item["tags"], item["step"], item["time"],
                                    item["shape"], item["dtype"], header["rank"])
        except Exception as exc:  # noqa: BLE001 - one bad result must not lose the batch
            mirror.fail(f"publishing {item['name']!r}", exc)
    return frames


def serve(inbox: Connection, conn: Connection) -> None:
    """The child's loop: start the hub as told (``inbox``: from the parent, ``conn``: to
    it), then act on each message until EOF or stop."""
    from .hub import Hub

    write = threading.Lock()
    mirror = Mirror(conn, write)
    start = _recv(inbox)
    try:
        hub = Hub(mirror, start["config"], owner_pid=start["pid"])
    except Exception as exc:  # noqa: BLE001 - e.g. the port is in use: the parent reports it
        with write:
            _send(conn, {"op": "error", "error": f"{type(exc).__name__}: {exc}"})
        return
    mirror.hub = hub
    ring = tail = None
    if "ring" in start:
        fd, size, at = start["ring"]
        ring = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        tail = Tail(fd, at)
    with write:
        _send(conn, {"op": "ready", "url": hub.url, "ws": hub.ws_url, "page": hub.page_url, "token": hub.token})
    # The compressors' checks and host stage (numpy, no torch): imported now, not when the
    # first client subscribes.
    threading.Thread(target=__import__, args=("source_patch.runtime.trace.compress",), daemon=True).start()
    try:
        while True:  # blocks until the parent says something: nothing here runs on a timer
            message = _recv(inbox)
            op = message.get("op")
            if op == "results":
                blob = inbox.recv_bytes(MAX_MESSAGE) if message.get("blob") else b""
                frames = _frames_of(mirror, message, blob, ring)
                if "release" in message:
                    tail.release(message["release"])  # the slices are copied out: free again
                if frames:
                    hub.deliver(frames)
            elif op == "state":
                hub.loop.call_soon_threadsafe(mirror.refreshed, message["id"], message["state"], message["names"])
            elif op == "records":
                hub.post([tuple(record) for record in message["records"]])
            elif op == "report":
                sub = mirror.by_number.get(message["sub"])
                if sub is not None:
                    hub.report(sub, message["error"])
            elif op in ("drain", "stats"):
                ok = hub.drain(float(message["timeout"])) if op == "drain" else True
                with write:  # fresh statistics first: the asker reads them once answered
                    _send(conn, {"op": "stats", "stats": hub.stats(), "cpu": time.process_time()})
                    _send(conn, {"op": "answer", "id": message["id"], "ok": ok})
            elif op == "applied":
                hub.loop.call_soon_threadsafe(mirror.ack, message["seq"])
            elif op == "config":
                hub.config = message["config"]
            elif op == "stop":
                break
    except (EOFError, OSError):
        pass  # the traced process ended
    finally:
        hub.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    inbox, conn = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    try:
        serve(inbox, conn)
    finally:
        inbox.close()
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
