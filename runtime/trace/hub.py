"""The trace hub: a WebSocket server (``websockets``, asyncio) in a daemon thread.

One hub per tracing process, on ``host`` (127.0.0.1 by default) and ``port +
LOCAL_RANK``.  The protocol (v2) is in docs/trace_clients.md; in short:

* HTTP ``GET /``, ``/view.js``, ``/view.css``: the browser view (static files, no
  data, no token needed); every other path but ``/ws`` is 404.
* WebSocket ``/ws``: the first message must be ``{"op": "hello", "token": ...}``
  within 5 s, else close 4401.  Then JSON requests (``subscribe``, ``unsubscribe``,
  ``list``, ``stats``, ``follow``, ``unfollow``) get JSON replies; a bad one gets ``{"op": "error"}`` and the
  connection stays open; a message over ``max_message`` bytes closes it with 1009.
* Traced results arrive as binary frames (frame.py), several to a message
  when several are queued (``frame.split`` cuts them apart).  Each client has a
  bounded queue: a full one drops frames (the per-connection ``seq`` shows the gap)
  and a client whose queue stays full, or whose send blocks, for ``stall_timeout``
  is closed with 1008 "too slow".  Nothing here ever waits on the training thread.
* Records (the sentinels' metric lines and events, JSON) go to the clients that
  ``follow`` them as ``{"op": "records"}`` text messages, each client with a bounded
  queue; the hub keeps the last RECORD_BACKLOG for clients that follow later.

This module imports ``websockets`` only when a hub starts.

The hub's protocol (auth, subscriptions, per-client queues, static page) runs on
one event loop with state shared by all handlers, so it lives in one module.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hmac
import json
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit

from ..core import settings
from ..core.ranks import global_rank
from ..core.endpoint import local_rank, parse_json, write_private_json
from .frame import encode, join, set_seq

log = logging.getLogger("source_patch.trace")

PROTOCOL_VERSION = 2         # 2: a binary message carries one or more frames (frame.join)
HELLO_TIMEOUT_S = 2.0        # an unauthenticated socket gets this long to say hello
MAX_UNAUTHENTICATED = 64     # sockets still to say hello, capped apart from max_clients
MAX_HELLO = 4096             # characters of a hello besides its token; a longer one is refused unparsed
BACKLOG = 256                # accept queue: a burst of clients waits, it is not refused
MAX_SUBSCRIPTIONS = 32       # per client
MAX_NAMES = 64               # patterns per subscription
MAX_CONTROL = 256            # replies waiting for a client; more means it does not read: closed
MAX_INFLIGHT = 1024          # batches handed to the loop and not yet queued
MESSAGE_BYTES = 1 << 20      # frames queued for a client are sent together up to this size
RECORD_BACKLOG = 2000        # records the hub keeps, for a client that follows later (``since``)
RECORD_QUEUE = 4096          # records waiting for one client; more are dropped (its ``n`` shows the gap)
RECORD_MESSAGE = 1 << 18     # records queued for a client are sent together up to this size
VIEW = Path(__file__).parent / "view"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/view.js": ("view.js", "text/javascript; charset=utf-8"),
          "/view.css": ("view.css", "text/css; charset=utf-8")}


class Subscription:
    """One client's subscription: which (name, layer) it wants, compressed how, how often."""

    __slots__ = ("client", "id", "names", "layers", "compressor", "every", "next_step", "reported",
                 "number", "_names", "_layers")

    def __init__(self, client, id, names, layers, compressor, every):  # noqa: A002 - the protocol's word
        self.client, self.id, self.names, self.layers = client, id, names, layers
        self.compressor, self.every = compressor, every
        self.next_step: dict = {}   # (name, layer) -> first step due again (training thread)
        self.reported = False       # a compressor error was sent to the client
        self.number = None          # its name on the wire to the traced process (forwarder.py)
        self._names = re.compile("|".join(fnmatch.translate(p) for p in names)).match
        self._layers = settings.IntSet(layers) if layers is not None else None

    def matches(self, name: str, layer) -> bool:
        return bool(self._names(name)) and (self._layers is None or layer in self._layers)

    def canonical(self) -> dict:
        return {"id": self.id, "names": self.names, "layers": self.layers,
                "compressor": self.compressor.spec(), "every": self.every}


