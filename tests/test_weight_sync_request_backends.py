"""The request backends' two ends in one process (runtime/weight_sync/ipc.py,
mooncake.py, backend.py): what the trainer exports or registers, the engine request's
bytes (JSON, never a pickle), and what an engine refuses.  The SGLang end to end runs
are in test_weight_sync_backends.py; the CUDA IPC path between two processes is
gpu-marked here."""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from source_patch.runtime.weight_sync import backend, ipc, wire
from source_patch.runtime.weight_sync.wire import ChecksumMismatch, ManifestError, WeightSyncError

LIMITS = dict(max_metadata_bytes=1 << 20, max_update_bytes=1 << 30)


def tensors(seed=0, big=6000):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, generator=gen), torch.arange(7, dtype=torch.int64),
            torch.randn(big, generator=gen).to(torch.bfloat16)]


def manifest(ts, bucket=4096, version=3):
    return wire.plan([(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(ts)], bucket, version)


def receive(payload, device="cpu"):
    return backend.receive_request(payload, device=torch.device(device), **LIMITS)


@pytest.fixture
def ipc_sender():
    sender = ipc.IpcSender(["http://127.0.0.1:1"], 10, device=torch.device("cpu"))
    yield sender
    sender.close()


def test_ipc_moves_every_tensor_bitwise_and_exports_its_memory_once(ipc_sender):
    for version in (1, 2, 3):
        ts = tensors(seed=version)
        m = manifest(ts, version=version)
        payload = ipc_sender.stage(m, ts, iter(ts))
        update = receive(payload)
        assert update.version == version and m.buckets > 1
        assert [name for name, _ in update.tensors] == ["t0", "t1", "t2"]
        assert all(torch.equal(got, want) for (_, got), want in zip(update.tensors, ts))
    assert ipc_sender.exports == 1  # the same memory, update after update
    bigger = tensors(big=9000)  # more bytes than before
    receive(ipc_sender.stage(manifest(bigger), bigger, iter(bigger)))
    assert ipc_sender.exports == 2  # it had to move: exported again


def test_the_engine_request_is_json_with_the_memory_and_the_sums(ipc_sender):
    ts = tensors()
    payload = ipc_sender.stage(manifest(ts), ts, iter(ts))
    doc = json.loads(payload)  # plain JSON: no pickle anywhere
    assert doc["backend"] == "ipc" and doc["memory"]["kind"] == "shm" and len(doc["sums"]) == doc["total_bytes"] // 4096 + 1
    assert list(doc)[-1] == "tensors" and os.path.exists(Path(ipc.SHM_DIR) / doc["memory"]["name"])
    ipc_sender.close()
    assert not os.path.exists(Path(ipc.SHM_DIR) / doc["memory"]["name"])


def test_a_wrong_sum_or_changed_bytes_are_refused_by_bucket(ipc_sender):
    ts = tensors()
    payload = ipc_sender.stage(manifest(ts), ts, iter(ts))
    doc = json.loads(payload)
    doc["sums"][1] += 1
    with pytest.raises(ChecksumMismatch, match=r"update v3: checksum mismatch in bucket\(s\) 1 of 3"):
        receive(json.dumps(doc).encode())
    ipc_sender.memory.tensor[0] += 1  # the trainer's memory changed after it was summed
    with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) 0 of 3"):
        receive(payload)


def test_from_buffers_the_stream_is_the_buffers_bytes(ipc_sender):
    flat = torch.randn(1024)
    views = [("a", flat[:256].view(16, 16)), ("b", flat[256:1024])]
    m, buffers = wire.plan_buffers(views, 1024, 5, extra=[("c", (3,), torch.float32)])
    extra = torch.tensor([1.0, 2.0, 3.0])
    update = receive(ipc_sender.stage(m, buffers, iter([extra])))
    got = dict(update.tensors)
    assert torch.equal(got["a"], views[0][1]) and torch.equal(got["b"], views[1][1]) and torch.equal(got["c"], extra)


@pytest.mark.parametrize("change, error", [
    (lambda d: d["memory"].update(name="../../etc/passwd"), "bad shared-memory export"),
    (lambda d: d["memory"].update(name="sp-ws-1-1-deadbeef"), "cannot open the trainer's shared memory"),
    (lambda d: d["memory"].update(nbytes=1 << 40), "holds"),
    (lambda d: d.update(memory={"kind": "pickle"}), "names no exported memory"),
    (lambda d: d.update(backend="nccl"), "expected ipc or mooncake"),
    (lambda d: d.update(sums=[1]), "bucket sums for 3 buckets"),
])
def test_a_bad_request_is_refused_with_a_reason(ipc_sender, change, error):
    ts = tensors()
    doc = json.loads(ipc_sender.stage(manifest(ts), ts, iter(ts)))
    change(doc)
    with pytest.raises(WeightSyncError, match=error):
        receive(json.dumps(doc).encode())


