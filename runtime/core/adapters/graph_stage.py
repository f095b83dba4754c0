"""Graph-safe call sites: what a call site sees while a CUDA graph is being captured
comes out after every replay of that graph (issue 31, build item 1).

A replayed CUDA graph runs only the device work recorded at capture: the Python of a
call site (a dump, a routing capture) never runs again.  So a call site that finds the
current stream capturing records only device work: a copy of its tensor into a static
buffer owned by that graph (allocated during capture, in the graph's memory pool, and
refilled by every replay).  After each replay, :meth:`GraphStage.drain` hands each
staged tensor, minus the padding rows of the graph's batch size, to the same writer
(``sink``) the eager call site uses, tagged ``cuda_graph=True`` and with the replay's
number::

    stage = GraphStage("decode-bs8")
    with stage.capture(), torch.cuda.graph(graph):   # call sites stage instead of writing
        out = model(static_input)
    stage.replay(graph)                               # instead of graph.replay()
    stage.drain(rows=real_batch, step=step)           # sinks get rows [:real_batch]

The drain copies the rows out of the static buffers on the current stream (no host
sync) before handing them on, so the next replay cannot overwrite what a writer has
not copied yet; writers then do what they do for eager tensors (routing: an async
device-to-host copy on a side stream).  Nothing stale is ever written: replaying a
graph whose staging was not drained raises :class:`GraphStageError`, and so does a
drain with nothing replayed since the last one.

Dump and trace call sites test one module flag, :data:`busy` (a capture or a Megatron
graph build in progress on some thread), and only then :func:`site`, which skips a
Megatron warm-up pass or stages under capture; with no graph being made their cost
is that one test.

The other direction (:func:`feed`): a call site that gives the graph a tensor (routing
replay's recorded expert ids) returns a static buffer under capture; before every
replay :meth:`GraphStage.replay` refills it for that forward (``fill``), so a replayed
graph routes as the record of its own step and micro-batch says, never as the capture's.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_local = threading.local()  # .stage: the GraphStage this thread captures into; .building: a Megatron build
_busy_lock = threading.Lock()
# Threads with a capture (a GraphStage's) or a Megatron graph build in progress.  The one
# test a capability's call site adds (dump, trace): zero, the call site runs as without graphs.
busy = 0


class GraphStageError(RuntimeError):
    """Staged tensors would be lost or written twice."""


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def active() -> "GraphStage | None":
    """The GraphStage this thread is capturing into, if any."""
    return getattr(_local, "stage", None)


def _set_local(**values) -> None:
    """Set this thread's ``stage`` / ``building``, keeping :data:`busy` in step."""
    global busy
    before = getattr(_local, "stage", None) is not None or getattr(_local, "building", None) is not None
    for name, value in values.items():
        setattr(_local, name, value)
    after = getattr(_local, "stage", None) is not None or getattr(_local, "building", None) is not None
    if before != after:
        with _busy_lock:
            busy += 1 if after else -1


def site(sink, key, tensor: torch.Tensor, **meta) -> bool:
    """For a call site that found :data:`busy` set: True when it must do nothing more,
    because this is an eager warm-up pass of a Megatron graph being built (nothing to
    record) or because ``tensor`` was staged in the graph being captured (:func:`stage`);
    False: an eager call, write as usual."""
    if warming_up():
        return True
    return stage(sink, key, tensor, **meta)


def stage(sink, key, tensor: torch.Tensor, **meta) -> bool:
    """For a call site: under graph capture, stage ``tensor`` for ``sink`` and return
    True (the call site must not write it itself); otherwise False."""
    if not tensor.is_cuda or not torch.cuda.is_current_stream_capturing():
        return False
    _capturing_stage(key, "its rows could never be drained after a replay").put(sink, key, tensor, **meta)
    return True


