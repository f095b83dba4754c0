"""A device tensor read back to the host without waiting for the device.

    reader = Readback()
    host = reader.start(flat)    # CUDA: a non-blocking copy into pinned memory, an event
    ...                          # training goes on
    if reader.done(): ...        # the copy has landed (never waits)
    reader.wait(); use(host)     # waits, if it must, for that copy only

The pinned buffer is the reader's own, made on its first CUDA read and grown when a
larger one comes, then reused: one read in flight per reader (wait for it before the
next ``start``).  A CPU tensor is copied at once (``done()`` is then True).  Used by the
sentinels' step ends (non-finite flags, routing health), which read once a step and
must never stall the training thread.
"""

from __future__ import annotations

import torch


class Readback:
    """One device-to-host read at a time, into a reused pinned buffer."""

    __slots__ = ("_host", "_event", "_made")

    def __init__(self):
        self._host: torch.Tensor | None = None
        self._event = None  # the read in flight's event (None: none, or a CPU read)
        self._made = None   # the CUDA event, made once and recorded again each read

    def start(self, source: torch.Tensor) -> torch.Tensor:
        """Begin copying ``source`` (flattened) to the host; the host tensor it lands in,
        to be read once :meth:`done` or after :meth:`wait`."""
        if source.device.type != "cuda":
            self._event = None
            return source.detach().reshape(-1).to("cpu", copy=True)
        n = source.numel()
        if self._host is None or self._host.numel() < n or self._host.dtype != source.dtype:
            self._host = torch.empty(max(n, 1024), dtype=source.dtype, pin_memory=True)
        host = self._host[:n]
        host.copy_(source.detach().reshape(-1), non_blocking=True)
        if self._made is None:
            self._made = torch.cuda.Event()
        self._made.record()
        self._event = self._made
        return host

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
