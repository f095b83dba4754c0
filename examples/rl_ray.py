"""A miniature RL loop in Ray actors, placed the way RL frameworks place Megatron and SGLang.

    python examples/rl_ray.py [--iterations 1] [--out sp-ray]

A local Ray cluster on this machine (no dashboard, no usage report) runs

- a trainer actor group: two Megatron-Core ranks, expert parallel 2 over gloo, holding
  the twin of a tiny Qwen3-MoE, under ``SOURCE_PATCH=megatron_cpu,routing,dump,weight_sync``;
- an engine actor that starts a real SGLang server on CPU (its child processes), under
  ``SOURCE_PATCH=routing,dump,weight_sync`` (the harness adds ``sglang_cpu``).

Each actor gets ``SOURCE_PATCH`` and its settings only through its Ray ``runtime_env``
(``source_patch.integrations.ray.runtime_env``): Ray's workers do not inherit the
driver's environment.  The driver then

1. shows what the start hook patched in every actor (``sp_ray.status``);
2. has trainer rank 0, once placed, publish the weight-sync rendezvous, which the
   engine joins through SGLang's own ``/init_weights_update_group``;
3. rolls out with routing capture and dumps on; each trainer rank collects the
   engine's routing records over Ray (``sp_ray.collect_routes``), replays them for its
   half of the batch (agreement with the engine per layer, without and with replay;
   log-prob mismatch), takes a REINFORCE step on a toy reward, and the patched
   ``optimizer.step()`` pushes the new weights (both ranks gather the experts, rank 0
   sends); the engine serves the new version;
4. prints where every actor's dumps and routes went, its dump control endpoint, and
   the ``source-patch compare`` command for the rollout and training dumps.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from rl_common import (PROMPTS, SGLangServer, agreement, agreement_line, build_trainer, join_update,
                       reinforce_backward, replayed_logps, rollout, seq_len_of, tiny_checkpoint, twin_logps)

from source_patch.integrations import ray as sp_ray
from source_patch.runtime.core.commands import command
from source_patch.runtime.core.endpoint import free_port

TRAINER_SPECS = ["megatron_cpu", "routing", "dump", "weight_sync"]
ENGINE_SPECS = ["routing", "dump", "weight_sync"]  # + sglang_cpu, which the harness adds
RAY_PROMPTS = PROMPTS + [[42, 17, 99, 3, 250]]  # two samples per trainer rank
WORLD = 2  # trainer ranks, all of them expert parallel
TIMEOUT = 600.0  # seconds for any one wait: a loaded 2-core machine is slow to start three actors


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--out", default="sp-ray")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the trainer's rendezvous stores listen on: loopback, as every actor runs on "
                        "this machine; empty for Ray's node address (a cluster's private network)")
    return p.parse_args(argv)


class Trainer(sp_ray.SourcePatchActor):
    """One Megatron-Core rank of the trainer group."""

    def __init__(self, rank: int, checkpoint: str, run: str):
        self.rank, self.checkpoint, self.run = rank, checkpoint, Path(run)

    def master(self, host: str) -> tuple:
        """Rank 0, once placed: where the group's rendezvous store will listen."""
        return host or sp_ray.node_address(), free_port()

    def setup(self, host: str, port: int) -> dict:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from source_patch.runtime.weight_sync.transport import rendezvous_store

        torch.set_num_threads(1)
        timeout = timedelta(seconds=TIMEOUT)
        store = rendezvous_store(host, port, self.rank, WORLD, timeout)  # rank 0 listens on host only
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=WORLD, timeout=timeout)
        ps.initialize_model_parallel(expert_model_parallel_size=WORLD)
        self.model, self.ddp, self.optimizer, self.routes = build_trainer(self.checkpoint)
        return {"ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}

    def train(self, samples: list, engines: list) -> dict:
        """One step on this rank's share of the rollout, the engine's routes replayed."""
        import torch

        from source_patch.runtime.dump import api as dump
        from source_patch.runtime.verdict.logprobs import mismatch, rollout_logprobs
        from source_patch.runtime.weight_sync import sync as weight_sync

        seq_len = seq_len_of(samples)  # one shape on every rank: expert parallelism gathers their tokens
        mine = samples[self.rank::WORLD]
        folder = self.run / "routes" / f"trainer-{self.rank}"
        found = sp_ray.collect_routes(engines, folder, rids=[s["rid"] for s in mine], timeout=TIMEOUT)
        records = [found[s["rid"]] for s in mine]
        engine = torch.cat([rollout_logprobs(s["logps"]) for s in mine])
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        dump.configure(enable=False)  # the plain forward is measured, not dumped
        with torch.no_grad():
            plain = torch.cat(twin_logps(self.ddp, mine, seq_len))
        plain_agreement = agreement(records, self.routes)
        dump.configure(enable=True)  # replayed_logps names the rows (source_patch.batch): the dumps pair
        train = replayed_logps(self.ddp, mine, records, seq_len, grad=True)
        replayed_agreement = agreement(records, self.routes)
        reward = reinforce_backward(self.ddp, mine, train)
        success, grad_norm, _ = self.optimizer.step()  # patched: gathers the experts, rank 0 pushes
        dump.flush()
        state = weight_sync.state()
        return {"rank": self.rank, "samples": len(mine), "records": len(found), "routes": str(folder),
                "plain": mismatch(engine, plain).line(), "replayed": mismatch(engine, torch.cat(train).detach()).line(),
                "plain_agreement": plain_agreement, "replayed_agreement": replayed_agreement, "reward": reward,
                "success": bool(success), "grad_norm": float(grad_norm), "version": state["version"],
                "pushes": state["counters"]["pushes"], "error": state["last_error"]}


class Engine(sp_ray.SourcePatchActor):
    """A real SGLang server on CPU, started by this actor as slime and miles start theirs."""

    def __init__(self, checkpoint: str, workdir: str):
        # The specs Ray's runtime_env activated here: the server's processes get them
        # too (the harness adds sglang_cpu, which lets SGLang serve on CPU).
        specs = os.environ["SOURCE_PATCH"].split(",")
        self.workdir = Path(workdir)
        self.server = SGLangServer(checkpoint, specs=specs, workdir=workdir,
                                   args=["--disable-radix-cache", "--skip-server-warmup"], timeout=TIMEOUT)
        atexit.register(self.server.close)

    def generate(self, prompts: list, new_tokens: int) -> list:
        return rollout(self.server, new_tokens, prompts)

    def join_update(self, body: dict | None) -> None:
        join_update(self.server, body)

    def dumper_state(self) -> tuple:
        """SGLang's /dumper/get_state, answered by source-patch's runtime in each scheduler."""
        return self.server.post("/dumper/get_state")

    def log(self) -> str:
        return str(self.workdir / "server.log")

    def close(self) -> None:
        self.server.close()


def environments(run: Path) -> tuple:
    """The trainers' and the engine's runtime_env: specs, settings, environment strings."""
    dumps = {"enable": True, "dir": run / "dumps", "port": free_port()}  # control endpoints from that port on
    trainer = sp_ray.runtime_env(TRAINER_SPECS, settings={
        "dump": {**dumps, "exp_name": "train"},
        "weight_sync": {"enable": True, "backend": "gloo", "timeout_s": TIMEOUT}})
    engine = sp_ray.runtime_env(ENGINE_SPECS, settings={
        "dump": {**dumps, "exp_name": "rollout"}, "weight_sync": {"timeout_s": TIMEOUT}},
        env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "DUMPER_SERVER_PORT": "reuse",
             "SOURCE_PATCH_ROUTING_SGLANG_DIR": str(run / "routes" / "engine")})
    return trainer, engine


