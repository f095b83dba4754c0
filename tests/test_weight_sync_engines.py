"""One trainer, several engines (setting weight_sync.groups, broadcast.Fanout): an
update group per engine, one broadcast per group, each group with its own handshake,
checksums, verdict and version.

Processes (gloo, CPU): a Megatron-Core trainer (tests/e2e/weight_sync_overlap_trainer.py)
pushes to engine A, one rank (a TP 1 engine), and engine B, two ranks (standing for a
TP 2 engine: both ranks receive every byte, each takes its own slice at load).  The
engine ranks run the transport's receiver (tests/e2e/weight_sync_group_receiver.py),
the stand-in tests/test_weight_sync.py uses for the engine; SGLang's own path with one
group is tests/test_weight_sync_engine.py's.
"""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from source_patch.runtime.weight_sync import broadcast as wt_broadcast
from source_patch.runtime.weight_sync import sync as weight_sync

E2E = Path(__file__).parent / "e2e"
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(Path(__file__).parent))
import weight_sync_models as models  # noqa: E402
from test_weight_sync import finish, start  # noqa: E402
from test_weight_sync_overlap import COMMON, differing  # noqa: E402

STEPS = 3


def test_the_groups_setting_is_checked_and_parsed():
    assert weight_sync.configure(groups="29600:2, 29601:3:tp2")["groups"] == ["29600:2", "29601:3:tp2"]
    assert wt_broadcast.parse_groups(["29600:2", "29601:3:tp2"], "sp") == [
        {"port": 29600, "world_size": 2, "group_name": "sp"}, {"port": 29601, "world_size": 3, "group_name": "tp2"}]
    for bad in ("29600", "x:2", "29600:1", "29600:2,29600:3"):
        with pytest.raises(ValueError):
            weight_sync.configure(groups=bad)
    weight_sync.configure(groups=None)


def test_groups_are_refused_with_a_request_backend():
    weight_sync.configure(groups="29600:2", backend="ipc", engines="http://127.0.0.1:1")
    try:
        with pytest.raises(weight_sync.weight_backend.WeightSyncError, match="broadcast backends"):
            weight_sync._connected()
    finally:
        weight_sync.configure(groups=None, backend="auto", engines=None)


ENGINES = {"a": 1, "b": 2}  # engine -> its ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """plain: from DDP's buffers, engine B's rank 2 finds bucket 1 of update 2
    corrupted; overlap: the packed push (program), overlapped."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("engines")
    plans = {"plain": ([], {("b", 2): ["--tamper", "2:1"]}), "overlap": (["--overlap", "--packed"], {})}
    procs = {}
    for run, (trainer_args, tamper) in plans.items():
        ports = {engine: models.free_port() for engine in ENGINES}
        procs[run] = [start([E2E / "weight_sync_group_receiver.py", tmp / f"{run}.{engine}{rank}", "--port",
                             ports[engine], "--rank", rank, "--world-size", ranks + 1, "--group-name",
                             f"engine_{engine}", "--updates", STEPS, *tamper.get((engine, rank), [])],
                            COMMON, open(tmp / f"{run}.{engine}{rank}.log", "w"))
                      for engine, ranks in ENGINES.items() for rank in range(1, ranks + 1)]
        groups = ",".join(f"{ports[e]}:{ranks + 1}:engine_{e}" for e, ranks in ENGINES.items())
        procs[run].append(start([E2E / "weight_sync_overlap_trainer.py", tmp / f"{run}.trainer", "--groups", groups,
                                 "--steps", STEPS, "--work", "1", *trainer_args],
                                COMMON | {"SOURCE_PATCH_CACHE": str(tmp / "cache")},
                                open(tmp / f"{run}.trainer.log", "w")))
    deadline = time.monotonic() + 240
    codes = {run: finish(p, deadline) for run, p in procs.items()}
    logs = {p.name: p.read_text()[-2000:] for p in tmp.glob("*.log")}
    return tmp, codes, logs