def _capturing_stage(key, why: str) -> "GraphStage":
    """The stage a call site under capture writes to: this thread's, or that of the graph
    being built (an SGLang graph's capture begins inside its backend: the first call site
    under it begins the stage)."""
    active = getattr(_local, "stage", None)
    if active is None:
        active = getattr(_local, "building", None)
        if active is None:
            raise GraphStageError(f"a call site ({key!r}) ran under CUDA graph capture outside "
                                  f"GraphStage.capture(): {why}")
        active.begin()
    return active


def feed(fill, key, like: torch.Tensor, **meta) -> torch.Tensor:
    """For a call site that gives the graph a tensor (routing replay's ids): under capture,
    a static buffer shaped like ``like`` that the graph reads, refilled before every
    replay by ``fill(key, buffer, replay=N, **meta, **tags)``; the call site returns it.

    The buffer is the one :func:`reserve` made for ``key`` in the graph's warm-up pass,
    outside the graph's memory pool.  One allocated under capture comes from that pool,
    where it may share memory with a scratch tensor of an earlier kernel of the same
    graph: each replay would then overwrite the fill before the call site reads it."""
    active = _capturing_stage(key, "its replays would read the capture's values forever")
    buffer = active.reserved.pop(key, None)
    if not _fits(buffer, like):
        # no warm-up (a GraphStage.capture() of your own): allocation only, no kernel (a clone
        # of ``like`` would be part of the graph and overwrite every fill with live values)
        buffer = torch.empty_like(like)
    active.feeds.append((fill, key, buffer, meta))
    return buffer


def reserve(key, like: torch.Tensor) -> None:
    """For a feeding call site in a graph's warm-up pass (:func:`warming_up`): allocate now,
    outside any graph's pool, the buffer :func:`feed` gives it under the capture."""
    stage = getattr(_local, "building", None)
    if stage is not None and not _fits(stage.reserved.get(key), like):
        stage.reserved[key] = torch.empty_like(like)


def _fits(buffer: "torch.Tensor | None", like: torch.Tensor) -> bool:
    return buffer is not None and (buffer.shape, buffer.dtype, buffer.device) == (like.shape, like.dtype, like.device)


