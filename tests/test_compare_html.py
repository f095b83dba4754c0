"""runtime/dump/compare_html.py: the comparator's report as a static HTML page."""

import math
import re
import xml.etree.ElementTree as ET

from source_patch.runtime.verdict import compare_html

HOSTILE = "<script>alert(1)</script>"


def report(routing=True):
    rows = []
    for layer in range(4):
        for name in ("layer_input", "mlp_output", HOSTILE):
            rel = 3e-4 if (name == "mlp_output" and layer == 2) else (0.0 if layer == 0 else 1e-7 * (layer + 1))
            rows.append({"name": name, "layer": layer, "rows": 10, "max_abs": rel, "rel_l2": rel,
                         "cosine": 1 - rel, "ok": rel <= 1e-4})
    rows.append({"name": "logits", "layer": None, "rows": 2, "max_abs": math.nan, "rel_l2": math.inf,
                 "cosine": math.nan, "ok": False})
    doc = {"requests": 2, "tokens": 10, "rtol": 1e-4, "first_divergent": ["mlp_output", 2], "rows": rows}
    if routing:
        doc["routing"] = {"per_layer": [{"layer": 0, "tokens": 10, "agreement": 1.0},
                                        {"layer": 1, "tokens": 10, "agreement": 0.75}],
                          "tokens_differing_any_layer": 0.25}
    return doc


def test_the_page_shows_the_verdict_the_curves_and_the_highlighted_rows():
    page = compare_html.render(report())
    assert "first divergent: mlp_output layer 2" in page
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 3  # rel L2, cosine, routing
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    assert svgs[0].count("<polyline") == 3 and "stroke-dasharray" in svgs[0]  # one per name + rtol
    assert "75.0%" in svgs[2] and "tokens routed differently in at least one layer: 25.00%" in page
    assert page.count("<tr class='bad'>") == 2  # mlp_output layer 2 and the non-finite logits row
    assert "exact zeros are drawn at 1e-12" in page


def test_strings_from_the_report_are_escaped():
    page = compare_html.render(report())
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_log_prob_figures_are_shown_when_present():
    doc = report()
    doc["logprobs"] = {"tokens": 6, "mean_abs_diff": 0.0, "max_abs_diff": 1e-7, "k3_kl": None,
                       "frac_over_ln2": 0.0, "tis_mean": 1.0, "tis_ess": 1.0, "line": "x"}
    page = compare_html.render(doc)
    assert "<td>max |dlogp|</td><td>1e-07</td>" in page and "<td>k3 KL(rollout || train)</td><td>n/a</td>" in page


def test_sections_without_data_are_left_out(tmp_path):
    path = compare_html.write(report(routing=False), tmp_path / "r.html")
    page = path.read_text()
    assert page.count("<svg") == 2 and "Routing agreement" not in page and "Next-token" not in page


def test_the_inputs_are_recorded_and_escaped():
    doc = report()
    doc["inputs"] = {"rollout dumps": "/r/rollout", "training dumps": "/t/replay-1", "checkpoint": HOSTILE,
                     "compare versions": "source-patch 0.1.0, torch 2.13.0", "compared at": "2026-11-25 10:00:00"}
    page = compare_html.render(doc)
    inputs = re.search(r"<h2>Inputs</h2><table class='inputs'>(.*?)</table>", page).group(1)
    assert "<tr><td>rollout dumps</td><td class='input'>/r/rollout</td></tr>" in inputs
    assert "<td>compare versions</td><td class='input'>source-patch 0.1.0, torch 2.13.0</td>" in inputs
    assert "&lt;script&gt;" in inputs and "<script" not in page
    assert "Inputs" not in compare_html.render(report())  # none given, none shown


def test_axis_labels_tell_neighbouring_ticks_apart():
    """Cosines of 1 - 1e-8 .. 1: each tick has a label of its own, and each axis its title."""
    rows = [{"name": "x", "layer": layer, "rows": 1, "max_abs": 0.0, "rel_l2": 1e-8 * layer,
             "cosine": 1 - 1e-8 * layer, "ok": True} for layer in range(4)]
    page = compare_html.render({"requests": 1, "tokens": 4, "rtol": 1e-4, "first_divergent": None, "rows": rows})
    relative, cosine = re.findall(r"<svg.*?</svg>", page, re.S)
    labels = re.findall(r"text-anchor='end'>([^<]+)</text>", cosine)
    assert len(labels) == 5 and len(set(labels)) == 5, labels
    assert labels[0].startswith("0.99999997") and labels[-1].startswith("1.00000000"), labels
    assert re.findall(r"text-anchor='end'>([^<]+)</text>", relative)[-1] == "1e-04"  # the rtol's decade
    assert "rotate(-90" in cosine and ">cosine</text>" in cosine and ">relative L2</text>" in relative
    assert "<td>0.99999997</td>" in page  # the table's cosines: 8 decimals, not 1