def load(tmp, run, who):
    from safetensors.torch import load_file

    per_version = {}
    for key, tensor in load_file(tmp / f"{run}.{who}.safetensors").items():
        version, name = key.split("/", 1)
        per_version.setdefault(int(version), {})[name] = tensor
    return per_version


def ranks():
    return [f"{engine}{rank}" for engine, n in ENGINES.items() for rank in range(1, n + 1)]


@pytest.mark.parametrize("run", ["plain", "overlap"])
def test_every_engine_rank_of_every_group_gets_every_version_bitwise(runs, run):
    tmp, codes, logs = runs
    assert codes[run] == [0] * (len(ranks()) + 1), logs
    expected = load(tmp, run, "trainer")
    for who in ranks():
        got = load(tmp, run, who)
        versions = [v for v in range(1, STEPS + 1) if not (run == "plain" and who.startswith("b") and v == 2)]
        assert sorted(got) == versions, (who, sorted(got))
        for version in versions:
            assert len(got[version]) == len(expected[version]) > 100
            assert differing(expected[version], got[version]) == [], (who, version)
    state = json.loads((tmp / f"{run}.trainer.json").read_text())["state"]
    assert [g["version"] for g in state["groups"]] == [STEPS, STEPS]


def test_a_group_that_refuses_an_update_keeps_its_version_and_the_others_take_it(runs):
    """Engine B's rank 2 finds update 2 corrupted: both of B's ranks refuse it (one
    verdict per group) and B keeps serving v1; engine A takes v2; the trainer's push of
    v2 fails naming engine B alone; v3 reaches both."""
    tmp, codes, logs = runs
    assert codes["plain"] == [0] * (len(ranks()) + 1), logs
    report = {who: json.loads((tmp / f"plain.{who}.json").read_text())["updates"] for who in ranks()}
    assert [u.get("version") for u in report["a1"]] == [1, 2, 3]
    for who in ("b1", "b2"):
        assert [u.get("version") for u in report[who]] == [1, None, 3]
        refused = report[who][1]
        assert refused["served"] == 1, refused
        assert ("ChecksumMismatch" if who == "b2" else "failed on another engine rank") in refused["error"], refused
    trainer = json.loads((tmp / "plain.trainer.json").read_text())
    errors = [row["error"] for row in trainer["rows"]]
    assert errors[0] is None and errors[2] is None
    assert "failed on 1 of 2 engine groups" in errors[1] and "engine_b@" in errors[1] and "engine_a@" not in errors[1]
    a, b = trainer["state"]["groups"]
    assert (a["updates"], a["failures"], b["updates"], b["failures"]) == (3, 0, 2, 1)
    assert b["last_error"].startswith("v2: ChecksumMismatch")


@pytest.mark.parametrize("run", ["plain", "overlap"])
def test_the_bytes_go_once_per_group_and_every_rank_of_a_group_gets_them(runs, run):
    """Counted on each link (Link.broadcast_bytes): per update, the trainer hands each
    group's broadcast the update's bytes and its checksums once (plus the manifest the
    first time); every rank of the group receives exactly that; the trainer's total
    is the update's bytes once per group."""
    tmp, codes, logs = runs
    assert codes[run] == [0] * (len(ranks()) + 1), logs
    report = {who: json.loads((tmp / f"{run}.{who}.json").read_text())["updates"] for who in ranks()}
    last = report["a1"][-1]
    update_bytes = last["total_bytes"] + 8 * last["buckets"]  # the buckets and their int64 sums
    assert last["bytes"] == update_bytes
    for who in ranks():
        assert report[who][-1]["bytes"] == update_bytes, who
        assert report[who][0]["bytes"] > update_bytes  # the first update: the manifest too
    groups = json.loads((tmp / f"{run}.trainer.json").read_text())["state"]["groups"]
    assert [g["bytes"] for g in groups] == [update_bytes] * len(ENGINES)  # the last update, per group
