"""Megatron-Core's own schedule with ``source_patch.batch`` naming each micro-batch's rows.

    SOURCE_PATCH=megatron_cpu,dump[,routing] python tests/e2e/batch_schedule.py OUT [--feed inside|before]
        [--replay REQUESTS_DIR] [--steps N] [--micro-batches M] [--packed]

The tiny GPT-MoE of examples/train_moe.py (2 MoE layers, 8 experts, top-2) on CPU; each
step runs a forward-only pass (old log-probs, ``forward_only=True``) and a
forward-backward pass over the same micro-batches through ``get_forward_backward_func()``,
then the optimizer step, as miles does.  Every micro-batch holds 3 requests of different
prompt and response lengths, right-padded to 16 tokens (``--packed``: back to back in
one row of 48 tokens, as THD).  ``--feed inside``: ``batch()`` is called in
``forward_step_func``; ``before``: once per micro-batch before each pass.

``--replay DIR``: SGLang-style request records (``token_order="requests"``, layer ids
0-based, one token short) are written there for every request, with random experts,
and routing replay (our runtime, mode replay) is given them; each router's routing map
is recorded with a forward hook.  Writes OUT.json: the request ids and lengths per
(step, microbatch), and with --replay the routers' chosen experts per (step, phase,
microbatch, layer).
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

from example import train_moe  # tests/e2e/example.py

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

try:
    from source_patch import batch as sp_batch
except ImportError:  # an install from before the root package (pyproject: "source_patch" = ".")
    from source_patch.runtime.core.rows import batch as sp_batch

SEQ, SAMPLES, EXPERTS, TOPK, LAYERS = 16, 3, 8, 2, 2


def requests(step: int, mb: int, gen: torch.Generator) -> list:
    out = []
    for i in range(SAMPLES):
        prompt = int(torch.randint(2, 7, (1,), generator=gen))
        response = int(torch.randint(1, SEQ - prompt + 1, (1,), generator=gen))
        tokens = torch.randint(1, 128, (prompt + response,), generator=gen).tolist()
        out.append({"rid": f"req-{step}-{mb}-{i}", "prompt": prompt, "response": response, "tokens": tokens})
    return out


def micro_batch(reqs: list, packed: bool) -> dict:
    """Inputs, labels and loss mask of one micro-batch; padded [b, SEQ] or packed [1, t]."""
    if packed:
        tokens = torch.tensor([t for r in reqs for t in r["tokens"]] + [0] * (SAMPLES * SEQ - sum(
            len(r["tokens"]) for r in reqs))).unsqueeze(0)
        positions = torch.cat([torch.arange(len(r["tokens"])) for r in reqs]
                              + [torch.arange(SAMPLES * SEQ - sum(len(r["tokens"]) for r in reqs))]).unsqueeze(0)
    else:
        tokens = torch.zeros(len(reqs), SEQ, dtype=torch.long)
        for row, r in enumerate(reqs):
            tokens[row, :len(r["tokens"])] = torch.tensor(r["tokens"])
        positions = torch.arange(SEQ).expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    return {"tokens": tokens, "position_ids": positions, "labels": labels,
            "loss_mask": (tokens > 0).float(), "reqs": reqs}


def name_rows(mb: dict, packed: bool, microbatch=None):
    reqs = mb["reqs"]
    kw = {"layout": "packed", "seq_len": SAMPLES * SEQ} if packed else {"seq_len": SEQ}
    return sp_batch([r["rid"] for r in reqs], [r["prompt"] for r in reqs], [r["response"] for r in reqs],
                    input_ids=mb["tokens"], microbatch=microbatch, **kw)


def write_requests(folder: Path, all_reqs: list, seed: int = 7) -> dict:
    """SGLang-style request records of random routes: {rid: RoutingRecord}."""
    from source_patch.runtime.routing.records.record import RoutingRecord

    gen = torch.Generator().manual_seed(seed)
    out = {}
    (folder / "rank0").mkdir(parents=True, exist_ok=True)
    for r in all_reqs:
        n = len(r["tokens"]) - 1  # SGLang never forwards the last sampled token
        indices = {layer: torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(n)])
                   for layer in range(LAYERS)}  # 0-based, as SGLang's layer_id
        rec = RoutingRecord(indices=indices, num_experts=EXPERTS, token_order="requests",
                            sample_ids=[r["rid"]], seq_lens=[n], source="sglang")
        rec.save(folder / "rank0" / f"{r['rid']}.safetensors")
        out[r["rid"]] = rec
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--feed", choices=("inside", "before"), default="inside")
    p.add_argument("--replay", metavar="DIR")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--packed", action="store_true")
    cli = p.parse_args()
    args = train_moe.parse_args(["--steps", str(cli.steps), "--micro-batches", str(cli.micro_batches),
                                 "--device", "cpu", "--layers", str(LAYERS), "--experts", str(EXPERTS),
                                 "--topk", str(TOPK), "--seq-len", str(SAMPLES * SEQ if cli.packed else SEQ),
                                 "--micro-batch", str(1 if cli.packed else SAMPLES)])
    device = torch.device("cpu")
    torch.set_num_threads(1)
    train_moe.init_distributed(device, args.ep)
    torch.manual_seed(args.seed)
    model = train_moe.build_model(args, device)
    optimizer = train_moe.build_optimizer(model, args)
    gen = torch.Generator().manual_seed(1234)
    data = {(s, m): requests(s, m, gen) for s in range(cli.steps) for m in range(cli.micro_batches)}

    routes: dict = {}
    where = {"step": 0, "phase": None, "mb": 0}
    if cli.replay:
        from megatron.core.transformer.moe.router import TopKRouter

        from source_patch.runtime.routing.megatron import control as routing

        write_requests(Path(cli.replay), [r for reqs in data.values() for r in reqs])
        routing.configure(mode="replay", dir=cli.replay)  # a folder of request records
        for module in model.module.modules():
            if isinstance(module, TopKRouter):
                def hook(m, inputs, out):
                    key = f"{where['step']}/{where['phase']}/{where['mb']}/{m.layer_number}"
                    routes[key] = [sorted(row.nonzero().reshape(-1).tolist()) for row in out[1]]
                module.register_forward_hook(hook)

    def forward_step(data_iterator, model_):
        mb = next(data_iterator)
        if cli.feed == "inside":
            name_rows(mb, cli.packed)
        output = model_(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])

        def loss(output_tensor):
            where["mb"] += 1
            return train_moe.loss_func(mb["loss_mask"], output_tensor)
        return output, loss

    for step in range(cli.steps):
        batches = [micro_batch(data[(step, m)], cli.packed) for m in range(cli.micro_batches)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for forward_only in (True, False):
            where.update(step=step, phase="fwd_only" if forward_only else "fwd_bwd", mb=0)
            if cli.feed == "before":
                for mb in batches:
                    name_rows(mb, cli.packed)
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=cli.micro_batches, seq_length=args.seq_len, micro_batch_size=args.micro_batch,
                forward_only=forward_only)
        success, _, _ = optimizer.step()
        assert success
    from source_patch.runtime.dump import api as dump

    dump.flush()
    Path(f"{cli.out}.json").write_text(json.dumps({
        "requests": {f"{s}/{m}": reqs for (s, m), reqs in data.items()}, "routes": routes,
        "exp_dir": dump.state()["exp_dir"]}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
