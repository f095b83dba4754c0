"""Python client of the trace hub, and a CLI that records a trace stream to a file.

    import source_patch.runtime.trace.client as client   # client.connect(...)

    async with client.connect("http://127.0.0.1:8765/#token=...") as c:
        await c.subscribe(["layer_output"], compressor={"kind": "tiles", "tiles": 32}, layers="0-3")
        async for frame in c:                     # frame.Frame: header, meta, array (numpy)
            print(frame.step, frame.name, frame.layer, frame.array.shape)

CLI (also ``source-patch trace ...``; an error is one line ``source-patch: error: ...``, exit 2)::

    python -m source_patch.runtime.trace.client record --url URL [--token T | --token-file F] \\
        --name layer_output [--layers 0-3] [--compressor tiles] [--param tiles=32] [--every 1] \\
        --out run.sptrace [--frames N | --seconds S] [--retry S]
    python -m source_patch.runtime.trace.client summary run.sptrace
    python -m source_patch.runtime.trace.client show run.sptrace [--name N] [--layer L] [--limit K]
    python -m source_patch.runtime.trace.client metrics --url URL [--token-file F] [--names GLOB ...] \
        [--seconds S | --records N] [--json]      # the sentinels' metric lines and events, live

Records (the sentinels' metric lines and events, JSON) are followed apart from frames::

    async with client.connect(url) as c:
        await c.follow()                          # the hub's backlog first, then live
        record = await c.next_record(timeout=5)   # Record(n, name, value)
        c.metrics()                               # {(kind, figure, layer): [(step, value), ...]} so far

A recording (``.sptrace``) is the 8 bytes ``SPTRACE1`` and then, per frame, its
length (u32, little-endian) and the frame exactly as received (frame.py):
:func:`read_recording` yields the decoded frames.  No pickle anywhere.  Needs
``websockets`` and numpy, not torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import struct
import sys
import time
from collections import deque
from pathlib import Path
from typing import AsyncIterator, Iterator, NamedTuple
from urllib.parse import urlsplit

from ..core import commands
from ..core.bounded import open_regular, read_regular
from .frame import Frame, FrameError, decode, split

RECORDING_MAGIC = b"SPTRACE1"
MAX_FRAME_BYTES = 1 << 28
_END = object()


class TraceError(Exception):
    """The hub answered a request with an error."""


def parse_target(target: str) -> tuple[str, str | None]:
    """(WebSocket URL, token from the URL fragment or None) for ``http://host:port/#token=T``,
    ``ws://host:port/ws`` or ``host:port``."""
    if "://" not in target:
        target = f"ws://{target}"
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname or not parts.port:
        raise ValueError(f"expected http://HOST:PORT/#token=..., ws://HOST:PORT/ws or HOST:PORT, got {target!r}")
    scheme = "wss" if parts.scheme in ("https", "wss") else "ws"
    token = None
    for item in parts.fragment.split("&"):
        key, _, value = item.partition("=")
        if key == "token" and value:
            token = value
    return f"{scheme}://{parts.netloc}/ws", token


class Record(NamedTuple):
    """A JSON record the traced process forwarded (protocol: ``{"op": "records"}``): its
    number ``n`` (from 1, per process: a gap is a record dropped), ``name``
    (``sentinels.metric`` or ``sentinels.event``) and ``value`` (the line as written to the
    sentinels' run folder: ``kind``, ``time``, ``rank``, ``step``, ...)."""

    n: int
    name: str
    value: dict


# Fields of a metric line that say where and when, not what was measured.
SERIES_KEYS = frozenset({"kind", "time", "rank", "step", "layer"})


def metric_series(records, history: int | None = 2000) -> dict:
    """The metric records as time series, as the browser view draws them:
    ``{(kind, figure, layer): [(step, value), ...]}`` (layer None where the line has none),
    one series per numeric field (booleans and lists left out), in record order, the last
    ``history`` points of each.  A line without a step is placed at its record number."""
    out: dict = {}
    for record in records:
        value = record.value
        if record.name != "sentinels.metric" or not isinstance(value, dict):
            continue
        step = value.get("step")
        x = step if isinstance(step, (int, float)) and not isinstance(step, bool) else record.n
        layer = value.get("layer")
        for figure, y in value.items():
            if figure in SERIES_KEYS or isinstance(y, bool) or not isinstance(y, (int, float)):
                continue
            points = out.setdefault((str(value.get("kind")), figure, layer), [])
            points.append((x, y))
            if history is not None and len(points) > history:
                del points[0]
    return out


