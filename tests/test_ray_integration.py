"""source_patch.integrations.ray without a cluster: the runtime_env it builds (strings
only, read back by the runtime as meant), routing files from several actors merged into
one replay source (paths and contents checked), what an actor says about its endpoints
(no tokens), the weight-sync rendezvous bodies.  The Ray cluster itself:
tests/test_ray_example.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from source_patch.integrations import ray as sp_ray
from source_patch.patcher import SpecError
from source_patch.runtime.core import settings
from source_patch.runtime.routing.records.file import RoutingRecordError
from source_patch.runtime.routing.records.record import RoutingRecord


def test_runtime_env_carries_specs_and_settings_as_strings_the_runtime_reads_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "mine.yaml"
    spec.write_text((Path(__file__).parent.parent / "patches" / "megatron_topk.yaml").read_text())
    env = sp_ray.runtime_env(["routing", "mine.yaml"], settings={
        "dump": {"enable": True, "dir": "dumps", "layers": "0-3,7", "names": ["attn_*", "logits"], "port": 0},
        "weight_sync": {"timeout_s": 30, "bucket_bytes": "64M", "backend": "gloo"}},
        env={"SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture"}, base={"env_vars": {"A": "1"}, "pip": ["x"]})
    variables = env["env_vars"]
    assert env["pip"] == ["x"] and variables["A"] == "1"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())
    assert variables["SOURCE_PATCH"] == f"routing,{spec}"  # a bundled name stays a name, a file becomes absolute
    assert variables["SOURCE_PATCH_DUMP_DIR"] == str(tmp_path / "dumps")  # workers start in another folder
    assert variables["SOURCE_PATCH_ROUTING_SGLANG_MODE"] == "capture"
    dump = settings.resolve("dump", variables)
    assert (dump["enable"], dump["layers"], dump["names"]) == (True, ["0-3", 7], ["attn_*", "logits"])
    sync = settings.resolve("weight_sync", variables)
    assert (sync["timeout_s"], sync["bucket_bytes"], sync["backend"]) == (30.0, 64 << 20, "gloo")


def test_runtime_env_refuses_what_a_worker_could_not_use():
    with pytest.raises(SpecError, match="no spec file or bundled spec named"):
        sp_ray.runtime_env(["mo"])  # a typo fails in the driver, not in every worker
    with pytest.raises(KeyError, match="unknown runtime component 'dumps'"):
        sp_ray.runtime_env(settings={"dumps": {"enable": True}})
    with pytest.raises(KeyError, match="valid keys"):
        sp_ray.runtime_env(settings={"dump": {"enabled": True}})
    with pytest.raises(ValueError, match="boolean"):
        sp_ray.runtime_env(settings={"dump": {"enable": "sometimes"}})
    with pytest.raises(TypeError, match="strings"):
        sp_ray.runtime_env(env={"SOURCE_PATCH_STRICT": 1})


def test_the_start_hook_activates_from_the_runtime_envs_variables_alone(tmp_path):
    """What a Ray worker gets: a fresh interpreter with these variables and no other."""
    env = sp_ray.runtime_env(["megatron_topk"], settings={"dump": {"enable": True, "dir": tmp_path}})
    code = ("import json, sys; from source_patch.integrations import ray as r; "
            "from source_patch.runtime.core import settings; "
            "print(json.dumps([r._active_specs(), settings.resolve('dump')['enable']]))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env["env_vars"]}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [["megatron_topk"], True]


def request_file(folder: Path, rid: str, first: int = 0) -> Path:
    record = RoutingRecord(indices={0: torch.tensor([[first, 1], [2, 3], [1, 4]])}, num_experts=8,
                           token_order="requests", sample_ids=[rid], seq_lens=[3], source="sglang",
                           extra={"rank": 0, "start_pos": 0})
    return record.save(folder / "rank0" / f"{rid}.safetensors")


def answer(folder: Path) -> dict:
    """What local_route_files answers for ``folder`` (without Ray's node address)."""
    return {"node": "n", "pid": 1, "dir": str(folder),
            "files": {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}}


def test_routing_files_of_several_actors_merge_into_one_replay_source(tmp_path, monkeypatch):
    monkeypatch.setattr(sp_ray, "node_address", lambda: "10.0.0.7")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    request_file(a, "r1"), request_file(a, "r2"), request_file(b, "r3")
    (a / "rank0" / "link.safetensors").symlink_to(a / "rank0" / "r1.safetensors")  # not a file of its own
    part = sp_ray.local_route_files(str(a))
    assert sorted(part["files"]) == ["rank0/r1.safetensors", "rank0/r2.safetensors"] and part["node"] == "10.0.0.7"
    records = sp_ray.merge_route_files([part, answer(b)], tmp_path / "into")
    assert sorted(records) == ["r1", "r2", "r3"] and records["r3"].indices[0].tolist()[0] == [0, 1]
    assert (tmp_path / "into" / "actor-1" / "rank0" / "r3.safetensors").is_file()
    with pytest.raises(ValueError, match="exceed"):
        sp_ray.local_route_files(str(a), max_bytes=100)


def test_merging_refuses_paths_outside_its_folder_and_disagreeing_copies(tmp_path):
    request_file(tmp_path / "a", "r1")
    request_file(tmp_path / "b", "r1", first=5)  # the same request routed differently elsewhere
    data = (tmp_path / "a" / "rank0" / "r1.safetensors").read_bytes()
    for bad in ("../escape.safetensors", "/etc/x.safetensors", "rank0/../../x.safetensors", "rank0/r1.txt",
                "rank0//r1.safetensors", ".hidden/r1.safetensors"):
        with pytest.raises(ValueError, match="not a plain relative path"):
            sp_ray.merge_route_files([{"node": "n", "files": {bad: data}}], tmp_path / "into")
    assert not (tmp_path / "escape.safetensors").exists()
    with pytest.raises(RoutingRecordError, match="captured different routes"):
        sp_ray.merge_route_files([answer(tmp_path / "a"), answer(tmp_path / "b")], tmp_path / "merged")
    with pytest.raises(RoutingRecordError):  # bytes that are not a routing file
        sp_ray.merge_route_files([{"node": "n", "files": {"rank0/x.safetensors": b"\0" * 64}}], tmp_path / "junk")


def test_an_actor_lists_its_own_endpoints_without_their_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(sp_ray, "node_address", lambda: "10.0.0.7")
    for key, value in {"ENABLE": "1", "DIR": str(tmp_path / "dumps"), "EXP_NAME": "train"}.items():
        monkeypatch.setenv(f"SOURCE_PATCH_DUMP_{key}", value)
    monkeypatch.setenv("SOURCE_PATCH_TRACE_DIR", str(tmp_path / "trace"))
    monkeypatch.setenv("SOURCE_PATCH_ROUTING_SGLANG_DIR", str(tmp_path / "routes"))
    control, trace = tmp_path / "dumps" / "train" / "control", tmp_path / "trace"
    control.mkdir(parents=True), trace.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid, port in ((os.getpid(), 1), (child.pid, 2), (1, 3)):  # pid 1 is no child of this process
            (control / f"h-p{pid}.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "token": "secret",
                                                                "pid": pid, "rank": None}))
        (trace / f"h-p{os.getpid()}-rank0.json").write_text(json.dumps(
            {"url": "http://127.0.0.1:9", "ws": "ws://127.0.0.1:9/ws", "token": "secret", "page": "x#secret",
             "pid": os.getpid(), "rank": 0}))
        found = sp_ray.local_endpoints()
    finally:
        child.kill()
        child.wait()
    assert found["node"] == "10.0.0.7" and found["dump_dir"] == str(tmp_path / "dumps" / "train")
    assert sorted(e["url"] for e in found["dump_control"]) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert [t["ws"] for t in found["trace"]] == ["ws://127.0.0.1:9/ws"]
    assert "secret" not in json.dumps(found) and found["routes"] == str(tmp_path / "routes")


def test_the_weight_sync_rendezvous_gives_each_engine_its_rank_offset():
    from source_patch.runtime.weight_sync import sync

    before = sync.configure()
    try:
        bodies = sp_ray.local_weight_sync_rendezvous([2, 2], host="127.0.0.1", port=29999)
        assert sync.configure()["port"] == 29999 and sync.configure()["world_size"] == 5
    finally:
        sync.configure(**{k: before[k] for k in ("host", "port", "world_size")})
    assert [b["rank_offset"] for b in bodies] == [1, 3]
    assert all(b["world_size"] == 5 and b["master_address"] == "127.0.0.1" and b["master_port"] == 29999
               and b["group_name"] == "source_patch_weights" and b["backend"] in ("gloo", "nccl") for b in bodies)
