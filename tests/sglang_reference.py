"""What transformers' Qwen3MoeForCausalLM computes on the engine's checkpoint: the
independent reference for the real-engine tests (greedy tokens, per-layer values)."""

import torch


def greedy(model, prompt: list, new_tokens: int) -> list:
    """Greedy continuation of ``prompt`` (fp32, no cache: slow but plain)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def activations(model, tokens: list) -> dict:
    """Per-token values at the points the dump spec records, for one sequence:
    ``layer_input[i]``, ``attention_output[i]``, ``mlp_output[i]``, ``router_logits[i]``
    (``[tokens, ...]``), ``final_hidden`` and ``logits``."""
    out, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks += [
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(("attention_output", i), o[0][0])),
            layer.mlp.register_forward_hook(
                lambda m, a, o, i=i: out.__setitem__(("mlp_output", i), (o[0] if isinstance(o, tuple) else o)[0])),
            layer.mlp.gate.register_forward_hook(
                lambda m, a, o, i=i: out.__setitem__(("router_logits", i), o[0] if isinstance(o, tuple) else o)),
        ]
    try:
        with torch.no_grad():
            result = model(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    for i in range(len(model.model.layers)):
        out[("layer_input", i)] = result.hidden_states[i][0]
        out[("router_logits", i)] = out[("router_logits", i)].reshape(len(tokens), -1)
    out[("final_hidden", None)] = result.hidden_states[-1][0]
    out[("logits", None)] = result.logits[0]
    return out


def wait_for(records_of, predicate, timeout=20.0):
    """Records (re-read) until ``predicate`` holds: the writer is asynchronous."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = records_of()
        if predicate(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def request_records(dumps, rid):
    """{step: (mode, row mask, {(name, layer): tensor})} of the forward passes that served ``rid``."""
    from source_patch.runtime.dump import reader

    records = reader.load(dumps)
    maps = [r for r in records if r.name == "row_request" and rid in r.tags["rids"]]
    out = {}
    for rows in maps:
        step = rows.tags["step"]
        mask = rows.tensor == rows.tags["rids"].index(rid)
        values = {(r.name, r.tags.get("layer")): r.tensor for r in records if r.tags["step"] == step}
        out[step] = (rows.tags["forward_mode"], mask, values)
    return out
