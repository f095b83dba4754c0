"""The trace hub's browser view (runtime/trace/view/), in a real headless Chromium.

The hub is the one the real tiny Megatron training serves (examples/train_moe.py under
SOURCE_PATCH=megatron_cpu,trace); Selenium drives the page like a user: it connects,
subscribes through the form, and the test checks what the canvases drew. Frame
decoding is checked against the Python encoder (runtime/trace/frame.py).

Needs Debian's chromium and chromedriver (apt-get install -y chromium chromium-driver)
and selenium (the `test` extra). To refresh the screenshot in the docs:

    SP_UPDATE_SCREENSHOT=1 .venv/bin/python -m pytest tests/test_trace_view.py
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from source_patch.runtime.core.endpoint import free_port

REPO = Path(__file__).resolve().parents[1]
VIEW = REPO / "runtime" / "trace" / "view"
SCREENSHOT = REPO / "docs" / "trace_view.png"
SENTINELS_SCREENSHOT = REPO / "docs" / "trace_sentinels.png"
LAYERS = 4
INSTALL = ("the browser-view test needs Debian's chromium and chromedriver, and selenium: "
           "apt-get install -y chromium chromium-driver && pip install -e '.[test]'")
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,960", "--force-device-scale-factor=1", "--hide-scrollbars")


def _executable(*names: str) -> str | None:
    return next(filter(None, map(shutil.which, names)), None)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = _executable("chromium", "chromium-browser")
    driver_path = _executable("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: {INSTALL}")
    if not (chromium and driver_path):
        pytest.fail(f"chromium or chromedriver not found on PATH: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status


def wait_for_hub(proc, url: str, log, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"exited with {proc.returncode} before its hub answered:\n{log.read()}")
        try:
            if _get(url) == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"no trace hub at {url} after {timeout} s; its output:\n{log.read()[-3000:]}")
        time.sleep(0.3)


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The Megatron example training under megatron_cpu,trace with the hub on a free
    port; long enough to outlive the tests, killed at the end. Yields (url, token)."""
    tmp = tmp_path_factory.mktemp("trainer")
    port, token = free_port(), "view-test-token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_TRACE")}
    env.update(SOURCE_PATCH="megatron_cpu,trace", SOURCE_PATCH_CACHE=str(tmp / "cache"),
               SOURCE_PATCH_TRACE_ENABLE="1", SOURCE_PATCH_TRACE_PORT=str(port),
               SOURCE_PATCH_TRACE_TOKEN=token)
    log = open(tmp / "train.log", "w+")
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "train_moe.py"), "--steps", "1000000",
                             "--layers", str(LAYERS)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for_hub(proc, url, log)
        yield url, token
    finally:
        stop(proc)
        log.close()


