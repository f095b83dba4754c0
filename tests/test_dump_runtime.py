"""The dump runtime: call sites, files + manifest, loader, filter, queue policy,
failures, and the HTTP control endpoint (CPU; one gpu-marked test for CUDA)."""

import errno
import http.client
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from source_patch.patcher.finder import RuntimeHandle
from source_patch.patcher.spec import loads
from source_patch.patcher import SpecError
from source_patch.runtime.core import ranks, settings
from source_patch.runtime.core.endpoint import free_port
from source_patch.runtime.dump import files
from source_patch.runtime.dump import reader as dump_reader
from source_patch.runtime.dump import server as dump_server

from source_patch.runtime.dump import api as D


def exp_dir(d) -> Path:
    return Path(d.state()["exp_dir"])


def manifest_lines(d, rank=0):
    path = exp_dir(d) / f"rank-{rank}" / "manifest.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def names_written(d):
    return [line["name"] for line in manifest_lines(d)]


@pytest.fixture
def sp():
    """A fresh ``__sp__`` handle, as patched modules get."""
    return RuntimeHandle()


# ---------------------------------------------------------------- records and loader


def test_roundtrip_with_tags_values_and_manifest(dumper, sp):
    values = {
        "f32": torch.randn(4, 3),
        "bf16": torch.randn(2, 5).to(torch.bfloat16),
        "i64": torch.arange(6).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.randn(6, 4).t(),  # not contiguous
        "empty": torch.empty(0, 7),
    }
    sp.dump_context(phase="fwd_bwd", microbatch=0)
    for layer in (1, 2):
        for name, value in values.items():
            assert sp.dump(name, value * layer if value.dtype != torch.bool else value,
                           layer=layer, note="x") is not None
    pair = (values["f32"], None, values["bf16"])
    assert sp.dump("qkv", pair, layer=1) is pair  # the argument itself comes back
    assert sp.dump("nothing", None) is None
    assert sp.dump_step((True, 1.5, 0)) == (True, 1.5, 0)
    sp.dump("loss", 2.5)
    assert dumper.flush(10)

    st = dumper.state()
    assert (st["counters"]["records"], st["counters"]["errors"], st["counters"]["dropped"], st["queue_depth"]) == (15, 0, 0, 0)
    rank_dir = exp_dir(dumper) / "rank-0"
    files = sorted(p.name for p in rank_dir.iterdir())
    assert "manifest.jsonl" in files and all(f == "manifest.jsonl" or f.endswith(".safetensors") for f in files)

    lines = manifest_lines(dumper)
    assert [line["seq"] for line in lines] == sorted(line["seq"] for line in lines)
    first = lines[0]
    assert set(first) >= {"name", "tags", "file", "key", "shape", "dtype", "seq", "bytes", "session"}
    assert first["tags"] == {"step": 0, "rank": 0, "phase": "fwd_bwd", "microbatch": 0, "layer": 1, "note": "x"}

    records = dump_reader.load(exp_dir(dumper))
    assert len(records) == 15
    by_key = {(r.name, r.layer): r for r in records}
    for layer in (1, 2):
        for name, value in values.items():
            r = by_key[(name, layer)]
            expected = value * layer if value.dtype != torch.bool else value
            assert r.dtype == str(value.dtype).removeprefix("torch.") and r.shape == tuple(value.shape)
            assert torch.equal(r.tensor, expected), name
    assert [r.name for r in records if r.name.startswith("qkv")] == ["qkv.0", "qkv.2"]
    loss = dump_reader.load(exp_dir(dumper), name="loss")[0]
    assert loss.step == 1 and loss.microbatch is None and loss.tensor.item() == 2.5


def test_dump_copies_cpu_tensors(dumper):
    x = torch.ones(8)
    dumper.dump("x", x)
    x.add_(41)  # a later in-place op must not reach the dump
    dumper.flush(10)
    assert torch.equal(dump_reader.load(exp_dir(dumper))[0].tensor, torch.ones(8))


