"""The comparator's report as one self-contained HTML page: the verdict, per-layer
error curves and routing agreement as inline SVG, the full table (where each row's
largest |a-b| sits, its percentiles), the worst tokens of the first divergent row and
a per-token view: each request a line of its tokens, coloured by their relative L2 on
a log scale around rtol.

    source-patch compare ROLLOUT TRAIN --html report.html

No script, no external resource; every string from the report is escaped (a report
is data, maybe from someone else's dumps), and the per-token view is capped
(:data:`MAX_REQUESTS` x :data:`MAX_TOKENS`, saying what it left out) so that a huge
report is still a bounded page.  Keys of the report that older comparators did not
write (``where``, ``percentiles``, ``worst``, ``tokens`` as an object,
``layer_numbering``) are shown where present, and their sections left out where not.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

_W, _H, _PAD, _LEGEND = 760, 260, 48, 150  # the legend sits right of the plot
_LEFT = 96  # room for the y axis' title and labels such as 0.999999985
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
_FLOOR = 1e-12  # log axis: exact zeros are drawn here, and said so
MAX_REQUESTS, MAX_TOKENS = 64, 512  # the per-token view: requests (the worst first), tokens of each
MAX_WORST = 10  # rows of the "Worst tokens" table
_TEXT = 24  # characters of a token's decoded text shown in its box (the tooltip: _TIP)
_TIP = 200
_LEVELS = 24  # heat levels above rtol/10: 8 per decade, rtol at 8, 100 x rtol at 24
_NEUTRAL, _AMBER, _RED, _NAN = (240, 240, 240), (255, 191, 0), (214, 39, 40), "#7b3294"


def render(report: dict, title: str = "Rollout vs training") -> str:
    rows = report.get("rows", [])
    first = report.get("first_divergent")
    verdict = ("no divergence past rtol" if not first else
               f"first divergent: {first[0]} layer {'-' if first[1] is None else first[1]}")
    view = report.get("tokens") if isinstance(report.get("tokens"), dict) else None
    paired = report.get("tokens_paired") if view is not None else report.get("tokens")
    counts = f"{_e(report.get('requests'))} requests" + ("" if paired is None else f", {_e(paired)} tokens paired")
    parts = [f"<h1>{_e(title)}</h1>",
             f"<p class='{'bad' if first else 'ok'}'><b>{_e(verdict)}</b> &middot; "
             f"{counts}, rtol {_e(report.get('rtol'))}</p>"]
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
    numbering = report.get("layer_numbering")
    parts.append(_section("All rows", ("" if numbering is None else f"<p class='numbering'>{_e(numbering)}</p>")
                          + _table(rows, report.get("rtol"))))
    rtol = _rtol(report.get("rtol"))
    worst = _worst_row(rows, first)
    if worst is not None:
        row, why = worst
        parts.append(_section(f"Worst tokens: {_short(row.get('name'), 120)} layer {_layer(row.get('layer'))} ({why})",
                              _worst(row["worst"], rtol), "worst"))
    if view is not None:
        parts.append(_section(f"Per token: {_short(view.get('name'), 120)} layer {_layer(view.get('layer'))} "
                              "(relative L2 of each token's row)", _tokens(view, rtol), "tokens"))
    heat = "" if worst is None and view is None else _heat_css()
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + _e(title) + "</title><style>"
            "body{font:14px sans-serif;margin:24px;max-width:960px}table{border-collapse:collapse}"
            "td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}td:first-child{text-align:left}"
            ".bad{color:#b00}.ok{color:#070}tr.bad{background:#fee}svg text{font:11px sans-serif}"
            "td.input{text-align:left;word-break:break-all}td.at,td.pct{font-size:12px;white-space:nowrap}"
            + heat + "</style></head><body>" + "".join(parts) + "</body></html>")


def write(report: dict, path, title: str = "Rollout vs training") -> Path:
    """The page at ``path``, written whole through core/private.py's plain-file writer
    (a FIFO or a device there is an OSError at once, a link replaced, never followed)."""
    from ..core import private

    path = Path(path)
    private.write_file(path, render(report, title).encode("utf-8"))
    return path


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _section(heading: str, body: str, anchor: str | None = None) -> str:
    if anchor is None:
        return f"<h2>{_e(heading)}</h2>{body}"
    return f"<section id='{anchor}'><h2>{_e(heading)}</h2>{body}</section>"


def _layer(layer) -> str:
    return "-" if layer is None else str(layer)


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
    """One row per (name, layer); where the report has them (newer comparators), where
    each row's largest |a-b| sits and the percentiles of |a-b|."""
    at = any(isinstance(r.get("where"), dict) for r in rows)
    pct = any(isinstance(r.get("percentiles"), dict) for r in rows)
    head = ("<tr><th>name</th><th>layer</th><th>rows</th><th>max |a-b|</th>"
            + ("<th>max at: request &middot; position &middot; index</th>" if at else "")
            + ("<th>|a-b| p50 &middot; p90 &middot; p99</th>" if pct else "")
            + "<th>rel L2</th><th>cosine</th></tr>")
    body = []
    for r in rows:
        cells = [f"<td>{_e(c)}</td>" for c in (r.get("name"), _layer(r.get("layer")), r.get("rows"),
                                                 _number(r.get("max_abs")))]
        if at:
            cells.append(_where_cell(r.get("where")))
        if pct:
            cells.append(_percentile_cell(r.get("percentiles")))
        cells += [f"<td>{_e(_number(r.get('rel_l2')))}</td>", f"<td>{_e(_number(r.get('cosine'), '.8f'))}</td>"]
        body.append(f"<tr class='{'' if r.get('ok', True) else 'bad'}'>" + "".join(cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table><p>highlighted: relative L2 above rtol {_e(rtol)}</p>"


def _where_cell(where) -> str:
    """request &middot; position &middot; hidden index of the largest |a-b|; a and b in its tooltip."""
    if not isinstance(where, dict):
        return "<td class='at'>n/a</td>"
    text = " \u00b7 ".join(_short("-" if where.get(k) is None else where.get(k), 40)
                           for k in ("request", "position", "index"))
    tip = f"rollout {_number(where.get('a'), '.6g')}, training {_number(where.get('b'), '.6g')}"
    return f"<td class='at' title='{_e(tip)}'>{_e(text)}</td>"


def _percentile_cell(percentiles) -> str:
    if not isinstance(percentiles, dict):
        return "<td class='pct'>n/a</td>"
    text = " \u00b7 ".join(_number(percentiles.get(k), ".2g") for k in ("p50", "p90", "p99"))
    return f"<td class='pct' title='{_e('max ' + _number(percentiles.get('max')))}'>{_e(text)}</td>"


# ------------------------------------------------------------------ tokens: the worst, and the per-token view

def _value(v) -> float | None:
    """A diff as a float: numbers, and the JSON report's strings for NaN and infinities."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() in ("nan", "inf", "infinity", "-inf", "-infinity"):
        return float(v.strip().lower().replace("infinity", "inf"))
    return None


def _rtol(rtol) -> float:
    v = _finite(rtol)
    return v if v is not None and v > 0 else 1e-4


def _level(diff, rtol: float) -> int | None:
    """0 below rtol/10, then 1.._LEVELS on a log scale (rtol at _LEVELS/3, 100 x rtol and
    above at _LEVELS); None for NaN or no number."""
    v = _value(diff)
    if v is None or math.isnan(v):
        return None
    if v <= rtol / 10:
        return 0
    decades = math.log10(v / rtol) if math.isfinite(v) else math.inf  # -1 .. 2 matters
    return _LEVELS if decades >= 2 else max(1, math.ceil((decades + 1) / 3 * _LEVELS))


def _heat(level: int) -> str:
    t = level / _LEVELS
    lo, hi, s = (_NEUTRAL, _AMBER, t * 3) if t <= 1 / 3 else (_AMBER, _RED, (t - 1 / 3) * 1.5)
    return "#" + "".join(f"{round(a + (b - a) * s):02x}" for a, b in zip(lo, hi))


def _heat_css() -> str:
    """The heat levels as classes (a class a token keeps the page small)."""
    levels = "".join(f".h{k}{{background:{_heat(k)}}}" for k in range(_LEVELS + 1))
    return (levels + f".hn{{background:{_NAN};color:#fff}}"
            + "".join(f".h{k}" + ("," if k < _LEVELS else "") for k in range(_LEVELS * 2 // 3, _LEVELS + 1))
            + "{color:#fff}"
            ".toks{display:flex;flex-wrap:wrap;gap:2px;margin:2px 0 12px}"
            ".toks span,.key span{font:12px monospace;padding:1px 3px;border-radius:2px;white-space:pre}"
            ".toks .cut{border-left:3px solid #222;padding:0;margin:0 3px;border-radius:0}"
            ".key span{display:inline-block;margin-right:10px}p.req{margin:6px 0 0;font-size:13px}")


def _heat_class(diff, rtol: float) -> str:
    level = _level(diff, rtol)
    return "hn" if level is None else f"h{level}"


def _short(value, limit: int) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _worst_row(rows: list, first):
    """The row whose worst tokens are shown: the first divergent one, else (nothing
    diverges) the one of the largest relative L2; only a row that has its ``worst``."""
    with_worst = [r for r in rows if isinstance(r, dict) and isinstance(r.get("worst"), list) and r["worst"]]
    if first:
        found = next((r for r in with_worst if [r.get("name"), r.get("layer")] == list(first)), None)
        return None if found is None else (found, "the first divergent row")
    finite = [(v, i) for i, r in enumerate(with_worst) if (v := _finite(r.get("rel_l2"))) is not None]
    return None if not finite else (with_worst[max(finite)[1]], "the largest relative L2; nothing diverges")


def _worst(entries: list, rtol: float) -> str:
    head = "<tr><th>request</th><th>position</th><th>token</th><th>rel L2 of its row</th></tr>"
    body = []
    for w in entries[:MAX_WORST]:
        if not isinstance(w, dict):
            continue
        cells = [_short("-" if w.get(k) is None else w.get(k), 80) for k in ("request", "position", "token")]
        diff = w.get("diff")
        body.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells)
                    + f"<td class='{_heat_class(diff, rtol)}'>{_e(_number(_value(diff)))}</td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _legend(rtol: float) -> str:
    keys = [(0, f"below rtol/10 ({rtol / 10:.0e})"), (_LEVELS // 3, f"rtol ({rtol:.0e})"),
            (_LEVELS * 2 // 3, f"10\u00d7 rtol ({rtol * 10:.0e})"),
            (_LEVELS, f"100\u00d7 rtol and above ({rtol * 100:.0e})")]
    spans = "".join(f"<span class='h{k}'>{_e(label)}</span>" for k, label in keys)
    return f"<p class='key'>{spans}<span class='hn'>NaN</span> (log scale; hover a token for its figures)</p>"


def _tokens(view: dict, rtol: float) -> str:
    """Each request a line of its tokens in position order, each token's box coloured by
    its relative L2; at most MAX_REQUESTS requests (the report orders them worst first)
    and MAX_TOKENS tokens a request (the first positions), what was left out said."""
    requests = [r for r in view.get("requests", []) if isinstance(r, dict)] \
        if isinstance(view.get("requests"), list) else []
    out = [_legend(rtol)]
    for req in requests[:MAX_REQUESTS]:
        listed = req.get("tokens") if isinstance(req.get("tokens"), list) else []
        tokens = [t for t in listed if isinstance(t, dict)]
        tokens.sort(key=lambda t: (_integer(t.get("position")) is None, _integer(t.get("position")) or 0))
        prompt = _integer(req.get("prompt_length"))
        rid = "-" if req.get("request") is None else _short(req.get("request"), 120)
        head = (f"request {rid} \u00b7 worst {_number(_value(req.get('worst')))} "
                f"\u00b7 {len(tokens)} tokens" + ("" if prompt is None else f" \u00b7 prompt {prompt}"))
        boxes, cut_at = [], prompt
        for t in tokens[:MAX_TOKENS]:
            position = _integer(t.get("position"))
            if cut_at is not None and position is not None and position >= cut_at:  # before the first response token
                cut_at = None
                cut = f"prompt length {prompt}: the response starts at position {prompt}"
                boxes.append(f"<span class='cut' title='{_e(cut)}'></span>")
            boxes.append(_box(t, position, rtol))
        left = len(tokens) - MAX_TOKENS
        if left > 0:
            said = f"\u2026 {left} tokens left out (at most {MAX_TOKENS} a request)"
            boxes.append(f"<span class='left'>{_e(said)}</span>")
        out.append(f"<p class='req'>{_e(head)}</p><div class='toks'>{''.join(boxes)}</div>")
    left = len(requests) - MAX_REQUESTS
    if left > 0:
        said = f"{left} requests left out (the view shows at most {MAX_REQUESTS}, the worst first)"
        out.append(f"<p class='left'>{_e(said)}</p>")
    if not requests:
        out.append("<p>no requests</p>")
    return "".join(out)


def _integer(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _box(token: dict, position, rtol: float) -> str:
    """One token: its decoded text if the report has it, else its id; its figures in the tooltip."""
    tid, text, diff = _integer(token.get("token")), token.get("text"), _value(token.get("diff"))
    shown = "?" if tid is None else str(tid)
    if isinstance(text, str):
        shown = _short(text.replace("\n", "\u21b5").replace("\t", "\u21e5"), _TEXT) or "\u2205"
    tip = (f"position {'-' if position is None else position} \u00b7 token {'-' if tid is None else tid}"
           + (f" {_short(repr(text), _TIP)}" if isinstance(text, str) else "")
           + f" \u00b7 rel L2 {_number(diff)}"
           + (f" ({diff / rtol:.3g}\u00d7 rtol)" if diff is not None and math.isfinite(diff) else ""))
    return f"<span class='{_heat_class(diff, rtol)}' title='{_e(tip)}'>{_e(shown)}</span>"


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