@pytest.mark.parametrize("plant", ["foreign", "link"])
def test_an_export_not_of_this_user_is_never_mapped(ipc_sender, plant):
    """/dev/shm is everyone's: a request naming a file another user planted there (or a
    link to one) is refused before it is mapped (issue 57's observation)."""
    if plant == "foreign" and os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    ts = tensors()
    doc = json.loads(ipc_sender.stage(manifest(ts), ts, iter(ts)))
    name = f"sp-ws-{os.getpid()}-999999-{secrets.token_hex(4)}"
    path = Path("/dev/shm") / name
    real = Path("/dev/shm") / f"{name}-target"
    try:
        real.write_bytes(bytes(doc["memory"]["nbytes"]))
        if plant == "foreign":
            real.rename(path)
            os.chown(path, 65534, 65534)
        else:
            path.symlink_to(real)
        doc["memory"]["name"] = name
        with pytest.raises(ManifestError, match="not a regular file of this user's"):
            receive(json.dumps(doc).encode())
    finally:
        for p in (path, real):
            p.unlink(missing_ok=True)


def test_request_size_and_update_size_limits_hold_before_anything_is_mapped(ipc_sender):
    ts = tensors()
    payload = ipc_sender.stage(manifest(ts), ts, iter(ts))
    with pytest.raises(ManifestError, match="max_metadata_bytes"):
        backend.receive_request(payload, device=torch.device("cpu"), max_metadata_bytes=100, max_update_bytes=1 << 30)
    with pytest.raises(ManifestError, match="max_update_bytes"):
        backend.receive_request(payload, device=torch.device("cpu"), max_metadata_bytes=1 << 20, max_update_bytes=64)


def test_a_sender_without_engines_says_which_setting_is_missing():
    with pytest.raises(WeightSyncError, match="SOURCE_PATCH_WEIGHT_SYNC_ENGINES"):
        backend.open_backend("ipc", engines=None, timeout_s=1)
    with pytest.raises(WeightSyncError, match="unknown weight-sync backend 'rdma'"):
        backend.open_backend("rdma")


def test_the_nccl_ctas_setting_reaches_the_update_groups_options(monkeypatch):
    """weight_sync.nccl_ctas goes from the settings to the group the trainer opens (its
    NCCL options are made from it: link._options, run on GPUs by the benches)."""
    from source_patch.runtime.core import settings
    from source_patch.runtime.weight_sync import link, sync

    opened = []
    monkeypatch.setattr(link, "open_group", lambda *args: opened.append(args) or object())
    monkeypatch.setattr(link, "Link", lambda group, timeout_s: type("L", (), {"broken": None, "group": None})())
    config = settings.resolve("weight_sync", {"SOURCE_PATCH_WEIGHT_SYNC_NCCL_CTAS": "32",
                                              "SOURCE_PATCH_WEIGHT_SYNC_PORT": "29999",
                                              "SOURCE_PATCH_WEIGHT_SYNC_BACKEND": "nccl"})
    monkeypatch.setattr(sync, "_config", config)
    monkeypatch.setattr(sync, "_backend", None)
    sync._connected()
    monkeypatch.setattr(sync, "_backend", None)
    assert opened and opened[0][5] == "nccl" and opened[0][-1] == 32, opened
    assert settings.resolve("weight_sync", {})["nccl_ctas"] == 0  # NCCL's own choice by default
    with pytest.raises(ValueError):
        settings.resolve("weight_sync", {"SOURCE_PATCH_WEIGHT_SYNC_NCCL_CTAS": "-1"})


def test_mooncake_moves_every_tensor_bitwise_and_registers_once():
    pytest.importorskip("mooncake.engine")
    from source_patch.runtime.weight_sync import mooncake

    sender = mooncake.MooncakeSender(["http://127.0.0.1:1"], 10)
    try:
        for version in (1, 2):
            ts = tensors(seed=version)
            update = receive(sender.stage(manifest(ts, version=version), ts, iter(ts)))
            assert update.version == version
            assert all(torch.equal(got, want) for (_, got), want in zip(update.tensors, ts))
        assert sender.registrations == 1
        doc = json.loads(sender.stage(manifest(ts, version=3), ts, iter(ts)))
        doc["sums"][2] -= 1
        with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) 2 of 3"):
            receive(json.dumps(doc).encode())
        doc["memory"]["segment"] = "127.0.0.1:1"  # nobody there
        with pytest.raises(WeightSyncError, match="the trainer is gone"):
            receive(json.dumps(doc).encode())
    finally:
        sender.close()