def test_loader_filters_and_cli(dumper, capsys):
    dumper.configure(file_bytes=1)  # one file per record
    for step in range(3):
        dumper.dump_context(phase="fwd_bwd" if step < 2 else "fwd_only")
        dumper.dump_context(microbatch=0)
        for mb in range(2):
            for layer in range(4):
                dumper.dump("attn_out", torch.full((2,), float(layer)), layer=layer)
                dumper.dump("mlp_out", torch.zeros(3), layer=layer)
            dumper.dump_microbatch()
        dumper.dump("logits", torch.zeros(5))
        dumper.dump_step()
    dumper.flush(10)
    root = exp_dir(dumper).parent
    assert len(dump_reader.load(root)) == 3 * (2 * 8 + 1)  # a root with one experiment
    assert len({r.file for r in dump_reader.load(root)}) == 51  # file_bytes=1: a file each
    got = dump_reader.load(root, name="attn_*", layer=[1, 2], step=range(0, 2), microbatch=1)
    assert [(r.step, r.layer) for r in got] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(torch.equal(r.tensor, torch.full((2,), float(r.layer))) for r in got)
    assert len(dump_reader.load(root, phase="fwd_only")) == 17
    assert dump_reader.load(root, layer=True) == []  # True is not layer 1
    assert len(dump_reader.load(root, layer=lambda v: v is None)) == 3
    assert len(dump_reader.load(exp_dir(dumper) / "rank-0", rank=0, name=["logits", "mlp_*"])) == 27

    assert dump_reader.main([str(root)]) == 0
    out = capsys.readouterr().out
    assert "attn_out" in out and "0-2" in out and "0-3" in out and "51 records" in out
    assert dump_reader.main([str(root / "missing")]) == 2  # unusable input


def test_reused_experiment_directory_keeps_both_runs(dumper, monkeypatch):
    dumper.dump("a", torch.zeros(1))
    dumper.flush(10)
    first = dumper.state()["session"]
    monkeypatch.setattr(D._pipeline, "session", "second-run")  # as a new process would have
    dumper.configure(file_bytes=1)
    dumper.dump("a", torch.ones(1))
    dumper.flush(10)
    records = dump_reader.load(exp_dir(dumper))
    assert [(r.session, r.tensor.item()) for r in records] == [(first, 0.0), ("second-run", 1.0)]
    assert len({r.file for r in records}) == 2  # nothing overwritten
    assert [r.session for r in dump_reader.load(exp_dir(dumper), session="second-run")] == ["second-run"]
    assert "2 sessions in one rank directory" in dump_reader.summary(records)


def test_torn_manifest_line_is_skipped(dumper):
    dumper.dump("a", torch.ones(1))
    dumper.flush(10)
    with open(exp_dir(dumper) / "rank-0" / "manifest.jsonl", "a") as f:
        f.write('{"seq": 99, "name": "tor')  # a crash mid-append
    assert [r.name for r in dump_reader.load(exp_dir(dumper))] == ["a"]


def test_files_are_published_before_their_manifest_lines(dumper, monkeypatch):
    seen = []
    original = files.append_manifest

    def check(path, data, fsync=False):
        rank_dir = Path(path).parent
        for line in data.decode().splitlines():
            seen.append((rank_dir / json.loads(line)["file"]).is_file())
        assert not list(rank_dir.glob(".*.tmp"))
        return original(path, data, fsync)

    monkeypatch.setattr(files, "append_manifest", check)
    for i in range(5):
        dumper.dump("x", torch.full((10,), i))
    dumper.configure(fsync=True)
    dumper.dump("y", torch.ones(3))
    dumper.flush(10)
    assert seen and all(seen) and dumper.state()["counters"]["records"] == 6