def describe_record(record: Record) -> str:
    """One line for a record: ``step 12 mismatch k3_mean=0.01 ...`` for a metric line,
    ``EVENT step 12 nonfinite layer 2 mlp_output ...`` for an event."""
    value = record.value if isinstance(record.value, dict) else {"value": record.value}
    shown = []
    for key, item in value.items():
        if key in ("kind", "time", "rank", "step"):
            continue
        if isinstance(item, float):
            item = f"{item:.6g}"
        elif not isinstance(item, (int, str)) or isinstance(item, bool):
            item = json.dumps(item, separators=(",", ":"))
        shown.append(f"{key}={item}")
    head = "EVENT " if record.name == "sentinels.event" else ""
    return (f"{head}step {value.get('step', '-')} rank {value.get('rank', '-')} {value.get('kind', record.name)} "
            + " ".join(shown)).rstrip()


class Connection:
    """An authenticated connection: requests, and an async iterator of decoded frames.

    Frames wait in a bounded buffer (``buffer`` frames); when the caller falls
    behind, the oldest are dropped and counted in ``dropped`` (the hub drops too:
    gaps in ``frame.seq`` show both).  Errors the hub sends about a subscription
    after it was accepted (e.g. a projection vector of the wrong length) are kept
    in ``errors``."""

    def __init__(self, ws, welcome: dict, buffer: int = 4096):
        self.ws, self.welcome = ws, welcome
        self.errors: list[dict] = []
        self.dropped = 0
        self.close_code: int | None = None
        self.close_reason = ""
        self._frames: asyncio.Queue = asyncio.Queue(buffer)
        self._records: asyncio.Queue = asyncio.Queue(buffer)
        self.records_dropped = 0          # records this client dropped (not read in time)
        self.on_record = None             # called with each Record as it arrives (in the reader task)
        self._seen: deque = deque(maxlen=buffer)  # the records read (the last `buffer`): metrics()
        self._last = 0                    # the last record number received: follow()'s default since
        self._waiting: dict = {}
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def subscribe(self, names, *, compressor: dict | None = None, layers=None, every: int = 1,
                        id: str | None = None) -> dict:  # noqa: A002 - the protocol's word
        """Subscribe (or, with an id in use, change that subscription); the canonical
        subscription the hub accepted.  TraceError with the hub's message if refused."""
        sub_id = id or f"s{next(self._ids)}"
        request = {"op": "subscribe", "id": sub_id, "names": [names] if isinstance(names, str) else list(names),
                   "layers": layers, "compressor": compressor or {"kind": "tiles"}, "every": every}
        reply = await self._request(request, ("subscribed", sub_id), sub_id)
        return reply["subscription"]

    async def unsubscribe(self, sub_id: str) -> None:
        await self._request({"op": "unsubscribe", "id": sub_id}, ("unsubscribed", sub_id), sub_id)

    async def list(self) -> list[dict]:
        """The names the process has traced so far (name, layers, shape, dtype)."""
        return (await self._request({"op": "list"}, ("names", None), None))["names"]

    async def stats(self) -> dict:
        return await self._request({"op": "stats"}, ("stats", None), None)

    async def follow(self, names=None, *, since: int | None = None) -> dict:
        """Receive the records named so (fnmatch globs; all by default): first those the hub
        keeps numbered above ``since`` (default: the last this connection has, so 0 at first:
        the hub's whole backlog), then each as it comes.  The hub's reply
        (``{"op": "following", "names", "backlog", "last"}``)."""
        request = {"op": "follow", "since": self._last if since is None else since}
        if names is not None:
            request["names"] = [names] if isinstance(names, str) else list(names)
        return await self._request(request, ("following", None), None)

    async def unfollow(self) -> None:
        await self._request({"op": "unfollow"}, ("unfollowed", None), None)

    async def next_record(self, timeout: float | None = None) -> Record:
        """The next record; TimeoutError, or StopAsyncIteration once the connection ends."""
        item = await asyncio.wait_for(self._records.get(), timeout)
        if item is _END:
            self._records.put_nowait(_END)
            raise StopAsyncIteration
        return item

    def take_records(self) -> list[Record]:
        """The records waiting now (without waiting for more)."""
        out = []
        while not self._records.empty():
            item = self._records.get_nowait()
            if item is _END:
                self._records.put_nowait(_END)
                break
            out.append(item)
        return out

    def metrics(self, history: int | None = 2000) -> dict:
        """The metric records received so far as time series (:func:`metric_series`)."""
        return metric_series(self._seen, history)

    def events(self) -> list[dict]:
        """The event lines received so far (``sentinels.event``)."""
        return [r.value for r in self._seen if r.name == "sentinels.event"]

    async def send_raw(self, message) -> None:
        """Send any message as is (tests use it for malformed requests)."""
        await self.ws.send(message)

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        return decode(await self.next_raw())

    async def next_raw(self) -> bytes:
        """The next frame as received (bytes); StopAsyncIteration once the connection ends."""
        item = await self._frames.get()
        if item is _END:
            self._frames.put_nowait(_END)  # for the next caller too
            raise StopAsyncIteration
        return item

    async def next_frame(self, timeout: float | None = None) -> Frame:
        """The next frame; TimeoutError, or StopAsyncIteration once the connection ends."""
        return await asyncio.wait_for(self.__anext__(), timeout)

    # -- internals

    async def _request(self, message: dict, key: tuple, request_id) -> dict:
        async with self._lock:  # one request at a time: replies match requests
            future = asyncio.get_running_loop().create_future()
            self._waiting[key] = (future, request_id)
            try:
                await self.ws.send(json.dumps(message))
                return await future
            finally:
                self._waiting.pop(key, None)

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for message in self.ws:
                if isinstance(message, bytes):
                    try:
                        frames = [bytes(frame) for frame in split(message)]
                    except FrameError:
                        frames = [message]  # the caller's decode() says what is wrong
                    for frame in frames:
                        self._push(frame)
                else:
                    self._answer(json.loads(message))
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.close_reason = self.ws.close_reason or ""
            for future, _ in self._waiting.values():
                if not future.done():
                    future.set_exception(TraceError(f"connection closed ({self.close_code} {self.close_reason})"))
            self._push(_END)
            self._push_record(_END)

    def _push(self, item) -> None:
        while True:
            try:
                self._frames.put_nowait(item)
                return
            except asyncio.QueueFull:
                self._frames.get_nowait()
                self.dropped += 1

    def _push_record(self, item) -> None:
        while True:
            try:
                self._records.put_nowait(item)
                return
            except asyncio.QueueFull:
                self._records.get_nowait()
                self.records_dropped += 1

    def _on_records(self, records) -> None:
        for raw in records if isinstance(records, list) else ():
            if not isinstance(raw, dict):
                continue
            record = Record(raw.get("n", 0), raw.get("name", ""), raw.get("value"))
            if isinstance(record.n, int) and record.n > self._last:
                self._last = record.n
            self._seen.append(record)
            self._push_record(record)
            if self.on_record is not None:
                try:
                    self.on_record(record)
                except Exception as exc:  # noqa: BLE001 - the caller's callback: kept, the reading goes on
                    self.errors.append({"op": "error", "id": None, "error": f"on_record: {type(exc).__name__}: {exc}"})

    def _answer(self, reply: dict) -> None:
        op = reply.get("op")
        if op == "records":
            return self._on_records(reply.get("records"))
        if op == "error":
            for key, (future, request_id) in self._waiting.items():
                if request_id == reply.get("id") and not future.done():
                    future.set_exception(TraceError(reply.get("error")))
                    return
            self.errors.append(reply)
            return
        waiting = self._waiting.get((op, reply.get("id") if op in ("subscribed", "unsubscribed") else None))
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(reply)