ENGINE = """
import sys, torch
from source_patch.runtime.weight_sync import backend
torch.cuda.set_device(int(sys.argv[2]))
update = backend.receive_request(open(sys.argv[1], "rb").read(), device=torch.device("cuda", int(sys.argv[2])),
                                 max_metadata_bytes=1 << 24, max_update_bytes=1 << 34)
torch.save({name: t.cpu() for name, t in update.tensors}, sys.argv[1] + ".pt")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_an_engine_process_on_each_gpu_copies_the_trainers_buckets_bitwise(tmp_path):
    """Colocated: the trainer's exported device memory, mapped by an engine process on
    each GPU (the peer GPU reads it over the interconnect), every tensor checked."""
    sender = ipc.IpcSender(["http://127.0.0.1:1"], 60, device=torch.device("cuda", 0))
    try:
        ts = [t.cuda() for t in tensors(big=1 << 20)]
        payload = sender.stage(manifest(ts, bucket=1 << 20), ts, iter(ts))
        assert json.loads(payload)["memory"]["kind"] == "cuda"
        (tmp_path / "req").write_bytes(payload)
        for gpu in range(min(2, torch.cuda.device_count())):
            subprocess.run([sys.executable, "-c", ENGINE, str(tmp_path / "req"), str(gpu)], check=True, timeout=120)
            got = torch.load(tmp_path / "req.pt", weights_only=True)
            assert all(torch.equal(got[f"t{i}"], t.cpu()) for i, t in enumerate(ts)), gpu
    finally:
        sender.close()


E2E = Path(__file__).parent / "e2e"
sys.path.insert(0, str(E2E))
import weight_sync_models as models  # noqa: E402
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                 reason="needs two GPUs")]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["--tp", "--ep"])
@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=TWO_GPUS)], ids=["cpu-shm", "cuda-ipc"])
def test_colocated_a_trainer_over_two_devices_feeds_an_engine_receiver_on_each_bitwise(tmp_path, parallel, cuda):
    """tests/e2e/weight_sync_colocated.py: Megatron with TP 2 or EP 2 over two devices
    (real gathers: NCCL on GPUs, gloo on CPU), in DDP's buffers, push() by ipc through
    the packed push's program (windows gathered into kept slots; on a GPU the third
    push replays captured graphs, after every parameter changed in place), an engine
    receiver next to each trainer rank maps the export and checks every tensor bitwise."""
    pytest.importorskip("megatron.core")
    from source_patch.runtime.core.endpoint import free_port

    out = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **({} if cuda else {"SOURCE_PATCH": "megatron_cpu",
                                                              "CUDA_VISIBLE_DEVICES": ""})}
    script = str(E2E / "weight_sync_colocated.py")
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("rank0", "rank1", "engine0", "engine1")]
    procs = [subprocess.Popen([sys.executable, script, "trainer", out, parallel, "2", *(["--cuda"] if cuda else [])],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(2)]
    procs += [subprocess.Popen([sys.executable, script, "engine", out, f"cuda:{d}" if cuda else str(d)], env=env,
                               stdout=logs[2 + d], stderr=subprocess.STDOUT) for d in range(2)]
    codes = models.exit_codes(procs)
    text = "\n".join((tmp_path / f"{n}.log").read_text()[-1500:] for n in ("rank0", "rank1", "engine0", "engine1"))
    assert codes == [0, 0, 0, 0], text
    trainer = json.loads(Path(f"{out}.trainer.json").read_text())
    # three pushes (the last after every parameter changed in place), by the packed push's program
    assert trainer["counters"]["pushes"] == 3 and trainer["counters"]["failures"] == 0 and trainer["counters"]["gathers"] > 0, trainer
    assert trainer["planned"] is True, trainer
    for d in range(2):
        engine = json.loads(Path(f"{out}.engine{d}.json").read_text())
        assert engine.get("version") == 7 and engine["names_match"] and engine["mismatched"] == [], engine
        assert engine["tensors"] > 10 and engine["device"] == (f"cuda:{d}" if cuda else "cpu")


COPYSUM = """
import json, torch
from source_patch.runtime.weight_sync import copysum, wire
cases = {}
for total, bucket in ((1 << 16, 4096), (12352, 4096), (3 << 20, 1 << 20)):
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(total))
    src[:8] = 255  # words near 2**64: the sums wrap
    dst, n = torch.empty(total, dtype=torch.uint8), -(-total // bucket)
    sums, ref = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    copysum.copy_and_sum(src, dst, bucket, sums)
    for k in range(n):
        wire.bucket_sum(src[k * bucket: (k + 1) * bucket], ref[k])
    cases[f"{total}/{bucket}"] = [torch.equal(src, dst), torch.equal(sums, ref)]
print(json.dumps({"cases": cases, "blocks": [copysum.block_for(b) for b in (4096, 48, 1 << 20, 4104)]}))
"""


def test_the_fused_copy_and_checksum_kernel_equals_a_copy_and_bucket_sums_under_tritons_interpreter():
    """runtime/weight_sync/copysum.py (the colocated ipc receive on a GPU) run by
    Triton's interpreter on CPU: the copy is exact and each bucket's sum is
    wire.bucket_sum's, wrapping included; a block never straddles two buckets."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", COPYSUM], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(copied and summed for copied, summed in result["cases"].values()), result
    assert result["blocks"] == [512, 0, 4096, 0]  # 4104 bytes: 513 words, odd: not fused
