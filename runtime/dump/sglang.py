"""The dump runtime inside SGLang's scheduler processes (patches/dump.yaml).

Call sites::

    __sp__.dump_sglang_forward(self, input_ids, positions, forward_batch)   # model forward entry
    __sp__.dump_sglang_forward_end()                                      # after the logits
    __sp__.dump_sglang_replay(self, forward_batch)                        # decode graph replay
    if __sp__.dump_sglang_control(self, recv_req): return                 # Scheduler.handle_dumper_control

Each forward pass of the model is one dump ``step`` (counted per process), tagged
``phase=inference``, ``forward_mode`` (extend | decode | ...) and ``cuda_graph``: a
decode CUDA graph's replay runs no Python, so its start is recorded by
:func:`dump_sglang_replay` and its layers' tensors, staged in the graph at capture,
come from the drain after it (core/adapters/sglang_graphs.py), the real tokens' rows only.
Per pass it records ``input_ids``, ``positions`` and ``row_request`` (for every row,
the index of its request in the ``rids`` tag), so any dumped row maps back to a
(request, token position).  Once per process it writes ``model.json`` (class,
layer count, parameter names, shapes and dtypes, parallel ranks, whether CUDA graphs
are on) beside its manifest.

Control: SGLang's HTTP server mounts ``POST /dumper/{configure,get_state,reset}``
when ``DUMPER_SERVER_PORT=reuse`` and forwards each to every scheduler; the patched
handler answers from this runtime (the same validation as the loopback endpoint).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ..core import ranks
from ..core.adapters import graph_stage, sglang_graphs
from ..core.adapters.sglang_batch import DRAFT, BatchRows, batch_rows
from . import api, server

_forward_pass = 0
_summary_dirs: set = set()

# SGLang's dumper setting names that mean the same here (DUMPER_* / /dumper/configure).
SGLANG_NAMES = {"enable": "enable", "dir": "dir", "exp_name": "exp_name"}
UNSUPPORTED = {"filter": "a Python expression SGLang evaluates; use names/layers/steps/ranks/phases"}


def dump_sglang_forward(model, input_ids, positions, forward_batch, cuda_graph: bool = False) -> None:
    """Start of one forward pass: step, ambient tags, the row map, the model summary.
    ``cuda_graph``: a decode graph's replay is starting (:func:`dump_sglang_replay`)."""
    global _forward_pass
    if graph_stage.busy and graph_stage.building():
        return  # a decode graph's warm-up or capture: placeholders, not a forward (its replays are)
    step, _forward_pass = _forward_pass, _forward_pass + 1
    if not api.on:
        return
    try:
        api.dump_step(step=step)
        rows = batch_rows(forward_batch)  # a draft model's forward (speculative decoding) is tagged "draft"
        mode = rows.mode if isinstance(rows, BatchRows) else "draft" if rows is DRAFT else _mode_name(forward_batch)
        api.dump_context(forward_mode=mode, cuda_graph=cuda_graph)
        _write_summary(model)
        api.dump("input_ids", input_ids)
        api.dump("positions", positions)
        if isinstance(rows, BatchRows):
            index = torch.repeat_interleave(torch.arange(len(rows.rids), dtype=torch.int32),
                                            torch.tensor(rows.lens, dtype=torch.int64))
            api.dump("row_request", index, rids=[str(r) for r in rows.rids], rows_per_request=rows.lens)
    except Exception as exc:  # noqa: BLE001 - a dump must never break serving
        api.fail("dump_sglang_forward", exc)


def dump_sglang_graph_build(runner, key) -> None:
    """Before a decode graph's capture (``capture_one_shape``): with dumping on (this
    module's import has read the settings: SGLang captures before its first forward),
    the graph gets a stage (core/adapters/sglang_graphs.py)."""
    sglang_graphs.sglang_graph_build(runner, key)


def dump_sglang_replay(runner, forward_batch) -> None:
    """Before a decode graph's replay (``DecodeCudaGraphRunner.execute``): the forward's
    start as the model's own entry would record it, which a replay does not run; the
    layers' staged tensors follow from the drain (core/adapters/sglang_graphs.py)."""
    if api.on:
        dump_sglang_forward(runner.model_runner.model, forward_batch.input_ids, forward_batch.positions,
                            forward_batch, cuda_graph=True)


def dump_sglang_forward_end(logits_output=None):
    """End of one forward pass: its records are written now, not after the writer's
    linger (SGLang kills its schedulers at shutdown; a finished pass is not lost)."""
    if api.on:
        api.nudge()
    return logits_output


def _mode_name(forward_batch) -> str:
    name = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
    return str(name).lower()


def _write_summary(model) -> None:
    folder = api.rank_dir(ranks.global_rank())
    if folder in _summary_dirs:
        return
    _summary_dirs.add(folder)
    params = [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
              for n, p in model.named_parameters()]
    layers = getattr(getattr(model, "model", None), "layers", None)
    summary = {
        "model": type(model).__name__, "layers": len(layers) if layers is not None else None,
        "parameters": params, "ranks": {"rank": ranks.global_rank(), **ranks.parallel_tags()},
        "cuda_graph": _cuda_graph_enabled(), "pid": os.getpid(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".model.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, folder / "model.json")


def _cuda_graph_enabled() -> bool | None:
    """Whether this engine replays CUDA graphs (decode batches then dump nothing)."""
    context = sys.modules.get("sglang.srt.runtime_context")
    try:
        args = context.get_server_args()  # the operator's input, as SGLang 0.5.23 publishes it
        return bool(torch.cuda.is_available() and not args.disable_cuda_graph)
    except Exception:  # noqa: BLE001 - an SGLang without that accessor
        return None


# ---------------------------------------------------------------- /dumper/{method} on SGLang's server


def dump_sglang_control(scheduler, recv_req) -> bool:
    """Answer SGLang's DumperControlReqInput from this runtime; True when answered
    (the patched handler then returns)."""
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    try:
        response = [handle_control(recv_req.method, recv_req.body)]
        reply = DumperControlReqOutput(success=True, response=response)
    except (server.HTTPError, ValueError) as exc:
        reply = DumperControlReqOutput(success=False, response=[], error=f"rank {ranks.global_rank()}: {exc}")
    scheduler.ipc_channels.send_to_tokenizer.send_output(reply, recv_req)
    return True


def handle_control(method: str, body: dict) -> dict:
    """``configure`` (SGLang's names where they overlap, or this runtime's), ``get_state``
    (or ``state``), ``reset``: the reply of this process, tagged with its rank."""
    if method == "configure":
        changes = {}
        for key, value in (body or {}).items():
            if key in UNSUPPORTED:
                raise ValueError(f"{key!r} is not supported: {UNSUPPORTED[key]}")
            changes[SGLANG_NAMES.get(key, key)] = value
        reply = server.configure_changes(api.configure, changes)
    elif method in ("get_state", "state"):
        reply = api.state()
    elif method == "reset":
        reply = api.reset()
    else:
        raise ValueError(f"unknown method {method!r} (configure, get_state, reset)")
    return {"rank": ranks.global_rank(), **ranks.parallel_tags(), **reply}
