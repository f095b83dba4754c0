"""Weight sync, trainer side: the host time of ``weight_sync.push()`` apart from the
transfer, on a real Megatron-Core MoE (Qwen3-30B-A3B's layout: 48 layers of 128
experts, tiny widths: the cost is per tensor, not per byte) in Megatron's DDP with the
distributed optimizer's contiguous parameter buffers.

    python bench/push_bench.py                 # one GPU (a world of one, NCCL)
    python bench/push_bench.py --cpu           # CPU (gloo; megatron_cpu patched in)

One process: push() sends over ``LoopbackLink(record=False)``, a wire that costs
nothing, so what is timed is push()'s host work around the bytes.  Rows, min and
median over ``--rounds`` (each round runs them all in turn):
  walk            model.named_parameters(), wrappers stripped (what every push did
                  before the walk was kept: megatron.named_params)
  params          MegatronParams(chunks): the kept walk and the parallel groups
  mapping         every parameter through names.to_hf (fused QKV and gate/up splits)
  push buffers    push() from DDP's parameter buffers (the default without gathers)
  push tensors    push() with from_buffers off: packed by the program planned once per
                  layout (program.py: every engine tensor a kept view, per bucket a few
                  fused copies, on a GPU one replayed CUDA graph per run between gathers)
  push tensors, copied   the same with replay_packing off (the fused copies, no graph)
  push tensors, unplanned   packed tensor by tensor, mapped anew each push (before)
  push, walked    push buffers with the kept walk dropped before each push (the old cost)
--profile: cProfile's top functions over 5 pushes from the buffers.  Ends with a
bitwise check: one push over a recording link, replayed to a receiver.

--engine (two GPUs; --cpu: two gloo processes; push_engine.py): the whole push, transfer included.
Rank 0 trains on GPU 0 and pushes to rank 1, a receiver on GPU 1 (``receiver.receive``,
the engine's protocol without SGLang's load), over NCCL groups of two.  Per round, in
rotated order: one raw broadcast of the update's bytes, push() from DDP's buffers,
push() packed (the program), push() packed tensor by tensor (before); rank 0's wall
time from a barrier to the verdict, min / median / % of raw with a 90% interval.
Each push method has a group of its own (a receiver keeps one layout's buffer and
views; alternating layouts on one group cost ~100 ms a push).
Ends with a bitwise check of each path (the receiver sends back what it got).

--ep N / --tp N (CPU): N gloo processes, experts spread (expert parallelism) or every
layer split (tensor parallelism, expert TP too); the packed path.  Per round, push()
with the parameters gathered a window of DDP's buffer at a time (megatron._Windows)
and with one gather per parameter, alternated; rank 0's wall time, the collectives
each ran, and a check that both broadcast the same bytes.  Not here: the transfer
(weight_sync_bench.py) and the engine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import stats  # bench/
from push_common import backend, bucket, build, mapped, plan_packing, profile  # bench/


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", action="store_true", help="then cProfile 5 pushes from the buffers")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: that many CPU processes over gloo, timing the expert gathers")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism: that many CPU processes over gloo, timing the shard gathers")
    p.add_argument("--engine", action="store_true",
                   help="two processes (GPUs 0 and 1): push to a receiver over NCCL, the transfer included")
    p.add_argument("--stage", choices=("update", "bucket"), default="update", help="--engine: the receiver's stage")
    p.add_argument("--bucket-kib", type=int, default=0,
                   help="bucket size in KiB (default: the bucket_bytes setting); small ones cut tensors over buckets")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ep * args.tp > 1 or args.engine:
        from source_patch.runtime.core.endpoint import free_port

        if args.engine:
            from push_engine import engine  # its own module: spawned processes import it by name

            torch.multiprocessing.spawn(engine, args=(args, free_port(), free_port(), free_port()), nprocs=2,
                                        join=True)
        else:
            torch.multiprocessing.spawn(parallel, args=(args, free_port()), nprocs=args.ep * args.tp, join=True)
        return
    device = torch.device("cpu") if args.cpu or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cpu":
        torch.set_num_threads(1)
    start = time.perf_counter()
    ddp = build(args, device)
    print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
    from source_patch.runtime.weight_sync import megatron as weight_megatron
    from source_patch.runtime.weight_sync import names as weight_names
    from source_patch.runtime.weight_sync import sync as weight_sync
    from source_patch.runtime.weight_sync import transport as wt

    weight_sync.configure(checksum=args.checksum, **bucket(args))
    chunks = [ddp]
    layout = weight_names.Layout.from_config(ddp.config)
    # the bench's wires (push() itself is unchanged): one for the planned pushes, one for the
    # unplanned (a link keeps one packing: alternating would plan again every push)
    wires = {True: wt.LoopbackLink(device, record=False), False: wt.LoopbackLink(device, record=False)}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def walk():
        return [(weight_names.strip_wrappers(n), p) for n, p in ddp.named_parameters()]

    def mapping():
        for name, full in weight_megatron.MegatronParams(chunks).tensors():
            for _ in weight_names.to_hf(name, full, layout):
                pass

    def push(from_buffers=True, walked=False, replay=True, planned=True):
        plan_packing(planned)
        weight_sync.configure(from_buffers=from_buffers, replay_packing=replay)
        if walked:
            weight_megatron._walks.pop(ddp, None)
        wire = wires[planned]
        weight_sync._connected = lambda: backend(wire)
        wire.rewind()
        weight_sync.push(chunks, version=1)
        sent = weight_sync.state()["sent_from"]
        if sent != ("buffers" if from_buffers else "tensors"):
            raise SystemExit(f"push sent from {sent}")

    rows = {"walk": walk, "params": lambda: weight_megatron.MegatronParams(chunks), "mapping": mapping,
            "push buffers": push, "push tensors": lambda: push(from_buffers=False),
            "push tensors, copied": lambda: push(from_buffers=False, replay=False),
            "push tensors, unplanned": lambda: push(from_buffers=False, planned=False),
            "push, walked": lambda: push(walked=True)}
    times: dict = {key: [] for key in rows}
    for r in range(args.warmup + args.rounds):
        for key, fn in rows.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= args.warmup:
                times[key].append(time.perf_counter() - t0)
    if args.profile:
        profile(push, sync)
    check(ddp, chunks, layout, device, weight_sync, wt)  # last: they swap the wire for a recording one
    check_program(ddp, chunks, weight_sync, wt, device)
    report(args, device, ddp, layout, times)


def parallel(rank: int, args, port: int) -> None:
    """--ep / --tp: that many CPU processes (one thread each); every round pushes with
    the buffer windows and with a gather per parameter (rank 0 sends over a free wire,
    the others take part in the gathers); rank 0 reports, and checks that both
    variants send the same bytes."""
    device = torch.device("cpu")
    torch.set_num_threads(1)
    world = args.ep * args.tp
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0)
    ddp = build(args, device, rank, world, store)
    from source_patch.runtime.weight_sync import megatron as weight_megatron
    from source_patch.runtime.weight_sync import sync as weight_sync
    from source_patch.runtime.weight_sync import transport as wt

    weight_sync.configure(checksum=args.checksum, **bucket(args))
    window = weight_megatron.WINDOW_BYTES
    wires = {True: wt.LoopbackLink(device), False: wt.LoopbackLink(device)}  # recorded, for the check

    def push(windows: bool) -> float:
        weight_megatron.WINDOW_BYTES = window if windows else 0  # 0: each parameter its own window: per parameter
        wires[windows].rewind()
        weight_sync._connected = lambda: backend(wires[windows])
        torch.distributed.barrier()
        t0 = time.perf_counter()
        weight_sync.push([ddp], version=1)
        return time.perf_counter() - t0

    times: dict = {True: [], False: []}
    gathers: dict = {}
    for r in range(args.warmup + args.rounds):
        for windows in ((True, False) if r % 2 == 0 else (False, True)):
            elapsed = push(windows)
            gathers[windows] = weight_sync.state()["counters"]["gathers"]
            if rank == 0 and weight_sync.state()["planned"] != windows:  # windows: the program; else by tensor
                raise SystemExit(f"check: the push with{'out' * (not windows)} windows was "
                                 f"{'not ' * windows}planned")
            if r >= args.warmup:
                times[windows].append(elapsed)
    try:
        if rank == 0:
            compare(args, ddp, wires, gathers, times)
    finally:
        # Every rank leaves together: a rank that exits while another still holds the
        # group (gloo's threads, the store on rank 0) can abort in the C++ teardown.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def compare(args, ddp, wires, gathers, times) -> None:
    """(rank 0 of --ep / --tp) The byte check, then the table."""
    same = [torch.equal(a, b) for a, b in zip(wires[True].messages, wires[False].messages)]
    if len(wires[True].messages) != len(wires[False].messages) or not all(same):
        raise SystemExit("check: the windowed and the per-parameter gathers sent different bytes")
    print(f"check: both variants broadcast the same {len(same)} messages, byte for byte")
    experts = sum(1 for name, _ in ddp.named_parameters() if ".experts." in name)
    print(f"\npush() with tensor parallelism {args.tp}, expert parallelism {args.ep}: CPU, gloo, one thread per "
          f"process, torch {torch.__version__}; {args.layers} layers x {args.experts} experts ({experts} local expert "
          f"parameters on rank 0); {args.rounds} rounds after {args.warmup} warm-up, alternated")
    print(f"{'':<40} {'collectives':>11} {'min ms':>9} {'median ms':>10} {'max ms':>9}")
    for windows, label in ((False, "gathers per parameter (before)"), (True, "buffer windows")):
        values = times[windows]
        print(f"{label:<40} {gathers[windows]:>11} {1e3 * min(values):>9.1f} {1e3 * statistics.median(values):>10.1f} "
              f"{1e3 * max(values):>9.1f}")
    ratio, low, high = stats.bootstrap(stats.ratio_of_medians, times[True], times[False], paired=True)
    print(f"buffer windows / per parameter: {ratio:.3f}x on the medians (90% interval {low:.3f}x .. {high:.3f}x, "
          f"the rounds' pairs resampled)")
    print("(rank 0's wall time of push(), from a barrier; the wire costs nothing but records the bytes)", flush=True)


def check(ddp, chunks, layout, device, weight_sync, wt) -> None:
    """One push over a recording link, replayed: every engine tensor equals the mapped parameter."""
    weight_sync.configure(from_buffers=True)
    tx = wt.LoopbackLink(device)
    weight_sync._connected = lambda: backend(tx)
    weight_sync.push(chunks, version=2)
    expected = dict(mapped(ddp, layout))
    got = 0
    for name, tensor in wt.receive(wt.LoopbackLink(device, replay=tx)).tensors:
        if not torch.equal(tensor, expected[name]):
            raise SystemExit(f"check: {name} differs from the trainer's parameter")
        got += 1
    if got != len(expected):
        raise SystemExit(f"check: {got} of {len(expected)} tensors received")
    print(f"check: one push from the buffers, replayed: all {got} engine tensors equal the mapped parameters")


def check_program(ddp, chunks, weight_sync, wt, device) -> None:
    """The packed push by its program and tensor by tensor broadcast the same bytes,
    after the parameters changed in place (the program is kept) and after one moved
    (it is planned again)."""
    from source_patch.runtime.weight_sync import planning

    def messages(planned: bool) -> list:
        plan_packing(planned)
        weight_sync.configure(from_buffers=False)
        tx = wt.LoopbackLink(device)
        weight_sync._connected = lambda: backend(tx)
        weight_sync.push(chunks, version=3)
        if weight_sync.state()["planned"] != planned:
            raise SystemExit(f"check: the packed push was {'not ' * planned}planned")
        return tx.messages

    kept = []
    for change in ("redrawn", "moved"):
        with torch.no_grad():
            for p in ddp.parameters():
                p.uniform_(-1, 1)
            if change == "moved":  # a buffer reallocated (its parameters views of a copy): planned again
                move_buffer(ddp, next(p for name, p in ddp.named_parameters() if "linear_qkv" in name))
        planned, before = messages(True), messages(False)
        if len(planned) != len(before) or not all(map(torch.equal, planned, before)):
            raise SystemExit(f"check: the planned packed push sent other bytes than tensor by tensor ({change})")
        kept.append(planning._plans[ddp].sources[1])
    if kept[0] is kept[1]:
        raise SystemExit("check: the program was kept after a parameter moved")
    print(f"check: the packed push by its program sent the same {len(planned)} messages as tensor by tensor, "
          "byte for byte, with the parameters redrawn in place and after a buffer moved (planned again)")


def move_buffer(ddp, member) -> None:
    """Every parameter in ``member``'s storage becomes the same view of a copy of it."""
    old = member.untyped_storage()
    new = torch.empty(old.nbytes(), dtype=torch.uint8, device=member.device)
    new.copy_(torch.empty(0, dtype=torch.uint8, device=member.device).set_(old))
    for p in ddp.parameters():
        if p.untyped_storage().data_ptr() == old.data_ptr():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device).set_(
                new.untyped_storage(), p.storage_offset(), p.shape, p.stride())


