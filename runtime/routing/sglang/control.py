"""The SGLang side's control surface (the capability contract: core/capability.py):
configure, state, reset, flush, close (core/control.py's, given what differs here), and the mode every call
site tests.

Settings: the ``routing_sglang`` component (docs/settings.md), read on first use:
``SOURCE_PATCH_ROUTING_SGLANG_MODE`` / ``_DIR`` / ``_REPLAY`` over a spec's
``runtime: routing_sglang:`` over the defaults (off; no dir; no replay source).
"""

from __future__ import annotations

import atexit
import os
import warnings
from pathlib import Path

from ...core.adapters import graph_stage
from ...core.control import Control
from ..records.record import RoutingRecord, load
from .files import by_request, merge_rank_files, write_held
from .graphs import unstaged
from .state import S, warn_once

SETTINGS = "routing_sglang"  # its settings component (the capability contract: core/capability.py)


def _apply(config: dict, rank=None, replay_objects=None) -> dict:
    src = None
    if config["mode"] == "replay":  # read before any state is set: a bad source fails every call alike
        src = _replay_source(replay_objects if replay_objects is not None else config["replay"])
    S.mode, S.replay, S.config = config["mode"], src, config
    S.rank = S.rank if rank is None else rank
    S.dir = config["dir"] or None
    graph_stage.use(SETTINGS, unstaged, on=S.mode != "off")  # SGLang's decode graphs stage / feed for us
    return config


def _replay_source(src) -> dict:
    """``{rid: RoutingRecord}`` of a replay source: a record, a mapping, a file or a folder of rank folders."""
    if isinstance(src, RoutingRecord):
        return {src.sample_ids[0] if src.sample_ids and len(src.sample_ids) == 1 else None: src}
    if isinstance(src, dict):
        return src
    if not src:
        raise ValueError("replay mode needs a record (SOURCE_PATCH_ROUTING_SGLANG_REPLAY)")
    p = Path(src)
    if p.is_dir() and not any(p.rglob("*.safetensors")):
        # as for a request without a record: the router's own routes, said once
        warn_once("emptydir", f"replay: no routing files under {p}: every request keeps the router's own routes")
        return {}
    return merge_rank_files(p) if p.is_dir() else by_request([load(p)])


def _counters() -> dict:
    with S.lock:
        rows = sum(e["end"] - e["start"] for e in S.live.values())
        requests = len(S.live)
        kv = S.stores["kv"]
    return {"requests_held": requests, "rows_held": rows, "records_written": S.written,
            "replay_records": len(S.replay or {}), "warnings": len(S.warned),
            "slot_store_slots": kv.capacity, "slot_store_bytes": kv.nbytes()}


def _clear() -> None:
    """reset(): forget everything (settings, ambient batch, captured rows, replay source);
    the settings are read again on first use."""
    with S.lock:
        S.reset()
    _control.forget()
    graph_stage.use(SETTINGS, on=False)  # until the settings are read again


def _stop(_timeout: float | None) -> bool:
    """close(): write what is still held (capture with a dir); records are written
    synchronously, so the timeout has nothing to wait for."""
    if S.mode == "capture" and S.dir and S.live:
        try:
            write_held()
        except Exception as exc:  # never fail interpreter exit
            S.last_error = f"writing held records: {type(exc).__name__}: {exc}"
            warnings.warn(f"source-patch sglang routing: writing held records failed: {exc}", RuntimeWarning)
            return False
    return True


# Settings not read yet stay unread: the first call site reads them (state() must not).
_control = Control(SETTINGS, apply=_apply, inputs=("rank", "replay_objects"),
                   enabled=lambda: S.mode not in (None, "off"), counters=_counters, last_error=lambda: S.last_error,
                   clear=_clear, stop=_stop)
configure_from_settings, state, reset, flush, close = _control.surface()[1:]


def configure(**changes) -> dict:
    """Change settings (keys of the ``routing_sglang`` schema: ``mode``, ``dir``,
    ``replay``) and apply them; returns the effective settings.  Two more inputs:
    ``replay`` may also be a RoutingRecord or a ``{rid: record}`` mapping, and ``rank``
    names the rank folder capture writes to (default: the process's rank)."""
    if not isinstance(changes.get("replay", ""), (str, os.PathLike)):
        changes["replay_objects"] = changes.pop("replay")
    return _control.configure(**{key: os.fspath(v) if isinstance(v, os.PathLike) else v
                                 for key, v in changes.items()})


def enabled() -> bool:
    """Whether the call sites do anything (the settings read first, if not yet)."""
    return current_mode() != "off"


def current_mode():
    """The mode in force (``off``, ``capture`` or ``replay``); the settings are read on first use."""
    if S.mode is None:
        configure()
    return S.mode


atexit.register(close)
