"""A host store of routes keyed by KV-cache slot, as SGLang's own capturer keeps one
(``sglang/srt/state_capturer/base.py``: ``BaseHostCache``, ``TopkCaptureOutput.finalize``,
``BaseTopkCapturer.get_topk``).

A token's routes are written at the slot its KV entry went to (``out_cache_loc`` of the
forward that computed it) and read back through the request's row of
``req_to_token``, so a prompt prefix served from the radix cache reads the rows the
earlier request wrote there: every record starts at position 0.  Freed slots are
simply overwritten by their next owner, so memory is bounded by the KV pool: per slot
and MoE layer ``topk`` int32 ids + ``topk`` float32 weights + one byte saying the row
was written (``bytes_per_slot``).

Forwards are held on their device until a read needs them (:meth:`SlotStore.pending`
then :meth:`SlotStore.settle`), so the call sites never wait for the device; a reader
may leave a forward pending (``keep``): under SGLang's overlap schedule the next batch
is already launched when a finished request is released, and waiting for it would
stall the overlap.
"""

from __future__ import annotations

import torch


class SlotStore:
    """``ids[layer]`` ``[capacity, topk]`` int32, ``weights[layer]`` float32 and
    ``written[layer]`` bool, grown on demand up to the largest slot written."""

    def __init__(self):
        self.ids, self.weights, self.written = {}, {}, {}
        self.capacity = 0
        self._pending = []  # (slots, {layer: (ids, weights)}, tag) still on the device

    def pending(self, slots: torch.Tensor, layers: dict, tag=None) -> None:
        """Hold one forward's rows (``slots``: one KV slot per row) until :meth:`settle`."""
        self._pending.append((slots, layers, tag))

    def settle(self, keep=None) -> None:
        """Scatter the held forwards into the host arrays (one device-to-host copy each),
        but those whose ``tag`` makes ``keep(tag)`` true, which stay held."""
        pending, self._pending = self._pending, []
        for slots, layers, tag in pending:
            if keep is not None and keep(tag):
                self._pending.append((slots, layers, tag))
                continue
            slots = slots.to("cpu", torch.int64)
            if slots.numel() == 0:
                continue
            self._grow(int(slots.max()) + 1)
            for layer, (ids, weights) in layers.items():
                n = min(len(slots), ids.shape[0])
                self._layer(layer, ids.shape[1])
                self.ids[layer][slots[:n]] = ids[:n].to("cpu", torch.int32)
                self.weights[layer][slots[:n]] = weights[:n].to("cpu", torch.float32)
                self.written[layer][slots[:n]] = True

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new = max(needed, 2 * self.capacity, 64)
        for table in (self.ids, self.weights, self.written):
            for layer, t in table.items():
                table[layer] = torch.cat([t, t.new_zeros((new - self.capacity, *t.shape[1:]))])
        self.capacity = new

    def _layer(self, layer: int, topk: int) -> None:
        if layer in self.ids:
            if self.ids[layer].shape[1] != topk:
                raise ValueError(f"layer {layer}: top-k width {topk}, earlier rows have {self.ids[layer].shape[1]}")
            return
        self.ids[layer] = torch.zeros(self.capacity, topk, dtype=torch.int32)
        self.weights[layer] = torch.zeros(self.capacity, topk, dtype=torch.float32)
        self.written[layer] = torch.zeros(self.capacity, dtype=torch.bool)

    def read(self, slots: torch.Tensor, what: str) -> tuple[dict, dict]:
        """``({layer: ids}, {layer: weights})`` of these slots, in their order.  A row
        never written (capture was off when a cached prefix was computed, a skipped
        forward) is an error naming the position: never zeros.  Settle what the rows
        need first."""
        slots = slots.to("cpu", torch.int64)
        ids, weights = {}, {}
        for layer in sorted(self.ids):
            if slots.numel() and int(slots.max()) >= self.capacity:
                missing = int((slots >= self.capacity).nonzero()[0])
            else:
                ok = self.written[layer][slots]
                missing = None if bool(ok.all()) else int((~ok).nonzero()[0])
            if missing is not None:
                raise LookupError(f"{what}: layer {layer} has no routes at position {missing} (KV slot "
                                  f"{int(slots[missing])}): it was computed while capture was off or "
                                  "its forward was not attributed")
            ids[layer] = self.ids[layer][slots].to(torch.int64)
            weights[layer] = self.weights[layer][slots].clone()
        return ids, weights

    def bytes_per_slot(self) -> int:
        return sum(t.shape[1] * 8 + 1 for t in self.ids.values())

    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_slot()
