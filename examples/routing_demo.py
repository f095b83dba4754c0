"""Watch Megatron-Core's MoE router choose experts, through a source patch.

    SOURCE_PATCH=megatron_topk python examples/routing_demo.py

The shipped spec patches megatron.core.transformer.moe.moe_utils as it imports:
after each place where the top-k experts are computed it emits them as an event.
Megatron itself is unmodified; nothing here monkey-patches it.
"""

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
from megatron.core.transformer.moe import moe_utils

from source_patch.runtime import capture

if not getattr(moe_utils, "__source_patches__", None):
    sys.exit("moe_utils is not patched: run with SOURCE_PATCH=megatron_topk "
             f"(SOURCE_PATCH is {os.environ.get('SOURCE_PATCH')!r})")
print("patched:", ", ".join(f"{a.spec}/{a.patch} -> {a.target}" for a in moe_utils.__source_patches__))

torch.manual_seed(0)
tokens, experts, k = 8, 8, 2
logits = torch.randn(tokens, experts)
for score_function in ("softmax", "sigmoid"):
    with capture("megatron.topk") as events:
        probs, routing_map = moe_utils.topk_routing_with_score_function(
            logits, k, score_function=score_function)
    (event,) = events
    chosen = event.value
    # The captured indices are exactly the experts Megatron's routing map selected.
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, chosen, True))
    print(f"\n{score_function}: top-{k} experts per token (captured inside Megatron)")
    for t in range(tokens):
        weights = ", ".join(f"e{e}={probs[t, e]:.2f}" for e in chosen[t].tolist())
        print(f"  token {t}: {weights}")
print("\nok: captured routing matches Megatron's routing map")
