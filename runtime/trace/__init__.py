"""Live tensor tracing: chosen tensors, compressed on their device, streamed to
WebSocket clients while a model trains or serves.

    api.py        call sites (trace, trace_step), the hot path, and the state every part
                  below shares (one place); the control API, importable from this package
    control.py    the control API (configure, url, state, names, reset, flush, close)
    lifecycle.py  a configuration applied: the hub started, restarted or stopped
    publisher.py  the publisher thread: results fetched to the host, handed to the hub
    device.py     the device stage, and torch's C entry points for streams and events
    plan.py       the planned due call, worked out once per (name, layer) and layout
    native.py     its compiled launch (native_launch.cpp), built by source-patch build-native
    graphs.py     trace() under CUDA graphs: staged at capture, offered after every replay
    compress.py   compressors: a device stage (torch, no sync) and a host stage (numpy)
    frame.py      the binary frame format and multi-frame messages
    fused.py      the fused Triton tiles kernel (compress.py's tiles on a GPU)
    hub.py        the WebSocket hub (127.0.0.1 + token, per-client bounded queues)
    forwarder.py  the hub in a process of its own; ring.py: the page-locked ring it reads
    client.py     Python client and the record/summary/show CLI
    view/         the browser page the hub serves
"""

_API = ("trace", "trace_step", "enabled", "configure", "configure_from_settings", "public_config", "url", "state",
        "names", "reset", "flush", "close")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