LABELS = {"walk": "named_parameters() walk (uncached)", "params": "MegatronParams (kept walk)",
          "mapping": "name/layout mapping (to_hf), every tensor", "push buffers": "push(), from DDP's buffers",
          "push tensors": "push(), packed (planned program)", "push tensors, copied": "the same, no graph replay",
          "push tensors, unplanned": "push(), packed tensor by tensor (before)",
          "push, walked": "push(), buffers, walk redone (before)"}


def report(args, device, ddp, layout, times) -> None:
    from source_patch.runtime.weight_sync import names as weight_names

    n_params = sum(1 for _ in ddp.parameters())
    n_tensors = sum(1 for _ in weight_names.plan(
        [(weight_names.strip_wrappers(n), tuple(p.shape), p.dtype) for n, p in ddp.named_parameters()], layout))
    nbytes = sum(p.nbytes for p in ddp.parameters())
    where = "CPU, 1 thread" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\npush() host time: {where}, torch {torch.__version__}; {args.layers} layers x {args.experts} experts: "
          f"{n_params} Megatron parameters -> {n_tensors} engine tensors, {nbytes / (1 << 20):.1f} MiB bf16; "
          f"checksums {'on' if args.checksum else 'off'}; {args.rounds} rounds after {args.warmup} warm-up")
    print(f"{'':<42} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'us/tensor':>10}")
    for key, label in LABELS.items():
        values = times[key]
        print(f"{label:<42} {1e3 * min(values):>9.2f} {1e3 * statistics.median(values):>10.2f} "
              f"{1e3 * max(values):>9.2f} {1e6 * statistics.median(values) / n_tensors:>10.2f}")
    ratio, low, high = stats.bootstrap(stats.ratio_of_medians, times["push buffers"], times["push, walked"],
                                       paired=True)
    print(f"push from the buffers, walk kept / walk redone: {ratio:.3f}x on the medians (90% interval "
          f"{low:.3f}x .. {high:.3f}x, the rounds resampled)")
    ratio, low, high = stats.bootstrap(stats.ratio_of_medians, times["push tensors"],
                                       times["push tensors, unplanned"], paired=True)
    print(f"packed push, planned / tensor by tensor: {ratio:.3f}x on the medians (90% interval {low:.3f}x .. "
          f"{high:.3f}x, the rounds resampled)")
    print("(one wall-clock interval per row and round, device synchronised at both ends; the wire costs nothing)",
          flush=True)


if __name__ == "__main__":
    main()
