"""Engine side of the weight-sync end-to-end test: SGLang's own weight-update code on CPU.

    SOURCE_PATCH=weight_sync_sglang python tests/e2e/weight_sync_engine.py OUT \
        --port P --world-size 2 --updates 3 [--tamper V:K] [--die-after V:K] [--bare]

Real SGLang: Qwen3MoeForCausalLM (tests/e2e/weight_sync_models.py) with its
load_weights, the runner-side WeightUpdater (init_weights_update_group,
receive_weights_from_distributed, load_weights_from_distributed, begin/end) and
the scheduler-side SchedulerWeightUpdaterManager (the begin/update/end session
protocol and the weight_version record), patched by weight_sync_sglang.  Stand-ins,
because no scheduler process or model runner runs here: the scheduler (records
the version), the TP worker (lists the one runner) and the cache flush.

Each update is what an orchestrator does over HTTP: begin_weight_update,
update_weights_from_distributed(load_format="source_patch"), end_weight_update.
Writes OUT.safetensors (after update u: ``u/<SGLang parameter>``) and OUT.json
(per update: success, message, engine_state(), the version SGLang recorded, seconds).

--bare: no SGLang, only weight_transport.receive (a cheap peer for tests about the
trainer side); OUT.safetensors then holds the received tensors under their names.
"""

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

import weight_sync_models as models  # tests/e2e/


GROUP = os.environ.get("SOURCE_PATCH_WEIGHT_SYNC_GROUP_NAME", "source_patch_weights")


class Scheduler:
    """Stand-in for the scheduler: keeps the weight version SGLang records."""

    def __init__(self):
        self.weight_version = None

    def record_weight_version_change(self, new_version):
        self.weight_version = new_version


def at(flag):
    return tuple(int(x) for x in flag.split(":")) if flag else None


def hooks(cli, current):
    tamper, die = at(cli.tamper), at(cli.die_after)

    def before_verify(bucket, data):
        if die == (current["update"], bucket):
            os._exit(17)
        if tamper == (current["update"], bucket):
            data[:8].bitwise_not_()  # as if corrupted in transit
    return before_verify


def bare(cli):
    from source_patch.runtime.weights import transport as weight_transport

    group = weight_transport.open_group("127.0.0.1", cli.port, 1, cli.world_size, GROUP, "gloo", 120)
    link = weight_transport.Link(group, 60)
    current = {"update": 0}
    weight_transport.before_verify = hooks(cli, current)
    out = {}
    for update in range(1, cli.updates + 1):
        current["update"] = update
        for name, tensor in weight_transport.receive(link).tensors:
            out[f"{update}/{name}"] = tensor.clone()
        save_file(out, cli.out + ".safetensors")
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--tamper", help="V:K flip bytes of bucket K of update V as it arrives")
    p.add_argument("--die-after", help="V:K exit when bucket K of update V arrived")
    p.add_argument("--bare", action="store_true")
    cli = p.parse_args()
    torch.set_num_threads(1)
    if cli.bare:
        return bare(cli)

    models.sglang_on_cpu()
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput, EndWeightUpdateReqInput, UpdateWeightsFromDistributedReqInput)
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from source_patch.runtime.weights import sync as weight_sync
    from source_patch.runtime.weights import transport as weight_transport

    model = models.sglang_model("qwen3_moe")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(math.nan)  # a parameter no update writes stays NaN
    updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
        get_model=lambda: model, update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    runner = SimpleNamespace(weight_updater=updater)
    scheduler = Scheduler()
    manager = SchedulerWeightUpdaterManager(
        tp_worker=SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)]),
        draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **kw: True,
        is_fully_idle=lambda **kw: True, scheduler=scheduler)

    ok, message = updater.init_weights_update_group(
        master_address="127.0.0.1", master_port=cli.port, rank_offset=1, world_size=cli.world_size,
        group_name=GROUP, backend="gloo")
    if not ok:
        sys.exit(f"init_weights_update_group: {message}")

    current = {"update": 0}
    weight_transport.before_verify = hooks(cli, current)
    out, report = {}, []
    for update in range(1, cli.updates + 1):
        current["update"] = update
        start = time.monotonic()
        assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
        result = manager.update_weights_from_distributed(UpdateWeightsFromDistributedReqInput(
            names=[], dtypes=[], shapes=[], group_name=GROUP, load_format="source_patch"))
        assert manager.end_weight_update(EndWeightUpdateReqInput()).success
        report.append({"success": result.success, "message": result.message,
                       "state": weight_sync.engine_state(), "sglang_version": scheduler.weight_version,
                       "seconds": round(time.monotonic() - start, 3)})
        for name, param in model.named_parameters():
            out[f"{update}/{name}"] = param.detach().clone()
        save_file(out, cli.out + ".safetensors")
        with open(cli.out + ".json", "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
