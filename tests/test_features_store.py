"""The feature store (runtime/features/store.py, mooncake.py): both backends put and
get bitwise, across processes, and fail cleanly on short reads, stale refs, released
samples and malformed refs.  The Mooncake tests run against a real mooncake_master."""

import json
import os
import runpy
import select
import subprocess
import sys
import textwrap
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from source_patch.runtime.features.ref import FeatureRef, RefError
from source_patch.runtime.features.store import SharedDirStore, StoreError, open_store

BACKENDS = ["dir", "mooncake"]

PRODUCER = textwrap.dedent('''
    import json, sys
    import torch


    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "hidden": torch.randn(33, 17, generator=g).to(torch.bfloat16),
            "logits": torch.randn(5, 7, generator=g, dtype=torch.float64).t(),  # non-contiguous
            "half": torch.randn(129, generator=g).half(),
            "ids": torch.randint(-2**40, 2**40, (300,), generator=g),
            "small": torch.randint(-128, 127, (3, 3), generator=g, dtype=torch.int8),
            "mask": torch.rand(64, generator=g) > 0.5,
            "scalar": torch.tensor(7, dtype=torch.uint8),
            "i32": torch.randint(0, 2**31 - 1, (4, 2), generator=g, dtype=torch.int32),
            "i16": torch.randint(-2**15, 2**15 - 1, (10,), generator=g, dtype=torch.int16),
            "empty": torch.empty(0, 9),
            "big": torch.randn(3 << 18, generator=g),  # 3 MiB: registered in place, not staged
        }


    if __name__ == "__main__":
        from source_patch.runtime.features.store import open_store

        url, sample_id, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
        with open_store(url) as store:
            ref = store.put(sample_id, sample(seed))
            print(json.dumps(ref.to_json()), flush=True)
            sys.stdin.readline()  # stay alive (a Mooncake client's objects die with it)
''')


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(expected: dict, got: dict) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].is_contiguous()
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), name


def need_mooncake() -> Path:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake.store cannot be imported ({exc}): install mooncake-transfer-engine-non-cuda")
    binary = Path(sys.executable).parent / "mooncake_master"
    if not binary.exists():
        pytest.skip(f"no mooncake_master next to {sys.executable}")
    return binary


@contextmanager
def running_master(log_path: Path):
    """host:port of a real mooncake_master on loopback (runtime/features/mooncake.master)."""
    need_mooncake()
    from source_patch.runtime.features.mooncake import master

    with master(log=log_path) as address:
        yield address


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    with running_master(tmp_path_factory.mktemp("mooncake") / "master.log") as address:
        yield address


@pytest.fixture(scope="module")
def mooncake_url(mooncake_master):
    # a store name of its own: the master may outlive this module
    return f"mooncake://{mooncake_master}?store=t{uuid.uuid4().hex[:12]}&segment_mb=64&buffer_mb=16"


@pytest.fixture(scope="module")
def mooncake_store(mooncake_url):
    """One client for the module: a Mooncake client's close() takes 1-2 s."""
    with open_store(mooncake_url) as s:
        yield s


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    if request.param == "dir":
        return f"dir://{tmp_path}/features?store=feat"
    return request.getfixturevalue("mooncake_url")


@pytest.fixture
def store(url, request):
    """A store of each backend (the tests use distinct sample ids: Mooncake's is shared)."""
    if url.startswith("mooncake"):
        yield request.getfixturevalue("mooncake_store")
        return
    with open_store(url) as s:
        yield s


@pytest.fixture(scope="module")
def producer_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("producer") / "producer.py"
    path.write_text(PRODUCER)
    return path, runpy.run_path(str(path))["sample"]


