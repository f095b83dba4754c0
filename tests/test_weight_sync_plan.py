"""Weight sync: the packed push planned once per layout (runtime/weight_sync/program.py,
sender.py): the program and the manifest's bytes are built at the first push of a
layout and reused while it holds; a 36k-tensor layout over gloo, bitwise."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from source_patch.runtime.core.endpoint import free_port
from source_patch.runtime.weight_sync import program
from source_patch.runtime.weight_sync import sender as wt_sender
from source_patch.runtime.weight_sync import transport as wt


def _model(n: int, seed: int = 0, unit: int = 1):
    """n small tensors (bf16 and float32, 1 to 40 times ``unit`` elements; some cross
    bucket ends)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(f"t{i}", (((i * 7) % 40 + 1) * unit,), torch.float32 if i % 5 == 0 else torch.bfloat16) for i in range(n)]
    return specs, [torch.randn(shape, generator=gen, dtype=dtype) for _, shape, dtype in specs]


def _received(tx) -> dict:
    return dict(wt.receive(wt.LoopbackLink("cpu", replay=tx)).tensors)


def test_the_packed_program_is_built_once_per_layout_and_reused_until_the_layout_changes(monkeypatch):
    built = []

    class Counted(program.Program):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(wt_sender, "Program", Counted)
    specs, tensors = _model(300)
    manifest = wt.plan(specs, 512, 0)  # 512-byte buckets: many, tensors crossing their ends
    sources = program.Sources([("out", t, True) for t in tensors], [], (None, None))
    tx = wt.LoopbackLink("cpu")
    kept = bodies = None
    for version in (1, 2, 3):
        tx.rewind()
        torch._foreach_add_(tensors, 1.0)  # new values in the same tensors, as a training step writes them
        m = dataclasses.replace(manifest, version=version)
        wt.send(tx, m, sources)
        got = _received(tx)
        assert [n for n, _, _ in specs] == list(got) and all(map(torch.equal, got.values(), tensors))
        kept = kept or tx.program
        assert tx.program is kept and len(built) == 1  # the second and third push did not rebuild it
        length, body = tx.program.manifest_message(m, tx.device)  # the manifest's bytes, kept: head rewritten
        assert bytes(body.numpy()) == m.to_json(tx.program.tensors_json) and int(length) == body.numel()
        bodies = body if bodies is None else bodies
        assert body is bodies
    # A changed layout (one tensor more) is planned again, and so are new sources.
    specs2, tensors2 = _model(301)
    manifest2 = wt.plan(specs2, 512, 4)
    sources2 = program.Sources([("out", t, True) for t in tensors2], [], (None, None))
    tx.rewind()
    wt.send(tx, manifest2, sources2)
    assert len(built) == 2 and tx.program is not kept
    assert all(map(torch.equal, _received(tx).values(), tensors2))
    tx.rewind()
    wt.send(tx, dataclasses.replace(manifest2, bucket_bytes=1024), sources2)  # another bucket size
    assert len(built) == 3
    assert all(map(torch.equal, _received(tx).values(), tensors2))


def test_a_new_version_with_another_head_length_rebuilds_the_manifest_bytes():
    specs, tensors = _model(50)
    manifest = wt.plan(specs, 256, 9)
    sources = program.Sources([("out", t, True) for t in tensors], [], (None, None))
    tx = wt.LoopbackLink("cpu")
    for version in (9, 10, 11):  # 9 -> 10: one digit more
        tx.rewind()
        m = dataclasses.replace(manifest, version=version)
        wt.send(tx, m, sources)
        _, body = tx.program.manifest_message(m, tx.device)
        assert bytes(body.numpy()) == m.to_json()
        assert all(map(torch.equal, _received(tx).values(), tensors))


