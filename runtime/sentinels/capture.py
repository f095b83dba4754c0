"""The capture a mismatch trigger asks for, on both sides, and its verdict, with no one
in the loop (docs/mismatch.md#capturing-a-triggered-sample).

1. **Trainer.**  A trigger (mismatch.py, in the ``fwd_only`` pass) adds its request id to
   this step's capture, which is set as ``core/watch.py``'s ``capture``.  The dump's
   training-side call sites read it (the sentinels never import the dump): in the same
   step's ``fwd_bwd`` pass each micro-batch whose Rows (``source_patch.batch``) holds a
   captured id is written whole, every name and layer, with its row map, into
   ``<dir>/rank-<r>/capture-step<N>/trainer``; each record is charged against
   ``max_bytes`` first (``take``).  The Rows also give the samples' token ids
   (``input_ids`` passed to ``source_patch.batch``).
2. **Engine.**  At the step's end a background thread asks the first engine of
   ``engines`` that accepts (``POST <url>/dumper/prefill``, bearer ``token``) to prefill
   those samples' prompt+response with dumps on for them only, into
   ``capture-step<N>/engine``, and polls ``/dumper/get_state`` until it is done.  Where
   the trainer does not see the engine's files there (another host, no shared
   filesystem; or ``engine_files: fetch``, the engine dumping into its own folder), it
   copies them over HTTP (``/dumper/prefill_files``, ``/dumper/prefill_read``), each file
   checked against what was listed, the bytes against ``max_bytes``.
3. **Verdict.**  The same thread runs ``compare`` (runtime/verdict, never imported here:
   a child process) of the engine's dumps against the trainer's, which writes
   ``<dir>/rank-<r>/verdict-step<N>.json`` and ``.html``, and writes the event
   ``mismatch_verdict`` (first divergent layer, worst tokens).

Training never waits for 2 and 3: one daemon thread, at most ``QUEUE`` steps waiting
(a step over that is said, not captured).  :func:`drain` waits for them (tests, the
sentinels' ``flush``).  Nothing raises into training: failures are counted and said.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..core import ranks, watch
from ..core.failures import Counters
from . import events

QUEUE = 4                 # steps waiting for the worker at most
PREFILL_TIMEOUT_S = 300.0
VERDICT_TIMEOUT_S = 600.0
FLUSH_TIMEOUT_S = 60.0
MAX_REPLY_BYTES = 4 << 20
MAX_VERDICT_BYTES = 64 << 20
METADATA_BYTES = 16 << 20  # a fetched capture's manifests and model.json, beyond its records' bytes

_NAMES = ("captures", "empty", "records", "bytes", "engine_prefills", "engine_bytes", "engine_fetched", "verdicts",
          "dropped", "errors", "lost")
_counters = Counters(_NAMES, "source_patch.sentinels", "sentinels capture")
_config: dict = {"engines": None, "token": "", "rtol": 1e-4, "engine_files": "auto"}
_ENGINE_PATH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}/[A-Za-z0-9][A-Za-z0-9._-]{0,200}")  # <rank folder>/<file>
_step = None               # this step's _Step, None: nothing to capture
_jobs: queue.Queue = queue.Queue(maxsize=QUEUE)
_worker: threading.Thread | None = None
_busy = 0                  # jobs taken and not finished
_busy_lock = threading.Lock()


class _Step:
    """One step's capture, shared by the views the dump sees (one per set of ids)."""

    def __init__(self, step, folder: Path, take):
        self.step, self.folder, self.take_bytes = step, folder, take
        self.ids: list = []            # request ids, trigger order
        self.tokens: dict = {}         # request id -> prompt+response token ids (from the Rows)
        self.records = self.bytes = 0
        self.cut = False               # max_bytes ran out mid-capture
        self.flush = None              # the dump's flush(timeout), handed over at its first record
        self.engine_files = _config["engine_files"]  # as set when the step triggered, not when its job runs
        self.lock = threading.Lock()


