"""How Megatron splits a training batch's sequence across ranks: the one statement of
it, for the dump (split batches laid beside the rollout's, runtime/dump/compare.py) and
routing (a record sliced for the rank that replays it, runtime/routing/records/slicing.py).

Context parallelism (Megatron's ``get_batch_on_this_cp_rank``): the sequence is cut
into ``2 * cp`` equal chunks and CP rank r holds chunks r and ``2 * cp - 1 - r``, in
that order ("zigzag": every rank gets an early and a late chunk, balancing causal
attention).  Sequence parallelism (``scatter_to_sequence_parallel_region``): inside a
tensor-parallel group, activations outside the tensor-parallel regions hold a
contiguous ``1 / tp`` of the (CP-local) sequence per rank; without it every TP rank
sees the whole CP-local sequence.

A rank that dumps its own ``row_request`` and ``positions`` (split the same way as its
activations) needs nothing else: the comparator keys every row by (request, position),
so the pieces of all ranks reassemble by themselves.

torch is imported inside the functions (core imports nothing heavy); they take tensors,
so torch is already loaded when they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) that context-parallel ``rank`` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def cp_split(x: torch.Tensor, cp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """This CP rank's part of ``x`` along the sequence dimension ``dim`` (zigzag)."""
    if cp == 1:
        return x
    import torch

    chunks = x.chunk(2 * cp, dim=dim)
    if len(chunks) != 2 * cp or x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2 * cp = {2 * cp}")
    first, second = zigzag_chunks(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def sp_split(x: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's contiguous ``1 / tp`` of the sequence (sequence parallelism)."""
    if x.shape[dim] % tp:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by tp = {tp}")
    return x.chunk(tp, dim=dim)[rank]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def local_seq_positions(seq_len: int, *, cp_size: int, cp_rank: int, tp_size: int = 1,
                        tp_rank: int = 0, sequence_parallel: bool = False) -> torch.Tensor:
    """Positions along a ``seq_len`` sequence that one rank sees, in its local order:
    ``torch.arange(seq_len)`` cut by :func:`cp_split`, then with ``sequence_parallel``
    by :func:`sp_split`.  Sizes and ranks are checked first (ints, rank in range,
    lengths divisible); a ``ValueError`` names the one that is not."""
    for name, size, rank in (("cp", cp_size, cp_rank), ("tp", tp_size, tp_rank)):
        if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
            raise ValueError(f"{name}_rank {rank!r} not in [0, {name}_size = {size!r})")
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp_size = {2 * cp_size}")
    import torch

    positions = cp_split(torch.arange(seq_len), cp_size, cp_rank)
    if sequence_parallel and tp_size > 1:
        if positions.numel() % tp_size:
            raise ValueError(f"CP-local sequence length {positions.numel()} is not divisible by "
                             f"tp_size = {tp_size} (sequence parallel)")
        positions = sp_split(positions, tp_size, tp_rank)
    return positions
