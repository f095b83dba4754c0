"""Which request and position each row of a training micro-batch is: ``source_patch.batch``.

An RL framework calls :func:`batch` once per micro-batch with what it has at hand (the
request ids, prompt and response lengths, the layout).  The result, a :class:`Rows`,
is kept here, ambient like core/tags.py's tags, and the capabilities pull it when they
need it, so import order does not matter and neither capability imports the other:

* the dump runtime (dump/api.py) writes the row map (``row_request`` with its ``rids``
  tag, ``positions``, ``input_ids`` when given) at the first dump call of a micro-batch
  whose row map it has not written yet; disabled, nothing runs;
* routing replay in Megatron (routing/megatron/control.py), where request records are
  given, aligns them to this layout at the first router call of the micro-batch.

Which micro-batch a :class:`Rows` is for: ``microbatch=`` when given; else inside a
schedule's forward step the ambient ``microbatch`` tag (the dump spec's); else a
counter from 0 that a schedule's start (either spec's) and an optimizer step reset, so
that calling :func:`batch` once per micro-batch *before* the schedule runs (handing it
the data iterator) and calling it *inside* ``forward_step_func`` give the same keys.
A capability asks :func:`current` with its own position: ``(phase, microbatch)`` in a
schedule, ``microbatch=None`` outside one (the latest :class:`Rows` then).

The sequence split (CP zigzag, SP contiguous parts) is core/slicing.py's; packed (THD)
batches are split per sequence, as Transformer Engine's ``thd_get_partitioned_indices``
does for Megatron's ``get_thd_batch_on_this_cp_rank``.

torch is imported inside the functions (core imports nothing heavy at module level).
"""

from __future__ import annotations

from . import ranks

LAYOUTS = ("padded", "packed")

# Read by the capabilities on their hot path: 0 until batch() is first called, then the
# version of the latest Rows (an int compare tells them nothing changed).
version = 0

_table: dict = {}        # (phase or None, microbatch) -> Rows
_latest = None           # the Rows of the latest batch() call
_next = 0                # the next counted microbatch
_PHASE_OF = {True: "fwd_only", False: "fwd_bwd"}  # a schedule's forward_only -> its phase tag


