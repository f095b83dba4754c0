"""Trace compressors (runtime/trace/compress.py) against independent numpy references."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from source_patch.runtime.trace import compress as tc


def np_tiles(a: np.ndarray, stats, tiles: int, dim: int) -> np.ndarray:
    rows = np.moveaxis(a.astype(np.float64), dim, -1).reshape(-1, a.shape[dim])
    width = rows.shape[1]
    size = math.ceil(width / min(tiles, width))
    funcs = {"mean": np.mean, "absmax": lambda t: np.abs(t).max(), "rms": lambda t: np.sqrt(np.mean(t * t)),
             "min": np.min, "max": np.max}
    return np.array([[funcs[s](rows[:, i:i + size]) for i in range(0, width, size)] for s in stats])


@pytest.mark.parametrize("shape, tiles, dim", [((4, 3, 64), 8, -1), ((5, 10), 4, -1), ((6, 7, 5), 3, 1),
                                               ((33,), 64, 0), ((2, 3, 10), 6, -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_tiles_equal_numpy(shape, tiles, dim, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    stats = list(tc.TILE_STATS)
    c = tc.parse({"kind": "tiles", "stats": stats, "tiles": tiles, "dim": dim})
    got = c(x)
    want = np_tiles(x.float().numpy(), stats, tiles, dim)
    assert got.dtype == torch.float32 and got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=1e-6)


def test_tiles_defaults_and_last_tile_shorter():
    c = tc.parse({"kind": "tiles"})
    assert c.spec() == {"kind": "tiles", "stats": ["mean", "absmax", "rms"], "tiles": 64, "dim": -1}
    x = torch.arange(10.0).reshape(1, 10)
    out = tc.parse({"kind": "tiles", "stats": ["min", "max"], "tiles": 4})(x)
    assert out.tolist() == [[0, 3, 6, 9], [2, 5, 8, 9]]  # tiles of 3, 3, 3 and the last of 1


@pytest.mark.parametrize("span", [None, [-1.0, 2.0]])
def test_histogram_equals_numpy(span):
    torch.manual_seed(1)
    x = torch.randn(3, 1000)
    x[0, :5] = torch.tensor([math.nan, math.inf, -math.inf, 5.0, -5.0])
    out = tc.parse({"kind": "histogram", "bins": 17, "range": span})(x).numpy()
    a = x.numpy().astype(np.float64).ravel()
    a = a[np.isfinite(a)]
    lo, hi = (a.min(), a.max()) if span is None else span
    counts, _ = np.histogram(a, bins=17, range=(lo, hi))
    assert out.shape == (19,) and out.dtype == np.float32
    np.testing.assert_allclose(out[:2], [lo, hi], rtol=1e-7)
    assert out[2:].tolist() == counts.tolist()


def test_histogram_of_a_constant_tensor_puts_everything_in_one_bin():
    out = tc.parse({"kind": "histogram", "bins": 4})(torch.full((10,), 2.5))
    assert out.tolist() == [2.5, 2.5, 10, 0, 0, 0]


@pytest.mark.parametrize("by_abs", [True, False])
def test_topk_equals_numpy(by_abs):
    torch.manual_seed(2)
    x = torch.randn(4, 50)
    out = tc.parse({"kind": "topk", "k": 7, "abs": by_abs})(x).numpy()
    a = x.numpy().ravel()
    order = np.argsort(-(np.abs(a) if by_abs else a), kind="stable")[:7]
    assert out.dtype == np.float64 and out.shape == (2, 7)
    assert out[1].tolist() == order.tolist()
    assert out[0].tolist() == a[order].astype(np.float64).tolist()  # signed values
    assert np.unravel_index(int(out[1][0]), x.shape) == np.unravel_index(order[0], x.shape)


def test_topk_k_larger_than_the_tensor():
    assert tc.parse({"kind": "topk", "k": 10})(torch.tensor([1.0, -3.0])).tolist() == [[-3.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("normalize", [True, False])
def test_projection_from_safetensors_equals_numpy(tmp_path, normalize):
    torch.manual_seed(3)
    v = torch.randn(64)
    path = tmp_path / "dir.safetensors"
    save_file({"direction": v}, str(path))
    x = torch.randn(8, 2, 64)
    c = tc.parse({"kind": "projection", "file": str(path), "normalize": normalize})
    assert c.params["key"] == "direction"  # the only tensor
    want = x.numpy().astype(np.float64) @ (v.numpy() / (np.linalg.norm(v.numpy()) if normalize else 1))
    got = c(x)
    assert got.shape == (8, 2) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    # along another dim
    c0 = tc.parse({"kind": "projection", "file": str(path), "dim": 0, "normalize": normalize})
    np.testing.assert_allclose(c0(x.permute(2, 0, 1)).numpy(), want, rtol=1e-5, atol=1e-5)


def test_projection_errors_are_clear(tmp_path):
    path = tmp_path / "two.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(2, 2)}, str(path))
    with pytest.raises(ValueError, match="holds 2 tensors; name one with key"):
        tc.parse({"kind": "projection", "file": str(path)})
    with pytest.raises(ValueError, match="must be a 1-D vector"):
        tc.parse({"kind": "projection", "file": str(path), "key": "b"})
    with pytest.raises(ValueError, match="no tensor 'c'"):
        tc.parse({"kind": "projection", "file": str(path), "key": "c"})
    with pytest.raises(ValueError, match="no such file"):
        tc.parse({"kind": "projection", "file": str(tmp_path / "missing.safetensors")})
    with pytest.raises(ValueError, match=r"\.safetensors file"):
        tc.parse({"kind": "projection", "file": "/etc/passwd"})
    not_safetensors = tmp_path / "junk.safetensors"
    not_safetensors.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="cannot read"):
        tc.parse({"kind": "projection", "file": str(not_safetensors)})
    c = tc.parse({"kind": "projection", "file": str(path), "key": "a"})
    with pytest.raises(ValueError, match="has 4 elements, the tensor's dim -1 has 5"):
        c(torch.ones(3, 5))


def test_raw_copies_and_caps():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = tc.parse({"kind": "raw"}, raw_max_elements=100)(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # a copy: later in-place changes stay out
    with pytest.raises(tc.TooLarge, match="over max_elements 5"):
        tc.parse({"kind": "raw", "max_elements": 5})(x)
    with pytest.raises(ValueError, match=r"max_elements must be in 1\.\.100"):
        tc.parse({"kind": "raw", "max_elements": 1000}, raw_max_elements=100)


@pytest.mark.parametrize("spec, error", [
    ("tiles", "expected an object"),
    ({"kind": "eval"}, "unknown kind 'eval' (valid: tiles, histogram, topk, projection, raw)"),
    ({"kind": "tiles", "reduce": "x.mean()"}, "unknown parameter 'reduce' (valid: stats, tiles, dim)"),
    ({"kind": "tiles", "stats": ["mean", "median"]}, "stats must be distinct names"),
    ({"kind": "tiles", "stats": []}, "stats must be a non-empty list"),
    ({"kind": "tiles", "tiles": 0}, "tiles must be in 1..4096"),
    ({"kind": "tiles", "tiles": True}, "tiles must be an integer"),
    ({"kind": "histogram", "range": [1, 1]}, "lo < hi"),
    ({"kind": "histogram", "range": "0,1"}, "range must be null or [lo, hi]"),
    ({"kind": "topk", "abs": 1}, "abs must be true or false"),
])
def test_bad_parameters_are_rejected(spec, error):
    with pytest.raises((ValueError, TypeError)) as info:
        tc.parse(spec)
    assert error in str(info.value)


def test_empty_tensors_are_refused():
    with pytest.raises(ValueError, match="empty"):
        tc.parse({"kind": "tiles"})(torch.zeros(0, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_compressor_synchronizes_the_gpu(tmp_path):
    """torch's sync debug mode raises on any host-device synchronisation."""
    path = tmp_path / "v.safetensors"
    save_file({"v": torch.randn(64)}, str(path))
    x = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16)
    compressors = [tc.parse(s) for s in ({"kind": "tiles", "stats": list(tc.TILE_STATS)}, {"kind": "histogram"},
                                         {"kind": "histogram", "range": [-1, 1]}, {"kind": "topk"},
                                         {"kind": "projection", "file": str(path)}, {"kind": "raw"})]
    for c in compressors:
        c.reduce(x)  # first use: the projection vector goes to the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reduced = [c.reduce(x) for c in compressors]  # what the training thread runs
    finally:
        torch.cuda.set_sync_debug_mode(0)
    outs = [torch.as_tensor(c.finish(r.cpu().numpy(), x.shape)) for c, r in zip(compressors, reduced)]
    for c, out in zip(compressors, outs):
        if c.kind == "topk":
            # bf16 has ties (also x and -x by magnitude): positions and signs may differ
            # between devices; the magnitudes, and the values the positions point at, may not
            values, positions = out.cpu()
            torch.testing.assert_close(values.abs(), c(x.cpu())[0].abs())
            torch.testing.assert_close(x.cpu().reshape(-1)[positions.long()].double(), values)
        elif c.kind != "projection":
            torch.testing.assert_close(out.cpu(), c(x.cpu()), rtol=1e-4, atol=1e-3)