class Capture:
    """What the dump reads from ``watch.capture`` (core/watch.py): a new one each time the
    ids change (the dump remembers its answer per capture object)."""

    phase = "fwd_bwd"

    def __init__(self, state: _Step):
        self._state = state
        self.request_ids = frozenset(state.ids)
        self.folder = str(state.folder / "trainer")
        self.step = state.step

    def take(self, nbytes: int) -> bool:
        s = self._state
        with s.lock:
            if s.cut:
                return False
            if not s.take_bytes(int(nbytes)):
                s.cut = True
                return False
            s.records += 1
            s.bytes += int(nbytes)
        _counters.add("records")
        _counters.add("bytes", int(nbytes))
        return True

    def writer(self, flush) -> None:
        self._state.flush = flush

    def seen(self, rows) -> None:
        """A micro-batch holding captured samples: their prompt+response token ids, where
        its Rows has ``input_ids`` and every position of a sample on this rank."""
        try:
            view = rows.view(False)
            ids = view["input_ids"]
            if ids is None:
                return
            requests, positions = view["row_request"].reshape(-1), view["positions"].reshape(-1)
            tokens = ids.reshape(-1)
            for i, rid in enumerate(rows.request_ids):
                if rid not in self.request_ids or rid in self._state.tokens:
                    continue
                mine = requests == i
                order = positions[mine].argsort()
                at = positions[mine][order].tolist()
                if at and at == list(range(len(at))):  # not so under CP: a part of the sample only
                    self._state.tokens[rid] = [int(t) for t in tokens[mine][order].tolist()]
        except Exception as exc:  # noqa: BLE001
            _counters.fail("capture.seen", exc)


# ---------------------------------------------------------------- mismatch.py's calls


def add(step, request_id, take, directory) -> None:
    """A triggered sample of ``step`` to capture; ``take(nbytes) -> bool`` charges the
    run's max_bytes; ``directory`` is the run folder."""
    global _step
    if _step is None or _step.step != step:
        folder = Path(directory).expanduser().resolve() / f"rank-{ranks.global_rank()}" / f"capture-step{step}"
        _step = _Step(step, folder, take)
        _counters.add("captures")
    if request_id not in _step.ids:
        _step.ids.append(request_id)
        watch.set_capture(Capture(_step))


def step_done(step) -> None:
    """The step is over: no more records; what was captured goes to the worker."""
    global _step
    state, _step = _step, None
    if watch.capture is not None:
        watch.set_capture(None)
    if state is None:
        return
    if not state.records:  # no dump call site saw them: no dump spec, or no Rows named for the fwd_bwd pass
        _counters.add("empty")
        return
    try:
        _jobs.put_nowait(state)
    except queue.Full:
        _counters.add("dropped")
        events.event("mismatch_verdict", step=state.step, where="not compared", request_ids=state.ids,
                     verdict=None, error=f"{QUEUE} earlier captures still wait for their verdict")
        return
    _start_worker()


def apply(config: dict) -> None:
    _config.update(engines=config.get("engines"), token=config.get("token") or "", rtol=float(config["rtol"]),
                   engine_files=config.get("engine_files") or "auto")


def clear() -> None:
    global _step
    _step = None
    if watch.capture is not None:
        watch.set_capture(None)
    _counters.reset()