class Rows:
    """The row map of one micro-batch on this rank.

    ``row_request`` (int32 ``[s, b]`` in Megatron's layout, ``s`` this rank's part of the
    sequence: -1 for padding, else an index into ``request_ids``), ``positions`` (int32
    ``[s, b]``: the token's position in its own sequence, -1 for padding), ``input_ids``
    (``[s, b]`` or None), ``request(t)`` / ``rows()`` for the ``(request id, position)`` of
    each token; ``segments`` the whole micro-batch's layout (``(row, start, length,
    sample)``), ``local_index`` this rank's tokens as rows of the whole ``[s, b]``
    flattened seq-major (what the router sees, in its order)."""

    def __init__(self, *, request_ids, segments, batch, seq_len, layout, microbatch, phase, cp_size, cp_rank,
                 tp_size, tp_rank, sequence_parallel, cp_positions, input_ids, version):
        self.request_ids, self.segments, self.batch, self.seq_len = request_ids, segments, batch, seq_len
        self.layout, self.microbatch, self.phase, self.version = layout, microbatch, phase, version
        self.cp_size, self.cp_rank, self.tp_size, self.tp_rank = cp_size, cp_rank, tp_size, tp_rank
        self.sequence_parallel = sequence_parallel  # None: not said; the dump and the router infer it
        self._cp_positions = cp_positions           # positions along a row this CP rank holds, its order
        self._input_ids = input_ids                 # [S, b] whole, or [s_cp, b] / [s, b] already local
        self._views: dict = {}

    # ---------------------------------------------------------- this rank's part

    def _full_maps(self):
        import torch

        rows = torch.full((self.seq_len, self.batch), -1, dtype=torch.int32)
        positions = torch.full((self.seq_len, self.batch), -1, dtype=torch.int32)
        for b, start, length, i in self.segments:
            rows[start:start + length, b] = i
            positions[start:start + length, b] = torch.arange(length, dtype=torch.int32)
        return rows, positions

    def view(self, sequence_parallel: bool | None = None) -> dict:
        """``{"row_request", "positions", "input_ids", "local_index", "seq_positions"}`` for this
        rank, split for sequence parallelism or not (default: as given to :func:`batch`, else
        not); cached."""
        sp = bool(self.sequence_parallel if sequence_parallel is None else sequence_parallel) and self.tp_size > 1
        got = self._views.get(sp)
        if got is not None:
            return got
        import torch

        from .slicing import sp_split

        seq = self._cp_positions
        if sp:
            if seq.numel() % self.tp_size:
                raise ValueError(f"CP-local sequence length {seq.numel()} is not divisible by tp_size = "
                                 f"{self.tp_size} (sequence parallel)")
            seq = sp_split(seq, self.tp_size, self.tp_rank)
        rows, positions = self._full_maps()
        ids = self._input_ids
        if ids is not None:
            if ids.shape[0] == self.seq_len:
                ids = ids[seq]
            elif ids.shape[0] == self._cp_positions.numel() and sp:
                ids = sp_split(ids, self.tp_size, self.tp_rank)
            elif ids.shape[0] != seq.numel():
                raise ValueError(f"input_ids hold {ids.shape[0]} positions per row: neither the whole "
                                 f"micro-batch's {self.seq_len} nor this rank's {seq.numel()}")
            ids = ids.contiguous()
        local_index = (seq[:, None] * self.batch + torch.arange(self.batch)[None, :]).reshape(-1)
        got = {"row_request": rows[seq].contiguous(), "positions": positions[seq].contiguous(),
               "input_ids": ids, "local_index": local_index, "seq_positions": seq}
        self._views[sp] = got
        return got

    @property
    def row_request(self):
        return self.view()["row_request"]

    @property
    def positions(self):
        return self.view()["positions"]

    @property
    def input_ids(self):
        return self.view()["input_ids"]

    @property
    def local_index(self):
        return self.view()["local_index"]

    def rows(self, sequence_parallel: bool | None = None) -> list:
        """``(request id, position)`` of every token of this rank's part, seq-major as the
        router sees it (``[s, b]`` flattened); None for padding."""
        view = self.view(sequence_parallel)
        out = []
        for i, p in zip(view["row_request"].reshape(-1).tolist(), view["positions"].reshape(-1).tolist()):
            out.append(None if i < 0 else (self.request_ids[i], p))
        return out

    def local_seq_len(self, sequence_parallel: bool | None = None) -> int:
        return int(self.view(sequence_parallel)["seq_positions"].numel())

    def infer_sequence_parallel(self, local_len: int) -> bool:
        """Whether a live tensor of ``local_len`` positions on this rank is split for
        sequence parallelism (the given flag wins)."""
        if self.sequence_parallel is not None or self.tp_size == 1:
            return bool(self.sequence_parallel)
        cp_len = int(self._cp_positions.numel())
        return local_len != cp_len and local_len * self.tp_size == cp_len

    def by_row(self) -> list:
        """``rows[b] = [(request id, start, length), ...]`` of the whole micro-batch (for
        routing's alignment: a BatchLayout's rows)."""
        out = [[] for _ in range(self.batch)]
        for b, start, length, i in self.segments:
            out[b].append((self.request_ids[i], start, length))
        return out

    def __repr__(self) -> str:
        return (f"Rows({self.layout}, {len(self.request_ids)} requests, [s={self.seq_len}, b={self.batch}], "
                f"microbatch {self.microbatch}, phase {self.phase}, cp {self.cp_rank}/{self.cp_size}, "
                f"tp {self.tp_rank}/{self.tp_size}, sp {self.sequence_parallel})")


# ---------------------------------------------------------------- the public call


def _ints(name, values, n=None) -> list:
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = list(values)
    if n is not None and len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} requests")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: {v!r} is not a non-negative int")
    return values