INTERPRETED = r"""
import json, sys, torch, triton, triton.language as tl
from source_patch.runtime.trace import compress as tc, fused

@triton.jit
def loop_to(out_ptr, n):
    total = 0
    for i in range(0, n, 1):
        total += 1
    tl.store(out_ptr, total)

try:  # the kernel's loops have bounds known at run time only: not every interpreter runs those
    loop_to[(1,)](torch.zeros(1, dtype=torch.int32), 3)
except Exception as exc:
    print(json.dumps({"unsupported": f"Triton {triton.__version__}'s interpreter: {exc}"}))
    sys.exit(0)
torch.manual_seed(0)
cases = []
for (shape, dtype), stats in zip(
        [((64, 4, 96), torch.float32), ((33, 200), torch.bfloat16), ((700, 24), torch.float16), ((5, 8), torch.float32)],
        [("mean", "absmax", "rms"), ("min", "max"), ("rms", "min", "mean", "max", "absmax"), ("absmax",)]):
    x = torch.randn(shape).to(dtype)
    parts, want = fused.column_stats(x, stats), tc.tile_columns(x, list(stats))
    got = torch.from_numpy(tc._join_splits(parts.double().numpy(), stats)).float()
    cases.append([list(shape), str(dtype), list(stats), parts.shape[1:] == want.shape and parts.shape[0] >= 1,
                  torch.allclose(got, want, rtol=1e-5, atol=2e-4)])
x = torch.randn(16, 32)
x[3, 5] = float("nan")
nan = torch.from_numpy(tc._join_splits(fused.column_stats(x, tc.TILE_STATS).double().numpy(), tc.TILE_STATS))
print(json.dumps({"cases": cases, "nan_column": torch.isnan(nan[:, 5]).all().item(),
                  "others_finite": not torch.isnan(nan[:, 4]).any().item(),
                  "splits": fused.column_stats(torch.randn(700, 24), ("mean",)).shape[0]}))
"""


