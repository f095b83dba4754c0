"""HTTP control endpoint of the dump runtime, and a small client CLI for it.

One endpoint per process, in a daemon thread (stdlib ``ThreadingHTTPServer``):

    GET  /state       counters, queue, step/phase, effective configuration
    POST /configure   JSON object of settings to change (validated as a whole)
    POST /reset       zero counters, last error and step

(``/dumper/get_state``, ``/dumper/configure``, ``/dumper/reset``: SGLang's paths,
accepted as aliases.)  Bound to ``host`` (127.0.0.1 by default) on ``port +
LOCAL_RANK`` (the next free port if that one is taken).  Every request needs
``Authorization: Bearer <token>``.  Each process writes its URL and token to
``<dir>/<exp_name>/control/<host>-p<pid>.json`` (mode 0600); the CLI reads those::

    python -m source_patch.runtime.dump.server DIR/EXP state
    python -m source_patch.runtime.dump.server DIR/EXP configure names='["attn_*"]' steps=10-12
    python -m source_patch.runtime.dump.server DIR/EXP reset

Errors are JSON bodies ``{"error": ..., "status": N}``: 400 bad JSON / unknown key
(with ``valid_keys``) / wrong value, 401 missing or wrong token, 404, 405, 408 request
not whole within ``REQUEST_TIMEOUT_S`` of its accept, 411, 413 body over
``max_request_bytes``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, NamedTuple
from urllib.parse import urlsplit

from ..core import settings
from ..core.endpoint import local_rank, parse_json, read_private_json, write_private_json

log = logging.getLogger("source_patch.dump")

# Settings that only the process itself may change (they decide who can talk to it).
NOT_OVER_HTTP = ("host", "port", "token")
PORT_TRIES = 64

_generated_token: str | None = None


def process_token() -> str:
    global _generated_token
    if _generated_token is None:
        _generated_token = secrets.token_urlsafe(32)
    return _generated_token


class _Server(ThreadingHTTPServer):
    """A thread per connection.  Until its request head (the request line and headers)
    has arrived a socket is *unauthenticated*: at most MAX_UNAUTHENTICATED are kept (one
    more drops the oldest that has not sent a whole head) and each is closed
    AUTH_TIMEOUT_S after its accept, so idle or trickling sockets neither pile up nor hold
    a worker (the trace hub caps them the same way).  The whole request, head and body,
    must arrive within REQUEST_TIMEOUT_S of its accept (408), however slowly it trickles:
    a per-read timeout let 16 token holders sending a byte every 4 s hold every worker.
    Requests with the token run at most WORKERS at once, taking a worker only once their
    body is in.  The accept loop never waits; connections not yet accepted wait in the
    kernel's backlog (256: Python's default of 5 overflowed under 200 clients)."""

    daemon_threads = True
    request_queue_size = 256
    WORKERS = 16
    MAX_UNAUTHENTICATED = 64
    AUTH_TIMEOUT_S = 2.0
    REQUEST_TIMEOUT_S = 5.0

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(self.WORKERS)
        self._lock = threading.Lock()
        self._waiting: dict = {}  # socket whose request head is still to come -> deadline
        self._deadlines: dict = {}  # socket -> when its whole request must be in
        self._admitted: set = set()
        super().__init__(*args, **kwargs)

    def server_close(self):
        # the accept loop and its timeouts are gone: hang up on sockets still sending a head
        with self._lock:
            for sock in self._waiting:
                _hang_up(sock)
            self._waiting.clear()
        super().server_close()

    def process_request(self, request, client_address):
        with self._lock:
            now = time.monotonic()
            self._waiting[request] = now + min(self.AUTH_TIMEOUT_S, self.REQUEST_TIMEOUT_S)
            self._deadlines[request] = now + self.REQUEST_TIMEOUT_S
            if len(self._waiting) > self.MAX_UNAUTHENTICATED:
                self._drop_oldest_stalled()
        super().process_request(request, client_address)

    def _drop_oldest_stalled(self) -> None:
        # skip sockets whose whole head waits in the kernel: a request whose thread has
        # not run yet (under a burst of real clients), not a stall
        for sock in self._waiting:
            if not _head_waiting(sock):
                del self._waiting[sock]
                _hang_up(sock)
                return

    def service_actions(self):
        """Every poll of the accept loop (0.2 s): close sockets past their deadline."""
        now = time.monotonic()
        with self._lock:
            for sock in [s for s, deadline in self._waiting.items() if deadline <= now]:
                del self._waiting[sock]
                _hang_up(sock)

    def head_read(self, sock) -> bool:
        """The request head of ``sock`` is in: no longer capped or timed out here (no
        more reads before the token is checked).  False if it was dropped meanwhile."""
        with self._lock:
            return self._waiting.pop(sock, None) is not None

    def deadline(self, sock) -> float:
        """When the request of ``sock`` must be in whole (time.monotonic())."""
        with self._lock:
            return self._deadlines.get(sock, 0.0)

    def admit(self, sock) -> None:
        """The request carried the token and is in whole: wait for a worker slot."""
        self._slots.acquire()
        with self._lock:
            self._admitted.add(sock)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._waiting.pop(request, None)
                self._deadlines.pop(request, None)
                admitted = request in self._admitted
                self._admitted.discard(request)
            if admitted:
                self._slots.release()

    # SO_REUSEADDR (the default) skips TIME_WAIT leftovers; on Linux it never lets two
    # processes listen on one port, so ranks still do not share one.


def _head_waiting(sock) -> bool:
    """True if a whole request head sits unread in ``sock``'s receive buffer (peeked
    through a duplicate: the socket's own timeout would make a peek wait)."""
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:
            return b"\r\n\r\n" in peek.recv(8192, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False


def _hang_up(sock) -> None:
    """Wake the thread blocked reading ``sock`` (it reads end of file and ends); that
    thread closes the socket."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Server6(_Server):
    address_family = socket.AF_INET6


class Actions(NamedTuple):
    """What the endpoint serves: dump's public control functions, handed over by api.py
    when it starts the endpoint (api.py imports this module, so this one cannot import it)."""

    state: Callable[[], dict]  # GET /state
    reset: Callable[[], dict]  # POST /reset
    configure: Callable[..., dict]  # POST /configure, with changes checked by configure_changes
    fail: Callable[[str, BaseException], None]  # count a failure, log the first of its kind


class ControlServer:
    def __init__(self, actions: Actions, config: dict):
        self.actions = actions
        self.token = config["token"] or process_token()
        self.max_request_bytes = config["max_request_bytes"]
        host = config["host"]
        base = config["port"] + local_rank()
        server_class = _Server6 if ":" in host else _Server
        last: OSError | None = None
        for port in range(base, min(base + PORT_TRIES, 65536)):
            try:
                self.httpd = server_class((host, port), _Handler)
                break
            except OSError as exc:
                last = exc
        else:
            raise OSError(f"no free port in {base}-{base + PORT_TRIES - 1} on {host}: {last}")
        self.httpd.control = self
        self.port = self.httpd.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="source-patch-dump-control", daemon=True)
        self.thread.start()
        self.control_file = self._write_control_file(config)
        generated = not config["token"]
        if self.control_file is not None:
            where = f"URL and token in {self.control_file}"
        elif generated:  # the file was the only other way to learn it
            where = f"token {self.token}"
        else:
            where = "token from the 'token' setting"
        print(f"source-patch dump: control endpoint {self.url} (pid {os.getpid()}); {where}",
              file=sys.stderr, flush=True)

    def _write_control_file(self, config: dict) -> Path | None:
        folder = Path(config["dir"]) / config["exp_name"] / "control"
        path = folder / f"{socket.gethostname().split('.')[0]}-p{os.getpid()}.json"
        info = {"url": self.url, "token": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
                "started": time.time()}
        try:
            write_private_json(path, info)
            return path
        except OSError as exc:
            self.actions.fail("writing the control file", exc)
            return None

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
        if self.control_file is not None:
            try:
                os.unlink(self.control_file)
            except OSError:
                pass

    def close_socket(self) -> None:
        """In a forked child: release the inherited listening socket, nothing else."""
        self.httpd.socket.close()


def start(actions: Actions, config: dict) -> ControlServer:
    return ControlServer(actions, config)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class _Handler(BaseHTTPRequestHandler):
    server_version = "source-patch-dump/1"
    protocol_version = "HTTP/1.0"  # one request per connection: no leftover body to misread
    timeout = 5  # a read's own limit; the body's reads are bounded by the request's deadline

    ROUTES = {
        "/state": ("GET", "state"), "/dumper/get_state": ("GET", "state"),
        "/configure": ("POST", "configure"), "/dumper/configure": ("POST", "configure"),
        "/reset": ("POST", "reset"), "/dumper/reset": ("POST", "reset"),
    }

    def parse_request(self) -> bool:
        # the head is in; one dropped (capped or late) meanwhile has a shut socket
        return super().parse_request() and self.server.head_read(self.request)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("control %s - %s", self.address_string(), format % args)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_PATCH(self):
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        control: ControlServer = self.server.control
        try:
            path = urlsplit(self.path).path.rstrip("/") or "/"
            route = self.ROUTES.get(path)
            if route is None:
                raise HTTPError(404, f"no endpoint {path}", endpoints=["GET /state", "POST /configure",
                                                                      "POST /reset"])
            self._authorize(control.token)
            wanted, action = route
            if method != wanted:
                raise HTTPError(405, f"{path} takes {wanted}, not {method}")
            body = self._body(control.max_request_bytes) if method == "POST" else b""
            self.server.admit(self.request)  # only now: a slow body never holds a worker
            actions = control.actions
            if action == "state":
                result = actions.state()
            elif action == "reset":
                result = {"ok": True, "state": actions.reset()}
            else:
                result = _configure(actions.configure, body)
            self._send(200, result)
        except HTTPError as exc:
            self._send(exc.status, {"error": exc.message, "status": exc.status, **exc.extra},
                       {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None)
        except Exception as exc:  # noqa: BLE001 - answer, and keep serving
            actions = getattr(control, "actions", None)
            if actions is not None:
                actions.fail("control request", exc)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}", "status": 500})

    def _authorize(self, token: str) -> None:
        header = self.headers.get("Authorization")
        if not header:
            raise HTTPError(401, "missing token: send 'Authorization: Bearer <token>' "
                                 "(the token is in <dir>/<exp_name>/control/*.json)")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPError(401, "invalid token")

    def _body(self, limit: int) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send the body with a Content-Length (no chunked encoding)")
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            raise HTTPError(400, f"bad Content-Length {raw!r}") from None
        if length > limit:
            raise HTTPError(413, f"request body of {length} bytes is over max_request_bytes ({limit})",
                            max_request_bytes=limit)
        return self._read_by(length, self.server.deadline(self.request))

    def _read_by(self, length: int, deadline: float) -> bytes:
        """``length`` body bytes, all in by ``deadline``: each read waits only for the
        time left, so trickling a byte per read cannot stretch the request."""
        chunks, left = [], length
        while left:
            chunk = self._read1_by(deadline, min(left, 1 << 16))
            if chunk is None:
                raise HTTPError(408, f"request not complete within {self.server.REQUEST_TIMEOUT_S:g} s of "
                                     f"its connection ({length - left} of {length} body bytes in)")
            if not chunk:
                raise HTTPError(400, f"the body ended after {length - left} of {length} bytes")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _read1_by(self, deadline: float, most: int) -> bytes | None:
        """What one read brings by ``deadline`` (b"" at the end of the stream), None if nothing."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        self.connection.settimeout(remaining)
        try:
            return self.rfile.read1(most)
        except TimeoutError:
            return None
        except OSError:  # the client reset the connection: its body ended
            return b""
        finally:
            self.connection.settimeout(self.timeout)  # the answer's writes: the handler's own limit

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = (json.dumps(payload, indent=1, default=str) + "\n").encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client went away


def _configure(configure, body: bytes) -> dict:
    if not body.strip():
        raise HTTPError(400, "empty body: send a JSON object of settings, e.g. {\"enable\": true}")
    try:
        changes = parse_json(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HTTPError(400, f"malformed JSON: {exc}") from None
    return configure_changes(configure, changes)


def configure_changes(configure: Callable[..., dict], changes) -> dict:
    """Validate ``changes`` (a JSON object of dump settings) as a whole, then apply them
    with ``configure`` (api.configure); HTTPError(400) says what is wrong.  Also SGLang's
    ``/dumper/configure`` (dump/sglang.py)."""
    if not isinstance(changes, dict):
        raise HTTPError(400, f"expected a JSON object of settings, got {type(changes).__name__}")
    schema = settings.SCHEMAS["dump"]
    valid = sorted(k for k in schema if k not in NOT_OVER_HTTP)
    unknown = sorted(k for k in changes if k not in schema)
    if unknown:
        raise HTTPError(400, f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                        valid_keys=valid)
    fixed = sorted(k for k in changes if k in NOT_OVER_HTTP)
    if fixed:
        raise HTTPError(400, f"{', '.join(fixed)} cannot be changed over HTTP (set them in the process)",
                        valid_keys=valid)
    for key, value in changes.items():
        try:
            settings.check("dump", key, value)
        except (ValueError, TypeError) as exc:
            raise HTTPError(400, f"{key}: {exc}", key=key) from None
    config = configure(**changes)
    return {"ok": True, "changed": sorted(changes), "config": config}


# ---------------------------------------------------------------- client CLI


def endpoints(folder: str | os.PathLike, refused: list | None = None) -> list[dict]:
    """The control files under an experiment directory (or a dump root holding several),
    each read as its process wrote it, privately (``endpoint.read_private_json``: a
    planted, foreign, linked or FIFO file is not read); those passed over are one line
    each in ``refused``."""
    root = Path(folder)
    files = sorted(root.glob("control/*.json")) or sorted(root.glob("*/control/*.json"))
    refused = [] if refused is None else refused
    out = []
    for path in files:
        info = read_private_json(path.parent, path.name, refused)
        if info is not None:
            out.append({**info, "file": str(path)})
    return out


def request(info: dict, method: str, path: str, body: dict | None = None, timeout: float = 10) -> tuple:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(info["url"] + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {info['token']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.dump.server",
                                     description="Talk to every dumping process of an experiment.")
    parser.add_argument("dir", help="the experiment directory <dir>/<exp_name> (or the dump root)")
    parser.add_argument("action", choices=["state", "configure", "reset"])
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="for configure: values are JSON where they parse as JSON, else strings")
    args = parser.parse_args(argv)
    refused: list = []
    found = endpoints(args.dir, refused)
    for line in refused:
        print(f"not read: {line}", file=sys.stderr)
    if not found:
        print(f"no control files under {args.dir} (is port set?)", file=sys.stderr)
        return 1
    body = None
    if args.action == "configure":
        body = {}
        for item in args.settings:
            key, eq, value = item.partition("=")
            if not eq:
                parser.error(f"expected KEY=VALUE, got {item!r}")
            body[key] = _value(value)
    method, path = {"state": ("GET", "/state"), "configure": ("POST", "/configure"),
                    "reset": ("POST", "/reset")}[args.action]
    failed = 0
    for info in found:
        try:
            status, payload = request(info, method, path, body)
        except OSError as exc:
            status, payload = None, {"error": f"unreachable: {exc}"}
        failed += status != 200
        print(json.dumps({"endpoint": info["url"], "pid": info.get("pid"), "status": status,
                          "response": payload}, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
