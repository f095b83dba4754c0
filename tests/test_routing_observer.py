"""Routing capture and replay only observe upstream (issue 30): a call no record can address
is routed by upstream unchanged, with one RuntimeWarning per process and cause.

Real megatron-core on CPU, in a child under SOURCE_PATCH=megatron_cpu,routing (the start hook
patches megatron as it imports, as in tests/test_routing_megatron.py): a TopKRouter built
outside a TransformerLayer (layer_number=None), and a direct call of
topk_routing_with_score_function (upstream's own RouterReplay tests do both), under
capture and under replay, give upstream's exact result and one warning each. A router
with a layer number, run outside any schedule, is recorded one record per forward and
replayed from those records.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r'''
    import json, sys, warnings
    import torch
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing
    from source_patch.runtime.routing.megatron import replay as routing_replay
    from source_patch.runtime.routing.megatron.files import RoutingReplayError

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=8,
                               moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False)
    router = TopKRouter(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    hidden = torch.randn(6, 2, 16)
    logits = torch.randn(12, 8)

    def call(kind):
        if kind == "router":
            return router(hidden)
        return topk_routing_with_score_function(logits, topk=2, use_pre_softmax=False, score_function="softmax")

    def ours(caught):
        return [str(w.message) for w in caught if str(w.message).startswith("source-patch routing")]

    report = {}
    for kind in ("router", "direct"):
        routing.configure(mode="off")
        want = call(kind)
        for mode in ("capture", "replay"):
            routing.reset()
            routing.configure(mode=mode)
            if mode == "replay":
                routing_replay.set_replay({})  # strict where a record could address a call: none here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = [call(kind) for _ in range(3)]
            same = all(torch.equal(g[0], want[0]) and torch.equal(g[1], want[1]) for g in got)
            report[f"{kind}/{mode}"] = {"same": same, "warnings": ours(caught), "records": len(routing_capture.records())}
    routing.configure(mode="off")

    # a router with a layer number outside any schedule: one record per forward, replayed in order
    router.set_layer_number(3)
    inputs = [torch.randn(6, 2, 16), torch.randn(4, 2, 16), torch.randn(6, 2, 16)]
    plain = [router(x)[1] for x in inputs]
    routing.reset()
    routing.configure(mode="capture")
    captured = [router(x)[1] for x in inputs]
    records = routing_capture.records()
    report["layered/capture"] = {"same": all(torch.equal(a, b) for a, b in zip(plain, captured)),
                                 "keys": [[r.extra["step"], r.extra["microbatch"]] for r in records],
                                 "layers": [r.layers for r in records]}
    forced = [r.replace(indices={3: (r.indices[3] + 1) % 8}) for r in records]
    routing.reset()
    routing.configure(mode="replay")
    routing_replay.set_replay(forced)
    replayed = [router(x)[1] for x in inputs]
    report["layered/replay"] = {
        "as_recorded": all(torch.equal(m, torch.zeros_like(m).scatter(1, r.indices[3], True))
                           for m, r in zip(replayed, forced))}
    routing.set_position(microbatch=0)
    try:
        router(torch.randn(5, 2, 16))  # a record exists for (0, 0) but does not fit: strict
        report["layered/misfit"] = "no error"
    except RoutingReplayError as exc:
        report["layered/misfit"] = str(exc)
    routing.configure(mode="off")
    print("REPORT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,routing", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for key in ("SOURCE_PATCH_ROUTING_MODE", "SOURCE_PATCH_ROUTING_DIR", "PYTHONWARNINGS"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("mode", ["capture", "replay"])
def test_a_router_without_a_layer_number_routes_as_upstream_with_one_warning(report, mode):
    got = report[f"router/{mode}"]
    assert got["same"], got
    assert got["records"] == 0
    (warning,) = got["warnings"]  # three calls, one warning
    assert f"{mode}: a TopKRouter without a layer_number" in warning


@pytest.mark.parametrize("mode", ["capture", "replay"])
def test_a_direct_routing_function_call_routes_as_upstream_with_one_warning(report, mode):
    got = report[f"direct/{mode}"]
    assert got["same"], got
    assert got["records"] == 0
    (warning,) = got["warnings"]
    assert f"{mode}: a routing function called outside TopKRouter.routing" in warning


def test_forwards_outside_a_schedule_are_recorded_one_microbatch_each_and_replayed(report):
    cap = report["layered/capture"]
    assert cap["same"]
    assert cap["keys"] == [[0, 0], [0, 1], [0, 2]] and cap["layers"] == [[3]] * 3
    assert report["layered/replay"]["as_recorded"]


def test_replay_stays_strict_where_a_record_exists_but_does_not_fit(report):
    assert "step 0, microbatch 0, layer 3: the record has 12 rows, the router has 10 tokens" in \
        report["layered/misfit"]
