"""bench/import_bench.py's table and intervals (standard library only, like its parent
process): milliseconds as the table prints them, the paired B - A column, the ratio of
the medians with a bootstrap 90% interval."""

from __future__ import annotations

import statistics

import stats  # bench/


def ratio_line(what: str, b: list, a: list, paired: bool = False) -> str:
    """B against A: the ratio of the medians with a bootstrap 90% interval (resampling
    each side; ``paired``: B[i] and A[i] are a pair, of one round or one process:
    resampling the pairs, the ratio of their medians)."""
    if len(a) < 3:
        return f"{what}: too few runs for an interval"
    ratio, low, high = stats.bootstrap(stats.ratio_of_medians, b, a, paired=paired)
    return f"{what}: {ratio:.3f}x on the medians (90% interval {low:.3f}x .. {high:.3f}x; n = {len(b)})"


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.3f}" if abs(ms) < 10 else f"{ms:.2f}" if abs(ms) < 100 else f"{ms:.1f}"


def paired(a: list, b: list) -> str:
    """Median of the per-round differences B - A, and their 10th..90th percentiles."""
    d = [y - x for x, y in zip(a, b)]
    if len(d) < 2:
        return "-"
    q = statistics.quantiles(d, n=10, method="inclusive")
    return f"{fmt_ms(statistics.median(d))} [{fmt_ms(q[0])}..{fmt_ms(q[-1])}]"


def table(rows: list) -> str:
    head = ("measurement", "A", "B", "runs", "A med ms", "A min ms", "B med ms", "B min ms",
            "B-A med ms", "B/A med", "paired B-A ms: med [10%..90%]")
    lines = []
    for what, a_name, b_name, a, b in rows:
        a_med = statistics.median(a) if a else None
        b_med = statistics.median(b)
        lines.append((
            what, a_name, b_name, str(len(b)),
            fmt_ms(a_med), fmt_ms(min(a) if a else None), fmt_ms(b_med), fmt_ms(min(b)),
            fmt_ms(b_med - a_med) if a else "-",
            f"{b_med / a_med:.2f}x" if a else "-",
            paired(a, b) if a else "-",
        ))
    widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
    left = 3  # text columns
    out = []
    for r in [head] + lines:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)
