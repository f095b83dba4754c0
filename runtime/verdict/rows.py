"""Rows keyed by (request, token position): one side's index, the pairing of two sides'
rows, the layout self-test, and the rows only one side holds.

    index = rows.index(side)            # RowIndex: rows per (name, layer), records of no row map
    pairing = rows.pair(index_a, index_b)
    x = rows.take(index_a.rows[key], rows.locate(index_a.rows[key], pairing.slot_a, pairing.size))

A pass is the records of one (step, micro-batch, rank): its ``row_request`` (with its
``rids`` tag) and ``positions`` map every row to (request id, position); a pass without
them in a micro-batch takes its step's map of no micro-batch, where there is one.  A
record is rows of its pass when it has the row map's shape in front (``[s, b, ...]``),
or its rows flattened (``[s * b, ...]``, as a router sees them); SGLang's logits, one
row per request and pass, are the request's last row of the pass.  Anything else is a
record of no row map, compared tensor against tensor (compare.py).

Rows are held as the dumped tensors viewed ``[n, width]`` with a key id per row (-1:
padding); pairing and gathering are index operations on those, never a Python loop per
row of a tensor (the Python work is per key: the row maps, the shared keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import records
from .records import DumpError, LayoutError
from .sides import MEGATRON


@dataclass
class RowIndex:
    side: object
    keys: dict = field(default_factory=dict)   # (rid, position) -> key id
    rows: dict = field(default_factory=dict)   # (name, layer) -> [(tensor [n, width], key ids [n])]
    loose: dict = field(default_factory=dict)  # (name, layer) -> [Rec] of no row map
    maps: bool = False                         # whether any pass has a row map

    def key_list(self) -> list:
        out = [None] * len(self.keys)
        for key, i in self.keys.items():
            out[i] = key
        return out


@dataclass
class Pairing:
    keys: list                  # the (rid, position) both sides' input_ids hold, sorted
    slot_a: object              # LongTensor: A's key id -> index in keys, or -1
    slot_b: object
    tokens: object = None       # LongTensor: the token id of each key (after the self-test)

    @property
    def size(self) -> int:
        return len(self.keys)


def keys_of(row_map, positions) -> list:
    """(rid, position) of every element of a row map; None for padding (-1).  A row map
    without its ``rids``, empty, not integers, pointing past its rids or of another
    size than its positions is a DumpError (it would pair the wrong rows)."""
    import torch

    rids = row_map.tags.get("rids")
    if not (isinstance(rids, list) and rids and all(isinstance(r, (str, int)) and not isinstance(r, bool)
                                                    for r in rids)):
        raise DumpError(f"{records.where(row_map)}: tag 'rids' is {records.reader.shown(rids)}, "
                        "expected a list of request ids")
    for rec in (row_map, positions):
        if rec.tensor.numel() == 0 or rec.tensor.dtype.is_floating_point or rec.tensor.dtype == torch.bool:
            raise DumpError(f"{records.where(rec)}: expected a non-empty integer tensor, got "
                            f"{list(rec.tensor.shape)} {str(rec.tensor.dtype).removeprefix('torch.')}")
    if positions.tensor.numel() != row_map.tensor.numel():
        raise DumpError(f"{records.where(positions)}: {positions.tensor.numel()} positions for "
                        f"{row_map.tensor.numel()} rows of row_request")
    index = row_map.tensor.reshape(-1).tolist()
    if not -1 <= min(index) <= max(index) < len(rids):
        raise DumpError(f"{records.where(row_map)}: values {min(index)}..{max(index)} outside -1..{len(rids) - 1} "
                        f"(its {len(rids)} rids)")
    rids = [str(r) for r in rids]  # one kind, so keys sort
    return [None if i < 0 else (rids[i], p) for i, p in zip(index, positions.tensor.reshape(-1).tolist())]


def index(side) -> RowIndex:
    """One side's rows and records of no row map, layers as the report numbers them."""
    import torch

    passes: dict = {}
    for r in side.records:
        passes.setdefault((r.tags.get("step"), r.tags.get("microbatch"), r.tags.get("rank")), []).append(r)
    maps = {}
    for key, recs in passes.items():
        named = {r.name: r for r in recs if r.tags.get("layer") is None}
        if "row_request" in named and "positions" in named:
            maps[key] = (named["row_request"], named["positions"])
    out = RowIndex(side, maps=bool(maps))
    for (step, microbatch, rank), recs in passes.items():
        found = maps.get((step, microbatch, rank)) or maps.get((step, None, rank))
        if found is None:
            for r in recs:
                out.loose.setdefault((r.name, side.layer(r.tags.get("layer"))), []).append(r)
            continue
        row_map = found[0].tensor
        keys = keys_of(*found)
        ids = torch.tensor([-1 if k is None else out.keys.setdefault(k, len(out.keys)) for k in keys],
                           dtype=torch.long)
        for r in recs:
            if r.name in ("row_request", "positions") and r.tags.get("layer") is None:
                continue
            where = (r.name, side.layer(r.tags.get("layer")))
            t, n = r.tensor, len(keys)
            if t.dim() > 0 and t.numel() % n == 0 and (t.shape[: row_map.dim()] == row_map.shape or t.shape[0] == n):
                out.rows.setdefault(where, []).append((t.reshape(n, -1), ids))
            elif r.name == "logits" and t.dim() > 0:
                out.rows.setdefault(where, []).append(_last_rows(found[0], keys, ids, t))
            else:
                out.loose.setdefault(where, []).append(r)
    return out