def wait_for(driver, script: str, what: str, timeout: float = 60):
    """Poll a JS expression until it is truthy; fail with the page's state if it never is."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return ({script});")
        if value:
            return value
        if time.monotonic() > deadline:
            state = driver.execute_script(
                "const v = window.spView || {}; return {state: v.state, lastError: v.lastError,"
                " framesReceived: v.framesReceived, framesDrawn: v.framesDrawn};")
            pytest.fail(f"timed out waiting for {what} ({script}); page: {state}")
        time.sleep(0.1)


def open_page(driver, url: str) -> None:
    driver.get("about:blank")  # a new document even when only the #fragment differs
    driver.get(url)  # may return before the new document's scripts ran
    deadline = time.monotonic() + 20
    while not driver.execute_script("return document.URL === arguments[0] && Boolean(window.spView)", url):
        if time.monotonic() > deadline:
            pytest.fail(f"view.js did not run at {url}; console: {driver.get_log('browser')}")
        time.sleep(0.05)


def fill(form, name: str, value: str) -> None:
    field = form.find_element("name", name)
    field.clear()
    field.send_keys(value)


def choose(form, name: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(form.find_element("name", name)).select_by_value(value)


def subscribe(driver, names: str, kind: str, layers: str = "", **params: str) -> None:
    form = driver.find_element("id", "subscribe")
    fill(form, "names", names)
    fill(form, "layers", layers)
    choose(form, "kind", kind)
    for param, value in params.items():
        fill(form, f"p:{param}", value)
    form.find_element("name", "apply").click()


# Per row band of a heatmap's plot area: the share of opaque pixels and the number of
# distinct colours (the band edges are left out: scaling may blend them).
ROW_PIXELS = """
const canvas = arguments[0], rows = Number(canvas.dataset.rows);
const [x, y, w, h] = canvas.dataset.plot.split(",").map(Number);
const pixels = canvas.getContext("2d").getImageData(x, y, w, h).data;
return Array.from({length: rows}, (_, r) => {
  let opaque = 0, total = 0;
  const colors = new Set();
  for (let yy = Math.floor(r * h / rows) + 1; yy < Math.floor((r + 1) * h / rows) - 1; yy++) {
    for (let xx = 0; xx < w; xx++) {
      const i = 4 * (yy * w + xx);
      total++;
      if (pixels[i + 3] === 255) opaque++;
      colors.add((pixels[i] << 16) | (pixels[i + 1] << 8) | pixels[i + 2]);
    }
  }
  return {opaque: opaque / total, colors: colors.size};
});
"""


def test_the_page_decodes_frames_as_the_python_encoder_writes_them(browser):
    """Every dtype, an odd metadata length (padding), the truncated flag, int64 beyond
    2**32, and bad frames rejected with a message (page opened from disk: no token,
    so it connects nowhere)."""
    from source_patch.runtime.trace import frame as trace_frame

    open_page(browser, (VIEW / "index.html").as_uri())
    wait_for(browser, "window.spView && window.spView.state === 'no-token'", "the page")
    rng = np.random.default_rng(0)
    cases = [
        (rng.standard_normal((3, 5)).astype(np.float32), {"sub": "s1", "name": "a", "layer": 2}, 0),
        (rng.standard_normal((2, 4)), {"sub": "s1", "name": "topk", "x": "odd!"}, 0),
        (np.array([-(2**40), 7, 2**50], dtype=np.int64), {"sub": "s2", "name": "ids"}, 0),
        (np.arange(-6, 6, dtype=np.int32).reshape(2, 2, 3), {"sub": "s3", "name": "i32", "layer": None}, 1),
        (np.arange(250, 256, dtype=np.uint8), {"sub": "s3", "name": "u8"}, 0),
        (np.array([0.5, -2.0, 65504.0, 6e-8, np.inf], dtype=np.float16), {"sub": "s4", "name": "half"}, 0),
        (np.float32(3.5).reshape(()), {"sub": "s5", "name": "scalar"}, 0),
    ]
    for seq, (array, meta, flags) in enumerate(cases):
        frame = trace_frame.encode(array, meta, seq=seq + 7, step=seq - 1, time=1.7e9 + seq, flags=flags)
        got = browser.execute_script(
            "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
            "const f = window.spView.decodeFrame(bytes.buffer);"
            "return {seq: f.seq, step: f.step, time: f.time, shape: f.shape, meta: f.meta,"
            " truncated: f.truncated, data: Array.from(f.data, v => Number.isFinite(v) ? v : String(v))};",
            base64.b64encode(frame).decode())
        assert (got["seq"], got["step"], got["time"]) == (seq + 7, seq - 1, 1.7e9 + seq)
        assert got["shape"] == list(array.shape) and got["meta"] == meta
        assert got["truncated"] == bool(flags)
        expected = [float(v) if np.isfinite(v) else str(float(v)).replace("inf", "Infinity")
                    for v in array.reshape(-1)]
        assert got["data"] == expected, meta["name"]
    # protocol v2: one message, several frames (each starting 8-byte aligned)
    frames = [trace_frame.encode(a, m, seq=i, step=i) for i, (a, m, _) in enumerate(cases)]
    got = browser.execute_script(
        "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
        "return window.spView.decodeMessage(bytes.buffer).map(f => ({seq: f.seq, meta: f.meta, n: f.data.length}));",
        base64.b64encode(trace_frame.join(frames)).decode())
    assert got == [{"seq": i, "meta": m, "n": a.size} for i, (a, m, _) in enumerate(cases)]
    good = trace_frame.encode(np.zeros(4, np.float32), {"sub": "s1"})
    for bad, message in ((good[:20], "shorter than its header"), (b"XXXX" + good[4:], "bad magic"),
                         (good[:-4], "too short for shape"), (good[:5] + b"\x09" + good[6:], "unknown dtype")):
        error = browser.execute_script(
            "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
            "try { window.spView.decodeFrame(bytes.buffer); return null; } catch (e) { return e.message; }",
            base64.b64encode(bad).decode())
        assert error and message in error


# A hub alone, in a process of its own, tracing a real tensor (the runtime's API, no spec).
SMALL_HUB = """
import importlib, sys, time, torch
trace = importlib.import_module("source_patch.runtime.trace")
trace.configure(enable=True, port=int(sys.argv[1]), token=sys.argv[2])
hidden = torch.randn(16, 32)
while True:
    for layer in (1, 2):
        trace.trace("hidden", hidden * layer, layer=layer)
    trace.trace_step()
    time.sleep(0.02)