@contextlib.asynccontextmanager
async def connect(target: str, token: str | None = None, *, client: str = "python", retry: float = 0.0,
                  max_size: int | None = MAX_FRAME_BYTES, buffer: int = 4096) -> AsyncIterator[Connection]:
    """Connect and authenticate.  ``target``: ``http://host:port/#token=T`` (the URL the
    process prints), ``ws://host:port/ws`` or ``host:port``.  ``retry``: keep trying to
    connect for that many seconds (a process whose hub is not up yet)."""
    from websockets.asyncio.client import connect as ws_connect

    uri, url_token = parse_target(target)
    token = token or url_token
    if not token:
        raise ValueError("no token: pass token=..., or a URL with #token=...")
    deadline = time.monotonic() + retry
    while True:
        try:
            ws = await ws_connect(uri, max_size=max_size, compression=None, open_timeout=10)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
    try:
        await ws.send(json.dumps({"op": "hello", "token": token, "client": client}))
        from websockets.exceptions import ConnectionClosed

        try:
            welcome = json.loads(await ws.recv())
        except ConnectionClosed as exc:
            raise TraceError(f"the hub closed the connection: {exc.rcvd.code if exc.rcvd else '?'} "
                             f"{exc.rcvd.reason if exc.rcvd else ''}".strip()) from None
        if welcome.get("op") != "welcome":
            raise TraceError(f"expected a welcome, got {welcome}")
        connection = Connection(ws, welcome, buffer)
        yield connection
    finally:
        await ws.close()


