"""The sentinels' routing health (issue 54, item 3): per step and MoE layer, tokens per
expert, max/mean imbalance, dead experts, router entropy and the agreement of the
router's own top-k with the replayed one.

In-process: the watch seam (core/watch.py's routes_hook set and unset by
routing_health.apply), the router call site handing it the router's own ids, its logits
and the replayed ids (ours, or a RouterReplay's that already replaced the router's), the
device accumulators allocated once, the metrics lines.

End to end (tests/e2e/sentinels_routing_run.py, a child under SOURCE_PATCH=megatron_cpu,routing):
a 2-layer GPT-MoE (8 experts, top-2, 2 micro-batches of 16 x 4 tokens) trained 2 steps
through Megatron-Core 0.16.1's schedule, routing health on, the sentinels' step call
after each optimizer step. The figures equal a direct computation from the capture
records (counts, imbalance, dead: exactly) and from the router's logits (entropy:
1e-6); replaying the capture gives agreement 1; replaying records with a planted fraction
of tokens' expert sets changed gives 1 - that fraction exactly where the router's input is
the capture's (the first routed layer before any update), and everywhere the agreement a
direct comparison gives; Megatron-Core's own RouterReplay replaying the same records gives
the same figures as ours.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from source_patch.runtime.core import watch  # noqa: E402
from source_patch.runtime.routing.megatron import control as routing  # noqa: E402
from source_patch.runtime.sentinels import events, routing_health  # noqa: E402

RUN = Path(__file__).parent / "e2e" / "sentinels_routing_run.py"
STEPS, MICROBATCHES, LAYERS, EXPERTS, TOPK, TOKENS = 2, 2, 2, 8, 2, 16 * 4


@pytest.fixture
def health(tmp_path):
    """routing_health armed, its metrics under tmp_path/rank-0/metrics.jsonl."""
    routing.configure(mode="off")
    events.open_run(str(tmp_path))
    routing_health.clear()
    routing_health.apply({"routing_health": True})
    yield tmp_path / "rank-0" / "metrics.jsonl"
    routing_health.apply({"routing_health": False})
    routing_health.clear()
    events.close_run()
    routing.reset()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def entropy(logits):
    p = torch.softmax(logits.double(), dim=-1)
    return float(torch.special.entr(p).sum(-1).mean())


def router(layer, replay_action=None):
    replay = None if replay_action is None else SimpleNamespace(router_replay_action=SimpleNamespace(value=replay_action))
    return SimpleNamespace(layer_number=layer, router_replay=replay,
                           config=SimpleNamespace(moe_router_num_groups=None, moe_router_group_topk=None,
                                                  sequence_parallel=False, num_moe_experts=EXPERTS))


def route(layer, logits, result, replay_action=None):
    """TopKRouter.routing's call sites around one compute_topk return."""
    routing.routing_enter(router(layer, replay_action), logits)
    try:
        return routing.routing_topk(logits.reshape(-1, EXPERTS), result)
    finally:
        routing.routing_exit()


def test_hook_set_and_unset_by_the_setting():
    routing_health.apply({"routing_health": True})
    assert watch.routes_hook is routing_health.routes
    routing_health.apply({"routing_health": False})
    assert watch.routes_hook is None


def test_unwatched_call_site_routes_unchanged():
    assert watch.routes_hook is None
    routing.configure(mode="off")
    logits = torch.randn(6, 2, EXPERTS)
    result = torch.topk(logits.reshape(-1, EXPERTS), TOPK, dim=1)
    assert route(1, logits, result) is result
    assert routing._watched is None