"""


def test_the_page_reconnects_and_subscribes_again_when_the_hub_comes_back(browser, tmp_path):
    port, token = free_port(), "reconnect-token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    log = open(tmp_path / "hub.log", "w+")
    url = f"http://127.0.0.1:{port}/"

    def start():
        proc = subprocess.Popen([sys.executable, "-c", SMALL_HUB, str(port), token], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_hub(proc, url, log, timeout=60)
        except BaseException:
            stop(proc)
            raise
        return proc

    hub = start()
    try:
        open_page(browser, f"{url}#token={token}")
        wait_for(browser, "spView.state === 'open'", "the connection")
        subscribe(browser, "hid*", "tiles", tiles="8")
        wait_for(browser, "spView.framesDrawn >= 4", "frames")
        stop(hub)
        # (one check: the page goes back to 'connecting' at each retry)
        wait_for(browser, "spView.state === 'closed' && document.querySelector('#where').textContent"
                 ".includes('retrying in')", "the page to notice and plan a retry")
        before = browser.execute_script("return spView.framesReceived")
        hub = start()
        wait_for(browser, "spView.state === 'open' && spView.reconnects >= 1", "the reconnection", timeout=30)
        wait_for(browser, f"spView.framesReceived > {before + 4}", "frames of the subscription sent again")
        view = browser.execute_script("return spView")
        assert view["subscriptions"]["s1"]["active"]["compressor"]["tiles"] == 8
        assert view["lastError"] is None, view["errors"]
        heatmap = browser.find_element("css selector", "section.panel[data-sub='s1'] canvas.heatmap")
        assert heatmap.get_attribute("data-rows") == "2" and heatmap.get_attribute("data-cols") == "8"

        # a projection on a vector from a safetensors file typed into the form: [16, 32] -> [16]
        import torch
        from safetensors.torch import save_file

        save_file({"direction": torch.randn(32)}, tmp_path / "direction.safetensors")
        subscribe(browser, "hidden", "projection", layers="2", file=str(tmp_path / "direction.safetensors"))
        cell = "section.panel[data-sub='s2'][data-kind='projection'] .cell-box[data-layer='2'] canvas"
        wait_for(browser, f"document.querySelector(\"{cell}\")?.dataset.points === '16'", "the projection")
        assert browser.execute_script("return spView.subscriptions.s2.active.compressor.file").endswith(
            "direction.safetensors")
    finally:
        stop(hub)
        log.close()


def test_the_page_connects_subscribes_and_draws_the_training(browser, trainer, tmp_path):
    url, token = trainer
    open_page(browser, f"{url}#token={token}")
    wait_for(browser, "spView.state === 'open'", "the connection")
    assert browser.find_element("id", "state").text == "open"
    wait_for(browser, "document.querySelector('#names li[data-name=\"layer_output\"]')", "the name list")

    # tiles: a heatmap with one row per layer, and a time series per layer
    subscribe(browser, "layer_output", "tiles")
    panel = "section.panel[data-sub='s1'][data-name='layer_output']"
    wait_for(browser, f"document.querySelector(\"{panel}\")?.dataset.layers === '{LAYERS}'", "every layer")
    wait_for(browser, f"document.querySelector(\"{panel} canvas.series\").dataset.points >= {3 * LAYERS}",
             "three steps of each layer")
    view = browser.execute_script("return spView")
    assert view["framesDrawn"] >= 3 * LAYERS and view["framesReceived"] >= view["framesDrawn"]
    assert view["subscriptions"]["s1"]["active"]["compressor"]["kind"] == "tiles"
    heatmap = browser.find_element("css selector", f"{panel} canvas.heatmap")
    assert heatmap.get_attribute("data-rows") == str(LAYERS)
    assert heatmap.get_attribute("data-cols") == "64"  # hidden 64, 64 tiles of one column
    rows = browser.execute_script(ROW_PIXELS, heatmap)
    assert len(rows) == LAYERS
    assert all(row["opaque"] == 1 for row in rows), rows  # every cell painted
    assert all(row["colors"] >= 2 for row in rows), rows  # and not one flat colour
    series = browser.find_element("css selector", f"{panel} canvas.series")
    assert series.get_attribute("data-series") == str(LAYERS)

    # histogram on two layers, then changed to topk at run time
    subscribe(browser, "layer_output", "histogram", layers="1-2", bins="32")
    hist = "section.panel[data-sub='s2'][data-kind='histogram']"
    wait_for(browser, f"document.querySelectorAll(\"{hist} canvas[data-bins='32']\").length === 2",
             "two histograms")
    wait_for(browser, "spView.stats.frames_sent > 0", "the hub's counters")  # polled every 2 s
    wait_for(browser, f"document.querySelector(\"{panel} canvas.series\").dataset.points >= {20 * LAYERS}",
             "a longer time series, for the screenshot")
    shot = tmp_path / "trace_view.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    browser.find_element("css selector", "#subs li[data-sub='s2'] button[name='edit']").click()
    form = browser.find_element("id", "subscribe")
    assert form.find_element("name", "apply").text == "Update s2"
    assert form.find_element("name", "layers").get_attribute("value")  # the form shows s2 as it runs
    choose(form, "kind", "topk")
    fill(form, "p:k", "5")
    form.find_element("name", "apply").click()
    topk = "section.panel[data-sub='s2'][data-kind='topk']"
    wait_for(browser, f"document.querySelector(\"{topk} canvas[data-k='5']\")", "the top-5 list")
    assert not browser.find_elements("css selector", hist)
    browser.find_element("css selector", "#subs li[data-sub='s2'] button[name='remove']").click()
    wait_for(browser, "!spView.subscriptions.s2 && !document.querySelector(\"section.panel[data-sub='s2']\")",
             "s2 removed")

    view = browser.execute_script("return spView")
    assert view["lastError"] is None and view["badFrames"] == 0, view["errors"]
    assert "frames sent" in browser.find_element("id", "stats").text  # the hub's counters, in the header

    # A bad parameter: the hub's error is shown, the connection stays open.
    subscribe(browser, "layer_output", "tiles", tiles="0")
    error = wait_for(browser, "spView.lastError", "the hub's error")
    assert "tiles" in error and browser.find_element("id", "errors").is_displayed()
    assert "tiles" in browser.find_element("id", "errors").text
    assert browser.execute_script("return spView.state") == "open"
    assert "s2" not in browser.execute_script("return spView.subscriptions")

    if os.environ.get("SP_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)


def test_a_wrong_token_shows_unauthorized_and_does_not_retry(browser, trainer):
    url, _ = trainer
    open_page(browser, f"{url}#token=wrong")
    wait_for(browser, "spView.state === 'unauthorized'", "the rejection")
    assert browser.find_element("id", "state").text == "unauthorized"
    assert "unauthorized" in browser.find_element("id", "errors").text
    time.sleep(1.5)  # the backoff would have retried by now
    assert browser.execute_script("return spView.reconnects") == 0
    assert browser.execute_script("return spView.framesReceived") == 0


# A traced process whose sentinels write their per-step lines (runtime/sentinels/events.py,
# as the watches call it) once a client follows them: STEPS steps, then it only traces.
SENTINEL_HUB = """
import importlib, math, random, sys, time, torch
trace = importlib.import_module("source_patch.runtime.trace")
from source_patch.runtime.trace import api
from source_patch.runtime.sentinels import events
trace.configure(enable=True, port=int(sys.argv[1]), token=sys.argv[2])
hostile, steps = sys.argv[3], int(sys.argv[4])
random.seed(0)
hidden = torch.randn(16, 64)
while not api.following():
    time.sleep(0.05)
