"""How a training batch's sequence is split across ranks, so dumps of split batches can
be laid side by side with the rollout's (runtime/dump/compare.py).

Context parallelism (Megatron's ``get_batch_on_this_cp_rank``): the sequence is cut
into ``2 * cp`` equal chunks and CP rank r holds chunks r and ``2 * cp - 1 - r``
("zigzag": every rank gets an early and a late chunk, balancing causal attention).
Sequence parallelism: inside a tensor-parallel group, activations outside the
tensor-parallel regions hold a contiguous ``1 / tp`` of the sequence per rank.

A rank that dumps its own ``row_request`` and ``positions`` (split the same way as its
activations) needs nothing else: the comparator keys every row by (request, position),
so the pieces of all ranks reassemble by themselves.
"""

from __future__ import annotations

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
