"""Routing capture and replay under Megatron-Core's own CUDA graphs (issue 31, build item 5).

A real GPT-MoE (examples/train_moe.py's model: 2 MoE layers, 8 experts, top-2, allgather
dispatcher) trained with ``cuda_graph_impl="local"`` and ``cuda_graph_scope=["moe_router"]``:
each layer's router (pre-MLP norm, router, dispatch preprocessing) is a CUDA graph that
Megatron records in step 0 (eager), builds at the end of step 0 (eager warm-up passes,
then the capture) and replays from step 1 on.  patches/routing.yaml gives each graph a
GraphStage (runtime/core/adapters/graph_stage.py): capture stages the top-k ids in the graph and
drains them after every replay; replay feeds the recorded ids into a static buffer the
graphed router reads.  Learning rate 0: every step routes with the same weights, so a
difference between two runs can only come from how the routes were taken.

Each scenario is its own process (this file run as a script; patching happens at import):

- ``capture`` eager vs graphed, same seed: every (step, micro-batch, layer) record equal,
  graph-replayed steps tagged ``cuda_graph``, no record from a warm-up pass;
- ``replay`` of the graphed capture into a model of another seed, graphed and eager: the
  routing map the experts used at the last replayed micro-batch is the recorded one, and
  the losses of graphed and eager replay agree, while the same model with routing off
  routes (and loses) otherwise;
- ``dump`` (patches/dump.yaml alone, its own copy of the graph hooks), graphed and eager,
  the same micro-batches at every step: the records of graph-replayed steps equal the
  eager step 0 of the same process and the eager process, bitwise, record for record;
  those of the graphed parts (router and MoE postprocess graphs) tagged ``cuda_graph``;
- ``trace`` (patches/trace.yaml alone, a client subscribed to everything in the process):
  the frames of the graphed process equal those of the eager one, bitwise, those of the
  graphed parts tagged ``cuda_graph`` from step 1 on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

STEPS, MICRO_BATCHES, SEED, OTHER_SEED = 4, 2, 1234, 99
ROOT = Path(__file__).resolve().parents[1]


def _scenario(out: Path, mode: str, graphs: bool, seed: int, folder: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    env["SOURCE_PATCH_CACHE"] = str(out.parent / "cache")
    args = [sys.executable, __file__, str(out), mode, "graphs" if graphs else "eager", str(seed), str(folder)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(runs: dict) -> dict:
    out = {}
    for name, (path, proc) in runs.items():
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"scenario {name} failed (exit {proc.returncode}):\n{log[-4000:]}"
        from safetensors.torch import load_file

        out[name] = (json.loads(path.with_suffix(".json").read_text()), load_file(str(path.with_suffix(".st"))))
    return out


def _routes(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Megatron's graphs)")
def test_capture_and_replay_under_megatron_cuda_graphs(tmp_path):
    pytest.importorskip("megatron.core")
    folder = tmp_path / "routes"
    first = {name: (tmp_path / name, _scenario(tmp_path / name, mode, graphs, seed, folder))
             for name, mode, graphs, seed in (("eager", "capture", False, SEED), ("graphs", "capture", True, SEED),
                                               ("off", "off", True, OTHER_SEED))}
    res = _results(first)
    (eager, eager_t), (graphed, graphed_t) = res["eager"], res["graphs"]

    assert graphed["router_graphs"] == 2 and eager["router_graphs"] == 0 and res["off"][0]["router_graphs"] == 2
    # capture: the records of graph-replayed steps are the eager ones, key for key, layer for layer
    keys = [(s, m) for s in range(STEPS) for m in range(MICRO_BATCHES)]
    assert [tuple(r["key"]) for r in graphed["records"]] == keys, "a warm-up pass or a lost replay in the records"
    assert [tuple(r["key"]) for r in eager["records"]] == keys
    assert [r["cuda_graph"] for r in graphed["records"]] == [s >= 1 for s, _ in keys]
    assert not any(r["cuda_graph"] for r in eager["records"])
    routes_e, routes_g = _routes(eager_t, "route/"), _routes(graphed_t, "route/")
    assert sorted(routes_g) == sorted(routes_e) and len(routes_g) == len(keys) * 2
    differ = [k for k in routes_e if not torch.equal(routes_e[k], routes_g[k])]
    assert not differ, f"graphed capture differs from eager at {differ}"
    # what the experts of the last (graph-replayed) micro-batch were sent is what was drained
    last = f"{STEPS - 1}/{MICRO_BATCHES - 1}/"
    for layer, used in _routes(graphed_t, "used/").items():
        assert torch.equal(used, routes_g[last + layer].sort(-1).values)

    replays = {name: (tmp_path / name, _scenario(tmp_path / name, "replay", graphs, OTHER_SEED, folder))
               for name, graphs in (("replay-graphs", True), ("replay-eager", False))}
    res.update(_results(replays))
    (rg, rg_t), (re_, re_t), (_, off_t) = res["replay-graphs"], res["replay-eager"], res["off"]
    # replay under graphs: every replayed micro-batch read the record (the feeds ran), the
    # experts got the recorded routes, and the model learns nothing else from the graph
    assert rg["router_graphs"] == 2 and re_["router_graphs"] == 0
    assert [tuple(k) for k in rg["used"]] == keys and all(n == 2 for n in rg["used_layers"])
    for layer, used in _routes(rg_t, "used/").items():
        assert torch.equal(used, routes_g[last + layer].sort(-1).values)
        assert not torch.equal(used, off_t["used/" + layer]), "routing off routes as recorded: the test shows nothing"
    assert torch.allclose(rg_t["loss"], re_t["loss"], rtol=1e-5, atol=1e-6), (rg_t["loss"], re_t["loss"])
    assert (rg_t["loss"][1:] - off_t["loss"][1:]).abs().max() > 1e-4, "replayed and live routes give one loss"


GRAPHED_NAMES = {"pre_mlp_residual", "routing_map", "mlp_output", "layer_output"}  # in the router / postprocess graphs


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The dump scenario, eager and graphed: (step, microbatch, name, layer) -> record."""
    torch_ok = torch.cuda.is_available()
    if not torch_ok:
        pytest.skip("needs a CUDA GPU (Megatron's graphs)")
    pytest.importorskip("megatron.core")
    from source_patch.runtime.dump.reader import load

    tmp = tmp_path_factory.mktemp("dumps")
    res = _results({name: (tmp / name, _scenario(tmp / name, "dump", graphs, SEED, tmp / "dumps"))
                    for name, graphs in (("eager", False), ("graphs", True))})
    out = {}
    for name in ("eager", "graphs"):
        records = load(tmp / "dumps", exp_name=name)
        keys = [(r.step, r.microbatch, r.name, r.layer) for r in records]
        assert len(set(keys)) == len(keys), f"{name}: a record twice (a warm-up pass or a drain twice)"
        out[name] = ({k: r for k, r in zip(keys, records)}, res[name][0])
    return out