def test_log_prob_figures_are_formatted_not_raw_floats():
    doc = report()
    doc["logprobs"] = {"tokens": 28, "mean_abs_diff": 6.811857223510742e-08, "max_abs_diff": 4.76837158203125e-07,
                       "k3_kl": 1.6218839379329e-14, "frac_over_ln2": 0.0, "tis_mean": 1.0000000596046448,
                       "tis_ess": 0.9999999999999, "line": "x"}
    table = re.search(r"Next-token log-probs.*?</table>", compare_html.render(doc), re.S).group(0)
    cells = dict(re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td></tr>", table))
    assert cells == {"tokens": "28", "mean |dlogp|": "6.81e-08", "max |dlogp|": "4.77e-07",
                     "k3 KL(rollout || train)": "1.62e-14", "share with |dlogp| &gt; ln 2": "0.00%",
                     "truncated IS weight, mean": "1.0000", "truncated IS, ESS / n": "1.0000"}


# ------------------------------------------------------------------ where, percentiles, worst and per-token view
# Synthetic reports following the comparator's JSON contract (issue 53 item 4): per row
# "where", "percentiles", "worst"; top level "tokens" (an object) and "layer_numbering".

def token_report(requests=None, rtol=1e-4):
    doc = report()
    doc["tokens_paired"] = 10
    for r in doc["rows"]:
        r["where"] = {"request": "r0", "position": 3, "index": 17, "a": 1.25, "b": 1.0}
        r["percentiles"] = {"p50": 1e-7, "p90": 2e-6, "p99": 3.5e-5, "max": r["max_abs"]}
        r["worst"] = [{"request": "r1", "position": 4, "token": 99, "diff": 5e-3},
                      {"request": "r0", "position": 0, "token": 5, "diff": 2e-4}]
    doc["rtol"] = rtol
    doc["layer_numbering"] = "layers numbered from 0 as SGLang's layer_id"
    diffs = [0.0, 1e-6, 2e-5, 1e-4, 5e-4, 3e-3, 2e-2, 1.0]  # increasing with the position
    doc["tokens"] = {"name": "mlp_output", "layer": 2, "requests": requests if requests is not None else [
        {"request": "r1", "worst": 1.0, "tokens": [{"position": p, "token": 100 + p, "diff": d}
                                                  for p, d in enumerate(diffs)]},
        {"request": "r0", "worst": 2e-4, "tokens": [{"position": 1, "token": 7, "diff": 2e-4},
                                                    {"position": 0, "token": 5, "diff": 0.0}]}]}
    return doc


def token_view(page):
    return re.search(r"<section id='tokens'>.*?</section>", page, re.S).group(0)


def boxes(section):
    """(class, title, text) of every token box, request by request."""
    return [re.findall(r"<span class='(h\d+|hn)' title='([^']*)'>([^<]*)</span>", line)
            for line in re.findall(r"<div class='toks'>(.*?)</div>", section, re.S)]


def test_the_table_says_where_the_maximum_sits_and_the_percentiles():
    page = compare_html.render(token_report())
    table = re.search(r"<h2>All rows</h2>(.*?)</table>", page, re.S).group(1)
    assert "<p class='numbering'>layers numbered from 0 as SGLang&#x27;s layer_id</p>" in table
    assert "<th>max at: request &middot; position &middot; index</th>" in table
    assert "<td class='at' title='rollout 1.25, training 1'>r0 \u00b7 3 \u00b7 17</td>" in table
    assert "<td class='pct' title='max 0.0003'>1e-07 \u00b7 2e-06 \u00b7 3.5e-05</td>" in table
    assert "4 requests" not in page and "2 requests, 10 tokens paired" in page  # "tokens" is the view now


def test_the_worst_tokens_of_the_first_divergent_row():
    doc = token_report()
    divergent = next(r for r in doc["rows"] if r["name"] == "mlp_output" and r["layer"] == 2)
    divergent["worst"] = [{"request": HOSTILE, "position": 9, "token": None, "diff": 0.25}]
    page = compare_html.render(doc)
    section = re.search(r"<section id='worst'>(.*?)</section>", page, re.S).group(1)
    assert "Worst tokens: mlp_output layer 2 (the first divergent row)" in section
    assert re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td><td class='h(\d+)'>([^<]*)</td>",
                      section) == [("&lt;script&gt;alert(1)&lt;/script&gt;", "9", "-", "24", "0.25")]
    doc["first_divergent"] = None  # nothing diverges: the row of the largest relative L2 (the logits' inf is not)
    page = compare_html.render(doc)
    assert "Worst tokens: mlp_output layer 2 (the largest relative L2; nothing diverges)" in page


def test_the_per_token_view_shows_each_requests_tokens_in_position_order():
    section = token_view(compare_html.render(token_report()))
    assert "Per token: mlp_output layer 2" in section
    first, second = boxes(section)
    assert [text for _, _, text in first] == [str(100 + p) for p in range(8)]
    assert [text for _, _, text in second] == ["5", "7"]  # sorted by position
    assert first[4][1] == "position 4 \u00b7 token 104 \u00b7 rel L2 0.0005 (5\u00d7 rtol)"
    assert section.index("request r1") < section.index("request r0")  # the report's order: worst first
    ET.fromstring(section)  # well-formed


