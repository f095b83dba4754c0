"""Inside one (name, layer): where the two sides differ, and which tokens differ most.

    m = drill.measure(x, y, labels)     # x, y: float32 [rows, width], row i of each the same token
    m.max_abs, m.rel_l2, m.cosine, m.where, m.percentiles, m.worst, m.per_row
    drill.token_view(name, layer, m.per_row, labels)    # every paired token, grouped by request

* ``where``: the largest |a - b|: its request, token position and hidden index (rows
  named by a row map), or its step, micro-batch and flat index in the dumped tensor
  (tensors compared as they are), with a and b there;
* ``percentiles`` of |a - b| over every value: p50, p90, p99 (the nearest rank) and
  max.  Up to :data:`EXACT_UP_TO` values they are exact; above, they are read from an
  evenly strided sample of about that many (a stride prime to the row width, so every
  hidden index is sampled): a full selection over each layer's values would cost more
  than the rest of the comparison (0.06 s for 4M values on the 2-core VM);
* ``per_row``: each row's relative L2 ``||a - b|| / ||b||`` (0 where both are zero,
  infinite where only b is; NaN stays NaN and ranks as the worst); ``worst``: the
  :data:`WORST` largest, worst first.

Everything is computed on whole tensors (one difference, per-row norms, one argmax, one
partial sort); the Python work is per reported row, not per token or value.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
EXACT_UP_TO = 1 << 20
WORST = 10


@dataclass
class Labels:
    """What each compared row is: keys ``(rid, position)`` and token ids per row (rows
    named by a row map), or pieces ``(first row, rows, width, step, microbatch)`` of the
    tensors compared as they are."""

    keys: list | None = None
    tokens: list | None = None
    pieces: list | None = None

    def row(self, i: int) -> dict:
        if self.keys is not None:
            rid, position = self.keys[i]
            return {"request": rid, "position": position, "token": None if self.tokens is None else self.tokens[i]}
        start, _, _, step, microbatch = self._piece(i)
        return {"request": None, "position": None, "token": None, "step": step, "microbatch": microbatch,
                "row": i - start}

    def at(self, i: int, column: int) -> dict:
        if self.keys is not None:
            rid, position = self.keys[i]
            return {"request": rid, "position": position, "index": column}
        start, _, width, step, microbatch = self._piece(i)
        return {"request": None, "position": None, "index": (i - start) * width + column, "step": step,
                "microbatch": microbatch}

    def _piece(self, i: int):
        return self.pieces[bisect.bisect_right([p[0] for p in self.pieces], i) - 1]


@dataclass
class Measure:
    rows: int
    max_abs: float
    rel_l2: float
    cosine: float
    where: dict
    percentiles: dict
    worst: list
    per_row: object  # float64 tensor [rows]: each row's relative L2


def measure(x, y, labels: Labels) -> Measure:
    """The figures of one (name, layer): x (side A) against y (side B, the reference)."""
    import torch

    width = x.shape[1]
    diff = x - y
    d2 = torch.linalg.vector_norm(diff, dim=1).double().square()
    x2 = torch.linalg.vector_norm(x, dim=1).double().square()
    y2 = torch.linalg.vector_norm(y, dim=1).double().square()
    xy = torch.einsum("ij,ij->i", x, y).double()
    flat = diff.abs_().reshape(-1)
    at = int(flat.argmax())
    max_abs = float(flat[at])
    row, column = divmod(at, width)
    where = {**labels.at(row, column), "a": float(x[row, column]), "b": float(y[row, column])}
    norm, ref = math.sqrt(float(d2.sum())), math.sqrt(float(y2.sum()))
    # a zero reference: 0 if equal, else inf; a NaN anywhere stays NaN (it diverges either way)
    rel = norm / ref if ref > 0 or math.isnan(ref) else (0.0 if norm == 0 else math.inf)
    cosine = float(xy.sum()) / max(math.sqrt(float(x2.sum())) * ref, 1e-8)
    per_row = torch.where(y2 > 0, (d2 / y2).sqrt(), torch.where(d2 == 0, 0.0, math.inf))
    per_row = torch.where(y2.isnan() | d2.isnan(), math.nan, per_row)
    rank = torch.nan_to_num(per_row, nan=math.inf)
    top = torch.topk(rank, min(WORST, len(rank))).indices.tolist()
    worst = [{**labels.row(i), "diff": float(per_row[i])} for i in top]
    return Measure(len(x), max_abs, rel, cosine, where, percentiles(flat, width, max_abs), worst, per_row)


def percentiles(values, width: int = 1, largest: float | None = None) -> dict:
    """p50, p90, p99 (nearest rank) and max of a 1-D float tensor (module docstring)."""
    import numpy as np

    sample = values[::stride(values.numel(), width)].numpy()
    ranks = [round(q * (len(sample) - 1)) for _, q in PERCENTILES]
    picked = np.partition(sample, ranks)[ranks]
    out = {name: float(v) for (name, _), v in zip(PERCENTILES, picked)}
    out["max"] = float(values.max()) if largest is None else largest
    return out


def stride(n: int, width: int) -> int:
    """The sampling stride for ``n`` values in rows of ``width``: 1 up to EXACT_UP_TO, else
    the smallest odd stride prime to the width that leaves at most about that many."""
    step = max(1, -(-n // EXACT_UP_TO))
    if step > 1:
        step |= 1
        while math.gcd(step, width) != 1:
            step += 2
    return step


def token_view(name: str, layer, per_row, labels: Labels) -> dict:
    """Every compared token of one (name, layer) by request: requests the worst first,
    each request's tokens in position order (the report's ``tokens``)."""
    view = {"name": name, "layer": layer, "requests": []}
    if labels.keys is None:
        return view
    requests: dict = {}
    values = per_row.tolist()
    for i, (rid, position) in enumerate(labels.keys):
        token = None if labels.tokens is None else labels.tokens[i]
        requests.setdefault(rid, []).append({"position": position, "token": token, "diff": values[i]})
    for rid, tokens in requests.items():
        tokens.sort(key=lambda t: t["position"])
        worst = max(tokens, key=lambda t: _rank(t["diff"]))["diff"]
        view["requests"].append({"request": rid, "worst": worst, "tokens": tokens})
    view["requests"].sort(key=lambda r: -_rank(r["worst"]))
    return view


def _rank(value: float) -> float:
    return math.inf if math.isnan(value) else value