# ---------------------------------------------------------------- recordings


def write_frame(out, frame: bytes) -> None:
    out.write(struct.pack("<I", len(frame)))
    out.write(frame)


def read_recording(path: str | Path) -> Iterator[Frame]:
    """The frames of a recording, in order.  A torn last frame (a crash while
    recording) ends the iteration quietly.  Only a regular file is read (a FIFO is
    refused at once instead of hanging); ValueError for one that is no recording."""
    with open_regular(path, what="trace recording", error=ValueError) as f:
        if f.read(len(RECORDING_MAGIC)) != RECORDING_MAGIC:
            raise ValueError(f"{path}: not a trace recording (no {RECORDING_MAGIC!r} header)")
        while True:
            head = f.read(4)
            if len(head) < 4:
                return
            (length,) = struct.unpack("<I", head)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"{path}: a frame of {length:,} bytes at offset {f.tell() - 4:,} "
                                 f"(at most {MAX_FRAME_BYTES:,}): not a trace recording")
            data = f.read(length)
            if len(data) < length:
                return
            try:
                frame = decode(data)
            except FrameError as exc:
                raise ValueError(f"{path}: the frame at offset {f.tell() - length - 4:,}: {exc}") from None
            yield frame


async def record(target: str, token: str | None, out: str | Path, *, names, compressor: dict,
                 layers=None, every: int = 1, frames: int | None = None, seconds: float | None = None,
                 retry: float = 0.0, log=sys.stderr) -> int:
    """Subscribe and append every frame to ``out`` until ``frames`` frames, ``seconds``
    seconds, or the end of the stream; the number of frames written."""
    written = 0
    deadline = None if seconds is None else time.monotonic() + seconds
    async with connect(target, token, client="trace_client record", retry=retry) as c:
        accepted = await c.subscribe(names, compressor=compressor, layers=layers, every=every, id="record")
        print(f"recording {json.dumps(accepted)} from rank {c.welcome['rank']} to {out}", file=log, flush=True)
        with open(out, "wb") as f:
            f.write(RECORDING_MAGIC)
            while frames is None or written < frames:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    frame = await asyncio.wait_for(c.next_raw(), remaining)
                except (asyncio.TimeoutError, StopAsyncIteration):
                    break
                write_frame(f, frame)
                written += 1
            f.flush()
        for error in c.errors:
            print(f"hub error: {error.get('error')}", file=log)
    return written


