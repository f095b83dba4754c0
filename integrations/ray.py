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
validates like any file.  Endpoint tokens never leave their node: the driver sees
URLs, and asks an actor to make a request for it (:func:`dump_request`).  Ray's own
ports, authentication and dashboard are Ray's (docs/integrations.md).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

SOURCE_PATCH = "SOURCE_PATCH"
SGLANG_ROUTING_DIR = "SOURCE_PATCH_SGLANG_ROUTING_DIR"
MAX_ROUTE_BYTES = 1 << 30  # routing files one actor hands over in one call
PATH_KEYS = {"dir"}        # settings that name a folder: made absolute (workers start elsewhere)
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\Z")  # a file or folder name, never . or ..


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
        env_vars[name] = value
    out = dict(base or {})
    out["env_vars"] = {**out.get("env_vars", {}), **env_vars}
    return out


def _spec_reference(ref) -> str:
    from source_patch.patcher import load_spec

    text = os.fspath(ref)
    spec = load_spec(text)  # SpecError here, in the driver, not in every worker
    bundled = os.sep not in text and not text.endswith((".yaml", ".yml")) and not os.path.exists(text)
    return text if bundled else spec.file


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
    trace hubs (URL, pid, rank; tokens stay in their 0600 files on this node)."""
    from source_patch.runtime.core import settings

    dump, trace = settings.resolve("dump"), settings.resolve("trace")
    return {"node": node_address(), "pid": os.getpid(),
            "dump_dir": _exp_dir(dump) if dump["enable"] else None,
            "dump_control": [_public(info) for info in _controls(dump)],
            "trace": [_public(info) for info in _trace_files(trace)],
            "routes": os.environ.get(SGLANG_ROUTING_DIR) or settings.resolve("routing")["dir"] or None}


def local_dump_request(method: str, path: str, body: dict | None = None) -> list:
    """One request to each dump control endpoint of this process and its children,
    made here with their tokens: ``[{"url", "pid", "status", "reply"}]``."""
    from source_patch.runtime.core import settings
    from source_patch.runtime.dump import server

    out = []
    for info in _controls(settings.resolve("dump")):
        try:
            status, reply = server.request(info, method, path, body)
        except OSError as exc:
            status, reply = None, {"error": str(exc)}
        out.append({"url": info["url"], "pid": info["pid"], "status": status, "reply": reply})
    return out


def _exp_dir(dump: dict) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(dump["dir"])), dump["exp_name"])


def _controls(dump: dict) -> list:
    from source_patch.runtime.dump import server

    family = _family()
    return [info for info in server.endpoints(_exp_dir(dump)) if info.get("pid") in family]


def _trace_files(trace: dict) -> list:
    import json

    family, out = _family(), []
    for path in sorted(Path(trace["dir"]).expanduser().glob("*.json")):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("pid") in family:
            out.append({**info, "file": str(path)})
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
    from source_patch.runtime.core import settings

    folder = folder or os.environ.get(SGLANG_ROUTING_DIR) or settings.resolve("routing")["dir"]
    if not folder:
        raise ValueError("no routing folder: pass one, or set SOURCE_PATCH_SGLANG_ROUTING_DIR / routing dir")
    root, files, total = Path(folder), {}, 0
    for path in sorted(root.rglob("*.safetensors")) if root.is_dir() else ():
        if path.is_symlink() or not path.is_file():
            continue
        total += path.stat().st_size
        if total > max_bytes:
            raise ValueError(f"routing files under {root} exceed {max_bytes} bytes: collect fewer at a time")
        files[path.relative_to(root).as_posix()] = path.read_bytes()
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


def _each(actors, method: str, *args, timeout: float = 300.0) -> list:
    return _ray().get([getattr(a, method).remote(*args) for a in actors], timeout=timeout)


def status(actors, timeout: float = 300.0) -> list:
    """:func:`local_status` of each actor."""
    return _each(actors, "source_patch_status", timeout=timeout)


def endpoints(actors, timeout: float = 300.0) -> list:
    """:func:`local_endpoints` of each actor."""
    return _each(actors, "source_patch_endpoints", timeout=timeout)


def dump_request(actors, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> list:
    """:func:`local_dump_request` in each actor, e.g. ``dump_request(actors, "GET", "/state")``
    or ``("POST", "/configure", {"names": ["logits"]})``."""
    return _each(actors, "source_patch_dump_request", method, path, body, timeout=timeout)


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
    ``into/actor-<i>/`` and merge them (:func:`routing.sglang.merge_rank_files`:
    every file validated, a request seen by several ranks must be the same on all)."""
    from source_patch.runtime.routing.sglang import merge_rank_files

    root = Path(into)
    for i, part in enumerate(parts):
        for relative, data in part["files"].items():
            names = relative.split("/")
            if not relative.endswith(".safetensors") or not all(_PLAIN.match(n) for n in names):
                raise ValueError(f"routing file {relative!r} from {part.get('node')}: not a plain relative path")
            target = root.joinpath(f"actor-{i}", *names)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return merge_rank_files(root) if any(root.rglob("*.safetensors")) else {}
