"""One rank of a two-rank Megatron-Core trainer (expert parallel 2 over gloo) fed by an
SGLang rollout, as an RL loop runs it: tests/test_verdict_e2e.py starts two of these.

    SOURCE_PATCH=megatron_cpu,routing,dump python tests/e2e/verdict_trainer.py PLAN.json \
        --checkpoint CKPT --rank R --world 2 --store STORE --replay ours|megatron|off --out RESULT.json

CKPT: the Qwen3-MoE checkpoint SGLang serves.  The rank imports Megatron-Core, joins the
group and builds the twin first, then waits (``--wait`` seconds) for PLAN.json, which
the test writes (whole, by a rename) from the engine's /generate replies once the
rollout is done, so the trainer's start overlaps the engine's:

    {"routes": the folder of the engine's routing records (rank<R>/<rid>.safetensors),
     "seq_len": the padded row length (equal on every rank: the allgather dispatcher
                gathers equal shapes),
     "samples": [{"rid", "prompt_ids", "output_ids"}, ...]  (the engine's replies),
     "micro_batches": [[[rid, rid], [rid, rid]], ...]       (per rank: its micro-batches)}

The twin of the checkpoint (source_patch.runtime.verdict.twin: experts split over the
two EP ranks, each rank loading its own) runs, through ``get_forward_backward_func()``,
a forward-only pass (old log-probs) and then a forward-backward pass over the rank's
micro-batches: each one a ``[b, seq_len]`` right-padded batch of its samples (prompt +
response), labels the next token, the loss on the response tokens.  Inside
``forward_step_func`` each micro-batch's rows are named with one call,
``source_patch.batch(rids, prompt_lengths, response_lengths, layout="padded",
seq_len=seq_len, input_ids=tokens)``, so the dumps pair with the rollout's by (request, position).

``--replay``:
  ours      source-patch's routing replay (the routing spec in mode replay, given the
            engine's request records by ``replay.set_requests(folder)``): aligned to
            each named micro-batch by the runtime;
  megatron  Megatron-Core's own ``RouterReplay`` (``moe_enable_routing_replay=True``),
            fed here per micro-batch as verl / NeMo-RL feed it: the engine's routes laid
            out as the batch is, ``[seq_len * b, topk]`` seq-major per layer (padding and
            the last generated token, which the engine never routed, get filler experts);
            the routing spec is whatever SOURCE_PATCH_ROUTING_MODE says (capture or off);
  off       the twin routes by itself.

RESULT.json: per (phase, micro-batch, Megatron layer) the experts each router chose for
every token of the ``[s, b]`` layout (sorted, seq-major), the losses per pass, the
log-probs of the forward-only pass and of the forward-backward pass, the dump folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

for _message in (".*Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "`torch.distributed.(all_gather|reduce_scatter)",
                 "When using async grad allreduce"):
    warnings.filterwarnings("ignore", message=_message)

import torch  # noqa: E402

try:
    from source_patch import batch as sp_batch  # noqa: E402
except ImportError:  # an install from before the package's root module
    from source_patch.runtime.core.rows import batch as sp_batch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for PLAN.json")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", required=True, help="a torch.distributed FileStore path shared by the ranks")
    p.add_argument("--replay", choices=("ours", "megatron", "off"), default="ours")
    p.add_argument("--out", required=True, help="this rank's RESULT.json")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the batch


def micro_batch(samples: dict, rids: list, seq_len: int) -> dict:
    """``[b, seq_len]`` right-padded tokens of ``rids``, labels the next token, the loss on
    the response's tokens (each predicted from the token before it)."""
    b = len(rids)
    tokens = torch.zeros(b, seq_len + 1, dtype=torch.long)
    mask = torch.zeros(b, seq_len)
    for row, rid in enumerate(rids):
        s = samples[rid]
        ids = s["prompt_ids"] + s["output_ids"]
        tokens[row, :len(ids)] = torch.tensor(ids)
        mask[row, len(s["prompt_ids"]) - 1:len(ids) - 1] = 1.0
    return {"rids": list(rids), "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq_len).expand(b, seq_len).contiguous(), "loss_mask": mask,
            "prompt_lengths": [len(samples[r]["prompt_ids"]) for r in rids],
            "response_lengths": [len(samples[r]["output_ids"]) for r in rids]}


