"""The dump runtime inside SGLang's scheduler processes (patches/dump.yaml).

Call sites::

    __sp__.dump_sglang_forward(self, input_ids, positions, forward_batch)   # model forward entry
    __sp__.dump_sglang_forward_end()                                      # after the logits
    __sp__.dump_sglang_replay(self, forward_batch)                        # decode graph replay
    if __sp__.dump_sglang_control(self, recv_req): return                 # Scheduler.handle_dumper_control

Each forward pass of the model is one dump ``step`` (counted per process), tagged
``phase=inference``, ``forward_mode`` (extend | decode | ...) and ``cuda_graph``: a
decode CUDA graph's replay runs no Python, so its start is recorded by
:func:`dump_sglang_replay` and its layers' tensors, staged in the graph at capture,
come from the drain after it (core/adapters/sglang_graphs.py), the real tokens' rows only.
Per pass it records ``input_ids``, ``positions`` and ``row_request`` (for every row,
the index of its request in the ``rids`` tag), so any dumped row maps back to a
(request, token position).  Once per process it writes ``model.json`` (class,
layer count, parameter names, shapes and dtypes, parallel ranks, whether CUDA graphs
are on) beside its manifest.

Control: SGLang's HTTP server mounts ``POST /dumper/{configure,get_state,reset}``
when ``DUMPER_SERVER_PORT=reuse`` and forwards each to every scheduler; the patched
handler answers from this runtime (the same validation as the loopback endpoint).
``POST /dumper/prefill`` re-runs given token ids as one teacher-forced prefill with
dumps on for those requests only (a mismatch capture, docs/dump_control.md): every rank
turns dumping on (``dir``, ``exp_name`` as asked) for passes that hold those request
ids, and where such a pass holds other requests too (live traffic batched with it) only
the asked requests' rows are written (``api.cut_rows``: the pass recorded as if it held
them alone, its ``row_request`` and ``rids`` theirs); rank 0 sends them through the
engine's own ``/flush_cache`` and ``/generate`` (``max_new_tokens: 0``) from a thread,
then ``/dumper/prefill_end`` puts every rank's dump back as it was.
``/dumper/get_state`` says how it went (``prefill``).  For a trainer on another host (no
shared filesystem), ``/dumper/prefill_files`` lists each rank's files of a finished
prefill and ``/dumper/prefill_read`` returns one of them in chunks (base64): the trainer
copies the engine's side into its own run folder.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import stat
import sys
import threading
import time

from pathlib import Path

import torch

from ..core import ranks
from ..core.adapters import graph_stage, sglang_graphs
from ..core.adapters.sglang_batch import DRAFT, BatchRows, batch_rows
from . import api, server

_forward_pass = 0
_summary_dirs: set = set()

# SGLang's dumper setting names that mean the same here (DUMPER_* / /dumper/configure).
SGLANG_NAMES = {"enable": "enable", "dir": "dir", "exp_name": "exp_name"}
UNSUPPORTED = {"filter": "a Python expression SGLang evaluates; use names/layers/steps/ranks/phases"}


def dump_sglang_forward(model, input_ids, positions, forward_batch, cuda_graph: bool = False) -> None:
    """Start of one forward pass: step, ambient tags, the row map, the model summary.
    ``cuda_graph``: a decode graph's replay is starting (:func:`dump_sglang_replay`)."""
    global _forward_pass
    if graph_stage.busy and graph_stage.building():
        return  # a decode graph's warm-up or capture: placeholders, not a forward (its replays are)
    step, _forward_pass = _forward_pass, _forward_pass + 1
    if not api.on:
        return
    try:
        api.dump_step(step=step)
        rows = batch_rows(forward_batch)  # a draft model's forward (speculative decoding) is tagged "draft"
        wanted = None
        if _only is not None:  # a prefill runs: only passes that hold its requests are dumped, only their rows
            holds = isinstance(rows, BatchRows) and any(str(r) in _only for r in rows.rids)
            api.pause(not holds)
            wanted = [i for i, r in enumerate(rows.rids) if str(r) in _only] if holds else None
        api.cut_rows(None)
        mode = rows.mode if isinstance(rows, BatchRows) else "draft" if rows is DRAFT else _mode_name(forward_batch)
        api.dump_context(forward_mode=mode, cuda_graph=cuda_graph)
        _write_summary(model)
        if isinstance(rows, BatchRows):
            kept = range(len(rows.rids)) if wanted is None else wanted
            lens = [rows.lens[i] for i in kept]
            index = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                            torch.tensor(lens, dtype=torch.int64))
            api.dump("row_request", index, rids=[str(rows.rids[i]) for i in kept], rows_per_request=lens)
            if wanted is not None and len(wanted) < len(rows.rids):
                api.cut_rows(_cut_of(rows.lens, wanted, input_ids.device))
        api.dump("input_ids", input_ids)
        api.dump("positions", positions)
    except Exception as exc:  # noqa: BLE001 - a dump must never break serving
        api.fail("dump_sglang_forward", exc)


