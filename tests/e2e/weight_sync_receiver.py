"""The receiving end of the weight-sync transport tests: weight_transport.receive alone,
no SGLang (the SGLang side runs in a real server: tests/test_weight_sync_engine.py).

    python tests/e2e/weight_sync_receiver.py OUT --port P --world-size 2 --updates 3 \
        [--tamper V:K] [--die-after V:K]

Writes OUT.safetensors: after update u, ``u/<engine name>`` for every received tensor.
"""

import argparse
import os

import torch
from safetensors.torch import save_file


GROUP = os.environ.get("SOURCE_PATCH_WEIGHT_SYNC_GROUP_NAME", "source_patch_weights")


def at(flag):
    return tuple(int(x) for x in flag.split(":")) if flag else None


def hooks(cli, current):
    tamper, die = at(cli.tamper), at(cli.die_after)

    def before_verify(bucket, data):
        if die == (current["update"], bucket):
            os._exit(17)
        if tamper == (current["update"], bucket):
            data[:8].bitwise_not_()  # as if corrupted in transit
    return before_verify


def receive(cli):
    from source_patch.runtime.weight_sync import receiver as weight_receiver
    from source_patch.runtime.weight_sync import transport as weight_transport

    group = weight_transport.open_group("127.0.0.1", cli.port, 1, cli.world_size, GROUP, "gloo", 120)
    link = weight_transport.Link(group, 60)
    current = {"update": 0}
    weight_receiver.before_verify = hooks(cli, current)
    out = {}
    for update in range(1, cli.updates + 1):
        current["update"] = update
        for name, tensor in weight_transport.receive(link).tensors:
            out[f"{update}/{name}"] = tensor.clone()
        save_file(out, cli.out + ".safetensors")
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--tamper", help="V:K flip bytes of bucket K of update V as it arrives")
    p.add_argument("--die-after", help="V:K exit when bucket K of update V arrived")
    cli = p.parse_args()
    torch.set_num_threads(1)
    receive(cli)


if __name__ == "__main__":
    main()
