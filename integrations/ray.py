"""source-patch in Ray actors (optional dependency: ``pip install source-patch[ray]``).

Ray starts trainer ranks and rollout engines as actors in worker processes that get
the environment of their node's raylet, not the driver's: ``SOURCE_PATCH`` and the
runtime's settings reach them reliably only through a ``runtime_env`` (the actor's or
the job's).  The start hook then patches in the worker as in any process (and in every
process the worker starts).  docs/integrations.md has the details and the recipes for
verl, slime, miles and NeMo-RL.

Driver::

    from source_patch.integrations import ray as sp_ray

    env = sp_ray.runtime_env(["megatron_cpu", "routing", "dump"],
                             settings={"dump": {"enable": True, "dir": "/shared/dumps"}})
    trainer = Trainer.options(runtime_env=env).remote()    # class Trainer(sp_ray.SourcePatchActor)
    sp_ray.status([trainer])            # SOURCE_PATCH and the patched modules, per actor
    sp_ray.endpoints([trainer])         # dump folders, dump control and trace hub URLs, per actor
    bodies = sp_ray.weight_sync_rendezvous(trainer, engine_tp_sizes=[2])  # rank 0, once placed
    records = sp_ray.collect_routes(engines, into="routes", rids=[...])  # {rid: RoutingRecord}

Actor classes inherit :class:`SourcePatchActor`; its ``source_patch_*`` methods run the
``local_*`` functions of this module in the actor (a framework's own worker class
can call those from its methods instead).

What crosses Ray: the runtime_env holds environment variable strings only (validated
here, read by the runtime as it reads any environment); actors answer with plain
dicts of strings and numbers, and routing files as bytes that the routing reader
validates like any file; an answer of another shape is an :class:`ActorAnswerError`
naming the actor.  Endpoint tokens never leave their node: the driver sees URLs, and
asks an actor to make a request for it (:func:`dump_request`), only to a loopback URL
read from a private control file.  Ray's own ports, authentication and dashboard are
Ray's (docs/integrations.md).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

SOURCE_PATCH = "SOURCE_PATCH"
ROUTING_SGLANG_DIR = "SOURCE_PATCH_ROUTING_SGLANG_DIR"
MAX_ROUTE_BYTES = 1 << 30  # routing files one actor hands over in one call
PATH_KEYS = {"dir"}        # settings that name a folder: made absolute (workers start elsewhere)
ROUTES_MARK = ".source-patch-routes"  # in a folder merge_route_files made: its actor-<i> folders are its own
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}\Z")  # a file or folder name, never . or ..
_ACTOR = re.compile(r"actor-\d+\Z")
# The URLs a token is sent to: this node's loopback (a wildcard bind is reached there too),
# never what a file says elsewhere (another host, a file:// URL read into the reply).
_LOCAL_URL = re.compile(r"http://(127\.0\.0\.1|localhost|\[::1\]|0\.0\.0\.0|\[::\]):(\d{1,5})/?\Z")
_WILDCARD = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}
_REQUEST_PATH = re.compile(r"/[A-Za-z0-9_./-]{0,200}\Z")  # the endpoint's paths: no query, no @host


class ActorAnswerError(ValueError):
    """An actor answered something its ``source_patch_*`` method never returns (says which actor)."""


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("source_patch.integrations.ray needs Ray: pip install 'source-patch[ray]'") from None
    return ray


# ------------------------------------------------------------------ runtime_env (driver)


def runtime_env(specs=(), settings: dict | None = None, env: dict | None = None, base: dict | None = None) -> dict:
    """A Ray ``runtime_env`` whose ``env_vars`` activate ``specs`` and set ``settings``
    in the actor's worker process (and every process it starts).

    ``specs``: bundled names (kept as names: each node has its own copy) or spec files
    (made absolute: the same path must exist on every node); each is loaded here first,
    so a typo fails in the driver.  ``settings``: ``{component: {key: value}}`` of the
    runtime's schemas (``source-patch settings``), validated and written as
    ``SOURCE_PATCH_<COMPONENT>_<KEY>``; a relative ``dir`` is made absolute.  ``env``:
    more variables, strings only.  ``base``: a runtime_env to extend (its other fields
    are kept, its ``env_vars`` are merged under these)."""
    env_vars = {}
    if specs:
        env_vars[SOURCE_PATCH] = ",".join(_spec_reference(s) for s in specs)
    for component, values in (settings or {}).items():
        for key, value in values.items():
            name, text = setting_variable(component, key, value)
            env_vars[name] = text
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"runtime_env env: {name!r}={value!r}: names and values must be strings")
        if name == SOURCE_PATCH or name in env_vars:  # would replace what was validated above
            raise ValueError(f"runtime_env env: {name} is set from "
                             f"{'specs' if name == SOURCE_PATCH else 'settings'} (validated): pass it there")
        if not name or "=" in name or "\0" in name + value:
            raise ValueError(f"runtime_env env: {name!r}: not an environment variable name and value")
        env_vars[name] = value
    out = dict(base or {})
    out["env_vars"] = {**out.get("env_vars", {}), **env_vars}
    return out


def _spec_reference(ref) -> str:
    from source_patch.patcher import load_spec

    text = os.fspath(ref)
    spec = load_spec(text)  # SpecError here, in the driver, not in every worker
    bundled = os.sep not in text and not text.endswith((".yaml", ".yml")) and not os.path.exists(text)
    reference = text if bundled else spec.file
    # The worker splits SOURCE_PATCH at both and strips each part: such a path would
    # reach it as other paths (patcher/boot.split_refs).
    if "," in reference or os.pathsep in reference or reference != reference.strip():
        raise ValueError(f"spec {text!r}: its path {reference!r} holds ',' or {os.pathsep!r} or surrounding "
                         f"spaces, which SOURCE_PATCH cannot carry: rename or move the file")
    return reference


def setting_variable(component: str, key: str, value) -> tuple[str, str]:
    """``(SOURCE_PATCH_<COMPONENT>_<KEY>, text)`` for one setting.  The text parses back
    to the same value (checked), so what the worker reads is what was meant."""
    from source_patch.runtime.core import settings

    if component not in settings.SCHEMAS:
        raise KeyError(f"unknown runtime component {component!r} (valid: {', '.join(sorted(settings.SCHEMAS))})")
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if key in PATH_KEYS and isinstance(value, str) and value.strip():
        value = os.path.abspath(os.path.expanduser(value.strip()))
    meant = settings.check(component, key, value)
    text = _as_text(meant)
    name = f"SOURCE_PATCH_{component.upper()}_{key.upper()}"
    if settings.check(component, key, text) != meant:
        raise ValueError(f"{name}: {value!r} has no environment form that reads back the same")
    return name, text


def _as_text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


# ------------------------------------------------------------------ in the actor


def node_address() -> str:
    """This process's node address as Ray knows it (what other nodes reach)."""
    return _ray().util.get_node_ip_address()


