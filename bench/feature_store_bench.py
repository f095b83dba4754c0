"""Feature store: put+get throughput of the zero-copy Mooncake path against serialising
each sample with torch.save into one Mooncake object, and of the shared-directory
backend, with the loopback ceiling measured in the same run.

    python bench/feature_store_bench.py              # 5 rounds (+1 warm-up) per variant
    python bench/feature_store_bench.py --quick      # 2 rounds, 16 MiB samples

Starts a mooncake_master (next to this Python) on loopback and a producer process;
this process is the consumer.  Per round the producer puts a sample and reports its
put time, the consumer gets it (timed), checks it bitwise on the first round, and
releases it (not timed).  Samples: one 64 MiB tensor, and 256 tensors of 256 KiB.

Variants:
  zero-copy   MooncakeStore.put/get: one object per tensor, read straight into the
              output (large tensors registered in place, small ones staged in pooled
              registered buffers), one batched transfer per sample
  zero-copy-out  the same, the consumer reading into tensors it reuses (get(ref, out=...))
  serialised  torch.save of the sample's dict to BytesIO, one object via the raw
              client's upsert(bytes); get(bytes), then torch.load(weights_only=True)
  shared-dir  SharedDirStore in --dir (default: a temporary folder in $TMPDIR, /tmp)
  dir-shm     SharedDirStore in a temporary folder in /dev/shm (tmpfs), if there is one
  raw         the ceiling: upsert_from of one registered 64 MiB buffer in the
              producer, get_into one registered, already-touched 64 MiB buffer in the
              consumer (reused every round)
  raw-fresh   the same into a freshly allocated (then registered) 64 MiB buffer per
              round, as a get must return new tensors: the page faults of new memory

Throughput = sample bytes / (put seconds + get seconds) of a round; the table shows
the min and median round time, the put and get medians, and GiB/s at the median.
torch.load appears here only as the baseline being measured (weights_only=True);
the feature store itself never unpickles anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import stats  # bench/

GiB = 1 << 30


def shapes(quick: bool) -> dict:
    total = (16 if quick else 64) << 20
    return {f"1 x {total >> 20} MiB": [total], f"{total >> 18} x 256 KiB": [256 << 10] * (total >> 18)}


def make_sample(sizes: list, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randint(-2**31, 2**31 - 1, (n // 4,), generator=g, dtype=torch.int32)
            for i, n in enumerate(sizes)}


def mooncake_url(master: str, segment_mb: int, direct_kb: int) -> str:
    return f"mooncake://{master}?store=bench&segment_mb={segment_mb}&buffer_mb=256&direct_kb={direct_kb}"


# -- the producer process -----------------------------------------------------------

def producer(args) -> None:
    from source_patch.runtime.features.store import open_store

    mc = open_store(mooncake_url(args.master, 1024, args.direct_kb))
    folders = {"shared-dir": open_store(f"dir://{args.dir}?store=bench")}
    if args.shm:
        folders["dir-shm"] = open_store(f"dir://{args.shm}?store=bench")
    samples = {}
    raw = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        variant, shape, sample_id = cmd["variant"], cmd["shape"], cmd["sample_id"]
        if shape not in samples:
            samples[shape] = make_sample(shapes(args.quick)[shape], seed=len(shape))
        tensors = samples[shape]
        answer = {}
        start = time.perf_counter()
        if variant.startswith("zero-copy"):
            answer["ref"] = mc.put(sample_id, tensors).to_json()
        elif variant in folders:
            answer["ref"] = folders[variant].put(sample_id, tensors).to_json()
        elif variant == "serialised":
            buf = io.BytesIO()
            torch.save(tensors, buf)
            rc = mc.client.upsert(sample_id, buf.getbuffer(), mc.config)
            if rc != 0:
                raise SystemExit(f"serialised upsert rc={rc}")
        elif variant in ("raw", "raw-fresh"):
            if raw is None:
                raw = torch.cat([t.view(torch.uint8) for t in tensors.values()])
                assert mc.client.register_buffer(raw.data_ptr(), raw.nbytes) == 0
            start = time.perf_counter()
            rc = mc.client.upsert_from(sample_id, raw.data_ptr(), raw.nbytes, mc.config)
            if rc != 0:
                raise SystemExit(f"raw upsert_from rc={rc}")
        answer["put_s"] = time.perf_counter() - start
        print(json.dumps(answer), flush=True)
    if raw is not None:
        mc.client.unregister_buffer(raw.data_ptr())
    print(json.dumps({"stats": mc.stats()}), flush=True)
    mc.close()
    for store in folders.values():
        store.close()


# -- the consumer (this process) ----------------------------------------------------

def bitwise(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per variant (default 5; --quick 2)")
    p.add_argument("--quick", action="store_true", help="16 MiB samples, 2 rounds")
    p.add_argument("--dir", default=None, help="folder of the shared-dir backend (default: a temporary one)")
    p.add_argument("--direct-kb", type=int, default=1024,
                   help="MooncakeStore direct_kb: tensors this large are registered in place, smaller ones staged")
    p.add_argument("--shm", default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", default="consumer", help=argparse.SUPPRESS)
    p.add_argument("--master", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "producer":
        return producer(args)
    rounds = args.rounds or (2 if args.quick else 5)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from source_patch.runtime.features.ref import FeatureRef
    from source_patch.runtime.features.store import open_store

    from source_patch.runtime.features.mooncake import master as mooncake_master

    stack = contextlib.ExitStack()  # the master, stopped last
    master = stack.enter_context(mooncake_master())
    own_dir = args.dir is None
    folder = tempfile.mkdtemp(prefix="feature-bench-") if own_dir else args.dir
    shm = tempfile.mkdtemp(prefix="feature-bench-", dir="/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    log_path = os.path.join(tempfile.gettempdir(), "feature_store_bench.producer.log")
    child = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--master", master, "--dir", folder,
                              "--direct-kb", str(args.direct_kb)] + (["--shm", shm] if shm else [])
                             + (["--quick"] if args.quick else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             stderr=open(log_path, "wb"))

    def ask(**cmd):
        child.stdin.write(json.dumps(cmd) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the producer exited (rc {child.wait()}); see {log_path}")
        return json.loads(line)

    results = []  # (variant, shape, put times, get times, nbytes)
    try:
        mc = open_store(mooncake_url(master, 0, args.direct_kb))  # a consumer contributes no segment
        folders = {"shared-dir": open_store(f"dir://{folder}?store=bench")}
        if shm:
            folders["dir-shm"] = open_store(f"dir://{shm}?store=bench")
        raw_out = None
        for shape, sizes in shapes(args.quick).items():
            expected = make_sample(sizes, seed=len(shape))
            nbytes = sum(sizes)
            variants = ["zero-copy", "zero-copy-out", "serialised", *folders] + (
                ["raw", "raw-fresh"] if len(sizes) == 1 else [])
            reused = None  # zero-copy-out: output tensors allocated (and touched) once
            for variant in variants:
                puts, gets = [], []
                for r in range(rounds + 1):  # round 0 warms up
                    sample_id = f"{variant}-{len(sizes)}-{r}"
                    answer = ask(op="put", variant=variant, shape=shape, sample_id=sample_id)
                    start = time.perf_counter()
                    if variant.startswith("zero-copy") or variant in folders:
                        store = folders.get(variant, mc)
                        ref = FeatureRef.from_json(answer["ref"])
                        if variant == "zero-copy-out" and reused is None:
                            reused = {k: torch.zeros_like(v) for k, v in expected.items()}
                            start = time.perf_counter()
                        got = store.get(ref, out=reused if variant == "zero-copy-out" else None)
                        elapsed = time.perf_counter() - start
                        ok = r or bitwise(expected, got)
                        store.release(ref)
                    elif variant == "serialised":
                        data = mc.client.get(sample_id)
                        got = torch.load(io.BytesIO(data), weights_only=True)
                        elapsed = time.perf_counter() - start
                        ok = r or bitwise(expected, got)
                        mc.client.remove(sample_id, True)
                    else:
                        if variant == "raw-fresh":
                            out = torch.empty(nbytes, dtype=torch.uint8)
                            assert mc.client.register_buffer(out.data_ptr(), nbytes) == 0
                        else:
                            if raw_out is None:  # registered once, outside the timing, and touched
                                raw_out = torch.zeros(nbytes, dtype=torch.uint8)
                                assert mc.client.register_buffer(raw_out.data_ptr(), nbytes) == 0
                                start = time.perf_counter()
                            out = raw_out
                        rc = mc.client.get_into(sample_id, out.data_ptr(), nbytes)
                        if variant == "raw-fresh":
                            mc.client.unregister_buffer(out.data_ptr())
                        elapsed = time.perf_counter() - start
                        ok = rc == nbytes and (r or torch.equal(
                            out, torch.cat([t.view(torch.uint8) for t in expected.values()])))
                        mc.client.remove(sample_id, True)
                    if not ok:
                        raise SystemExit(f"{variant} {shape}: the consumer read different bytes")
                    got = None
                    if r:
                        puts.append(answer["put_s"])
                        gets.append(elapsed)
                results.append((variant, shape, puts, gets, nbytes))
                print(f"  done: {variant:<10} {shape}", file=sys.stderr, flush=True)
        producer_stats = ask(op="exit")["stats"]
        consumer_stats = mc.stats()
        if raw_out is not None:
            mc.client.unregister_buffer(raw_out.data_ptr())
        mc.close()
        for store in folders.values():
            store.close()
    finally:
        if child.poll() is None:
            child.stdin.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
        stack.close()
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    print(f"\nfeature store bench: {rounds} rounds (+1 warm-up), producer and consumer in separate processes, "
          f"loopback TCP, {os.cpu_count()} cores, direct_kb={args.direct_kb}; shared-dir in {folder}"
          + (f", dir-shm in {shm}" if shm else ""))
    header = (f"{'variant':<13} {'sample':<14} {'ms: ' + stats.HEADER:>34} {'put ms':>8} {'get ms':>8} "
              f"{'GiB/s med':>10} {'GiB/s best':>11}")
    print(header)
    print("-" * len(header))
    median_rate = {}
    for variant, shape, puts, gets, nbytes in results:
        totals = [a + b for a, b in zip(puts, gets)]
        best, med = min(totals), statistics.median(totals)
        median_rate[variant, shape] = nbytes / med / GiB
        print(f"{variant:<13} {shape:<14} {stats.cells(totals, 1e3, 1):>34} {statistics.median(puts) * 1e3:>8.1f} "
              f"{statistics.median(gets) * 1e3:>8.1f} {nbytes / med / GiB:>10.2f} {nbytes / best / GiB:>11.2f}")
    print()
    for shape in shapes(args.quick):
        for variant in ("zero-copy", "zero-copy-out"):
            ratio = median_rate[variant, shape] / median_rate["serialised", shape]
            print(f"{variant} / serialised, {shape}: {ratio:.2f}x (median put+get; goal >= 2x)")
    for shape in shapes(args.quick):
        if ("raw", shape) in median_rate:
            print(f"zero-copy / raw ceiling, {shape}: {median_rate['zero-copy', shape] / median_rate['raw', shape]:.2f}; "
                  f"/ raw into fresh memory: {median_rate['zero-copy', shape] / median_rate['raw-fresh', shape]:.2f}")
    for who, stats in (("producer", producer_stats), ("consumer", consumer_stats)):
        print(f"{who} MooncakeStore: register {stats['register_seconds'] * 1e3:.2f} ms over "
              f"{stats['registrations']} registrations, transfer {stats['transfer_seconds']:.2f} s, "
              f"staging copies {stats['copy_seconds']:.2f} s")


if __name__ == "__main__":
    main()
