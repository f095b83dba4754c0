"""The planned due call: what a due trace() call of one (name, layer) and tensor
layout needs, worked out once (:func:`make`), so that api._fast can run it in one
frame: one subscription whose tiles go through the fused kernel straight into the
forwarder's ring (hub: process), launched with the grid and arguments fused.py computed
for the layout: through native.py's compiled launch (the trace setting
``triton_launch: native``, where built), else through Triton's compiled launcher.

It reads none of the trace state (api.py, which imports it): :func:`make` is given the
ring, and api arms a compiled due call once it has a plan with one (api._make_plan).
"""

from __future__ import annotations

import torch

from .ring import ALIGN


class Plan:
    """api._fast runs it in one frame (and the launcher's) where the general path takes
    ~12; ``stale``: the tensor's layout changed, plan again; ``failed``: its launch
    raised, the general path from now on; ``native``: native.py's plan of the launch
    (it checks the tensor's layout itself, and launches on ``stream``, the device's
    default stream, where that is current), or None; ``due``: with it, the compiled due
    call (native_launch.cpp), which api.trace calls instead of api._fast: the whole
    call in C++, handed to api._fast where its one case does not hold."""

    __slots__ = ("sub", "subs", "shape", "dtype", "device", "aligned", "call", "args", "at_stream", "at_input",
                 "nbytes", "padded", "dims", "stale", "failed", "native", "native_launch", "stream", "due")

    def __init__(self, sub, tensor: torch.Tensor, launch, native_launch: bool = False):
        self.sub, self.stale, self.failed = sub, False, False
        self.native = self.native_launch = self.stream = self.due = None
        self.nbytes = 4 * launch.shape[0] * launch.shape[1] * launch.shape[2]  # float32 [splits, stats, cols]
        self.padded = -(-self.nbytes // ALIGN) * ALIGN  # what a slice of it takes in the ring
        if native_launch:
            from . import device, native

            self.native = native.plan(launch.kernel, (*launch.grid, 1), launch.args, tensor, self.nbytes, self.padded)
            if self.native is not None:
                module = native.load()
                self.native_launch, self.due = module.launch, module.due  # api.trace calls due (else api._fast)
                index = tensor.get_device()
                self.stream = (device.known_streams.get((index, 0)) or device.know_stream(index, 0))[0]
        call, before, middle, after = launch.compiled  # fused._launcher's
        # The launch's arguments, in one list: _fast sets the three that change (under api's
        # lock: one call at a time) where it would join four parts at every call.
        self.call, self.args = call, [*before, None, *middle, None, None, *after]
        self.at_stream, self.at_input = len(before), len(before) + 1 + len(middle)  # the output right after the input
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.get_device()
        self.aligned = tensor.data_ptr() & 15 == 0  # its kernel is compiled for 16-byte aligned input or not
        # every result's subscriptions and shape, shared (nothing downstream changes them)
        self.subs, self.dims = [sub], list(launch.shape)


def make(routes: tuple, tensor, ring) -> "Plan | bool | None":
    """(after a general due call) A plan for this (name, layer) into ``ring`` (the
    forwarder's, or None), False where none can apply (several subscriptions, another
    compressor, no ring the device writes to), None where one may later (the kernel is
    not compiled yet)."""
    fused_spec = getattr(routes[0].compressor, "fused", None)
    if len(routes) != 1 or fused_spec is None or ring is None or not isinstance(tensor, torch.Tensor) \
            or not tensor.is_cuda:
        return False
    if not (ring.direct and ring.pinned and ring.device_address is not None):
        return None
    from . import compress

    fused = compress.fused_kernel()
    launch = fused.planned(tensor, *fused_spec) if fused is not None else None
    return None if launch is None else Plan(routes[0], tensor, launch, compress.NATIVE_LAUNCH)