class GraphStage:
    """The staging buffers of one CUDA graph and the state of its last replay."""

    def __init__(self, name: str, users: frozenset = frozenset()):
        self.name = name
        self.users = users  # the capabilities registered (use()) when it was built: who staged or fed
        self.hooked = False  # Megatron's replay hooks: between graph_replay and graph_replayed
        self.entries = []  # (sink, key, static buffer, meta), in call order, fixed at capture
        self.feeds = []  # (fill, key, static buffer, meta): what the graph reads, refilled per replay
        self.reserved = {}  # key -> a feed's buffer, allocated in a warm-up pass (reserve())
        self.replays = 0
        self.undrained = False

    @contextlib.contextmanager
    def capture(self):
        """Call sites in this block (on this thread) stage into this graph."""
        previous = self.begin()
        try:
            yield self
        finally:
            self.end(previous)

    def begin(self) -> "GraphStage | None":
        """Make this the stage call sites on this thread capture into (the start of
        :meth:`capture`, for code that cannot hold a ``with`` block); returns the
        previous one."""
        if self.entries or self.feeds:
            raise GraphStageError(f"graph {self.name!r}: captured twice (make a new GraphStage per graph)")
        previous = getattr(_local, "stage", None)
        _set_local(stage=self)
        return previous

    def end(self, previous: "GraphStage | None" = None) -> None:
        """The end of :meth:`begin`'s capture: ``previous`` (its return) is current again."""
        _set_local(stage=previous)

    def put(self, sink, key, tensor: torch.Tensor, **meta) -> None:
        buffer = torch.empty_like(tensor)  # during capture: the graph's pool, kept alive by this reference
        buffer.copy_(tensor.detach())
        self.entries.append((sink, key, buffer, meta))

    def replay(self, graph, **tags) -> None:
        """Refill what the graph reads (each feed's ``fill``, on the current stream), then
        ``graph.replay()``; refused while the previous replay's rows are undrained."""
        self.before_replay(**tags)
        graph.replay()
        self.after_replay()

    def before_replay(self, **tags) -> None:
        """What :meth:`replay` does before ``graph.replay()`` (for code that replays the
        graph itself): refuse an undrained stage, refill the feeds."""
        if self.undrained:
            raise GraphStageError(f"graph {self.name!r}: replay {self.replays + 1} would overwrite the staged rows "
                                  f"of replay {self.replays}, which were never drained")
        for fill, key, buffer, meta in self.feeds:
            fill(key, buffer, replay=self.replays + 1, **meta, **tags)

    def after_replay(self) -> None:
        """What :meth:`replay` does after ``graph.replay()``: the staged rows await a drain."""
        self.replays += 1
        self.undrained = bool(self.entries)

    def drain(self, rows: int | None = None, **tags) -> int:
        """Hand every staged tensor's first ``rows`` rows (default all: no padding) to its
        sink as ``sink(key, tensor, cuda_graph=True, replay=N, **meta, **tags)``;
        returns how many were handed on."""
        if not self.undrained:
            raise GraphStageError(f"graph {self.name!r}: nothing to drain (no replay since the last drain): "
                                  "its buffers hold rows that were written already or never computed")
        for sink, key, buffer, meta in self.entries:
            n = buffer.shape[0] if rows is None else rows
            if not 0 <= n <= buffer.shape[0]:
                raise GraphStageError(f"graph {self.name!r}: {n} rows asked of {key!r}, whose graph has "
                                      f"{buffer.shape[0]}")
            sink(key, buffer[:n].clone(), cuda_graph=True, replay=self.replays, **meta, **tags)
        self.undrained = False
        return len(self.entries)


# ------------------------------------------------------------------ Megatron-Core's own graphs
#
# patches/routing.yaml calls these from megatron-core's cuda_graphs.py (``cuda_graph_impl=
# "local"``): each ``_CudaGraphRunner`` gets a GraphStage when its forward graph is built
# (``create_fwd_graph``: eager warm-up passes, then the capture), is fed before and drained
# after every ``fwd_graph.replay()`` (``_CudagraphReplayNode.forward``).  A capability that
# stages or feeds under graphs registers with :func:`use`; with none registered every
# hook is one truthiness test and Megatron's graphs are built and replayed as without us.
# patches/dump.yaml and patches/trace.yaml carry the same hooks, so that each spec works
# alone: with several active each hook runs once per spec, and the repeats do nothing.

_users: dict = {}  # capability name -> on_unstaged(name, what): a graph built while it was off
_stages = None  # weakref.WeakKeyDictionary: _CudaGraphRunner -> GraphStage (made on first use)


def use(name: str, on_unstaged=None, on: bool = True) -> None:
    """Register (``on``) or drop capability ``name`` as a user of graph staging.
    ``on_unstaged(name, what)`` is called at each replay of a graph built while this
    capability was not registered (``what``: that graph, in words): its call sites in that
    graph were never staged or fed."""
    if on:
        _users[name] = on_unstaged
    else:
        _users.pop(name, None)


def reported_once(activity: str, fail):
    """An ``on_unstaged`` for :func:`use` (dump, trace): each graph built while
    ``activity`` ("dumping") was off is reported once, through ``fail(where, exc)``."""
    seen: set = set()

    def report(name: str, what: str) -> None:
        if what not in seen:
            seen.add(what)
            fail(f"{name} under CUDA graphs", GraphStageError(
                f"{what}: its CUDA graph was built while {activity} was off, so its replays {name} nothing "
                f"(turn {activity} on before the graphs are built: Megatron builds them after the first step, "
                "SGLang at start-up)"))
    return report


