"""A trainer for the overlapped push and the several-group tests: a real Megatron-Core
MoE in DDP's buffers (bench/push_common.build, a world of one on CPU) whose parameters
change in place at every step, and ``weight_sync.push()`` after each step.

    python tests/e2e/weight_sync_overlap_trainer.py OUT --steps 6 [--overlap] [--packed]
        [--work N] [--live] [--groups 29600:2,29601:3 | --port P]

The weight_sync settings come from the environment (SOURCE_PATCH_WEIGHT_SYNC_*) and
these flags.  Per step: the "optimizer step" (every parameter changed in place), the
mapped engine tensors recorded (the snapshot version v must arrive as), push(v), then
the next step's work (``--work`` passes that rewrite every parameter, the way the next
step's forward and optimizer would run while an overlapped push is on the wire).
--live (a control): the overlapped push sends the live parameter buffers instead of
its snapshot, so the next step's writes can reach the wire.
Writes OUT.safetensors (``v/<engine name>``: what each version must hold) and OUT.json
(per step: the caller's time in push(), whether the push was still on the wire when
push() returned and when the next step's work ended, the background send's time; the
final state()).
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from push_common import build, mapped  # noqa: E402 - bench/


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--packed", action="store_true", help="from_buffers off: the packed push (program)")
    p.add_argument("--work", type=int, default=3, help="passes over every parameter after each push")
    p.add_argument("--live", action="store_true", help="control: send the live buffers, no snapshot")
    p.add_argument("--groups", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    cli = p.parse_args()
    torch.set_num_threads(1)
    ddp = build(SimpleNamespace(layers=cli.layers, experts=cli.experts, hidden=cli.hidden, tp=1, ep=1),
                torch.device("cpu"))
    from source_patch.runtime.weight_sync import names as weight_names
    from source_patch.runtime.weight_sync import sync as weight_sync

    settings = {"backend": "gloo", "overlap": cli.overlap, "from_buffers": not cli.packed}
    settings.update({"groups": cli.groups} if cli.groups else {"port": cli.port})
    weight_sync.configure(**settings)
    if cli.live:
        live_hand_over(weight_sync)
    chunks, layout = [ddp], weight_names.Layout.from_config(ddp.config)
    params = [p for p in ddp.parameters()]
    gen = torch.Generator().manual_seed(0)
    noise = [torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-2 for p in params]

    def step():  # the optimizer's writes: every parameter changed in place
        with torch.no_grad():
            for param, n in zip(params, noise):
                param.add_(n)

    expected, rows = {}, []
    for version in range(1, cli.steps + 1):
        step()
        for name, tensor in mapped(ddp, layout):
            expected[f"{version}/{name}"] = tensor.detach().clone()
        start = time.perf_counter()
        error = None
        try:
            weight_sync.push(chunks, version=version)
        except Exception as exc:  # noqa: BLE001 - recorded (an error of the push before, with overlap)
            error = f"{type(exc).__name__}: {exc}"
        returned = time.perf_counter()
        inflight = weight_sync._inflight
        on_wire_at_return = inflight is not None and inflight.ended is None
        with torch.no_grad():
            for _ in range(cli.work):  # the next step's work while the update is on the wire
                step()
                for param, n in zip(params, noise):
                    param.sub_(n)  # (undone: the next version is the step() above plus one)
        worked = time.perf_counter()
        on_wire_after_work = inflight is not None and inflight.ended is None
        rows.append({"version": version, "push_s": returned - start, "work_s": worked - returned,
                     "on_wire_at_return": on_wire_at_return, "on_wire_after_work": on_wire_after_work,
                     "send_s": None, "send_end_after_return_s": None, "error": error, "inflight": inflight,
                     "returned": returned})
    flushed = weight_sync.flush()
    for row in rows:
        inflight, returned = row.pop("inflight"), row.pop("returned")
        if inflight is not None and inflight.ended is not None:
            row["send_s"] = inflight.ended - inflight.started
            row["send_end_after_return_s"] = inflight.ended - returned
    state = weight_sync.state()
    closed = weight_sync.close()
    save_file(expected, cli.out + ".safetensors")
    Path(cli.out + ".json").write_text(json.dumps({"rows": rows, "flushed": flushed, "closed": closed,
                                                   "state": state}, default=str))
    sys.stdout.flush()
    os._exit(0)


def live_hand_over(weight_sync) -> None:
    """The control: an overlapped push that sends the live parameter buffers from its
    thread (no snapshot), so the next step's writes can go out as version v."""

    class Live:
        def __init__(self, backend, tensors, extra):
            self.backend, self.tensors, self.extra = backend, tensors, list(extra)

        def send(self, manifest, _buffers, extra=(), **_):
            self.backend.send(manifest, self.tensors, extra=self.extra)

    class NoSnapshot:
        stream = SimpleNamespace(device=torch.device("cpu"))

        def sending(self):
            import contextlib

            return contextlib.nullcontext()

    def hand_over(backend, manifest, tensors, extra):
        weight_sync._inflight = weight_sync._InFlight(Live(backend, tensors, extra), manifest, None, NoSnapshot(),
                                                      torch.device("cpu"))

    weight_sync._hand_over = hand_over


if __name__ == "__main__":
    threading.excepthook = lambda args: print("thread failed:", args.exc_value, flush=True)
    main()
