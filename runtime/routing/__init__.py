"""MoE routing capture and replay.

    record.py    the versioned safetensors record format, slicing for CP/SP, RouterReplay interop
    megatron.py  capture/replay in Megatron-Core's routers (patches/routing.yaml)
    sglang.py    capture/replay in SGLang's select_experts (patches/routing.yaml)
    align.py     lay rollout routes out as the training batch; routing diffs
"""