def test_round_trip_is_bitwise(store, producer_module):
    _, sample = producer_module
    tensors = sample(1)
    before = store.stats()
    ref = store.put("sample-1", tensors)
    assert ref.store == store.name and ref.sample_id == "sample-1"
    assert [m.name for m in ref.tensors] == list(tensors)
    assert ref.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    wire = FeatureRef.from_json(json.loads(json.dumps(ref.to_json())))  # as it travels
    assert_bitwise(tensors, store.get(wire))
    assert_bitwise(tensors, store.get(wire))  # a get does not consume
    stats = store.stats()
    delta = {k: stats[k] - before[k] for k in ("puts", "gets", "bytes_put", "bytes_got", "transfer_seconds",
                                               "register_seconds", "registrations")}
    assert delta["puts"] == 1 and delta["gets"] == 2
    assert delta["bytes_put"] == ref.nbytes and delta["bytes_got"] == 2 * ref.nbytes
    assert delta["transfer_seconds"] > 0
    if stats["backend"] == "MooncakeStore":  # "big" is registered in place, timed apart
        assert delta["registrations"] >= 2 and delta["register_seconds"] > 0
    store.release(ref)


def test_tensors_sharing_memory(store):
    """Two names for one large tensor: Mooncake refuses to register an overlapping
    range in place, so the second is staged; both read back."""
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
    ref = store.put("alias", {"a": big, "b": big, "c": big[: 1 << 18]})
    got = store.get(ref)
    assert torch.equal(got["a"], big) and torch.equal(got["b"], big) and torch.equal(got["c"], big[: 1 << 18])
    store.release(ref)


def test_get_reads_into_tensors_the_caller_reuses(store):
    sample = {"big": torch.randn(512, 1024), "small": torch.arange(10)}  # 2 MiB: registered in place
    reused = {name: torch.zeros_like(t) for name, t in sample.items()}
    for seed in range(2):
        sample["big"].add_(seed)
        ref = store.put(f"reuse-{seed}", sample)
        got = store.get(ref, out=reused)
        assert all(got[k] is reused[k] and torch.equal(got[k], sample[k]) for k in sample)
        store.release(ref)
    ref = store.put("reuse-bad", sample)
    with pytest.raises(ValueError, match=r"out\['big'\] must be a contiguous CPU tensor of shape \[512, 1024\]"):
        store.get(ref, out={"big": torch.zeros(1024, 512)})
    store.release(ref)


