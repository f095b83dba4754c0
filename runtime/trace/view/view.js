// source-patch live trace view: talks trace protocol v2 to the hub that served this page
// (docs/trace_clients.md), decodes its binary frames and draws them on canvases. Plain ES2020.
"use strict";
(() => {
  const HISTORY = 500;                     // time-series points kept per layer
  const SERIES_HISTORY = 2000;             // points kept per sentinel metric series (kind, figure, layer)
  const MAX_EVENTS = 200;                  // sentinel events listed (the latest)
  const MAX_METRIC_CHARTS = 64;            // sentinel metric charts drawn at most
  const MAX_LINES = 64;                    // lines (layers) per metric chart
  // Fields of a metric line that say where and when (not charted), and the figures shown
  // first (the others under "more figures"); a numeric field of any other kind is charted too.
  const WHERE_KEYS = new Set(["kind", "time", "rank", "step", "layer"]);
  const KEY_FIGURES = {
    mismatch: ["max_abs_diff_max", "k3_mean", "max_abs_diff_mean", "k3_max", "frac_over_ln2_mean", "over_threshold"],
    routing_health: ["imbalance", "entropy", "agreement", "tokens"],
  };
  const POLL_MS = 2000;                    // refresh period of the name list and hub stats
  const MAX_CELLS = 32;                    // small multiples drawn per panel
  const STAT_KEYS = ["frames_sent", "dropped", "clients", "errors"];  // hub counters shown in the header
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f"];
  // dtype code -> typed array; float16 (5) is read as raw bits and converted.
  const DTYPES = [Float32Array, Float64Array, BigInt64Array, Int32Array, Uint8Array, Uint16Array];
  const HEADER = 40;
  const EMPTY = "Subscribe to a trace name to see it here.";

  const $ = (sel, root = document) => root.querySelector(sel);
  const el = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    node.append(...children);
    return node;
  };

  // What tests (and curious users, from the console) can read.
  const view = window.spView = {
    state: "idle", framesReceived: 0, framesDrawn: 0, draws: 0, gaps: 0, badFrames: 0,
    reconnects: 0, lastError: null, errors: [], subscriptions: {}, names: [], stats: {},
    welcome: null, step: null, decodeFrame, decodeMessage,
    recordsReceived: 0, recordGaps: 0, lastRecord: 0, sentinelEvents: [], metricCharts: 0,
  };
  let ws = null, backoff = 500, retryTimer = null, nextSeq = 0, timers = [], editing = null;
  let compressors = {};                    // kind -> {param: default}, from the hub's welcome
  const panels = new Map();                // "sub\0name" -> panel
  const dirty = new Set();
  // The sentinels' metric series: "kind\0figure" -> {kind, figure, lines: Map(layer -> [[step, value]])}
  const metrics = new Map();
  let sentinelsDirty = false, scheduled = false;

  // ------------------------------------------------------------------ frames

  /** The frame at byte `at` of a message (header table in docs/trace_clients.md) ->
   *  {seq, step, time, shape, meta, data, end}; `end`: the byte after its data. */
  function decodeFrame(buf, at = 0) {
    if (buf.byteLength - at < HEADER) throw new Error(`frame of ${buf.byteLength - at} bytes is shorter than its header`);
    const dv = new DataView(buf, at);
    const magic = String.fromCharCode(...new Uint8Array(buf, at, 4));
    if (magic !== "SPTF") throw new Error(`bad magic ${JSON.stringify(magic)}`);
    const version = dv.getUint8(4), code = dv.getUint8(5), ndim = dv.getUint8(6), flags = dv.getUint8(7);
    if (version !== 1) throw new Error(`frame version ${version}, this page reads 1`);
    if (!DTYPES[code]) throw new Error(`unknown dtype code ${code}`);
    const metaLen = dv.getUint32(8, true), metaAt = HEADER + 4 * ndim;
    const shape = Array.from({ length: ndim }, (_, i) => dv.getUint32(HEADER + 4 * i, true));
    const dataAt = Math.ceil((metaAt + metaLen) / 8) * 8;   // data starts 8-byte aligned
    const count = shape.reduce((a, b) => a * b, 1), Type = DTYPES[code];
    const end = at + dataAt + count * Type.BYTES_PER_ELEMENT;
    if (end > buf.byteLength) throw new Error(`frame of ${buf.byteLength - at} bytes is too short for shape [${shape}]`);
    const meta = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, at + metaAt, metaLen)));
    let data = new Type(buf, at + dataAt, count);            // frames start 8-byte aligned in a message
    if (code === 2) data = Float64Array.from(data, Number);
    if (code === 5) data = Float32Array.from(data, halfToFloat);
    return {
      seq: Number(dv.getBigUint64(16, true)), step: Number(dv.getBigInt64(24, true)),
      time: dv.getFloat64(32, true), truncated: Boolean(flags & 1), shape, meta, data, end,
    };
  }

  /** A binary message: one or more frames, each starting at a multiple of 8 bytes. */
  function decodeMessage(buf) {
    const frames = [];
    for (let at = 0; at < buf.byteLength; at = Math.ceil(frames[frames.length - 1].end / 8) * 8) {
      frames.push(decodeFrame(buf, at));
    }
    return frames;
  }

  function halfToFloat(h) {
    const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
    if (exp === 0) return sign * 2 ** -14 * (frac / 1024);
    if (exp === 31) return frac ? NaN : sign * Infinity;
    return sign * 2 ** (exp - 15) * (1 + frac / 1024);
  }

  function onMessage(buf) {
    let frames;
    try { frames = decodeMessage(buf); } catch (e) { view.badFrames++; return addError(`bad frame: ${e.message}`); }
    frames.forEach(onFrame);
  }

  function onFrame(frame) {
    view.framesReceived++;
    if (frame.seq > nextSeq) view.gaps += frame.seq - nextSeq;   // the hub dropped frames for us
    nextSeq = frame.seq + 1;
    const sub = view.subscriptions[frame.meta.sub];
    if (!sub || (sub.active && sub.active.compressor.kind !== frame.meta.kind)) return;  // gone or replaced
    panelFor(frame.meta).add(frame);
  }

  // ------------------------------------------------------------ sentinel records

  /** {op: "records", records: [{n, name, value}]}: the sentinels' metric lines and events. */
  function onRecords(records) {
    if (!Array.isArray(records)) return;
    for (const r of records) {
      if (!r || typeof r !== "object" || !Number.isFinite(r.n) || r.n <= view.lastRecord) continue;  // seen already
      if (view.lastRecord && r.n > view.lastRecord + 1) view.recordGaps += r.n - view.lastRecord - 1;  // dropped
      view.lastRecord = r.n;
      view.recordsReceived++;
      const value = r.value && typeof r.value === "object" ? r.value : {};
      if (r.name === "sentinels.metric") addMetric(value);
      else if (r.name === "sentinels.event") addEvent(value);
    }
    sentinelsDirty = true;
    schedule();
  }

  const stepOf = (value) => (typeof value.step === "number" && Number.isFinite(value.step) ? value.step : view.lastRecord);

  function addMetric(value) {
    const kind = String(value.kind ?? "?"), x = stepOf(value);
    const layer = value.layer === undefined || value.layer === null ? "-" : String(value.layer);
    for (const [figure, y] of Object.entries(value)) {
      if (WHERE_KEYS.has(figure) || typeof y !== "number" || !Number.isFinite(y)) continue;
      const key = `${kind}\0${figure}`;
      let chart = metrics.get(key);
      if (!chart) {
        if (metrics.size >= 4 * MAX_METRIC_CHARTS) continue;   // bounded: a stream of ever-new figures
        metrics.set(key, chart = { kind, figure, lines: new Map() });
      }
      let points = chart.lines.get(layer);
      if (!points) {
        if (chart.lines.size >= MAX_LINES) continue;
        chart.lines.set(layer, points = []);
      }
      if (points.length && points[points.length - 1][0] === x) points.pop();  // the same step again: the latest
      points.push([x, y]);
      if (points.length > SERIES_HISTORY) points.splice(0, points.length - SERIES_HISTORY);
    }
  }

  function addEvent(value) {
    view.sentinelEvents.push(value);
    if (view.sentinelEvents.length > MAX_EVENTS) view.sentinelEvents.shift();
  }

  /** "nonfinite at step 12, layer 2 mlp_output" and the other scalar fields, as text. */
  function describeEvent(value) {
    const head = `${value.kind ?? "event"} at step ${value.step ?? "?"}` +
      (value.layer !== undefined && value.layer !== null ? `, layer ${value.layer}` : "") +
      (typeof value.name === "string" ? ` ${value.name}` : "");
    const rest = Object.entries(value)
      .filter(([k, v]) => !["kind", "step", "layer", "name", "time"].includes(k) && v !== null && typeof v !== "object")
      .map(([k, v]) => `${k} ${typeof v === "number" ? fmt(v) : String(v)}`);
    return [head, rest.join(" · ").slice(0, 400)];
  }

  function keyFigure(chart) { return (KEY_FIGURES[chart.kind] || []).indexOf(chart.figure); }

  function drawSentinels() {
    const box = $("#sentinels");
    box.hidden = false;
    const charts = [...metrics.values()].sort((a, b) => {
      const ka = keyFigure(a), kb = keyFigure(b);
      if ((ka < 0) !== (kb < 0)) return ka < 0 ? 1 : -1;
      return a.kind.localeCompare(b.kind) || (ka - kb) || a.figure.localeCompare(b.figure);
    }).slice(0, MAX_METRIC_CHARTS);
    const main = charts.filter((c) => keyFigure(c) >= 0 || !KEY_FIGURES[c.kind]);
    const more = charts.filter((c) => !main.includes(c));
    placeCharts($("#metrics"), main);
    const details = $("#more-metrics");
    details.hidden = !more.length;
    $("summary", details).textContent = `more figures (${more.length})`;
    placeCharts($("#metrics-more"), more);
    view.metricCharts = charts.length;
    const events = view.sentinelEvents;
    $("#sentinel-events-box").hidden = !events.length;
    $("#sentinel-events").replaceChildren(...events.slice().reverse().map((value) => {
      const [head, rest] = describeEvent(value);
      return el("li", { "data-kind": String(value.kind ?? ""), "data-step": String(value.step ?? "") },
        el("b", { text: head }), el("span", { class: "detail", text: rest }));
    }));
    const marks = events.map((e) => e.step).filter((x) => typeof x === "number");
    $("#sentinels-title").textContent = `${view.recordsReceived} records · ${charts.length} figures · ` +
      `${events.length} events${view.recordGaps ? ` · ${view.recordGaps} dropped` : ""}`;
    for (const chart of charts) {
      if (!chart.node.isConnected || (more.includes(chart) && !details.open)) continue;
      const lines = [...chart.lines.entries()].sort(([a], [b]) => (a === "-" ? -1 : b === "-" ? 1 : Number(a) - Number(b)));
      const last = lines[0][1][lines[0][1].length - 1];
      chart.label.replaceChildren(el("b", { text: chart.figure }), ` · ${chart.kind} · step ${last[0]} · ${fmt(last[1])}` +
        (lines.length > 1 ? ` · ${lines.length} layers` : ""));
      drawLines(chart.canvas, lines.map(([layer, points], i) => ({
        label: layer === "-" ? chart.figure : `L${layer}`, color: PALETTE[i % PALETTE.length], points,
      })), { height: 130, marks });
    }
  }

  function placeCharts(grid, charts) {
    for (const chart of charts) {
      if (chart.node) continue;
      chart.label = el("div", { class: "cell-label" });
      chart.canvas = el("canvas", { class: "series", "data-kind": chart.kind, "data-figure": chart.figure });
      chart.node = el("div", { class: "cell-box metric", "data-kind": chart.kind, "data-figure": chart.figure },
        chart.label, chart.canvas);
    }
    const nodes = charts.map((c) => c.node);
    if (nodes.length !== grid.children.length || nodes.some((n, i) => grid.children[i] !== n)) grid.replaceChildren(...nodes);
  }

  // -------------------------------------------------------------- connection

  function connect() {
    clearTimeout(retryTimer);
    const token = new URLSearchParams(location.hash.slice(1)).get("token");
    if (!token) return setState("no-token", "no token: open the URL the trainer printed (http://HOST:PORT/#token=...)");
    setState("connecting", `connecting to ws://${location.host}/ws`);
    const sock = ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`);
    sock.binaryType = "arraybuffer";
    sock.onopen = () => sock.send(JSON.stringify({ op: "hello", token, client: "browser" }));
    sock.onmessage = (ev) => { if (sock === ws) (typeof ev.data === "string" ? onText : onMessage)(ev.data); };
    sock.onclose = (ev) => { if (sock === ws) onClose(ev); };
  }

  function disconnect() {
    const old = ws;
    ws = null;                               // its close event is then ignored
    timers.forEach(clearInterval);
    timers = [];
    if (old) old.close();
  }

  function onClose(ev) {
    disconnect();
    if (ev.code === 4401) {
      const message = "unauthorized: the hub rejected the token; open the URL the trainer printed";
      setState("unauthorized", message);
      return addError(message);
    }
    const wait = backoff;
    backoff = Math.min(backoff * 2, 10000);
    const why = ev.code === 1009 ? "message too big" : ev.reason || `code ${ev.code}`;
    setState("closed", `disconnected (${why}); retrying in ${(wait / 1000).toFixed(1)} s`);
    retryTimer = setTimeout(() => { view.reconnects++; connect(); }, wait);
  }

  function send(message) {
    if (ws && ws.readyState === WebSocket.OPEN && view.state === "open") ws.send(JSON.stringify(message));
  }

  function onText(text) {
    let msg;
    try { msg = JSON.parse(text); } catch (e) { return addError(`unreadable hub message: ${text.slice(0, 80)}`); }
    const sub = view.subscriptions[msg.id];
    switch (msg.op) {
      case "welcome": return onWelcome(msg);
      case "subscribed":
        if (!sub) return;
        Object.assign(sub, { active: msg.subscription, error: null });   // canonical: defaults filled
        clearPanels(msg.id);
        return renderSubs();
      case "unsubscribed": return forget(msg.id);
      case "names": view.names = msg.names || []; return renderNames();
      case "stats": view.stats = msg; return renderStats();
      case "records": return onRecords(msg.records);
      case "following":
        if (msg.last < view.lastRecord) {            // another process serves this hub now: its numbers start over
          view.lastRecord = 0;
          send({ op: "follow", names: ["sentinels.*"], since: 0 });
        }
        return undefined;
      case "unfollowed": return undefined;
      case "error": return onHubError(msg, sub);
      default: return addError(`unknown message op ${JSON.stringify(msg.op)} from the hub`);
    }
  }

  function onWelcome(msg) {
    view.welcome = msg;
    view.step = msg.step;
    backoff = 500;
    nextSeq = 0;
    compressors = msg.compressors || {};
    setState("open", "");
    if (msg.names) view.names = msg.names.map((n) => (typeof n === "string" ? { name: n } : n));
    fillKinds();
    renderNames();
    for (const sub of Object.values(view.subscriptions)) {       // after a reconnect
      send(sub.active ? { op: "subscribe", ...sub.active, id: sub.id } : sub.request);
    }
    // The sentinels' records: the hub's backlog past what this page has, then live.
    send({ op: "follow", names: ["sentinels.*"], since: view.lastRecord });
    const poll = () => { send({ op: "list" }); send({ op: "stats" }); };
    poll();
    timers.push(setInterval(poll, POLL_MS));
  }

  function onHubError(msg, sub) {
    addError(msg.id ? `${msg.id}: ${msg.error}` : msg.error);
    if (!sub) return;
    if (!sub.active) return forget(msg.id);    // never accepted
    sub.error = msg.error;                     // the previous version still runs
    renderSubs();
  }

  // ----------------------------------------------------------- subscriptions

  function subscribe(request) {
    const sub = view.subscriptions[request.id] || { id: request.id, active: null };
    view.subscriptions[request.id] = Object.assign(sub, { request, error: null });
    send(request);
    renderSubs();
  }

  function unsubscribe(id) {
    if (view.state === "open") send({ op: "unsubscribe", id });  // forgotten when the hub confirms
    else forget(id);
  }

  function forget(id) {
    delete view.subscriptions[id];
    clearPanels(id, true);
    renderSubs();
  }

  const freeId = () => { for (let i = 1; ; i++) if (!view.subscriptions[`s${i}`]) return `s${i}`; };

  function formRequest(form) {
    const names = form.names.value.split(",").map((s) => s.trim()).filter(Boolean);
    const layersText = form.layers.value.trim();
    const layers = !layersText ? null
      : /^\d+(\s*,\s*\d+)*$/.test(layersText) ? layersText.split(",").map(Number) : layersText;
    const kind = form.kind.value, compressor = { kind };
    for (const [param, fallback] of Object.entries(compressors[kind] || {})) {
      const input = form.elements[`p:${param}`];
      if (input.type === "checkbox") compressor[param] = input.checked;
      else if (input.value.trim() !== "") compressor[param] = parseParam(input.value.trim(), fallback);
    }
    return { op: "subscribe", id: editing || freeId(), names, layers, compressor, every: Number(form.every.value) || 1 };
  }

  // A parameter typed in the form, read after its default's type; the hub validates it.
  function parseParam(text, fallback) {
    if (typeof fallback === "number") return Number.isNaN(Number(text)) ? text : Number(text);
    if (typeof fallback === "string") return text;
    try { return JSON.parse(text); } catch (e) { /* a comma list, e.g. "mean, absmax" */ }
    const items = text.split(",").map((s) => (s.trim() !== "" && !Number.isNaN(Number(s)) ? Number(s) : s.trim()));
    return Array.isArray(fallback) || items.length > 1 ? items : items[0];   // a path stays a string
  }

  function showParam(value) {
    if (value === null || value === undefined) return "";
    return Array.isArray(value) ? value.join(", ") : typeof value === "object" ? JSON.stringify(value) : String(value);
  }

  function fillKinds(selected) {
    const select = $("#subscribe").kind, kind = selected || select.value || Object.keys(compressors)[0];
    select.replaceChildren(...Object.keys(compressors).map((k) => el("option", { value: k, text: k })));
    select.value = compressors[kind] ? kind : Object.keys(compressors)[0];
    fillParams();
  }

  function fillParams(values = {}) {
    const kind = $("#subscribe").kind.value;
    const fields = Object.entries(compressors[kind] || {}).map(([param, fallback]) => {
      const value = param in values ? values[param] : fallback;
      const input = typeof fallback === "boolean"
        ? el("input", { type: "checkbox", name: `p:${param}` })
        : el("input", { name: `p:${param}`, value: showParam(value), placeholder: fallback === null ? "none" : "" });
      if (input.type === "checkbox") input.checked = Boolean(value);
      return el("label", { class: input.type === "checkbox" ? "check" : "" }, param, " ", input);
    });
    $("#params").replaceChildren(el("legend", { text: `${kind} parameters` }), ...fields);
  }

  function editSubscription(id) {
    const form = $("#subscribe"), request = view.subscriptions[id].active || view.subscriptions[id].request;
    const { kind, ...params } = request.compressor;
    form.names.value = request.names.join(", ");
    form.layers.value = request.layers === null ? "" : showParam(request.layers);
    form.every.value = request.every;
    fillKinds(kind);
    fillParams(params);
    setEditing(id);
  }

  function setEditing(id) {
    $("#subscribe").apply.textContent = (editing = id) ? `Update ${id}` : "Subscribe";
    $("#editing").textContent = id ? `editing ${id}` : "";
  }

  // ------------------------------------------------------------------ panels

  function panelFor(meta) {
    const key = `${meta.sub}\0${meta.name}`;
    let panel = panels.get(key);
    if (!panel || panel.kind !== meta.kind) {
      if (panel) panel.el.remove();
      panel = makePanel(meta);
      panels.set(key, panel);
      const main = $("#panels");
      $(".empty", main)?.remove();
      main.append(...[...panels.values()].sort((a, b) => a.key.localeCompare(b.key)).map((p) => p.el));
    }
    return panel;
  }

  function clearPanels(id, remove = false) {
    for (const [key, p] of panels) {
      if (p.sub !== id) continue;
      p.el.remove();
      panels.delete(key);
      dirty.delete(p);
    }
    if (remove && !panels.size) $("#panels").replaceChildren(el("p", { class: "muted empty", text: EMPTY }));
  }

  function makePanel(meta) {
    const title = el("span", { class: "muted" }), body = el("div", { class: "body" });
    const node = el("section", { class: "panel", "data-sub": meta.sub, "data-name": meta.name, "data-kind": meta.kind },
      el("h3", {}, el("b", { text: meta.name }), " ", title), body);
    return {
      key: `${meta.sub}\0${meta.name}`, sub: meta.sub, name: meta.name, kind: meta.kind, el: node, body,
      layers: new Map(), cells: new Map(), frames: 0, pending: 0, stat: null, step: null,
      add(frame) {
        const layer = frame.meta.layer ?? "-";
        const entry = this.layers.get(layer) || { history: [] };
        this.layers.set(layer, Object.assign(entry, { latest: frame }));
        if (this.kind === "tiles") pushHistory(entry.history, frame);
        this.frames++;
        this.pending++;
        this.step = frame.step;
        markDirty(this);
      },
      setTitle() { title.textContent = `${this.sub} · ${this.kind} · step ${this.step}`; },
    };
  }

  // tiles: one point per step and layer: the mean over tiles of every stat.
  function pushHistory(history, frame) {
    const [nstats, n] = frame.shape;
    const sum = (s) => frame.data.subarray(s * n, (s + 1) * n).reduce((a, b) => a + b, 0);
    const means = Array.from({ length: nstats }, (_, s) => sum(s) / n);
    const x = frame.step >= 0 ? frame.step : frame.time;
    if (history.length && history[history.length - 1][0] === x) history.pop();  // microbatches of one step
    history.push([x, means]);
    if (history.length > HISTORY) history.shift();
  }

  function markDirty(panel) {
    dirty.add(panel);
    schedule();
  }

  function schedule() {
    if (!scheduled) { scheduled = true; requestAnimationFrame(drawDirty); }
  }

  function drawDirty() {
    scheduled = false;
    if (sentinelsDirty) { sentinelsDirty = false; drawSentinels(); }
    for (const p of dirty) {
      p.setTitle();
      (p.kind === "tiles" ? drawTilesPanel : drawCellsPanel)(p);
      Object.assign(p.el.dataset, { layers: p.layers.size, frames: p.frames, step: p.step });
      view.framesDrawn += p.pending;
      p.pending = 0;
      if (p.step > view.step) view.step = p.step;
    }
    renderWhere();
    renderStats();
    view.draws++;
    dirty.clear();
  }

  const sortedLayers = (p) => [...p.layers.keys()].sort((a, b) => (a === "-" ? -1 : b === "-" ? 1 : a - b));

  function drawTilesPanel(p) {
    const layers = sortedLayers(p), first = p.layers.get(layers[0]).latest;
    const stats = first.meta.params?.stats || compressors.tiles?.stats || [];
    if (!p.controls) {
      p.select = el("select", { title: "statistic", onchange: () => { p.stat = p.select.value; markDirty(p); } });
      [p.heat, p.series, p.caption] = [el("canvas", { class: "heatmap" }), el("canvas", { class: "series" }),
        el("p", { class: "caption" })];
      p.controls = el("div", { class: "controls" }, "stat ", p.select);
      p.body.append(p.controls, p.heat, p.caption, p.series);
    }
    if (p.select.options.length !== stats.length) {
      p.select.replaceChildren(...stats.map((s) => el("option", { value: s, text: s })));
      p.stat = stats.includes(p.stat) ? p.stat : stats.includes("absmax") ? "absmax" : stats[0];
    }
    p.select.value = p.stat;
    const s = Math.max(0, stats.indexOf(p.stat)), ntiles = first.shape[1];
    const rows = layers.map((layer) => {
      const f = p.layers.get(layer).latest;
      return f.shape[1] === ntiles ? f.data.subarray(s * ntiles, (s + 1) * ntiles) : new Float32Array(ntiles).fill(NaN);
    });
    const xLabel = `tile (${ntiles} along dim ${first.meta.params?.dim ?? -1})`;
    drawMatrix(p.heat, rows, ntiles, layers.map((l) => `L${l}`), { cellHeight: 22, xLabel });
    p.caption.textContent = `${p.stat} per tile, latest step of each layer; ` +
      `below: mean over tiles of ${p.stat} per layer, by step`;
    drawLines(p.series, layers.map((layer, i) => ({
      label: `L${layer}`, color: PALETTE[i % PALETTE.length],
      points: p.layers.get(layer).history.map(([x, means]) => [x, means[s]]),
    })));
  }

  // histogram / topk / projection / raw: one small chart per layer.
  function drawCellsPanel(p) {
    if (!p.grid) p.body.append(p.grid = el("div", { class: "cells" }));
    const layers = sortedLayers(p).slice(0, MAX_CELLS);
    for (const layer of layers) {
      if (p.cells.has(layer)) continue;
      const label = el("div", { class: "cell-label" }), canvas = el("canvas", { class: "cell" });
      p.cells.set(layer, { label, canvas, node: el("div", { class: "cell-box", "data-layer": layer }, label, canvas) });
    }
    p.grid.replaceChildren(...layers.map((layer) => p.cells.get(layer).node));  // before sizing canvases
    for (const layer of layers) {
      const { label, canvas } = p.cells.get(layer), f = p.layers.get(layer).latest;
      label.textContent = `layer ${layer} · step ${f.step} · [${f.shape}]${f.truncated ? " · truncated" : ""}`;
      if (p.kind === "histogram") drawHistogram(canvas, f);
      else if (p.kind === "topk") drawTopk(canvas, f);
      else if (f.shape.length < 2) {
        const points = Array.from(f.data, (v, i) => [i, v]);
        drawLines(canvas, [{ color: PALETTE[0], points }], { height: 150, xName: "index" });
      } else {
        const cols = f.shape[f.shape.length - 1], nrows = f.data.length / cols;
        const rows = Array.from({ length: nrows }, (_, r) => f.data.subarray(r * cols, (r + 1) * cols));
        drawMatrix(canvas, rows, cols, null, { cellHeight: Math.min(8, 256 / nrows), xLabel: `[${f.shape}]` });
      }
    }
  }

  // ----------------------------------------------------------------- drawing

  const FONT = "11px system-ui, -apple-system, 'Segoe UI', sans-serif";
  const INK = "#374151", GRID = "#e5e7eb";

  function setupCanvas(canvas, height) {
    const width = Math.max(240, canvas.parentElement.clientWidth - 2), dpr = window.devicePixelRatio || 1;
    Object.assign(canvas.style, { width: `${width}px`, height: `${height}px` });
    Object.assign(canvas, { width: Math.round(width * dpr), height: Math.round(height * dpr) });
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = FONT;
    return [ctx, width, dpr];
  }

  function text(ctx, string, x, y, align = "left", baseline = "middle") {
    Object.assign(ctx, { fillStyle: INK, textAlign: align, textBaseline: baseline });
    ctx.fillText(string, x, y);
  }

  function range(values) {
    let lo = Infinity, hi = -Infinity;
    for (const arr of values) for (const v of arr) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (lo > hi) return [0, 1];
    return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
  }

  const fmt = (v) => (v === 0 ? "0" : Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(2)
    : String(Number(v.toPrecision(3))));

  // Sequential (viridis-like) for one-signed data, blue-white-red around 0 for signed data.
  const SEQUENTIAL = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const DIVERGING = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];
  function colorAt(stops, t) {
    if (!Number.isFinite(t)) return [200, 200, 200];
    const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
    return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
  }
  function colorScale(lo, hi) {
    if (lo < 0 && hi > 0) { const m = Math.max(-lo, hi); return { stops: DIVERGING, lo: -m, hi: m }; }
    return { stops: SEQUENTIAL, lo, hi };
  }

  /** rows: equal-length arrays, drawn as a heatmap; rowLabels: one per row or null. */
  function drawMatrix(canvas, rows, ncols, rowLabels, { cellHeight, xLabel }) {
    const left = rowLabels ? 34 : 6, top = 4, plotH = rows.length * cellHeight;
    const [ctx, width, dpr] = setupCanvas(canvas, top + plotH + 20);
    const plotW = width - left - 64;
    const [lo, hi] = range(rows), scale = colorScale(lo, hi);
    const image = new ImageData(ncols, rows.length);
    rows.forEach((row, r) => row.forEach((v, c) => {
      image.data.set([...colorAt(scale.stops, (v - scale.lo) / (scale.hi - scale.lo)), 255], 4 * (r * ncols + c));
    }));
    const bitmap = Object.assign(document.createElement("canvas"), { width: ncols, height: rows.length });
    bitmap.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(bitmap, left, top, plotW, plotH);
    if (rowLabels) rowLabels.forEach((label, r) => text(ctx, label, left - 6, top + (r + 0.5) * cellHeight, "right"));
    text(ctx, xLabel, left, top + plotH + 11);
    const barH = Math.max(plotH, 30), barX = left + plotW + 10;
    for (let i = 0; i < barH; i++) {
      ctx.fillStyle = `rgb(${colorAt(scale.stops, 1 - i / (barH - 1))})`;
      ctx.fillRect(barX, top + i, 10, 1);
    }
    text(ctx, fmt(scale.hi), barX + 14, top + 5);
    text(ctx, fmt(scale.lo), barX + 14, top + barH - 5);
    Object.assign(canvas.dataset, { rows: rows.length, cols: ncols, lo, hi,
      plot: [left, top, plotW, plotH].map((v) => Math.round(v * dpr)).join(",") });
  }

  /** series: [{label, color, points: [[x, y], ...]}] as lines on shared axes, with a legend. */
  function drawLines(canvas, series, { height = 170, xName = "step", marks = [] } = {}) {
    const [ctx, width] = setupCanvas(canvas, height);
    const left = 56, top = 8, w = width - left - 64, h = height - top - 22;
    const [x0, x1] = range(series.map((s) => s.points.map((p) => p[0])));
    const [lo, hi] = range(series.map((s) => s.points.map((p) => p[1]))), pad = (hi - lo) * 0.05;
    const [y0, y1] = [lo - pad, hi + pad];                  // lines clear of the frame
    const px = (x) => left + ((x - x0) / (x1 - x0)) * w, py = (y) => top + h - ((y - y0) / (y1 - y0)) * h;
    ctx.strokeStyle = GRID;
    ctx.strokeRect(left, top, w, h);
    text(ctx, fmt(y1), left - 6, top + 4, "right");
    text(ctx, fmt(y0), left - 6, top + h - 4, "right");
    text(ctx, `${xName} ${fmt(x0)}`, left, top + h + 6, "left", "top");
    text(ctx, fmt(x1), left + w, top + h + 6, "right", "top");
    ctx.strokeStyle = "#dc2626";                            // events (a sentinel's) at their steps
    ctx.setLineDash([3, 3]);
    let marked = 0;
    for (const x of new Set(marks)) {
      if (x < x0 || x > x1) continue;
      ctx.beginPath();
      ctx.moveTo(px(x), top);
      ctx.lineTo(px(x), top + h);
      ctx.stroke();
      marked++;
    }
    ctx.setLineDash([]);
    canvas.dataset.marks = marked;
    ctx.lineWidth = 1.5;
    series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      s.points.forEach(([x, y], j) => (j ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y))));
      if (s.points.length === 1) ctx.arc(px(s.points[0][0]), py(s.points[0][1]), 2, 0, 2 * Math.PI);
      ctx.stroke();
      if (series.length < 2) return;
      ctx.fillStyle = s.color;
      ctx.fillRect(left + w + 10, top + 4 + i * 14, 10, 3);
      text(ctx, s.label, left + w + 24, top + 5 + i * 14);
    });
    Object.assign(canvas.dataset, { series: series.length, points: series.reduce((n, s) => n + s.points.length, 0) });
  }

  function drawHistogram(canvas, frame) {
    const [lo, hi] = frame.data, counts = frame.data.subarray(2);
    const [ctx, width] = setupCanvas(canvas, 150);
    const left = 40, top = 6, w = width - left - 8, h = 150 - top - 22, max = Math.max(...counts, 1);
    ctx.fillStyle = PALETTE[0];
    counts.forEach((c, i) => {
      const bar = (c / max) * h;
      ctx.fillRect(left + (i * w) / counts.length, top + h - bar, Math.max(1, w / counts.length - 1), bar);
    });
    text(ctx, fmt(lo), left, top + h + 6, "left", "top");
    text(ctx, fmt(hi), left + w, top + h + 6, "right", "top");
    text(ctx, fmt(max), left - 4, top, "right", "top");
    canvas.dataset.bins = counts.length;
  }

  function drawTopk(canvas, frame) {
    const k = frame.shape[1], values = frame.data.subarray(0, k), positions = frame.data.subarray(k, 2 * k);
    const shape = frame.meta.source_shape || [], rowH = 14;
    const [ctx, width] = setupCanvas(canvas, k * rowH + 8);
    const left = 110, half = (width - left - 60) / 2, mid = left + half;
    const max = Math.max(...Array.from(values, Math.abs), 1e-30);
    values.forEach((v, i) => {
      const y = 4 + i * rowH, len = (v / max) * half;
      ctx.fillStyle = v < 0 ? PALETTE[0] : PALETTE[2];
      ctx.fillRect(Math.min(mid, mid + len), y + 2, Math.abs(len), rowH - 4);
      text(ctx, `[${unravel(positions[i], shape)}]`, left - 6, y + rowH / 2, "right");
      text(ctx, fmt(v), width - 56, y + rowH / 2);
    });
    canvas.dataset.k = k;
  }

  function unravel(flat, shape) {
    const index = [];
    for (let d = shape.length - 1; d >= 0; d--) { index.unshift(flat % shape[d]); flat = Math.floor(flat / shape[d]); }
    return shape.length ? index.join(", ") : String(flat);
  }

  // --------------------------------------------------------------- side bar

  function setState(state, detail) {
    view.state = document.body.dataset.state = $("#state").textContent = state;
    renderWhere(detail);
  }

  function renderWhere(detail) {
    const w = view.welcome;
    const live = view.state === "open" && w ? `rank ${w.rank} · step ${view.step} · ${location.host}` : "";
    $("#where").textContent = detail ?? live;
  }

  function addError(message) {
    view.lastError = message;
    view.errors.push({ time: new Date().toLocaleTimeString(), message });
    if (view.errors.length > 50) view.errors.shift();
    const bar = $("#errors");
    bar.replaceChildren(...view.errors.slice(-4).map((e) => el("div", {}, el("time", { text: e.time }), " ", e.message)),
      el("button", { type: "button", title: "dismiss", text: "×", onclick: () => { bar.hidden = true; } }));
    bar.hidden = false;
  }

  function renderStats() {
    const numbers = Object.entries(view.stats).filter(([, v]) => typeof v === "number");
    const preferred = numbers.filter(([k]) => STAT_KEYS.includes(k));
    const shown = preferred.length ? preferred : numbers.slice(0, 6);
    shown.push(["received", view.framesReceived], ["gaps", view.gaps]);
    if (view.recordsReceived) shown.push(["records", view.recordsReceived]);
    $("#stats").replaceChildren(...shown.flatMap(([k, v]) => [el("dt", { text: k.replace(/_/g, " ") }),
      el("dd", { text: fmt(v) })]));
  }

  function renderNames() {
    if (!view.names.length) return $("#names").replaceChildren(el("li", { class: "muted", text: "none seen yet" }));
    $("#names").replaceChildren(...view.names.map((n) => {
      const xs = (n.layers || []).filter((l) => l !== null).sort((a, b) => a - b);
      const last = xs[xs.length - 1], layers = xs.length > 2 && last - xs[0] === xs.length - 1 ? `${xs[0]}-${last}` : `${xs}`;
      const about = [xs.length ? `layers ${layers}` : "", n.shape ? `[${n.shape}]` : "", n.dtype || ""];
      const use = () => { $("#subscribe").names.value = n.name; };
      return el("li", { "data-name": n.name, title: "use in the subscribe form", onclick: use },
        el("b", { text: n.name }), el("span", { class: "muted", text: about.filter(Boolean).join(" · ") }));
    }));
  }

  function renderSubs() {
    const subs = Object.values(view.subscriptions);
    if (!subs.length) return $("#subs").replaceChildren(el("li", { class: "muted", text: "none" }));
    $("#subs").replaceChildren(...subs.map((sub) => {
      const r = sub.active || sub.request, layers = r.layers === null ? "all" : showParam(r.layers);
      return el("li", { "data-sub": sub.id, "data-status": sub.error ? "error" : sub.active ? "active" : "pending" },
        el("span", { class: "actions" },
          el("button", { type: "button", name: "edit", text: "edit", onclick: () => editSubscription(sub.id) }),
          el("button", { type: "button", name: "remove", text: "remove", onclick: () => unsubscribe(sub.id) })),
        el("span", { class: "title" }, el("b", { text: sub.id }), " ", r.names.join(", ")),
        el("div", { class: "muted", text: `${r.compressor.kind} · layers ${layers} · every ${r.every}` }),
        sub.error ? el("div", { class: "sub-error", text: sub.error }) : "");
    }));
  }

  function init() {
    const form = $("#subscribe");
    form.kind.addEventListener("change", () => fillParams());
    form.addEventListener("submit", (ev) => { ev.preventDefault(); subscribe(formRequest(form)); setEditing(null); });
    form.new.addEventListener("click", () => setEditing(null));
    fillKinds();
    window.addEventListener("hashchange", () => { disconnect(); backoff = 500; connect(); });  // a new token
    window.addEventListener("resize", () => { panels.forEach(markDirty); sentinelsDirty = metrics.size > 0; schedule(); });
    $("#more-metrics").addEventListener("toggle", () => { sentinelsDirty = true; schedule(); });
    connect();
  }

  Object.assign(view, { subscribe, unsubscribe });
  init();
})();