def _cut_of(lens: list, wanted: list, device) -> tuple:
    """api.cut_rows' argument: the token rows and the request rows of ``wanted`` (their
    positions in the pass), in the pass's order, on the pass's device (made once a pass,
    not copied there for each record)."""
    starts = [0, *itertools.accumulate(lens[:-1])]
    token_index = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in wanted])
    return sum(lens), token_index.to(device), len(lens), torch.tensor(wanted, dtype=torch.int64, device=device)


def dump_sglang_graph_build(runner, key) -> None:
    """Before a decode graph's capture (``capture_one_shape``): with dumping on (this
    module's import has read the settings: SGLang captures before its first forward),
    the graph gets a stage (core/adapters/sglang_graphs.py)."""
    sglang_graphs.sglang_graph_build(runner, key)


def dump_sglang_replay(runner, forward_batch) -> None:
    """Before a decode graph's replay (``DecodeCudaGraphRunner.execute``): the forward's
    start as the model's own entry would record it, which a replay does not run; the
    layers' staged tensors follow from the drain (core/adapters/sglang_graphs.py)."""
    if api.on:
        dump_sglang_forward(runner.model_runner.model, forward_batch.input_ids, forward_batch.positions,
                            forward_batch, cuda_graph=True)


def dump_sglang_forward_end(logits_output=None):
    """End of one forward pass: its records are written now, not after the writer's
    linger (SGLang kills its schedulers at shutdown; a finished pass is not lost)."""
    if api.on:
        api.nudge()
    return logits_output


def _mode_name(forward_batch) -> str:
    name = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
    return str(name).lower()


