"""Issue 36, items 5, 9 and 10 (Mooncake): the feature stream, its control plane and
the feature store on hostile or misplaced input.  Each test asserts the clean error,
that no file was changed or lost, and that nothing hangs (``within``; subprocesses
with a timeout)."""

import ipaddress
import json
import os
import sqlite3
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_features_store import mooncake_master, mooncake_store, mooncake_url, running_master  # noqa: F401

from source_patch.runtime.features.ref import FeatureRef, TensorMeta
from source_patch.runtime.features.store import SharedDirStore, StoreError, open_store
from source_patch.runtime.features.control_plane import ControlPlane
from source_patch.runtime.features.stream import Consumer, Producer, status
from source_patch.runtime.features.stream_format import StreamCorrupt, StreamError

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads recurses: RecursionError unless refused first
STATUS = [sys.executable, "-m", "source_patch.runtime.features.stream", "status"]


def ref(i, store="store0"):
    return FeatureRef(store, f"sample-{i}", 0, (TensorMeta("hidden", (i + 1, 16), "bfloat16"),))


def within(fn, seconds=10.0):
    """fn() in a daemon thread: its result or its exception; fails if it hangs."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def status_cli(*args):
    """The status command: exit 2 (unusable input) and one clean line, never a traceback or a hang."""
    out = subprocess.run(STATUS + [str(a) for a in args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("source-patch: error: "), out.stderr
    assert "Traceback" not in out.stderr
    return out.stderr


def drain(stream, db) -> list:
    """Every ref a fresh consumer yields (made and used in one thread: SQLite's rule)."""
    with Consumer(stream, db, idle_timeout=30.0, poll=0.01) as consumer:
        return list(consumer)


def stream_ids(path) -> list:
    return [json.loads(line)["ref"]["sample_id"] for line in Path(path).read_bytes().splitlines()
            if b'"ref"' in line]


# ---- item 5: the producer never changes a file it did not create as a stream ------

@pytest.mark.parametrize("via_symlink", [False, True])
def test_producer_leaves_a_file_that_is_not_a_stream_untouched(tmp_path, via_symlink):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"keep me\nlast")
    path = notes
    if via_symlink:
        path = tmp_path / "refs.jsonl"
        path.symlink_to(notes)
    db = tmp_path / "notes.db"
    error = "a symlink, folder, FIFO or device" if via_symlink else "not a ref stream: refused"
    with pytest.raises(StreamError, match=error):
        within(lambda: Producer(path, db))
    assert notes.read_bytes() == b"keep me\nlast"
    assert not db.exists()  # the stream is checked before the db is opened


def test_producer_refuses_a_stream_its_db_did_not_make(tmp_path):
    stream, mine, other = tmp_path / "refs.jsonl", tmp_path / "mine.db", tmp_path / "other.db"
    producer = Producer(stream, mine)
    producer.publish(ref(0))
    producer.abandon()
    with open(stream, "ab") as f:
        f.write(b'{"seq":1,"ref":{"sto')  # a torn tail, which its own producer would cut
    before = stream.read_bytes()
    with pytest.raises(StreamError, match="never bound to it"):
        Producer(stream, other)
    assert stream.read_bytes() == before
    with Producer(stream, mine) as again:  # its own db: repaired and appended to
        again.publish(ref(1))
    assert stream_ids(stream) == ["sample-0", "sample-1"]


def test_one_db_per_stream(tmp_path):
    first, second, db = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "control.db"
    producer = Producer(first, db)
    producer.publish(ref(0))
    producer.publish(ref(1))
    with pytest.raises(StreamError, match="belongs to stream .*a.jsonl.* one db per stream"):
        Producer(second, db)
    assert not second.exists()  # created, refused, removed: no copy of the other's samples
    producer.publish(ref(2))
    producer.close()
    assert stream_ids(first) == ["sample-0", "sample-1", "sample-2"]
    second.write_bytes(b"")
    with pytest.raises(StreamError, match="belongs to stream"):
        Producer(second, db)
    with pytest.raises(StreamError, match="belongs to stream"):
        Consumer(second, db, idle_timeout=1.0)
    assert second.read_bytes() == b""
    with ControlPlane(db) as plane:
        assert plane.stats() == {"committed": 3, "in_flight": 3, "acked": 0}


# ---- item 9: the control db, the stream file, db rows ----------------------------

