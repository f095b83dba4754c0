"""source_patch.integrations.ray trusts nothing on disk or in an answer (issue 57,
items 5 and 7): merged routes never go through a planted link nor merge stale files,
control and token files are read only from this user's private folders (a FIFO never
hangs) and tokens go only to loopback URLs, malformed actor answers are one error
naming the actor, and SOURCE_PATCH carries exactly the validated specs.  Without a
cluster: the functions are called with crafted inputs (a stand-in for Ray where the
driver asks actors)."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from source_patch.integrations import ray as sp_ray
from source_patch.runtime.core import private
from source_patch.runtime.core.endpoint import MAX_INFO_BYTES
from source_patch.runtime.routing.records.record import RoutingRecord

BUNDLED = Path(__file__).parent.parent / "patches" / "megatron_topk.yaml"


def route_bytes(tmp_path: Path, rid: str) -> bytes:
    record = RoutingRecord(indices={0: torch.tensor([[0, 1], [2, 3], [1, 4]])}, num_experts=8,
                           token_order="requests", sample_ids=[rid], seq_lens=[3], source="sglang",
                           extra={"rank": 0, "start_pos": 0})
    return record.save(tmp_path / "made" / f"{rid}.safetensors").read_bytes()


def part(tmp_path: Path, *rids: str) -> dict:
    return {"node": "n", "files": {f"rank0/{rid}.safetensors": route_bytes(tmp_path, rid) for rid in rids}}


# ------------------------------------------------------------------ merging routes


def test_merging_never_writes_through_a_link_planted_in_its_folder(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    into = tmp_path / "into"
    (into / "actor-0" / "rank0").mkdir(parents=True)
    (into / "actor-0" / "rank0" / "r1.safetensors").symlink_to(victim)  # in a folder no merge made
    with pytest.raises(ValueError, match="no earlier merge wrote"):
        sp_ray.merge_route_files([part(tmp_path, "r1")], into)
    assert victim.read_text() == "keep me"

    merged = tmp_path / "merged"
    sp_ray.merge_route_files([part(tmp_path, "r1")], merged)  # a folder of its own, then a link in it
    link = merged / "actor-0" / "rank0" / "r1.safetensors"
    link.unlink()
    link.symlink_to(victim)
    assert sorted(sp_ray.merge_route_files([part(tmp_path, "r1")], merged)) == ["r1"]
    assert victim.read_text() == "keep me" and not link.is_symlink() and link.is_file()
    assert oct(os.stat(merged).st_mode & 0o777) == "0o700" and oct(os.stat(link).st_mode & 0o777) == "0o600"


def test_merging_does_not_merge_files_from_before(tmp_path):
    into = tmp_path / "into"
    assert sorted(sp_ray.merge_route_files([part(tmp_path, "r1", "r2")], into)) == ["r1", "r2"]
    assert sorted(sp_ray.merge_route_files([part(tmp_path, "r3")], into)) == ["r3"]  # r1, r2 are gone
    assert sorted(p.name for p in into.rglob("*.safetensors")) == ["r3.safetensors"]
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="new or empty folder"):
        sp_ray.merge_route_files([part(tmp_path, "r1")], stray)
    assert (stray / "notes.txt").read_text() == "mine" and not (stray / "actor-0").exists()


def test_merging_refuses_a_folder_others_can_write(tmp_path):
    into = tmp_path / "shared"
    into.mkdir()
    os.chmod(into, 0o777)
    with pytest.raises(private.Untrusted, match="writable by group or others"):
        sp_ray.merge_route_files([part(tmp_path, "r1")], into)
    assert list(into.iterdir()) == []


@pytest.mark.parametrize("answer, why", [
    (None, "not a route_files answer"),
    ({"node": "n"}, "not a route_files answer"),
    ({"files": [b"x"]}, "not a route_files answer"),
    ({"files": {1: b"x"}}, "named by a int"),
    ({"files": {"rank0/a.safetensors": "text"}}, "holds a str"),
    ({"files": {"rank0/a.safetensors": {"deep": [[[]]]}}}, "holds a dict"),
    ({"files": {"a.safetensors": b"x", "a.safetensors/b.safetensors": b"y"}}, "both a file and a folder"),
    ({"files": {"x" * 300 + ".safetensors": b"x"}}, "not a plain relative path"),
    ({"files": {"/".join(["d"] * 20) + ".safetensors": b"x"}}, "not a plain relative path"),
])
def test_a_malformed_route_files_answer_is_one_error_naming_the_actor(tmp_path, answer, why):
    with pytest.raises(sp_ray.ActorAnswerError, match=f"actor 1.*{why}|{why}.*actor 1"):
        sp_ray.merge_route_files([part(tmp_path, "r1"), answer], tmp_path / "into")
    assert not (tmp_path / "into").exists()  # checked before anything is written


class FakeRay:
    """What the driver's helpers use of Ray: ``actor.method.remote(...)`` and ``get``."""

    def __init__(self, answers):
        self.answers = answers

    def get(self, refs, timeout=None):
        return [self.answers[i] for i in refs]