def _write_summary(model) -> None:
    folder = api.rank_dir(ranks.global_rank())
    if folder in _summary_dirs:
        return
    _summary_dirs.add(folder)
    params = [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
              for n, p in model.named_parameters()]
    layers = getattr(getattr(model, "model", None), "layers", None)
    summary = {
        "model": type(model).__name__, "layers": len(layers) if layers is not None else None,
        "parameters": params, "ranks": {"rank": ranks.global_rank(), **ranks.parallel_tags()},
        "cuda_graph": _cuda_graph_enabled(), "pid": os.getpid(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".model.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, folder / "model.json")


def _cuda_graph_enabled() -> bool | None:
    """Whether this engine replays CUDA graphs (decode batches then dump nothing)."""
    context = sys.modules.get("sglang.srt.runtime_context")
    try:
        args = context.get_server_args()  # the operator's input, as SGLang 0.5.23 publishes it
        return bool(torch.cuda.is_available() and not args.disable_cuda_graph)
    except Exception:  # noqa: BLE001 - an SGLang without that accessor
        return None


# ---------------------------------------------------------------- /dumper/{method} on SGLang's server


def dump_sglang_control(scheduler, recv_req) -> bool:
    """Answer SGLang's DumperControlReqInput from this runtime; True when answered
    (the patched handler then returns)."""
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    try:
        response = [handle_control(recv_req.method, recv_req.body)]
        reply = DumperControlReqOutput(success=True, response=response)
    except (server.HTTPError, ValueError) as exc:
        reply = DumperControlReqOutput(success=False, response=[], error=f"rank {ranks.global_rank()}: {exc}")
    scheduler.ipc_channels.send_to_tokenizer.send_output(reply, recv_req)
    return True


def handle_control(method: str, body: dict) -> dict:
    """``configure`` (SGLang's names where they overlap, or this runtime's), ``get_state``
    (or ``state``), ``reset``: the reply of this process, tagged with its rank."""
    if method == "configure":
        changes = {}
        for key, value in (body or {}).items():
            if key in UNSUPPORTED:
                raise ValueError(f"{key!r} is not supported: {UNSUPPORTED[key]}")
            changes[SGLANG_NAMES.get(key, key)] = value
        reply = server.configure_changes(api.configure, changes)
    elif method in ("get_state", "state"):
        reply = api.state()
    elif method == "reset":
        reply = api.reset()
    elif method == "prefill":
        reply = prefill_start(body or {})
    elif method == "prefill_end":
        reply = prefill_end(body or {})
    elif method == "prefill_files":
        reply = prefill_files(body or {})
    elif method == "prefill_read":
        reply = prefill_read(body or {})
    else:
        raise ValueError(f"unknown method {method!r} (configure, get_state, reset, prefill, prefill_files, "
                         "prefill_read)")
    if method in ("get_state", "state"):
        reply = {**reply, "prefill": dict(_prefill)}
    return {"rank": ranks.global_rank(), **ranks.parallel_tags(), **reply}


# ---------------------------------------------------------------- /dumper/prefill: a capture's re-run

MAX_REQUESTS = 16          # requests at most in one prefill
MAX_TOKENS = 1 << 16       # token ids at most in one prefill, all requests together
MAX_RID_CHARS = 256
TIMEOUT_S = 300.0          # the generate request's own limit
PREFILL_KEYS = ("requests", "dir", "exp_name")
FILE_CHUNK = 2 << 20       # bytes of a file in one prefill_read reply (base64: ~2.7 MB of JSON)
MAX_DONE = 16              # finished prefills whose files can still be listed and read
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")  # what the dump writes; never a path

_only: frozenset | None = None   # the request ids of the running prefill (None: none runs)
_prefill: dict = {"status": "idle"}
_restore: dict = {}
_bytes_before = 0
_folder: Path | None = None      # this rank's folder of the running prefill's records
_done: dict = {}                 # prefill id -> this rank's folder of its records (the last MAX_DONE)
_lock = threading.Lock()


def prefill_start(body: dict) -> dict:
    """Check ``body`` (``requests``: ``[{"rid", "input_ids"}]``, optional ``dir`` and
    ``exp_name`` for the records), turn dumping on for those requests only, and on rank 0
    send them to the engine from a thread; the reply says the prefill started."""
    global _only, _prefill, _restore, _bytes_before, _folder
    unknown = sorted(k for k in body if k not in PREFILL_KEYS)
    if unknown:
        raise ValueError(f"prefill: unknown key(s) {', '.join(map(repr, unknown))} (valid: {', '.join(PREFILL_KEYS)})")
    requests = _requests(body.get("requests"))
    with _lock:
        if _only is not None:
            raise ValueError(f"prefill: {_prefill.get('id')} is still running (one at a time)")
        config = api.state()["config"]
        restore = {"enable": config["enable"], "dir": config["dir"], "exp_name": config["exp_name"]}
        changes = {"enable": True, **{k: body[k] for k in ("dir", "exp_name") if k in body}}
        server.configure_changes(api.configure, changes)  # validated as /dumper/configure is
        _restore, _only = restore, frozenset(r["rid"] for r in requests)
        state = api.state()
        _bytes_before = state["counters"]["bytes"]
        rank = ranks.global_rank()
        _folder = Path(state["exp_dir"]) / state["config"]["rank_dir"].replace("{rank}", str(rank))
        _prefill = {"id": f"prefill-{os.getpid()}-{time.time_ns()}", "status": "running",
                    "requests": [r["rid"] for r in requests], "tokens": sum(len(r["input_ids"]) for r in requests),
                    "exp_dir": state["exp_dir"], "started": time.time()}
        if ranks.global_rank() == 0:  # one rank sends the requests; every rank dumps its part
            threading.Thread(target=_run, args=(_prefill["id"], requests), name="source-patch-dump-prefill",
                             daemon=True).start()
        return {"ok": True, "prefill": dict(_prefill)}


def _requests(value) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError("prefill: 'requests' must be a non-empty list of {\"rid\": str, \"input_ids\": [int, ...]}")
    if len(value) > MAX_REQUESTS:
        raise ValueError(f"prefill: {len(value)} requests, at most {MAX_REQUESTS} at once")
    out, total, seen = [], 0, set()
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"rid", "input_ids"}:
            raise ValueError(f"prefill: requests[{i}] must be an object with exactly 'rid' and 'input_ids'")
        rid, ids = item["rid"], item["input_ids"]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not 0 < len(str(rid)) <= MAX_RID_CHARS:
            raise ValueError(f"prefill: requests[{i}].rid must be a str or int of 1-{MAX_RID_CHARS} characters")
        if str(rid) in seen:
            raise ValueError(f"prefill: request id {rid!r} given twice")
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < 1 << 31 for t in ids):
            raise ValueError(f"prefill: requests[{i}].input_ids must be a non-empty list of token ids (int >= 0)")
        total += len(ids)
        if total > MAX_TOKENS:
            raise ValueError(f"prefill: more than {MAX_TOKENS} token ids in all")
        seen.add(str(rid))
        out.append({"rid": str(rid), "input_ids": ids})
    return out