def test_router_call_site_hands_the_hook_its_own_and_replayed_ids(monkeypatch):
    seen = []
    monkeypatch.setattr(watch, "routes_hook", lambda *args: seen.append(args))
    routing.configure(mode="off")
    torch.manual_seed(0)
    logits = torch.randn(6, 2, EXPERTS)
    scores = logits.reshape(-1, EXPERTS)
    own = torch.topk(scores, TOPK, dim=1)
    assert route(3, logits, own) is own
    layer, ids, given, replayed = seen.pop()
    assert layer == 3 and ids is own[1] and replayed is None and torch.equal(given, scores)
    # Megatron-Core's RouterReplay replaced the router's ids before the call site: the
    # router's own are recomputed from the scores it ranked.
    target = torch.randint(0, EXPERTS, (12, TOPK))
    theirs = (scores.gather(1, target), target)
    assert route(4, logits, theirs, "replay_forward") is theirs
    layer, ids, given, replayed = seen.pop()
    assert layer == 4 and torch.equal(ids, own[1]) and replayed is target
    # RECORD: the router's own choice, nothing replayed
    route(5, logits, own, "record")
    assert seen.pop()[3] is None
    # no layer (a router built outside a TransformerLayer): nothing handed over
    route(None, logits, own)
    assert not seen


def test_figures_accumulated_on_the_device_and_written_per_step(health):
    torch.manual_seed(1)
    want_counts, want_entropy, calls = torch.zeros(EXPERTS, dtype=torch.int64), [], []
    for mb in range(3):
        logits = torch.randn(10, EXPERTS)
        logits[:, 7] = -1e4  # expert 7 never chosen: dead
        own = torch.topk(logits, TOPK, dim=1)[1]
        replayed = own.clone()
        if mb == 1:  # 4 of 10 tokens' expert sets changed
            for t in range(4):
                replayed[t, 0] = next(e for e in range(EXPERTS) if e not in own[t].tolist())
        calls.append((own, logits, replayed if mb else None))
        want_counts += torch.bincount((replayed if mb else own).reshape(-1), minlength=EXPERTS)
        want_entropy.append(torch.special.entr(torch.softmax(logits.double(), -1)).sum(-1))
    for own, logits, replayed in calls:
        routing_health.routes(2, own, logits, replayed)
    assert len(routing_health._held) == 3  # held: accumulated together at the step's end
    table = routing_health._layers[2].table
    routing_health.step_end(7)
    assert routing_health._held == []
    buffers = table.values.data_ptr()
    [line] = lines(health)
    assert line["kind"] == "routing_health" and (line["step"], line["layer"], line["tokens"]) == (7, 2, 30)
    assert line["per_expert"] == want_counts.tolist()
    assert line["dead"] == [7] and line["imbalance"] == max(line["per_expert"]) / (30 * TOPK / EXPERTS)
    assert abs(line["entropy"] - float(torch.cat(want_entropy).mean())) < 1e-6  # float32 softmax
    assert line["replayed"] == 20 and line["agreement"] == 1 - 4 / 20
    # the next step: the same tensors, zeroed; nothing routed, nothing written
    routing_health.step_end(None)
    assert len(lines(health)) == 1
    for own, logits, replayed in calls:
        routing_health.routes(2, own, logits, None)
    routing_health.step_end(None)
    assert table.values.data_ptr() == buffers and routing_health._layers[2].table is table
    last = lines(health)[-1]
    assert last["step"] == 9 and last["agreement"] is None and last["replayed"] == 0
    assert routing_health.counters()["routing_health_lines"] == 2 and routing_health.last_error() is None


def test_layers_of_one_shape_are_accumulated_as_one_batch_and_held_calls_are_bounded(health, monkeypatch):
    """Eight layers' calls: one table, a row each, the figures of each layer its own; past
    HELD_CALLS the calls are accumulated before the step's end; a held tensor changed in
    place before that is counted."""
    torch.manual_seed(3)
    monkeypatch.setattr(routing_health, "HELD_CALLS", 5)
    calls = {}
    for layer in range(1, 9):
        logits = torch.randn(6, EXPERTS)
        calls[layer] = (torch.topk(logits, TOPK, dim=1)[1], logits)
        routing_health.routes(layer, *calls[layer], None)
    assert len(routing_health._held) == 3  # the first five were accumulated at the fifth call
    calls[8][1].mul_(2)  # held, changed in place before its batch runs
    routing_health.step_end(0)
    assert len(routing_health._tables) == 1 and routing_health.counters()["routing_health_changed"] == 1
    got = {line["layer"]: line for line in lines(health)}
    assert sorted(got) == list(range(1, 9)) and routing_health.counters()["routing_health_lines"] == 8  # one write
    for layer, (own, logits) in calls.items():
        assert got[layer]["per_expert"] == torch.bincount(own.reshape(-1), minlength=EXPERTS).tolist()
        assert abs(got[layer]["entropy"] - entropy(logits)) < 1e-5


