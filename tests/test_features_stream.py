"""The feature ref stream and its SQLite control plane (runtime/features/stream.py):
partial lines, end marker, idle producer, exactly-once training across a killed
consumer, no re-publishing by a restarted producer, backpressure, corrupt lines,
the status CLI.  Producers and consumers run as separate processes (child.py)."""

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from source_patch.runtime.features.ref import FeatureRef, TensorMeta
from source_patch.runtime.features.control_plane import ControlPlane
from source_patch.runtime.features.stream import Backpressure, Consumer, Producer
from source_patch.runtime.features.stream_format import StreamCorrupt, StreamError
from source_patch.runtime.features.stream_io import RefReader, RefWriter, StreamIdle

END_LINE = b'{"end":true}\n'

CHILD = textwrap.dedent('''
    import json, os, sys, time
    from source_patch.runtime.features.ref import FeatureRef, TensorMeta
    from source_patch.runtime.features.control_plane import ControlPlane
    from source_patch.runtime.features.stream import Consumer, Producer

    def ref(i):
        return FeatureRef("store0", f"sample-{i}", 0, (TensorMeta("hidden", (i + 1, 16), "bfloat16"),))

    def flag(path):
        open(path, "w").close()

    def hang():
        while True:
            time.sleep(60)

    def produce(stream, db, start, stop, hw, delay, hang_at, flag_path):
        """Publish samples start..stop-1; hang (no end marker) once hang_at are published."""
        producer = Producer(stream, db, high_watermark=hw, poll=0.01)
        published, max_in_flight = 0, 0
        for i in range(start, stop):
            published += producer.publish(ref(i))
            max_in_flight = max(max_in_flight, producer.in_flight())  # sampled right after each commit
            if published == hang_at:
                flag(flag_path)
                hang()
            time.sleep(delay)
        producer.close()
        print(json.dumps({"published": published, "max_in_flight": max_in_flight}))

    def consume(stream, db, trained, kill_after, batch, delay, flag_path):
        """Train in batches: a sample counts as trained when its id is written to
        `trained` together with its ack.  After kill_after acks take 3 more refs
        (trained partly, never acked) and hang."""
        consumer = Consumer(stream, db, idle_timeout=10.0, poll=0.01)
        flag(flag_path + ".started")
        acked, pending, taken = 0, [], 0
        for r in consumer:
            if kill_after is not None and acked >= kill_after:
                taken += 1
                if taken == 3:
                    flag(flag_path)
                    hang()
                continue
            pending.append(r)
            time.sleep(delay)  # the forward/backward pass
            if len(pending) == batch:  # the optimizer step, then the ack
                fd = os.open(trained, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                os.write(fd, "".join(p.sample_id + "\\n" for p in pending).encode())
                os.close(fd)
                consumer.ack(pending)
                acked += len(pending)
                pending = []
        assert not pending or kill_after is None
        if pending:
            fd = os.open(trained, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, "".join(p.sample_id + "\\n" for p in pending).encode())
            os.close(fd)
            consumer.ack(pending)
        print(json.dumps({"resumed_from": consumer.resumed_from}))
        consumer.close()

    def halfline(stream, flag_path):
        """One line in two writes, the second only once the test says go."""
        line = json.dumps({"seq": 0, "ref": ref(0).to_json()}).encode() + b"\\n"
        fd = os.open(stream, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, line[:40])
        flag(flag_path)
        while not os.path.exists(flag_path + ".go"):
            time.sleep(0.01)
        os.write(fd, line[40:])
        os.write(fd, b'{"end":true}\\n')

    mode, args = sys.argv[1], [json.loads(a) for a in sys.argv[2:]]
    {"produce": produce, "consume": consume, "halfline": halfline}[mode](*args)
''')


def ref(i, store="store0"):
    return FeatureRef(store, f"sample-{i}", 0, (TensorMeta("hidden", (i + 1, 16), "bfloat16"),))


