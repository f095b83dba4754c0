"""The overlapped push (setting weight_sync.overlap, runtime/weight_sync/sync.py,
broadcast.Snapshot): the update is copied into a snapshot and sent on a thread while
the caller's step goes on; at most one in flight; its error surfaces at the next push,
flush() or close() and in state().

In-process: the snapshot against a wire that sends late, the error path.  Processes
(gloo, CPU): a Megatron-Core trainer (tests/e2e/weight_sync_overlap_trainer.py) pushes
every step with overlap while its main thread keeps rewriting every parameter, and an
engine rank (tests/e2e/weight_sync_group_receiver.py: the transport's receiver, the
stand-in tests/test_weight_sync.py uses; no SGLang) serves what it loaded while a
thread polls the served version and weights.
"""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from source_patch.runtime.weight_sync import broadcast as wt_broadcast
from source_patch.runtime.weight_sync import sync as weight_sync
from source_patch.runtime.weight_sync import wire
from source_patch.runtime.weight_sync import transport as wt

E2E = Path(__file__).parent / "e2e"
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(Path(__file__).parent))
import weight_sync_models as models  # noqa: E402
from test_weight_sync import finish, start  # noqa: E402

STEPS = 6


@pytest.fixture
def overlapped():
    weight_sync.configure(overlap=True)
    yield
    weight_sync.flush()
    weight_sync._inflight = None
    weight_sync.configure(overlap=False)
    weight_sync.reset()


class Late:
    """A backend whose wire starts ``delay`` seconds late (then a loopback recording)."""

    def __init__(self, delay: float, fail: str = ""):
        self.link, self.delay, self.fail = wt.LoopbackLink("cpu"), delay, fail
        self.device, self.broken, self.sent = torch.device("cpu"), None, []

    def send(self, manifest, tensors, extra=(), **_):
        time.sleep(self.delay)
        if self.fail:
            raise wire.WeightSyncError(self.fail)
        self.link.rewind()
        wt_broadcast.Broadcast(self.link).send(manifest, tensors, extra=extra)
        self.sent.append(manifest.version)


def buffer_update(version: int):
    flat = torch.arange(4096, dtype=torch.float32)
    named = [("a", flat[:1024].view(32, 32)), ("b", flat[1024:4096])]
    manifest, buffers = wire.plan_buffers(named, 4096, version)
    return flat, manifest, buffers


def test_the_update_is_copied_before_the_caller_returns_and_sent_after(overlapped):
    flat, manifest, buffers = buffer_update(3)
    before = flat.clone()
    late = Late(0.3)
    start_s = time.perf_counter()
    weight_sync._hand_over(late, manifest, buffers, ())
    returned_s = time.perf_counter() - start_s
    assert returned_s < 0.15 and weight_sync.state()["in_flight"] == 3
    flat.add_(1)  # the next step's writes, while the update waits for its wire
    assert weight_sync.flush() and late.sent == [3]
    assert weight_sync.state()["in_flight"] is None and weight_sync.state()["version"] == 3
    update = wt.receive(wt.LoopbackLink("cpu", replay=late.link))
    got = dict(update.tensors)
    assert torch.equal(got["a"].reshape(-1), before[:1024]) and torch.equal(got["b"], before[1024:])


def test_a_failed_overlapped_push_surfaces_once_at_flush_and_stays_in_state(overlapped):
    _, manifest, buffers = buffer_update(4)
    weight_sync._hand_over(Late(0.1, fail="the engine went away"), manifest, buffers, ())
    assert not weight_sync.flush()  # flush says it failed (and state() keeps why)
    state = weight_sync.state()
    assert state["counters"]["failures"] == 1 and state["counters"]["pushes"] == 0
    assert "v4" in state["last_error"] and "the engine went away" in state["last_error"]
    assert weight_sync._settle() is None and weight_sync.flush()  # raised once


def test_the_next_overlapped_push_waits_for_the_one_on_the_wire(overlapped):
    _, manifest, buffers = buffer_update(5)
    late = Late(0.3)
    weight_sync._hand_over(late, manifest, buffers, ())
    start_s = time.perf_counter()
    assert weight_sync._settle() is None  # what push() does before it touches the snapshot or the link
    assert time.perf_counter() - start_s > 0.15 and late.sent == [5]


def test_the_setting_is_checked():
    assert weight_sync.configure(overlap="1")["overlap"] is True
    weight_sync.configure(overlap=False)


# ------------------------------------------------------------------ processes


def trainer(tmp, name, port, args):
    return start([E2E / "weight_sync_overlap_trainer.py", tmp / f"{name}.trainer", "--port", port,
                  "--steps", STEPS, *args], COMMON | {"SOURCE_PATCH_CACHE": str(tmp / "cache")},
                 open(tmp / f"{name}.trainer.log", "w"))


