"""The hub the configuration asks for: started, restarted or stopped when settings are
applied, in a forwarder process (forwarder.py, ``hub: process``) or in a thread here
(hub.py, ``hub: thread``, or when the forwarder cannot start), with the publisher
thread (publisher.py) that hands it the traced results.

The state it changes (the configuration, whether call sites trace, the hub and its
ring) is api.py's, changed through api's functions (set_config, set_enabled, serve,
unserve, start_publisher); the hub reads the state through api too (its ``runtime``).
"""

from __future__ import annotations

import os
import sys

from ..core import commands, ranks, settings
from . import api, graphs, publisher


def apply(config: dict) -> None:
    """(caller holds control's configuration lock) Apply a validated configuration."""
    config = dict(config, dir=os.path.abspath(os.path.expanduser(config["dir"])))
    api.set_config(config)  # call sites off until it is applied; plans made again, with the launch asked for now
    from . import compress

    compress.USE_TRITON = config["triton"]
    launch = config["triton_launch"]
    compress.DIRECT_LAUNCH = launch != "triton"
    compress.NATIVE_LAUNCH = launch in ("auto", "native") and config["enable"] and _native_built(launch == "native")
    serve = bool(config["enable"] and config["port"])
    if serve and config["ranks"] is not None:
        serve = ranks.global_rank() in settings.IntSet(config["ranks"])
    started = _sync_hub(config, serve)
    api.set_enabled(api.hub is not None)
    graphs.use(api.is_enabled(), api.trace, api.fail)
    if started and config["wait"] and not api.subscribed.is_set():
        print(f"source-patch trace: waiting up to {config['wait']:g} s for a client to subscribe",
              file=sys.stderr, flush=True)
        api.subscribed.wait(config["wait"])


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
              f"(build it with: {commands.command('build-native')})", file=sys.stderr)
    return False


_native_said = False  # _native_built's message: once a process


def _sync_hub(config: dict, serve: bool) -> bool:
    """Start, restart or stop the hub to match ``config``; True if one started."""
    key = (config["host"], config["port"], config["token"], config["max_message"], config["dir"],
           config["hub"]) if serve else None
    if key == api.hub_key:
        if api.hub is not None:
            api.hub.config = config  # queue sizes and timeouts apply at once
        return False
    stop_hub()
    if key is None:
        return False
    try:
        hub = _new_hub(config)
    except Exception as exc:  # noqa: BLE001 - no hub: nothing traced, training goes on
        api.serve(None, key)  # (not tried again for this configuration)
        api.fail("starting the trace hub", exc)
        return False
    api.serve(hub, key)
    api.start_publisher(publisher.loop)  # asleep until there is something to hand over
    return True


def _new_hub(config: dict):
    """A hub in a forwarder process (hub: process), or in a thread here (hub: thread,
    or when the forwarder cannot start: said once, then served from a thread).  Either
    reads the trace state through api.py (its ``runtime``)."""
    from .hub import Hub

    if config["hub"] == "process":
        from .forwarder import Forwarder, ForwarderUnavailable

        try:
            return Forwarder(api, config)
        except ForwarderUnavailable as exc:
            api.fail("starting the trace forwarder (serving from a thread instead)", exc)
    return Hub(api, config)


def stop_hub() -> None:
    """Stop the hub (its clients, its forwarder) and forget its subscriptions and ring."""
    hub = api.unserve()
    if hub is not None:
        try:
            hub.stop()
        except Exception as exc:  # noqa: BLE001
            api.fail("stopping the trace hub", exc)
