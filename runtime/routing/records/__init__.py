"""The routing record: which experts each token was routed to, per MoE layer, shared by
both sides (docs/routing.md).  Each name is imported from its own module, from the base up:

    file.py           the versioned safetensors file format; RoutingRecordError
    sglang_field.py   SGLang's routed_experts field (base64 int32) <-> tensors
    record.py         RoutingRecord: fields, checks, save/load, from/to SGLang's meta
    slicing.py        a record's slices for Megatron's CP/SP ranks, and back
    router_replay.py  Megatron's RouterReplay <-> records
    describe.py       a record file described; its CLI: python -m source_patch.runtime.routing.records.describe FILE
"""
