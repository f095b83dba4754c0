"""Align SGLang routing (per request) to Megatron's training batch, and diff routings.

Rollout routing replay captures, in SGLang, one :class:`RoutingRecord` per request
(``token_order="requests"``, ``sample_ids=[request id]``, tokens = prompt tokens
then generated tokens in generation order).  Megatron trains on a micro-batch
``[seq, batch]`` whose rows hold those samples right-padded, left-padded or packed
several to a row.  This module turns the former into the latter::

    import source_patch.runtime.routing.align as align   # BatchLayout, align_to_megatron, routing_diff

    layout = BatchLayout.padded([("req-7", 5), ("req-9", 3)], seq_len=8)     # one sample a row
    layout = BatchLayout.pack_greedy([("a", 5), ("b", 3), ("c", 6)], seq_len=8)  # packed rows
    full = align_to_megatron(sglang_records, layout)     # token_order "megatron-sbh"
    mine = slice_for_rank(full, batch=layout.batch, cp_size=2, cp_rank=0)   # then per rank
    print(routing_diff(full, recorded_by_megatron))      # what replay changed

Token order of the result: token ``t = s * batch + b`` is position ``s`` of batch
row ``b`` (Megatron's ``[seq, batch]`` flattened seq-major, as in the router's
``logits.view(-1, E)``).  A position inside a segment ``(sample, start, length)``
of row ``b`` holds token ``s - start`` of that sample (its routing is copied from
the request record); every other position is padding.

Padding filler: Megatron routes padding tokens too, so replay needs some valid,
distinct expert ids for them.  ``filler="spread"`` (default) gives output token
``t`` the experts ``(t * topk + j) % num_experts`` for ``j < topk`` -- distinct in
a row, and spread evenly over the experts so padding does not pile onto a few
experts (expert-parallel load); ``filler="lowest"`` gives ``0 .. topk-1``.  Filler
probabilities (when the records have probs) are ``0``.  Which tokens are real is
recorded: ``extra["aligned"]`` holds the layout (``seq_len``, rows of
``[sample_id, start, length, routed]``, ``filler``), :func:`valid_mask` rebuilds the
``[seq * batch]`` bool mask from it, and ``padding`` holds each row's trailing
right padding (left padding and gaps between packed samples are only in the mask).

``routed``: SGLang never forwards the last sampled token, so a request record may
be up to ``missing_tail`` tokens shorter than the sample's length in the layout;
those tail positions get the filler and count as not valid.

The batch layout, the alignment that uses it and the diff report over its result
are one algorithm, kept in one module so its invariants stay in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from .records.file import RoutingRecordError, is_int
from .records.record import RoutingRecord

FILLERS = ("spread", "lowest")
ALIGN_KEY = "aligned"


class RoutingAlignError(RoutingRecordError):
    """Request records and a batch layout do not fit together."""


def _check_sid(sid, where: str):
    if not (isinstance(sid, str) or is_int(sid)):
        raise RoutingAlignError(f"{where}: sample id must be a str or int, got {sid!r}")


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class BatchLayout:
    """A Megatron training micro-batch: ``batch`` rows of ``seq_len`` positions.

    ``rows[b]`` lists the samples in row ``b`` as ``(sample_id, start, length)``:
    the sample's tokens ``0 .. length-1`` sit at positions ``start .. start+length-1``
    (``length`` is the unpadded sample length).  Positions no segment covers are
    padding.  Segments of a row must not overlap; a sample appears once.  The
    constructors cover the common cases: :meth:`padded` (one sample a row, right or
    left padded) and :meth:`packed` / :meth:`pack_greedy` (several samples back to
    back in a row)."""

    seq_len: int
    rows: tuple = ()

    def __post_init__(self):
        err = RoutingAlignError
        if not is_int(self.seq_len) or self.seq_len < 1:
            raise err(f"seq_len must be a positive int, got {self.seq_len!r}")
        rows = []
        seen: dict = {}
        for b, row in enumerate(self.rows):
            segs = []
            for seg in row:
                if len(seg) != 3:
                    raise err(f"row {b}: a segment is (sample_id, start, length), got {seg!r}")
                sid, start, length = seg
                _check_sid(sid, f"row {b}")
                if not is_int(start) or not is_int(length) or start < 0 or length < 0:
                    raise err(f"row {b}, sample {sid!r}: start {start!r} and length {length!r} must be "
                              "non-negative ints")
                if start + length > self.seq_len:
                    raise err(f"sample {sid!r} is longer than its slot: {length} tokens from position "
                              f"{start} in row {b} of seq_len {self.seq_len}")
                if sid in seen:
                    raise err(f"sample {sid!r} appears twice (rows {seen[sid]} and {b})")
                seen[sid] = b
                segs.append((sid, start, length))
            ordered = sorted(segs, key=lambda s: s[1])
            for (a, sa, la), (c, sc, _) in zip(ordered, ordered[1:]):
                if sa + la > sc:
                    raise err(f"row {b}: samples {a!r} ({sa}..{sa + la - 1}) and {c!r} (from {sc}) overlap")
            rows.append(tuple(segs))
        if not rows:
            raise err("a batch layout needs at least one row")
        object.__setattr__(self, "rows", tuple(rows))

    # ---------------------------------------------------------- constructors

    @classmethod
    def padded(cls, samples: Sequence, seq_len: int | None = None, *, side: str = "right",
               pad_to_multiple_of: int = 1) -> "BatchLayout":
        """One sample per row, in the given order: ``samples`` = ``[(sample_id, length), ...]``.

        ``seq_len`` defaults to the longest length rounded up to
        ``pad_to_multiple_of`` (e.g. ``2 * cp_size``).  ``side``: "right" puts each
        sample at position 0, "left" ends it at ``seq_len``."""
        samples = [tuple(s) for s in samples]
        if side not in ("right", "left"):
            raise RoutingAlignError(f"side must be 'right' or 'left', got {side!r}")
        if not samples:
            raise RoutingAlignError("padded() needs at least one sample")
        if seq_len is None:
            longest = max(length for _, length in samples)
            m = pad_to_multiple_of
            seq_len = max(m, -(-longest // m) * m)
        for sid, length in samples:
            if is_int(length) and length > seq_len:
                raise RoutingAlignError(f"sample {sid!r} is longer than its slot: {length} tokens, "
                                        f"seq_len {seq_len}")
        return cls(seq_len, tuple(((sid, 0 if side == "right" else seq_len - length, length),)
                                  for sid, length in samples))

    @classmethod
    def packed(cls, rows: Sequence[Sequence], seq_len: int) -> "BatchLayout":
        """Explicit packing: ``rows[b]`` = ``[(sample_id, length), ...]`` placed back to
        back from position 0; the rest of the row is right padding."""
        out = []
        for b, row in enumerate(rows):
            pos, segs = 0, []
            for sid, length in row:
                if is_int(length) and pos + length > seq_len:
                    raise RoutingAlignError(f"sample {sid!r} is longer than its slot: {length} tokens from "
                                            f"position {pos} in row {b} of seq_len {seq_len}")
                segs.append((sid, pos, length))
                pos += length
            out.append(tuple(segs))
        return cls(seq_len, tuple(out))

    @classmethod
    def pack_greedy(cls, samples: Sequence, seq_len: int, *, batch: int | None = None) -> "BatchLayout":
        """Pack ``[(sample_id, length), ...]`` in order (next fit): a sample goes into the
        current row if it fits, otherwise starts a new one.  ``batch`` pads the
        layout with empty rows up to that many (an error if more are needed)."""
        rows: list = [[]]
        used = 0
        for sid, length in samples:
            if is_int(length) and length > seq_len:
                raise RoutingAlignError(f"sample {sid!r} is longer than its slot: {length} tokens, "
                                        f"seq_len {seq_len}")
            if used + length > seq_len and rows[-1]:
                rows.append([])
                used = 0
            rows[-1].append((sid, length))
            used += length
        if batch is not None:
            if len(rows) > batch:
                raise RoutingAlignError(f"the samples need {len(rows)} rows of {seq_len}, batch is {batch}")
            rows += [[] for _ in range(batch - len(rows))]
        return cls.packed(rows, seq_len)

    # ---------------------------------------------------------- views

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return self.seq_len * self.batch

    @property
    def sample_order(self) -> list:
        """Sample ids row by row, by position within a row."""
        return [sid for row in self.rows for sid, _, _ in sorted(row, key=lambda s: s[1])]

    @property
    def lengths(self) -> dict:
        """sample id -> unpadded length."""
        return {sid: length for row in self.rows for sid, _, length in row}

    def segments(self):
        """``(b, sample_id, start, length)`` in :attr:`sample_order`."""
        for b, row in enumerate(self.rows):
            for sid, start, length in sorted(row, key=lambda s: s[1]):
                yield b, sid, start, length

    def token_rows(self, b: int, start: int, length: int) -> torch.Tensor:
        """Rows of the ``[seq, batch]``-flattened token list for positions
        ``start .. start+length-1`` of batch row ``b``: ``s * batch + b``."""
        return torch.arange(start, start + length) * self.batch + b

    def valid_mask(self, routed: dict | None = None) -> torch.Tensor:
        """Bool ``[seq_len * batch]`` (seq-major): True where a sample token sits
        (only its first ``routed[sid]`` tokens, when given)."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        for b, sid, start, length in self.segments():
            n = length if routed is None else routed.get(sid, length)
            mask[self.token_rows(b, start, n)] = True
        return mask

    def to_json(self, routed: dict | None = None) -> dict:
        return {"seq_len": self.seq_len,
                "rows": [[[sid, start, length, length if routed is None else routed.get(sid, length)]
                          for sid, start, length in row] for row in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> tuple:
        """``(layout, routed)`` from :meth:`to_json` output."""
        try:
            rows = tuple(tuple((s[0], s[1], s[2]) for s in row) for row in data["rows"])
            routed = {s[0]: s[3] if len(s) > 3 else s[2] for row in data["rows"] for s in row}
            return cls(data["seq_len"], rows), routed
        except (KeyError, TypeError, IndexError) as exc:
            raise RoutingAlignError(f"malformed aligned layout {data!r}: {exc}") from None


# ---------------------------------------------------------------- align


def filler_indices(rows: torch.Tensor, topk: int, num_experts: int, filler: str = "spread") -> torch.Tensor:
    """Expert ids for padding tokens at output rows ``rows`` (see the module doc)."""
    if filler == "spread":
        return (rows[:, None] * topk + torch.arange(topk)[None, :]) % num_experts
    if filler == "lowest":
        return torch.arange(topk).expand(rows.numel(), topk).clone()
    raise RoutingAlignError(f"filler must be one of {FILLERS}, got {filler!r}")


def _request_table(request_records: Iterable[RoutingRecord]):
    """sample id -> (record, first token, count); and the common num_experts/topk/layers/probs."""
    err = RoutingAlignError
    records = list(request_records.values() if isinstance(request_records, dict) else request_records)
    if not records:
        raise err("no request records")
    table: dict = {}
    first = records[0]
    for i, rec in enumerate(records):
        if not isinstance(rec, RoutingRecord):
            raise err(f"record {i} is a {type(rec).__name__}, not a RoutingRecord")
        rec.validate()  # token count vs seq_lens, ids, ... (raises RoutingRecordError)
        if rec.token_order != "requests":
            raise err(f"record {i} has token_order {rec.token_order!r}; SGLang request records are 'requests'")
        if rec.parallel is not None:
            raise err(f"record {i} is a per-rank slice (parallel={rec.parallel})")
        for name in ("num_experts", "topk", "layers"):
            if getattr(rec, name) != getattr(first, name):
                raise err(f"record {i} (samples {rec.sample_ids}) has {name}={getattr(rec, name)!r}, "
                          f"record 0 (samples {first.sample_ids}) has {getattr(first, name)!r}")
        if (rec.probs is None) != (first.probs is None):
            raise err(f"record {i} {'lacks' if rec.probs is None else 'has'} probs, record 0 does not")
        if rec.sample_ids is None:
            raise err(f"record {i} has no sample_ids: cannot tell which request it is")
        seq_lens = rec.seq_lens
        if seq_lens is None:
            if len(rec.sample_ids) != 1:
                raise err(f"record {i} holds {len(rec.sample_ids)} requests but no seq_lens")
            seq_lens = [rec.num_tokens]
        offset = 0
        for sid, n in zip(rec.sample_ids, seq_lens):
            if sid in table:
                raise err(f"sample {sid!r} is in record {table[sid][3]} and record {i}")
            table[sid] = (rec, offset, n, i)
            offset += n
    return table, first


def align_to_megatron(request_records: Iterable[RoutingRecord], layout: BatchLayout, *,
                      filler: str = "spread", missing_tail: int = 0, source: str | None = None,
                      extra: dict | None = None, layer_offset: int = 0) -> RoutingRecord:
    """SGLang request records -> one full-length ``megatron-sbh`` record for ``layout``.

    ``request_records``: records with ``token_order="requests"`` (a list, or a dict
    keyed by anything); each may hold one or several requests (``sample_ids`` /
    ``seq_lens``).  Requests not in the layout are ignored.  The result has
    ``seq_len * batch`` tokens, token ``s * batch + b`` = position ``s`` of row
    ``b``; padding gets the ``filler``; ``sample_ids`` has one entry per row (the
    sample id when a row holds exactly one sample, else the ids joined by ``+``),
    ``seq_lens = [seq_len] * batch``, ``padding`` the trailing padding of each row,
    and ``extra["aligned"]`` the exact layout (see :func:`valid_mask`).

    Errors (:class:`RoutingAlignError`): a layout sample missing from the records,
    a request longer than its slot or shorter by more than ``missing_tail``, a
    sample in two records, records that differ in layers / num_experts / topk /
    having probs, records that are not ``requests`` order or are rank slices.  A
    record whose token count does not match its ``seq_lens`` fails validation.

    ``layer_offset`` is added to every layer id: SGLang numbers layers from 0
    (``layer_id``), Megatron from 1 (``layer_number``), so pass 1 to replay an
    SGLang capture in Megatron."""
    err = RoutingAlignError
    if not isinstance(layout, BatchLayout):
        raise err(f"layout must be a BatchLayout, got {type(layout).__name__}")
    if filler not in FILLERS:
        raise err(f"filler must be one of {FILLERS}, got {filler!r}")
    if not is_int(missing_tail) or missing_tail < 0:
        raise err(f"missing_tail must be a non-negative int, got {missing_tail!r}")
    table, first = _request_table(request_records)
    topk, num_experts, layers = first.topk, first.num_experts, first.layers

    # src[t]: (record number, token in record) for each output token, -1 for padding
    total = layout.num_tokens
    src_rec = torch.full((total,), -1, dtype=torch.long)
    src_tok = torch.zeros(total, dtype=torch.long)
    routed = {}
    for b, sid, start, length in layout.segments():
        if sid not in table:
            have = list(table)
            raise err(f"sample {sid!r} (row {b}) is in no request record (records hold "
                      f"{have[:8]}{'...' if len(have) > 8 else ''})")
        rec, offset, n, i = table[sid]
        if n > length:
            raise err(f"sample {sid!r} is longer than its slot: the record has {n} tokens, the layout "
                      f"gives it {length} (row {b}, from position {start})")
        if n < length - missing_tail:
            raise err(f"sample {sid!r}: the record has {n} tokens, the layout says {length}"
                      + (f" (at most {missing_tail} may be missing)" if missing_tail else
                         " (pass missing_tail=1 if SGLang did not forward the last sampled token)"))
        routed[sid] = n
        rows = layout.token_rows(b, start, n)
        src_rec[rows] = i
        src_tok[rows] = torch.arange(offset, offset + n)

    valid = src_rec >= 0
    pad_rows = (~valid).nonzero().reshape(-1)
    fill = filler_indices(pad_rows, topk, num_experts, filler)
    # one gather per layer from the used records, concatenated
    records = {i: rec for rec, _, _, i in table.values()}
    used = sorted({int(i) for i in src_rec[valid].unique()})
    base, pos = torch.zeros(max(used, default=0) + 1, dtype=torch.long), 0
    for i in used:
        base[i] = pos
        pos += records[i].num_tokens
    real_rows = valid.nonzero().reshape(-1)
    src = base[src_rec[real_rows]] + src_tok[real_rows]
    indices, probs = {}, None if first.probs is None else {}
    for layer in layers:
        out = torch.empty((total, topk), dtype=torch.long)
        out[pad_rows] = fill
        if used:
            out[real_rows] = torch.cat([records[i].indices[layer].long() for i in used])[src]
        indices[layer] = out
        if probs is not None:
            dtype = first.probs[layer].dtype
            pout = torch.zeros((total, topk), dtype=dtype)
            if used:
                pout[real_rows] = torch.cat([records[i].probs[layer].to(dtype) for i in used])[src]
            probs[layer] = pout

    row_ids, padding = [], []
    for row in layout.rows:
        ordered = sorted(row, key=lambda s: s[1])
        row_ids.append(ordered[0][0] if len(ordered) == 1 else "+".join(str(s[0]) for s in ordered))
        end = max((start + routed[sid] for sid, start, _ in ordered), default=0)
        padding.append(layout.seq_len - end)
    tags = dict(extra or {})
    tags[ALIGN_KEY] = {**layout.to_json(routed), "filler": filler}
    if layer_offset:
        indices = {layer + layer_offset: ids for layer, ids in indices.items()}
        probs = None if probs is None else {layer + layer_offset: p for layer, p in probs.items()}
    return RoutingRecord(indices=indices, probs=probs, num_experts=num_experts, topk=topk,
                         token_order="megatron-sbh", sample_ids=row_ids,
                         seq_lens=[layout.seq_len] * layout.batch, padding=padding,
                         source=source or first.source, extra=tags)


def _layout_of(record: RoutingRecord, layout: BatchLayout | None):
    tag = record.extra.get(ALIGN_KEY) if isinstance(record.extra, dict) else None
    routed = None
    if tag is not None:
        stored, routed = BatchLayout.from_json(tag)
        if layout is None:
            layout = stored
    if layout is None:
        raise RoutingAlignError("record carries no aligned layout (extra['aligned']): pass layout=")
    return layout, routed


def valid_mask(record: RoutingRecord, layout: BatchLayout | None = None) -> torch.Tensor:
    """Bool ``[tokens]``: True for real sample tokens, False for padding filler.

    From ``extra["aligned"]`` (or ``layout``) for an aligned record; otherwise from
    ``padding`` (right padding of each ``megatron-sbh`` row / each request); all True
    without either."""
    if layout is not None or (isinstance(record.extra, dict) and ALIGN_KEY in record.extra):
        layout, routed = _layout_of(record, layout)
        if layout.num_tokens != record.num_tokens:
            raise RoutingAlignError(f"layout has {layout.num_tokens} tokens, record {record.num_tokens}")
        return layout.valid_mask(routed)
    mask = torch.ones(record.num_tokens, dtype=torch.bool)
    if record.padding is None or record.seq_lens is None:
        return mask
    if record.token_order == "megatron-sbh":
        batch = len(record.seq_lens)
        seq = record.num_tokens // max(batch, 1)
        for b, pad in enumerate(record.padding):
            mask[torch.arange(seq - pad, seq) * batch + b] = False
    else:
        offset = 0
        for n, pad in zip(record.seq_lens, record.padding):
            mask[offset + n - pad: offset + n] = False
            offset += n
    return mask


_valid_mask = valid_mask  # routing_diff's argument shadows the name


def split_to_requests(record: RoutingRecord, layout: BatchLayout | None = None) -> list:
    """Inverse of :func:`align_to_megatron`: one ``requests`` record per sample of the
    layout (in :attr:`BatchLayout.sample_order`), ``sample_ids=[id]``, holding the
    sample's tokens (its routed tokens, when ``extra["aligned"]`` says fewer were
    routed).  ``layout`` defaults to the one stored in ``extra["aligned"]``."""
    if record.token_order != "megatron-sbh" or record.parallel is not None:
        raise RoutingAlignError(f"split_to_requests needs a full megatron-sbh record, got token_order "
                                f"{record.token_order!r}, parallel={record.parallel}")
    layout, routed = _layout_of(record, layout)
    if layout.num_tokens != record.num_tokens:
        raise RoutingAlignError(f"layout has {layout.seq_len} x {layout.batch} = {layout.num_tokens} tokens, "
                                f"record has {record.num_tokens}")
    out = []
    for b, sid, start, length in layout.segments():
        n = length if routed is None else routed.get(sid, length)
        rows = layout.token_rows(b, start, n)
        out.append(RoutingRecord(
            indices={k: record.indices[k][rows] for k in record.layers},
            probs=None if record.probs is None else {k: record.probs[k][rows] for k in record.layers},
            num_experts=record.num_experts, topk=record.topk, token_order="requests",
            sample_ids=[sid], seq_lens=[n], source=record.source))
    return out


# ---------------------------------------------------------------- diff


@dataclass
class RoutingDiff:
    """How two routings of the same tokens differ (valid tokens only).

    A token differs in a layer when its expert *set* differs (order within the
    top-k is ignored).  ``per_layer[layer]`` = tokens differing in that layer;
    ``tokens_differing`` = tokens differing in at least one layer."""

    tokens: int                      # valid tokens compared
    layers: list
    per_layer: dict                  # layer -> tokens whose expert set differs
    tokens_differing: int
    overlap: dict = field(default_factory=dict)   # layer -> mean |A & B| / topk over valid tokens

    @property
    def fraction(self) -> float:
        return self.tokens_differing / self.tokens if self.tokens else 0.0

    def layer_fraction(self, layer) -> float:
        return self.per_layer[layer] / self.tokens if self.tokens else 0.0

    @property
    def layers_differing(self) -> list:
        return [layer for layer in self.layers if self.per_layer[layer]]

    @property
    def identical(self) -> bool:
        return self.tokens_differing == 0

    def __str__(self) -> str:
        head = (f"routing diff: {self.tokens_differing} of {self.tokens} tokens ({100 * self.fraction:.2f}%) "
                f"route differently in at least one layer; {len(self.layers_differing)} of "
                f"{len(self.layers)} layers differ")
        table = [("layer", "tokens differing", "fraction", "mean overlap")]
        for layer in self.layers:
            table.append((str(layer), str(self.per_layer[layer]), f"{100 * self.layer_fraction(layer):.2f}%",
                          f"{self.overlap.get(layer, 1.0):.3f}"))
        table.append(("any", str(self.tokens_differing), f"{100 * self.fraction:.2f}%", ""))
        widths = [max(len(r[i]) for r in table) for i in range(4)]
        return "\n".join([head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in table])


def routing_diff(reference: RoutingRecord, other: RoutingRecord, valid_mask: torch.Tensor | None = None
                 ) -> RoutingDiff:
    """Compare two records of the same tokens, layer by layer (see :class:`RoutingDiff`).

    ``valid_mask``: bool ``[tokens]``; only True tokens are counted.  Defaults to
    :func:`valid_mask` of ``reference`` (aligned layout, or padding) -- padding
    filler never counts as a difference."""
    err = RoutingAlignError
    if reference.num_tokens != other.num_tokens:
        raise err(f"records hold {reference.num_tokens} and {other.num_tokens} tokens")
    if reference.layers != other.layers:
        raise err(f"records have layers {reference.layers} and {other.layers}")
    if reference.topk != other.topk:
        raise err(f"records have topk {reference.topk} and {other.topk}")
    if reference.token_order != other.token_order:
        raise err(f"records have token_order {reference.token_order!r} and {other.token_order!r}")
    if valid_mask is None:
        valid_mask = _valid_mask(reference)
    valid_mask = torch.as_tensor(valid_mask, dtype=torch.bool).reshape(-1)
    if valid_mask.numel() != reference.num_tokens:
        raise err(f"valid_mask has {valid_mask.numel()} entries for {reference.num_tokens} tokens")
    rows = valid_mask.nonzero().reshape(-1)
    any_diff = torch.zeros(rows.numel(), dtype=torch.bool)
    per_layer, overlap = {}, {}
    for layer in reference.layers:
        a = reference.indices[layer][rows].long().sort(dim=1).values
        b = other.indices[layer][rows].long().sort(dim=1).values
        differ = (a != b).any(dim=1)
        per_layer[layer] = int(differ.sum())
        any_diff |= differ
        shared = (a[:, :, None] == b[:, None, :]).any(dim=2).sum(dim=1)
        overlap[layer] = float(shared.float().mean() / reference.topk) if rows.numel() else 1.0
    return RoutingDiff(tokens=int(rows.numel()), layers=list(reference.layers), per_layer=per_layer,
                       tokens_differing=int(any_diff.sum()), overlap=overlap)
