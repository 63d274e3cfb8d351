/* sigprop dashboard: draws the plots of the solution and validation pages from the JSON each page
 * embeds (<script type="application/json" id="page-data">), follows a running validation, and
 * drives the solve form. No framework and nothing from other origins: plotly.js is served by
 * sigprop from the installed plotly package. Text from the server is only ever set with
 * textContent or passed to plotly as data, never written as HTML. */
"use strict";

(function () {
  const PLOT_CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"]};
  const FONT = {family: "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size: 12, color: "#212529"};
  const RUN_COLORS = {solved: "#1971c2", solution: "#1971c2", he: "#c92a2a", eoc: "#2b8a3e", plain: "#f08c00"};
  const PALETTE = ["#7048e8", "#0b7285", "#e64980", "#5c940d", "#862e9c"];
  const ACTIVE = new Set(["queued", "running"]);

  /* Run draw() once plotly.js is there. The pages are complete without it (tables, parameters and
     the graph diagram are rendered by the server), so the 4.8 MB library is fetched only after the
     page's load event: a first visit spends most of a second compiling it, and that must not hold
     back the page; the plots appear when it is ready (from the browser's cache on later visits). */
  function withPlotly(draw) {
    if (window.Plotly) {
      draw();
      return;
    }
    const src = document.body.dataset.plotly;
    if (!src) return;  // plotly is not installed: the page says so
    const fetchIt = () => {
      const script = document.createElement("script");
      script.src = src;
      script.onload = () => {
        performance.mark("sigprop-plotly");
        draw();
        performance.mark("sigprop-drawn");  // bench/dashboard_bench.py reads when the plots were drawn
      };
      document.head.appendChild(script);
    };
    if (document.readyState === "complete") fetchIt();
    else window.addEventListener("load", fetchIt, {once: true});
  }

  function pageData() {
    const el = document.getElementById("page-data");
    return el ? JSON.parse(el.textContent) : null;
  }

  function layout(extra) {
    return Object.assign({
      margin: {l: 60, r: 20, t: 10, b: 50}, font: FONT, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      hovermode: "closest", legend: {orientation: "h", x: 0, y: -0.22},
    }, extra);
  }

  function axis(title, extra) {
    return Object.assign({title: {text: title}, gridcolor: "#eef0f2", zerolinecolor: "#ced4da", automargin: true}, extra);
  }

  function draw(id, traces, extra) {
    const el = document.getElementById(id);
    if (!el || !window.Plotly) return;
    window.Plotly.newPlot(el, traces, layout(extra), PLOT_CONFIG);
  }

  function runColor(name, i) {
    return RUN_COLORS[name] || PALETTE[i % PALETTE.length];
  }

  // -- solution page ----------------------------------------------------------------------------

  /* The solved curve of a shaped network spans a sliver of [-1, 1] (TAT with eta = 0.9: C(c) from
     about 0.8 to 1), so against the identity it reads as a flat line. When it spans less than a
     quarter of the main axis, an inset in the lower right corner, where C < -0.2 (the identity
     and the C maps of deep networks, which tend to 0 or 1, pass above it) draws it again on its own scale. */
  const ZOOM_BELOW = 0.5;

  function zoomInset(cm, traces, extra) {
    const solved = cm.series.find((s) => s.zoom && s.y && s.y.length);
    if (!solved) return;
    const lo = Math.min(...solved.y), hi = Math.max(...solved.y);
    if (hi - lo >= ZOOM_BELOW) return;
    const pad = Math.max((hi - lo) * 0.08, 1e-6);
    traces.push({type: "scatter", mode: "lines", name: solved.name + ", zoomed", x: cm.c, y: solved.y,
      xaxis: "x2", yaxis: "y2", showlegend: false, line: {color: solved.color, width: 2},
      hovertemplate: "c = %{x:.3f}<br>C = %{y:.5f}<extra>zoomed</extra>"});
    extra.xaxis2 = axis("", {domain: [0.6, 0.98], anchor: "y2", range: [-1, 1], tickfont: {size: 10}});
    extra.yaxis2 = axis("", {domain: [0.08, 0.34], anchor: "x2", range: [lo - pad, hi + pad], tickfont: {size: 10},
      tickformat: ".3~f"});
    extra.shapes = [{type: "rect", xref: "paper", yref: "paper", x0: 0.53, x1: 0.995, y0: 0.02, y1: 0.42,
      fillcolor: "#fff", line: {color: "#ced4da", width: 1}, layer: "below"}];
    extra.annotations = [{xref: "paper", yref: "paper", x: 0.79, y: 0.415, yanchor: "top", showarrow: false,
      text: "solved network, zoomed", font: {size: 11, color: "#495057"}}];
  }

  function drawCMap(cm) {
    const traces = cm.series.map((s) => ({
      type: "scatter", mode: "lines", name: s.name, x: cm.c, y: s.y, visible: s.visible || true,
      line: {color: s.color, dash: s.dash || "solid", width: s.width || 2},
      hovertemplate: "c = %{x:.3f}<br>C = %{y:.4f}<extra>" + "%{fullData.name}" + "</extra>",
    }));
    const extra = {
      xaxis: axis("input correlation c", {range: [-1, 1]}),
      yaxis: axis("output correlation C(c)", {range: [-1.05, 1.05]}),
    };
    zoomInset(cm, traces, extra);
    draw("c-map", traces, extra);
  }

  function drawVMap(vm) {
    const ends = [Math.min(...vm.q), Math.max(...vm.q)];
    const traces = [
      {type: "scatter", mode: "lines", name: "V(q)", x: vm.q, y: vm.v, line: {color: "#1971c2", width: 3}},
      {type: "scatter", mode: "lines", name: "identity", x: ends, y: ends, line: {color: "#868e96", dash: "dot"}},
      {type: "scatter", mode: "markers", name: "stable fixed point", x: vm.stable, y: vm.stable,
        marker: {size: 12, color: "#2b8a3e"}},
      {type: "scatter", mode: "markers", name: "unstable fixed point", x: vm.unstable, y: vm.unstable,
        marker: {size: 12, color: "#fff", line: {color: "#c92a2a", width: 2}}},
    ];
    draw("v-map", traces, {xaxis: axis("q (pre-activation variance)"), yaxis: axis("V(q)")});
  }

  /* Two stacked panels over the weighted layers: gamma relative to its mean (balanced scaling is a
     flat line at 1, whatever the absolute value, which is tiny for deep networks) and alpha. */
  function drawGR(gr) {
    const mean = gr.gamma.reduce((sum, g) => sum + g, 0) / gr.gamma.length;
    const traces = [
      {type: "scatter", mode: "lines+markers", name: "γ / mean γ", x: gr.x, y: gr.gamma.map((g) => g / mean),
        customdata: gr.gamma, text: gr.text, hovertemplate: "%{text}<br>γ = %{customdata:.5g}<extra></extra>",
        line: {color: "#1971c2"}},
      {type: "scatter", mode: "lines+markers", name: "α (multiplier)", x: gr.x, y: gr.alpha, text: gr.text,
        yaxis: "y2", hovertemplate: "%{text}<br>α = %{y:.5g}<extra></extra>", line: {color: "#f08c00"}},
    ];
    draw("gr-plot", traces, {
      xaxis: axis("weighted layer", {anchor: "y2"}),
      yaxis: axis("γ / mean γ", {domain: [0.56, 1], rangemode: "tozero"}),
      yaxis2: axis("α", {domain: [0, 0.44], rangemode: "tozero"}),
      showlegend: false, margin: {l: 70, r: 20, t: 30, b: 50},
    });
  }

  function solutionPage(data) {
    withPlotly(() => {
      if (data.c_map) drawCMap(data.c_map);
      if (data.v_map) drawVMap(data.v_map);
      if (data.gr) drawGR(data.gr);
    });
  }

  // -- validation page --------------------------------------------------------------------------

  function curves(id, series, title, extra) {
    const traces = series.map((s, i) => ({
      type: "scatter", mode: "lines", name: s.name, x: s.steps, y: s.values,
      line: {color: runColor(s.name, i), width: s.name === "solved" ? 3 : 2},
    }));
    draw(id, traces, Object.assign({xaxis: axis("step"), yaxis: axis(title)}, extra || {}));
  }

  /* A log axis: plotly's automatic ticks label 2 and 5 within each decade ("5 2 1 5 2 0.1 5 2
     0.01"), which reads as noise; one tick per power of ten, written as a plain number (1, 0.1,
     0.01, then 1e-5 for the tiny ones), reads as a scale. The range runs from the power of ten
     below the data to the one above, so even data within one decade gets two labelled ticks. */
  function logTicks(series) {
    const ys = series.flatMap((s) => s.y).filter((y) => y > 0 && Number.isFinite(y));
    const ticks = {type: "log", dtick: 1, tickformat: "~g"};
    if (!ys.length) return ticks;
    const lo = Math.floor(Math.log10(Math.min(...ys)));
    const hi = Math.ceil(Math.log10(Math.max(...ys)));
    return Object.assign(ticks, {range: [lo, Math.max(hi, lo + 1)]});
  }

  function drawGradNorms(series) {
    const runs = [...new Set(series.map((s) => s.run))];
    const traces = series.map((s) => ({
      type: "scatter", mode: "lines+markers", name: s.name, x: s.x, y: s.y, text: s.layers,
      hovertemplate: "%{text}<br>%{y:.4g}<extra>%{fullData.name}</extra>",
      line: {color: runColor(s.run, runs.indexOf(s.run)), dash: s.last ? "dot" : "solid"},
    }));
    draw("grad-plot", traces, {xaxis: axis("weighted layer"), yaxis: axis("gradient norm", logTicks(series))});
  }

  function drawCValues(series) {
    const traces = [];
    series.forEach((s, i) => {
      const color = runColor(s.name, i);
      traces.push({type: "scatter", mode: "lines+markers", name: s.name + " (empirical)", x: s.x, y: s.y,
        text: s.layers, hovertemplate: "%{text}<br>c = %{y:.4f}<extra></extra>", line: {color: color}});
      if (typeof s.predicted === "number" && s.x.length) {
        traces.push({type: "scatter", mode: "lines", name: s.name + " (predicted at the output)",
          x: [s.x[0], s.x[s.x.length - 1]], y: [s.predicted, s.predicted], line: {color: color, dash: "dash"}});
      }
    });
    draw("c-values-plot", traces, {xaxis: axis("weighted layer"), yaxis: axis("c (cosine of the pair)")});
  }

  function showStatus(s) {
    const bar = document.getElementById("progress");
    const text = document.getElementById("progress-text");
    const badge = document.getElementById("status");
    if (bar && typeof s.percent === "number") {
      bar.value = s.percent;
      bar.textContent = Math.round(s.percent) + "%";
    }
    if (text) {
      const p = s.progress || {};
      text.textContent = p.total ? `step ${p.step} of ${p.total}` + (p.run ? ` (${p.run})` : "") : s.status;
    }
    if (badge) {
      badge.textContent = s.status;
      badge.className = "status " + s.status;
    }
  }

  /* While the job is queued or running, ask the server every second; when it has ended, reload
     so the page shows the results (the server renders them). */
  function follow(status) {
    const url = "/dashboard/validations/" + encodeURIComponent(status.id) + ".json";
    async function tick() {
      try {
        const response = await fetch(url, {cache: "no-store", headers: {Accept: "application/json"}});
        if (response.ok) {
          const s = await response.json();
          showStatus(s);
          if (!ACTIVE.has(s.status)) {
            window.location.reload();
            return;
          }
        }
      } catch (err) {
        /* a blip (server restart): keep asking */
      }
      window.setTimeout(tick, 1000);
    }
    window.setTimeout(tick, 1000);
  }

  function validationPage(data) {
    const p = data.plots;
    if (data.active) follow(data.status);
    withPlotly(() => {
      if (p.loss.length) curves("loss-plot", p.loss, "training loss");
      if (p.validation_loss && p.validation_loss.length) {
        curves("validation-loss-plot", p.validation_loss, "validation loss (nats per byte)");
      } else if (p.accuracy.length) {
        curves("accuracy-plot", p.accuracy, "test accuracy");
      }
      if (p.grad_norms.length) drawGradNorms(p.grad_norms);
      if (p.c_values.length) drawCValues(p.c_values);
    });
  }

  // -- solve form -------------------------------------------------------------------------------

  // a starting value for required template parameters that have no default
  const SUGGESTED = {mlp: {depth: 20}, cnn: {depth: 10}, resnet: {depth: 50}};

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : String(v));
    }
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function field(labelText, input, help) {
    const label = el("label", {title: help || ""}, labelText);
    label.appendChild(input);
    if (help) label.appendChild(el("small", {}, help));
    return label;
  }

  function paramInput(tpl, p) {
    const id = "param-" + p.name;
    const start = (SUGGESTED[tpl] || {})[p.name] ?? p.default;
    let input;
    if (p.type === "boolean") {
      input = el("input", {type: "checkbox", id: id, checked: p.default === true});
    } else if (Array.isArray(p.allowed) && p.allowed.every((v) => typeof v === "number")) {
      input = el("select", {id: id});
      if (!p.required) input.appendChild(el("option", {value: ""}, "default"));
      for (const v of p.allowed) input.appendChild(el("option", {value: v, selected: v === start}, String(v)));
    } else if (p.type === "integer" || p.type === "number") {
      input = el("input", {type: "number", id: id, min: p.minimum, max: p.maximum,
        step: p.type === "integer" ? 1 : "any", required: p.required,
        value: start ?? "", placeholder: p.required ? "" : "default"});
    } else {
      input = el("input", {type: "text", id: id, value: Array.isArray(start) ? start.join(", ") : "",
        placeholder: "comma-separated integers (empty: default)"});
    }
    input.dataset.param = p.name;
    input.dataset.kind = p.type;
    input.dataset.default = JSON.stringify(p.default);
    return field(p.name + (p.required ? " *" : ""), input, p.description);
  }

  /* A template parameter's value, or undefined when it is empty or equal to its default (the
     request then says only what differs: the same graph and cache key either way). */
  function readParam(input) {
    const kind = input.dataset.kind;
    const dflt = input.dataset.default;
    let value;
    if (kind === "boolean") {
      value = input.checked;
    } else {
      const raw = input.value.trim();
      if (raw === "") return undefined;
      if (kind === "integer") value = Number.parseInt(raw, 10);
      else if (kind === "number") value = Number.parseFloat(raw);
      else if (kind.startsWith("array")) value = raw.split(/[\s,]+/).filter(Boolean).map((v) => Number.parseInt(v, 10));
      else value = raw;
    }
    return JSON.stringify(value) === dflt ? undefined : value;
  }

  function solveForm(catalog) {
    const form = document.getElementById("solve-form");
    const tplSel = document.getElementById("template");
    const methodSel = document.getElementById("method");
    const actSel = document.getElementById("activation");
    const paramsBox = document.getElementById("template-params");
    const targetsBox = document.getElementById("targets");
    const preview = document.getElementById("preview");
    const templates = Object.fromEntries(catalog.templates.map((t) => [t.name, t]));

    for (const t of catalog.templates) tplSel.appendChild(el("option", {value: t.name}, t.name));
    for (const [name, m] of Object.entries(catalog.methods)) methodSel.appendChild(el("option", {value: name}, m.label));

    function renderParams() {
      const t = templates[tplSel.value];
      document.getElementById("template-description").textContent = t.description;
      paramsBox.replaceChildren(...t.parameters.map((p) => paramInput(t.name, p)));
    }

    function renderActivations() {
      const m = catalog.methods[methodSel.value];
      const keep = actSel.value;
      actSel.replaceChildren(...m.activations.map((a) => el("option", {value: a}, a)));
      if (m.activations.includes(keep)) actSel.value = keep;
    }

    function renderTargets() {
      const m = catalog.methods[methodSel.value];
      const targets = m.targets[actSel.value] || m.targets["*"] || [];
      if (!targets.length) {
        targetsBox.replaceChildren(el("p", {class: "hint"}, "This method takes no targets."));
        return;
      }
      targetsBox.replaceChildren(...targets.map((t) => {
        const input = el("input", {type: "number", step: "any", id: "target-" + t.name, required: t.required,
          value: t.default ?? "", placeholder: t.required ? "" : "default"});
        input.dataset.target = t.name;
        return field(t.name + (t.required ? " *" : ""), input, t.description);
      }));
    }

    function request() {
      const graph = {template: tplSel.value};
      for (const input of paramsBox.querySelectorAll("[data-param]")) {
        const v = readParam(input);
        if (v !== undefined) graph[input.dataset.param] = v;
      }
      const targets = {};
      for (const input of targetsBox.querySelectorAll("[data-target]")) {
        if (input.value.trim() !== "") targets[input.dataset.target] = Number.parseFloat(input.value);
      }
      return {graph: graph, method: methodSel.value, activation: actSel.value, targets: targets};
    }

    function refresh() {
      preview.textContent = JSON.stringify(request(), null, 2);
    }

    function showError(code, message, hint) {
      document.getElementById("error-code").textContent = code;
      document.getElementById("error-message").textContent = message;
      document.getElementById("error-hint").textContent = hint || "";
      document.getElementById("error").hidden = false;
    }

    async function submit(event) {
      event.preventDefault();
      document.getElementById("error").hidden = true;
      const button = document.getElementById("submit");
      const busy = document.getElementById("busy");
      const headers = {"Content-Type": "application/json", Accept: "application/json"};
      const key = document.getElementById("api-key").value.trim();
      if (key) headers.Authorization = "Bearer " + key;
      button.disabled = true;
      busy.hidden = false;
      try {
        const response = await fetch("/v1/solve", {method: "POST", headers: headers, body: JSON.stringify(request())});
        let body = null;
        try {
          body = await response.json();
        } catch (err) {
          body = null;
        }
        if (response.ok) {
          const solved = (body && body.key) || response.headers.get("X-Sigprop-Key");
          window.location.assign("/dashboard/solutions/" + encodeURIComponent(solved));
          return;
        }
        const e = (body && body.error) || {};
        showError(e.code || "HTTP " + response.status, e.message || response.statusText || "the request failed", e.hint);
      } catch (err) {
        showError("network_error", "the service could not be reached", "check the connection and retry");
      } finally {
        button.disabled = false;
        busy.hidden = true;
      }
    }

    tplSel.addEventListener("change", () => { renderParams(); refresh(); });
    methodSel.addEventListener("change", () => { renderActivations(); renderTargets(); refresh(); });
    actSel.addEventListener("change", () => { renderTargets(); refresh(); });
    form.addEventListener("input", refresh);
    form.addEventListener("submit", submit);
    renderParams();
    renderActivations();
    renderTargets();
    refresh();
    form.dataset.ready = "1";
  }

  function start() {
    const page = document.body.dataset.page;
    const data = pageData();
    if (page === "solution") solutionPage(data);
    else if (page === "validation") validationPage(data);
    else if (page === "new") solveForm(data);
    document.body.dataset.ready = "1";
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