class FakeActor:
    def __init__(self, i):
        self.i = i

    def __getattr__(self, method):
        return type("Method", (), {"remote": lambda _, *args: self.i})()

    def __repr__(self):
        return f"Actor(engine-{self.i})"


def test_an_answer_of_the_wrong_kind_names_its_actor(monkeypatch):
    monkeypatch.setattr(sp_ray, "_ray", lambda: FakeRay([{"pid": 1}, "not a dict"]))
    with pytest.raises(sp_ray.ActorAnswerError, match=r"actor 1 \(Actor\(engine-1\)\).*str, not a dict"):
        sp_ray.status([FakeActor(0), FakeActor(1)])
    monkeypatch.setattr(sp_ray, "_ray", lambda: FakeRay([[], {"status": 200}]))
    with pytest.raises(sp_ray.ActorAnswerError, match="actor 1 .*dict, not a list"):
        sp_ray.dump_request([FakeActor(0), FakeActor(1)], "GET", "/state")


# ------------------------------------------------------------------ control and token files


@pytest.fixture
def endpoints(tmp_path, monkeypatch):
    """This process's dump control folder and trace folder (settings point there)."""
    monkeypatch.setattr(sp_ray, "node_address", lambda: "10.0.0.7")
    for key, value in {"ENABLE": "1", "DIR": str(tmp_path / "dumps"), "EXP_NAME": "train"}.items():
        monkeypatch.setenv(f"SOURCE_PATCH_DUMP_{key}", value)
    monkeypatch.setenv("SOURCE_PATCH_TRACE_DIR", str(tmp_path / "trace"))
    control, trace = tmp_path / "dumps" / "train" / "control", tmp_path / "trace"
    control.mkdir(parents=True, mode=0o700), trace.mkdir(mode=0o700)
    return control, trace


def control_file(folder: Path, name: str, url: str, token: str = "t0ken") -> Path:
    path = folder / name
    private.write_private(str(folder), [name], json.dumps({"url": url, "token": token, "pid": os.getpid()}))
    return path


