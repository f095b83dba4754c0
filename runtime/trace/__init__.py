"""Live tensor tracing: chosen tensors, compressed on their device, streamed to
WebSocket clients while a model trains or serves.

    manifest.py   its declaration: settings, control modules, call sites, specs, docs page
    api.py        the ground floor: call sites (trace, trace_step), the hot path, and the
                  state every part above shares (one place), imported by them
    control.py    the control API (configure, url, state, reset, flush, close); its import
                  reads the settings
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

# The public API, each name where it is defined (the call sites and the state's readers in
# api.py, the rest in control.py), exported lazily: the client CLI imports no torch.
_API = {"trace": "api", "trace_step": "api", "names": "api", "enabled": "control", "configure": "control",
        "configure_from_settings": "control", "public_config": "control", "url": "control", "state": "control",
        "reset": "control", "flush": "control", "close": "control"}


def __getattr__(name: str):
    if name in _API:
        from . import api, control  # control's import reads the settings, before any call

        return getattr(api if _API[name] == "api" else control, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
