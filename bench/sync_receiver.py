"""The receiving end of overhead_bench.py's "weight sync every step": joins the
trainer's update group as rank 1 on its own GPU and receives every update (the
engine's protocol and checks, without SGLang's load) until it is stopped; then one
line: the updates, bytes and refusals it saw.

    python bench/sync_receiver.py --port PORT [--device cuda:1]   # cpu: over gloo
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the trainer's SOURCE_PATCH_WEIGHT_SYNC_PORT")
    p.add_argument("--device", default="cuda:1")
    p.add_argument("--group", default="source_patch_weights", help="SOURCE_PATCH_WEIGHT_SYNC_GROUP_NAME")
    p.add_argument("--timeout", type=float, default=900.0, help="longest wait for the next update, seconds")
    p.add_argument("--nccl-ctas", type=int, default=0, help="the trainer's SOURCE_PATCH_WEIGHT_SYNC_NCCL_CTAS")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from source_patch.runtime.weight_sync import transport as wt

    counts = {"updates": 0, "bytes": 0, "refused": 0}

    def report(*_):
        print(f"sync receiver: {counts['updates']} updates, {counts['bytes'] / 2**30:.2f} GiB, "
              f"{counts['refused']} refused", flush=True)
        os._exit(0)  # NCCL's teardown can hang on a peer that left (push_engine.py)

    signal.signal(signal.SIGTERM, report)
    link = wt.Link(wt.open_group("127.0.0.1", args.port, 1, 2, args.group,
                                 "nccl" if device.type == "cuda" else "gloo", args.timeout, args.nccl_ctas),
                   args.timeout)
    while not link.broken:
        try:
            update = wt.receive(link)
        except wt.WeightSyncError as exc:
            print(f"sync receiver: {exc}", file=sys.stderr, flush=True)
            if link.broken:  # the trainer is gone
                break
            counts["refused"] += 1
            continue
        counts["updates"] += 1
        counts["bytes"] += update.manifest.total_bytes
        update.close()
    report()


if __name__ == "__main__":
    main()