def start(ray, args, run: Path, checkpoint: Path) -> tuple:
    """The engine and the trainer group, placed and connected."""
    trainer_env, engine_env = environments(run)
    # The engine answers route requests while it waits in a weight update: a threaded actor.
    engine = ray.remote(Engine).options(runtime_env=engine_env, num_cpus=1, max_concurrency=4) \
        .remote(str(checkpoint), str(run / "engine"))
    trainers = [ray.remote(Trainer).options(runtime_env=trainer_env, num_cpus=1).remote(r, str(checkpoint), str(run))
                for r in range(WORLD)]
    host, port = ray.get(trainers[0].master.remote(args.host), timeout=TIMEOUT)
    layout = ray.get([t.setup.remote(host, port) for t in trainers], timeout=TIMEOUT)[0]
    print(f"trainer group: {WORLD} ranks, expert parallel {layout['ep']}, data parallel {layout['dp']} "
          f"(gloo, rendezvous {host}:{port})", flush=True)
    # Trainer rank 0 is placed: it picks the weight-sync rendezvous on its node and says where.
    body = sp_ray.weight_sync_rendezvous(trainers[0], engine_tp_sizes=[1], host=args.host, timeout=TIMEOUT)[0]
    print(f"weight sync rendezvous (published by trainer rank 0): {body['master_address']}:{body['master_port']}, "
          f"world size {body['world_size']}", flush=True)
    ray.get(engine.log.remote(), timeout=TIMEOUT)  # the server is up
    return engine, trainers, body


def per_spec(patched: dict) -> str:
    """'routing 8 patches in 4 modules, ...' from a status's {module: ["spec:patch", ...]}."""
    patches, modules = {}, {}
    for module, applied in patched.items():
        for spec in (entry.partition(":")[0] for entry in applied):
            patches[spec] = patches.get(spec, 0) + 1
            modules.setdefault(spec, set()).add(module)
    return ", ".join(f"{spec} {n} patches in {len(modules[spec])} modules" for spec, n in patches.items())


