"""What the machine gives a dumping process: first touch of fresh host memory, the
disk's sequential write bandwidth, pinned host allocation (overhead_bench.py runs it
first, on a fresh machine: the first-run condition of issue 34).

Each is measured twice: the second pass tells whether the first paid a one-off (a
virtual machine backing guest memory on its first touch, a thin disk allocating its
blocks, the driver pinning pages it never pinned before).
"""

from __future__ import annotations

import os
import time

CHUNK = 64 << 20


def touch(gib: float) -> float:
    """GiB/s of touching ``gib`` of newly mapped anonymous memory, one thread, in huge
    pages where the kernel gives them (fewer faults: what is left is the memory's own
    first touch, which a virtual machine's host may back only then)."""
    import mmap

    import torch

    size = int(gib * 2**30)
    area = mmap.mmap(-1, size)
    if hasattr(area, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    view = torch.frombuffer(area, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        view.fill_(1)
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    del view
    area.close()
    return gib / elapsed


def disk(folder: str, gib: float, path: str | None = None) -> tuple[float, float, str]:
    """(GiB/s into the page cache, GiB/s to the disk with fdatasync, the file) of writing
    ``gib`` in CHUNK pieces: to a new file under ``folder``, or over the blocks of the
    existing file ``path`` (a thin virtual disk allocates a block on its first write)."""
    path = path or os.path.join(folder, f"probe-{time.monotonic_ns()}.bin")
    block = os.urandom(CHUNK)  # incompressible
    chunks = max(1, int(gib * 2**30 / CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # no O_TRUNC: an existing file is overwritten in place
    try:
        start = time.perf_counter()
        for _ in range(chunks):
            os.write(fd, block)
        buffered = time.perf_counter() - start
        os.fdatasync(fd)
        synced = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):  # out of the page cache: a second pass allocates its pages again
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    total = chunks * CHUNK / 2**30
    return total / buffered, total / synced, path


def pinned(gib: float) -> float:
    """Seconds to allocate ``gib`` of pinned host memory through torch's caching host
    allocator, its cache emptied first (what a dumping process's first records pay)."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    start = time.perf_counter()
    block = torch.empty(int(gib * 2**30), dtype=torch.uint8, pin_memory=True)
    elapsed = time.perf_counter() - start
    del block
    if empty is not None:
        empty()
    return elapsed


def settings() -> str:
    values = []
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_expire_centisecs"):
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                values.append(f"{name}={f.read().strip()}")
        except OSError:
            pass
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        values.append(f"MemTotal={info['MemTotal'].strip()} MemFree={info['MemFree'].strip()} "
                      f"Cached={info['Cached'].strip()}")
    except (OSError, KeyError):
        pass
    return " ".join(values)


def report(folder: str, gib: float, cuda: bool) -> None:
    """Pass 1 on fresh memory and new disk blocks; pass 2 on memory freed by pass 1 and
    over pass 1's file: a first-use cost shows as pass 1 slower."""
    print(f"machine probes ({gib:g} GiB each): {settings()}", flush=True)
    path = None
    for i in (1, 2):
        line = f"  pass {i}: first touch of {'fresh' if i == 1 else 'reused'} memory {touch(gib):.2f} GiB/s"
        into_cache, to_disk, path = disk(folder, gib, path)
        line += (f"; disk write ({'new blocks' if i == 1 else 'over them'}) {into_cache:.2f} GiB/s into the "
                 f"page cache, {to_disk:.2f} GiB/s with fdatasync")
        if cuda:
            line += f"; pinned allocation of {gib:g} GiB {pinned(gib):.2f} s"
        print(line, flush=True)
    os.unlink(path)
    print(flush=True)
