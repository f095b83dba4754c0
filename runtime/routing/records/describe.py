"""A routing record file, described: its metadata and a per-layer table (tokens, top-k,
dtype on disk, expert load).  ``describe(path)`` returns the text; the CLI prints it::

    python -m source_patch.runtime.routing.records.describe FILE
"""

from __future__ import annotations

import os
import sys

import torch

from ...core import commands
from .file import FORMAT, RoutingRecordError, disk_dtypes, read_header
from .record import load


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

    parser = argparse.ArgumentParser(prog="python -m source_patch.runtime.routing.records.describe",
                                     description="Show a routing record file.")
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        print(describe(args.file))
    except (RoutingRecordError, OSError) as exc:  # a record that cannot be read: unusable input
        return commands.error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
