"""The broadcast transport's public API in one import (torch only, usable without the
rest of weight sync; docs/weight_sync.md, API).  Nothing in the runtime imports this
module: each name is defined along the protocol, and the runtime imports it there:

    wire.py      the contract both ends read: manifest, digests, checksums, limits, errors
    link.py      the process group and its deadlines (nccl / gloo), LoopbackLink
    sender.py    packing and the sending end
    receiver.py  the receiving end

    group = open_group("10.0.0.1", 29600, rank, world_size, "source_patch_weights", "nccl", 300)
    link = Link(group, timeout_s=300)
    send(link, plan(specs, bucket_bytes=512 << 20, version=7), tensors)  # rank 0
    send(link, *plan_buffers(named_views, 512 << 20, 7))                  # or from the buffers themselves
    update = receive(link)                                               # engine ranks
    model.load_weights(update.tensors)

Test hooks, limits and internals are the owning module's: set and reach them there
(``sender.after_send``, ``receiver.before_verify``, ``wire.MAX_TENSORS``).
"""

from __future__ import annotations

from .link import Link, LoopbackLink, close_group, open_group, rendezvous_store
from .receiver import Update, receive
from .sender import send
from .wire import (ALIGN, CHECKSUM_MISMATCH, DTYPES, FORMAT, MAGIC, MANIFEST_FORMAT, MAX_BUCKETS, MAX_LAYOUTS,
                   MAX_TENSORS, NEED_MANIFEST, OK, REJECTED, ROW, Buffers, ChecksumMismatch, Entry, Manifest,
                   ManifestError, WeightSyncError, WeightSyncTimeout, handshake_row, layout_digest, layout_verdict,
                   plan, plan_buffers, tensors_digest, too_many_buckets)

__all__ = ["ALIGN", "CHECKSUM_MISMATCH", "DTYPES", "FORMAT", "MAGIC", "MANIFEST_FORMAT", "MAX_BUCKETS", "MAX_LAYOUTS",
           "MAX_TENSORS", "NEED_MANIFEST", "OK", "REJECTED", "ROW", "Buffers", "ChecksumMismatch", "Entry", "Link",
           "LoopbackLink", "Manifest", "ManifestError", "Update", "WeightSyncError", "WeightSyncTimeout",
           "close_group", "handshake_row", "layout_digest", "layout_verdict", "open_group", "plan", "plan_buffers",
           "receive", "rendezvous_store", "send", "tensors_digest", "too_many_buckets"]
