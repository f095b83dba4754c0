"""The per-token view of `source-patch compare --html`, from a real comparison, as a
screenshot in headless Chromium (docs/compare_tokens.png).

    .venv/bin/python tests/e2e/compare_screenshot.py [OUT_DIR] [--png docs/compare_tokens.png]

Writes two dump runs the way the dump runtime writes them (one safetensors file and its
manifest, as tests/test_hardening_dump.py does): one forward pass of four requests of
16..22 tokens, four layers of ``layer_input`` / ``attention_output`` / ``mlp_output`` and
``final_hidden``; the rollout's 0-based layer ids, the training side's 1-based layer
numbers.  Both sides hold the same numbers up to float32-sized noise, except that the
rollout's ``attention_output`` of layer 2 is perturbed at a few tokens, the perturbation
carried (decaying) to the later positions of the same request, as attention would, and
into every later layer.  Then it runs the comparator (``compare.compare``) on the two
folders, writes its JSON and HTML report into OUT_DIR (default: a temporary folder) and
a screenshot of the page's per-token section (``<section id='tokens'>``).

Needs Debian's chromium and chromedriver and selenium (as tests/test_trace_view.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from source_patch.runtime.dump import files
from source_patch.runtime.verdict import compare, compare_html

HIDDEN, LAYERS, VOCAB = 64, 4, 32000
# request id -> (prompt length, response length)
REQUESTS = {"req-7f3a": (12, 10), "req-02c1": (8, 10), "req-9d44": (10, 10), "req-5e10": (6, 10)}
# (request, position) -> relative L2 injected into the rollout's attention_output of layer 2
PERTURBED = {("req-02c1", 9): 5e-3, ("req-02c1", 14): 8e-4, ("req-5e10", 11): 4e-4, ("req-7f3a", 3): 3e-5}
DECAY = 0.55  # the perturbation's share at each later position of the same request
NOISE = 2e-7  # float32-sized differences everywhere
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1000,1400", "--force-device-scale-factor=1", "--hide-scrollbars")


def rows_of():
    """(request, position) of every row of the pass, and the rows' token ids."""
    g = torch.Generator().manual_seed(1)
    keys = [(rid, p) for rid, (prompt, response) in REQUESTS.items() for p in range(prompt + response)]
    return keys, torch.randint(0, VOCAB, (len(keys),), generator=g)


def perturbation(keys) -> torch.Tensor:
    """Per row, the relative L2 to inject at attention_output layer 2 (0 for most)."""
    out = torch.zeros(len(keys), dtype=torch.float64)
    for (rid, pos), size in PERTURBED.items():
        for i, (r, p) in enumerate(keys):
            if r == rid and p >= pos:
                out[i] = max(float(out[i]), size * DECAY ** (p - pos))
    return out


def tensors(keys):
    """{(name, layer): (rollout rows, training rows)}: the reference, and the rollout's copy."""
    g = torch.Generator().manual_seed(2)
    inject = perturbation(keys)
    carried = torch.zeros(len(keys), dtype=torch.float64)
    out = {}
    for layer in range(LAYERS):
        for name in ("layer_input", "attention_output", "mlp_output"):
            if (name, layer) == ("attention_output", 2):
                carried = inject
            elif carried.any():
                carried = carried * 1.3  # grows a little through the later layers
            out[(name, layer)] = _pair(g, carried)
    out[("final_hidden", None)] = _pair(g, carried * 1.3)
    return out


def _pair(g, relative):
    ref = torch.randn(len(relative), HIDDEN, generator=g)
    direction = torch.randn(ref.shape, generator=g)
    direction = direction / direction.norm(dim=1, keepdim=True) * ref.norm(dim=1, keepdim=True)
    noise = torch.randn(ref.shape, generator=g) * NOISE * ref.abs().mean()
    return (ref + direction * relative[:, None].float() + noise).float(), ref


def write_dump(folder: Path, records) -> Path:
    """``records`` ([name, tags, tensor]) as one rank folder of one run (files.write_safetensors
    and its manifest lines)."""
    rank_dir = folder / "rank-0"
    rank_dir.mkdir(parents=True)
    entries = [(f"{seq:08d}:{name}", tensor.contiguous()) for seq, (name, _, tensor) in enumerate(records)]
    files.write_safetensors(rank_dir / "f.safetensors", entries, {"format": "pt"})
    lines = [{"seq": seq, "name": name, "tags": tags, "file": "f.safetensors", "key": key,
              "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
              "bytes": tensor.numel() * tensor.element_size(), "session": "s"}
             for seq, ((name, tags, tensor), (key, _)) in enumerate(zip(records, entries))]
    (rank_dir / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def write_runs(out: Path):
    keys, ids = rows_of()
    rids = list(REQUESTS)
    row_request = torch.tensor([rids.index(r) for r, _ in keys], dtype=torch.int32)
    positions = torch.tensor([p for _, p in keys])
    pairs = tensors(keys)
    sides = {}
    for side, offset, pick in (("rollout", 0, 0), ("train", 1, 1)):
        recs = [["input_ids", {}, ids], ["positions", {}, positions], ["row_request", {"rids": rids}, row_request]]
        for (name, layer), pair in pairs.items():
            recs.append([name, {} if layer is None else {"layer": layer + offset}, pair[pick]])
        sides[side] = write_dump(out / side, [[n, {"step": 0, "rank": 0, **t}, x] for n, t, x in recs])
    return sides["rollout"], sides["train"]


def add_prompt_lengths(data: dict) -> None:
    """Not in the comparator's contract (it does not know the boundary): this script knows
    the prompts it wrote, and the renderer marks them where given."""
    for req in data["tokens"]["requests"]:
        req.setdefault("prompt_length", REQUESTS[req["request"]][0])


def screenshot(page: Path, png: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(page.resolve().as_uri())
        driver.find_element("css selector", "#tokens").screenshot(str(png))
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="folder for the dumps and reports (default: a temporary one)")
    p.add_argument("--png", help="write the screenshot of the per-token view here")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="compare-screenshot-"))
    out.mkdir(parents=True, exist_ok=True)
    rollout, train = write_runs(out)
    report = compare.compare(rollout, train)
    data = report.to_json()
    if not (isinstance(data.get("tokens"), dict) and all("worst" in r for r in data["rows"])):
        raise SystemExit("the comparator's report lacks its per-token keys (rows[].worst, tokens)")
    add_prompt_lengths(data)
    data["inputs"] = {"rollout dumps": str(rollout), "training dumps": str(train),
                      "made by": "tests/e2e/compare_screenshot.py (synthetic dumps; prompt lengths added by the script)"}
    (out / "report.json").write_text(json.dumps(compare.json_safe(data), indent=1))
    page = compare_html.write(data, out / "report.html")
    print(report.table())
    print(f"page {page}")
    if args.png:
        screenshot(page, Path(args.png))
        print(f"screenshot {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