def local_status() -> dict:
    """This process: its node, pid, SOURCE_PATCH, the active specs and every module
    the patcher has patched here so far (``{module: ["spec:patch", ...]}``)."""
    patched = {}
    for name, module in list(sys.modules.items()):
        applied = getattr(module, "__dict__", {}).get("__source_patches__")  # set by the patcher's loader
        if applied:
            patched[name] = sorted({f"{a.spec}:{a.patch}" for a in applied})
    return {"node": node_address(), "pid": os.getpid(), "source_patch": os.environ.get(SOURCE_PATCH),
            "specs": _active_specs(), "patched": dict(sorted(patched.items()))}


def _active_specs() -> list:
    if not os.environ.get(SOURCE_PATCH):
        return []
    from source_patch.patcher.activation import installed_finder  # hands the start-up fast path over

    finder = installed_finder()  # None: the start hook did not run in this interpreter
    return [s.name for s in finder.specs] if finder else []


def local_endpoints() -> dict:
    """Where this process and its children dump, their dump control endpoints and
    trace hubs (URL, pid, rank; tokens stay in their 0600 files on this node), and
    ``refused``: the files not read (one line each: a foreign folder, a link, a FIFO)."""
    from source_patch.runtime.core import settings

    dump, trace, refused = settings.resolve("dump"), settings.resolve("trace"), []
    return {"node": node_address(), "pid": os.getpid(),
            "dump_dir": _exp_dir(dump) if dump["enable"] else None,
            "dump_control": [_public(info) for info in _controls(dump, refused)],
            "trace": [_public(info) for info in _family_files(Path(trace["dir"]).expanduser(), refused)],
            "routes": os.environ.get(ROUTING_SGLANG_DIR) or settings.resolve("routing")["dir"] or None,
            "refused": refused}