def _not_a_db(tmp_path, kind):
    path = tmp_path / "control.db"
    if kind == "text":
        path.write_bytes(b"these are my notes, not SQLite\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    return path


@pytest.mark.parametrize("kind", ["text", "folder", "fifo", "device"])
def test_a_control_db_that_is_not_sqlite_is_refused(tmp_path, kind):
    db = _not_a_db(tmp_path, kind)
    before = db.read_bytes() if kind == "text" else None
    stream = tmp_path / "refs.jsonl"
    with pytest.raises(StreamError, match="control db .*(not a regular file|not an SQLite database)"):
        within(lambda: ControlPlane(db))
    with pytest.raises(StreamError, match="control db"):
        within(lambda: Producer(stream, db))
    assert not stream.exists()  # the stream it created for the refused db is gone
    assert "control db" in status_cli("--db", db)
    if kind == "text":
        assert db.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["control.db"]  # no -wal, -shm, lock


def test_a_fifo_stream_does_not_hang_the_consumer(tmp_path):
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    os.mkfifo(stream)
    with pytest.raises(StreamError, match="stream: .*refs.jsonl is not a regular file"):
        within(lambda: drain(stream, db))  # before: blocked in open(), the idle timeout never ran
    with pytest.raises(StreamError, match="not a regular file"):
        within(lambda: Producer(stream, db))
    assert "not a regular file" in status_cli("--db", db, "--stream", stream)


def test_a_folder_stream_is_a_stream_error(tmp_path):
    stream, db = tmp_path / "refs", tmp_path / "control.db"
    stream.mkdir()
    with pytest.raises(StreamError, match="refs is not a regular file"):
        within(lambda: drain(stream, db))
    with pytest.raises(StreamError, match="not a regular file"):
        Producer(stream, db)
    assert list(stream.iterdir()) == []
    assert "not a regular file" in status_cli("--db", db, "--stream", stream)


def test_a_deeply_nested_db_row_is_stream_corrupt(tmp_path):
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    producer = Producer(stream, db)
    producer.publish(ref(0))
    producer.abandon()
    with ControlPlane(db) as plane:
        assert plane.commit(ref(1))  # committed, not streamed: a restarted producer appends it
    raw = sqlite3.connect(db)
    raw.execute("UPDATE samples SET ref = ? WHERE sample_id = 'sample-1'", (DEEP,))
    raw.commit()
    raw.close()
    before = stream.read_bytes()
    with pytest.raises(StreamCorrupt, match="the ref of seq 1: nested deeper than 4 levels"):
        Producer(stream, db)
    assert stream.read_bytes() == before
    with Consumer(stream, db, idle_timeout=1.0) as consumer, pytest.raises(StreamCorrupt, match="seq 1"):
        list(consumer)
    assert status(db)["in_flight"] == 2  # the counts still read


# ---- item 9: the dir store's safetensors header -----------------------------------

def _plant(store, ref, header: bytes, data: bytes = b"") -> Path:
    path = Path(store.path(ref.sample_id, ref.generation))
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_a_deeply_nested_safetensors_header_is_a_store_error(tmp_path):
    with SharedDirStore(tmp_path) as store:
        ref = store.put("deep", {"x": torch.zeros(4)})
        path = _plant(store, ref, ('{"x":' + DEEP + "}").encode())
        before = path.read_bytes()
        with pytest.raises(StoreError, match="the safetensors header: nested deeper than 3 levels"):
            store.get(ref)
        assert path.read_bytes() == before


def test_data_offsets_past_the_file_are_a_store_error(tmp_path):
    with SharedDirStore(tmp_path) as store:
        ref = store.put("far", {"x": torch.zeros(4)})
        header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [2**62, 2**62 + 16]}})
        _plant(store, ref, header.encode(), bytes(16))
        with pytest.raises(StoreError, match="malformed header entry for tensor 'x'"):
            store.get(ref)


def test_a_fifo_in_the_dir_store_is_refused(tmp_path):
    with SharedDirStore(tmp_path) as store:
        ref = store.put("pipe", {"x": torch.zeros(4)})
        path = store.path("pipe", ref.generation)
        os.unlink(path)
        os.mkfifo(path)
        with pytest.raises(StoreError, match="is not a regular file"):
            within(lambda: store.get(ref))


# ---- item 9: Mooncake refuses a ref of another dtype or shape ---------------------

def test_mooncake_refuses_a_ref_of_another_dtype_or_shape(mooncake_store, tmp_path):  # noqa: F811
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    for store in (mooncake_store, SharedDirStore(tmp_path)):
        good = store.put("mixed", {"x": x})
        for shape, dtype in [((2, 8), "float32"), ((16,), "float32"), ((4, 4), "int32"), ((8, 4), "bfloat16")]:
            other = FeatureRef.from_json({**good.to_json(), "tensors": [
                {"name": "x", "shape": list(shape), "dtype": dtype}]})
            assert other.nbytes == good.nbytes
            with pytest.raises(StoreError, match="holds other tensors than the ref names|holds (shape|dtype)"):
                store.get(other)
        assert torch.equal(store.get(good)["x"], x)  # the stored sample is intact
        store.release(good)


# ---- item 10: listeners -----------------------------------------------------------

def _listeners(pid: int) -> set:
    """(address, port) of the TCP sockets ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((_address(address, width), int(port, 16)))
    return found


def _address(hex_address: str, width: int) -> str:
    """/proc/net/tcp{,6} print addresses as 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return str(ipaddress.IPv4Address(raw[::-1]))
    return str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))


def _master_listening_on(port: int) -> int:
    """The pid of this process's mooncake_master child that listens on ``port``."""
    for entry in Path("/proc").iterdir():
        try:
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        if head.endswith("(mooncake_master") and int(tail.split()[1]) == os.getpid():
            if port in {p for _, p in _listeners(int(entry.name))}:
                return int(entry.name)
    raise AssertionError(f"no mooncake_master child listens on port {port}")


def test_mooncake_listeners(tmp_path):
    """What we start listens on loopback (the master); Mooncake's client opens two
    listeners on every interface whatever it is given (docs/features.md, "Listeners"):
    this pins that documented exception, so a change in either shows up here."""
    before = _listeners(os.getpid())
    with running_master(tmp_path / "master.log") as address:
        master = _listeners(_master_listening_on(int(address.rsplit(":", 1)[1])))
        assert len(master) >= 2 and all(host == "127.0.0.1" for host, _ in master), master  # rpc, metrics
        with open_store(f"mooncake://{address}?store=listen&segment_mb=16&buffer_mb=4"):
            client = _listeners(os.getpid()) - before
    wildcard = {(h, p) for h, p in client if h not in ("127.0.0.1", "::1")}
    assert {h for h, _ in wildcard} <= {"0.0.0.0", "::"}, client
    assert len(wildcard) == 2, client  # the P2P handshake socket and the TCP data acceptor
