"""Comparator throughput: `compare()` on a pair of dump directories of a given total size.

    python bench/compare_bench.py                # a 1 GiB pair (512 MiB a side), 3 rounds
    python bench/compare_bench.py --gib 0.25     # smaller
    python bench/compare_bench.py --tp 2         # the training side's activations as 2 column-parallel shards

Both sides are written by the real dump runtime (safetensors + manifest), laid out as
the specs lay them out: the rollout side SGLang-style (one row per token, 0-based
layers), the training side Megatron-style ([s, b] rows, 1-based layers), the same
values with a little noise on the training side.  With ``--tp N`` the training side
dumps each activation as N tensor-parallel shards (the last dimension split, tags
``tp``), which the comparator joins before pairing.  Each round times a whole
`compare(rollout, train)` (read, join, index, pair, compare, drill down; the page cache is
warm after the first); the table gives min and median over the rounds, in records/s and GiB/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from source_patch.runtime.dump import api as dump
from source_patch.runtime.verdict import compare

import stats  # bench/

NAMES = ("layer_input", "attention_output", "pre_mlp_residual", "mlp_output")


def write_side(root: Path, exp: str, steps: int, seq: int, batch: int, hidden: int, layers: int,
               training: bool, seed: int, tp: int = 1) -> int:
    """One side's dumps; returns the number of records."""
    dump.configure(enable=True, dir=str(root), exp_name=exp, names=None, rank_dir="rank-{rank}")
    torch.manual_seed(seed)
    records = 0
    for step in range(steps):
        dump.dump_step(step=step)
        gen = torch.Generator().manual_seed(step)  # the same tokens and values on both sides
        tokens = torch.randint(0, 1000, (seq, batch), generator=gen)
        rids = [f"s{step}-r{b}" for b in range(batch)]
        if training:  # Megatron: [s, b]
            shape, ids, pos = (seq, batch), tokens, torch.arange(seq).unsqueeze(1).expand(seq, batch)
            rows = torch.arange(batch, dtype=torch.int32).expand(seq, batch)
        else:         # SGLang: request after request
            shape, ids = (seq * batch,), tokens.t().reshape(-1)
            pos = torch.arange(seq).repeat(batch)
            rows = torch.arange(batch, dtype=torch.int32).repeat_interleave(seq)
        dump.dump("input_ids", ids.contiguous())
        dump.dump("positions", pos.contiguous())
        dump.dump("row_request", rows.contiguous(), rids=rids)
        for layer in range(layers):
            for name in NAMES:
                full = torch.randn(seq, batch, hidden, generator=gen)
                if not training:
                    dump.dump(name, full.permute(1, 0, 2).reshape(seq * batch, hidden).contiguous(), layer=layer)
                    records += 1
                    continue
                value = full + 1e-6 * torch.randn(full.shape)
                for k, shard in enumerate(value.chunk(tp, dim=-1)):  # tp 1: the whole tensor, untagged
                    dump.dump(name, shard.contiguous(), layer=layer + 1, **({"tp": k} if tp > 1 else {}))
                    records += 1
        records += 3
        dump.flush()
    dump.configure(enable=False)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="total size of the pair")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", help="where to write the dumps (default: a temporary folder)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shards of the training side's activations")
    args = p.parse_args(argv)
    seq, batch, hidden, layers = 512, 4, 1024, 8
    per_step = len(NAMES) * layers * seq * batch * hidden * 4
    steps = max(1, round(args.gib * (1 << 30) / 2 / per_step))
    root = Path(args.dir or tempfile.mkdtemp(prefix="compare-bench-"))
    start = time.perf_counter()
    n = write_side(root, "rollout", steps, seq, batch, hidden, layers, training=False, seed=1)
    n += write_side(root, "train", steps, seq, batch, hidden, layers, training=True, seed=1, tp=args.tp)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"wrote {n} records, {size / (1 << 30):.2f} GiB in {time.perf_counter() - start:.1f} s "
          f"({steps} steps x {layers} layers x {len(NAMES)} names x [{seq} x {batch}, {hidden}] fp32 a side"
          f"{f'; training in {args.tp} TP shards' if args.tp > 1 else ''})")
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        report = compare.compare(root / "rollout", root / "train", rtol=1e-4)
        times.append(time.perf_counter() - start)
        assert report.first_divergent is None and report.tokens == steps * seq * batch
        assert report.token_view["requests"] and all(r.percentiles and r.worst for r in report.rows)  # drilled
        assert args.tp == 1 or report.joined, "the shards were not joined"
    med = statistics.median(times)
    print(f"{'rounds':>6} {'seconds: ' + stats.HEADER:>40} {'records/s (median)':>19} {'GiB/s (median)':>15}")
    print(f"{args.rounds:>6} {stats.cells(times):>40} {n / med:>19.0f} {size / (1 << 30) / med:>15.3f}")


if __name__ == "__main__":
    main()