def test_the_fused_tiles_kernel_computes_what_the_torch_reductions_do():
    """fused.py under Triton's interpreter (numpy on the CPU): every statistic, several
    shapes, dtypes and block plans; NaN reaches every statistic of its column only."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "unsupported" in result:  # the gpu-marked test below checks the compiled kernel there
        pytest.skip(result["unsupported"][:300])
    assert len(result["cases"]) == 4 and all(ok_shape and close for *_, ok_shape, close in result["cases"]), \
        result["cases"]
    assert result["nan_column"] and result["others_finite"]
    assert result["splits"] == 11  # 700 rows of 24 columns: blocks of 64 rows, a split each (< 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiles_of_a_cuda_tensor_take_the_fused_kernel_and_match_the_torch_path():
    if tc.fused_kernel() is None:
        pytest.skip("Triton is not importable here")
    x = torch.randn(512, 4, 1024, device="cuda", dtype=torch.bfloat16)
    stats = list(tc.TILE_STATS)
    tiles = tc.parse({"kind": "tiles", "stats": stats, "tiles": 64})
    fused_parts = tiles.reduce(x)
    tc.USE_TRITON = False
    try:
        torch_columns = tiles.reduce(x)
    finally:
        tc.USE_TRITON = True
    assert fused_parts.dim() == 3 and fused_parts.shape[0] > 1 and torch_columns.shape == (len(stats), 1024)
    fused_result, torch_result = (tiles.finish(r.cpu().numpy(), x.shape) for r in (fused_parts, torch_columns))
    np.testing.assert_allclose(fused_result, torch_result, rtol=1e-4, atol=1e-4)
    assert tc.tile_columns(x.transpose(0, 2), stats).shape == (len(stats), 512)  # not contiguous: torch path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launches_compute_what_tritons_own_launches_do_in_every_layout(monkeypatch):
    """After the first launch of a layout, fused.py calls the compiled kernel's own
    launcher; layouts Triton specialises apart (rows == 1, widths not a multiple of 16,
    a pointer off 16-byte alignment, bf16) must each get their own kernel, and results
    written into device memory, pinned memory and the trace ring must be the same."""
    from source_patch.runtime.trace import ring as ring_module

    fused = tc.fused_kernel()
    if fused is None:
        pytest.skip("Triton is not importable here")
    jit, launches = fused._column_stats, []

    class Counting:  # counts the launches that go through Triton's own dispatch
        def __getitem__(self, grid):
            launches.append(grid)
            return jit[grid]

    monkeypatch.setattr(fused, "_column_stats", Counting())
    base = torch.randn(4097 * 130 + 1, device="cuda")  # first: pinning needs the CUDA context it makes
    ring = ring_module.shared()  # the process's one ring: kept registered until exit, never unmapped
    assert ring.pin() and ring.device_address is not None  # asked of the driver once: launches ask nothing
    cases = [base[: 64 * 1024].view(64, 1024), base[1: 1 + 64 * 1024].view(64, 1024),  # aligned, then not
             base[: 1 * 96].view(1, 96), base[: 37 * 130].view(37, 130),
             base[: 4096 * 130].view(4096, 130).to(torch.bfloat16)]
    intos = {"device": None, "pinned": lambda shape: torch.empty(shape, dtype=torch.float32, pin_memory=True),
             "ring": ring.claim}
    stats = tc.TILE_STATS
    for x in cases:
        want = fused.column_stats(x, stats, direct=False).cpu()  # the setting triton_launch: triton
        before = len(launches)
        for where, into in intos.items():
            for _ in range(2):
                got = fused.column_stats(x, stats, into)
                torch.cuda.synchronize()
                got = got if isinstance(got, torch.Tensor) else got.tensor()
                assert torch.equal(got.cpu(), want), (tuple(x.shape), x.dtype, x.data_ptr() % 16, where)
                ring.reset()
        assert len(launches) == before, (tuple(x.shape), x.dtype)  # every one of them went direct
    kernels = {id(launch.function) for launch in fused._launches.values() if launch.compiled}
    assert len(kernels) >= 4  # aligned / not, rows == 1, width 130, bf16: not all one kernel
    hook = lambda metadata: None  # noqa: E731 - a profiler's launch hook: Triton's dispatch again
    triton_hooks = fused._hooks
    triton_hooks.launch_enter_hook.add(hook)
    try:
        fused.column_stats(cases[0], stats)
    finally:
        triton_hooks.launch_enter_hook.remove(hook)
    assert len(launches) == before + 1



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", ["direct", "native"])
def test_planned_due_calls_write_into_the_ring_what_the_general_path_does(monkeypatch, request, launch):
    """After a (name, layer)'s first due call the runtime plans its launch (api._fast):
    later due calls of that layout go through the plan, into ring slices, and write
    what the fused kernel writes through Triton's own dispatch; another layout goes the
    general way and is planned anew; every result waits for its batch's event.  The
    same through the native launch (triton_launch: native), which checks the layout
    itself; a launch hook added meanwhile sends the next call to Triton's dispatch."""
    import threading

    from source_patch.runtime.trace import api, hub, ring as ring_module

    fused = tc.fused_kernel()
    if fused is None:
        pytest.skip("Triton is not importable here")
    if launch == "native":
        request.getfixturevalue("native_launch")
    monkeypatch.setattr(tc, "NATIVE_LAUNCH", launch == "native")  # (auto, the default, takes one where built)
    x = torch.randn(64, 4, 256, device="cuda")  # first: pinning needs the CUDA context it makes
    ring = ring_module.shared()
    assert ring.pin() and ring.device_address is not None
    for name, value in (("_ring", ring), ("_enabled", True), ("_stepping", True), ("_unsealed", []),
                        ("_publisher", threading.current_thread())):  # alive: no publisher takes the results
        monkeypatch.setattr(api, name, value)
    general = []
    emit = api._emit
    monkeypatch.setattr(api, "_emit", lambda *args: general.append(args[2].shape) or emit(*args))
    sub = hub.parse_subscription({"op": "subscribe", "id": "t", "names": ["h"], "compressor": {"kind": "tiles"}})
    api.set_subscriptions([sub])
    try:
        calls = sum(api.due_call_us())
        for _ in range(4):
            api.trace("h", x, layer=1)
            api.trace_step()
        plan = api._table.plans[("h", 1)]
        assert isinstance(plan, api._Plan) and not plan.stale and sum(api.due_call_us()) == calls + 4
        assert (plan.native is not None) == (launch == "native")
        assert general == [x.shape]  # the first call only: the others went by the plan
        y = torch.randn(32, 512, device="cuda")  # another layout: the general path, then a new plan
        api.trace("h", y, layer=1)
        api.trace_step()
        assert general == [x.shape, y.shape] and api._table.plans[("h", 1)].shape == y.shape
        side = torch.cuda.Stream()  # the plan launches on the stream current at the call
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            api.trace("h", y, layer=1)
            api.trace_step()
        assert general == [x.shape, y.shape]
        items = list(api._pending)
        assert len(items) == 6 and all(item.event is not None and item.slot for item in items)
        assert [item.stream == side for item in items] == [False] * 5 + [True]
        assert [tuple(item.shape) for item in items] == [tuple(x.shape)] * 4 + [tuple(y.shape)] * 2
        torch.cuda.synchronize()
        stats = sub.compressor.fused[0]
        for item, tensor in zip(items, [x] * 4 + [y] * 2):
            offset, _, _, shape = item.slot
            got = ring.floats[offset // 4: offset // 4 + math.prod(shape)].view(shape)
            want = fused.column_stats(tensor, stats, direct=False)
            assert torch.equal(got, want.cpu()), item.shape
        api._pending.clear()
        crossed = torch.randn(512, 32, device="cuda").t()  # y's shape, not contiguous: not the plan's
        api.trace("h", crossed, layer=1)
        assert general == [x.shape, y.shape, crossed.shape] and len(api._pending) == 1
        seen = []  # a profiler's launch hook, added between two calls: Triton's dispatch at once
        fused._hooks.launch_enter_hook.add(seen.append)
        try:
            api.trace_step()
            api.trace("h", y, layer=1)
        finally:
            fused._hooks.launch_enter_hook.remove(seen.append)
        assert general[-1] == y.shape and len(general) == 4 and seen
    finally:
        api.set_subscriptions(())
        api._pending.clear()
        ring.reset()


class _FlatLauncher:
    """The shape of Triton 3.6's CudaLauncher (its __call__ passes every argument
    through to its C launch, the kernel's arguments last and flat)."""

    def __init__(self, scratch: int = 0):
        self.launch = lambda *arguments: self.calls.append(arguments)
        self.calls: list = []
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = (lambda size: None if size == 0 else "scratch")  # stand-in for the allocator
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch(self.global_scratch_size), scratch(self.profile_scratch_size), *args)


