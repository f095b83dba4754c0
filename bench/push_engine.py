"""push_bench.py --engine: the whole push, transfer included (see push_bench.py's
docstring): rank 0 trains and pushes, rank 1 receives, over one group per push method;
a table of each method against a raw broadcast of the same bytes.  Shares the model
and the push backend with push_bench.py through push_common.py (never imports
push_bench: push_bench imports this module)."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import stats  # bench/
from push_common import backend, bucket, build, mapped, plan_packing, profile  # bench/

ENGINE_ROWS = ("raw", "push buffers", "push tensors", "push unplanned")
METHOD = {"raw": "buffers", "push buffers": "buffers", "push tensors": "tensors", "push unplanned": "unplanned"}


def engine(rank: int, args, *ports: int) -> None:
    """--engine: rank 0 builds the model and pushes, rank 1 receives; both run the
    same schedule of rows, so every collective meets its peer."""
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if cpu:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    from source_patch.runtime.weight_sync import transport as wt

    def links() -> dict:  # one group per push method (see the module doc)
        return {method: wt.Link(wt.open_group("127.0.0.1", port, rank, 2, f"push_{method}",
                                              "gloo" if cpu else "nccl", 300), 300)
                for method, port in zip(("buffers", "tensors", "unplanned"), ports)}

    if rank == 1:
        _Ends(links(), args).receiver()
    else:
        start = time.perf_counter()
        ddp = build(args, device)  # a world of its own, as a trainer's default group is
        print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
        from source_patch.runtime.weight_sync import sync as weight_sync

        weight_sync.configure(checksum=args.checksum, **bucket(args))
        _Ends(links(), args).sender(ddp, weight_sync)
    # Both ends passed the last barrier; leave without tearing the groups down:
    # destroying them held each process until its timeout on two H200 (NCCL), and
    # leaving them to the interpreter's exit now and then aborted a process in gloo's
    # C++ teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Ends:
    """The two ends of --engine's schedule, over one link per push method."""

    def __init__(self, links: dict, args):
        self.links, self.args = links, args
        self.link = links["buffers"]  # barriers, the raw broadcast
        n = len(ENGINE_ROWS)
        self.rotation = [list(ENGINE_ROWS[r % n:] + ENGINE_ROWS[:r % n]) for r in range(args.warmup + args.rounds)]

    def barrier(self) -> None:
        if self.link.device.type == "cuda":
            torch.cuda.synchronize()
        self.link.vote(0, "barrier")

    def raw(self, flat: torch.Tensor) -> None:
        self.link.wait(self.link.broadcast(flat), "raw")
        self.link.vote(0, "ack")  # as push() ends with its verdict

    def receiver(self) -> None:
        from source_patch.runtime.weight_sync import transport as wt

        for method in self.links:  # the warm-up pushes; then the update's size
            self.receive(wt, method)
        size = torch.zeros(1, dtype=torch.int64, device=self.link.device)
        self.link.wait(self.link.broadcast(size), "size")
        flat = torch.empty(int(size.item()), dtype=torch.uint8, device=self.link.device)
        for order in self.rotation:
            for row in order:
                self.barrier()
                if row == "raw":
                    self.raw(flat)
                else:
                    self.receive(wt, METHOD[row])
        for _ in range(5 if self.args.profile else 0):
            self.receive(wt, "buffers")
        for method, link in self.links.items():  # the bitwise check: send back what arrived
            self.barrier()
            got = sorted(self.receive(wt, method))
            joined = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in got])
            broadcast_from(link, torch.tensor([joined.numel()], dtype=torch.int64, device=joined.device))
            broadcast_from(link, joined)
        self.barrier()

    def receive(self, wt, method: str) -> list:
        update = wt.receive(self.links[method], stage=self.args.stage)
        got = [(name, tensor.clone() if self.args.stage == "bucket" else tensor) for name, tensor in update.tensors]
        update.close()
        return got

    def sender(self, ddp, weight_sync) -> None:
        def push(method: str):
            plan_packing(method != "unplanned")  # off: packed tensor by tensor, as before issue 32's item 2
            weight_sync.configure(from_buffers=method == "buffers", replay_packing=True)
            weight_sync._connected = lambda: backend(self.links[method])  # the bench's groups (push() is unchanged)
            self.version += 1
            weight_sync.push([ddp], version=self.version)
            state = weight_sync.state()
            if state["sent_from"] != ("buffers" if method == "buffers" else "tensors") or \
                    state["planned"] != (method == "tensors"):
                raise SystemExit(f"push sent from {state['sent_from']} (planned: {state['planned']}), not {method}")

        self.version = 0
        for method in self.links:
            push(method)
        nbytes = weight_sync.state()["counters"]["last_bytes"]
        self.link.wait(self.link.broadcast(torch.tensor([nbytes], dtype=torch.int64, device=self.link.device)),
                       "size")
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.link.device)
        times: dict = {row: [] for row in ENGINE_ROWS}
        for r, order in enumerate(self.rotation):
            for row in order:
                self.barrier()
                t0 = time.perf_counter()
                if row == "raw":
                    self.raw(flat)
                else:
                    push(METHOD[row])
                if self.link.device.type == "cuda":
                    torch.cuda.synchronize()
                if r >= self.args.warmup:
                    times[row].append(time.perf_counter() - t0)
        if self.args.profile:  # where a push from the buffers spends its host time, transfer included
            profile(lambda: push("buffers"), torch.cuda.synchronize if torch.cuda.is_available() else lambda: None,
                    "cumtime")
        checked = [self.check(ddp, push, method) for method in self.links]
        self.barrier()
        engine_report(self.args, ddp, nbytes, times, checked)

    def check(self, ddp, push, method: str) -> int:
        """Redraw every parameter in place (DDP's buffers stay), push, and compare what
        the receiver got, byte for byte, with the parameters mapped here."""
        from source_patch.runtime.weight_sync import names as weight_names

        with torch.no_grad():
            for p in ddp.parameters():
                p.uniform_(-1, 1)
        self.barrier()
        push(method)
        expected = sorted(mapped(ddp, weight_names.Layout.from_config(ddp.config)))
        joined = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in expected])
        size = torch.zeros(1, dtype=torch.int64, device=joined.device)
        broadcast_from(self.links[method], size)
        back = torch.empty(int(size.item()), dtype=torch.uint8, device=joined.device)
        broadcast_from(self.links[method], back)
        if not torch.equal(back, joined):
            raise SystemExit(f"check: the receiver's tensors differ from the trainer's (pushed from {method})")
        return len(expected)


