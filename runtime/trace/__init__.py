"""Live tensor tracing: chosen tensors, compressed on their device, streamed to
WebSocket clients while a model trains or serves.

    api.py       call sites (trace, trace_step) and control (configure, url, state, ...);
                 importable from this package
    graphs.py    trace() under CUDA graphs: staged at capture, offered after every replay
    compress.py  compressors: a device stage (torch, no sync) and a host stage (numpy)
    frame.py     the binary frame format and multi-frame messages
    hub.py       the WebSocket hub (127.0.0.1 + token, per-client bounded queues)
    client.py    Python client and the record/summary/show CLI
    view/        the browser page the hub serves
"""

_API = ("trace", "trace_step", "enabled", "configure", "configure_from_settings", "public_config", "url", "state",
        "names", "reset", "flush", "close")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
