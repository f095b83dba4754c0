"""Replay a rollout's tokens through the Megatron twin with the dump spec active.

    SOURCE_PATCH=megatron_cpu,dump SOURCE_PATCH_DUMP_DIR=D \
        python tests/e2e/twin_replay.py CHECKPOINT ROLLOUT_DUMPS [--perturb LAYER] [--logprobs OUT.json]

Each request of the rollout (its tokens read back from the rollout's input_ids /
positions / row_request dumps) is one forward pass of the twin, one dump step, with
row_request / positions / input_ids records in the activations' [s, b] layout, so
source_patch.runtime.dump.compare can pair every row.  --perturb L scales one weight
of Megatron layer L (1-based) by 1.01: a divergence the comparator must place there.
--logprobs writes {rid: [log p(token[i] | tokens[:i]) for i >= 1]} of the twin.
"""

import json

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from source_patch.runtime.dump import api as dump
from source_patch.runtime.dump import compare
from source_patch.runtime.dump.logprobs import token_logprobs
from source_patch.runtime.weights import twin


def sequences(rollout) -> dict:
    """{rid: token ids by position} of every row the rollout computed."""
    tokens = {}
    for (rid, position), token in compare.index_rows(compare.load(rollout, ['input_ids', 'positions', 'row_request']))[("input_ids", None)].items():
        tokens.setdefault(rid, {})[position] = int(token)
    return {rid: [by_pos[p] for p in range(len(by_pos))] for rid, by_pos in tokens.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("rollout")
    p.add_argument("--perturb", type=int)
    p.add_argument("--logprobs", help="write the twin's per-token log-probs here (JSON)")
    cli = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model = twin.build(cli.checkpoint)
    if cli.perturb:
        with torch.no_grad():
            model.decoder.layers[cli.perturb - 1].self_attention.linear_proj.weight.mul_(1.01)
    dump.dump_context(phase="fwd_only")
    logps = {}
    for step, (rid, tokens) in enumerate(sorted(sequences(cli.rollout).items())):
        dump.dump_step(step=step)
        column = torch.tensor(tokens).unsqueeze(1)  # [s, b=1], Megatron's layout
        dump.dump("input_ids", column)
        dump.dump("positions", torch.arange(len(tokens)).unsqueeze(1))
        dump.dump("row_request", torch.zeros_like(column, dtype=torch.int32), rids=[rid])
        out = twin.logits(model, [tokens])[0]
        logps[rid] = token_logprobs(out[:-1], torch.tensor(tokens[1:], dtype=torch.long)).tolist()
    dump.flush()
    if cli.logprobs:
        with open(cli.logprobs, "w") as f:
            json.dump(logps, f)


if __name__ == "__main__":
    main()