PUSH_36K = r"""
import json, sys, dataclasses, torch
sys.path.insert(0, sys.argv[4])
import test_weight_sync_plan as t
from source_patch.runtime.weight_sync import program, transport as wt
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
N = 36169
specs, base = t._model(N)
link = wt.Link(wt.open_group("127.0.0.1", port, rank, 2, "plan36k", "gloo", 120), 120)  # the group's only holder
result = []
if rank == 0:
    manifest = wt.plan(specs, 64 << 10, 0)
    tensors = [b.clone() for b in base]
    sources = program.Sources([("out", x, True) for x in tensors], [], (None, None))
    for version in (1, 2, 3):
        torch._foreach_copy_(tensors, base)
        torch._foreach_add_(tensors, float(version))
        m = dataclasses.replace(manifest, version=version)
        # versions 1 and 2: the planned program (the second push reuses it); 3: the tensors one by one
        wt.send(link, m, sources if version < 3 else iter(tensors))
        result.append({"version": version, "program_id": id(link.program), "buckets": m.buckets})
else:
    for version in (1, 2, 3):
        update = wt.receive(link)
        want = torch._foreach_add(base, float(version))
        names = [n for n, _ in update.tensors]
        bad = [n for (n, got), w in zip(update.tensors, want) if not torch.equal(got, w)]
        result.append({"version": update.manifest.version, "n": len(names),
                       "names": names == [s[0] for s in specs], "bad": bad[:5]})
link.close()  # the group's threads stop here, not racing the interpreter's exit (Link.close)
json.dump(result, open(out, "w"))
"""


def test_a_36k_tensor_layout_is_pushed_over_gloo_bitwise(tmp_path):
    """Two processes over gloo: 36,169 small tensors pushed by the planned program twice
    (the second push reuses it) and once tensor by tensor, each received bitwise."""
    script = tmp_path / "push36k.py"
    script.write_text(PUSH_36K)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), str(tmp_path / f"r{rank}.json"),
                               str(Path(__file__).parent)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    sent, received = (json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in (0, 1))
    assert [s["version"] for s in sent] == [1, 2, 3] and sent[0]["buckets"] > 8
    assert sent[0]["program_id"] == sent[1]["program_id"]  # planned once, reused by the second push
    assert received == [{"version": v, "n": 36169, "names": True, "bad": []} for v in (1, 2, 3)]


def test_a_programs_bucket_is_a_few_table_launches_whatever_its_tensor_count():
    """On a GPU a bucket's copies (and its checksum) are copysum Tables, one launch for
    all its tensors, then captured as a graph: built here on CPU (no kernel runs), per
    bucket the sum slot's zero_, one Table of every tensor, one of the gaps.  (Tensors
    of whole 8-byte words; others are copied by a _foreach_copy_ per dtype, captured in
    the same graph.)"""
    specs, tensors = _model(36169, unit=8)
    manifest = wt.plan(specs, 256 << 10, 0)
    packing = program.Program(manifest, program.Sources([("out", t, True) for t in tensors], [], (None, None)),
                              torch.device("cpu"), tables=True)
    launches = [[type(g).__name__ if callable(g) else "foreach" for run in runs if not callable(run) for g in run]
                for runs in packing.runs]
    assert manifest.buckets > 4 and len(launches) == manifest.buckets
    assert all(kinds[1:] == ["Table", "Table"] and len(kinds) == 3 for kinds in launches), launches
    assert packing.summing == set(range(manifest.buckets))


def test_the_host_bench_prints_both_models_side_by_side():
    """bench/weight_sync_host_bench.py (in a process of its own: it stubs the device work
    in the modules it loads), tiny: every method, both models, the ratio lines."""
    bench = Path(__file__).parents[1] / "bench" / "weight_sync_host_bench.py"
    out = subprocess.run([sys.executable, str(bench), "--gb", "0.05", "--rounds", "2", "--warmup", "1",
                          "--wire", "new"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "725 tensors, after" in out.stdout and "3,618 tensors, after" in out.stdout
    assert all(any(line.startswith(m) for line in out.stdout.splitlines()) for m in ("planned", "packed", "buffers"))
    assert "36k / 7k at the median" in out.stdout