class _NestedLauncher(_FlatLauncher):
    """The shape of Triton 3.9's: the kernel's arguments in one tuple."""

    def __call__(self, gridX, gridY, gridZ, stream, function, metadata, launch_metadata, enter, leave, *args):
        self.launch(gridX, gridY, gridZ, stream, function, False, True, metadata, launch_metadata, enter, leave,
                    None, None, "annotations", "signature", args)


class _Kernel:
    def __init__(self, launcher):
        self.run, self.function, self.packed_metadata = launcher, 0xF00, ("meta",)

    def _init_handles(self):
        pass


@pytest.mark.parametrize("launcher, direct", [(_FlatLauncher(), True), (_NestedLauncher(), False),
                                              (_FlatLauncher(scratch=64), False)],
                         ids=["flat", "nested", "scratch"])
def test_a_planned_launch_hands_the_c_launch_what_the_launchers_call_would(launcher, direct):
    """fused._launcher skips the launcher's Python __call__ only where it passes its
    arguments through unchanged (recorded once with stand-ins); either way, the planned
    call hands the C launch exactly what the __call__ hands it."""
    fused = tc.fused_kernel()
    if fused is None:
        pytest.skip("Triton is not importable here")
    launch = fused._Launch(torch.empty(64, 256), ("mean", "max"))
    call, before, middle, after = fused._launcher(_Kernel(launcher), launch)
    assert (call is not launcher) == direct and launch.function == 0xF00
    if direct:
        assert not launcher.calls  # recorded without launching
    launcher.calls.clear()
    launcher(*launch.grid, 1, 77, 0xF00, ("meta",), None, None, None, 1024, 2048, *launch.args)
    call(*before, 77, *middle, 1024, 2048, *after)
    assert len(launcher.calls) == 2 and launcher.calls[0] == launcher.calls[1], launcher.calls


