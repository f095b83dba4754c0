"""Cold start across ranks: N processes import the same patched modules at once.

    python bench/cold_start_bench.py [--procs 16] [--rounds 3] [--spec megatron_cpu] [--module M]

For each round: one process with an empty cache (cold x1); N at once with an empty
cache (cold xN: one parses each module, the others wait on the key's lock and load
it); N at once with the cache filled (warm xN: nobody parses).  Wall-clock seconds;
cold xN / warm xN is what the parsing costs the whole job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import stats  # bench/


def launch(n: int, cache: str, spec: str, module: str) -> float:
    env = {**os.environ, "SOURCE_PATCH": spec, "SOURCE_PATCH_CACHE": cache, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", f"import {module}"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for _ in range(n)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"import failed: {err.decode()[-2000:]}")
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spec", default="megatron_cpu")
    p.add_argument("--module", default="megatron.core.models.gpt")
    args = p.parse_args()
    rows = {"cold x1": [], f"cold x{args.procs}": [], f"warm x{args.procs}": []}
    for _ in range(args.rounds):
        cache = tempfile.mkdtemp(prefix="sp-cold-")
        shutil.rmtree(cache)
        rows["cold x1"].append(launch(1, cache, args.spec, args.module))
        shutil.rmtree(cache)
        rows[f"cold x{args.procs}"].append(launch(args.procs, cache, args.spec, args.module))
        rows[f"warm x{args.procs}"].append(launch(args.procs, cache, args.spec, args.module))
        shutil.rmtree(cache)
    print(f"import {args.module} under {args.spec}; {args.rounds} rounds, seconds (wall)")
    print(f"{'run':12} {stats.HEADER}")
    for name, values in rows.items():
        print(f"{name:12} {stats.cells(values)}")
    cold, warm = (statistics.median(rows[k]) for k in (f"cold x{args.procs}", f"warm x{args.procs}"))
    print(f"cold x{args.procs} / warm x{args.procs} (median): {cold / warm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
