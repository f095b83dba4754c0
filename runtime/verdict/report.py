"""A comparison's result: its rows, the text table and the JSON form.

The JSON form (``Report.to_json``, ``--json``, ``--json-out``, and compare_html.py's
input) is a contract: each of ``rows`` has name, layer, rows, max_abs, rel_l2, cosine,
ok, ``where`` {request, position, index, a, b}, ``percentiles`` {p50, p90, p99, max}
and ``worst`` [{request, position, token, diff}] (tensors compared as they are add
step, microbatch and row); the report has ``tokens`` {name, layer, requests: [{request,
worst, tokens: [{position, token, diff}]}]} (the per-token view), ``tokens_paired``,
``layer_numbering``, and, where there are any, ``not_compared`` (lines), ``joined``
(lines), ``prefix_cache_rows``, ``routing``, ``logprobs``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    name: str
    layer: int | None           # numbered from 0 (Report.layer_numbering)
    rows: int                   # rows compared: (request, position) pairs, or rows of the tensors
    max_abs: float
    rel_l2: float
    cosine: float
    ok: bool
    where: dict | None = None        # the largest |a - b| (drill.py)
    percentiles: dict | None = None  # of |a - b|
    worst: list | None = None        # the rows of the largest relative L2, worst first


@dataclass
class Report:
    rows: list = field(default_factory=list)
    tokens: int = 0             # (request, position) pairs both sides hold
    requests: int = 0
    rtol: float = 1e-4
    routing: list = field(default_factory=list)  # [{"layer", "tokens", "agreement"}]
    routing_any_differ: float | None = None      # fraction of tokens routed differently in >= 1 layer
    logprobs: dict | None = None                 # logprobs.Mismatch.to_json() of the next tokens
    layer_numbering: str = ""
    token_view: dict | None = None               # drill.token_view of the first divergent row
    not_compared: list = field(default_factory=list)  # one line each: what a side lacks
    joined: list = field(default_factory=list)        # one line per side that joined shards
    prefix_cache_rows: int = 0

    @property
    def first_divergent(self):
        bad = next((r for r in self.rows if not r.ok), None)
        return None if bad is None else (bad.name, bad.layer)

    def table(self) -> str:
        lines = [f"{self.requests} requests, {self.tokens} tokens paired; rtol {self.rtol:g}", self.layer_numbering]
        lines += self.joined
        lines.append(f"{'name':18} {'layer':>5} {'rows':>6} {'max|a-b|':>10} {'rel L2':>10} {'cosine':>9}  ok")
        for r in self.rows:
            layer = "-" if r.layer is None else str(r.layer)
            lines.append(f"{r.name:18} {layer:>5} {r.rows:>6} {r.max_abs:>10.3g} {r.rel_l2:>10.3g} "
                         f"{r.cosine:>9.6f}  {'ok' if r.ok else 'DIVERGES'}")
        for r in self.routing:
            lines.append(f"{'routing agreement':18} {r['layer']:>5} {r['tokens']:>6} {r['agreement']:>10.2%}")
        if self.routing_any_differ is not None:
            lines.append(f"tokens routed differently in at least one layer: {self.routing_any_differ:.2%}")
        if self.logprobs is not None:
            lines.append(f"next-token log-probs: {self.logprobs['line']}")
        lines += self.not_compared
        first = next((r for r in self.rows if not r.ok), None)
        if first is not None:
            lines += _drill_lines(first)
        lines.append("no divergence" if first is None else f"first divergent: {first.name}"
                     + ("" if first.layer is None else f" layer {first.layer}"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = {"requests": self.requests, "tokens_paired": self.tokens, "rtol": self.rtol,
               "layer_numbering": self.layer_numbering, "first_divergent": self.first_divergent,
               "rows": [asdict(r) for r in self.rows],
               "tokens": self.token_view or {"name": None, "layer": None, "requests": []}}
        if self.routing:
            out["routing"] = {"per_layer": self.routing, "tokens_differing_any_layer": self.routing_any_differ}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.not_compared:
            out["not_compared"] = self.not_compared
            out["prefix_cache_rows"] = self.prefix_cache_rows
        if self.joined:
            out["joined"] = self.joined
        return out


def _drill_lines(row: Row) -> list:
    """The first divergent row, drilled into: where its largest |a - b| is, its
    percentiles, its worst tokens (a section after the table: the table stays narrow)."""
    layer = "-" if row.layer is None else row.layer
    w, p = row.where or {}, row.percentiles or {}
    if w.get("request") is not None:
        at = f"request {w['request']!r} position {w['position']} hidden index {w['index']}"
    else:
        at = f"step {w.get('step')} microbatch {w.get('microbatch')} flat index {w.get('index')}"
    lines = [f"{row.name} layer {layer}: largest |a-b| {row.max_abs:.3g} at {at} (a {w.get('a', 0):.6g}, "
             f"b {w.get('b', 0):.6g}); |a-b| p50 {p.get('p50', 0):.3g} p90 {p.get('p90', 0):.3g} "
             f"p99 {p.get('p99', 0):.3g} max {p.get('max', 0):.3g}"]
    worst = []
    for t in [t for t in row.worst or [] if t["diff"] != 0][:5]:  # the table stays readable; JSON has 10
        if t.get("request") is not None:
            token = "" if t.get("token") is None else f" token {t['token']}"
            worst.append(f"{t['request']!r}@{t['position']}{token} {t['diff']:.3g}")
        else:
            worst.append(f"step {t.get('step')} row {t.get('row')} {t['diff']:.3g}")
    if worst:
        lines.append("  worst rows (relative L2): " + ", ".join(worst))
    return lines
