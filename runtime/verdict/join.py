"""Shards that parallel ranks dumped, joined into the tensors the other side holds whole,
before anything is paired.

    notes = join.join(side_a, side_b)   # each side's records replaced by the joined ones

**Tensor parallelism.**  Records of one step that differ only in their ``tp`` and
``rank`` tags are the TP ranks' copies of one tensor (a group).  A group is joined
only where its ranks hold the same rows: each rank's row map (``row_request``,
``positions`` of its step, micro-batch and rank) equal, or none; ranks that hold
different rows are sequence-parallel slices, which pair by (request, position) as
they are.  How a group is joined, the first rule that applies:

1. a ``tp_mode`` tag on the records: ``"replicated"`` (one kept), ``"concat"``
   (column-parallel outputs: the last dimension split, concatenated in TP order) or
   ``"sum"`` (row-parallel partial sums, added in float32);
2. every rank holds the same tensor: replicated, the lowest TP rank's kept;
3. ``logits``: Megatron's vocab-parallel output layer, TP rank k holding the k-th
   slice of the vocabulary: concatenated;
4. by the other side's tensor of the same name and layer (after its own rules 1-3):
   a last dimension ``tp`` times this shard's: concatenated; the same TP layout there
   (as many shards of this width, not replicated): concatenated on both sides, a
   comparison shard against shard whichever the mode; the same last dimension as a
   shard: partial sums, added;
5. else concatenated (a width that then matches nothing is reported, not guessed at).

**Expert parallelism.**  Records of one expert each (an ``expert`` tag) are stacked
into one ``[experts, ...]`` tensor in global expert order: with several ``ep`` ranks
that all number their experts ``0 .. local - 1``, expert i of EP rank r is ``r * local
+ i``; ranks whose numbers are disjoint already number them globally.  Tensors of an
EP rank's local experts (``[local_experts, ...]``: a ``local_experts`` tag, or a name
starting with ``expert``) from several ``ep`` ranks are concatenated along the first
dimension in EP order.  The ``dp`` tag is not part of an EP group (Megatron's
expert-parallel ranks are carved out of its data-parallel ones).  A group with an EP
rank or an expert twice, or of different shapes, is left as it is.

The joined record keeps the tags of its lowest rank.
"""

from __future__ import annotations

from collections import Counter

from . import records
from .records import DumpError, Rec

TP_MODES = ("replicated", "concat", "sum")


def join(a, b) -> list:
    """Join both sides' shards (records replaced in place); one note per side that
    joined anything, for the report."""
    first = {side.label: _tp_first(side) for side in (a, b)}
    shapes = {side.label: _shapes(side, *first[side.label][:2]) for side in (a, b)}  # before either side's rule 4
    notes = []
    for side, other in ((a, b), (b, a)):
        resolved, undecided, counts = first[side.label]
        widths, layouts = shapes[other.label]
        for shards in undecided:
            mode = _by_other(side, shards, widths, layouts)
            joined = _apply(shards, mode)
            resolved.extend([joined] if joined is not None else shards)
            counts[mode if joined is not None else "left"] += 1
        side.records, experts = _experts(resolved)
        said = [f"{counts[m]} {w}" for m, w in (("replicated", "replicated (one kept)"), ("concat", "concatenated"),
                                                 ("sum", "summed")) if counts[m]]
        if said or experts:
            notes.append(f"{side}: joined " + "; ".join(
                ([f"tensor-parallel shards of {', '.join(said)} tensors"] if said else [])
                + ([f"expert-parallel pieces of {experts} tensors in global expert order"] if experts else [])))
    return notes


def _key(tags: dict, leave_out) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in tags.items() if k not in leave_out))


def _row_maps(recs) -> dict:
    """{(step, microbatch, rank): {name: tensor}} of the row maps."""
    maps: dict = {}
    for r in recs:
        if r.name in ("row_request", "positions"):
            maps.setdefault((r.tags.get("step"), r.tags.get("microbatch"), r.tags.get("rank")), {})[r.name] = r.tensor
    return maps


def _same_rows(shards, maps) -> bool:
    """Whether the shards' ranks hold the same rows (equal row maps, or none at all)."""
    import torch

    found = [maps.get((s.tags.get("step"), s.tags.get("microbatch"), s.tags.get("rank"))) for s in shards]
    if all(m is None for m in found):
        return True
    if any(m is None or m.keys() != found[0].keys() for m in found):
        return False
    return all(m[k].shape == found[0][k].shape and torch.equal(m[k], found[0][k]) for m in found[1:] for k in m)