def _cp_positions(layout, seq_len, starts, cp_size, cp_rank):
    """Positions along a row that CP rank ``cp_rank`` holds, in its order: the whole row
    zigzagged (padded), or each packed sequence zigzagged on its own (THD)."""
    import torch

    from .slicing import cp_split, local_seq_positions

    if layout == "padded" or cp_size == 1:
        return local_seq_positions(seq_len, cp_size=cp_size, cp_rank=cp_rank)
    bounds = list(starts) + [seq_len]
    parts = []
    for first, end in zip(bounds, bounds[1:]):
        if end == first:
            continue
        if (end - first) % (2 * cp_size):
            raise ValueError(f"packed sequence at {first}..{end - 1}: {end - first} tokens are not divisible by "
                             f"2 * cp_size = {2 * cp_size} (pass cu_seqlens padded as Megatron's THD batches are)")
        parts.append(cp_split(torch.arange(first, end), cp_size, cp_rank))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def batch(request_ids, prompt_lengths, response_lengths, *, layout: str = "padded", seq_len: int | None = None,
          cu_seqlens=None, padding_side: str = "right", input_ids=None, microbatch: int | None = None,
          phase: str | None = None, cp_size: int | None = None, cp_rank: int | None = None,
          sequence_parallel: bool | None = None, tp_size: int | None = None, tp_rank: int | None = None) -> Rows:
    """Name the rows of one micro-batch; returns its :class:`Rows` and keeps it ambient.

    ``request_ids[i]`` (str or int) has ``prompt_lengths[i] + response_lengths[i]``
    tokens.  ``layout="padded"``: sample i is row i of ``[b, seq_len]`` (``seq_len``
    default: the longest), right or left padded (``padding_side``); ``"packed"`` (THD):
    the samples back to back in one row of ``seq_len`` tokens (default: ``cu_seqlens[-1]``,
    else the sum), sample i from ``cu_seqlens[i]`` (Megatron's ``PackedSeqParams.cu_seqlens_q``,
    possibly padded; default: the lengths' running sum).  ``input_ids``: the micro-batch's
    token ids as laid out (``[b, s]``; ``[t]`` or ``[1, t]`` packed), whole or already
    this rank's part.  ``microbatch``, ``phase``: which micro-batch of which pass
    (default: module doc).  ``cp_size`` / ``cp_rank`` / ``tp_size`` / ``tp_rank``: default
    Megatron's parallel state; ``sequence_parallel``: default inferred from the live
    tensors (the dump's first tensor of the micro-batch, the router's config)."""
    global version, _latest, _next
    import torch

    from . import tags as ambient  # here: a module that imports rows pays for nothing else

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    rids = list(request_ids.tolist() if hasattr(request_ids, "tolist") else request_ids)
    if not rids:
        raise ValueError("a micro-batch needs at least one request")
    for rid in rids:
        if not (isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool))):
            raise ValueError(f"request id {rid!r}: expected a str or an int")
    if len(set(rids)) != len(rids):
        raise ValueError(f"request ids repeat: {rids}")
    lengths = [p + r for p, r in zip(_ints("prompt_lengths", prompt_lengths, len(rids)),
                                     _ints("response_lengths", response_lengths, len(rids)))]
    size, rank, tp, tp_r = ranks.cp_tp()
    cp_size = size if cp_size is None else cp_size
    cp_rank = rank if cp_rank is None else cp_rank
    tp_size = tp if tp_size is None else tp_size
    tp_rank = tp_r if tp_rank is None else tp_rank
    ids = None if input_ids is None else torch.as_tensor(input_ids)

    if layout == "padded":
        longest = max(lengths)
        seq_len = longest if seq_len is None else int(seq_len)
        if seq_len < longest:
            raise ValueError(f"seq_len {seq_len} is shorter than the longest sample ({longest} tokens)")
        starts = [0 if padding_side == "right" else seq_len - n for n in lengths]
        segments = tuple((i, starts[i], n, i) for i, n in enumerate(lengths))
        rows_b = len(rids)
        if ids is not None:
            if ids.dim() != 2 or ids.shape[0] != rows_b:
                raise ValueError(f"input_ids: expected [b={rows_b}, s], got {list(ids.shape)}")
            ids = ids.t()
    else:
        if cu_seqlens is not None:
            cu = _ints("cu_seqlens", cu_seqlens)
            if len(cu) != len(rids) + 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens {cu}: expected {len(rids) + 1} non-decreasing offsets from 0")
            for i, n in enumerate(lengths):
                if n > cu[i + 1] - cu[i]:
                    raise ValueError(f"request {rids[i]!r}: {n} tokens in a slot of {cu[i + 1] - cu[i]} "
                                     f"(cu_seqlens {cu[i]}..{cu[i + 1]})")
            starts, total = cu[:-1], cu[-1]
        else:
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            total = sum(lengths)
        seq_len = total if seq_len is None else int(seq_len)
        if seq_len < total:
            raise ValueError(f"seq_len {seq_len} is shorter than the packed samples ({total} tokens)")
        segments = tuple((0, s, n, i) for i, (s, n) in enumerate(zip(starts, lengths)))
        rows_b = 1
        if ids is not None:
            ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
            if ids.dim() != 2 or ids.shape[0] != 1:
                raise ValueError(f"input_ids: expected [t] or [1, t] for a packed batch, got {list(ids.shape)}")
            ids = ids.t()
    if layout == "packed":  # each sequence (and a padding tail) is split on its own
        cp_positions = _cp_positions(layout, seq_len, list(starts) + ([total] if seq_len > total else []),
                                     cp_size, cp_rank)
    else:
        cp_positions = _cp_positions(layout, seq_len, (), cp_size, cp_rank)
    if ids is not None and ids.shape[0] not in (seq_len, cp_positions.numel()) and not (
            sequence_parallel is not False and tp_size > 1 and ids.shape[0] * tp_size == cp_positions.numel()):
        raise ValueError(f"input_ids hold {ids.shape[0]} positions per row: neither the micro-batch's {seq_len} "
                         f"nor this rank's {cp_positions.numel()}")

    context = ambient.context()
    if phase is None:
        phase = context.get("phase")
    if microbatch is None:
        current = context.get("microbatch")
        if isinstance(current, int) and not isinstance(current, bool):
            microbatch = current  # inside a schedule's forward step (the dump spec counts them)
        else:
            microbatch = _next
    microbatch = int(microbatch)
    _next = microbatch + 1
    version += 1
    rows = Rows(request_ids=tuple(rids), segments=segments, batch=rows_b, seq_len=seq_len, layout=layout,
                microbatch=microbatch, phase=phase, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size,
                tp_rank=tp_rank, sequence_parallel=sequence_parallel, cp_positions=cp_positions,
                input_ids=ids, version=version)
    rows.view()  # errors (lengths that do not split) here, at the call, not at the first dump
    _table[(phase, microbatch)] = rows
    _latest = rows
    return rows


# ---------------------------------------------------------------- for the capabilities


def current(phase=None, microbatch: int | None = None) -> Rows | None:
    """The Rows of ``microbatch`` of the pass ``phase`` (a Rows named without a phase
    serves every pass); outside a schedule (``microbatch`` None) the latest one."""
    if microbatch is None:
        return _latest
    if phase is not None:
        found = _table.get((phase, microbatch))
        if found is not None:
            return found
    return _table.get((None, microbatch))


def phase_of(forward_only) -> str:
    """A schedule's phase tag (as the dump spec sets it) from its ``forward_only``."""
    return _PHASE_OF[bool(forward_only)]


def schedule_begin() -> None:
    """A schedule starts (either spec's call site; calling it twice is the same): the
    counted microbatches start from 0 again; Rows already named stay."""
    global _next
    _next = 0


def step_end() -> None:
    """An optimizer step ended: the micro-batches of the step are done."""
    global _next, _latest, version
    _next = 0
    if _table or _latest is not None:
        _table.clear()
        _latest = None
        version += 1


def clear() -> None:
    """Forget every Rows (tests)."""
    step_end()
