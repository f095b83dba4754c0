"""weight_sync: fresh weights pushed from the trainer to the engines (docs/weight_sync.md)."""

from __future__ import annotations

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, choice, integer, nonempty_text, port, seconds, size, string_list, text


SETTINGS = {
    "enable": Setting(False, boolean, "trainer: push the weights after every `every` successful optimizer "
                                      "steps; when false the call site costs one flag test"),
    "host": Setting("127.0.0.1", nonempty_text, "rendezvous address: the trainer's TCPStore, where "
                                                 "engine ranks connect (SGLang's master_address)"),
    "port": Setting(0, port, "rendezvous port (SGLang's master_port); required when enabled"),
    "world_size": Setting(2, integer(low=2), "ranks in the update group: 1 trainer + every engine rank"),
    "groups": Setting(None, lambda value: _groups(value), "trainer, nccl / gloo: several update groups, one per "
                      "engine (or engine group), as PORT:WORLD_SIZE[:NAME] items (NAME: group_name; WORLD_SIZE: 1 "
                      "+ that engine's ranks); each update is broadcast on each group in turn, with its own "
                      "checksums and verdict; when set, port and world_size are not read"),
    "group_name": Setting("source_patch_weights", nonempty_text, "the update group's name (SGLang's group_name)"),
    "backend": Setting("auto", choice("auto", "nccl", "gloo", "ipc", "mooncake"),
                       "how updates reach the engines: nccl / gloo broadcast over the update group (auto: nccl "
                       "when CUDA is available, else gloo); ipc: colocated, engines copy from the trainer's "
                       "exported memory (CUDA IPC; shared memory on CPU); mooncake: engines read the trainer's "
                       "registered memory through a Mooncake TransferEngine (docs/weight_sync_backends.md)"),
    "engines": Setting(None, string_list, "trainer, ipc / mooncake: the engines' HTTP URLs "
                       "(http://127.0.0.1:30000,...); each update is posted to each as SGLang's "
                       "update_weights_from_tensor with load_format source_patch"),
    "mooncake_host": Setting("127.0.0.1", nonempty_text, "mooncake: the address this process's "
                             "TransferEngine advertises to its peers (trainer and engines)"),
    "mooncake_metadata": Setting("P2PHANDSHAKE", nonempty_text, "mooncake: where TransferEngines find each "
                                 "other: P2PHANDSHAKE (directly) or a metadata server's URL, e.g. a "
                                 "mooncake_master's http://127.0.0.1:PORT/metadata"),
    "mooncake_protocol": Setting("tcp", choice("tcp", "rdma"), "mooncake: the TransferEngine's transport"),
    "mooncake_device": Setting("", text, "mooncake, rdma: the NICs to use (Mooncake's device names, "
                               "comma-separated; empty: every one found)"),
    # At least 4 KiB (receivers also refuse more than 16,384 buckets: wire.MAX_BUCKETS).
    "bucket_bytes": Setting(512 << 20, size(low=4 << 10), "bytes per bucket; the sender double-buffers two of them "
                            "(512 MiB: the fastest of 128 MiB-1 GiB on two H100, docs/benchmarks.md)"),
    "nccl_ctas": Setting(0, integer(low=0), "trainer, nccl: thread blocks per collective of the update group "
                         "(NCCL's minimum and maximum; 0: NCCL's choice); every rank must use the same (engines: "
                         "NCCL_MIN_CTAS and NCCL_MAX_CTAS in their environment)"),
    "checksum": Setting(True, boolean, "per-bucket checksum (int64 word sum on the device), checked by receivers"),
    "from_buffers": Setting(True, boolean, "trainer: send the parameters that lie in Megatron's contiguous "
                            "parameter buffers (distributed optimizer, no tensor- or expert-parallel "
                            "gather) straight from them: no packing, no per-tensor work per push"),
    "replay_packing": Setting(True, boolean, "trainer, GPU: a bucket packed from the same tensors (same "
                              "addresses, contiguous) as the push before is packed by replaying its copies, "
                              "captured once as a CUDA graph (thread-local capture, nothing allocated): ~10 us of "
                              "host time per bucket instead of ~1 us per tensor"),
    "timeout_s": Setting(300.0, seconds(positive=True), "longest wait for any step of an update (also the first "
                                                  "connection); then the update fails instead of hanging"),
    "overlap": Setting(False, boolean, "trainer, rank 0: a push copies the update into a snapshot of its own "
                       "(one copy of the update's bytes; on a GPU on a side stream after the optimizer step) and "
                       "sends it on a background thread while the step returns; the next push, flush() or close() "
                       "waits for it (at most one in flight) and raises its error"),
    "every": Setting(1, integer(low=1), "trainer: push after every N-th successful optimizer step"),
    "on_error": Setting("log", choice("log", "raise"), "trainer: a failed push is logged and counted "
                                                       "(training continues) or raised from optimizer.step()"),
    "stage": Setting("update", choice("update", "bucket"), "engine: 'update' receives and verifies the whole "
                     "update before loading (a failure changes nothing; memory: one model copy); 'bucket' "
                     "verifies and loads bucket by bucket (memory: two buckets; a failure mid-way leaves "
                     "a partial update, reported as such)"),
    "max_metadata_bytes": Setting(64 << 20, size(low=1), "engine: largest manifest it accepts"),
    "max_update_bytes": Setting(1 << 40, size(low=1), "engine: largest update (sum of tensor bytes) it accepts"),
    "vocab_size": Setting(0, integer(low=0), "trainer: cut padded embedding / output-layer rows to this "
                                             "vocabulary size (0 = send as is)"),
}

def _groups(value) -> list | None:
    """``groups``: PORT:WORLD_SIZE[:NAME] items, checked (canonical: the same strings)."""
    items = string_list(value)
    for item in items or ():
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit():
            raise ValueError(f"expected PORT:WORLD_SIZE[:NAME] items, got {item!r}")
        if not 0 < int(parts[0]) <= 65535 or int(parts[1]) < 2:
            raise ValueError(f"{item!r}: a port 1-65535 and a world size of at least 2")
    ports = [item.split(":")[0] for item in items or ()]
    if len(set(ports)) != len(ports):
        raise ValueError(f"groups: a port named twice ({', '.join(ports)})")
    return items


CAPABILITY = Capability(
    name="weight_sync",
    summary="fresh weights pushed from the trainer to the engines, verified and versioned",
    components={"weight_sync": Component(control="sync", settings=SETTINGS)},
    call_sites={
        "sync": ("weight_sync_attach", "weight_sync_step", "weight_sync_receive", "weight_sync_loaded",
                 "weight_sync_version", "weight_sync_load_request"),
    },
    specs=("weight_sync.yaml",),
    page="weight_sync.md",
)
