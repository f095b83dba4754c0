"""A model builder of your own for ``source-patch replay``: the Megatron twin with one
weight of Megatron layer ``SOURCE_PATCH_TEST_PERTURB`` (1-based, default 2) scaled by
1.01, a divergence the comparator must place there::

    source-patch replay ROLLOUT_DUMPS --checkpoint CKPT --builder tests/e2e/twin_replay.py:perturbed --html r.html

Run as a script it is the replay in this process (``source_patch.runtime.verdict.replay.replay_here``,
the worker of ``source-patch replay``), as tests/test_compare.py runs it::

    SOURCE_PATCH=megatron_cpu,dump SOURCE_PATCH_DUMP_DIR=D \\
        python tests/e2e/twin_replay.py CHECKPOINT ROLLOUT_DUMPS [--perturb LAYER] [--logprobs OUT.json]

--logprobs writes {rid: [log p(token[i] | tokens[:i]) for i >= 1]} of the twin.
"""

import argparse
import json
import os

from source_patch.runtime.verdict import replay
from source_patch.runtime.verdict import twin


def perturbed(checkpoint):
    import torch

    model = twin.build(checkpoint)
    layer = int(os.environ.get("SOURCE_PATCH_TEST_PERTURB", "2"))
    with torch.no_grad():
        model.decoder.layers[layer - 1].self_attention.linear_proj.weight.mul_(1.01)
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("rollout")
    p.add_argument("--perturb", type=int, help="scale a weight of this Megatron layer (1-based) by 1.01")
    p.add_argument("--logprobs", help="write the twin's per-token log-probs here (JSON)")
    cli = p.parse_args()
    if cli.perturb:
        os.environ["SOURCE_PATCH_TEST_PERTURB"] = str(cli.perturb)
    logps = replay.replay_here(cli.rollout, cli.checkpoint, builder=f"{__file__}:perturbed" if cli.perturb else None)
    if cli.logprobs:
        with open(cli.logprobs, "w") as f:
            json.dump(logps, f)


if __name__ == "__main__":
    main()