def _last_rows(row_map, keys, ids, logits) -> tuple:
    """SGLang's logits: one row per request of the pass, the request's last row there."""
    import torch

    last: dict = {}
    for i, key in enumerate(keys):
        if key is not None and (key[0] not in last or key[1] > keys[last[key[0]]][1]):
            last[key[0]] = i
    picked = [(i, int(ids[last[rid]])) for i, rid in enumerate(map(str, row_map.tags["rids"]))
              if rid in last and i < logits.shape[0]]
    rows = torch.tensor([i for i, _ in picked], dtype=torch.long)
    return logits.reshape(logits.shape[0], -1).index_select(0, rows), torch.tensor([k for _, k in picked],
                                                                                  dtype=torch.long)


def _present(index_: RowIndex) -> set:
    """The keys a side holds a token id for (its input_ids rows)."""
    import torch

    pieces = index_.rows.get(("input_ids", None), [])
    if not pieces:
        return set()
    ids = torch.unique(torch.cat([p[1] for p in pieces]))
    names = index_.key_list()
    return {names[i] for i in ids.tolist() if i >= 0}


def pair(a: RowIndex, b: RowIndex) -> Pairing:
    """The (request, position) keys both sides' input_ids hold, sorted; empty when none."""
    import torch

    shared = sorted(_present(a) & _present(b))
    slots = []
    for side in (a, b):
        slot = torch.full((len(side.keys),), -1, dtype=torch.long)
        if shared:
            slot[torch.tensor([side.keys[k] for k in shared])] = torch.arange(len(shared))
        slots.append(slot)
    return Pairing(shared, *slots)


def locate(pieces, slot_of, size: int):
    """For each shared key, the index of its row in the pieces (concatenated), -1 where
    none; where a key has several rows (passes that repeat it), the last one."""
    import torch

    ids = torch.cat([p[1] for p in pieces])
    slots = torch.full_like(ids, -1)
    valid = ids >= 0
    slots[valid] = slot_of[ids[valid]]
    keep = slots >= 0
    found = torch.full((size,), -1, dtype=torch.long)
    return found.scatter_reduce_(0, slots[keep], torch.arange(len(ids))[keep], "amax")


def widths(pieces) -> set:
    return {p[0].shape[1] for p in pieces}


def take(pieces, rows, dtype=None):
    """Rows ``rows`` (indices into the pieces concatenated) as one ``[len(rows), width]``
    tensor (``dtype``: converted); a single piece taken in order is not copied."""
    import torch

    width = pieces[0][0].shape[1]
    if len(pieces) == 1:
        t = pieces[0][0]
        if not (len(rows) == t.shape[0] and bool((rows == torch.arange(len(rows))).all())):
            t = t.index_select(0, rows)
        return t if dtype is None else t.to(dtype)
    sizes = torch.tensor([p[0].shape[0] for p in pieces])
    starts = torch.cumsum(sizes, 0) - sizes
    ordered, order = torch.sort(rows)
    bounds = torch.searchsorted(ordered, torch.cat([starts, sizes.sum().reshape(1)])).tolist()
    out = torch.empty((len(rows), width), dtype=dtype or pieces[0][0].dtype)
    for j, (t, _) in enumerate(pieces):  # a loop per piece (pass), each an index operation
        lo, hi = bounds[j], bounds[j + 1]
        if lo < hi:
            out[order[lo:hi]] = t.index_select(0, ordered[lo:hi] - starts[j]).to(out.dtype)
    return out


def self_test(a: RowIndex, b: RowIndex, pairing: Pairing) -> None:
    """Every paired (request, position) holds the same token id on both sides, else
    LayoutError naming the first that does not (sets ``pairing.tokens``)."""
    tokens = []
    for side, slot in ((a, pairing.slot_a), (b, pairing.slot_b)):
        pieces = side.rows[("input_ids", None)]
        for t, ids in pieces:
            if t.shape[1] != 1:
                rid, position = side.key_list()[int(ids[ids >= 0][0])]
                raise DumpError(f"input_ids of request {rid!r} position {position} in {side.side}: {t.shape[1]} "
                                "values, expected one token id per row")
        tokens.append(take(pieces, locate(pieces, slot, pairing.size)).reshape(-1))
    differ = (tokens[0] != tokens[1]).nonzero()
    if len(differ):
        i = int(differ[0])
        rid, position = pairing.keys[i]
        raise LayoutError(f"layout self-test: request {rid!r} position {position}: token {int(tokens[0][i])} "
                          f"in {a.side}, {int(tokens[1][i])} in {b.side}")
    pairing.tokens = tokens[0]


def not_compared(a: RowIndex, b: RowIndex, pairing: Pairing) -> tuple:
    """(rows taken from a prefix cache, lines): the rows one side holds and the other
    does not.  Of a request both hold, the positions before the other side's first row
    are the ones an engine took from its prefix cache (radix cache on: only computed
    rows are dumped), said as such unless that side is Megatron; the rest are rows
    only one side holds (the last token a training side was fed, a request only one
    side served)."""
    shared = set(pairing.keys)
    cached, lines = 0, []
    for side, other in ((a, b), (b, a)):
        first: dict = {}
        for rid, position in _present(side):
            first[rid] = min(position, first.get(rid, position))
        before = after = 0
        for rid, position in _present(other) - shared:
            if rid in first and position < first[rid]:
                before += 1
            else:
                after += 1
        if before and side.side.kind != MEGATRON:
            cached += before
            lines.append(f"{before} rows the engine took from its prefix cache: not compared "
                         f"({side.side} has no rows for them, {other.side.label} has)")
        else:
            after += before
        if after:
            lines.append(f"{after} rows only in {other.side}: not compared")
    return cached, lines
