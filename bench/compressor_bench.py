"""Device time of each trace compressor on one hidden-state-sized tensor.

    python bench/compressor_bench.py            # GPU: [1024, 4, 1024] float32 and bfloat16
    python bench/compressor_bench.py --quick    # CPU smoke run

Times are CUDA-event times per call (median of --iters), the input already on the
device; `tiles, two passes` reduces the contiguous width first, then the rows (an
alternative measured side by side; on an H200 the two were within the noise, so the
runtime keeps the single reduction).  A second of warm-up work runs first: the
first variant timed used to read high.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without the package installed

from source_patch.runtime import trace_compress as tc  # noqa: E402


def tiles_two_passes(x: torch.Tensor, tiles: int = 64) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).unflatten(1, (tiles, -1))
    count = rows.shape[0] * rows.shape[2]
    return torch.stack([rows.sum(2, dtype=torch.float32).sum(0) / count,
                        torch.linalg.vector_norm(rows, math.inf, 2, dtype=torch.float32).amax(0),
                        torch.linalg.vector_norm(torch.linalg.vector_norm(rows, 2, 2, dtype=torch.float32), 2, 0)
                        / math.sqrt(count)])


def timed(fn, x, iters: int) -> float:
    """Median milliseconds per call."""
    for _ in range(3):
        fn(x)
    samples = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(x)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shape = (1024, 4, 1024) if device == "cuda" else (64, 4, 256)
    with tempfile.TemporaryDirectory() as tmp:
        vector = Path(tmp) / "v.safetensors"
        save_file({"v": torch.randn(shape[-1])}, str(vector))
        variants = {"tiles (mean, absmax, rms)": tc.parse({"kind": "tiles"}),
                    "tiles, two passes": tiles_two_passes,
                    "histogram, 64 bins": tc.parse({"kind": "histogram"}),
                    "topk 16": tc.parse({"kind": "topk"}),
                    "projection": tc.parse({"kind": "projection", "file": str(vector)})}
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        print(f"device {name}, torch {torch.__version__}, input {list(shape)}, median of {args.iters} calls\n")
        print(f"{'compressor':28}" + "".join(f"{str(d).replace('torch.', ''):>12}" for d in (torch.float32, torch.bfloat16)))
        inputs = [torch.randn(shape, device=device, dtype=d) for d in (torch.float32, torch.bfloat16)]
        warm_until = time.perf_counter() + 1.0
        while time.perf_counter() < warm_until:  # clocks up, caches and allocator warm
            for fn in variants.values():
                fn(inputs[0])
        for label, fn in variants.items():
            print(f"{label:28}" + "".join(f"{timed(fn, x, args.iters):10.3f}ms" for x in inputs))


if __name__ == "__main__":
    main()