def broadcast_from(link, tensor: torch.Tensor, src: int = 1) -> None:
    link.wait(torch.distributed.broadcast(tensor, group=link.group, group_src=src, async_op=True), "check")


def engine_report(args, ddp, nbytes: int, times: dict, checked: list) -> None:
    where = "CPU x2 (gloo)" if args.cpu or not torch.cuda.is_available() else \
        f"{torch.cuda.get_device_name(0)} x2 (NCCL)"
    n_params = sum(1 for _ in ddp.parameters())
    print(f"check: pushed from the buffers and packed, the receiver got all {checked[0]} engine tensors "
          "equal to the trainer's, byte for byte")
    print(f"\nwhole push(): {where}, torch {torch.__version__}; {args.layers} layers x {args.experts} experts, "
          f"hidden {args.hidden}: {n_params} Megatron parameters -> {checked[0]} engine tensors, "
          f"{nbytes / (1 << 30):.2f} GiB; checksums {'on' if args.checksum else 'off'}, receiver stage "
          f"{args.stage}; {args.rounds} rounds after {args.warmup} warm-up, rows rotated")
    print(f"{'':<28} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'GB/s':>7} {'% of raw':>9} {'90% interval':>15}")
    raw = statistics.median(times["raw"])
    for row, values in times.items():
        _, low, high = stats.bootstrap(stats.ratio_of_medians, times["raw"], values, paired=True)
        median = statistics.median(values)
        print(f"{ENGINE_LABELS[row]:<28} {1e3 * min(values):>9.2f} {1e3 * median:>10.2f} {1e3 * max(values):>9.2f} "
              f"{nbytes / median / 1e9:>7.1f} {100 * raw / median:>8.1f}% {f'{100 * low:.1f}..{100 * high:.1f}%':>15}")
    print("(rank 0's wall time from a barrier to the verdict: host work, gathers of none (one rank), packing, "
          "transfer, checksums, the receiver's verification; not the engine's load_weights)")
    print("every round, ms:")
    for row, values in times.items():
        print(f"  {ENGINE_LABELS[row]:<28} " + " ".join(f"{1e3 * v:.1f}" for v in values), flush=True)


ENGINE_LABELS = {"raw": "raw broadcast, same bytes", "push buffers": "push(), from DDP's buffers",
                 "push tensors": "push(), packed", "push unplanned": "push(), packed unplanned"}