def drain(timeout: float | None = None) -> bool:
    """Wait until every queued capture has its verdict (or ``timeout`` seconds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _busy_lock:
            idle = not _busy and _jobs.empty()
        if idle:
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def counters() -> dict:
    return {f"capture_{k}": v for k, v in _counters.snapshot().items()}


def last_error():
    return _counters.last_error


# ---------------------------------------------------------------- the worker


def _start_worker() -> None:
    global _worker
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_work, name="source-patch-sentinels-capture", daemon=True)
        _worker.start()


def _work() -> None:
    global _busy
    while True:
        state = _jobs.get()
        with _busy_lock:
            _busy += 1
        try:
            _verdict(state)
        except Exception as exc:  # noqa: BLE001 - said, and the next capture goes on
            _counters.fail("capture worker", exc)
            events.event("mismatch_verdict", step=state.step, where="failed", request_ids=state.ids, verdict=None,
                         error=f"{type(exc).__name__}: {exc}")
        finally:
            with _busy_lock:
                _busy -= 1


def _verdict(state: _Step) -> None:
    fields = {"request_ids": state.ids, "trainer": str(state.folder / "trainer"), "trainer_bytes": state.bytes,
              "trainer_records": state.records, "truncated": state.cut}
    if state.flush is not None:
        fields["trainer_flushed"] = bool(state.flush(timeout=FLUSH_TIMEOUT_S))
    engine = _engine_side(state, fields)
    if engine is None:
        events.event("mismatch_verdict", step=state.step, where="trainer side only", verdict=None, **fields)
        return
    rank_folder = state.folder.parent
    out, html = rank_folder / f"verdict-step{state.step}.json", rank_folder / f"verdict-step{state.step}.html"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}  # no spec in the child
    argv = [sys.executable, "-m", "source_patch.runtime.verdict.compare", str(engine), fields["trainer"],
            "--rtol", repr(_config["rtol"]), "--json-out", str(out), "--html", str(html)]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=VERDICT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        code, said = done.returncode, (done.stderr or "").strip().splitlines()
    except subprocess.TimeoutExpired:
        code, said = None, [f"compare ran past {VERDICT_TIMEOUT_S:g} s"]
    fields["compare_exit"] = code
    report = _read_report(out) if code in (0, 1) else None
    if report is None:
        fields["error"] = said[-1][:500] if said else f"compare exited {code}"
        events.event("mismatch_verdict", step=state.step, where="not compared", verdict=None, **fields)
        return
    _counters.add("verdicts")
    first = report.get("first_divergent")
    row = next((r for r in report.get("rows", []) if not r.get("ok")), None)
    worst = [{k: t.get(k) for k in ("request", "position", "token", "diff")}
             for t in (row or {}).get("worst") or [] if t.get("diff")][:5]
    where = "no divergence" if not first else f"{first[0]}" + ("" if first[1] is None else f" layer {first[1]}")
    events.event("mismatch_verdict", step=state.step, where=where,
                 first_divergent={"name": first[0], "layer": first[1]} if first else None,
                 rel_l2=(row or {}).get("rel_l2"), worst_tokens=worst,
                 logprobs=(report.get("logprobs") or {}).get("line"), tokens_paired=report.get("tokens_paired"),
                 verdict=str(out), html=str(html), **fields)


def _engine_side(state: _Step, fields: dict):
    """The engine's dumps of the samples (its run folder), or None (said in ``fields``)."""
    engines = _config["engines"] or []
    if not engines:
        fields["engine"] = "no engines set (the setting engines)"
        return None
    requests = [{"rid": str(rid), "input_ids": state.tokens[rid]} for rid in state.ids if rid in state.tokens]
    missing = [rid for rid in state.ids if rid not in state.tokens]
    if missing:
        fields["no_tokens"] = missing  # source_patch.batch got no input_ids, or a CP rank holds a part
    if not requests:
        fields["engine"] = "no token ids for these samples (pass input_ids to source_patch.batch)"
        return None
    left = state.take_bytes(0, left=True)
    if left < state.bytes:  # the engine's dump of the same tokens costs about what the trainer's did
        fields["engine"] = f"max_bytes: {left:,} bytes left, the trainer's capture took {state.bytes:,}"
        return None
    fetch = state.engine_files == "fetch"
    body = {"requests": requests, "exp_name": f"sp-capture-r{ranks.global_rank()}-step{state.step}-{time.time_ns()}"} \
        if fetch else {"requests": requests, "dir": str(state.folder), "exp_name": "engine"}
    errors = []
    for url in engines:
        try:
            status, reply = _request(url, "/dumper/prefill", body)
            if status != 200:
                errors.append(f"{url}: {status} {str(reply)[:300]}")
                continue
            prefill_id = _prefill_of(reply).get("id")
            final = _wait(url, prefill_id)
            _counters.add("engine_prefills")
            fields.update(engine=url, engine_status=final.get("status"), engine_bytes=final.get("bytes"),
                          cached_tokens=final.get("cached_tokens"), engine_error=final.get("error"))
            nbytes = int(final.get("bytes") or 0)
            state.take_bytes(nbytes, force=True)
            _counters.add("engine_bytes", nbytes)
            if final.get("status") != "done":
                return None
            into = state.folder / "engine"
            if fetch or not any(into.glob("*/manifest.jsonl")):  # not here: another host's disk
                # the records' bytes as the engine counted them, and room for manifests and model.json
                fields["engine_fetched"] = _fetch(url, prefill_id, into, nbytes + METADATA_BYTES)
            return into
        except (OSError, ValueError) as exc:
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
    fields["engine"] = "; ".join(errors)[:1000]
    return None


