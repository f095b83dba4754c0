"""An engine rank for the overlapped-push and several-group tests: the transport's
receiving end (receiver.receive, stage "update", as tests/e2e/weight_sync_receiver.py;
no SGLang) as one rank of an update group, standing for an engine that serves what it
loaded while the next update is on the wire.

    python tests/e2e/weight_sync_group_receiver.py OUT --port P --rank R --world-size W \
        [--group-name NAME] --updates N [--tamper V:K] [--poll]

The "engine" loads each received update (already verified: stage "update") into its
served weights and then serves its version, inside a lock standing for SGLang's
weight-update session (no request is served while it loads).  --poll: a thread reads the
served version and a few served weights all the time, as requests would, and records
what it read.  Writes OUT.safetensors (``v/<engine name>`` of every version loaded;
``poll/i/<engine name>``: what poll i read) and OUT.json (per update: version or error,
the bytes this rank received on the group, the served version when it arrived; the
polls' versions).
"""

import argparse
import json
import os
import threading
import time

import torch
from safetensors.torch import save_file


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--group-name", default="source_patch_weights")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--tamper", help="V:K flip bytes of bucket K of update V as it arrives")
    p.add_argument("--poll", action="store_true")
    cli = p.parse_args()
    torch.set_num_threads(1)
    from source_patch.runtime.weight_sync import receiver as weight_receiver
    from source_patch.runtime.weight_sync import transport as wt

    group = wt.open_group("127.0.0.1", cli.port, cli.rank, cli.world_size, cli.group_name, "gloo", 120)
    link = wt.Link(group, 60)
    current = {"update": 0}
    tamper = tuple(int(x) for x in cli.tamper.split(":")) if cli.tamper else None

    def before_verify(bucket, data):
        if tamper == (current["update"], bucket):
            data[:8].bitwise_not_()  # as if corrupted in transit
    weight_receiver.before_verify = before_verify

    session = threading.Lock()  # SGLang's weight-update session: no request is served while loading
    served = {"version": None, "weights": {}}
    polls, stop = [], threading.Event()

    def poll():  # requests: the served version and a few of its weights, all the time
        while not stop.is_set() and len(polls) < 400:
            with session:
                version, weights = served["version"], served["weights"]
                if version is not None:
                    names = sorted(weights)[:: max(1, len(weights) // 6)]
                    polls.append((version, {n: weights[n].clone() for n in names}))
            time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True) if cli.poll else None
    if poller is not None:
        poller.start()
    out, updates = {}, []
    for update in range(1, cli.updates + 1):
        current["update"] = update
        before = link.broadcast_bytes
        try:
            got = wt.receive(link)
            tensors = [(name, tensor.clone()) for name, tensor in got.tensors]
        except Exception as exc:  # noqa: BLE001 - refused: the engine keeps what it serves
            updates.append({"update": update, "error": f"{type(exc).__name__}: {exc}",
                            "bytes": link.broadcast_bytes - before, "served": served["version"]})
            continue
        with session:  # loaded, then served
            served["weights"] = dict(tensors)
            served["version"] = got.version
        for name, tensor in tensors:
            out[f"{got.version}/{name}"] = tensor
        updates.append({"update": update, "version": got.version, "bytes": link.broadcast_bytes - before,
                        "buckets": got.manifest.buckets, "total_bytes": got.manifest.total_bytes})
    stop.set()
    if poller is not None:
        poller.join()
    for i, (version, weights) in enumerate(polls):
        for name, tensor in weights.items():
            out[f"poll/{i}/{version}/{name}"] = tensor
    save_file(out, cli.out + ".safetensors")
    with open(cli.out + ".json", "w") as f:
        json.dump({"updates": updates, "polls": [v for v, _ in polls]}, f)
    os._exit(0)


if __name__ == "__main__":
    main()
