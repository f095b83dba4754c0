"""The hub the configuration asks for: started, restarted or stopped when settings are
applied, in a forwarder process (forwarder.py, ``hub: process``) or in a thread here
(hub.py, ``hub: thread``, or when the forwarder cannot start).

The state it sets (the configuration, whether call sites trace, the hub and its ring)
lives in api.py, where the hot path reads it as module globals; api hands itself over
at import (``api`` below), so this module never imports it and holds no copy of it.
"""

from __future__ import annotations

import os
import sys

from ..core import ranks, settings
from . import graphs

api = None  # runtime/trace/api.py, set by it at import: the one place the trace state lives


def apply(config: dict) -> None:
    """(caller holds control's configuration lock) Apply a validated configuration."""
    api._enabled = False
    api._config = dict(config, dir=os.path.abspath(os.path.expanduser(config["dir"])))
    config = api._config
    from . import compress

    compress.USE_TRITON = config["triton"]
    launch = config["triton_launch"]
    compress.DIRECT_LAUNCH = launch != "triton"
    compress.NATIVE_LAUNCH = launch in ("auto", "native") and config["enable"] and _native_built(launch == "native")
    api._table.plans.clear()  # planned again, with the launch asked for now
    serve = bool(config["enable"] and config["port"])
    if serve and config["ranks"] is not None:
        serve = ranks.global_rank() in settings.IntSet(config["ranks"])
    started = _sync_hub(serve)
    api._enabled = api._hub is not None
    graphs.use(api._enabled, api.trace, api._fail)
    api._arm()
    if started and config["wait"] and not api._table.subs:
        print(f"source-patch trace: waiting up to {config['wait']:g} s for a client to subscribe",
              file=sys.stderr, flush=True)
        api._subscribed.wait(config["wait"])


def _native_built(asked: bool) -> bool:
    """The native launch is built for this torch (native.py); where not, said once when
    ``asked`` for by name (``auto`` takes it where built, silently), and a build that
    fails to load is said either way."""
    from . import native

    try:
        if native.load() is not None:
            return True
        if not asked or native.refused:
            return False  # auto: silent; a refused build: load() said why, once
        reason = f"none built for this torch under {native.build_dir().parent}"
    except Exception as exc:  # noqa: BLE001 - a broken build: Triton's launch, said
        reason = f"{type(exc).__name__}: {exc}"
    global _native_said
    if not _native_said:
        _native_said = True
        print(f"source-patch trace: triton_launch: native: {reason}; launching directly instead "
              "(build it with: source-patch build-native)", file=sys.stderr)
    return False


_native_said = False  # _native_built's message: once a process


def _sync_hub(serve: bool) -> bool:
    """Start, restart or stop the hub to match the configuration; True if one started."""
    config = api._config
    key = (config["host"], config["port"], config["token"], config["max_message"], config["dir"],
           config["hub"]) if serve else None
    if key == api._hub_key:
        if api._hub is not None:
            api._hub.config = config  # queue sizes and timeouts apply at once
        return False
    stop_hub()
    if key is None:
        return False
    api._hub_key = key
    try:
        hub = api._hub = _new_hub()
    except Exception as exc:  # noqa: BLE001 - no hub: nothing traced, training goes on
        api._fail("starting the trace hub", exc)
        return False
    ring = api._ring = getattr(hub, "ring", None)
    if ring is not None:
        ring.lock = api._lock  # the trace queue's: the planned due call takes one lock for its slice and its place
    if api._publisher is None and hasattr(hub, "share_state"):
        with api._cond:
            api._start_publisher()  # it sends the forwarder this process's state, traced or not
    return True


def _new_hub():
    """A hub in a forwarder process (hub: process), or in a thread here (hub: thread,
    or when the forwarder cannot start: said once, then served from a thread)."""
    from . import hub

    if api._config["hub"] == "process":
        from .forwarder import Forwarder, ForwarderUnavailable

        try:
            return Forwarder(api, api._config)
        except ForwarderUnavailable as exc:
            api._fail("starting the trace forwarder (serving from a thread instead)", exc)
    return hub.Hub(api, api._config)


def stop_hub() -> None:
    """Stop the hub (its clients, its forwarder) and forget its subscriptions and ring."""
    hub = api._hub
    api._hub, api._hub_key, api._shared, api._ring = None, None, (), None
    api._arm()
    api.set_subscriptions(())
    if hub is not None:
        try:
            hub.stop()
        except Exception as exc:  # noqa: BLE001
            api._fail("stopping the trace hub", exc)
