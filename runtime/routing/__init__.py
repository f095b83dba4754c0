"""MoE routing capture and replay.

The record (users import it from ``record.py``; the runtime from each name's own module), from the base up:

    record_file.py      the versioned safetensors file format; RoutingRecordError
    record_sglang.py    SGLang's routed_experts field (base64 int32) <-> tensors
    record_type.py      RoutingRecord: fields, checks, save/load, from/to SGLang's meta
    record_slicing.py   slices for Megatron's CP/SP ranks, and back
    record_megatron.py  Megatron's RouterReplay <-> records
    record.py           the public names, and the inspect CLI

Megatron-Core's routers (patches/routing.yaml; users import ``megatron.py``):

    megatron.py          control, call sites, the per-step position both sides share
    megatron_capture.py  host copies, pending records, background saver, index.json
    megatron_replay.py   records to replay, sliced for this rank, staged on the device
    megatron_files.py    the on-disk layout (rank folders, index.json), RoutingReplayError

SGLang and the way between:

    sglang.py      capture/replay in SGLang's select_experts (patches/routing.yaml)
    slot_store.py  the host store of routes keyed by KV-cache slot (sglang.py's capture)
    align.py       lay rollout routes out as the training batch; routing diffs
"""