def test_safetensors_files_are_self_describing(dumper):
    from safetensors import safe_open

    dumper.dump("h", torch.ones(2, 2), layer=3)
    dumper.flush(10)
    record = dump_reader.load(exp_dir(dumper))[0]
    with safe_open(str(record.file), framework="pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor(record.key), torch.ones(2, 2))
    described = json.loads(meta["records"])
    assert described == [{"seq": record.seq, "name": "h", "tags": record.tags}]


# ---------------------------------------------------------------- ambient tags


def test_step_microbatch_and_context_semantics(dumper, sp):
    assert sp.dump_microbatch() == 0 and sp.dump_microbatch() == 1  # unset: starts at 0
    # As patches/dump.yaml does: reset at the schedule's entry, advance at the end of
    # each forward_step, so the first microbatch's records carry 0, the second 1.
    sp.dump_context(microbatch=0)
    tagged = []
    for _ in range(3):
        tagged.append(dumper.state()["context"]["microbatch"])
        sp.dump_microbatch()
    assert tagged == [0, 1, 2] and sp.dump_microbatch(index=7) == 7
    assert sp.dump_step((False, None, None)) == (False, None, None)  # a skipped step
    assert dumper.state()["step"] == 0 and dumper.state()["context"]["microbatch"] == 7
    assert sp.dump_step(True) is True
    assert dumper.state()["step"] == 1 and "microbatch" not in dumper.state()["context"]
    assert sp.dump_microbatch() == 0  # a new step counts from 0
    sp.dump_step(step=100)
    assert dumper.state()["step"] == 100
    sp.dump_context(phase="fwd_bwd")
    with sp.dump_context(phase="fwd_only", extra="e"):
        assert dumper.state()["context"] == {"phase": "fwd_only", "extra": "e"}
    assert dumper.state()["context"] == {"phase": "fwd_bwd"}
    sp.dump_context(phase=None)
    assert dumper.state()["phase"] is None
    sp.dump("t", torch.zeros(1), layer=torch.tensor(4), obj=Path("p"), name="n", value=1)  # any tag name
    dumper.flush(10)
    # Outside a schedule (no phase set) a record's phase is "inference".
    assert manifest_lines(dumper)[0]["tags"] == {"step": 100, "rank": 0, "phase": "inference",
                                                 "layer": 4, "obj": "p", "name": "n", "value": 1}


def test_parallel_ranks_come_from_an_initialised_megatron(dumper, monkeypatch):
    import types

    fake = types.ModuleType("megatron.core.parallel_state")
    fake._TENSOR_MODEL_PARALLEL_GROUP = fake._PIPELINE_MODEL_PARALLEL_GROUP = fake._DATA_PARALLEL_GROUP = None
    fake.model_parallel_is_initialized = lambda: fake._TENSOR_MODEL_PARALLEL_GROUP is not None
    fake.get_tensor_model_parallel_rank = lambda: 1
    fake.get_pipeline_model_parallel_rank = lambda: 2
    fake.get_context_parallel_rank = lambda: 0
    fake.get_expert_model_parallel_rank = lambda: 3

    def no_dp_group():
        raise AssertionError("data parallel group is not initialized")

    fake.get_data_parallel_rank = no_dp_group
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake)
    dumper.dump("before_init", torch.zeros(1))
    fake._TENSOR_MODEL_PARALLEL_GROUP = fake._PIPELINE_MODEL_PARALLEL_GROUP = fake._DATA_PARALLEL_GROUP = object()
    dumper.dump("after_init", torch.zeros(1))
    dumper.flush(10)
    tags = {line["name"]: line["tags"] for line in manifest_lines(dumper)}
    assert tags["before_init"] == {"step": 0, "rank": 0, "phase": "inference"}
    assert tags["after_init"] == {"step": 0, "rank": 0, "phase": "inference", "tp": 1, "pp": 2, "cp": 0,
                                  "ep": 3}


# ---------------------------------------------------------------- filter and settings


def test_filter_semantics(dumper):
    dumper.configure(names=["attn_*", "qkv.1"], layers="0-1,5", steps=[0, "2-"], phases="fwd_bwd,inference")
    dumper.dump_context(phase="fwd_bwd")
    for step in range(4):
        for layer in (0, 1, 2, 5):
            dumper.dump("attn_out", torch.zeros(1), layer=layer)
            dumper.dump("mlp_out", torch.zeros(1), layer=layer)
            dumper.dump("qkv", (torch.zeros(1), torch.ones(1)), layer=layer)
        dumper.dump("attn_nolayer", torch.zeros(1))  # layers is set: no layer tag, not kept
        dumper.dump_step()
    dumper.dump_context(phase="fwd_only")
    dumper.dump("attn_out", torch.zeros(1), layer=0)
    dumper.flush(10)
    kept = [(line["name"], line["tags"]["step"], line["tags"]["layer"]) for line in manifest_lines(dumper)]
    expected = [(n, s, l) for s in (0, 2, 3) for l in (0, 1, 5) for n in ("attn_out", "qkv.1")]
    assert kept == expected
    assert dumper.state()["counters"]["filtered"] == 4 * (4 * 4 + 1) + 1 - len(expected)

    dumper.configure(ranks=[1, 2], names=None, layers=None, steps=None, phases=None)
    dumper.dump("attn_out", torch.zeros(1), layer=0)  # this process is rank 0
    dumper.configure(names=["qkv"], ranks=None)  # the call site's name selects every element
    dumper.dump("qkv", (torch.zeros(1), torch.ones(1)))
    dumper.flush(10)
    assert names_written(dumper)[len(expected):] == ["qkv.0", "qkv.1"]