class Answering(BaseHTTPRequestHandler):
    """A stand-in dump endpoint: answers every request with what it was asked and with."""

    def do_GET(self):
        body = json.dumps({"path": self.path, "auth": self.headers.get("Authorization")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = HTTPServer(("127.0.0.1", 0), Answering)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_token_goes_only_to_a_loopback_url(endpoints, endpoint, tmp_path):
    control, _ = endpoints
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "state").write_text(json.dumps({"private": "key material"}))
    control_file(control, "a-p1.json", f"http://0.0.0.0:{endpoint}")  # a wildcard bind: asked on loopback
    control_file(control, "b-p2.json", f"file://{tmp_path / 'secret'}")  # would read the file into the reply
    control_file(control, "c-p3.json", "http://192.0.2.1:80")  # another host
    control_file(control, "d-p4.json", f"http://127.0.0.1:{endpoint}@192.0.2.1")  # userinfo trick
    answers = sp_ray.local_dump_request("GET", "/state")
    assert [a["status"] for a in answers] == [200, None, None, None]
    assert answers[0]["reply"] == {"path": "/state", "auth": "Bearer t0ken"}
    assert all("not a loopback http URL" in a["reply"]["error"] for a in answers[1:])
    assert "key material" not in json.dumps(answers)


@pytest.mark.parametrize("method, path", [("GET", "@192.0.2.1/state"), ("GET", "/state?x=1"), ("DELETE", "/state"),
                                          ("GET", "/state\r\nHost: x"), ("GET", "state")])
def test_a_request_the_endpoint_does_not_serve_is_refused_in_the_driver_and_the_actor(method, path):
    with pytest.raises(ValueError, match="dump request"):
        sp_ray.dump_request([], method, path)
    with pytest.raises(ValueError, match="dump request"):
        sp_ray.local_dump_request(method, path)


def test_files_planted_where_others_can_write_are_not_read(endpoints, endpoint, tmp_path):
    control, trace = endpoints
    control_file(control, "h-p1.json", f"http://127.0.0.1:{endpoint}")
    os.chmod(control, 0o777)  # anyone could have put that file there
    found = sp_ray.local_endpoints()
    assert found["dump_control"] == [] and sp_ray.local_dump_request("GET", "/state") == []
    assert any(str(control) in r and "writable by group or others" in r for r in found["refused"])
    os.chmod(control, 0o700)
    (control / "link-p2.json").symlink_to(control / "h-p1.json")
    found = sp_ray.local_endpoints()
    assert [e["file"] for e in found["dump_control"]] == [str(control / "h-p1.json")]
    assert any("link-p2.json" in r and "symbolic link" in r for r in found["refused"])
    (trace / "deep-p3.json").write_text("[" * 10_000)
    (trace / "huge-p4.json").write_text(" " * (MAX_INFO_BYTES + 1))
    refused = " ".join(sp_ray.local_endpoints()["refused"])
    assert "deep-p3.json: its content: nested deeper" in refused and "huge-p4.json: larger than" in refused


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_control_file_of_another_user_is_not_read(endpoints, endpoint):
    control, _ = endpoints
    path = control_file(control, "h-p1.json", f"http://127.0.0.1:{endpoint}")
    os.chown(path, 65534, 65534)
    found = sp_ray.local_endpoints()
    assert found["dump_control"] == [] and any("owned by uid 65534" in r for r in found["refused"])


@pytest.mark.parametrize("where", ["control", "trace"])
def test_a_fifo_among_control_or_token_files_does_not_hang(endpoints, where):
    folder = endpoints[0] if where == "control" else endpoints[1]
    fifo = folder / "h-p1.json"
    os.mkfifo(fifo)
    done = {}
    reader = threading.Thread(target=lambda: done.update(found=sp_ray.local_endpoints()), daemon=True)
    reader.start()
    reader.join(2)
    if reader.is_alive():  # the old reader blocks opening the FIFO: a writer lets it go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("local_endpoints hung on a FIFO")
    assert any("h-p1.json" in r and "not a regular file" in r for r in done["found"]["refused"])


def test_the_dump_cli_reads_control_files_as_ray_does(tmp_path):
    """`python -m source_patch.runtime.dump.server DIR state` finds control files through
    the same private reader (core/endpoint.read_private_json): a FIFO planted beside a
    real file does not hang it, a link is not followed; each is one line passed over."""
    from source_patch.runtime.core.endpoint import write_private_json
    from source_patch.runtime.dump import server

    control = tmp_path / "exp" / "control"
    write_private_json(control / "h-p1.json", {"url": "http://127.0.0.1:1", "token": "t", "pid": 1})
    os.mkfifo(control / "h-p2.json")
    (control / "h-p3.json").symlink_to(control / "h-p1.json")
    refused, done = [], {}
    reader = threading.Thread(target=lambda: done.update(found=server.endpoints(tmp_path / "exp", refused)),
                              daemon=True)
    reader.start()
    reader.join(2)
    if reader.is_alive():
        os.close(os.open(control / "h-p2.json", os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("endpoints hung on a FIFO")
    assert [info["file"] for info in done["found"]] == [str(control / "h-p1.json")]
    assert sorted(line.split(":")[0].rsplit("/", 1)[1] for line in refused) == ["h-p2.json", "h-p3.json"]


# ------------------------------------------------------------------ runtime_env


@pytest.mark.parametrize("folder, name", [("specs,v2", "mine.yaml"), (f"specs{os.pathsep}v2", "mine.yaml"),
                                          ("specs", "mine.yaml ")])
def test_a_spec_path_the_worker_would_split_is_refused(tmp_path, folder, name):
    spec = tmp_path / folder / name  # the worker splits at ',' and os.pathsep, and strips each part
    spec.parent.mkdir()
    spec.write_text(BUNDLED.read_text())
    with pytest.raises(ValueError, match="SOURCE_PATCH cannot carry"):
        sp_ray.runtime_env([spec])


def test_env_cannot_replace_what_specs_and_settings_set():
    with pytest.raises(ValueError, match="SOURCE_PATCH is set from specs"):
        sp_ray.runtime_env(["megatron_topk"], env={"SOURCE_PATCH": "/tmp/evil.yaml"})
    with pytest.raises(ValueError, match="SOURCE_PATCH is set from specs"):
        sp_ray.runtime_env(env={"SOURCE_PATCH": "/tmp/evil.yaml"})  # unvalidated, even without specs
    with pytest.raises(ValueError, match="SOURCE_PATCH_DUMP_ENABLE is set from settings"):
        sp_ray.runtime_env(settings={"dump": {"enable": True}}, env={"SOURCE_PATCH_DUMP_ENABLE": "0"})
    with pytest.raises(ValueError, match="not an environment variable"):
        sp_ray.runtime_env(env={"A=B": "1"})
    assert sp_ray.runtime_env(env={"OTHER": "1"})["env_vars"] == {"OTHER": "1"}