def local_dump_request(method: str, path: str, body: dict | None = None) -> list:
    """One request to each dump control endpoint of this process and its children,
    made here with their tokens: ``[{"url", "pid", "status", "reply"}]``.  Only to a
    loopback URL (an endpoint bound elsewhere is listed with an error, not asked)."""
    import http.client

    from source_patch.runtime.core import settings
    from source_patch.runtime.dump import server

    method = _check_request(method, path, body)
    out = []
    for info in _controls(settings.resolve("dump"), []):
        url, token = _local_url(info.get("url")), info.get("token")
        try:
            if url is None or not isinstance(token, str):
                raise ValueError(f"{info['file']}: not a loopback http URL with a port and a token: not asked")
            status, reply = server.request({"url": url, "token": token}, method, path, body)
        except (OSError, ValueError, RecursionError, http.client.HTTPException) as exc:  # a peer's reply too
            status, reply = None, {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.append({"url": info.get("url"), "pid": info["pid"], "status": status, "reply": reply})
    return out


def _check_request(method, path, body) -> str:
    """The request's method, after checking it is one the dump endpoint serves (in the
    driver and again in the actor: ``path`` is appended to the endpoint's URL)."""
    if not isinstance(method, str) or method.upper() not in ("GET", "POST"):
        raise ValueError(f"dump request: method {method!r}: GET or POST")
    if not isinstance(path, str) or not _REQUEST_PATH.match(path):
        raise ValueError(f"dump request: path {path!r}: an absolute path such as /state (letters, digits, _ . - /)")
    if body is not None and not isinstance(body, dict):
        raise ValueError(f"dump request: body: a dict or None, not a {type(body).__name__}")
    return method.upper()


def _local_url(url) -> str | None:
    """``url`` if it is this node's loopback with a port (a wildcard host made loopback), else None."""
    found = _LOCAL_URL.match(url) if isinstance(url, str) else None
    if not found or not 0 < int(found[2]) < 65536:
        return None
    return f"http://{_WILDCARD.get(found[1], found[1])}:{found[2]}"


def _exp_dir(dump: dict) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(dump["dir"])), dump["exp_name"])


def _controls(dump: dict, refused: list) -> list:
    return _family_files(Path(_exp_dir(dump)) / "control", refused)


def _family_files(folder: Path, refused: list) -> list:
    """The JSON files in ``folder`` (control or token files, which their processes write
    private: runtime/core/private.py) of this process and its children.  Read only where
    the folder and the file are this user's and no one else can write them, never
    through a link, never a FIFO (it would hang) or an oversized file
    (``endpoint.read_private_json``); any other is one line in ``refused``: a file
    planted there must not choose the URL that ``local_dump_request`` sends a token to."""
    from source_patch.runtime.core import endpoint, private

    try:
        os.close(private.open_folder(str(folder), []))  # the folder checked once, not per file
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    except OSError as exc:  # Untrusted: another user's, or writable by others
        refused.append(f"{folder}: {exc.strerror or exc}")
        return []
    family, out = _family(), []
    for name in names:
        info = endpoint.read_private_json(folder, name, refused)
        pid = info.get("pid") if info else None
        if type(pid) is int and pid in family:  # a bool is no pid
            out.append({**info, "file": str(folder / name)})
    return out


def _public(info: dict) -> dict:
    return {k: info[k] for k in ("url", "ws", "pid", "rank", "file") if k in info}


