"""Weight sync, trainer -> engines, after each optimizer step.

    manifest.py  its declaration: settings, control modules, call sites, specs, docs page
    sync.py      the call sites (attach, step, receive, load_request, loaded, version) and control
    planning.py  what a push sends, planned once per layout
    megatron.py  gathering Megatron's TP/EP-sharded parameters into full tensors
    names.py     Megatron -> Hugging Face / SGLang name and layout mapping
    wire.py      the contract both ends read: manifest, digests, checksums, limits, errors
    link.py      the broadcast backends' update group and its deadlines
    sender.py    packing and the sending end;  receiver.py  the receiving end
    program.py   the packed push, planned once per layout as a program
    copysum.py   its Triton kernels: a copy (packing, an engine's receive) and its checksums in one pass
    backend.py   the backend interface: broadcast.py (nccl, gloo), ipc.py, mooncake.py
    request.py   the engine request of the ipc and mooncake backends
    transport.py the broadcast transport's public API in one import (nothing here imports it)
"""
