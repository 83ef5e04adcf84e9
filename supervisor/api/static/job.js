// One job's page: charts from GET /api/v1/jobs/{id}/samples (uPlot, vendored), the log
// tail (of any attempt), the Stop and Restart buttons. The summary above is page.js's
// fragment refresh.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const RATE_WINDOW_S = 10;
  const chartsEl = document.getElementById("charts");
  const jobId = chartsEl.dataset.job;
  const api = "/api/v1/jobs/" + encodeURIComponent(jobId);
  const samples = [];
  let lastT = null;
  const metrics = { t: [], series: {} };

  // axis labels only; every figure in the page's text is formatted by the daemon
  function bytes(n) {
    if (n == null) return "";
    const units = [["PB", 1e15], ["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
    for (const [unit, size] of units) if (Math.abs(n) >= size) return (n / size).toFixed(1) + " " + unit;
    return n.toFixed(0) + " B";
  }
  const bytesAxis = (u, ticks) => ticks.map(bytes);
  const ONE_POINT_SPAN_S = 120;
  // uPlot 1.6.32 spans a time axis of one point over 86,400,000 s (2027-2029 around a
  // sample of today: a day in its milliseconds, read as seconds): two minutes around it
  function setData(chart, data) {
    const x = data[0];
    if (x.length !== 1) { chart.setData(data); return; }
    chart.setData(data, false);
    chart.setScale("x", { min: x[0] - ONE_POINT_SPAN_S / 2, max: x[0] + ONE_POINT_SPAN_S / 2 });
  }
  const colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#db2777"];

  function makeChart(id, title, series, axes) {
    const el = document.getElementById(id);
    const opts = {
      title: title, width: Math.max(el.clientWidth, 300), height: 220,
      series: [{}].concat(series.map((s, i) => Object.assign({ stroke: colors[i % colors.length], width: 1.5, spanGaps: true }, s))),
      axes: [{}].concat(axes),
      scales: { x: { time: true } },
    };
    return new uPlot(opts, [[]].concat(series.map(() => [])), el);
  }

  const charts = {
    items: makeChart("chart-items", "items done and rate",
      [{ label: "items done", scale: "items" }, { label: "rate (items/s)", scale: "rate" }],
      [{ scale: "items" }, { scale: "rate", side: 1, grid: { show: false } }]),
    bytes: makeChart("chart-bytes", "bytes written and disk free",
      [{ label: "written", scale: "b", value: (u, v) => bytes(v) }, { label: "disk free", scale: "free", value: (u, v) => bytes(v) }],
      [{ scale: "b", values: bytesAxis, size: 70 }, { scale: "free", side: 1, values: bytesAxis, size: 70, grid: { show: false } }]),
    cpu: makeChart("chart-cpu", "CPU and RSS",
      [{ label: "CPU %", scale: "pct" }, { label: "RSS", scale: "rss", value: (u, v) => bytes(v) }],
      [{ scale: "pct" }, { scale: "rss", side: 1, values: bytesAxis, size: 70, grid: { show: false } }]),
    gpu: makeChart("chart-gpu", "GPU memory (all devices)",
      [{ label: "GPU memory", scale: "g", value: (u, v) => bytes(v) }],
      [{ scale: "g", values: bytesAxis, size: 70 }]),
    metrics: null,
  };

  function drawSamples() {
    const x = samples.map((s) => Date.parse(s.t) / 1000);
    // rate over the samples of the last RATE_WINDOW_S (one-tick differences are jagged)
    let start = 0;
    const rate = samples.map((s, i) => {
      while (start < i && (x[i] - x[start] > RATE_WINDOW_S || samples[start].items_done == null)) start += 1;
      if (start === i || s.items_done == null) return null;
      return Math.max(0, (s.items_done - samples[start].items_done) / (x[i] - x[start]));
    });
    setData(charts.items, [x, samples.map((s) => s.items_done), rate]);
    setData(charts.bytes, [x, samples.map((s) => s.bytes_written), samples.map((s) => s.disk_free_bytes)]);
    setData(charts.cpu, [x, samples.map((s) => s.cpu_percent), samples.map((s) => s.rss_bytes)]);
    setData(charts.gpu, [x, samples.map((s) => s.gpu_memory_bytes)]);
  }

  async function loadSamples() {
    const query = lastT ? "since=" + encodeURIComponent(lastT) + "&limit=10000" : "limit=5000";
    const answer = await fetch(api + "/samples?" + query, { cache: "no-store" });
    if (!answer.ok) return;
    const fresh = (await answer.json()).filter((s) => lastT === null || s.t > lastT);
    if (fresh.length) {
      samples.push(...fresh);
      lastT = samples[samples.length - 1].t;
      drawSamples();
    }
  }

  function recordMetrics() {
    const summary = document.getElementById("job-summary");
    if (!summary) return;
    const values = JSON.parse(summary.dataset.metrics || "{}");
    const observed = summary.dataset.observed ? Date.parse(summary.dataset.observed) / 1000 : null;
    const names = Object.keys(values).sort();
    if (!names.length || observed === null || metrics.t[metrics.t.length - 1] === observed) return;
    metrics.t.push(observed);
    for (const name of names) {
      if (!metrics.series[name]) metrics.series[name] = new Array(metrics.t.length - 1).fill(null);
      metrics.series[name].push(values[name]);
    }
    for (const name of Object.keys(metrics.series)) {
      if (metrics.series[name].length < metrics.t.length) metrics.series[name].push(null);
    }
    const all = Object.keys(metrics.series).sort();
    if (!charts.metrics || charts.metrics.series.length !== all.length + 1) {
      if (charts.metrics) charts.metrics.destroy();
      charts.metrics = makeChart("chart-metrics", "worker metrics (since this page opened)",
        all.map((name) => ({ label: name, scale: "m" })), [{ scale: "m" }]);
    }
    setData(charts.metrics, [metrics.t.slice()].concat(all.map((name) => metrics.series[name].slice())));
  }

  const logEl = document.getElementById("log");
  // what a terminal interprets instead of showing (supervisor/formatting.py, terminal_text):
  // escape sequences (colours, cursor moves, OSC titles) and control characters but tab,
  // newline and carriage return
  const TERMINAL_CONTROLS = /\x1b\[[0-?]*[ -\/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -\/]*[0-~]?|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]/g;
  const attemptEl = document.getElementById("log-attempt");
  let shownAttempt = attemptEl.value;
  attemptEl.addEventListener("change", () => { shownAttempt = null; loadLog(); });

  // the select offers every attempt so far: a restart adds one
  function syncAttempts(count) {
    const known = attemptEl.options.length - 1;
    for (let n = known + 1; n <= count; n++) {
      const option = document.createElement("option");
      option.value = option.textContent = String(n);
      attemptEl.insertBefore(option, attemptEl.options[1] || null);
    }
  }

  async function loadLog() {
    const attempt = attemptEl.value;
    const answer = await fetch(api + "/logs?tail=200" + (attempt ? "&attempt=" + attempt : ""),
                               { cache: "no-store" });
    if (!answer.ok) return;
    const text = (await answer.text()).replace(TERMINAL_CONTROLS, "");
    // someone selecting in the log (to copy an error) keeps the selection until they let go
    const selection = window.getSelection();
    if (selection && !selection.isCollapsed && logEl.contains(selection.anchorNode)) return;
    if (attempt !== attemptEl.value) return;  // changed while this one was on its way
    const switched = shownAttempt !== attempt;
    shownAttempt = attempt;
    if (switched || text !== logEl.textContent) {
      const atEnd = logEl.scrollTop + logEl.clientHeight >= logEl.scrollHeight - 4;
      logEl.textContent = text;
      if (atEnd) logEl.scrollTop = logEl.scrollHeight;
    }
  }

  const stop = document.getElementById("stop");
  const stopResult = document.getElementById("stop-result");
  stop.addEventListener("click", async () => {
    if (!window.confirm("Stop job " + jobId + "? (SIGTERM, then SIGKILL after its grace)")) return;
    stop.disabled = true;
    const answer = await fetch(api + "/stop", { method: "POST" });
    const body = await answer.json().catch(() => ({}));
    stopResult.textContent = answer.ok ? "stop requested" : (body.error || ("stop failed: " + answer.status));
    if (!answer.ok && answer.status !== 409) stop.disabled = false;
    window.jobsup.refresh();
  });

  const restart = document.getElementById("restart");
  restart.addEventListener("click", async () => {
    if (!window.confirm("Restart job " + jobId + "? (a new attempt; the earlier ones' logs are kept)")) return;
    restart.disabled = true;
    const answer = await fetch(api + "/restart", { method: "POST" });
    const body = await answer.json().catch(() => ({}));
    stopResult.textContent = answer.ok ? "restarted: attempt " + (body.attempt + 1) + " pending"
      : (body.error || ("restart failed: " + answer.status));
    if (answer.ok) stop.disabled = false;
    else restart.disabled = false;
    window.jobsup.refresh();
  });

  // the buttons follow the job: Stop while it runs or waits, Restart once it ended
  document.getElementById("live").addEventListener("jobsup:refreshed", () => {
    recordMetrics();
    const summary = document.getElementById("job-summary");
    if (!summary) return;
    const ended = summary.dataset.ended === "true";
    if (ended) stop.disabled = true;
    else if (!restart.disabled) stop.disabled = false;  // restarted elsewhere: it runs again
    restart.disabled = !ended;
    syncAttempts(parseInt(summary.dataset.attempt, 10) || 0);
  });

  async function tick() {
    await Promise.all([loadSamples(), loadLog()]).catch(() => document.body.classList.add("stale"));
  }
  window.jobsup.charts = charts;
  window.jobsup.samples = samples;
  recordMetrics();
  tick();
  setInterval(tick, REFRESH_MS);
})();