def _family() -> set:
    """This process and its descendants (from /proc; elsewhere this process only)."""
    children: dict = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        entries = []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(pid))
    family, todo = {os.getpid()}, [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in family:
                family.add(child)
                todo.append(child)
    return family


def local_route_files(folder: str | None = None, max_bytes: int = MAX_ROUTE_BYTES) -> dict:
    """The routing files under ``folder`` (default: this process's SGLang routing
    dir, else its Megatron routing dir) as ``{relative path: bytes}``."""
    from source_patch.runtime.core import bounded, settings

    folder = folder or os.environ.get(ROUTING_SGLANG_DIR) or settings.resolve("routing")["dir"]
    if not folder:
        raise ValueError("no routing folder: pass one, or set SOURCE_PATCH_ROUTING_SGLANG_DIR / routing dir")
    root, files, total = Path(folder), {}, 0
    for path in sorted(root.rglob("*.safetensors")) if root.is_dir() else ():
        if path.is_symlink() or not path.is_file():
            continue
        total += path.stat().st_size
        if total > max_bytes:
            raise ValueError(f"routing files under {root} exceed {max_bytes} bytes: collect fewer at a time")
        # no link, no FIFO swapped in since the check (it would hang this actor)
        files[path.relative_to(root).as_posix()] = bounded.read_regular(path, max_bytes=max_bytes,
                                                                         what="routing file", follow_symlinks=False)
    return {"node": node_address(), "pid": os.getpid(), "dir": str(root.resolve()), "files": files}


def local_weight_sync_rendezvous(engine_tp_sizes=(1,), host: str | None = None, port: int = 0) -> list:
    """On trainer rank 0 once it is placed: the weight-sync rendezvous on this node
    (``host``, default Ray's node address; ``port``, default a free one), set in this
    process's weight sync, and SGLang's ``/init_weights_update_group`` body for each
    engine (consecutive ``rank_offset``s; ``world_size`` 1 + every engine rank)."""
    import torch

    from source_patch.runtime.core.endpoint import free_port
    from source_patch.runtime.weight_sync import sync

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        raise ValueError("the weight-sync rendezvous is served by trainer rank 0 (the sender): call it there")
    host, port = host or node_address(), port or free_port()
    world = 1 + sum(int(tp) for tp in engine_tp_sizes)
    config = sync.configure(host=host, port=port, world_size=world)
    backend = config["backend"] if config["backend"] != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    bodies, offset = [], 1
    for tp in engine_tp_sizes:
        bodies.append({"master_address": host, "master_port": port, "rank_offset": offset, "world_size": world,
                       "group_name": config["group_name"], "backend": backend})
        offset += int(tp)
    return bodies


class SourcePatchActor:
    """Mix into a Ray actor class: the driver's helpers below call these methods."""

    def source_patch_status(self) -> dict:
        return local_status()

    def source_patch_endpoints(self) -> dict:
        return local_endpoints()

    def source_patch_dump_request(self, method: str, path: str, body: dict | None = None) -> list:
        return local_dump_request(method, path, body)

    def source_patch_route_files(self, folder: str | None = None) -> dict:
        return local_route_files(folder)

    def source_patch_weight_sync_rendezvous(self, engine_tp_sizes=(1,), host: str | None = None,
                                            port: int = 0) -> list:
        return local_weight_sync_rendezvous(engine_tp_sizes, host, port)


# ------------------------------------------------------------------ the driver's helpers


def _each(actors, method: str, *args, timeout: float = 300.0, kind: type = dict) -> list:
    """Each actor's answer to ``method``, checked to be a ``kind`` (ActorAnswerError names the actor)."""
    actors = list(actors)
    answers = _ray().get([getattr(a, method).remote(*args) for a in actors], timeout=timeout)
    for i, answer in enumerate(answers):
        if not isinstance(answer, kind):
            raise ActorAnswerError(f"actor {i} ({actors[i]!r}): {method} answered a {type(answer).__name__}, "
                                   f"not a {kind.__name__}")
    return answers


def status(actors, timeout: float = 300.0) -> list:
    """:func:`local_status` of each actor."""
    return _each(actors, "source_patch_status", timeout=timeout)


def endpoints(actors, timeout: float = 300.0) -> list:
    """:func:`local_endpoints` of each actor."""
    return _each(actors, "source_patch_endpoints", timeout=timeout)


def dump_request(actors, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> list:
    """:func:`local_dump_request` in each actor, e.g. ``dump_request(actors, "GET", "/state")``
    or ``("POST", "/configure", {"names": ["logits"]})``."""
    method = _check_request(method, path, body)  # here first: the actors would all refuse it
    return _each(actors, "source_patch_dump_request", method, path, body, timeout=timeout, kind=list)


def weight_sync_rendezvous(trainer, engine_tp_sizes=(1,), host: str | None = None, port: int = 0,
                           timeout: float = 300.0) -> list:
    """:func:`local_weight_sync_rendezvous` in ``trainer`` (rank 0's actor)."""
    return _ray().get(trainer.source_patch_weight_sync_rendezvous.remote(list(engine_tp_sizes), host, port),
                      timeout=timeout)


def collect_routes(actors, into, rids=None, folder: str | None = None, timeout: float = 120.0) -> dict:
    """The SGLang routing records of ``actors`` (engines on any node), copied under
    ``into`` (one folder per actor) and merged: ``{rid: RoutingRecord}``.  With
    ``rids``, waits until each has a record (SGLang writes one when it releases the
    finished request, just after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        parts = _each(actors, "source_patch_route_files", folder, timeout=timeout)
        records = merge_route_files(parts, into)
        missing = sorted(set(rids or ()) - set(records))
        if not missing:
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"no routing record for {missing[:8]} after {timeout:.0f} s in {len(parts)} actor(s)")
        time.sleep(0.2)


def merge_route_files(parts: list, into) -> dict:
    """Write each part's files (:func:`local_route_files` answers) under
    ``into/actor-<i>/`` and merge them (:func:`routing.sglang.files.merge_rank_files`:
    every file validated, a request seen by several ranks must be the same on all).

    ``into`` is new, empty, or a folder an earlier call wrote (it holds ROUTES_MARK):
    this user's, writable by no one else (made 0700), its ``actor-<i>`` folders
    replaced by this call's, so no file from before is merged; any other content is
    refused.  Files are written 0600 through private.write_private: never through a
    link planted there.  An answer that is not a dict of plain relative
    ``*.safetensors`` names to bytes is an ActorAnswerError naming the actor."""
    from source_patch.runtime.core import private
    from source_patch.runtime.routing.sglang.files import merge_rank_files

    checked = [_files_of(i, part) for i, part in enumerate(parts)]  # all before anything is written
    root = _fresh_routes_folder(into)
    for i, files in enumerate(checked):
        for relative, data in files.items():
            # not synced: a copy fetched again on the next call; a torn one fails validation
            private.write_private(root, [f"actor-{i}", *relative.split("/")], data, sync=False)
    return merge_rank_files(root) if any(checked) else {}


def _files_of(i: int, part) -> dict:
    """Actor ``i``'s ``files``, checked (types, names, size) without writing anything."""
    node = part.get("node") if isinstance(part, dict) else None
    where = f"actor {i}" + (f" (node {node[:100]!r})" if isinstance(node, str) else "")
    files = part.get("files") if isinstance(part, dict) else None
    if not isinstance(files, dict):
        raise ActorAnswerError(f"{where}: not a route_files answer (a dict whose 'files' is a dict)")
    total, folders = 0, set()
    for relative, data in files.items():
        if not isinstance(relative, str) or not isinstance(data, (bytes, bytearray)):
            raise ActorAnswerError(f"{where}: a routing file named by a {type(relative).__name__} holds a "
                                   f"{type(data).__name__}: expected a str path and bytes")
        names = relative.split("/")
        if not relative.endswith(".safetensors") or len(names) > 8 or not all(_PLAIN.match(n) for n in names):
            raise ActorAnswerError(f"routing file {relative[:300]!r} from {where}: not a plain relative path")
        folders.update("/".join(names[:k]) for k in range(1, len(names)))
        total += len(data)
    clash = folders & set(files)
    if clash or total > MAX_ROUTE_BYTES:
        raise ActorAnswerError(f"{where}: " + (f"{sorted(clash)[0][:300]!r} is both a file and a folder" if clash
                                               else f"{total:,} bytes of routing files, over {MAX_ROUTE_BYTES:,}"))
    return files


def _fresh_routes_folder(into) -> str:
    """``into`` made or checked (private), its earlier actor-<i> folders removed, marked."""
    from source_patch.runtime.core import private

    root = os.path.abspath(os.fspath(into))
    fd = private.open_folder(root, [], create=True)  # made 0700; Untrusted if another user could write it
    try:
        entries = os.listdir(fd)
    finally:
        os.close(fd)
    if entries:  # an earlier merge's (marked, nothing else there): its files are not merged again
        if ROUTES_MARK not in entries or not all(_ACTOR.match(e) for e in entries if e != ROUTES_MARK):
            raise ValueError(f"merge routes into {root}: it holds what no earlier merge wrote (only {ROUTES_MARK} "
                             f"and actor-<i> folders may be there): collect into a new or empty folder")
        private.read_private(root, [ROUTES_MARK])  # a regular file of this user's, not a link
        for name in entries:
            if name != ROUTES_MARK:
                shutil.rmtree(os.path.join(root, name))  # never follows a link (refuses one at the top)
    private.write_private(root, [ROUTES_MARK], b"written by source_patch.integrations.ray.merge_route_files\n")
    return root