@pytest.mark.gpu
def test_dumps_of_replayed_steps_equal_the_eager_step_bitwise(dumps):
    records, summary = dumps["graphs"]
    assert summary["router_graphs"] == 2 and summary["dump_errors"] == 0, summary
    keys = sorted(records, key=str)
    names = {k[2] for k in keys}
    assert GRAPHED_NAMES <= names and {"layer_input", "attention_output", "logits"} <= names
    per_step = {s: sorted((k[1:] for k in keys if k[0] == s), key=str) for s in range(STEPS)}
    assert all(per_step[s] == per_step[0] for s in range(STEPS)), "a step lacks records another has"
    graphed = {k for k in keys if records[k].tags.get("cuda_graph")}
    assert graphed == {k for k in keys if k[0] >= 1 and k[2] in GRAPHED_NAMES}, "cuda_graph tags"
    differ = [k for k in keys if k[0] >= 1 and not torch.equal(records[k].tensor, records[(0, *k[1:])].tensor)]
    assert not differ, f"replayed steps differ from the eager step 0 at {differ[:8]}"


@pytest.mark.gpu
def test_dumps_under_graphs_equal_a_process_without_graphs_bitwise(dumps):
    (graphed, _), (eager, summary) = dumps["graphs"], dumps["eager"]
    assert summary["router_graphs"] == 0 and summary["dump_errors"] == 0, summary
    assert sorted(graphed, key=str) == sorted(eager, key=str)
    assert not any(r.tags.get("cuda_graph") for r in eager.values())
    differ = {k: float((graphed[k].tensor.double() - eager[k].tensor.double()).abs().max()) for k in eager
              if not torch.equal(graphed[k].tensor, eager[k].tensor)}
    assert not differ, f"{len(differ)} of {len(eager)} records differ, e.g. {sorted(differ.items(), key=str)[:8]}"