def test_parsing_and_the_host_stage_need_no_torch(tmp_path):
    """What the trace forwarder runs of a compressor (its parameters' checks, the host
    stage) imports numpy only: the forwarder starts without torch (~3 s of a core and
    ~200-500 MiB less a traced rank).  A projection's vector is read with numpy there,
    bfloat16 and the float8s widened from their bits: the same values and the same
    refusals as torch reads."""
    vectors = {"f32": torch.randn(48), "bf16": torch.randn(48, dtype=torch.bfloat16),
               "e5m2": torch.randn(48).to(torch.float8_e5m2), "e4m3": (torch.randn(48) * 50).to(torch.float8_e4m3fn),
               "zero": torch.zeros(48, dtype=torch.bfloat16)}
    path = tmp_path / "v.safetensors"
    save_file(vectors, str(path))
    x = torch.randn(6, 48)
    specs = [{"kind": "tiles", "tiles": 5, "stats": list(tc.TILE_STATS)}, {"kind": "histogram", "bins": 7},
             {"kind": "topk", "k": 4}, {"kind": "raw"}]
    specs += [{"kind": "projection", "file": str(path), "key": key} for key in ("f32", "bf16", "e5m2", "e4m3")]
    reduced = [tc.parse(spec).reduce(x).numpy().tolist() for spec in specs]  # the device stage's output, here
    script = f"""
import json, sys
import numpy as np
from source_patch.runtime.trace import compress as tc
specs, reduced = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = []
for spec, values in zip(specs, reduced):
    c = tc.parse(spec)
    values = np.asarray(values, dtype=np.float64 if spec["kind"] == "topk" else np.float32)
    out.append(c.finish(values, (6, 48)).tolist())
vectors = {{key: tc.load_vector({str(path)!r}, key, False)[0].tolist() for key in ("f32", "bf16", "e5m2", "e4m3")}}
try:
    tc.parse({{"kind": "projection", "file": {str(path)!r}, "key": "zero"}})
    refused = None
except ValueError as exc:
    refused = str(exc)
print(json.dumps({{"torch": "torch" in sys.modules, "out": out, "vectors": vectors, "refused": refused}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(specs), json.dumps(reduced)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["torch"] is False
    for spec, out in zip(specs, got["out"]):
        np.testing.assert_allclose(np.asarray(out), tc.parse(spec)(x).numpy(), rtol=1e-6, atol=1e-6, err_msg=str(spec))
    for key, values in got["vectors"].items():
        assert np.array_equal(np.asarray(values, dtype=np.float32), vectors[key].float().numpy()), key
    assert got["refused"] is not None and "has norm 0.0; cannot normalize" in got["refused"]
