"""Routing capture and replay in SGLang's ``select_experts`` (patches/routing.yaml, the
SGLang side; docs/routing_sglang.md), from the ground floor up:

    slot_store.py  the host store of routes keyed by KV-cache slot
    state.py       the state every module here shares (S), warn_once, the rank
    batch.py       the ambient batch: which request and position each row of a forward is
    capture.py     a forward's routed rows into the slot store; each request's record read back
    replay.py      recorded ids for the batch's rows, and the weights SGLang's top-k gives them
    graphs.py      under SGLang's decode CUDA graphs: staged capture, fed replay
    files.py       record files: written per request, waited for, merged over rank folders
    control.py     the control surface: configure, state, reset, close, the mode in force
    call_sites.py  the call sites (routing_sglang_batch / _topk / _release / _graph_build)
"""
