"""Weight sync into a REAL SGLang server: Megatron trains (two ranks, expert parallel,
distributed optimizer) and pushes after every step; the server receives through its
own admin HTTP path (init_weights_update_group, begin / update_weights_from_distributed
with load_format "source_patch" / end) with patches/weight_sync.yaml active in
its scheduler.  After each update the server generates what transformers generates
with the trainer's weights of that step, and serves the trainer's version; a trainer
killed in the middle of an update leaves the server alive, serving the previous
weights and version."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core")

E2E = Path(__file__).parent / "e2e"
sys.path.insert(0, str(E2E))
import weight_sync_models as models  # noqa: E402

GROUP = "source_patch_weights"
STEPS, TAMPER, DIE = 4, "2:1", "4:1"   # update 2: a corrupted bucket; update 4: the trainer dies
PROMPTS, NEW = models.PROMPTS, models.NEW
TRAINER_SPECS = f"megatron_cpu,weight_sync,{E2E / 'weight_sync_distopt_cpu.yaml'}"


def trainer_ranks(tmp: Path, port: int) -> list:
    master = models.free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "SOURCE_PATCH": TRAINER_SPECS, "SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1",
           "SOURCE_PATCH_WEIGHT_SYNC_PORT": str(port), "SOURCE_PATCH_WEIGHT_SYNC_BUCKET_BYTES": "4K",
           "SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "60", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master)}
    return [subprocess.Popen([sys.executable, str(E2E / "weight_sync_trainer.py"), str(tmp / "trainer"),
                              "--distributed-optimizer", "--steps", str(STEPS), "--ep", "2", "--die-after", DIE,
                              "--tamper", TAMPER],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=open(tmp / f"trainer.rank{r}.log", "w"), stderr=subprocess.STDOUT)
            for r in range(2)]


@pytest.fixture(scope="module")
def synced(sglang_server, weight_sync_server_env, tmp_path_factory):
    """The orchestration an RL framework does over HTTP, step after step; what the
    server generated and served after each update."""
    from source_patch.testing.sglang import tiny_checkpoint

    tmp = tmp_path_factory.mktemp("weight-sync-engine")
    model = tiny_checkpoint(**models.checkpoint_config())
    server = sglang_server(specs=["weight_sync"], args=["--skip-server-warmup", "--disable-radix-cache"],
                           env=weight_sync_server_env, model=model)  # shared: tests/conftest.py
    port = models.free_port()
    seen = {"before": server.generate(input_ids=PROMPTS, max_new_tokens=NEW, sampling={"ignore_eos": True})}
    init = {}
    joiner = threading.Thread(target=lambda: init.update(reply=server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": GROUP, "backend": "gloo"}, timeout=300)))
    joiner.start()
    procs = trainer_ranks(tmp, port)
    joiner.join(300)
    assert init.get("reply", (0,))[0] == 200 and init["reply"][1]["success"], (init, _logs(tmp))
    updates = []
    for update in range(1, STEPS + 1):
        assert server.post("/begin_weight_update")[0] == 200
        status, reply = server.post("/update_weights_from_distributed", {
            "names": [], "dtypes": [], "shapes": [], "group_name": GROUP, "load_format": "source_patch"},
            timeout=300)
        assert server.post("/end_weight_update")[0] == 200
        out = server.generate(input_ids=PROMPTS, max_new_tokens=NEW, sampling={"ignore_eos": True})
        updates.append({"status": status, "reply": reply, "outputs": out})
    codes = [p.wait(120) for p in procs]
    return model, tmp, seen, updates, codes, server


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(tmp.glob("*.log")))


def tokens(update) -> list:
    return [o["output_ids"] for o in update["outputs"]]


def versions(update) -> set:
    return {o["meta_info"]["weight_version"] for o in update["outputs"]}


def test_each_update_serves_the_trainers_weights_and_version(synced, sglang_cpu):
    model, tmp, seen, updates, codes, _ = synced
    for step in (1, 3):
        update = updates[step - 1]
        assert update["status"] == 200 and update["reply"]["success"], (update["reply"], _logs(tmp))
        assert tokens(update) == models.reference(model, tmp, step)
        assert versions(update) == {str(step)}
    assert tokens(updates[0]) != [o["output_ids"] for o in seen["before"]]
    assert tokens(updates[2]) != tokens(updates[0])  # training moved the weights


def test_a_corrupted_bucket_is_refused_and_the_previous_weights_stay(synced, sglang_cpu):
    model, tmp, seen, updates, codes, _ = synced
    failed = updates[1]
    assert not failed["reply"]["success"] and "checksum mismatch in bucket(s) 1 of" in failed["reply"]["message"]
    assert tokens(failed) == tokens(updates[0]) and versions(failed) == {"1"}
    trainer = json.loads((tmp / "trainer.rank0.json").read_text())  # the trainer's side of it
    assert trainer[1]["version"] == 1 and "ChecksumMismatch" in trainer[1]["last_error"]
    assert trainer[2]["version"] == 3  # the next step syncs again


def test_a_trainer_killed_mid_update_leaves_the_server_on_the_previous_weights(synced, sglang_cpu):
    model, tmp, seen, updates, codes, server = synced
    failed = updates[3]
    assert not (failed["status"] == 200 and failed["reply"].get("success")), failed["reply"]
    assert codes[0] == 17  # the sending rank exited while sending update 4, on purpose
    assert server.alive() and server.get("/health")[0] == 200
    assert tokens(failed) == tokens(updates[2]) and versions(failed) == {"3"}
