"""The link of the broadcast backends (``nccl`` on GPU, ``gloo`` on CPU): a process
group of its own for weight updates, joined the way SGLang's
``/init_weights_update_group`` joins it, and the deadline every wait on it gets.

    link = Link(open_group("10.0.0.1", 29600, rank, world_size, "source_patch_weights", "nccl", 300),
                timeout_s=300)
    ...
    link.close()  # destroys the group and stops its threads (Link.close)

Every wait is bounded by ``timeout_s``; a peer that dies or stalls fails the update
with WeightSyncTimeout / WeightSyncError and marks the link broken (the group is then
unusable: create a new one).  ``LoopbackLink`` plays both ends in one process (the
bench's ``--phases`` mode, tests).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .wire import WeightSyncError, WeightSyncTimeout, first_line, handshake_row


def open_group(host: str, port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float, nccl_ctas: int = 0):
    """Join (rank 0: create) a process group of its own for weight updates: a
    TCPStore at host:port (rank 0 serves it, listening on host only) under a
    PrefixStore(group_name).  The same construction as SGLang's
    ``init_custom_process_group``, which its ``/init_weights_update_group`` uses on
    the engine ranks, so a trainer joins the group an SGLang server opens.  The
    default group is neither used nor changed."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(host, port, rank, world_size, timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                         PrefixStore(group_name, store), group_name=group_name,
                                         backend_options=_options(backend, nccl_ctas), timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _options(backend: str, ctas: int = 0):
    """NCCL's kernels go on a high-priority stream: the block scheduler then gives the
    next broadcast SMs ahead of a bucket checksum or packing copy still running (each
    of those takes every SM it can get, and the broadcast waited for them).  ``ctas``:
    thread blocks per collective (NCCL's minimum and maximum; 0: NCCL's choice), the
    setting weight_sync.nccl_ctas; every rank of the group must use the same."""
    if backend != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    if ctas:
        options.config.min_ctas = options.config.max_ctas = ctas  # NCCL refuses a minimum without a maximum
    return options


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta):
    """Rank 0 serves the rendezvous store, the others connect to it (also usable for a
    default group: ``init_process_group(store=...)``).  torch's server
    listens on every interface whatever ``host`` says, so it is handed a socket bound
    to ``host`` alone.  (torch's rendezvous() served none at all under torchrun, which
    sets TORCHELASTIC_USE_AGENT_STORE: every rank became a client.)"""
    if rank:
        return dist.TCPStore(host, port, world_size, False, timeout)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise WeightSyncError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # The store owns the descriptor from here (closed with it, or if it fails to start).
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach(),
                         use_libuv=True)


def abort_group(group) -> None:
    """Abort an NCCL group's communicator at once, waiting for no peer (best effort: the
    group is given up either way; other backends are left to their destroy)."""
    try:
        if dist.get_backend(group) == "nccl":
            group._get_backend(torch.device("cuda")).abort()
    except Exception:  # noqa: BLE001
        pass


def close_group(group) -> None:
    """Destroy a group made by open_group (best effort: its peers may be gone).  NCCL's
    communicator is aborted first: its graceful shutdown waits for the peers, and one
    blocked in its next receive (a receive() loop) held the trainer there for good.
    (gloo has nothing to abort.)  The group's threads stop only when its last reference
    goes: a Link's group is closed with Link.close, which says why that matters."""
    abort_group(group)
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001
        pass