def parse_subscription(message: dict, client=None, raw_max_elements: int = 1 << 16) -> Subscription:
    """A Subscription from a ``subscribe`` request; ValueError/TypeError say what is wrong."""
    from . import compress as trace_compress

    unknown = sorted(set(message) - {"op", "id", "names", "layers", "compressor", "every"})
    if unknown:
        raise ValueError(f"subscribe: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         "(valid: id, names, layers, compressor, every)")
    sub_id = message.get("id")
    if not isinstance(sub_id, str) or not 0 < len(sub_id) <= 64:
        raise ValueError("subscribe: id must be a string of 1-64 characters (the same id again replaces "
                         "that subscription)")
    names = message.get("names")
    if isinstance(names, str):
        names = [names]
    if (not isinstance(names, list) or not 0 < len(names) <= MAX_NAMES
            or not all(isinstance(n, str) and 0 < len(n) <= 256 for n in names)):
        raise ValueError(f"subscribe: names must be a list of 1-{MAX_NAMES} name patterns "
                         "(fnmatch globs such as 'attention_*')")
    try:
        layers = settings.int_filter(message.get("layers"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"subscribe: layers: {exc} (or null for all)") from None
    every = message.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 1_000_000:
        raise ValueError(f"subscribe: every must be an integer >= 1 (steps between frames), got {every!r}")
    compressor = trace_compress.parse(message.get("compressor", {"kind": "tiles"}),
                                      raw_max_elements=raw_max_elements)
    return Subscription(client, sub_id, names, layers, compressor, every)


class Client:
    """One authenticated connection: its subscriptions and its send queues (loop thread)."""

    def __init__(self, hub: "Hub", ws, name: str):
        self.hub, self.ws, self.name = hub, ws, name
        self.subs: dict = {}
        self.frames: deque = deque()
        self.control: deque = deque()
        self.seq = 0
        self.sent = self.dropped = 0
        self.full_since: float | None = None
        self.send_started: float | None = None
        self.closed = False
        self.wakeup = asyncio.Event()
        self.follow = None            # the record names it follows (a match function), or None
        self.follow_names: list = []
        self.records: deque = deque()  # JSON texts of records waiting to be sent
        self.records_sent = self.records_dropped = 0

    def offer_records(self, records) -> None:
        """Queue the records (number, name, text) this client follows; when its queue is
        full they are dropped and counted (the records' ``n`` show the gap)."""
        match = self.follow
        if match is None or self.closed:
            return
        queued = False
        for _, name, text in records:
            if not match(name):
                continue
            if len(self.records) >= RECORD_QUEUE:
                self.records_dropped += 1
                self.hub.counts["records_dropped"] += 1
                continue
            self.records.append(text)
            queued = True
        if queued:
            self.wakeup.set()

    def offer(self, frame: bytearray) -> None:
        """Queue a frame with the next sequence number, or drop it when the queue is full."""
        seq, self.seq = self.seq, self.seq + 1
        if len(self.frames) >= self.hub.config["client_queue"]:
            self.dropped += 1
            self.hub.counts["dropped"] += 1
            if self.full_since is None:
                self.full_since = time.monotonic()
            return
        set_seq(frame, seq)
        self.frames.append(frame)
        self.wakeup.set()

    def say(self, message: dict) -> None:
        if self.closed:
            return
        if len(self.control) >= MAX_CONTROL:
            self.hub.drop(self, 1008, "too slow")
            return
        self.control.append(json.dumps(message, default=str))
        self.wakeup.set()

    async def send_loop(self) -> None:
        """The only task that sends on this connection: replies first, then the queued
        frames, several to a message (one send per batch, not per frame: the hub
        thread's CPU time is taken from the training thread's GIL)."""
        try:
            while not self.closed:
                await self.wakeup.wait()
                self.wakeup.clear()
                while (self.control or self.records or self.frames) and not self.closed:
                    if self.control:
                        frames, message = [], self.control.popleft()
                    elif self.records:
                        frames, message = [], self._take_records()
                    else:
                        frames = self._take_frames()
                        message = join(frames)
                    if len(self.frames) < self.hub.config["client_queue"]:
                        self.full_since = None
                    self.send_started = time.monotonic()
                    await self.ws.send(message)
                    self.send_started = None
                    self.sent += len(frames)
                    self.hub.counts["frames_sent"] += len(frames)
        except Exception:  # noqa: BLE001 - the connection is gone; the handler cleans up
            self.send_started = None

    def _take_records(self) -> str:
        """Queued records as one text message ``{"op": "records", "records": [...]}``, up to
        RECORD_MESSAGE characters, at least one record."""
        texts = [self.records.popleft()]
        size = len(texts[0])
        while self.records and size + len(self.records[0]) + 1 <= RECORD_MESSAGE:
            size += len(self.records[0]) + 1
            texts.append(self.records.popleft())
        self.records_sent += len(texts)
        self.hub.counts["records_sent"] += len(texts)
        return '{"op":"records","records":[' + ",".join(texts) + "]}"

    def _take_frames(self) -> list:
        """Queued frames for one message: up to MESSAGE_BYTES, at least one."""
        frames = [self.frames.popleft()]
        size = len(frames[0])
        while self.frames and size + len(self.frames[0]) + 8 <= MESSAGE_BYTES:  # + its padding
            size += len(self.frames[0]) + 8
            frames.append(self.frames.popleft())
        return frames

    def stalled(self, now: float, timeout: float) -> bool:
        return ((self.full_since is not None and now - self.full_since > timeout)
                or (self.send_started is not None and now - self.send_started > timeout))

    def info(self) -> dict:
        return {"client": self.name, "subscriptions": sorted(self.subs), "sent": self.sent,
                "dropped": self.dropped, "queued": len(self.frames), "follows": self.follow_names,
                "records_sent": self.records_sent, "records_dropped": self.records_dropped}


def result_frames(subs: list, array, name: str, tags: dict, step: int, stamp: float, shape: list,
                  dtype: str, rank: int) -> list:
    """[(subscription, frame)] of one traced result: the host stage of their (shared)
    compressor, then a frame per subscription.  ``tags``: already JSON values."""
    array = subs[0].compressor.finish(array, shape)
    frames = []
    for sub in subs:
        compressor = sub.compressor
        meta = {**tags, "sub": sub.id, "name": name, "layer": tags.get("layer"), "rank": rank,
                "kind": compressor.kind, "params": compressor.params, "source_shape": shape,
                "source_dtype": dtype}
        frames.append((sub, bytearray(encode(array, meta, step=step, time=stamp))))
    return frames


class Hub:
    """The server thread.  ``runtime`` is the trace state (api.py: set_subscriptions,
    current_step, names, snapshot, fail), or forwarder.Mirror when the hub runs in a
    process of its own for ``owner_pid``."""

    def __init__(self, runtime, config: dict, owner_pid: int | None = None):
        import websockets  # noqa: F401 - fail here, in the caller, when it is missing

        self.runtime, self.config = runtime, config
        self.owner_pid = owner_pid or os.getpid()
        self.token = config["token"] or secrets.token_urlsafe(32)
        self.host = config["host"]
        self.port = config["port"] + local_rank()
        self.clients: set = set()
        self.unauthenticated = 0
        self.counts = {"frames_sent": 0, "dropped": 0, "clients_dropped": 0, "rejected": 0,
                       "late": 0, "records_sent": 0, "records_dropped": 0}
        self.backlog: deque = deque(maxlen=RECORD_BACKLOG)  # (number, name, text): the latest records
        self._following = False  # told to the runtime: a client follows records
        self._inflight = 0
        self._lock = threading.Lock()
        self._server = None
        self._sockets: list = []
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="source-patch-trace-hub", daemon=True)
        self.thread.start()
        if not self._ready.wait(30) or self._error is not None:
            error = self._error or TimeoutError("the hub did not start within 30 s")
            self.stop()
            raise error
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/"
        self.ws_url = f"ws://{shown}:{self.port}/ws"
        self.page_url = f"{self.url}#token={self.token}"
        self.token_file = self._write_token_file() if not config["token"] else None
        if self.token_file is not None:
            where = f"URL with token in {self.token_file}"
        elif not config["token"]:
            where = f"open {self.page_url}"
        else:
            where = "token from the 'token' setting"
        forwarder = f", forwarder pid {os.getpid()}" if owner_pid else ""
        print(f"source-patch trace: hub {self.url} (rank {global_rank()}, pid {self.owner_pid}{forwarder}); "
              f"{where}", file=sys.stderr, flush=True)

    # -- thread and server

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()
            self.loop.close()
            return
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def _start(self) -> None:
        from websockets.asyncio.server import serve

        self._server = await serve(
            self._connection, self.host, self.port, process_request=self._http,
            max_size=self.config["max_message"], max_queue=16, compression=None,
            ping_interval=20, ping_timeout=20, close_timeout=2, server_header=None, backlog=BACKLOG,
            logger=logging.getLogger("source_patch.trace.websockets"))
        self._sockets = list(self._server.sockets)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        """Close every client (1001), then the server, then the loop."""
        if self.loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
            try:
                future.result(5)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if getattr(self, "token_file", None) is not None:
            try:
                os.unlink(self.token_file)
            except OSError:
                pass

    async def _shutdown(self) -> None:
        self._watchdog.cancel()
        for client in list(self.clients):
            await self._close(client, 1001, "going away")
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass

    def close_sockets(self) -> None:
        """In a forked child: release the inherited listening sockets, nothing else."""
        for sock in self._sockets:
            try:
                os.close(sock.fileno())
            except OSError:
                pass

    # -- from other threads

    def publish(self, items: list, rank: int) -> None:
        """(publisher thread) Frames of fetched results (publisher.Result), to the clients."""
        from ..core.tags import tag_value

        frames = []
        for item in items:
            try:
                tags = {k: tag_value(v) for k, v in item.tags.items()}
                frames += result_frames(item.subs, item.host.numpy(), item.name, tags, item.step, item.time,
                                        list(item.shape), str(item.dtype), rank)
            except Exception as exc:  # noqa: BLE001 - one bad result must not lose the batch
                self.runtime.fail(f"publishing {item.name!r}", exc)
        if frames:
            self.deliver(frames)

    def deliver(self, frames: list) -> None:
        """(publisher thread) Queue ``[(subscription, frame), ...]`` on the clients."""
        with self._lock:
            if self._inflight >= MAX_INFLIGHT:
                self.counts["late"] += len(frames)
                return
            self._inflight += 1
        self.loop.call_soon_threadsafe(self._deliver, frames)

    def post(self, records: list) -> None:
        """(publisher thread, or the forwarder's loop) Records ``[(number, name, JSON text)]``
        to the clients that follow them."""
        if not records:
            return
        with self._lock:
            if self._inflight >= MAX_INFLIGHT:
                self.counts["records_dropped"] += len(records)
                return
            self._inflight += 1
        self.loop.call_soon_threadsafe(self._post, records)

    def report(self, sub: Subscription, message: str) -> None:
        """(training thread) An error of one subscription, sent to its client."""
        self.loop.call_soon_threadsafe(sub.client.say, {"op": "error", "id": sub.id, "error": message})

    def drain(self, timeout: float) -> bool:
        """Wait until every client's queue is sent (or ``timeout``)."""
        if not self.loop.is_running():
            return True
        try:
            return asyncio.run_coroutine_threadsafe(self._drained(timeout), self.loop).result(timeout + 1)
        except Exception:  # noqa: BLE001
            return False

    def cpu_seconds(self) -> float:
        """CPU time of the hub's thread so far (what serving costs the process)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))
        except (OSError, AttributeError, TypeError):  # ended, or not on this platform
            return 0.0

    def stats(self) -> dict:
        return {**self.counts, "clients": len(self.clients), "url": self.url,
                "per_client": [c.info() for c in list(self.clients)]}

    # -- loop thread

    def _deliver(self, frames: list) -> None:
        with self._lock:
            self._inflight -= 1
        for sub, frame in frames:
            client = sub.client
            if not client.closed and client.subs.get(sub.id) is sub:  # not replaced meanwhile
                client.offer(frame)

    def _post(self, records: list) -> None:
        with self._lock:
            self._inflight -= 1
        self.backlog.extend(records)
        for client in self.clients:
            if client.follow is not None:
                client.offer_records(records)

    async def _drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                inflight = self._inflight
            if not inflight and not any((c.frames or c.control or c.records or c.send_started) for c in self.clients
                                        if not c.closed):
                return True
            await asyncio.sleep(0.01)
        return False

    async def _watch(self) -> None:
        """Close clients that stall: queue full, or one send blocked, for stall_timeout."""
        while True:
            timeout = self.config["stall_timeout"]
            await asyncio.sleep(min(0.25, max(timeout / 4, 0.01)))
            now = time.monotonic()
            for client in list(self.clients):
                if not client.closed and client.stalled(now, timeout):
                    self.drop(client, 1008, "too slow")

    def drop(self, client: Client, code: int, reason: str) -> None:
        if not client.closed:
            self.counts["clients_dropped"] += 1
            log.info("source-patch trace: closing client %r: %s", client.name, reason)
            asyncio.get_running_loop().create_task(self._close(client, code, reason))

    async def _close(self, client: Client, code: int, reason: str) -> None:
        """Close with ``code``; a peer that does not read cannot take the close frame,
        so after a second the connection is aborted."""
        self._forget(client)
        try:
            await asyncio.wait_for(client.ws.close(code, reason), 1.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            pass
        transport = getattr(client.ws, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.abort()

    def _forget(self, client: Client) -> None:
        if client.closed:
            return
        client.closed = True
        client.wakeup.set()
        self.clients.discard(client)
        self._subscriptions_changed()
        if client.follow is not None:
            self._following_changed()

    def _subscriptions_changed(self) -> None:
        self.runtime.set_subscriptions([s for c in self.clients for s in c.subs.values()])

    def _following_changed(self) -> None:
        """Tell the runtime whether any client follows records (it subscribes to them only
        then), when that changes."""
        following = any(c.follow is not None for c in self.clients if not c.closed)
        if following != self._following:
            self._following = following
            self.runtime.set_following(following)

    def _http(self, connection, request):
        """Static files of the browser view; None lets ``/ws`` go on to the WebSocket handshake."""
        from websockets.datastructures import Headers
        from websockets.http11 import Response

        path = urlsplit(request.path).path
        if path == "/ws":
            return None
        entry = STATIC.get(path)
        body = None
        if entry is not None:
            try:
                body = (VIEW / entry[0]).read_bytes()
            except OSError:
                body = None
        if body is None:
            return connection.respond(404, "not found\n")
        headers = Headers([("Content-Type", entry[1]), ("Content-Length", str(len(body))),
                           ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                           ("Referrer-Policy", "no-referrer")])
        return Response(200, "OK", headers, body)

    async def _connection(self, ws) -> None:
        """Authenticate first: only clients that said hello with the token count toward
        max_clients; sockets still to do so are capped and timed out on their own."""
        from websockets.exceptions import ConnectionClosed

        if self.unauthenticated >= MAX_UNAUTHENTICATED:
            self.counts["rejected"] += 1
            await ws.close(1013, "too many connections waiting to authenticate")
            return
        self.unauthenticated += 1
        try:
            client = await self._hello(ws)
        finally:
            self.unauthenticated -= 1
        if client is None:
            return
        sender = asyncio.get_running_loop().create_task(client.send_loop())
        try:
            async for message in ws:
                await self._on_message(client, message)
                if sender.done():
                    break
        except ConnectionClosed:
            pass
        except Exception as exc:  # noqa: BLE001 - a client's input never reaches the host's stderr
            log.debug("trace hub: closing client %s: %s: %s", client.name, type(exc).__name__, exc)
            await ws.close(1011, "internal error")
        finally:
            self._forget(client)
            sender.cancel()

    async def _hello(self, ws) -> Client | None:
        from websockets.exceptions import ConnectionClosed

        try:
            first = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S)
            hello = parse_json(first) if self._hello_sized(first) else None
        except (asyncio.TimeoutError, ValueError):  # also JSON nested too deep
            hello = None
        except ConnectionClosed:
            return None
        token = hello.get("token") if isinstance(hello, dict) and hello.get("op") == "hello" else None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            self.counts["rejected"] += 1
            await ws.close(4401, "unauthorized")
            return None
        if len(self.clients) >= self.config["max_clients"]:
            self.counts["rejected"] += 1
            await ws.close(1013, "too many clients")
            return None
        name = hello.get("client")
        client = Client(self, ws, name[:64] if isinstance(name, str) else "anonymous")
        self.clients.add(client)
        await self._refresh()
        runtime = self.runtime
        client.say({"op": "welcome", "version": PROTOCOL_VERSION, "rank": global_rank(),
                    "step": runtime.current_step(), "names": sorted({e["name"] for e in runtime.names()}),
                    "compressors": self._compressors()})
        return client

    def _hello_sized(self, first) -> bool:
        """A text message no longer than a hello can be (a token character escapes to
        at most 12): a longer one from an unauthenticated peer is refused unparsed, so
        it holds the loop for microseconds, not for a parse."""
        return isinstance(first, str) and len(first) <= MAX_HELLO + 12 * len(self.token)

    def _compressors(self) -> dict:
        from .compress import defaults

        return defaults(self.config["raw_max_elements"])

    async def _on_message(self, client: Client, message) -> None:
        if isinstance(message, bytes):
            client.say({"op": "error", "id": None, "error": "expected JSON text messages, got binary"})
            return
        try:
            request = parse_json(message)
        except ValueError as exc:
            client.say({"op": "error", "id": None, "error": f"malformed JSON: {exc}"})
            return
        if not isinstance(request, dict):
            client.say({"op": "error", "id": None, "error": "expected a JSON object with an 'op'"})
            return
        request_id = request.get("id") if isinstance(request.get("id"), (str, int)) else None
        op = request.get("op")
        try:
            if op == "subscribe":
                await self._subscribe(client, request)
            elif op == "unsubscribe":
                await self._unsubscribe(client, request)
            elif op == "list":
                await self._refresh()
                client.say({"op": "names", "names": self.runtime.names(), "step": self.runtime.current_step()})
            elif op == "stats":
                await self._refresh()
                client.say({"op": "stats", **self._stats(client)})
            elif op == "follow":
                await self._follow(client, request)
            elif op == "unfollow":
                client.follow, client.follow_names = None, []
                client.records.clear()
                self._following_changed()
                client.say({"op": "unfollowed"})
            elif op == "hello":
                raise ValueError("already authenticated")
            else:
                raise ValueError(f"unknown op {op!r} (valid: subscribe, unsubscribe, list, stats); records: follow, unfollow")
        except (ValueError, TypeError, KeyError) as exc:
            client.say({"op": "error", "id": request_id, "error": str(exc).strip('"')})

    async def _subscribe(self, client: Client, request: dict) -> None:
        # A projection reads its vector from disk: off the loop.
        sub = await asyncio.to_thread(parse_subscription, request, client, self.config["raw_max_elements"])
        if client.closed:
            return
        if sub.id not in client.subs and len(client.subs) >= MAX_SUBSCRIPTIONS:
            raise ValueError(f"subscribe: at most {MAX_SUBSCRIPTIONS} subscriptions per client")
        client.subs[sub.id] = sub
        self._subscriptions_changed()
        await self._applied()
        client.say({"op": "subscribed", "id": sub.id, "subscription": sub.canonical()})

    async def _applied(self) -> None:
        """A forwarder's runtime confirms that the traced process has the new set, so a
        reply means "from the next trace() call on", as it does in-process."""
        applied = getattr(self.runtime, "applied", None)
        if applied is not None:
            await applied()

    async def _refresh(self) -> None:
        """A forwarder's runtime asks the traced process for its state now (it sends
        none on its own), so a stats, list or welcome shows it as it is."""
        refresh = getattr(self.runtime, "refresh", None)
        if refresh is not None:
            await refresh()

    async def _follow(self, client: Client, request: dict) -> None:
        """``{"op": "follow", "names": [globs] (default all), "since": N (default 0)}``: the
        records named so, from now on, and first those of the backlog numbered above N."""
        unknown = sorted(set(request) - {"op", "id", "names", "since"})
        if unknown:
            raise ValueError(f"follow: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             "(valid: names, since)")
        names = request.get("names")
        if names is None:
            names = ["*"]
        elif isinstance(names, str):
            names = [names]
        if (not isinstance(names, list) or not 0 < len(names) <= MAX_NAMES
                or not all(isinstance(n, str) and 0 < len(n) <= 256 for n in names)):
            raise ValueError(f"follow: names must be a list of 1-{MAX_NAMES} record name patterns "
                             "(fnmatch globs such as 'sentinels.*')")
        since = request.get("since", 0)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"follow: since must be an integer >= 0 (the last record number you have), got {since!r}")
        # The backlog queued at once, and live records from now on (the loop runs nothing
        # in between): in order, none twice.
        client.follow = re.compile("|".join(fnmatch.translate(p) for p in names)).match
        client.follow_names = names
        client.records.clear()
        backlog = [r for r in self.backlog if r[0] > since]
        client.offer_records(backlog)
        self._following_changed()
        await self._applied()  # a forwarder's traced process follows: a record emitted from now on comes
        client.say({"op": "following", "names": names, "backlog": len(backlog),
                    "last": self.backlog[-1][0] if self.backlog else 0})

    async def _unsubscribe(self, client: Client, request: dict) -> None:
        sub_id = request.get("id")
        if sub_id not in client.subs:
            raise ValueError(f"unsubscribe: no subscription {sub_id!r} (yours: {', '.join(client.subs) or 'none'})")
        del client.subs[sub_id]
        self._subscriptions_changed()
        await self._applied()
        client.say({"op": "unsubscribed", "id": sub_id})

    def _stats(self, client: Client) -> dict:
        state = self.runtime.snapshot()
        return {"frames_sent": self.counts["frames_sent"], "dropped": self.counts["dropped"],
                "clients": len(self.clients), "clients_dropped": self.counts["clients_dropped"],
                "rejected": self.counts["rejected"], "step": state["step"], "rank": state["rank"],
                "results": state["results"], "runtime_dropped": state["dropped"] + self.counts["late"],
                "skipped": state["skipped"], "errors": state["errors"],
                "compress_errors": state["compress_errors"], "too_large": state["too_large"],
                "cost_seconds": state["cost_seconds"], "due_call_us": state.get("due_call_us"),
                "ring": state.get("ring"), "records": state.get("records", 0),
                "records_dropped": state.get("records_dropped", 0) + self.counts["records_dropped"],
                "records_sent": self.counts["records_sent"], "you": client.info()}

    # -- token file

    def _write_token_file(self) -> Path | None:
        folder = Path(self.config["dir"])
        rank = global_rank()
        path = folder / f"{socket.gethostname().split('.')[0]}-p{self.owner_pid}-rank{rank}.json"
        info = {"url": self.url, "ws": self.ws_url, "token": self.token, "page": self.page_url,
                "pid": self.owner_pid, "rank": rank, "local_rank": local_rank(), "started": time.time()}
        try:
            write_private_json(path, info)
            return path
        except OSError as exc:
            self.runtime.fail("writing the trace token file", exc)
            return None

