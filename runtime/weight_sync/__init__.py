"""Weight sync, trainer -> engines, after each optimizer step.

    sync.py      the call sites (attach, step, receive, loaded, version)
    transport.py bucketed, double-buffered, checksummed transfer with a JSON manifest
    megatron.py  gathering Megatron's TP/EP-sharded parameters into full tensors
    names.py     Megatron -> Hugging Face / SGLang name and layout mapping
"""
