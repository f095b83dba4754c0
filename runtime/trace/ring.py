"""Host memory the traced process shares with its trace forwarder: results go there
straight from the device.

With ``hub: process`` the training thread copies each reduced result (a few KB to a
few hundred KB) into the next free slice of this ring, asynchronously on its own
stream; the memory is page-locked (``cuMemHostRegister``) so the copy is a real DMA
that returns at once.  The publisher thread then only waits for the copies' events
(without the GIL) and sends the forwarder a short header naming the slices; the
forwarder reads the bytes from its own mapping of the same memory and writes how far it
has read into the same memory (``released``, the page after the slices): no message
back per batch, so nothing wakes in the traced process.  The publisher takes that as
the ring's tail before each batch it hands over (``refresh``).  Nothing is joined,
allocated, pinned or serialised in the traced process per result.

One ring per process, created on first use and kept until exit: an in-flight copy
must never land in unmapped memory, so it is neither unmapped nor unpinned, and a
restarted forwarder gets the same one.  Slices are handed out in order (``head``) and
given back in order (``tail``): a result that does not fit is dropped (and counted),
never waited for.
"""

from __future__ import annotations

import ctypes
import functools
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


class _Cursor:
    """One of a ring's two cursor integers, read and set as an attribute."""

    def __init__(self, index: int):
        self.index = index

    def __get__(self, ring, owner=None):
        return self if ring is None else ring.cursor[self.index]

    def __set__(self, ring, value: int) -> None:
        ring.cursor[self.index] = value


class Ring:
    head = _Cursor(0)  # bytes handed out, ever (the training thread's)
    tail = _Cursor(1)  # bytes given back, ever (refresh: what the forwarder has released)

    def __init__(self, size: int = SIZE):
        self.size = size
        self.fd = os.memfd_create("source-patch-trace-ring", 0)  # anonymous: nothing to clean up
        # The page after the slices holds how far the forwarder has read (``released``):
        # it maps that page writable, the slices read-only (forwarder.Tail).
        self.released_at = at = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        os.ftruncate(self.fd, at + mmap.PAGESIZE)
        self._map = mmap.mmap(self.fd, at + mmap.PAGESIZE)
        self._released = ctypes.c_int64.from_buffer(self._map, at)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=size)
        self.floats = self.bytes.view(torch.float32)
        self.address = self.bytes.data_ptr()
        self.device_address: int | None = None  # where kernels see it, once pinned (None: unknown)
        self.lock = threading.Lock()  # any thread may trace (api's trace queue lock where it serves)
        self.direct = True  # kernels may write here (cleared if a launch refuses host memory)
        # [head, tail] (above), two int64 that the compiled due call reads and writes too
        # (native_launch.cpp, at ``cursor_address``).  In this process's own memory, inline
        # in the ctypes object, not in the shared page: a due call runs cold, and that page
        # would be one more for it to find (on the CPU VM, where a TLB miss walks two page
        # tables, 0.999-1.025x of a cold call: not resolved, not risked).
        self.cursor = (ctypes.c_int64 * 2)()
        self.cursor_address = ctypes.addressof(self.cursor)
        self.pinned: bool | None = None  # None: not tried yet

    def pin(self) -> bool:
        """Page-lock the ring once, for asynchronous device copies (False: cannot)."""
        if self.pinned is None:
            self.pinned = register(self.address, self.size)
            if self.pinned:
                self.device_address = _device_address(self.address)
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
        with self.lock:
            offset, end = self._take(nbytes)
            if offset is None:
                return None
            target = self.bytes[offset: offset + nbytes].view(result.dtype)
            target.copy_(result.reshape(-1), non_blocking=result.is_cuda)
        return offset, end, NUMPY[result.dtype], list(result.shape)

    def claim(self, shape: tuple) -> "Slice | None":
        """(training thread) The next free slice, for a kernel to write a float32 result
        of ``shape`` into directly (the memory is mapped into the device's address
        space).  None when it does not fit now."""
        with self.lock:
            offset, end = self._take(math.prod(shape) * 4)
        return None if offset is None else Slice(self, offset, end, shape)

    def _take(self, nbytes: int) -> tuple:
        # (caller holds lock) api._fast and native_launch.cpp's claim_and_launch run this
        # inline: keep the three in step (but for the refresh where full: theirs wait for
        # the publisher's, before its next batch).
        start = self.head
        offset = start % self.size
        if offset + nbytes > self.size:  # a slice never wraps: skip to the ring's start
            start += self.size - offset
            offset = 0
        end = start + -(-nbytes // ALIGN) * ALIGN
        if end - self.tail > self.size and end - self.refresh() > self.size:  # (read now, where it is full)
            return None, None
        self.head = end
        return offset, end

    def release(self, upto: int) -> None:
        """Slices up to ``upto`` have been read: free again."""
        if upto > self.tail:
            self.tail = upto

    @property
    def released(self) -> int:
        """How far the forwarder has read, as it wrote it into the shared page."""
        return self._released.value

    def refresh(self) -> int:
        """(the publisher, before each batch; state) The tail moved up to what the
        forwarder has released: the slices it read are free again (between two
        refreshes a claim sees them taken, so the ring holds up to a batch less); the tail."""
        self.release(self._released.value)
        return self.tail

    def state(self) -> dict:
        self.refresh()
        return {"bytes": self.size, "pinned": self.pinned, "in_use": self.head - self.tail,
                "written": self.head}

    def reset(self) -> None:
        """A new forwarder starts reading: everything handed out so far is forgotten."""
        self.tail = self._released.value = self.head


@functools.lru_cache(maxsize=1)
def _driver():
    """The CUDA driver library (ctypes), or None where there is none."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def register(address: int, size: int) -> bool:
    """Page-lock ``size`` bytes at ``address`` for every device's context and map them
    into the devices' address space (kernels write there); False where refused.
    Through the driver, not the runtime: a refused ``cudaHostRegister`` stays the
    thread's last runtime error, which torch's next kernel launch check would raise in
    the traced code; the driver's refusal leaves nothing behind."""
    cuda = _driver()
    if cuda is None:
        return False
    torch.cuda.current_device()  # the runtime's primary context, current on this thread
    portable, devicemap = 1, 2  # CU_MEMHOSTREGISTER_* (cuda.h)
    status = cuda.cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(size),
                                       ctypes.c_uint(portable | devicemap))
    return status == 0