TRACED_IN_GRAPHS = {"router_logits", "mlp_output", "layer_output"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Megatron's graphs)")
def test_traces_under_megatron_cuda_graphs_equal_eager(tmp_path):
    pytest.importorskip("megatron.core")
    res = _results({name: (tmp_path / name, _scenario(tmp_path / name, "trace", graphs, SEED, tmp_path))
                    for name, graphs in (("eager", False), ("graphs", True))})
    (eager, eager_t), (graphed, graphed_t) = res["eager"], res["graphs"]
    assert graphed["router_graphs"] == 2 and graphed["trace_errors"] == 0 == eager["trace_errors"], graphed
    assert sorted(graphed["frames"]) == sorted(eager["frames"]) and len(eager["frames"]) >= STEPS * 7
    want = sorted(f"{s}/{n}/{layer}" for s in range(1, STEPS) for n in TRACED_IN_GRAPHS for layer in (1, 2))
    assert sorted(graphed["cuda_graph"]) == want and eager["cuda_graph"] == []
    differ = [k for k in eager_t if not torch.equal(eager_t[k], graphed_t[k])]
    assert not differ, f"graphed frames differ from eager at {differ[:8]}"


class _Frames:
    """A client of this process's trace hub, in a thread: subscribed to every name (tiles)."""

    def __init__(self, url: str):
        self.url, self.frames, self.stop = url, [], False
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the trace client did not subscribe"

    async def _main(self):
        from source_patch.runtime.trace.client import connect

        async with connect(self.url) as client:
            await client.subscribe(["*"], compressor={"kind": "tiles", "tiles": 4}, id="all")
            self.ready.set()
            while not self.stop:
                try:
                    self.frames.append(await client.next_frame(0.5))
                except (asyncio.TimeoutError, TimeoutError):
                    pass

    def close(self, expected: int) -> list:
        deadline = time.monotonic() + 30
        while len(self.frames) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stop = True
        self.thread.join(5)
        return self.frames


# --------------------------------------------------------------------------- the scenario process


def _used_routes(model) -> dict:
    """Per MoE layer: the experts each token of the last micro-batch was dispatched to."""
    out = {}
    for module in model.modules():
        if hasattr(module, "router") and hasattr(module, "token_dispatcher"):
            rmap = module.token_dispatcher.local_map  # all experts at ep 1; routing_map is freed after use
            out[str(module.router.layer_number)] = rmap.nonzero()[:, 1].view(rmap.shape[0], -1).cpu()
    return out


def main(out: str, mode: str, graphs: str, seed: str, folder: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import graph_bench  # bench/graph_bench.py: the graphed model and the activation

    graph_bench.activate((mode,) if mode in ("dump", "trace") else ("routing",))
    sys.path.insert(0, str(ROOT / "examples"))
    import train_moe
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import save_file

    from source_patch.runtime.routing.megatron import capture as routing_capture, control as routing
    from source_patch.runtime.routing.megatron.replay import _used

    args = train_moe.parse_args(["--layers", "2", "--micro-batches", str(MICRO_BATCHES), "--seed", seed,
                                 "--lr", "0"])
    train_moe.init_distributed(torch.device("cuda"), 1)
    if mode == "dump":  # on before the graphs are built (the end of step 0)
        from source_patch.runtime.dump import api as dump

        dump.configure(enable=True, dir=folder, exp_name=Path(out).name)
    elif mode == "trace":
        from source_patch.runtime.core.endpoint import free_port

        os.environ["SOURCE_PATCH_TRACE_PORT"] = "0"  # not the spec's 8765 at import: parallel scenarios
        from source_patch.runtime.trace import control as tracer

        tracer.configure(enable=True, port=free_port(), token="t", dir=out + "-trace", hub="thread", wait=0,
                         client_queue=4096)
        client = _Frames(tracer.url())
    else:
        routing.configure(mode=mode, **({"dir": folder} if mode == "replay" else {}))
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=True)  # what Megatron's graphs need
    model = graph_bench.graphed_model(train_moe, args, graphs == "graphs")
    optimizer = train_moe.build_optimizer(model, args)
    data = train_moe.make_dataset(args, torch.device("cuda"))
    losses = []
    for step in range(STEPS):
        first = 0 if mode in ("dump", "trace") else step * args.micro_batches  # the same forwards every step
        batches = [train_moe.make_batch(data, first + m, args) for m in range(args.micro_batches)]
        losses.append(train_moe.train_step(model, optimizer, batches, args)[0])
    torch.cuda.synchronize()
    tensors = {"loss": torch.tensor(losses, dtype=torch.float64)}
    tensors.update({f"used/{k}": v for k, v in _used_routes(model).items()})
    summary = {"records": [], "used": sorted(_used), "used_layers": [len(v) for _, v in sorted(_used.items())]}
    if mode == "capture":
        routing_capture.flush()
        for rec in routing_capture.records():
            key = (rec.extra["step"], rec.extra["microbatch"])
            summary["records"].append({"key": key, "cuda_graph": bool(rec.extra.get("cuda_graph"))})
            for layer, ids in rec.indices.items():
                tensors[f"route/{key[0]}/{key[1]}/{layer}"] = ids.sort(-1).values.contiguous()
        if graphs == "graphs":
            routing.save(folder)
    if mode == "dump":
        dump.flush()
        summary["dump_errors"] = dump.state()["counters"]["errors"]
        summary["dump_last_error"] = dump.state()["last_error"]
        summary["dump_records"] = dump.state()["counters"]["records"]
    if mode == "trace":
        tracer.flush()
        frames = client.close(tracer.state()["counters"]["results"])
        summary["trace_errors"] = tracer.state()["counters"]["errors"]
        summary["frames"] = sorted(f"{f.step}/{f.meta['name']}/{f.layer}" for f in frames)
        summary["cuda_graph"] = sorted(f"{f.step}/{f.meta['name']}/{f.layer}" for f in frames
                                       if f.meta.get("cuda_graph"))
        tensors.update({f"frame/{f.step}/{f.meta['name']}/{f.layer}": torch.from_numpy(f.array.copy()) for f in frames})
        tracer.close()
    summary["warnings"] = sorted(routing._warned)
    summary["router_graphs"] = sum(r.fwd_graph is not None for m in model.modules()
                                   if hasattr(m, "cudagraph_manager_router") for r in m.cudagraph_manager_router.cudagraph_runners)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out + ".st")
    Path(out + ".json").write_text(json.dumps(summary))
    routing.configure(mode="off")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
