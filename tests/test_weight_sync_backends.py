"""The request backends into a REAL SGLang server (CPU): Megatron trains (two ranks,
expert parallel 2, distributed optimizer) and after every step pushes its weights by
``ipc`` (shared memory on CPU) or ``mooncake`` (TransferEngines over loopback TCP that
find each other through a real mooncake_master's metadata server), posting each
update itself to the server's own admin
request ``update_weights_from_tensor`` with load_format "source_patch"
(patches/weight_sync.yaml active in the server's scheduler; nothing is unpickled).
After each update the server generates what transformers generates with the
trainer's weights of that step and serves the trainer's version; a wrong checksum
is refused and the server keeps its old version; a trainer killed in the middle of
an update leaves the server serving the previous weights and version."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core")

E2E = Path(__file__).parent / "e2e"
sys.path.insert(0, str(E2E))
import weight_sync_models as models  # noqa: E402

STEPS, TAMPER, DIE = 4, "2:1", "4:1"   # update 2: a wrong bucket sum; update 4: the trainer dies
TRAINER_SPECS = f"megatron_cpu,weight_sync,{E2E / 'weight_sync_distopt_cpu.yaml'}"


def trainer_ranks(tmp: Path, backend: str, url: str, extra_env: dict) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "SOURCE_PATCH": TRAINER_SPECS, "SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1",
           "SOURCE_PATCH_WEIGHT_SYNC_BACKEND": backend, "SOURCE_PATCH_WEIGHT_SYNC_ENGINES": url,
           "SOURCE_PATCH_WEIGHT_SYNC_BUCKET_BYTES": "4K", "SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "60",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(models.free_port()), **extra_env}
    return [subprocess.Popen([sys.executable, str(E2E / "weight_sync_trainer.py"), str(tmp / "trainer"),
                              "--distributed-optimizer", "--steps", str(STEPS), "--ep", "2", "--die-after", DIE,
                              "--tamper", TAMPER, "--generate", url],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=open(tmp / f"trainer.rank{r}.log", "w"), stderr=subprocess.STDOUT)
            for r in range(2)]


@pytest.fixture(scope="module")
def metadata(mooncake_metadata):
    """The URL of a real mooncake_master on 127.0.0.1 serving the TransferEngines' metadata,
    started as the feature store starts its master (tests/conftest.py)."""
    url, why = mooncake_metadata
    if url is None:
        pytest.skip(why)
    return url


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(tmp.glob("*.log")))


@pytest.fixture(scope="module", params=["ipc", "mooncake"])
def pushed(request, sglang_server, weight_sync_server_env, metadata, tmp_path_factory):
    """A trainer run that pushes by ``backend`` to a real server; what the server
    generated after each update (recorded by the trainer), and after the run."""
    from source_patch.testing.sglang import tiny_checkpoint

    backend = request.param
    tmp = tmp_path_factory.mktemp(f"weight-sync-{backend}")
    model = tiny_checkpoint(**models.checkpoint_config())
    mooncake = {"SOURCE_PATCH_WEIGHT_SYNC_MOONCAKE_METADATA": metadata}  # both ends find segments there
    # the server test_hardening_weights.py and test_weight_sync_engine.py push into too (one start)
    server = sglang_server(specs=["weight_sync"], args=["--skip-server-warmup", "--disable-radix-cache"],
                           env=weight_sync_server_env, model=model)
    assert weight_sync_server_env["SOURCE_PATCH_WEIGHT_SYNC_MOONCAKE_METADATA"] == metadata
    before = server.generate(input_ids=models.PROMPTS, max_new_tokens=models.NEW, sampling={"ignore_eos": True})
    procs = trainer_ranks(tmp, backend, server.url, mooncake)
    try:
        codes = models.exit_codes(procs)
    finally:
        for p in procs:  # the rank that died on purpose left its shared memory behind
            for leftover in Path("/dev/shm").glob(f"sp-ws-{p.pid}-*"):
                leftover.unlink()
    after = server.generate(input_ids=models.PROMPTS, max_new_tokens=models.NEW, sampling={"ignore_eos": True})
    states = json.loads((tmp / "trainer.rank0.json").read_text())
    return model, tmp, before, states, after, codes, server


def tokens(outputs) -> list:
    return [o["output_ids"] for o in outputs]


def versions(outputs) -> set:
    return {o["meta_info"]["weight_version"] for o in outputs}


def test_each_update_serves_the_trainers_weights_and_version(pushed, sglang_cpu):
    model, tmp, before, states, after, codes, _ = pushed
    assert len(states) == 3, _logs(tmp)  # the trainer died in step 4
    for step in (1, 3):
        state = states[step - 1]
        assert state["version"] == step and state["last_error"] in (None, states[1]["last_error"]), _logs(tmp)
        assert tokens(state["generated"]) == models.reference(model, tmp, step)
        assert versions(state["generated"]) == {str(step)}
    assert tokens(states[0]["generated"]) != tokens(before)
    assert tokens(states[2]["generated"]) != tokens(states[0]["generated"])  # training moved the weights


def test_a_wrong_checksum_is_refused_and_the_previous_weights_stay(pushed, sglang_cpu):
    model, tmp, before, states, after, codes, _ = pushed
    failed = states[1]
    assert failed["version"] == 1 and "ChecksumMismatch" in failed["last_error"], failed
    assert "checksum mismatch in bucket(s) 1 of" in failed["last_error"]
    assert tokens(failed["generated"]) == tokens(states[0]["generated"]) and versions(failed["generated"]) == {"1"}
    assert states[2]["version"] == 3 and states[2]["counters"]["pushes"] == 2  # the next step syncs again


def test_a_trainer_killed_mid_update_leaves_the_server_on_the_previous_weights(pushed, sglang_cpu):
    model, tmp, before, states, after, codes, server = pushed
    assert codes[0] == 17, _logs(tmp)  # the sending rank exited while staging update 4, on purpose
    assert server.alive() and server.get("/health")[0] == 200
    assert tokens(after) == tokens(states[2]["generated"]) and versions(after) == {"3"}
