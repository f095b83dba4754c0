"""Live tracing end to end: examples/train_moe.py trains on CPU under
megatron_cpu + dump + trace in a subprocess while a real client subscribes over a
real WebSocket on 127.0.0.1.  Every frame must equal its compressor applied offline
to the tensor the dump runtime saved at the same (name, step, microbatch, layer)."""

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")
from source_patch.runtime.trace import compress as tc  # noqa: E402
from source_patch.runtime.dump.reader import load  # noqa: E402
from source_patch.runtime.trace.client import connect  # noqa: E402
from source_patch.runtime.core.endpoint import free_port  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
STEPS, LAYERS = 3, 4
TOKEN = "e2e-token"
# The dump runtime also records the router's logits, at the very anchor trace.yaml uses.
DUMP_ROUTER = """
source_patch: 1
name: dump_router_logits
patches:
  - id: router-logits
    module: megatron.core.transformer.moe.router
    target: TopKRouter.forward
    edits:
      - at: before
        match: "probs, routing_map = self.routing(...)"
        code: __sp__.dump("router_logits", logits, layer=self.layer_number)
"""
SUBSCRIPTIONS = [
    dict(names=["layer_output"], compressor={"kind": "tiles", "stats": list(tc.TILE_STATS), "tiles": 8}),
    dict(names=["attention_output", "mlp_output"], layers=[2, 3], compressor={"kind": "histogram", "bins": 16}),
    dict(names=["router_logits"], every=2, compressor={"kind": "topk", "k": 5}),
    dict(names=["final_hidden"], compressor={"kind": "raw"}),
]


def environment(tmp: Path, specs: str, **extra) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SOURCE_PATCH_DUMP", "SOURCE_PATCH_TRACE"))}
    environ.update(SOURCE_PATCH=specs, SOURCE_PATCH_CACHE=str(tmp / "cache"), **extra)
    return environ


def losses(stdout: str) -> list:
    return re.findall(r"^step \d+/\d+ loss (\S+) grad_norm (\S+)", stdout, re.M)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace-e2e")
    (tmp / "dump_router.yaml").write_text(DUMP_ROUTER)
    port = free_port()
    environ = environment(tmp, f"megatron_cpu,dump,trace,{tmp / 'dump_router.yaml'}",
                          SOURCE_PATCH_DUMP_DIR=str(tmp / "dumps"), SOURCE_PATCH_DUMP_EXP_NAME="run",
                          SOURCE_PATCH_TRACE_PORT=str(port), SOURCE_PATCH_TRACE_TOKEN=TOKEN,
                          SOURCE_PATCH_TRACE_WAIT="120", SOURCE_PATCH_TRACE_DIR=str(tmp / "sp-trace"))
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--micro-batches", "2"]
    proc = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The same training without tracing, alongside (both are single-threaded).
    plain = subprocess.Popen(command, env=environment(tmp, "megatron_cpu"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    async def client():
        async with connect(f"127.0.0.1:{port}", TOKEN, client="e2e", retry=120) as c:
            accepted = [await c.subscribe(**s, id=f"s{i}") for i, s in enumerate(SUBSCRIPTIONS)]
            frames = [frame async for frame in c]  # until the process closes its hub at exit
            return c.welcome, accepted, frames, c.close_code, c.errors

    try:
        result = asyncio.run(asyncio.wait_for(client(), 240))
        out, err = proc.communicate(timeout=240)
        plain_out, plain_err = plain.communicate(timeout=240)
    finally:
        for p in (proc, plain):
            if p.poll() is None:
                p.kill()
    assert proc.returncode == 0, out + err
    assert plain.returncode == 0, plain_err
    return tmp, out, err, plain_out, result


def test_every_subscribed_series_arrives_for_every_due_step(traced):
    _, _, err, _, (welcome, accepted, frames, close_code, errors) = traced
    assert welcome["rank"] == 0 and f"source-patch trace: hub http://127.0.0.1:" in err
    assert close_code == 1001 and errors == []  # closed by the process at exit ("going away")
    assert [a["id"] for a in accepted] == ["s0", "s1", "s2", "s3"]
    got = sorted((f.meta["sub"], f.name, f.step, f.layer) for f in frames)
    want = sorted([("s0", "layer_output", s, n) for s in range(STEPS) for n in range(1, LAYERS + 1)]
                  + [("s1", name, s, n) for name in ("attention_output", "mlp_output") for s in range(STEPS)
                     for n in (2, 3)]
                  + [("s2", "router_logits", s, n) for s in (0, 2) for n in range(1, LAYERS + 1)]
                  + [("s3", "final_hidden", s, None) for s in range(STEPS)])
    assert got == want
    assert [f.seq for f in frames] == list(range(len(frames)))  # nothing dropped
    shapes = {"s0": (5, 8), "s1": (18,), "s2": (2, 5), "s3": (32, 8, 64)}
    for f in frames:
        assert f.array.shape == shapes[f.meta["sub"]]
        assert f.meta["source_shape"] == ([32, 8, 8] if f.name == "router_logits" else [32, 8, 64])
        # tags: the rank, and phase and microbatch from the dump runtime's context.  A step's
        # first call is due; only the subscriptions made after training resumed (all but the
        # first, which ended the wait) may start at step 0's second microbatch.
        assert f.meta["rank"] == 0 and f.meta["phase"] == "fwd_bwd"
        assert f.meta["microbatch"] == 0 or (f.step == 0 and f.meta["sub"] != "s0")


def test_frame_values_equal_the_compressor_applied_to_the_dumped_tensors(traced):
    tmp, _, _, _, (_, _, frames, _, _) = traced
    dumped = {(r.name, r.step, r.microbatch, r.layer): r for r in load(tmp / "dumps" / "run")}
    assert len(frames) > 0
    for f in frames:
        reference = dumped[(f.name, f.step, f.meta["microbatch"], f.layer)].tensor
        expected = tc.parse({"kind": f.meta["kind"], **f.meta["params"]})(reference).numpy()
        np.testing.assert_allclose(f.array, expected, rtol=1e-6, atol=1e-6,
                                   err_msg=f"{f.name} step {f.step} layer {f.layer}")


def test_tracing_leaves_training_unchanged(traced):
    _, out, _, plain, _ = traced
    assert len(losses(out)) == STEPS and losses(out) == losses(plain)
