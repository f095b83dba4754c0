"""Host memory the traced process shares with its trace forwarder: results go there
straight from the device.

With ``hub: process`` the training thread copies each reduced result (a few KB to a
few hundred KB) into the next free slice of this ring, asynchronously on its own
stream; the memory is page-locked (``cudaHostRegister``) so the copy is a real DMA
that returns at once.  The publisher thread then only waits for the copies' events
(without the GIL) and sends the forwarder a short header naming the slices; the
forwarder reads the bytes from its own mapping of the same memory and says how far it
has read (``release``).  Nothing is joined, allocated, pinned or serialised in the
traced process per result.

One ring per process, created on first use and kept until exit: an in-flight copy
must never land in unmapped memory, so it is neither unmapped nor unpinned, and a
restarted forwarder gets the same one.  Slices are handed out in order (``head``) and
given back in order (``tail``): a result that does not fit is dropped (and counted),
never waited for.
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import torch

SIZE = 32 << 20   # bytes: ~100 steps of 8 layers' tiles
ALIGN = 256       # every slice starts aligned for any dtype and for the DMA engine
LARGEST = SIZE // 8  # larger results take the publisher's copy instead
NUMPY = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2", torch.int64: "<i8",
         torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|b1"}


class Ring:
    def __init__(self, size: int = SIZE):
        self.size = size
        self.fd = os.memfd_create("source-patch-trace-ring", 0)  # anonymous: nothing to clean up
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.floats = self.bytes.view(torch.float32)
        self._lock = threading.Lock()  # any thread may trace
        self.direct = True  # kernels may write here (cleared if a launch refuses host memory)
        self.head = 0   # bytes handed out, ever (the training thread's)
        self.tail = 0   # bytes given back, ever (set by the forwarder's answers)
        self.pinned: bool | None = None  # None: not tried yet

    def pin(self) -> bool:
        """Page-lock the ring once, for asynchronous device copies (False: cannot)."""
        if self.pinned is None:
            flags = 1 | 2  # cudaHostRegisterPortable | Mapped: every device's context, kernels write it
            status = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, flags)
            self.pinned = int(status) == 0
        return self.pinned

    def takes(self, result: torch.Tensor) -> bool:
        """Whether ``result`` goes through the ring: small enough, a dtype numpy reads,
        and for a CUDA result page-locked memory to copy into."""
        return (result.dtype in NUMPY and result.numel() * result.element_size() <= LARGEST
                and (not result.is_cuda or self.pin()))

    def put(self, result: torch.Tensor) -> tuple | None:
        """(training thread) Copy ``result`` into the next free slice: (offset, end, numpy
        dtype, shape), ``end`` being what to release once read; None when it does not fit now."""
        nbytes = result.numel() * result.element_size()
        with self._lock:
            offset, end = self._take(nbytes)
            if offset is None:
                return None
            target = self.bytes[offset: offset + nbytes].view(result.dtype)
            target.copy_(result.reshape(-1), non_blocking=result.is_cuda)
        return offset, end, NUMPY[result.dtype], list(result.shape)

    def claim(self, shape: tuple, slots: list) -> torch.Tensor | None:
        """(training thread) A float32 tensor of ``shape`` on the next free slice, for a
        kernel to write its result into directly (the memory is mapped into the device's
        address space); its slot is appended to ``slots``.  None when it does not fit now."""
        count = math.prod(shape)
        with self._lock:
            offset, end = self._take(count * 4)
            if offset is None:
                return None
            slots.append((offset, end, "<f4", list(shape)))
            return self.floats[offset // 4: offset // 4 + count].view(shape)

    def _take(self, nbytes: int) -> tuple:
        start = self.head
        offset = start % self.size
        if offset + nbytes > self.size:  # a slice never wraps: skip to the ring's start
            start += self.size - offset
            offset = 0
        end = start + -(-nbytes // ALIGN) * ALIGN
        if end - self.tail > self.size:
            return None, None
        self.head = end
        return offset, end

    def release(self, upto: int) -> None:
        """(the forwarder's reader thread) Slices up to ``upto`` have been read."""
        if upto > self.tail:
            self.tail = upto

    def state(self) -> dict:
        return {"bytes": self.size, "pinned": self.pinned, "in_use": self.head - self.tail,
                "written": self.head}

    def reset(self) -> None:
        """A new forwarder starts reading: everything handed out so far is forgotten."""
        self.tail = self.head


_ring: Ring | None = None
_lock = threading.Lock()


def shared() -> Ring | None:
    """This process's ring (None where memfd is not available: results then take the
    publisher's copy and the socket)."""
    global _ring
    with _lock:
        if _ring is None and hasattr(os, "memfd_create"):
            try:
                _ring = Ring()
            except OSError:
                return None
        return _ring


def forget() -> None:
    """(a forked child) Leave the parent's ring to the parent."""
    global _ring, _lock
    _ring, _lock = None, threading.Lock()