for step in range(steps):
    for layer in (1, 2):
        trace.trace("hidden", hidden * (1 + 0.01 * step) * layer, layer=layer)
    spike = 4.0 if step == 25 else 1.0
    events.metric("mismatch", step=step, samples=64, tokens=8192, threshold=0.6931,
                  max_abs_diff_max=spike * (0.12 + 0.03 * math.sin(step / 3) + 0.01 * random.random()),
                  max_abs_diff_mean=0.01 + 0.002 * random.random(), k3_mean=spike * 1e-4 * (1.5 + math.sin(step / 5)),
                  k3_max=float("nan"), over_threshold=int(step == 25), triggers=int(step == 25))
    for layer in range(1, 5):
        events.metric("routing_health", step=step, layer=layer, tokens=4096, topk=2,
                      per_expert=[512] * 8, dead=[], imbalance=1.1 + 0.08 * layer + 0.05 * random.random(),
                      entropy=2.0 - 0.004 * step * layer / 4, agreement=0.99 - 0.01 * layer * random.random())
    if step == 12:
        events.event("nonfinite", step=step, microbatch=1, phase="backward", layer=2, name="mlp_output",
                     site="mlp_output@2", nonfinite_sites=3, first_of_run=True)
    if step == 25:
        events.event("mismatch_trigger", step=step, where="request req-25-3", request_id="req-25-3", tokens=212,
                     max_abs_diff=1.9, k3=0.08, capture=True)
    if hostile:
        events.event("nonfinite", step=step, layer=hostile, name=hostile, site=hostile)
        events.metric(hostile, step=step, **{hostile: 1.0})
    trace.trace_step()
    time.sleep(0.03)
