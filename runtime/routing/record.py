"""Routing records: which experts each token was routed to, per MoE layer.

The data layer under routing capture and replay (docs/routing.md), and the one
place users import it from (the runtime imports each name from its own module)::

    import source_patch.runtime.routing.record as record   # RoutingRecord, load, slice_for_rank

    rec = RoutingRecord(indices={1: idx1, 2: idx2}, num_experts=64, topk=8,
                        seq_lens=[4096] * 2, sample_ids=["a", "b"])
    rec.save("routes/step-0.safetensors")          # atomic; one safetensors file
    rec = load("routes/step-0.safetensors")        # checks format/version, validates
    mine = slice_for_rank(rec, batch=2, cp_size=2, cp_rank=1,
                          tp_size=2, tp_rank=0, sequence_parallel=True)

The record is one contract whose parts live in a module each, from the base up:

    record_file.py      the file format (safetensors + JSON metadata), RoutingRecordError
    record_sglang.py    SGLang's routed_experts field (base64 int32) <-> tensors
    record_type.py      RoutingRecord: fields, checks, save/load, from/to SGLang's meta
    record_slicing.py   CP/SP slices for a Megatron rank, and back
    record_megatron.py  Megatron's RouterReplay <-> records
    record.py           this module: the public names (docs/routing.md), and the inspect CLI

CLI::

    python -m source_patch.runtime.routing.record FILE
"""

from __future__ import annotations

import os
import sys

import torch

from .record_file import FORMAT, MAX_HEADER_BYTES, METADATA_KEY, RoutingRecordError, disk_dtypes, read_header
from .record_megatron import from_megatron_native, megatron_replay_layers, to_megatron_native
from .record_slicing import gather_slices, local_seq_positions, slice_for_rank, token_rows
from .record_type import RoutingRecord, from_sglang_meta, load, to_sglang_meta

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "METADATA_KEY", "RoutingRecord", "RoutingRecordError", "describe",
           "from_megatron_native", "from_sglang_meta", "gather_slices", "load", "local_seq_positions", "main",
           "megatron_replay_layers", "read_header", "slice_for_rank", "to_megatron_native", "to_sglang_meta",
           "token_rows"]


def describe(path: str | os.PathLike) -> str:
    """Metadata and a per-layer table (tokens, topk, dtype on disk, expert load)."""
    meta, entries = read_header(path)
    record = load(path)
    dtypes = disk_dtypes(entries)
    lines = [f"{path}: {FORMAT} v{meta['version']}"]
    for key in ("source", "num_experts", "topk", "num_tokens", "token_order", "parallel", "seq_lens",
                "padding", "sample_ids", "extra"):
        value = meta.get(key)
        if isinstance(value, list) and len(value) > 8:
            value = f"{value[:8]}... ({len(value)} entries)"
        lines.append(f"  {key}: {value}")
    table = [("layer", "tokens", "topk", "dtype", "probs", "load min", "load max", "load mean")]
    for layer in record.layers:
        counts = torch.bincount(record.indices[layer].reshape(-1), minlength=record.num_experts)
        table.append((str(layer), str(record.num_tokens), str(record.topk), dtypes[f"layer.{layer}.indices"],
                      dtypes.get(f"layer.{layer}.probs", "-"), str(int(counts.min())), str(int(counts.max())),
                      f"{counts.float().mean().item():.2f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.routing.record",
                                     description="Show a routing record file.")
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        print(describe(args.file))
    except RoutingRecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