def test_a_bad_call_is_counted_never_raised(health):
    routing_health.routes(1, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, EXPERTS),
                          torch.zeros(4, 3, dtype=torch.int64))
    assert routing_health.counters()["routing_health_errors"] == 1
    assert "replayed ids" in routing_health.last_error()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_read_is_asynchronous_and_flush_writes_it(health):
    """The step's end never waits for the device: a copy to pinned memory and an event;
    the lines come when it is done (that step's end, the next one, or drain)."""
    torch.manual_seed(2)
    logits = torch.randn(4096, EXPERTS, device="cuda")
    own = torch.topk(logits, TOPK, dim=1)[1]
    # a first step: the pinned buffer's allocation (cudaHostAlloc) waits for the device
    routing_health.routes(1, own, logits, None)
    routing_health.step_end(0)
    routing_health.drain()
    assert len(lines(health)) == 1
    # a long kernel ahead of the step's end: the copy cannot be done when step_end returns
    big = torch.randn(8192, 8192, device="cuda")
    routing_health.routes(1, own, logits, None)
    assert routing_health.last_error() is None
    for _ in range(20):
        big = big @ big / 8192
    routing_health.step_end(1)
    assert routing_health.last_error() is None
    assert routing_health._pending and len(lines(health)) == 1
    routing_health.drain()
    first, line = lines(health)
    want = torch.bincount(own.reshape(-1).cpu(), minlength=EXPERTS).tolist()
    assert (line["step"], line["tokens"], line["per_expert"]) == (1, 4096, want) and first["per_expert"] == want
    assert abs(line["entropy"] - entropy(logits.cpu())) < 1e-5
    assert float(routing_health._layers[1].table.values.abs().sum()) == 0  # zeroed for the next step


# --------------------------------------------------------------------- end to end, real Megatron-Core


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, shared_code_cache):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("sentinels-routing")
    env = {**os.environ, "SOURCE_PATCH": "megatron_cpu,routing", "SOURCE_PATCH_CACHE": str(shared_code_cache),
           "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(RUN), str(out), "off", "capture", "replay", "planted",
                             "planted_last", "router_replay"], env=env, capture_output=True, text=True,
                            timeout=300, cwd=RUN.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((out / "status.json").read_text())
    assert all(s.get("ok") for s in status), status
    from source_patch.runtime.routing.megatron import files as routing_files

    metrics = [{(m["step"], m["layer"]): m for m in lines(Path(s["dir"]) / "rank-0" / "metrics.jsonl")
                if m["kind"] == "routing_health"} for s in status]
    return SimpleNamespace(out=out, status=status, metrics=metrics, tensors=load_file(out / "out.safetensors"),
                           captured=routing_files.load_dir(out / "capture"))


SCENARIO = {"off": 0, "capture": 1, "replay": 2, "planted": 3, "planted_last": 4, "router_replay": 5}