def _run(prefill_id: str, requests: list) -> None:
    """Rank 0's thread: the requests through the engine's own HTTP paths (the radix cache
    flushed first, so every position is computed and dumped), then every rank's end."""
    outcome = {"id": prefill_id, "status": "done"}
    url, headers = "", {"admin": {}, "generate": {}}
    try:
        url, headers = _own_server()
        _post(url + "/flush_cache", None, headers["admin"], 30.0)  # not done while other requests run: said below
        reply = _post(url + "/generate", {"input_ids": [r["input_ids"] for r in requests],
                                          "rid": [r["rid"] for r in requests],
                                          "sampling_params": {"max_new_tokens": 0}}, headers["generate"], TIMEOUT_S)
        replies = reply if isinstance(reply, list) else [reply]
        outcome["cached_tokens"] = sum(int((r.get("meta_info") or {}).get("cached_tokens") or 0) for r in replies)
    except Exception as exc:  # noqa: BLE001 - said in the state, never raised into serving
        outcome.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    try:
        _post(url + "/dumper/prefill_end", outcome, headers["admin"], 120.0)
    except Exception as exc:  # noqa: BLE001 - the server is gone or refused: end here at least
        api.fail("prefill_end", exc)
        try:
            prefill_end({**outcome, "status": "failed", "error": outcome.get("error") or f"prefill_end: {exc}"})
        except Exception as again:  # noqa: BLE001 - it had ended after all
            api.fail("prefill_end", again)


def prefill_end(body: dict) -> dict:
    """Every rank: the prefill's records on disk, the dump put back as it was."""
    global _only, _prefill
    with _lock:
        if _only is None or body.get("id") != _prefill.get("id"):
            raise ValueError(f"prefill_end: no prefill {body.get('id')!r} is running")
        written = api.flush(timeout=60)
        state = api.state()
        _only = None
        api.pause(False)
        api.cut_rows(None)
        api.configure(**_restore)
        status = body.get("status") if body.get("status") in ("done", "failed") else "failed"
        _prefill = {**_prefill, "status": status, "finished": time.time(), "flushed": bool(written),
                    "bytes": state["counters"]["bytes"] - _bytes_before,
                    **{k: body[k] for k in ("error", "cached_tokens") if k in body}}
        _done[_prefill["id"]] = _folder
        while len(_done) > MAX_DONE:
            del _done[next(iter(_done))]
        return {"ok": True, "prefill": dict(_prefill)}


def prefill_files(body: dict) -> dict:
    """This rank's files of a finished prefill (``id``): ``[{"path": "<rank folder>/<name>",
    "bytes"}]``, regular files only (never a link)."""
    folder = _finished_folder(body, ("id",))
    files = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:  # this rank dumped nothing for it
        entries = []
    for entry in entries:
        if _FILE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            files.append({"path": f"{folder.name}/{entry.name}", "bytes": entry.stat(follow_symlinks=False).st_size})
    return {"id": body["id"], "files": files}


def prefill_read(body: dict) -> dict:
    """``FILE_CHUNK`` bytes at most of one file of a finished prefill (``id``, ``path`` as
    prefill_files named it, ``offset``), base64 in ``data``; ``skip`` on the ranks whose
    folder it is not in."""
    folder = _finished_folder(body, ("id", "path", "offset"))
    path, offset = body.get("path"), body.get("offset", 0)
    if not isinstance(path, str) or path.count("/") != 1:
        raise ValueError("prefill_read: 'path' must be '<rank folder>/<file>' as prefill_files names it")
    owner, name = path.split("/")
    if owner != folder.name:
        return {"path": path, "skip": True}
    if not _FILE_NAME.fullmatch(name):
        raise ValueError(f"prefill_read: {name!r} is not a dump file's name")
    if type(offset) is not int or offset < 0:
        raise ValueError("prefill_read: 'offset' must be an int >= 0")
    fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"prefill_read: {path} is not a regular file")
        data = os.pread(fd, FILE_CHUNK, offset)
    finally:
        os.close(fd)
    return {"path": path, "offset": offset, "size": info.st_size, "eof": offset + len(data) >= info.st_size,
            "data": base64.b64encode(data).decode("ascii")}


def _finished_folder(body: dict, keys: tuple) -> Path:
    unknown = sorted(k for k in body if k not in keys)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} (valid: {', '.join(keys)})")
    with _lock:
        folder = _done.get(body.get("id")) if isinstance(body.get("id"), str) else None
    if folder is None:
        raise ValueError(f"no finished prefill {body.get('id')!r} here (the last {MAX_DONE} are kept)")
    return folder


def _own_server() -> tuple:
    """This engine's HTTP server (SGLang's published server arguments) and the key it
    wants (``--admin-api-key``, else ``--api-key``)."""
    args = sys.modules["sglang.srt.runtime_context"].get_server_args()
    host = str(args.host or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{host}]" if ":" in host else host
    keys = {"admin": getattr(args, "admin_api_key", None) or getattr(args, "api_key", None),
            "generate": getattr(args, "api_key", None)}
    headers = {use: {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
               for use, key in keys.items()}
    return f"http://{shown}:{args.port}", headers


def _post(url: str, body, headers: dict, timeout: float):
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")
