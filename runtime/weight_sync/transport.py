"""The broadcast transport's names in one place, as they were before the split
(scripts, benches and tests import them from here).  The code lives along the
protocol:

    wire.py      the contract both ends read: manifest, digests, checksums, limits, errors
    link.py      the process group and its deadlines (nccl / gloo), LoopbackLink
    sender.py    packing and the sending end
    receiver.py  the receiving end
    backend.py   the backend interface and one module per backend (broadcast.py, ipc.py, mooncake.py)

    group = open_group("10.0.0.1", 29600, rank, world_size, "source_patch_weights", "nccl", 300)
    link = Link(group, timeout_s=300)
    send(link, plan(specs, bucket_bytes=512 << 20, version=7), tensors)  # rank 0
    send(link, *plan_buffers(named_views, 512 << 20, 7))                  # or from the buffers themselves
    update = receive(link)                                               # engine ranks
    model.load_weights(update.tensors)

Test hooks and limits are the owning module's globals (``sender.after_send``,
``receiver.before_verify``, ``wire.MAX_TENSORS``): set them there.
"""

from __future__ import annotations

from .link import Link, LoopbackLink, close_group, open_group, rendezvous_store  # noqa: F401
from .receiver import Update, _BucketPlan, _manifest, _Staged, _Streamed, receive  # noqa: F401
from .sender import _Packing, _Replays, _Spans, send  # noqa: F401
from .wire import (ALIGN, CHECKSUM_MISMATCH, DTYPES, FORMAT, MAGIC, MANIFEST_FORMAT, MAX_BUCKETS,  # noqa: F401
                   MAX_LAYOUTS, MAX_TENSORS, NEED_MANIFEST, OK, REJECTED, ROW, Buffers, ChecksumMismatch, Entry,
                   Manifest, ManifestError, WeightSyncError, WeightSyncTimeout, handshake_row, layout_digest,
                   layout_verdict, plan, plan_buffers, tensors_digest, too_many_buckets)
from .wire import bucket_sum as _bucket_sum  # noqa: F401
from .wire import split_tensors as _split_tensors  # noqa: F401
