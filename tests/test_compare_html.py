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