def _tp_first(side):
    """Rules 1-3 on one side: (records resolved, groups left to rule 4, counts)."""
    import torch

    groups: dict = {}
    resolved, undecided, counts = [], [], Counter()
    for r in side.records:
        if records.tag(r, "tp") is None or r.tensor.dim() == 0:
            resolved.append(r)
        else:
            groups.setdefault((r.name, _key(r.tags, ("tp", "rank"))), []).append(r)
    maps = _row_maps(side.records)
    for shards in groups.values():
        tps = [s.tags["tp"] for s in shards]
        if len(set(tps)) < 2 or len(set(tps)) != len(tps) or not _same_rows(shards, maps):
            resolved.extend(shards)  # one TP rank, a rank twice, or sequence-parallel slices
            continue
        shards.sort(key=lambda s: s.tags["tp"])
        mode = shards[0].tags.get("tp_mode")
        if mode is not None and mode not in TP_MODES:
            raise DumpError(f"{records.where(shards[0])}: tag 'tp_mode' is {mode!r}, expected one of "
                            f"{', '.join(TP_MODES)}")
        if mode is None:
            t0 = shards[0].tensor
            if all(s.tensor.shape == t0.shape and torch.equal(s.tensor, t0) for s in shards[1:]):
                mode = "replicated"
            elif shards[0].name == "logits":
                mode = "concat"
            else:
                undecided.append(shards)
                continue
        joined = _apply(shards, mode)
        resolved.extend([joined] if joined is not None else shards)
        counts[mode if joined is not None else "left"] += 1
    return resolved, undecided, counts


def _shapes(side, resolved, undecided) -> tuple:
    """{(name, layer): last dimensions} of a side's resolved records, and
    {(name, layer): {(ranks, shard width)}} of its groups left to rule 4."""
    widths: dict = {}
    layouts: dict = {}
    for r in resolved:
        if r.tensor.dim() > 0:
            widths.setdefault((r.name, side.layer(r.tags.get("layer"))), set()).add(r.tensor.shape[-1])
    for shards in undecided:
        key = (shards[0].name, side.layer(shards[0].tags.get("layer")))
        layouts.setdefault(key, set()).add((len(shards), shards[0].tensor.shape[-1]))
    return widths, layouts


def _by_other(side, shards, widths, layouts) -> str:
    """Rules 4 and 5: the mode the other side's tensor of this name and layer implies."""
    key = (shards[0].name, side.layer(shards[0].tags.get("layer")))
    n, width = len(shards), shards[0].tensor.shape[-1]
    if n * width in widths.get(key, ()) or (n, width) in layouts.get(key, ()):
        return "concat"
    if width in widths.get(key, ()):
        return "sum"
    return "concat"


def _apply(shards, mode):
    """The joined record, or None where the shards' shapes do not allow the mode."""
    import torch

    first = shards[0]
    if mode == "replicated":
        return first
    if mode == "concat":
        if len({s.tensor.shape[:-1] for s in shards}) != 1:
            return None
        return Rec(first.name, first.tags, torch.cat([s.tensor for s in shards], dim=-1), first.where)
    if len({s.tensor.shape for s in shards}) != 1:
        return None
    total = first.tensor.float().clone() if first.tensor.is_floating_point() else first.tensor.clone()
    for s in shards[1:]:
        total += s.tensor
    return Rec(first.name, first.tags, total, first.where)


def _experts(recs) -> tuple:
    """Expert-parallel pieces joined (module docstring): (records, tensors joined)."""
    import torch

    per_expert: dict = {}
    local: dict = {}
    out = []
    for r in recs:
        if records.tag(r, "expert") is not None:
            per_expert.setdefault((r.name, _key(r.tags, ("expert", "ep", "rank", "dp"))), []).append(r)
        elif records.tag(r, "ep") is not None and r.tensor.dim() > 0 and (
                "local_experts" in r.tags or r.name.startswith("expert")):
            local.setdefault((r.name, _key(r.tags, ("ep", "rank", "dp"))), []).append(r)
        else:
            out.append(r)
    joined = 0
    for group in per_expert.values():
        order = _global_experts(group)
        if order is None or len({r.tensor.shape for r in group}) != 1:
            out.extend(group)
            continue
        stacked = torch.stack([r.tensor for _, r in sorted(zip(order, group), key=lambda p: p[0])])
        first = min(group, key=lambda r: (r.tags.get("ep") or 0, r.tags["expert"]))
        out.append(Rec(first.name, {k: v for k, v in first.tags.items() if k != "expert"}, stacked, first.where))
        joined += 1
    for group in local.values():
        eps = [r.tags["ep"] for r in group]
        counts = [records.tag(r, "local_experts") for r in group]
        if (len(set(eps)) < 2 or len(set(eps)) != len(eps) or len({r.tensor.shape[1:] for r in group}) != 1
                or any(c is not None and c != r.tensor.shape[0] for c, r in zip(counts, group))):
            out.extend(group)
            continue
        group.sort(key=lambda r: r.tags["ep"])
        out.append(Rec(group[0].name, group[0].tags, torch.cat([r.tensor for r in group]), group[0].where))
        joined += 1
    return out, joined


def _global_experts(group):
    """Each record's global expert id, or None where the numbering is ambiguous."""
    by_rank: dict = {}
    for r in group:
        experts = by_rank.setdefault(records.tag(r, "ep"), set())
        if r.tags["expert"] in experts:
            return None  # an expert twice on one EP rank (data-parallel copies?)
        experts.add(r.tags["expert"])
    sets = list(by_rank.values())
    if len(sets) == 1 or all(not (s & t) for i, s in enumerate(sets) for t in sets[i + 1:]):
        return [r.tags["expert"] for r in group]  # one rank, or global ids already
    local = len(sets[0])
    if all(s == set(range(local)) for s in sets):
        return [(r.tags.get("ep") or 0) * local + r.tags["expert"] for r in group]
    return None