def unregister(address: int) -> bool:
    """Undo ``register`` (tests: the ring itself stays registered until exit)."""
    cuda = _driver()
    return cuda is not None and cuda.cuMemHostUnregister(ctypes.c_void_p(address)) == 0


def _device_address(host: int) -> int | None:
    """The device address of registered host memory, from the driver (the same number
    as the host's on most systems, not on all); None where it cannot be asked.  Asked
    once: a launcher given a host address asks at every launch (cuPointerGetAttribute)."""
    cuda = _driver()
    if cuda is None:
        return None
    try:
        address = ctypes.c_uint64()
        device_pointer = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER (cuda.h)
        status = cuda.cuPointerGetAttribute(ctypes.byref(address), device_pointer, ctypes.c_uint64(host))
    except AttributeError:
        return None
    # Registration maps whole pages: an answer that moves the offset within a page is not an address.
    ok = status == 0 and address.value and (address.value - host) % mmap.PAGESIZE == 0
    return address.value if ok else None


class Slice:
    """A claimed slice of the ring as a kernel launcher takes it: ``device_address``
    (where known), ``data_ptr()`` (the launcher maps the host address to the device's)
    or ``tensor()``, a float32 view."""

    __slots__ = ("ring", "offset", "end", "shape", "device_address")

    def __init__(self, ring: Ring, offset: int, end: int, shape: tuple):
        self.ring, self.offset, self.end, self.shape = ring, offset, end, shape
        base = ring.device_address
        self.device_address = None if base is None else base + offset  # a launcher given it asks nothing

    @property
    def slot(self) -> tuple:
        """(offset, end, numpy dtype, shape), as ``Ring.put`` returns it."""
        return self.offset, self.end, "<f4", list(self.shape)

    def data_ptr(self) -> int:
        """The host address (a launcher given this object asks the driver for the device's)."""
        return self.ring.address + self.offset

    def tensor(self) -> torch.Tensor:
        start = self.offset // 4
        return self.ring.floats[start: start + math.prod(self.shape)].view(self.shape)


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