def test_token_colours_follow_the_diff_on_a_log_scale_around_rtol():
    page = compare_html.render(token_report())
    levels = [int(cls[1:]) for cls, _, _ in boxes(token_view(page))[0]]
    # 0, 1e-6 (rtol/100), 2e-5 (just above rtol/10), rtol, 5 rtol, 30 rtol, 200 rtol, 1e4 rtol
    assert levels == sorted(levels) and levels[0] == levels[1] == 0 and levels[2] > 0
    assert levels[3] == compare_html._LEVELS // 3 and levels[-2] == levels[-1] == compare_html._LEVELS
    css = dict(re.findall(r"\.(h\d+)\{background:#([0-9a-f]{6})\}", page))
    greens = [int(css[f"h{k}"][2:4], 16) for k in levels]
    assert greens == sorted(greens, reverse=True) and len(set(greens)) == len(set(levels))
    assert css["h0"] == "f0f0f0" and css[f"h{compare_html._LEVELS // 3}"] == "ffbf00"  # neutral, amber at rtol
    assert css[f"h{compare_html._LEVELS}"] == "d62728"  # red from 100x rtol
    legend = re.search(r"<p class='key'>(.*?)</p>", page).group(1)
    assert "below rtol/10 (1e-05)" in legend and "rtol (1e-04)" in legend and "100\u00d7 rtol" in legend
    # relative to the report's rtol: the same diff is colder under a larger rtol
    colder = [int(c[1:]) for c, _, _ in boxes(token_view(compare_html.render(token_report(rtol=1e-2))))[0]]
    assert all(c <= w for c, w in zip(colder, levels)) and colder[4] == 0


def test_nan_text_and_the_prompt_boundary():
    requests = [{"request": "r0", "worst": "NaN", "prompt_length": 2, "tokens": [
        {"position": 0, "token": 1, "text": "Hello", "diff": 0.0},
        {"position": 1, "token": 2, "text": "<b>\n", "diff": 1e-3},
        {"position": 2, "token": 3, "text": " world", "diff": "NaN"}]}]
    section = token_view(compare_html.render(token_report(requests)))
    [line] = boxes(section)
    assert [(cls, text) for cls, _, text in line] == [("h0", "Hello"), ("h16", "&lt;b&gt;\u21b5"), ("hn", " world")]
    assert "token 2 &#x27;&lt;b&gt;\\n&#x27;" in line[1][1]  # the text's repr in the tooltip, escaped
    toks = re.search(r"<div class='toks'>(.*?)</div>", section).group(1)
    spans = re.findall(r"<span class='([^']+)'", toks)
    assert spans == ["h0", "h16", "cut", "hn"] and "prompt length 2" in toks  # before the first response token
    assert "<b>" not in section and "\u00b7 prompt 2" in section


def test_a_hostile_request_id_is_escaped_everywhere():
    doc = token_report([{"request": HOSTILE, "worst": 1.0, "tokens": [{"position": 0, "token": 1, "diff": 1.0}]}])
    for r in doc["rows"]:
        r["where"]["request"] = HOSTILE
        r["worst"][0]["request"] = HOSTILE
    doc["tokens"]["name"] = HOSTILE
    page = compare_html.render(doc)
    assert "<script" not in page and page.count("&lt;script&gt;") > 3


def test_the_view_is_capped_and_says_what_it_left_out():
    many = [{"request": f"r{i}", "worst": 1.0 / (i + 1),
             "tokens": [{"position": p, "token": p, "diff": 1e-3} for p in range(600 if i == 0 else 3)]}
            for i in range(compare_html.MAX_REQUESTS + 36)]
    section = token_view(compare_html.render(token_report(many)))
    lines = boxes(section)
    assert len(lines) == compare_html.MAX_REQUESTS and len(lines[0]) == compare_html.MAX_TOKENS
    assert "\u2026 88 tokens left out (at most 512 a request)" in section
    assert "36 requests left out (the view shows at most 64, the worst first)" in section
    assert "request r63 " in section and "request r64 " not in section


def test_a_report_without_the_new_keys_renders_as_before():
    page = compare_html.render(report())
    assert "2 requests, 10 tokens paired" in page
    for absent in ("max at", "p50", "Worst tokens", "Per token", "class='numbering'", "class='h0'", ".h0{"):
        assert absent not in page, absent
    assert "<tr><th>name</th><th>layer</th><th>rows</th><th>max |a-b|</th><th>rel L2</th><th>cosine</th></tr>" in page
    # only some rows with the keys: the others say n/a
    doc = token_report()
    del doc["rows"][0]["where"], doc["rows"][0]["percentiles"]
    assert compare_html.render(doc).count("<td class='at'>n/a</td><td class='pct'>n/a</td>") == 1