def warming_up() -> bool:
    """Whether a graph is being built (Megatron's, SGLang's) and this is one of its eager
    warm-up passes (their inputs are placeholders and their results thrown away: not a
    forward to record)."""
    return getattr(_local, "building", None) is not None and getattr(_local, "stage", None) is None \
        and not capturing()


def building() -> bool:
    """Whether this thread is building a graph: its warm-up passes or its capture."""
    return getattr(_local, "building", None) is not None


def graph_build(runner) -> None:
    """``create_fwd_graph`` entry: a new GraphStage for this runner; warm-up begins."""
    if not _users:
        return
    global _stages
    if _stages is None:
        import weakref

        _stages = weakref.WeakKeyDictionary()
    _stages[runner] = begin_build(_stages.get(runner), describe(runner))


def begin_build(kept: "GraphStage | None", name: str) -> "GraphStage":
    """A graph's build begins (its warm-up passes, then its capture): a new stage named
    ``name``, which this thread's call sites use until :func:`end_build`.  ``kept``: the
    stage the runner got from another spec's copy of the hook; while it is this build's,
    untouched, it is the one returned.  A build that raised earlier leaves nothing behind."""
    building = getattr(_local, "building", None)
    if building is not None and kept is building and not building.entries and not building.feeds \
            and getattr(_local, "stage", None) is None:
        return building
    _set_local(stage=None, building=GraphStage(name, frozenset(_users)))
    return _local.building


def end_build() -> None:
    """The build is over (the graph keeps its stage)."""
    if getattr(_local, "building", None) is not None:
        _set_local(stage=None, building=None)


def describe(runner) -> str:
    """A runner's module and layer (its own __str__ assumes a hidden_states keyword, which
    the MoE router graph's runner does not have)."""
    module = getattr(runner, "base_module", None)
    number = getattr(module, "layer_number", None)
    func = getattr(getattr(runner, "func", None), "__name__", None)
    return f"megatron {type(module).__name__}" + (f" {number}" if number is not None else "") + \
        (f" {func}" if func and func != "__call__" else "")


def graph_capture(runner) -> None:
    """Before ``with torch.cuda.graph(...)`` in ``create_fwd_graph``: call sites stage."""
    stage = getattr(_local, "building", None)
    if stage is not None and getattr(_local, "stage", None) is not stage:
        stage.begin()


def graph_captured(runner) -> None:
    """After the capture block: the build is over."""
    end_build()


def graph_replay(runner) -> None:
    """Before ``runner.fwd_graph.replay()``: refill what the graph reads.  A capability
    registered now but not when the graph was built hears of it (``on_unstaged``)."""
    if _users:
        before_replay(_stages.get(runner) if _stages is not None else None, lambda: describe(runner))


def graph_replayed(runner) -> None:
    """After the replay (its outputs ready on the current stream): drain the staged rows
    into their writers, tagged ``cuda_graph=True`` (Megatron's training graphs have no
    padding rows)."""
    if _users and _stages is not None:
        after_replay(_stages.get(runner))


def before_replay(stage: "GraphStage | None", what) -> None:
    """A replay hook's first half, for any framework's runner (``stage``: its graph's, or
    None when built with no user registered; ``what()``: that graph in words)."""
    if stage is not None and stage.hooked:
        return  # another spec's copy of this hook ran first
    for name, on_unstaged in list(_users.items()):
        if on_unstaged is not None and (stage is None or name not in stage.users):
            on_unstaged(name, what())
    if stage is not None:
        stage.before_replay()
        stage.hooked = True


def after_replay(stage: "GraphStage | None", rows: int | None = None, **tags) -> None:
    """A replay hook's second half: drain the first ``rows`` rows (the rest: padding)."""
    if stage is None or not stage.hooked:
        return  # another spec's copy of this hook drained it already
    stage.hooked = False
    stage.after_replay()
    if stage.undrained:
        stage.drain(rows, **tags)
