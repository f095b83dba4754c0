"""Megatron twin of an SGLang checkpoint: logits of a few sequences, written to a file.

    SOURCE_PATCH=megatron_cpu python tests/e2e/twin_logits.py CHECKPOINT OUT.safetensors TOKENS_JSON
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from source_patch.runtime.verdict import twin
from source_patch.runtime.weight_sync import names


def main():
    checkpoint, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model = twin.build(checkpoint)
    layout = names.Layout.from_config(model.config)
    # The round trip: every parameter maps back to the checkpoint tensors it came from.
    from safetensors.torch import load_file
    hf = load_file(f"{checkpoint}/model.safetensors")
    for name, param in model.named_parameters():
        for hf_name, tensor in names.to_hf(name, param.detach(), layout):
            assert torch.equal(tensor, hf[hf_name]), hf_name
    save_file({f"logits.{i}": twin.logits(model, [seq])[0].contiguous() for i, seq in enumerate(tokens)}, out)


if __name__ == "__main__":
    main()