def _fetch(url: str, prefill_id, into: Path, limit: int) -> int:
    """Copy the engine's files of a finished prefill into ``into`` over HTTP; the bytes
    copied.  Paths are the engine's listing, checked (``<rank folder>/<file>``, no more),
    all of them ``limit`` bytes at most; each file is written under a temporary name,
    checked against its listed size, then renamed."""
    status, reply = _request(url, "/dumper/prefill_files", {"id": prefill_id})
    if status != 200:
        raise ValueError(f"prefill_files: {status} {str(reply)[:300]}")
    files = [f for entry in (reply if isinstance(reply, list) else [reply]) if isinstance(entry, dict)
             for f in entry.get("files") or []]
    for f in files:
        if not (isinstance(f, dict) and isinstance(f.get("path"), str) and _ENGINE_PATH.fullmatch(f["path"])
                and type(f.get("bytes")) is int and f["bytes"] >= 0):
            raise ValueError(f"prefill_files: an entry that is not a dump file {str(f)[:200]}")
    listed = sum(f["bytes"] for f in files)
    if listed > limit:
        raise ValueError(f"prefill_files: {listed:,} bytes listed, more than the {limit:,} expected")
    copied = 0
    for f in files:
        target = into / f["path"]
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.part")
        with open(partial, "wb") as out:
            while True:
                status, reply = _request(url, "/dumper/prefill_read", {"id": prefill_id, "path": f["path"],
                                                                        "offset": out.tell()})
                chunk = next((e for e in (reply if isinstance(reply, list) else [reply])
                              if isinstance(e, dict) and not e.get("skip") and "data" in e), None)
                if status != 200 or chunk is None:
                    raise ValueError(f"prefill_read {f['path']}: {status} {str(reply)[:300]}")
                out.write(base64.b64decode(chunk["data"], validate=True))
                if out.tell() > f["bytes"]:
                    raise ValueError(f"prefill_read {f['path']}: more than the {f['bytes']} bytes listed")
                if chunk.get("eof"):
                    break
        if partial.stat().st_size != f["bytes"]:
            raise ValueError(f"prefill_read {f['path']}: {partial.stat().st_size} bytes, {f['bytes']} listed")
        os.replace(partial, target)
        copied += f["bytes"]
    _counters.add("engine_fetched", copied)
    return copied


def _prefill_of(reply) -> dict:
    """The rank-0 entry's ``prefill`` of a /dumper/* reply (a list, one per rank)."""
    entries = reply if isinstance(reply, list) else [reply]
    for entry in entries:
        if isinstance(entry, dict) and entry.get("rank", 0) == 0 and isinstance(entry.get("prefill"), dict):
            return entry["prefill"]
    raise ValueError(f"no prefill in the reply {str(reply)[:200]}")


def _wait(url: str, prefill_id) -> dict:
    deadline = time.monotonic() + PREFILL_TIMEOUT_S
    while True:
        status, reply = _request(url, "/dumper/get_state", {})
        if status == 200:
            entries = [e.get("prefill") for e in (reply if isinstance(reply, list) else [reply]) if isinstance(e, dict)]
            mine = [p for p in entries if isinstance(p, dict) and p.get("id") == prefill_id]
            if mine and all(p.get("status") in ("done", "failed") for p in mine):
                first = dict(mine[0])
                first["bytes"] = sum(int(p.get("bytes") or 0) for p in mine)
                if any(p.get("status") == "failed" for p in mine):
                    first["status"] = "failed"
                    first["error"] = next((p.get("error") for p in mine if p.get("error")), first.get("error"))
                return first
        if time.monotonic() > deadline:
            raise ValueError(f"prefill {prefill_id} not done within {PREFILL_TIMEOUT_S:g} s")
        time.sleep(0.2)


def _request(url: str, path: str, body) -> tuple:
    headers = {"Content-Type": "application/json"}
    if _config["token"]:
        headers["Authorization"] = f"Bearer {_config['token']}"
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read(MAX_REPLY_BYTES) or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read(MAX_REPLY_BYTES) or b"null")
        except ValueError:
            return exc.code, exc.reason


def _read_report(path: Path):
    try:
        if path.stat().st_size > MAX_VERDICT_BYTES:
            return None
        report = json.loads(path.read_text())
        return report if isinstance(report, dict) else None
    except (OSError, ValueError):
        return None