def summary(frames) -> str:
    """A table: one row per (name, layer, kind)."""
    rows: dict = {}
    for frame in frames:
        key = (frame.name, frame.layer, frame.meta.get("kind"))
        row = rows.setdefault(key, {"frames": 0, "steps": set(), "shape": frame.array.shape,
                                    "source": frame.meta.get("source_shape")})
        row["frames"] += 1
        row["steps"].add(frame.step)
    head = ("name", "layer", "kind", "frames", "steps", "shape", "source shape")
    lines = [head]
    for (name, layer, kind), row in sorted(rows.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        steps = sorted(row["steps"])
        lines.append((str(name), "-" if layer is None else str(layer), str(kind), str(row["frames"]),
                      f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0]),
                      str(list(row["shape"])), str(row["source"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
    return f"{text}\n{sum(r['frames'] for r in rows.values())} frames, {len(rows)} series"


def _show_line(frame: Frame) -> str:
    a = frame.array
    values = f"min {a.min():.6g} mean {a.mean():.6g} max {a.max():.6g}" if a.size else "empty"
    return (f"seq {frame.seq} step {frame.step} {frame.name} layer {frame.layer} {frame.meta.get('kind')} "
            f"{list(a.shape)} {values}")


# ---------------------------------------------------------------- CLI


def _param(text: str):
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _token(args) -> tuple[str, str | None]:
    """(target, token) from --url / --token / --token-file (a hub's JSON file or a text file)."""
    target, token = args.url, args.token
    if args.token_file:
        try:  # the hub's file is a few hundred bytes; a FIFO or a folder is refused, not waited on
            text = read_regular(args.token_file, max_bytes=64 << 10, what="token file").decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(str(exc)) from None
        try:
            info = json.loads(text)
        except ValueError:
            info = None
        if isinstance(info, dict):
            token = token or info.get("token")
            target = target or info.get("url")
        else:
            token = token or text
    if not target:
        raise ValueError("give --url (or a --token-file written by the hub)")
    return target, token


def parser(prog: str = "python -m source_patch.runtime.trace.client"):
    p = commands.Parser(prog=prog, description="Record a live trace stream, and read recordings back.")
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="subscribe and write frames to a file")
    rec.add_argument("--url", help="http://HOST:PORT/#token=..., ws://HOST:PORT/ws or HOST:PORT")
    rec.add_argument("--token")
    rec.add_argument("--token-file", help="the hub's JSON file (sp-trace/*.json) or a file holding the token")
    rec.add_argument("--name", action="append", required=True, help="name pattern (repeatable)")
    rec.add_argument("--layers", help="'0-3,7' (default: all)")
    rec.add_argument("--compressor", default="tiles", help="tiles, histogram, topk, projection or raw")
    rec.add_argument("--param", action="append", type=_param, default=[],
                     help="compressor parameter KEY=VALUE (VALUE as JSON when it parses), repeatable")
    rec.add_argument("--every", type=int, default=1)
    rec.add_argument("--out", required=True)
    stop = rec.add_mutually_exclusive_group()
    stop.add_argument("--frames", type=int)
    stop.add_argument("--seconds", type=float)
    rec.add_argument("--retry", type=float, default=0.0, help="keep trying to connect this many seconds")
    for name in ("summary", "show"):
        reader = sub.add_parser(name, help="read a recording back" if name == "show" else "one row per series")
        reader.add_argument("file")
        if name == "show":
            reader.add_argument("--name")
            reader.add_argument("--layer", type=int)
            reader.add_argument("--limit", type=int, default=50)
    met = sub.add_parser("metrics", help="print the sentinels' metric lines and events as they come")
    met.add_argument("--url", help="http://HOST:PORT/#token=..., ws://HOST:PORT/ws or HOST:PORT")
    met.add_argument("--token")
    met.add_argument("--token-file", help="the hub's JSON file (sp-trace/*.json) or a file holding the token")
    met.add_argument("--names", action="append", help="record name pattern (repeatable; default: all)")
    met.add_argument("--records", type=int, help="stop after this many records")
    met.add_argument("--seconds", type=float, help="stop after this long")
    met.add_argument("--json", action="store_true", help="one JSON record a line: {n, name, value}")
    met.add_argument("--retry", type=float, default=0.0, help="keep trying to connect this many seconds")
    return p


def main(argv=None, prog: str = "python -m source_patch.runtime.trace.client") -> int:
    args = parser(prog).parse_args(argv)
    try:
        if args.command == "metrics":
            return _metrics(args)
        return _record(args) if args.command == "record" else _read_back(args)
    except (TraceError, ValueError, OSError) as exc:  # FrameError too: one line, not a traceback
        return commands.error(commands.first_line(exc))


def _record(args) -> int:
    target, token = _token(args)
    compressor = {"kind": args.compressor, **dict(args.param)}
    n = asyncio.run(record(target, token, args.out, names=args.name, compressor=compressor, layers=args.layers,
                           every=args.every, frames=args.frames, seconds=args.seconds, retry=args.retry))
    print(f"{n} frames written to {args.out}", file=sys.stderr)
    return 0


async def print_records(target: str, token: str | None, *, names=None, records: int | None = None,
                        seconds: float | None = None, as_json: bool = False, retry: float = 0.0,
                        out=None) -> int:
    """Follow the records and print each (``describe_record``, or JSON) until ``records``
    records, ``seconds`` seconds or the end of the stream; the number printed."""
    printed, out = 0, out or sys.stdout
    deadline = None if seconds is None else time.monotonic() + seconds
    async with connect(target, token, client="trace_client metrics", retry=retry) as c:
        await c.follow(names)
        while records is None or printed < records:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            try:
                record = await c.next_record(remaining)
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
            line = json.dumps(record._asdict(), separators=(",", ":")) if as_json else describe_record(record)
            print(line, file=out, flush=True)
            printed += 1
    return printed


def _metrics(args) -> int:
    target, token = _token(args)
    asyncio.run(print_records(target, token, names=args.names, records=args.records, seconds=args.seconds,
                              as_json=args.json, retry=args.retry))
    return 0


def _read_back(args) -> int:
    """``summary`` and ``show``."""
    frames = read_recording(args.file)
    if args.command == "summary":
        print(summary(frames))
        return 0
    shown = 0
    for frame in frames:
        if (args.name and frame.name != args.name) or (args.layer is not None and frame.layer != args.layer):
            continue
        print(_show_line(frame))
        shown += 1
        if shown >= args.limit:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