def megatron_routes(records: dict, mb: dict, seq_len: int, layers: int, topk: int, experts: int) -> list:
    """The engine's routes of a micro-batch for Megatron's ``RouterReplay.set_replay_data``:
    per router (layer order), ``[seq_len * b, topk]`` int64, token ``s * b + row`` (the
    router's ``[s, b]`` flattened seq-major) position ``s`` of sample ``row``.  A record
    holds a request's routed tokens from position 0 (cached prefix included: SGLang's
    capture is keyed by KV slot), one short of its length (the last sampled token was
    never fed back); those and the padding get distinct filler experts, spread as
    routing/align.py's ``spread`` filler."""
    b = len(mb["rids"])
    flat = torch.arange(seq_len * b)
    filler = (flat[:, None] * topk + torch.arange(topk)[None, :]) % experts
    out = []
    for layer in range(layers):  # SGLang's layer_id: Megatron's layer_number - 1
        ids = filler.clone().reshape(seq_len, b, topk)
        for row, rid in enumerate(mb["rids"]):
            routed = records[rid].indices[layer].to(torch.int64)
            length = mb["prompt_lengths"][row] + mb["response_lengths"][row]
            if not length - 1 <= routed.shape[0] <= length:
                raise SystemExit(f"error: request {rid!r}: a routing record of {routed.shape[0]} tokens for a "
                                 f"sample of {length}")
            ids[:routed.shape[0], row] = routed
        out.append(ids.reshape(seq_len * b, topk).contiguous())
    return out


def wait_for(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"error: no {path} after {timeout:g} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    return loss, {"loss": loss.detach(), "logps": (-losses).detach()}


# --------------------------------------------------------------------------- the rank


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(args.store, args.world),
                                         rank=args.rank, world_size=args.world)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from source_patch.runtime.dump import api as dump
    from source_patch.runtime.routing.megatron import control as routing
    from source_patch.runtime.routing.megatron import replay as routing_replay
    from source_patch.runtime.routing.sglang.files import merge_rank_files
    from source_patch.runtime.verdict import twin

    ps.initialize_model_parallel(expert_model_parallel_size=args.world)
    if not dump.state()["enabled"]:
        sys.exit("error: dumping is off: the dump spec did not start (SOURCE_PATCH=megatron_cpu,routing,dump?)")

    checkpoint = args.checkpoint
    hf = twin.hf_config(checkpoint)
    torch.manual_seed(0)
    model = twin.build(checkpoint, moe_enable_routing_replay=args.replay == "megatron").train()
    config = model.config
    layers, topk, experts = config.num_layers, config.moe_router_topk, config.num_moe_experts

    plan = wait_for(Path(args.plan), args.wait)
    records = merge_rank_files(plan["routes"])  # {rid: RoutingRecord} of the engine
    if args.replay == "ours":
        if routing.state()["config"]["mode"] != "replay":
            routing.configure(mode="replay")
        routing_replay.set_requests(plan["routes"])  # aligned to each micro-batch source_patch.batch names
    elif args.replay == "megatron":
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    seq_len = plan["seq_len"]
    samples = {s["rid"]: s for s in plan["samples"]}
    batches = [micro_batch(samples, rids, seq_len) for rids in plan["micro_batches"][args.rank]]

    chosen: dict = {}
    where = {"phase": None, "mb": 0}

    def keep(router, inputs, output):  # the experts each token went to (routing_map), per router call
        key = f"{where['phase']}/{where['mb']}/{router.layer_number}"
        chosen[key] = [row.nonzero().reshape(-1).tolist() for row in output[1]]

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == layers, (len(routers), layers)
    for router in routers:
        router.register_forward_hook(keep)

    def forward_step(data_iterator, model_):
        mb = next(data_iterator)
        # One call per micro-batch names its rows: the dumps pair by (request, position),
        # and our routing replay (mode replay) aligns the engine's records to this layout.
        sp_batch(mb["rids"], mb["prompt_lengths"], mb["response_lengths"], layout="padded",
                 seq_len=seq_len, input_ids=mb["tokens"])
        if args.replay == "megatron":  # the framework's own R3: fed per micro-batch, as verl does
            RouterReplay.clear_global_indices()
            RouterReplay.set_replay_data(megatron_routes(records, mb, seq_len, layers, topk, experts))
        output = model_(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])

        def loss(output_tensor):
            where["mb"] += 1
            return loss_func(mb["loss_mask"], output_tensor)
        return output, loss

    result = {"rank": args.rank, "replay": args.replay, "ep": ps.get_expert_model_parallel_world_size(),
              "dp": ps.get_data_parallel_world_size(), "hf_layers": hf["num_hidden_layers"], "losses": {},
              "logps": {}}
    model.zero_grad()
    for forward_only in (True, False):  # old log-probs, then the training pass
        phase = "fwd_only" if forward_only else "fwd_bwd"
        where.update(phase=phase, mb=0)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=batches[0]["tokens"].shape[0],
            forward_only=forward_only)
        result["losses"][phase] = [float(x["loss"]) for x in out]
        result["logps"][phase] = [x["logps"].tolist() for x in out]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    result["grads"] = len(grads)
    result["grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads)
    if args.replay == "megatron":
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    dump.flush()
    torch.distributed.barrier()
    result.update(chosen=chosen, exp_dir=dump.state()["exp_dir"], routing=routing.state()["counters"],
                  routing_mode=routing.state()["config"]["mode"],
                  batches=[{"rids": mb["rids"], "prompt_lengths": mb["prompt_lengths"],
                            "response_lengths": mb["response_lengths"]} for mb in batches])
    Path(args.out).write_text(json.dumps(result))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