class Link:
    """A weight-update group, its device, and the deadline every wait gets.
    ``broadcast_bytes``: the bytes this rank passed to ``broadcast`` on it so far
    (a sender's sent, a receiver's received; the several-group fan-out counts each
    group's update with it)."""

    broadcast_bytes = 0

    def __init__(self, group, timeout_s: float = 300.0):
        self.group = group
        self.timeout_s = float(timeout_s)
        self.backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self.rank = group.rank()
        self.size = group.size()
        self.broken: Optional[str] = None
        self.packing = None  # the sender's bucket buffers and layout, reused while it holds
        self.program = None  # the same for a packed push's program (program.py)
        self.spans = None  # the same for updates sent from buffers (plan_buffers)
        self.known_manifest = None  # a receiver's last (tensors JSON, entries): parsed once
        self.layouts: dict = {}  # a receiver's accepted layouts: digest -> manifest (at most MAX_LAYOUTS)
        self.staged = None  # a receiver's (entries, stream buffer, views into it), reused while it holds
        self.streamed = None  # a streamed receiver's _BucketPlan, reused while its layout holds
        self.sums = None  # a receiver's (sent, computed) checksum tensors, reused while the bucket count holds

    def broadcast(self, tensor: torch.Tensor):
        self._check()
        self.broadcast_bytes += tensor.nbytes
        return dist.broadcast(tensor, group=self.group, group_src=0, async_op=True)

    def wait(self, work, what: str) -> None:
        """Wait for ``work`` at most timeout_s; a failure breaks the link."""
        self._check()
        try:
            if self.backend == "gloo":
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                self._poll(work, what)
                work.wait()  # orders the current stream after it; no host sync
        except WeightSyncError as exc:
            self.broken = str(exc)
            raise
        except RuntimeError as exc:
            text = str(exc).lower()
            timed_out = "timed out" in text or "timeout" in text
            reason = f"no peer answered within {self.timeout_s:g} s" if timed_out else "a peer failed"
            self.broken = f"{what}: {reason} ({type(exc).__name__}: {first_line(exc)})"
            raise (WeightSyncTimeout if timed_out else WeightSyncError)(self.broken) from exc

    def after(self, work, what: str) -> None:
        """Order the current stream after ``work``: on NCCL without waiting on the host
        (work still to check with ``wait``, for its deadline); elsewhere, ``wait``."""
        if self.backend == "nccl":
            self._check()
            work.wait()
        else:
            self.wait(work, what)

    def _poll(self, work, what: str) -> None:
        # NCCL work cannot be waited on with a deadline; poll its completion
        # (an event query, no device sync) and give the communicator up on expiry.
        # The first 0.2 ms spin: a handshake or a vote completes in tens of us, and a
        # sleep rounds up to the timer's slack (~60 us) at each of the update's steps.
        now = time.monotonic()
        spin, deadline = now + 2e-4, now + self.timeout_s
        pause = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                abort_group(self.group)
                raise WeightSyncTimeout(f"{what}: no peer answered within {self.timeout_s:g} s")
            if now > spin:
                time.sleep(pause)
                pause = min(pause * 2, 5e-5)  # a late wake-up would leave the wire idle

    def handshake(self, row: list, what: str) -> list:
        """Every rank's ``row`` (wire.handshake_row), gathered: one collective and one
        wait where a header and a layout vote took two of each, on the path to the
        first bucket."""
        mine = torch.tensor(row, dtype=torch.int64).to(self.device)
        rows = torch.empty((self.size, len(row)), dtype=torch.int64, device=self.device)
        self._check()
        self.wait(dist.all_gather(list(rows.unbind(0)), mine, group=self.group, async_op=True), what)
        return rows.tolist()

    def vote(self, status, what: str) -> int:
        """All-reduce MAX of every rank's status: an int, or an int64 tensor of one
        element on the link's device (computed there: no host sync before the vote)."""
        flag = status if isinstance(status, torch.Tensor) else \
            torch.tensor([status], dtype=torch.int64, device=self.device)
        self._check()
        self.wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what)
        return int(flag.item())

    def close(self) -> None:
        """Destroy the group (close_group) and drop it; the link is unusable after.  The
        drop is what stops the group's threads: its destructor waits for them, the GIL
        released.  A gloo thread drops each collective once done, and where Python has
        let go of its tensors (a vote's flag) that drop takes the GIL; a thread that asks
        for it once the interpreter is exiting is ended inside a C++ destructor, and the
        process aborts (std::terminate).  A group kept to the end (a script's global)
        was destroyed at the exit, its threads racing it: keep no other reference."""
        group, self.group = self.group, None
        if group is not None:
            self.broken = self.broken or "the link was closed"
            close_group(group)

    def _check(self) -> None:
        if self.broken:
            raise WeightSyncError(f"the weight-update group is broken ({self.broken}); "
                                  "create a new one")


class LoopbackLink(Link):
    """A Link without a process group, for one process that plays both ends (the
    bench's ``--phases`` mode, tests).  ``send`` on a sender link records a copy of
    every broadcast (``record=False``: drops them, a wire that costs nothing);
    ``receive`` on ``LoopbackLink(device, replay=sender_link)`` gets those copies
    in order, as if broadcast.  Votes return the caller's own status, and every
    wait is already done.  ``rewind()`` before each update."""

    def __init__(self, device, record: bool = True, replay: Optional["LoopbackLink"] = None):
        self.group, self.timeout_s, self.backend = None, 0.0, "loopback"
        self.device = torch.device(device)
        self.rank, self.size = (0 if replay is None else 1), 2
        self.broken = None
        self.packing = self.spans = self.program = self.known_manifest = self.staged = self.streamed = None
        self.sums = None
        self.layouts = {}
        self.record, self.source = record, replay
        self.messages: list = []  # a sender's recorded broadcasts
        self.position = 0         # a receiver's next message

    def rewind(self) -> None:
        """Before each update: a sender forgets the last one, a receiver replays from the start."""
        if self.source is None:
            self.messages.clear()
        self.position = 0

    def broadcast(self, tensor: torch.Tensor):
        self._check()
        if self.source is not None:
            tensor.copy_(self.source.messages[self.position])
            self.position += 1
        elif self.record:
            self.messages.append(tensor.clone())
        return None

    def wait(self, work, what: str) -> None:
        self._check()

    def vote(self, status, what: str) -> int:
        self._check()
        return int(status.item()) if isinstance(status, torch.Tensor) else status

    def handshake(self, row: list, what: str) -> list:
        # A recorded wire cannot hear its receivers: the manifest always travels (a
        # receiver that never accepted a layout is in every handshake).
        self._check()
        if self.source is None:
            if self.record:
                self.messages.append(torch.tensor(row, dtype=torch.int64))
            return [row, handshake_row()]
        sender = self.source.messages[self.position].tolist()
        self.position += 1
        return [sender, row, handshake_row()]