@pytest.mark.parametrize("key,raw,parsed", [
    ("layers", "0-3, 7,10-", ["0-3", 7, "10-"]),
    ("layers", [0, "2-4"], [0, "2-4"]),
    ("steps", 5, [5]),
    ("steps", "", None),
    ("names", "attn_*, mlp.0", ["attn_*", "mlp.0"]),
    ("names", [], None),
    ("phases", ["fwd_bwd"], ["fwd_bwd"]),
    ("queue_bytes", "512M", 512 << 20),
    ("queue_bytes", "1.5GiB", 3 << 29),
    ("queue_bytes", 4096, 4096),
    ("enable", "yes", True),
    ("on_full", "drop", "drop"),
    ("port", "8123", 8123),
])
def test_setting_parsers(key, raw, parsed):
    assert settings.check("dump", key, raw) == parsed


@pytest.mark.parametrize("key,raw,message", [
    ("layers", "3-1", "bad range"),
    ("layers", "x", "expected an integer or a range"),
    ("layers", [-1], ">= 0"),
    ("layers", [True], "expected an integer or a range"),
    ("layers", 1.5, "a list or a comma-separated string"),
    ("names", [1], "expected strings"),
    ("queue_bytes", "lots", "byte count"),
    ("queue_bytes", 0, ">= 1"),
    ("on_full", "wait", "expected one of block, drop"),
    ("port", 70000, "0-65535"),
    ("exp_name", "../x", "plain directory name"),
    ("enable", [1], "expected a boolean"),
])
def test_setting_parsers_reject(key, raw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        settings.check("dump", key, raw)


def test_settings_from_environment_and_spec(dumper, write_spec, tmp_path):
    env = {"SOURCE_PATCH_DUMP_ENABLE": "1", "SOURCE_PATCH_DUMP_LAYERS": "0-1",
           "SOURCE_PATCH_DUMP_NAMES": "a*,b", "SOURCE_PATCH_DUMP_DIR": str(tmp_path / "env"),
           "SOURCE_PATCH_DUMP_ON_FULL": "drop", "SOURCE_PATCH_DUMP_QUEUE_BYTES": "64k"}
    config = dumper.configure_from_settings(env)
    assert (config["enable"], config["layers"], config["names"], config["on_full"], config["queue_bytes"]) == \
        (True, ["0-1"], ["a*", "b"], "drop", 65536)
    assert config["dir"] == str(tmp_path / "env")
    with pytest.raises(ValueError, match="SOURCE_PATCH_DUMP_STEPS='x'"):
        dumper.configure_from_settings({"SOURCE_PATCH_DUMP_STEPS": "x"})

    spec = ("source_patch: 1\nname: d\nruntime:\n  dump:\n    enable: true\n    layers: 0-3\n"
            "    on_full: drop\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
            "    edits:\n      - {at: entry, code: \"pass\"}\n")
    assert loads(spec, "s.yaml").runtime == {"dump": {"enable": True, "layers": ["0-3"], "on_full": "drop"}}
    with pytest.raises(SpecError, match=r"runtime.dump.layer: unknown key 'layer'.*valid keys: dir, drop_behind, drop_behind_bytes, enable"):
        loads(spec.replace("layers:", "layer:"), "s.yaml")


def test_configure_rejects_bad_values_atomically(dumper):
    before = dumper.public_config()
    with pytest.raises(KeyError, match="valid keys"):
        dumper.configure(names=["a"], nmes=["b"])
    with pytest.raises(ValueError):
        dumper.configure(names=["a"], queue_bytes="lots")
    assert dumper.public_config() == before


# ---------------------------------------------------------------- disabled, queue policy


def test_disabled_queues_nothing(dumper, sp, monkeypatch):
    dumper.configure(enable=False)
    called = []
    monkeypatch.setattr(D, "_record", lambda *a: called.append(a))
    x = torch.ones(3)
    for i in range(1000):
        assert sp.dump("x", x, layer=i) is x
    sp.dump_context(phase="fwd_bwd")
    sp.dump_microbatch()
    sp.dump_step()
    st = dumper.state()
    assert called == [] and (st["counters"]["records"], st["queue_depth"], st["counters"]["filtered"], st["counters"]["errors"]) == (0, 0, 0, 0)
    assert st["step"] == 1  # steps are still counted, so enabling later tags the right step
    assert not exp_dir(dumper).exists()


def gate_writer(monkeypatch):
    """Hold the writer before it writes a file until the returned event is set."""
    gate = threading.Event()
    original = files.write_safetensors

    def gated(*args, **kwargs):
        gate.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(files, "write_safetensors", gated)
    return gate


def test_full_queue_drops_and_counts(dumper, sp, monkeypatch):
    gate = gate_writer(monkeypatch)
    dumper.configure(queue_bytes=1000, on_full="drop")
    x = torch.zeros(100)  # 400 bytes: two fit
    for _ in range(10):
        assert sp.dump("x", x) is x
    st = dumper.state()
    assert (st["counters"]["dropped"], st["queue_depth"], st["queue_bytes"]) == (8, 2, 800)
    gate.set()
    assert dumper.flush(10)
    st = dumper.state()
    assert (st["counters"]["records"], st["counters"]["dropped"], st["queue_depth"], st["queue_bytes"]) == (2, 8, 0, 0)


def test_full_queue_blocks_until_room(dumper, monkeypatch, caplog):
    gate = gate_writer(monkeypatch)
    dumper.configure(queue_bytes=1000, on_full="block")
    done = threading.Event()

    def train():
        for _ in range(4):
            dumper.dump("x", torch.zeros(100))
        done.set()

    thread = threading.Thread(target=train)
    with caplog.at_level(logging.WARNING, logger="source_patch.dump"):
        thread.start()
        assert not done.wait(0.3)  # the third record waits for room
        assert dumper.state()["queue_depth"] == 2
        gate.set()
        thread.join(10)
    assert done.is_set() and dumper.flush(10)
    st = dumper.state()
    assert (st["counters"]["records"], st["counters"]["dropped"]) == (4, 0) and st["counters"]["blocked_s"] > 0.2
    # The writer fell behind: counted per wait, said once, with the rates in and out.
    assert st["counters"]["waits"] >= 1 and st["counters"]["write_s"] > 0
    behind = [r.getMessage() for r in caplog.records if "falling behind" in r.getMessage()]
    assert len(behind) == 1 and "the caller waits for room" in behind[0] and "GiB/s" in behind[0], behind


def test_record_larger_than_queue_passes_alone(dumper):
    dumper.configure(queue_bytes=16, on_full="drop")
    dumper.dump("big", torch.zeros(100))
    dumper.flush(10)
    assert dumper.state()["counters"]["records"] == 1 and dumper.state()["counters"]["dropped"] == 0


def _fs_type(path) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            point, fs = line.split()[1:3]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fs
    return kind


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore over a mapping that touches none)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        try:
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_drop_behind_leaves_written_files_out_of_the_page_cache(tmp_path):
    path = tmp_path / "written.bin"
    path.write_bytes(os.urandom(4 << 20))
    os.sync()  # written back: clean pages, still cached
    before = _resident_pages(path)
    files.DropBehind().written(path)
    after = _resident_pages(path)
    if before == 0 or _fs_type(path) in ("tmpfs", "ramfs"):
        pytest.skip(f"a {_fs_type(path)} folder keeps no page cache to drop (resident pages: {before})")
    assert after < before // 10, (before, after)


