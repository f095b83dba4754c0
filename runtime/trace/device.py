"""The device stage of a due trace() call, and the torch entry points the hot path uses.

:func:`stage` runs a compressor's reduction on the tensor's device and puts the result
where the hub reads it: into the forwarder's page-locked ring (written by the kernel
itself, or copied there asynchronously) or nowhere (a thread hub copies it later).
The rest are torch's C functions for streams and events, each with the public way as
its fallback: a due call's host time grows with every Python frame it takes.

It reads none of the trace state (api.py, which imports it): what it needs of it comes
as arguments, and what it finds goes back as results (stage_failed names the counter).
"""

from __future__ import annotations

import torch

from .ring import Slice


def stage(compressor, tensor: torch.Tensor, ring, copying) -> tuple:
    """(result, slot): the compressor's device stage and, with a forwarder's ring, the
    slice of it the result goes to: written there by the kernel itself (fused tiles),
    or copied there asynchronously; (None, None) when the ring is full.  ``copying(exc)``
    is told once a kernel could not write to the ring (ring.direct is then off)."""
    if ring is None:
        return compressor.reduce(tensor), None
    if ring.direct and tensor.is_cuda and (ring.pinned or ring.pin()):
        head = ring.head
        try:
            result = compressor.reduce(tensor, ring.claim)
        except Exception as exc:  # noqa: BLE001
            if ring.head == head:
                raise  # nothing was claimed: the compressor's own error
            ring.direct = False  # a kernel that cannot write host memory here: copy from now on
            copying(exc)
            result = compressor.reduce(tensor)
        if type(result) is Slice:
            return result, result.slot
    else:
        result = compressor.reduce(tensor)
    if not ring.takes(result):
        return result, None
    slot = ring.put(result)
    return (result, slot) if slot is not None else (None, None)


def stage_failed(subs: list, name: str, exc: Exception, hub) -> str:
    """A compressor's device stage raised (a client's parameters that do not fit, a
    result too large): said once to each subscription it served, through ``hub`` (where
    one serves); the counter it counts in."""
    from .compress import TooLarge

    message = f"{name}: {exc}" if isinstance(exc, (ValueError, TypeError, IndexError, RuntimeError)) \
        else f"{name}: {type(exc).__name__}: {exc}"
    for sub in subs:
        if not sub.reported:  # once per subscription
            sub.reported = True
            if hub is not None:
                hub.report(sub, message)
    return "too_large" if isinstance(exc, TooLarge) else "compress_errors"


# Whether the current CUDA stream is capturing a graph: torch's own test without its
# Python wrapper (the public one where a build lacks it).
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing

# torch.cuda.Event.record(stream) without its Python wrapper, where torch has the C method.
event_record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None) or torch.cuda.Event.record

# (device index, stream id) -> (torch.cuda.Stream, its cudaStream_t): a stream's id names
# it for the process's life, so one stream_of call finds both (current_stream, api._fast).
known_streams: dict = {}


def _public_stream_of(index: int) -> tuple:
    """stream_of the public way, for a torch without the C function."""
    stream = torch.cuda.current_stream(index if index >= 0 else None)
    return stream.stream_id, stream.device_index, 1


# (stream id, device index, device type) of the current stream of device ``index`` (-1: of
# the current device, so that one call says both).
stream_of = getattr(torch._C, "_cuda_getCurrentStream", None) or _public_stream_of


def current_stream(index: int):
    """torch.cuda.current_stream(index) without its device-index resolution and a new
    Stream object per call (most of an event record's host time, profiled on an H100)."""
    try:
        sid, device, kind = torch._C._cuda_getCurrentStream(index)
    except AttributeError:  # a torch without it: the public way
        return torch.cuda.current_stream(index)
    return (known_streams.get((device, sid)) or know_stream(device, sid, kind))[0]


def know_stream(index: int, sid: int, kind: int = 1) -> tuple:
    """(Stream, raw handle) of the stream ``sid`` of device ``index``, now in known_streams."""
    stream = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)
    pair = known_streams[(index, sid)] = (stream, stream.cuda_stream)
    return pair