def test_producer_and_consumer_are_separate_processes(url, producer_module):
    path, sample = producer_module
    proc = subprocess.Popen([sys.executable, str(path), url, "cross-1", "7"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the producer printed no ref within 60 s"
        line = proc.stdout.readline()
        assert line, f"the producer exited (rc {proc.poll()}) without a ref"
        ref = FeatureRef.from_json(json.loads(line))
        with open_store(url, **({"segment_mb": 0} if url.startswith("mooncake") else {})) as consumer:
            assert_bitwise(sample(7), consumer.get(ref))
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(30) == 0
            if url.startswith("mooncake"):  # its objects went with the producer's client
                with pytest.raises(StoreError, match="missing object .*producer's client closed"):
                    consumer.get(ref)
            else:  # files outlive their writer
                assert_bitwise(sample(7), consumer.get(ref))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_truncated_object_is_a_short_read(store):
    tensors = {"a": torch.arange(100, dtype=torch.int32), "b": torch.ones(8, dtype=torch.bfloat16)}
    ref = store.put("short", tensors)
    key = ref.key("a")
    if isinstance(store, SharedDirStore):
        from safetensors.torch import save_file

        save_file({"a": tensors["a"][:60].clone(), "b": tensors["b"]}, store.path("short", ref.generation))
    else:  # the raw Mooncake client replaces the object with a shorter one
        assert store.client.upsert(key, as_bytes(tensors["a"][:60]).numpy().tobytes()) == 0
    with pytest.raises(StoreError, match=f"short read of {key}: rc=240, expected 400 bytes"):
        store.get(ref)


def test_a_file_cut_short_is_a_short_read(tmp_path):
    with SharedDirStore(tmp_path) as store:
        ref = store.put("cut", {"x": torch.arange(1000, dtype=torch.int64)})
        path = store.path("cut", ref.generation)
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(StoreError, match=r"short read of features/cut/g\d+/x: rc=7900, expected 8000"):
            store.get(ref)


def test_a_file_with_other_shapes_or_dtypes_is_refused(tmp_path):
    from safetensors.torch import save_file

    with SharedDirStore(tmp_path) as store:
        ref = store.put("s", {"x": torch.zeros(4, 4)})
        save_file({"x": torch.zeros(2, 8)}, store.path("s", ref.generation))
        with pytest.raises(StoreError, match=r"holds shape \[2, 8\]"):
            store.get(ref)
        save_file({"x": torch.zeros(4, 4, dtype=torch.int32)}, store.path("s", ref.generation))
        with pytest.raises(StoreError, match="holds dtype I32, the ref says float32"):
            store.get(ref)
        save_file({"x": torch.zeros(4, 4), "y": torch.zeros(1)}, store.path("s", ref.generation))
        with pytest.raises(StoreError, match="holds tensors"):
            store.get(ref)
        Path(store.path("s", ref.generation)).write_bytes(b"\xff" * 8 + b"{}")
        with pytest.raises(StoreError, match="header length"):
            store.get(ref)


def test_dir_files_are_plain_safetensors(tmp_path, producer_module):
    from safetensors.torch import load_file, save_file

    tensors = producer_module[1](3)
    with SharedDirStore(tmp_path / "d", fsync=True) as store:
        ref = store.put("st", tensors)
        assert os.listdir(tmp_path / "d") == [f"st.g{ref.generation}.safetensors"]  # no temp file left
        assert_bitwise(tensors, load_file(store.path("st", ref.generation)))
        save_file({k: v.contiguous() for k, v in tensors.items()}, store.path("st", ref.generation))
        assert_bitwise(tensors, store.get(ref))  # and files the library writes read back


def test_mooncake_object_larger_than_the_ref_is_refused(mooncake_store):
    store = mooncake_store
    ref = store.put("long", {"a": torch.arange(10, dtype=torch.int32)})
    assert store.client.upsert(ref.key("a"), b"\0" * 80) == 0
    with pytest.raises(StoreError, match=r"get of .*/a failed rc=-600 \(invalid parameters"):
        store.get(ref)


def test_a_stale_generation_fails_cleanly(store):
    first = store.put("s", {"x": torch.zeros(3)})
    second = store.put("s", {"x": torch.ones(3)})
    assert second.generation > first.generation
    if isinstance(store, SharedDirStore):  # the older generation is removed by the re-put
        assert not os.path.exists(store.path("s", first.generation))
    else:
        assert store.client.is_exist(first.key("x")) == 0
    with pytest.raises(RefError, match=f"stale ref: sample s generation {first.generation}, "
                                       f"current {second.generation}"):
        store.get(first)
    store.release(first)  # releasing the stale ref leaves the current generation alone
    assert torch.equal(store.get(second)["x"], torch.ones(3))


def test_release_then_get_is_missing_and_release_is_idempotent(store):
    ref = store.put("r", {"x": torch.arange(5), "e": torch.empty(0)})
    assert torch.equal(store.get(ref)["x"], torch.arange(5))  # a get leaves a lease: release forces it
    store.release(ref)
    with pytest.raises(StoreError, match="missing object"):
        store.get(ref)
    store.release(ref)  # idempotent
    again = store.put("r", {"x": torch.arange(6)})  # a re-put after release: never the old generation
    assert again.generation > ref.generation
    with pytest.raises((RefError, StoreError), match="stale|missing"):
        store.get(ref)


def test_malformed_refs_are_refused(store):
    good = store.put("m", {"x": torch.zeros(2)}).to_json()
    for bad in [None, [], {**good, "extra": 1}, {**good, "generation": -1}, {**good, "generation": "1"},
                {**good, "sample_id": "../etc"}, {**good, "tensors": []},
                {**good, "tensors": [{"name": "x", "shape": [2], "dtype": "object"}]},
                {**good, "tensors": [{"name": "x", "shape": [-2], "dtype": "float32"}]},
                {**good, "tensors": [{"name": "x", "shape": [2]}]}]:
        with pytest.raises(RefError):
            FeatureRef.from_json(bad)
    with pytest.raises(RefError):
        FeatureRef.from_json(json.loads('{"store": "s", "sample_id": "a", "generation": 1.5, "tensors": []}'))
    with pytest.raises(RefError, match="expected a FeatureRef"):
        store.get(good)  # the JSON itself, not a ref
    with pytest.raises(RefError, match="ref of store 'other'"):
        store.get(FeatureRef.from_json({**good, "store": "other"}))


def test_put_refuses_what_a_ref_cannot_carry(store):
    with pytest.raises(RefError, match="cannot be stored"):
        store.put("p", {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(RefError):
        store.put("p", {"bad name!": torch.zeros(2)})
    with pytest.raises(RefError):
        store.put("../p", {"x": torch.zeros(2)})
    with pytest.raises(ValueError):
        store.put("p", {})
    with pytest.raises(TypeError):
        store.put("p", {"x": [1, 2]})


class LeaseHeld:
    """A client whose batch_remove reports a held lease (-706) for the first ``n`` calls."""

    def __init__(self, client, n):
        self.client, self.n = client, n

    def batch_remove(self, keys, force=False):
        if self.n > 0:
            self.n -= 1
            return [-706] * len(keys)
        return self.client.batch_remove(keys, force)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_mooncake_release_retries_a_held_lease_then_reports_it(mooncake_store):
    store, real = mooncake_store, mooncake_store.client
    retries = store.stats()["release_retries"]
    try:
        ref = store.put("lease", {"x": torch.arange(4)})
        store.client = LeaseHeld(real, 2)
        store.release(ref)  # two retries, then removed
        assert store.stats()["release_retries"] == retries + 2
        with pytest.raises(StoreError, match="missing"):
            store.get(ref)
        ref = store.put("lease", {"x": torch.arange(4)})
        store.client = LeaseHeld(real, 100)
        with pytest.raises(StoreError, match=r"still lease-held after 5 tries \(rc=-706\)"):
            store.release(ref)
    finally:
        store.client = real
    assert torch.equal(store.get(ref)["x"], torch.arange(4))  # not lost: still there
    store.release(ref)


def test_mooncake_full_segment_fails_the_put_instead_of_evicting(tmp_path):
    """Its own master: with another client's segment mounted, the master would place
    the objects there once the producer's preferred segment is full."""
    with running_master(tmp_path / "master.log") as master, \
            open_store(f"mooncake://{master}?store=full&segment_mb=16&buffer_mb=4") as store:
        kept = [store.put(f"f{i}", {"x": torch.full((1 << 20,), i, dtype=torch.int32)}) for i in range(3)]
        with pytest.raises(StoreError, match="rc=-200 .no space"):
            for i in range(3, 8):
                store.put(f"f{i}", {"x": torch.full((1 << 20,), i, dtype=torch.int32)})
        for i, ref in enumerate(kept):  # nothing unreleased was evicted to make room
            assert torch.equal(store.get(ref)["x"], torch.full((1 << 20,), i, dtype=torch.int32))


def test_open_store_urls(tmp_path):
    with open_store(f"dir://{tmp_path}/a?fsync=1", store="named") as s:
        assert isinstance(s, SharedDirStore) and s.fsync and s.name == "named"
    for bad in ["dir://host/x", "dir:relative", "mooncake://127.0.0.1", "mooncake://:5/", "s3://b/k",
                f"dir://{tmp_path}?nope=1", f"dir://{tmp_path}?fsync=maybe", "mooncake://127.0.0.1:1?segment_mb=x"]:
        with pytest.raises(ValueError):
            open_store(bad)
    s = open_store(f"dir://{tmp_path}/b")
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.put("x", {"x": torch.zeros(1)})