def test_files_leave_the_page_cache_once_the_window_of_newer_bytes_is_full(monkeypatch):
    advised = []
    monkeypatch.setattr(files, "_advise_dontneed", advised.append)
    behind = files.DropBehind(window=10, again=2)
    behind.written(Path("a"), 6)
    behind.written(Path("b"), 4)
    assert advised == []  # 10 bytes: all within the window
    behind.written(Path("c"), 3)
    assert advised == [Path("a")]  # a is older than the newest 10 bytes (b, c: 7)
    behind.written(Path("d"), 9)
    assert advised == [Path("a"), Path("b"), Path("c")]  # b and c leave; a (of `again` = 2) is forgotten
    advised.clear()
    behind.written(Path("e"), 1)
    assert advised == [Path("b"), Path("c")]  # advised again after each later file, `again` of them


def test_the_writer_drops_files_behind_its_window_by_default(dumper, monkeypatch):
    advised = []
    monkeypatch.setattr(files, "_advise_dontneed", advised.append)
    for i in range(3):
        dumper.dump("x", torch.zeros(100))
        assert dumper.flush(10)
    assert advised == []  # a dump smaller than drop_behind_bytes (2 GiB) stays cached
    dumper.configure(file_bytes=1, drop_behind_bytes=0)  # a file per record, each advised away at once
    for i in range(3):
        dumper.dump("x", torch.zeros(100))
        assert dumper.flush(10)
    # the window shrank to 0: the files it held leave too (earlier tests' of this process among them)
    mine = {p for p in advised if p.is_relative_to(exp_dir(dumper))}
    assert len(mine) == 6 and all(p.exists() and p.suffix == ".safetensors" for p in mine), advised
    dumper.configure(drop_behind=False)
    advised.clear()
    dumper.dump("x", torch.zeros(100))
    assert dumper.flush(10) and advised == []