def engine(tmp, name, port, args=()):
    return start([E2E / "weight_sync_group_receiver.py", tmp / f"{name}.engine", "--port", port,
                  "--updates", STEPS, *args], COMMON, open(tmp / f"{name}.engine.log", "w"))


COMMON = {"SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "60", "SOURCE_PATCH_WEIGHT_SYNC_BUCKET_BYTES": "64K"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """overlap: from DDP's buffers, the engine polled while it serves; packed: the
    program's path (from_buffers off); live: the control, the live buffers sent from
    the thread (no snapshot)."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("overlap")
    work = ["--overlap", "--work", "25"]
    plans = {"overlap": (work, ["--poll"]), "packed": ([*work, "--packed"], []), "live": ([*work, "--live"], [])}
    procs = {}
    for name, (trainer_args, engine_args) in plans.items():
        port = models.free_port()
        procs[name] = [engine(tmp, name, port, engine_args), trainer(tmp, name, port, trainer_args)]
    deadline = time.monotonic() + 240
    codes = {name: finish(p, deadline) for name, p in procs.items()}
    logs = {p.name: p.read_text()[-2000:] for p in tmp.glob("*.log")}
    return tmp, codes, logs


def results(tmp, name):
    from safetensors.torch import load_file

    expected, got, polls = {}, {}, []
    for key, tensor in load_file(tmp / f"{name}.trainer.safetensors").items():
        version, param = key.split("/", 1)
        expected.setdefault(int(version), {})[param] = tensor
    for key, tensor in load_file(tmp / f"{name}.engine.safetensors").items():
        if key.startswith("poll/"):
            _, i, version, param = key.split("/", 3)
            polls.append((int(i), int(version), param, tensor))
        else:
            version, param = key.split("/", 1)
            got.setdefault(int(version), {})[param] = tensor
    trainer = json.loads((tmp / f"{name}.trainer.json").read_text())
    engine = json.loads((tmp / f"{name}.engine.json").read_text())
    return expected, got, polls, trainer, engine


def differing(expected: dict, got: dict) -> list:
    return sorted(name for name in expected if name not in got or not torch.equal(expected[name], got[name]))


@pytest.mark.parametrize("name", ["overlap", "packed"])
def test_every_version_arrives_as_the_trainer_had_it_when_its_push_returned(runs, name):
    tmp, codes, logs = runs
    assert codes[name] == [0, 0], logs
    expected, got, _, trainer, engine = results(tmp, name)
    assert [u.get("version") for u in engine["updates"]] == list(range(1, STEPS + 1)), engine
    for version in range(1, STEPS + 1):
        assert len(got[version]) == len(expected[version]) > 100
        assert differing(expected[version], got[version]) == [], version
    state = trainer["state"]
    assert trainer["flushed"] and trainer["closed"] and state["version"] == STEPS
    assert state["counters"]["pushes"] == STEPS and state["counters"]["failures"] == 0
    assert state["sent_from"] == ("tensors" if name == "packed" else "buffers")


def test_the_engine_never_serves_a_half_loaded_version(runs):
    """Every poll (the served version and weights read together, as a request would,
    while the next update was on the wire) reads exactly the trainer's version."""
    tmp, codes, logs = runs
    assert codes["overlap"] == [0, 0], logs
    expected, _, polls, _, engine = results(tmp, "overlap")
    versions = engine["polls"]
    assert len(versions) > 10 and versions == sorted(versions) and len(set(versions)) > 2, versions
    for i, version, param, tensor in polls:
        assert torch.equal(tensor, expected[version][param]), (i, version, param)


def test_the_callers_step_returns_while_the_update_is_on_the_wire(runs):
    tmp, codes, logs = runs
    assert codes["overlap"] == [0, 0], logs
    rows = results(tmp, "overlap")[3]["rows"]
    for row in rows[1:]:  # (the first push also opens the group)
        assert row["on_wire_at_return"] and row["send_end_after_return_s"] > 0, row
    # the caller's time in push() is below the transfer's (wire time measured on the thread)
    assert sorted(r["push_s"] for r in rows[1:])[len(rows) // 2] < sorted(r["send_s"] for r in rows[1:])[len(rows) // 2]


def test_without_the_snapshot_the_next_steps_writes_reach_the_wire(runs):
    """The control: the same run sending the live buffers from the thread.  The next
    step's writes land between a bucket's checksum and its bytes (the engine refuses
    the version: the trainer hears of it at the next push) or before both (the engine
    would load bytes the trainer never had as that version)."""
    tmp, codes, logs = runs
    assert codes["live"] == [0, 0], logs
    expected, got, _, trainer, _ = results(tmp, "live")
    spoiled = [v for v in range(2, STEPS + 1) if v not in got or differing(expected[v], got[v])]
    assert spoiled, "the control delivered every version intact: the test would not see a missing snapshot"
    errors = [row["error"] for row in trainer["rows"] if row["error"]]
    assert all("the push before" in e for e in errors)  # surfaced at the next push
