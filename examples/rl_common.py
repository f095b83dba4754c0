"""What the RL examples share: examples/rl_loop.py (one process) and examples/rl_ray.py
(Ray actors).

A real SGLang server rolls out (tokens, their log-probs, the weight version served);
the Megatron-Core twin of its checkpoint computes the same tokens' log-probs and
routes, plain or with the engine's routes replayed, takes a REINFORCE-style step on a
toy reward, and the engine joins each weight update over SGLang's own HTTP admin path.
Samples are padded on the right into one ``[batch, seq_len]`` forward (one sample,
unpadded, in rl_loop).  Imported by the examples' scripts (their folder is on the path,
in Ray's workers too).
"""

from __future__ import annotations

from source_patch.testing.sglang import SGLangServer, tiny_checkpoint  # noqa: F401 - the harness, here only

try:
    from source_patch import batch as sp_batch  # one call per micro-batch names its rows
except ImportError:  # an install from before the package's root module
    from source_patch.runtime.core.rows import batch as sp_batch

GROUP = "source_patch_weights"
PROMPTS = [[5, 9, 2, 7, 7, 1], [300, 4, 8], [11, 12, 13, 14]]


def rollout(server, new_tokens: int, prompts=PROMPTS) -> list:
    reply = server.generate(input_ids=prompts, max_new_tokens=new_tokens, return_logprob=True,
                            sampling={"ignore_eos": True, "temperature": 1.0})
    return [{"prompt": p, "output": r["output_ids"], "version": r["meta_info"].get("weight_version"),
             "logps": r["meta_info"]["output_token_logprobs"], "rid": r["meta_info"]["id"]}
            for p, r in zip(prompts, reply)]


def join_update(server, body: dict | None) -> None:
    """The engine's side of one weight update, as an RL framework drives it over HTTP:
    joining the update group first when ``body`` (``/init_weights_update_group``'s) is
    given, then SGLang's begin / update (``load_format: "source_patch"``) / end."""
    if body is not None:
        server.post("/init_weights_update_group", body, timeout=300)
    server.post("/begin_weight_update")
    server.post("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                     "group_name": GROUP, "load_format": "source_patch"},
                timeout=300)
    server.post("/end_weight_update")


def build_trainer(checkpoint, lr: float = 1e-2):
    """The twin of ``checkpoint`` in DDP, its Megatron optimizer (patched: weight sync
    remembers optimizer -> model), and its routers' last routes (:func:`record_routes`).
    Megatron's parallel state must be initialised."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from source_patch.runtime.verdict import twin

    torch.manual_seed(0)
    model = twin.build(checkpoint).train()
    routes = record_routes(model)
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, bf16=False, params_dtype=torch.float32), [ddp])
    return model, ddp, optimizer, routes


def record_routes(model) -> dict:
    """{layer (0-based, as SGLang): routing map of the last forward} from the twin's routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    routes = {}
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(
                lambda m, inputs, out: routes.__setitem__(m.layer_number - 1, out[1].detach()))
    return routes


def seq_len_of(samples) -> int:
    return max(len(s["prompt"]) + len(s["output"]) for s in samples)


def batch_ids(samples, seq_len: int):
    """``[batch, seq_len]`` token ids, right-padded with 0."""
    import torch

    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens = s["prompt"] + s["output"]
        ids[row, :len(tokens)] = torch.tensor(tokens)
    return ids


def twin_logps(model, samples, seq_len: int | None = None) -> list:
    """Each sample's generated tokens' log-probs under the twin (one forward, with the
    graph for backward)."""
    import torch

    from source_patch.runtime.verdict.logprobs import token_logprobs

    seq_len = seq_len or seq_len_of(samples)
    ids = batch_ids(samples, seq_len)
    logits = model(ids, torch.arange(seq_len).expand_as(ids), attention_mask=None)
    out = []
    for row, s in enumerate(samples):
        start, end = len(s["prompt"]), len(s["prompt"]) + len(s["output"])
        out.append(token_logprobs(logits[row, start - 1:end - 1], torch.tensor(s["output"])))
    return out


def name_rows(samples, seq_len: int | None = None):
    """``source_patch.batch`` for a ``[batch, seq_len]`` right-padded forward of ``samples``:
    the dumps get its row map (request ids, positions, token ids), routing replay aligns
    the engine's records to it.  One call per micro-batch."""
    seq_len = seq_len or seq_len_of(samples)
    return sp_batch([s["rid"] for s in samples], [len(s["prompt"]) for s in samples],
                    [len(s["output"]) for s in samples], seq_len=seq_len, input_ids=batch_ids(samples, seq_len))


def replayed_logps(model, samples, records, seq_len: int | None = None, weights: bool = False,
                   grad: bool = False) -> list:
    """:func:`twin_logps` with the engine's routes replayed: ids (weights recomputed
    from the twin's scores, so the router still learns), or ids and the engine's weights.
    ``records``: the engine's routing records of ``samples`` (by request id), aligned by
    the runtime to the batch :func:`name_rows` names (the last generated token, never fed
    back to the engine, has no route: ``missing_tail``)."""
    import torch

    from source_patch.runtime.routing.megatron import control as routing, replay as routing_replay

    seq_len = seq_len or seq_len_of(samples)
    routing_replay.set_requests([r if r.sample_ids == [s["rid"]] else r.replace(sample_ids=[s["rid"]])
                                 for s, r in zip(samples, records)], layer_offset=1, missing_tail=1)
    name_rows(samples, seq_len)
    routing.configure(mode="replay", replay_probs=weights)
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            return twin_logps(model, samples, seq_len)
    finally:
        routing.configure(mode="off")


def same_experts(engine, routes: dict, row: int = 0, batch: int = 1) -> dict:
    """Per layer: [tokens of batch row ``row`` routed to the same set of experts by the
    engine (its record) and the twin (``routes``, tokens ``[seq, batch]`` flattened), tokens compared]."""
    out = {}
    for layer in engine.layers:
        ids = engine.indices[layer]
        mine = routes[layer].reshape(-1, batch, routes[layer].shape[-1])[: len(ids), row]
        same = sum(set(a.tolist()) == set(b.nonzero().reshape(-1).tolist()) for a, b in zip(ids, mine))
        out[layer] = [same, len(ids)]
    return out


def agreement(records, routes: dict) -> dict:
    """:func:`same_experts` summed over a batch: ``records[b]`` is row b's engine record."""
    total = {}
    for row, record in enumerate(records):
        for layer, (same, n) in same_experts(record, routes, row, len(records)).items():
            total[layer] = [a + b for a, b in zip(total.get(layer, [0, 0]), (same, n))]
    return total


def agreement_line(agree: dict) -> str:
    return ", ".join(f"{layer}: {same / n:.1%} of {n}" for layer, (same, n) in sorted(agree.items()))


def reward(tokens: list) -> float:
    """A toy reward: the share of even token ids (what the policy should learn to emit)."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def reinforce_backward(ddp, samples, logps) -> float:
    """Backward of a REINFORCE loss (the generated tokens' log-probs weighted by the
    reward minus the batch's mean reward) and DDP's gradient sync; the mean reward."""
    rewards = [reward(s["output"]) for s in samples]
    baseline = sum(rewards) / len(rewards)
    loss = -sum((r - baseline) * lp.sum() for r, lp in zip(rewards, logps)) / len(samples)
    loss.backward()
    ddp.finish_grad_sync()
    return baseline
