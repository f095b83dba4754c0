"""This process's global rank and parallel ranks, read from what is already imported
and initialised (torch.distributed, Megatron's or SGLang's parallel_state); never
imports any of them, so a process without distributed state pays nothing.

The one place the runtime reads them: the dump tags its records with them, routing
names its rank folders by ``global_rank`` and slices a record by ``cp_tp`` (the
sequence split itself: core/slicing.py)."""

from __future__ import annotations

import os
import sys

_rank: int | None = None          # cached once torch.distributed is initialised
_parallel: tuple | None = None    # (key, tags) of the parallel ranks last read

_MEGATRON_RANKS = (("tp", "get_tensor_model_parallel_rank"), ("pp", "get_pipeline_model_parallel_rank"),
                   ("cp", "get_context_parallel_rank"), ("ep", "get_expert_model_parallel_rank"),
                   ("dp", "get_data_parallel_rank"))
_SGLANG_RANKS = (("tp", "get_tensor_model_parallel_rank"), ("pp", "get_pipeline_model_parallel_rank"),
                 ("ep", "get_moe_expert_parallel_rank"))
_SOURCES = (
    ("megatron.core.parallel_state", _MEGATRON_RANKS,
     ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP")),
    ("sglang.srt.distributed.parallel_state", _SGLANG_RANKS, ("_TP", "_PP")),
)


def global_rank() -> int:
    """torch.distributed's rank once initialised (then cached), else $RANK, else 0."""
    global _rank
    if _rank is not None:
        return _rank
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            _rank = dist.get_rank()
            return _rank
    except Exception:  # noqa: BLE001
        pass
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def parallel_tags() -> dict:
    """``{"tp": .., "pp": .., ...}`` from an initialised Megatron (or SGLang)
    parallel_state; cached until its groups change."""
    global _parallel
    for module_name, getters, key_attrs in _SOURCES:
        ps = sys.modules.get(module_name)
        if ps is None:
            continue
        try:
            if not ps.model_parallel_is_initialized():
                continue
        except Exception:  # noqa: BLE001
            continue
        key = (module_name,) + tuple(id(getattr(ps, attr, None)) for attr in key_attrs)
        cached = _parallel
        if cached is not None and cached[0] == key:
            return cached[1]
        tags = {}
        for tag, getter in getters:
            try:
                tags[tag] = int(getattr(ps, getter)())
            except Exception:  # noqa: BLE001 - a group that this job does not use
                pass
        _parallel = (key, tags)
        return tags
    return {}


def cp_tp() -> tuple[int, int, int, int]:
    """``(cp_size, cp_rank, tp_size, tp_rank)`` of an initialised Megatron parallel_state,
    else ``(1, 0, 1, 0)``: how this rank's sequence is split (core/slicing.py).  Read on
    every call (not cached), once per record, never per router call."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    return 1, 0, 1, 0


def forget() -> None:
    """Read the ranks again next time (a forked child, a test that re-initialises)."""
    global _rank, _parallel
    _rank = _parallel = None
