"""Routing capture and replay in Megatron-Core's routers (patches/routing.yaml, the
Megatron side; docs/routing_megatron.md):

    control.py  control (configure, state, save, ...), the call sites and the per-step
                position (step, microbatch, layer) both sides share
    capture.py  host copies, pending records, background saver, index.json
    replay.py   records to replay, sliced for this rank, staged on the device
    files.py    the on-disk layout (rank folders, index.json), RoutingReplayError
"""