def direct(e2e, scenario, routes=None):
    """The figures computed from the routes (a record per (step, microbatch), or the routes
    each router dispatched) and the router's logits (a forward hook, no source patch)."""
    i, t = SCENARIO[scenario], e2e.tensors
    want = {}
    for step in range(STEPS):
        for layer in range(1, LAYERS + 1):
            counts, ent, agree = torch.zeros(EXPERTS, dtype=torch.int64), [], 0
            for mb in range(MICROBATCHES):
                logits = t[f"{i}/logits/{step}/{mb}/{layer}"]
                taken = routes[step, mb].indices[layer] if routes else t[f"{i}/route/{step}/{mb}/{layer}"]
                counts += torch.bincount(taken.reshape(-1), minlength=EXPERTS)
                p = torch.softmax(logits.double(), dim=-1)
                ent.append(-(p * torch.log(p)).sum(-1))
                own = torch.topk(logits, TOPK, dim=1)[1].sort(1).values
                agree += int((own == taken.sort(1).values).all(1).sum())
            mean = counts.sum().item() / EXPERTS
            want[step, layer] = {"tokens": TOKENS * MICROBATCHES, "per_expert": counts.tolist(),
                                 "imbalance": counts.max().item() / mean,
                                 "dead": [e for e in range(EXPERTS) if counts[e] == 0],
                                 "entropy": float(torch.cat(ent).mean()),
                                 "agreement": agree / (TOKENS * MICROBATCHES)}
    return want


def check(got, want, replayed):
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert (g["tokens"], g["topk"], g["per_expert"], g["dead"]) == (w["tokens"], TOPK, w["per_expert"], w["dead"]), key
        assert g["imbalance"] == w["imbalance"], key
        assert abs(g["entropy"] - w["entropy"]) < 1e-6, key
        if replayed:
            assert g["replayed"] == w["tokens"] and g["agreement"] == w["agreement"], key
        else:
            assert g["replayed"] == 0 and g["agreement"] is None, key


def test_e2e_figures_equal_a_direct_computation_from_the_capture(e2e):
    assert sorted(e2e.captured) == [(s, m) for s in range(STEPS) for m in range(MICROBATCHES)]
    check(e2e.metrics[1], direct(e2e, "capture", e2e.captured), replayed=False)
    # routing off: the same model, data and seed route as the capture (the figures are the router's)
    assert {k: v["per_expert"] for k, v in e2e.metrics[0].items()} == \
        {k: v["per_expert"] for k, v in e2e.metrics[1].items()}
    check(e2e.metrics[0], direct(e2e, "off"), replayed=False)


def test_e2e_replay_of_the_capture_agrees_fully(e2e):
    check(e2e.metrics[2], direct(e2e, "replay", e2e.captured), replayed=True)
    assert all(m["agreement"] == 1.0 for m in e2e.metrics[2].values())


PLANTED = {1: 1 / 4, 2: 3 / 8}  # tests/e2e/sentinels_routing_run.py's PLANT, per layer


@pytest.mark.parametrize("scenario", ["planted", "router_replay"])
def test_e2e_planted_replay_drops_agreement_by_the_planted_fraction(e2e, scenario):
    i = SCENARIO[scenario]
    got = e2e.metrics[i]
    for (step, mb), rec in e2e.captured.items():  # the routes dispatched: changed exactly where planted
        for layer, ids in rec.indices.items():
            dispatched = e2e.tensors[f"{i}/route/{step}/{mb}/{layer}"]
            changed = (ids.sort(1).values != dispatched.sort(1).values).any(1)
            assert changed.float().mean().item() == PLANTED[layer]
    check(got, direct(e2e, scenario), replayed=True)
    # the first routed layer sees the capture's input before any update: 1 - the planted fraction
    assert got[0, 1]["agreement"] == 1 - PLANTED[1]
    assert got[0, 2]["agreement"] < 1 and got[1, 1]["agreement"] < 1


def test_e2e_planted_last_layer(e2e):
    got = e2e.metrics[SCENARIO["planted_last"]]
    check(got, direct(e2e, "planted_last"), replayed=True)
    assert got[0, 1]["agreement"] == 1.0 and got[0, 2]["agreement"] == 1 - PLANTED[2]


def test_e2e_megatron_router_replay_gives_our_replays_figures(e2e):
    ours, theirs = e2e.metrics[SCENARIO["planted"]], e2e.metrics[SCENARIO["router_replay"]]
    strip = lambda m: {k: {f: v for f, v in line.items() if f != "time"} for k, line in m.items()}  # noqa: E731
    assert strip(ours) == strip(theirs)
