"""The comparator's report as one self-contained HTML page: the verdict, per-layer
error curves and routing agreement as inline SVG, and the full table.

    source-patch compare ROLLOUT TRAIN --html report.html

No script, no external resource; every string from the report is escaped (a report
is data, maybe from someone else's dumps).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

_W, _H, _PAD, _LEGEND = 760, 260, 48, 150  # the legend sits right of the plot
_LEFT = 96  # room for the y axis' title and labels such as 0.999999985
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
_FLOOR = 1e-12  # log axis: exact zeros are drawn here, and said so


def render(report: dict, title: str = "Rollout vs training") -> str:
    rows = report.get("rows", [])
    first = report.get("first_divergent")
    verdict = ("no divergence past rtol" if not first else
               f"first divergent: {first[0]} layer {'-' if first[1] is None else first[1]}")
    parts = [f"<h1>{_e(title)}</h1>",
             f"<p class='{'bad' if first else 'ok'}'><b>{_e(verdict)}</b> &middot; "
             f"{_e(report.get('requests'))} requests, {_e(report.get('tokens'))} tokens paired, "
             f"rtol {_e(report.get('rtol'))}</p>"]
    if report.get("inputs"):
        parts.append(_section("Inputs", _inputs(report["inputs"])))
    layered = [r for r in rows if r.get("layer") is not None]
    if layered:
        parts.append(_section("Relative L2 per layer (log scale; dashed: rtol)",
                              _chart(layered, "rel_l2", "relative L2", log=True, threshold=report.get("rtol"))))
        parts.append(_section("Cosine similarity per layer", _chart(layered, "cosine", "cosine", log=False)))
    routing = report.get("routing")
    if routing and routing.get("per_layer"):
        parts.append(_section("Routing agreement per layer (same set of experts)", _bars(routing)))
    logprobs = report.get("logprobs")
    if logprobs:
        parts.append(_section("Next-token log-probs (rollout = behaviour policy)", _logprobs(logprobs)))
    parts.append(_section("All rows", _table(rows, report.get("rtol"))))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + _e(title) + "</title><style>"
            "body{font:14px sans-serif;margin:24px;max-width:800px}table{border-collapse:collapse}"
            "td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}td:first-child{text-align:left}"
            ".bad{color:#b00}.ok{color:#070}tr.bad{background:#fee}svg text{font:11px sans-serif}"
            "td.input{text-align:left;word-break:break-all}"
            "</style></head><body>" + "".join(parts) + "</body></html>")


def write(report: dict, path, title: str = "Rollout vs training") -> Path:
    """The page at ``path``, written whole through core/private.py's plain-file writer
    (a FIFO or a device there is an OSError at once, a link replaced, never followed)."""
    from ..core import private

    path = Path(path)
    private.write_file(path, render(report, title).encode("utf-8"))
    return path


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _section(heading: str, body: str) -> str:
    return f"<h2>{_e(heading)}</h2>{body}"


def _scale(lo: float, hi: float, log: bool):
    """value -> y pixel, and the tick values."""
    if log:
        lo, hi = math.log10(max(lo, _FLOOR)), math.log10(max(hi, _FLOOR * 10))
        lo, hi = math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1)
        ticks = [10.0 ** k for k in range(int(lo), int(hi) + 1)]
        to = lambda v: math.log10(max(v, _FLOOR))  # noqa: E731
    else:
        lo, hi = (lo, hi) if hi > lo else (lo - 1e-6 * max(1.0, abs(lo)), hi)  # all equal: drawn at the top
        ticks = [lo + (hi - lo) * k / 4 for k in range(5)]
        to = float
    span = hi - lo
    return (lambda v: _H - _PAD - (to(v) - lo) / span * (_H - 2 * _PAD)), ticks


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _labels(ticks: list, log: bool) -> list:
    """Tick labels that tell neighbours apart: powers of ten on a log axis; on a linear
    one as many decimals as the tick spacing needs (cosines differ in the 8th digit)."""
    if log:
        return [f"{t:.0e}" for t in ticks]
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 0.0
    decimals = min(max(1 - math.floor(math.log10(step)), 0), 12) if step > 0 else 6
    return [f"{t:.{decimals}f}" for t in ticks]


def _chart(rows: list, key: str, axis: str, log: bool, threshold=None) -> str:
    layers = sorted({int(r["layer"]) for r in rows})
    values = [v for r in rows if (v := _finite(r.get(key))) is not None]
    if threshold is not None and log:
        values.append(float(threshold))
    if not values:
        return "<p>no finite values</p>"
    y, ticks = _scale(min(values), max(values), log)
    right = _W - _LEGEND
    x = {layer: _LEFT + i * (right - _LEFT) / max(len(layers) - 1, 1) for i, layer in enumerate(layers)}
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}'>",
           f"<text x='12' y='{_H / 2:.1f}' text-anchor='middle' transform='rotate(-90 12 {_H / 2:.1f})'>"
           f"{_e(axis)}</text>"]
    for t, label in zip(ticks, _labels(ticks, log)):
        out.append(f"<line x1='{_LEFT}' x2='{right}' y1='{y(t):.1f}' y2='{y(t):.1f}' stroke='#eee'/>"
                   f"<text x='{_LEFT - 4}' y='{y(t) + 4:.1f}' text-anchor='end'>{label}</text>")
    for layer, px in x.items():
        out.append(f"<text x='{px:.1f}' y='{_H - 20}' text-anchor='middle'>{layer}</text>")
    out.append(f"<text x='{(_LEFT + right) / 2}' y='{_H - 4}' text-anchor='middle'>layer (rollout's, 0-based)</text>")
    if threshold is not None and log:
        out.append(f"<line x1='{_LEFT}' x2='{right}' y1='{y(float(threshold)):.1f}' "
                   f"y2='{y(float(threshold)):.1f}' stroke='#b00' stroke-dasharray='6 4'/>")
    names = list(dict.fromkeys(r["name"] for r in rows))
    for i, name in enumerate(names):
        color = _COLORS[i % len(_COLORS)]
        points = [(x[int(r["layer"])], y(v)) for r in rows if r["name"] == name
                  and (v := _finite(r.get(key))) is not None]
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='"
                   + " ".join(f"{px:.1f},{py:.1f}" for px, py in points) + "'/>")
        out.append(f"<text x='{right + 12}' y='{_PAD + 14 * i}' fill='{color}'>{_e(name)}</text>")
    out.append("</svg>")
    if log and any(_finite(r.get(key)) == 0 for r in rows):
        out.append(f"<p>exact zeros are drawn at {_FLOOR:g}</p>")
    return "".join(out)


def _bars(routing: dict) -> str:
    per_layer = routing["per_layer"]
    width = (_W - _LEGEND - _PAD) / max(len(per_layer), 1)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}'>"]
    for i, entry in enumerate(per_layer):
        share = min(max(_finite(entry.get("agreement")) or 0.0, 0.0), 1.0)
        h = share * (_H - 2 * _PAD)
        px = _PAD + i * width
        out.append(f"<rect x='{px + 4:.1f}' y='{_H - _PAD - h:.1f}' width='{width - 8:.1f}' height='{h:.1f}' "
                   f"fill='{'#2ca02c' if share == 1 else '#d62728'}'/>"
                   f"<text x='{px + width / 2:.1f}' y='{_H - _PAD - h - 4:.1f}' text-anchor='middle'>"
                   f"{share:.1%}</text><text x='{px + width / 2:.1f}' y='{_H - 20}' text-anchor='middle'>"
                   f"{_e(entry.get('layer'))}</text>")
    out.append("</svg>")
    differ = _finite(routing.get("tokens_differing_any_layer"))
    if differ is not None:
        out.append(f"<p>tokens routed differently in at least one layer: {differ:.2%}</p>")
    return "".join(out)


def _table(rows: list, rtol) -> str:
    head = "<tr><th>name</th><th>layer</th><th>rows</th><th>max |a-b|</th><th>rel L2</th><th>cosine</th></tr>"
    body = []
    for r in rows:
        cells = [r.get("name"), "-" if r.get("layer") is None else r.get("layer"), r.get("rows"),
                 _number(r.get("max_abs")), _number(r.get("rel_l2")), _number(r.get("cosine"), ".8f")]
        body.append(f"<tr class='{'' if r.get('ok', True) else 'bad'}'>"
                    + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table><p>highlighted: relative L2 above rtol {_e(rtol)}</p>"


def _number(value, spec: str = ".3g") -> str:
    """A figure as text: a finite number formatted by ``spec``; NaN and infinities (or the
    JSON report's strings for them) by name; None as n/a."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    if value is None:
        return "n/a"
    return {"nan": "NaN", "inf": "inf", "infinity": "inf", "-inf": "-inf", "-infinity": "-inf"}.get(
        str(value).lower(), str(value))


_LOGPROB_ROWS = (("tokens", "tokens", "d"), ("mean_abs_diff", "mean |dlogp|", ".3g"),
                 ("max_abs_diff", "max |dlogp|", ".3g"), ("k3_kl", "k3 KL(rollout || train)", ".3g"),
                 ("frac_over_ln2", "share with |dlogp| > ln 2", ".2%"),
                 ("tis_mean", "truncated IS weight, mean", ".4f"), ("tis_ess", "truncated IS, ESS / n", ".4f"))


def _logprobs(figures: dict) -> str:
    cells = "".join(f"<tr><td>{_e(label)}</td><td>{_e(_number(figures.get(key), spec))}</td></tr>"
                    for key, label, spec in _LOGPROB_ROWS)
    return f"<table>{cells}</table>"


def _inputs(inputs: dict) -> str:
    """What the report was made from (compare.describe_inputs): one row per item."""
    cells = "".join(f"<tr><td>{_e(key)}</td><td class='input'>{_e(value)}</td></tr>" for key, value in inputs.items())
    return f"<table class='inputs'>{cells}</table>"