print("sentinel steps written", flush=True)
while True:
    for layer in (1, 2):
        trace.trace("hidden", hidden * layer, layer=layer)
    trace.trace_step()
    time.sleep(0.05)
"""

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def sentinel_hub(tmp_path, hostile: str, steps: int):
    port, token = free_port(), "sentinel-token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    log = open(tmp_path / "sentinels.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", SENTINEL_HUB, str(port), token, hostile, str(steps)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for_hub(proc, url, log, timeout=60)
    except BaseException:
        stop(proc)
        log.close()
        raise
    return proc, log, f"{url}#token={token}"


def test_the_page_draws_the_sentinels_metrics_as_time_series(browser, tmp_path):
    """The page follows the records on connecting; the process writes 40 steps of a
    mismatch line and a routing_health line per layer (4), and two events: one chart per
    (kind, figure), a line per layer, every step a point, the events listed and marked."""
    steps = 40
    proc, log, url = sentinel_hub(tmp_path, "", steps)
    try:
        open_page(browser, url)
        wait_for(browser, "spView.state === 'open'", "the connection")
        chart = "#metrics canvas[data-kind='{}'][data-figure='{}']"
        k3, imbalance = chart.format("mismatch", "k3_mean"), chart.format("routing_health", "imbalance")
        wait_for(browser, f"document.querySelector(\"{k3}\")?.dataset.points === '{steps}'", "40 steps of k3_mean")
        wait_for(browser, f"document.querySelector(\"{imbalance}\")?.dataset.points === '{4 * steps}'",
                 "40 steps of imbalance in each of 4 layers")
        assert browser.find_element("css selector", imbalance).get_attribute("data-series") == "4"
        assert browser.find_element("css selector", k3).get_attribute("data-series") == "1"
        assert browser.find_element("css selector", k3).get_attribute("data-marks") == "2"  # both events' steps
        # key figures first (mismatch's, then routing_health's); the rest under "more figures"
        figures = browser.execute_script(
            "return [...document.querySelectorAll('#metrics .metric')].map(n => n.dataset.kind + ':' + n.dataset.figure)")
        assert figures[:4] == ["mismatch:max_abs_diff_max", "mismatch:k3_mean", "mismatch:max_abs_diff_mean",
                               "mismatch:over_threshold"], figures
        assert "routing_health:entropy" in figures and "routing_health:agreement" in figures
        assert "mismatch:k3_max" not in figures  # null every step: no series
        assert browser.execute_script("return document.querySelectorAll('#metrics-more .metric').length") >= 2
        items = browser.find_elements("css selector", "#sentinel-events li")
        assert [i.get_attribute("data-kind") for i in items] == ["mismatch_trigger", "nonfinite"]  # latest first
        assert items[1].text.startswith("nonfinite at step 12, layer 2 mlp_output")
        view = browser.execute_script("return spView")
        assert view["recordsReceived"] == steps * 5 + 2 and view["recordGaps"] == 0
        assert view["lastError"] is None and view["badFrames"] == 0, view["errors"]

        subscribe(browser, "hidden", "tiles", tiles="16")  # with a trace panel beside, for the screenshot
        wait_for(browser, "document.querySelector(\"section.panel[data-sub='s1'] canvas.series\")"
                 "?.dataset.points >= 20", "the trace panel")
        shot = tmp_path / "trace_sentinels.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("SP_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, SENTINELS_SCREENSHOT)

        # Reloaded, the page gets the hub's backlog (the process writes no more lines): the same series.
        open_page(browser, url)
        wait_for(browser, f"document.querySelector(\"{imbalance}\")?.dataset.points === '{4 * steps}'",
                 "the backlog after a reload")
    finally:
        stop(proc)
        log.close()


def test_the_page_escapes_every_string_of_a_record(browser, tmp_path):
    proc, log, url = sentinel_hub(tmp_path, HOSTILE, 3)
    try:
        open_page(browser, url)
        wait_for(browser, "spView.sentinelEvents.length === 3 && document.querySelectorAll('#sentinel-events li')"
                 ".length === 3", "the hostile events")
        hostile_chart = "#metrics .metric canvas"
        wait_for(browser, f"[...document.querySelectorAll('{hostile_chart}')].some(c => c.dataset.kind === "
                          f"{HOSTILE!r} && c.dataset.points === '3')", "the hostile series")
        assert browser.execute_script("return window.__pwned") is None
        assert browser.execute_script("return document.querySelectorAll('#sentinels img, #sentinels script').length") == 0
        texts = [li.text for li in browser.find_elements("css selector", "#sentinel-events li")]
        assert all(HOSTILE in text for text in texts), texts  # shown as text, literally
        assert HOSTILE in browser.find_element("id", "metrics").text
    finally:
        stop(proc)
        log.close()