def show_status(ray, run: Path, engine, trainers) -> None:
    print("patched in every actor (the start hook ran in Ray's workers):", flush=True)
    names = [f"trainer rank {r}" for r in range(WORLD)] + ["engine"]
    statuses = dict(zip(names, sp_ray.status(trainers + [engine], timeout=TIMEOUT)))
    for name, status in statuses.items():
        print(f"  {name} (pid {status['pid']}): specs {','.join(status['specs'])} active; "
              + (f"{len(status['patched'])} modules patched: {per_spec(status['patched'])}" if status["patched"]
                 else "no target imported in the actor itself"), flush=True)
    (run / "actors.json").write_text(json.dumps(statuses, indent=1))  # every patched module, by actor
    code, replies = ray.get(engine.dumper_state.remote(), timeout=TIMEOUT)
    ranks = [r.get("rank") for r in replies] if code == 200 and isinstance(replies, list) else replies
    print(f"  engine's SGLang server (+ sglang_cpu): /dumper/get_state answered by source-patch in "
          f"scheduler rank(s) {ranks}", flush=True)


def iterate(ray, args, engine, trainers, body) -> None:
    for iteration in range(1, args.iterations + 1):
        samples = ray.get(engine.generate.remote(RAY_PROMPTS, args.new_tokens), timeout=TIMEOUT)
        versions = ", ".join(sorted({str(s["version"]) for s in samples}))
        print(f"iteration {iteration}: engine served weight version {versions}; "
              f"{len(samples)} samples x {args.new_tokens} tokens", flush=True)
        joined = engine.join_update.remote(body if iteration == 1 else None)  # waits for the push
        results = ray.get([t.train.remote(samples, [engine]) for t in trainers], timeout=TIMEOUT)
        ray.get(joined, timeout=TIMEOUT)
        for r in results:
            print(f"  trainer rank {r['rank']}: {r['samples']} samples; the engine's routing records collected "
                  f"over Ray ({r['records']}) into {r['routes']}", flush=True)
            print(f"    routing agreement, plain:    {agreement_line(r['plain_agreement'])}", flush=True)
            print(f"    routing agreement, replayed: {agreement_line(r['replayed_agreement'])}", flush=True)
            print(f"    mismatch, plain:    {r['plain']}", flush=True)
            print(f"    mismatch, replayed: {r['replayed']}", flush=True)
            pushed = (f"pushed the new weights to the engine as version {r['version']}" if r["pushes"]
                      else "gathered its experts for rank 0's push")
            print(f"    step: success {r['success']}, grad norm {r['grad_norm']:.3f}, mean reward {r['reward']:.3f}; "
                  f"{pushed}" + (f"; weight sync error: {r['error']}" if r["error"] else ""), flush=True)
    final = ray.get(engine.generate.remote(RAY_PROMPTS, args.new_tokens), timeout=TIMEOUT)
    print(f"after {args.iterations} update{'s' if args.iterations != 1 else ''} the engine serves weight version "
          f"{', '.join(sorted({str(s['version']) for s in final}))}", flush=True)


def show_places(ray, run: Path, engine, trainers) -> None:
    """Where each actor's dumps, control endpoints and routes are, asked from the driver."""
    actors = trainers + [engine]
    names = [f"trainer rank {r}" for r in range(WORLD)] + ["engine"]
    places = sp_ray.endpoints(actors, timeout=TIMEOUT)
    states = sp_ray.dump_request(actors, "GET", "/state", timeout=TIMEOUT)
    print(f"where everything went (run {run}):", flush=True)
    for name, place, replies in zip(names, places, states):
        print(f"  {name} (node {place['node']}, pid {place['pid']}):", flush=True)
        for reply in replies:
            state = reply["reply"]
            folder = Path(state["exp_dir"]) / state["config"]["rank_dir"].format(rank=state["rank"])
            print(f"    dumps {folder} ({state['counters']['records']} records) from pid {reply['pid']}, "
                  f"control endpoint {reply['url']}", flush=True)
        if place["routes"]:
            print(f"    routes {place['routes']} (SGLang capture)", flush=True)
    print(f"    server log {ray.get(engine.log.remote(), timeout=TIMEOUT)}", flush=True)
    print(f"  every actor's patched modules: {run / 'actors.json'}", flush=True)
    print(f"compare: {command('compare', run / 'dumps' / 'rollout', run / 'dumps' / 'train')}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Path(args.out).resolve() / time.strftime("ray-%Y%m%d-%H%M%S")
    run.mkdir(parents=True)
    checkpoint = tiny_checkpoint()
    print(f"checkpoint: {checkpoint}", flush=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # else Ray reports usage to its vendor
    import ray

    cpus = max(os.cpu_count() or 1, WORLD + 1)  # logical slots, one per actor
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 << 20)  # a cluster of its own, even where RAY_ADDRESS names another
    print(f"ray: a local cluster of {cpus} logical CPUs, dashboard off; starting the engine actor and "
          f"{WORLD} trainer actors ...", flush=True)
    engine, began = None, time.monotonic()
    try:
        engine, trainers, body = start(ray, args, run, checkpoint)
        print(f"actors placed and connected in {time.monotonic() - began:.1f} s", flush=True)
        show_status(ray, run, engine, trainers)
        iterate(ray, args, engine, trainers, body)
        show_places(ray, run, engine, trainers)
        print(f"done in {time.monotonic() - began:.1f} s", flush=True)
    finally:
        if engine is not None:
            try:
                ray.get(engine.close.remote(), timeout=120)
            except Exception as exc:  # noqa: BLE001 - shutting down regardless
                print(f"engine close: {exc}", file=sys.stderr)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