def test_close_then_dump_again(dumper):
    dumper.dump("a", torch.zeros(1))
    assert dumper.close(10)
    assert not dumper.state()["writer_alive"]
    dumper.dump("b", torch.zeros(1))
    assert dumper.flush(10) and names_written(dumper) == ["a", "b"]


# ---------------------------------------------------------------- failures never reach the caller


def test_unsupported_values_are_counted_not_raised(dumper, sp, caplog):
    with caplog.at_level(logging.WARNING, logger="source_patch.dump"):
        assert sp.dump("s", "text") == "text"
        assert sp.dump("s", "text") == "text"
        meta = torch.empty(3, device="meta")
        assert sp.dump("m", meta) is meta
        c = torch.zeros(2, dtype=torch.complex64)
        assert sp.dump("c", c) is c
    st = dumper.state()
    assert st["counters"]["errors"] == 4 and "complex" in st["last_error"]
    assert sum("cannot dump a str" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_enospc_is_counted_and_logged_once(dumper, sp, monkeypatch, caplog):
    def full(out, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_bytes", full)
    x = torch.ones(4)
    with caplog.at_level(logging.WARNING, logger="source_patch.dump"):
        for _ in range(3):
            assert sp.dump("x", x) is x
            dumper.flush(10)
    st = dumper.state()
    assert (st["counters"]["records"], st["counters"]["lost"], st["counters"]["errors"]) == (0, 3, 3)
    assert "No space left on device" in st["last_error"]
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    rank_dir = exp_dir(dumper) / "rank-0"
    assert list(rank_dir.iterdir()) == []  # no partial file, no temp file, no manifest line
    monkeypatch.undo()
    sp.dump("after", x)
    dumper.flush(10)
    assert names_written(dumper) == ["after"] and dumper.state()["counters"]["records"] == 1


def test_failed_write_midway_leaves_no_file(dumper, monkeypatch):
    calls = []
    original = files.write_bytes

    def second_write_fails(out, data):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        return original(out, data)

    monkeypatch.setattr(files, "write_bytes", second_write_fails)
    dumper.dump("x", torch.ones(4))
    dumper.flush(10)
    assert list((exp_dir(dumper) / "rank-0").iterdir()) == []
    assert dumper.state()["counters"]["lost"] == 1


def test_manifest_failure_removes_the_file_and_truncates_partial_lines(dumper, monkeypatch, tmp_path):
    monkeypatch.setattr(files, "append_manifest", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    dumper.dump("x", torch.ones(4))
    dumper.flush(10)
    assert list((exp_dir(dumper) / "rank-0").iterdir()) == []  # no file without its lines
    monkeypatch.undo()

    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b'{"a": 1}\n')
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            real_write(fd, bytes(data[:4]))
            raise OSError(errno.ENOSPC, "full")
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", half_then_full)
    with pytest.raises(OSError):
        files.append_manifest(manifest, b'{"b": 2}\n{"c": 3}\n')
    monkeypatch.undo()
    assert manifest.read_bytes() == b'{"a": 1}\n'


def _run_as_nobody(fn):
    """Run fn() in a forked child with uid/gid nobody; return its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            result = fn()
        except BaseException as exc:  # noqa: BLE001
            result = {"child_error": repr(exc)}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def test_read_only_directory(dumper):
    readonly = Path(tempfile.mkdtemp(prefix="sp-ro-"))
    try:
        readonly.chmod(0o555)

        def attempt():
            dumper.configure(dir=str(readonly))
            x = torch.ones(4)
            returned = [dumper.dump("x", x) is x for _ in range(3)]
            dumper.flush(10)
            return {"returned": returned, "state": dumper.state()}

        if os.geteuid() == 0:  # root writes anywhere: try as nobody in a forked child
            result = _run_as_nobody(attempt)
            if "child_error" in result:
                pytest.skip(f"cannot drop privileges here: {result['child_error']}")
        else:
            result = json.loads(json.dumps(attempt(), default=str))
        st = result["state"]
        assert result["returned"] == [True] * 3
        assert st["counters"]["records"] == 0 and st["counters"]["lost"] == 3 and st["counters"]["errors"] >= 1
        assert "Permission denied" in st["last_error"] or "Read-only" in st["last_error"]
        assert list(readonly.iterdir()) == []
    finally:
        readonly.chmod(0o755)
        for path in sorted(readonly.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        readonly.rmdir()


def test_unwritable_dir_path_is_a_file(dumper, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    dumper.configure(dir=str(blocker / "below"))
    assert dumper.dump("x", 5) == 5
    dumper.flush(10)
    st = dumper.state()
    assert st["counters"]["lost"] == 1 and ("NotADirectoryError" in st["last_error"] or "FileExistsError" in st["last_error"])


# ---------------------------------------------------------------- HTTP control endpoint


TOKEN = "test-token-0123456789"


@pytest.fixture
def control(dumper, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dumper.configure(port=free_port(), token=TOKEN)
    url = dumper.state()["control"]
    assert url and url.startswith("http://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1])

    def call(method, path, body=None, token=TOKEN, headers=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = json.loads(resp.read())
        conn.close()
        return resp.status, payload

    return call


def test_control_state_configure_reset(control, dumper):
    status, st = control("GET", "/state")
    assert status == 200 and st["enabled"] is True and st["config"]["token"] == "<set>"
    assert TOKEN not in json.dumps(st)
    dumper.dump("a_first", torch.zeros(1))
    status, body = control("POST", "/configure", {"names": ["b*"], "steps": "0-5"})
    assert status == 200 and body["changed"] == ["names", "steps"] and body["config"]["names"] == ["b*"]
    dumper.dump("a_second", torch.zeros(1))  # filtered out now
    dumper.dump("b_kept", torch.zeros(1))
    dumper.flush(10)
    assert names_written(dumper) == ["a_first", "b_kept"]
    dumper.dump_step()
    status, st = control("GET", "/dumper/get_state")  # SGLang's path
    assert status == 200 and st["counters"]["records"] == 2 and st["counters"]["filtered"] == 1 and st["step"] == 1
    status, body = control("POST", "/reset")
    assert status == 200 and body["state"]["counters"]["records"] == 0 and body["state"]["step"] == 0
    status, _ = control("POST", "/configure", {"enable": False, "max_request_bytes": 100})
    assert status == 200 and dumper.state()["enabled"] is False
    status, body = control("POST", "/configure", {"names": ["x" * 200]})  # the same server, new limit
    assert status == 413 and body["max_request_bytes"] == 100


@pytest.mark.parametrize("kind", ["unknown_key", "wrong_type", "fixed_key", "missing_token", "wrong_token",
                                  "not_bearer", "oversized", "malformed", "not_object", "empty",
                                  "bad_length", "wrong_method", "no_such_path"])
def test_control_rejects_bad_requests(control, dumper, sp, kind):
    before = dumper.public_config()
    requests = {
        "unknown_key": (("POST", "/configure", {"enable": True, "nmes": ["x"]}), 400, "unknown key 'nmes'"),
        "wrong_type": (("POST", "/configure", {"queue_bytes": [1]}), 400, "queue_bytes: expected a byte count"),
        "fixed_key": (("POST", "/configure", {"port": 1}), 400, "cannot be changed over HTTP"),
        "missing_token": (("GET", "/state", None, None), 401, "missing token"),
        "wrong_token": (("GET", "/state", None, "nope"), 401, "invalid token"),
        "not_bearer": (("GET", "/state", None, None, {"Authorization": f"Basic {TOKEN}"}), 401, "invalid token"),
        "oversized": (("POST", "/configure", {"names": ["x" * 70000]}), 413, "over max_request_bytes"),
        "malformed": (("POST", "/configure", None, TOKEN, None, b"{enable: true"), 400, "malformed JSON"),
        "not_object": (("POST", "/configure", [1, 2]), 400, "expected a JSON object"),
        "empty": (("POST", "/configure", None, TOKEN, None, b""), 400, "empty body"),
        "bad_length": (("POST", "/configure", None, TOKEN, {"Content-Length": "abc"}), 400, "bad Content-Length"),
        "wrong_method": (("GET", "/configure"), 405, "takes POST"),
        "no_such_path": (("GET", "/etc/passwd"), 404, "no endpoint"),
    }
    args, status, message = requests[kind]
    x = torch.ones(2)
    assert sp.dump("before", x) is x
    got, body = control(*args)
    assert sp.dump("after", x) is x  # training goes on
    assert got == status and message in body["error"] and body["status"] == status, body
    if kind == "unknown_key":
        assert "enable" in body["valid_keys"] and "token" not in body["valid_keys"]
    assert dumper.public_config() == before  # nothing applied
    dumper.flush(10)
    assert names_written(dumper) == ["before", "after"]


def test_control_generated_token_file(dumper, monkeypatch, capfd):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dumper.configure(port=free_port())
    files = dump_server.endpoints(exp_dir(dumper))
    assert len(files) == 1
    info = files[0]
    path = Path(info["file"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(info["token"]) >= 32
    err = capfd.readouterr().err
    assert "control endpoint" in err and str(path) in err and info["token"] not in err
    assert dump_server.request(info, "GET", "/state")[0] == 200
    assert dump_server.main([str(exp_dir(dumper)), "configure", 'names=["z*"]', "steps=1-2"]) == 0
    assert dumper.public_config()["names"] == ["z*"] and dumper.public_config()["steps"] == ["1-2"]
    dumper.configure(port=0)  # stops the endpoint and removes its file
    assert not path.exists() and dumper.state()["control"] is None


def test_control_ports_do_not_clash(dumper, monkeypatch):
    port = free_port()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        dumper.configure(port=port, token=TOKEN)  # taken: the next free one
        assert dumper.state()["control"] == f"http://127.0.0.1:{port + 1}" or \
            int(dumper.state()["control"].rsplit(":", 1)[1]) > port
    dumper.configure(port=0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    base = free_port()
    dumper.configure(port=base - 3)
    assert int(dumper.state()["control"].rsplit(":", 1)[1]) >= base


def underscore_reads(folder: Path) -> list:
    """``module._name`` where ``module`` is a sibling module of dump/ imported by name."""
    import ast

    siblings = {p.stem for p in folder.glob("*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.level == 1 and not node.module for alias in node.names if alias.name in siblings}
        found += [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in names and node.attr.startswith("_")]
    return found


def test_dump_modules_reach_each_other_through_public_names_only(tmp_path):
    """Issue 55: api.py owns dump's state; no module of dump/ reads another's private
    names, and none hands itself over (the endpoint gets server.Actions)."""
    folder = Path(D.__file__).parent
    assert underscore_reads(folder) == []
    assert not [p.name for p in folder.glob("*.py") if "sys.modules[__name__]" in p.read_text()]
    (tmp_path / "api.py").write_text("_enabled = False\n")
    (tmp_path / "sglang.py").write_text("from . import api\nif api._enabled:\n    pass\n")
    assert underscore_reads(tmp_path) == ["sglang.py:2 api._enabled"]  # the check can fail


# ---------------------------------------------------------------- process-level behaviour


def test_package_export_and_no_megatron_import(tmp_path):
    """``__sp__.dump`` is the function, whatever was imported first (the subpackage
    ``source_patch.runtime.dump`` does not shadow it); the runtime never imports
    Megatron; atexit flushes."""
    code = f"""
import sys, torch
import source_patch.runtime.dump.api        # the subpackage first must not shadow the export
from source_patch.runtime import facade
from source_patch.runtime.dump import configure, state
configure(enable=True, dir={str(tmp_path)!r}, exp_name="e")
x = torch.ones(3)
assert facade.dump("via_module", x) is x
from source_patch.patcher.finder import RuntimeHandle
assert RuntimeHandle().dump("via_handle", x) is x
assert not any(m.startswith("megatron") for m in sys.modules)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_DUMP")})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
    assert [r.name for r in dump_reader.load(tmp_path / "e")] == ["via_module", "via_handle"]


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gpu_copy", ["clone", "direct"])
def test_cuda_async_copies(dumper, gpu_copy):
    dumper.configure(gpu_copy=gpu_copy)
    expected = {}
    for i in range(20):
        x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
        y = (x @ x.t())[:, :64]  # produced by a kernel on the current stream; a strided view
        expected[f"y{i}"] = y.cpu()
        dumper.dump(f"y{i}", y, layer=i)
        if gpu_copy == "clone":
            y.fill_(float("nan"))  # overwritten in place right after the dump
        del x, y  # freed at once: record_stream keeps the memory until the copy ran
        torch.empty(1024, 1024, device="cuda").fill_(7.0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a tensor made on another stream
        z = torch.arange(10, device="cuda")
        dumper.dump("z", z)
    torch.cuda.synchronize()
    assert dumper.flush(60)
    st = dumper.state()
    assert st["counters"]["errors"] == 0 and st["counters"]["records"] == 21, st
    for r in dump_reader.load(exp_dir(dumper)):
        if r.name == "z":
            assert torch.equal(r.tensor, torch.arange(10))
        else:
            assert torch.equal(r.tensor, expected[r.name]), r.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_is_skipped_not_broken(dumper):
    x = torch.ones(16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x * 2).sum()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        dumper.dump("in_graph", y)
    graph.replay()
    torch.cuda.synchronize()
    assert dumper.flush(10)
    assert dumper.state()["counters"]["records"] == 0 and "graph capture" in dumper.state()["last_error"]