@pytest.fixture
def run(tmp_path):
    """run(mode, *args) -> Popen of child.py in that mode; killed at teardown if alive."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procs = []

    def start(mode, *args):
        proc = subprocess.Popen([sys.executable, str(script), mode, *map(json.dumps, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for(path, proc, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"child exited {proc.returncode} before {path}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.01)


def finish(proc, timeout=30.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def sigkill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def stream_ids(path) -> list:
    lines = open(path, "rb").read().splitlines()
    return [json.loads(line)["ref"]["sample_id"] for line in lines if line + b"\n" != END_LINE]


def test_a_reader_never_parses_a_half_written_line(tmp_path, run):
    stream, flag = tmp_path / "refs.jsonl", str(tmp_path / "half")
    writer = run("halfline", str(stream), flag)
    wait_for(flag, writer)
    reader = RefReader(stream, poll=0.01)
    for _ in range(3):  # polls see 40 bytes without a newline: not a record, nothing consumed
        assert reader.read_available() == [] and reader.offset == 0 and not reader.ended
        time.sleep(0.02)
    open(flag + ".go", "w").close()
    writer.wait(timeout=10)
    records = list(reader)  # now the line is complete, then the end marker stops the iteration
    assert [(r.seq, r.ref, r.offset) for r in records] == [(0, ref(0), 0)]
    assert reader.ended and reader.offset == stream.stat().st_size - len(END_LINE)


def test_a_stream_created_as_the_readers_open_fails_is_read_not_refused(tmp_path, monkeypatch):
    """A consumer started before its producer: its open finds no file, and the producer
    creates the file at that moment.  The reader stays idle, then reads it (it once
    looked again, saw the file, took it for one it could not open, and raised)."""
    from source_patch.runtime.core import bounded

    path, missed, real_open = tmp_path / "refs.jsonl", [], os.open

    def open_as_the_producer_starts(name, flags, *mode):
        if os.fspath(name) == os.fspath(path) and not missed:
            missed.append(name)
            writer = RefWriter(path)  # the producer, right after the failed open
            writer.append(ref(0), 0)
            writer.close()  # with the end marker
            raise FileNotFoundError(2, "No such file or directory", os.fspath(name))
        return real_open(name, flags, *mode)

    monkeypatch.setattr(bounded.os, "open", open_as_the_producer_starts)
    with RefReader(path, idle_timeout=5.0, poll=0.01) as reader:
        assert reader.read_available() == [] and missed  # idle: no stream yet
        assert [r.ref for r in reader] == [ref(0)] and reader.ended


def test_the_end_marker_stops_the_reader(tmp_path, run):
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    finish(run("produce", str(stream), str(db), 0, 3, 64, 0, None, ""))
    with RefReader(stream, idle_timeout=5.0, poll=0.01) as reader:
        assert [r.ref.sample_id for r in reader] == ["sample-0", "sample-1", "sample-2"]
    # the offset rests on the end marker: a reader resumed there stops at once
    with RefReader(stream, offset=reader.offset, idle_timeout=5.0) as again:
        assert list(again) == [] and again.ended


def test_idle_when_the_producer_is_killed_mid_stream(tmp_path, run):
    stream, db, flag = tmp_path / "refs.jsonl", tmp_path / "control.db", str(tmp_path / "hung")
    producer = run("produce", str(stream), str(db), 0, 10, 64, 0, 3, flag)
    wait_for(flag, producer)
    sigkill(producer)
    reader = RefReader(stream, idle_timeout=0.5, poll=0.01)
    got = []
    with pytest.raises(StreamIdle) as idle:
        got.extend(r.ref.sample_id for r in reader)
    assert got == ["sample-0", "sample-1", "sample-2"]
    size = stream.stat().st_size
    assert (f"no new ref for 0.5 s and no end marker: the producer may have died (last offset {size})"
            in str(idle.value))


def test_a_killed_consumer_restarted_trains_every_sample_exactly_once(tmp_path, run):
    stream, db, trained = tmp_path / "refs.jsonl", tmp_path / "control.db", tmp_path / "trained.txt"
    flag = str(tmp_path / "consumer1")
    consumer = run("consume", str(stream), str(db), str(trained), 20, 4, 0.002, flag)
    wait_for(flag + ".started", consumer)
    producer = run("produce", str(stream), str(db), 0, 50, 64, 0.002, None, "")
    wait_for(flag, consumer)  # 20 acked, 3 more taken and not acked
    sigkill(consumer)
    with ControlPlane(db) as plane:
        assert plane.stats()["acked"] == 20
    assert finish(producer)["published"] == 50
    restarted = run("consume", str(stream), str(db), str(trained), None, 4, 0, str(tmp_path / "consumer2"))
    resumed_from = finish(restarted)["resumed_from"]
    counts = collections.Counter(trained.read_text().split())
    assert counts == {f"sample-{i}": 1 for i in range(50)}
    with ControlPlane(db) as plane:
        assert plane.stats() == {"committed": 50, "in_flight": 0, "acked": 50}
        assert plane.unacked() == []
    assert 0 <= resumed_from <= stream.stat().st_size


def test_a_restarted_producer_does_not_republish(tmp_path, run):
    stream, db, flag = tmp_path / "refs.jsonl", tmp_path / "control.db", str(tmp_path / "hung")
    first = run("produce", str(stream), str(db), 0, 50, 64, 0, 30, flag)
    wait_for(flag, first)
    sigkill(first)  # no end marker
    assert finish(run("produce", str(stream), str(db), 0, 50, 64, 0, None, ""))["published"] == 20
    assert stream_ids(stream) == [f"sample-{i}" for i in range(50)]
    assert [json.loads(line).get("seq") for line in stream.read_bytes().splitlines()] == [*range(50), None]
    assert stream.read_bytes().endswith(END_LINE) and stream.read_bytes().count(END_LINE) == 1


def test_backpressure_keeps_in_flight_under_the_high_watermark(tmp_path, run):
    stream, db, trained = tmp_path / "refs.jsonl", tmp_path / "control.db", tmp_path / "trained.txt"
    consumer = run("consume", str(stream), str(db), str(trained), None, 1, 0.02, str(tmp_path / "c"))
    producer = run("produce", str(stream), str(db), 0, 30, 5, 0, None, "")
    result = finish(producer)
    assert result["published"] == 30 and result["max_in_flight"] == 5  # filled up, never beyond
    finish(consumer)
    assert sorted(trained.read_text().split()) == sorted(f"sample-{i}" for i in range(30))


def test_backpressure_timeout(tmp_path):
    with Producer(tmp_path / "refs.jsonl", tmp_path / "control.db", high_watermark=2, poll=0.01) as producer:
        assert producer.publish(ref(0)) and producer.publish(ref(1))
        assert producer.publish(ref(0)) is False  # a duplicate does not wait for room
        with pytest.raises(Backpressure, match="2 samples in flight .high watermark 2. for 0.1 s"):
            producer.publish(ref(2), timeout=0.1)
        producer.plane.ack(["sample-0"])
        assert producer.publish(ref(2), timeout=0.1)


def test_corrupt_lines_name_their_offset(tmp_path):
    good = json.dumps({"seq": 0, "ref": ref(0).to_json()}).encode() + b"\n"
    bad_ref = ref(1).to_json()
    bad_ref["tensors"][0]["dtype"] = "object"
    cases = [(b"not json\n", "is not JSON"),
             (b'{"seq": -1, "ref": {}}\n', "seq must be a non-negative integer"),
             (b'{"seq": 1}\n', 'neither {"seq"'),
             (json.dumps({"seq": 1, "ref": bad_ref}).encode() + b"\n", "dtype 'object' is not one of"),
             (b"[" * 100000 + b"\n", "is not JSON")]
    for i, (line, message) in enumerate(cases):
        path = tmp_path / f"s{i}.jsonl"
        path.write_bytes(good + line)
        reader = RefReader(path, idle_timeout=1.0)
        with pytest.raises(StreamCorrupt, match=f"line at byte offset {len(good)}.*{message}") as e:
            list(reader)
        assert message in str(e.value) and reader.offset == len(good)  # the bad line is not consumed


def test_oversized_lines_are_refused(tmp_path):
    path = tmp_path / "refs.jsonl"
    writer = RefWriter(path, max_line=150)
    writer.append(ref(0), 0)
    big = FeatureRef("store0", "sample-1", 0, tuple(TensorMeta(f"t{i}", (1,), "int8") for i in range(10)))
    with pytest.raises(StreamError, match="over the 150-byte limit"):
        writer.append(big, 1)
    writer.abandon()
    first = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"x" * 400)  # no newline yet: the reader refuses once the limit is passed
    with pytest.raises(StreamCorrupt, match=f"line at byte offset {first} is over the 150-byte limit"):
        list(RefReader(path, idle_timeout=1.0, max_line=150))


def test_a_producer_repairs_the_stream_a_dead_one_left(tmp_path):
    """Committed but never appended (died in between), and a torn last line: reopening
    cuts the torn tail and appends the missing lines in seq order."""
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    producer = Producer(stream, db)
    producer.publish(ref(0))
    producer.abandon()
    with ControlPlane(db) as plane:
        assert plane.commit(ref(1)) and plane.commit(ref(2)) and not plane.commit(ref(1))
    with open(stream, "ab") as f:
        f.write(b'{"seq":1,"ref":{"sto')
    with Producer(stream, db) as producer:
        assert producer.publish(ref(3)) and not producer.publish(ref(2))
    assert stream_ids(stream) == ["sample-0", "sample-1", "sample-2", "sample-3"]
    with pytest.raises(StreamError, match="has ended"):
        Producer(stream, db)


def test_one_consumer_per_db_and_resume_from_the_saved_offset(tmp_path):
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    producer = Producer(stream, db)
    consumer = Consumer(stream, db, idle_timeout=1.0, poll=0.01)
    with pytest.raises(StreamError, match="held by another live process"):
        Consumer(stream, db)
    it = iter(consumer)
    producer.publish(ref(0))
    assert next(it) == ref(0)  # from SQLite (committed, unacked)
    for i in range(1, 4):
        producer.publish(ref(i))
    assert next(it) == ref(1)  # from the stream, skipping sample-0 (yielded already)
    consumer.ack([ref(0), ref(1)])
    offset = consumer.reader.offset
    assert offset == sum(map(len, stream.read_bytes().splitlines(keepends=True)[:2]))  # after 2 lines
    consumer.close()
    producer.close()
    with Consumer(stream, db, idle_timeout=1.0) as again:
        assert again.resumed_from == offset
        assert list(again) == [ref(2), ref(3)]
        again.ack([ref(2), ref(3)])
    with ControlPlane(db) as plane, pytest.raises(KeyError, match="never committed"):
        plane.ack(["sample-9"])


def test_status_cli(tmp_path):
    stream, db = tmp_path / "refs.jsonl", tmp_path / "control.db"
    with Producer(stream, db) as producer:
        for i in range(4):
            producer.publish(ref(i))
    with ControlPlane(db) as plane:
        plane.ack(["sample-0", "sample-1"])
        plane.commit(ref(7))  # committed, never appended: unstreamed, not lost
    cli = [sys.executable, "-m", "source_patch.runtime.features.stream", "status", "--db", str(db)]
    text = subprocess.run(cli + ["--stream", str(stream)], capture_output=True, text=True, check=True).stdout
    for line in ["committed: 5", "in_flight: 3", "acked: 2", "lost: 0", "unstreamed: 1", "stream_refs: 4",
                 f"stream_bytes: {stream.stat().st_size}", "stream_ended: True"]:
        assert line in text.splitlines(), text
    # a stream from another run: its samples are in no control plane -> lost
    other = tmp_path / "other.jsonl"
    writer = RefWriter(other)
    writer.append(ref(0, store="elsewhere"), 0)
    writer.append(ref(99), 1)
    writer.close()
    out = json.loads(subprocess.run(cli + ["--stream", str(other), "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["lost"] == 1 and out["unstreamed"] == 3 and out["stream_refs"] == 2 and out["corrupt"] is None
    bare = subprocess.run(cli, capture_output=True, text=True, check=True).stdout.splitlines()
    assert bare[:3] == ["committed: 5", "in_flight: 3", "acked: 2"]
    missing = subprocess.run(cli[:-1] + [str(tmp_path / "none.db")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith("source-patch: error: no control db")
