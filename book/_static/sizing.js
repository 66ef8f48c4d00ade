// The sizing page: loads Pyodide, puts the course's cost models (labs/labkit/predict/ and its
// subfolders, such as the planner's package, copied into _static/labkit/predict/ when the site
// is built; the configuration lists the folders and the modules) into its file system, and
// answers the form
// with labkit.predict.sizing.run. Nothing is computed here: this file only moves fields in and
// draws what Python returns.
(function () {
  "use strict";
  const config = window.SIZING_CONFIG;
  const $ = (id) => document.getElementById(id);
  const started = performance.now();
  let answer = null;   // the Python function, once loaded

  function status(text) { $("sizing-status").textContent = text; }
  function showError(text) {
    $("sizing-error").textContent = text;
    $("sizing-error").hidden = !text;
  }

  function loadScript(url) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = url;
      script.onload = resolve;
      script.onerror = () => reject(new Error("could not load " + url));
      document.head.appendChild(script);
    });
  }

  const GB = 1e9;
  // a value that rounds to zero prints as 0, never "-0.00" (a sum's rounding can leave -1e-17)
  const fmt = (x, digits = 1) => (Math.abs(x) < 0.5 * 10 ** -digits ? 0 : x).toLocaleString(
    "en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  const ZERO = { ddp: "DDP", zero1: "ZeRO-1", zero2: "ZeRO-2", zero3: "ZeRO-3" };

  function cell(row, text, header) {
    const el = document.createElement(header ? "th" : "td");
    el.textContent = text;
    row.appendChild(el);
  }

  function table(target, headers, rows) {
    const wrapper = document.createElement("div");
    wrapper.className = "sizing-table";
    const t = document.createElement("table");
    const head = t.createTHead().insertRow();
    headers.forEach((h) => cell(head, h, true));
    const body = t.createTBody();
    rows.forEach((r) => { const row = body.insertRow(); r.forEach((v) => cell(row, v)); });
    wrapper.appendChild(t);
    target.appendChild(wrapper);
    return t;
  }

  // Stacked horizontal bars of parameters, gradients and optimizer state per GPU.
  function memoryChart(target, memory) {
    const stages = Object.keys(memory);
    const most = Math.max(...stages.map((s) => memory[s].total));
    // drawn at the width it is shown at, so that its text stays legible on a phone
    const width = Math.max(320, Math.min(640, target.clientWidth || 600));
    const left = 64, right = 96, bar = 26, gap = 12;
    const height = stages.length * (bar + gap) + 30;
    const colours = { params: "#4C72B0", grads: "#DD8452", optimizer: "#55A868" };
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "Bar chart of model-state memory per GPU, GB, for " +
      stages.map((s) => `${ZERO[s]} ${fmt(memory[s].total / GB)}`).join(", "));
    svg.classList.add("sizing-chart");
    const add = (tag, attrs, text) => {
      const el = document.createElementNS(ns, tag);
      Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
      if (text !== undefined) el.textContent = text;
      svg.appendChild(el);
    };
    const scale = (width - left - right) / most;
    stages.forEach((s, i) => {
      const y = i * (bar + gap);
      add("text", { x: left - 8, y: y + bar * 0.7, "text-anchor": "end" }, ZERO[s]);
      let x = left;
      ["params", "grads", "optimizer"].forEach((part) => {
        const w = memory[s][part] * scale;
        add("rect", { x, y, width: Math.max(w, 0), height: bar, fill: colours[part] });
        x += w;
      });
      add("text", { x: x + 6, y: y + bar * 0.7 }, `${fmt(memory[s].total / GB)} GB`);
    });
    let x = left;
    const y = stages.length * (bar + gap) + 14;
    Object.entries(colours).forEach(([part, colour]) => {
      add("rect", { x, y: y - 10, width: 12, height: 12, fill: colour });
      add("text", { x: x + 16, y }, part);
      x += Math.min(120, (width - left) / 3);
    });
    target.appendChild(svg);
  }

  function layoutLabel(c) {
    let text = `tp ${c.tp} · pp ${c.pp} · dp ${c.dp}`;
    if (c.cp > 1) text += ` · cp ${c.cp}`;
    if (c.ep > 1) text += ` · ep ${c.ep}`;
    // the experts' tensor parallelism, where it is not the attention's (tp)
    if (c.etp !== undefined && c.etp !== c.tp) text += ` · etp ${c.etp}`;
    if (c.chunks > 1) text += `, v ${c.chunks}`;
    return text;
  }

  // The answer first: a phone shows a table's first columns and scrolls to the rest, so
  // the layout (held in place while the rest scrolls), its step time and MFU lead, and the
  // settings that produce them follow.
  function configurationRows(list) {
    return list.map((c) => {
      const t = c.time_s;
      const comm = t.tp + t.pp + t.dp + t.cp + t.ep;
      return [layoutLabel(c), fmt(t.step, 2), `${fmt(100 * c.mfu, 0)} %`,
        fmt(c.memory_bytes.total / GB),
        `${fmt(t.compute + t.recompute, 2)} + ${fmt(t.bubble, 2)} + ${fmt(comm, 2)}`,
        ZERO[c.zero], `${c.micro_batch} × ${c.microbatches}`, c.recompute];
    });
  }
  const CONFIG_HEADERS = ["layout", "step s", "MFU", "GB / GPU",
    "s: compute + bubble + comm", "ZeRO", "b × m", "recompute"];

  function render(result) {
    const out = $("sizing-results");
    out.replaceChildren();
    const model = result.model;
    const heading = (text) => {
      const h = document.createElement("h3");
      h.textContent = text;
      out.appendChild(h);
    };
    heading(`Model states per GPU: ${fmt(model.params / 1e9, 2)} B parameters`);
    memoryChart(out, result.memory_per_gpu);
    // the total first, for the same reason as the planner's step time
    const memoryTable = table(out, ["", "total GB", "parameters GB", "gradients GB",
      "optimizer GB"], Object.entries(result.memory_per_gpu).map(([s, m]) =>
      [ZERO[s], fmt(m.total / GB), fmt(m.params / GB), fmt(m.grads / GB),
        fmt(m.optimizer / GB)]));
    memoryTable.id = "sizing-memory";
    if (result.planner) {
      heading(`The planner's fastest of ${result.planner.count.toLocaleString("en-US")} ` +
        "configurations that fit");
      const best = table(out, CONFIG_HEADERS, configurationRows(result.planner.best));
      best.id = "sizing-best";
    } else if (result.planner_note) {
      const p = document.createElement("p");
      p.textContent = `No planner: ${result.planner_note}.`;
      out.appendChild(p);
    }
    if (result.layout) {
      const c = result.layout;
      heading("Your layout");
      const p = document.createElement("p");
      p.id = "sizing-layout";
      p.textContent = c.reason ? `${layoutLabel(c)} does not fit: ${c.reason}.` :
        `${layoutLabel(c)} ranks ${c.rank} of ${result.planner.count.toLocaleString("en-US")}` +
        `, ${fmt(100 * (c.step_time_s / c.best_step_time_s - 1))} % slower than the best.`;
      out.appendChild(p);
      if (!c.reason) table(out, CONFIG_HEADERS, configurationRows([c]));
    }
    $("sizing-command").textContent = result.command;
  }

  function fields() {
    const data = {};
    new FormData($("sizing-form")).forEach((value, key) => { data[key] = value; });
    return data;
  }

  function compute() {
    showError("");
    const reply = JSON.parse(answer(JSON.stringify(fields())));
    if (reply.error) {
      showError(reply.error);
      return false;
    }
    render(reply.ok);
    return true;
  }

  function showModelFields() {
    const choice = $("sizing-model").value;
    $("sizing-params-field").hidden = choice !== "params";
    $("sizing-shape-fields").hidden = choice !== "shape";
  }

  async function main() {
    if (!config) { status("The page's configuration did not load."); return; }
    $("sizing-model").addEventListener("change", showModelFields);
    showModelFields();
    status(`Loading Python (Pyodide ${config.version})…`);
    await loadScript(config.pyodide + "pyodide.js");
    const pyodide = await window.loadPyodide({ indexURL: config.pyodide });
    status("Loading the course's cost models…");
    for (const folder of ["", ...config.folders]) {
      pyodide.FS.mkdirTree(`/home/pyodide/labkit/${folder}`);
    }
    const base = new URL("../_static/labkit/", window.location.href);
    await Promise.all(config.modules.map(async (name) => {
      const response = await fetch(new URL(`${name}.py`, base));
      if (!response.ok) throw new Error(`could not load labkit/${name}.py`);
      pyodide.FS.writeFile(`/home/pyodide/labkit/${name}.py`, await response.text());
    }));
    answer = pyodide.runPython(`
import json, sys
sys.path.insert(0, "/home/pyodide")
from labkit.predict import sizing

def answer(text):
    try:
        return json.dumps({"ok": sizing.run(json.loads(text))})
    except sizing.SizingError as error:
        return json.dumps({"error": str(error)})
    except Exception as error:   # a bug, not the reader's input: one line all the same
        return json.dumps({"error": f"internal error: {type(error).__name__}: {error}"})
answer
`);
    $("sizing-form").addEventListener("submit", (event) => {
      event.preventDefault();
      compute();
    });
    $("sizing-submit").disabled = false;
    if (compute()) {
      const seconds = (performance.now() - started) / 1000;
      $("sizing-results").dataset.firstResultS = seconds.toFixed(2);
      status(`Ready: Python loaded and the first answer computed in ${fmt(seconds)} s.`);
    } else {
      status("Ready.");
    }
  }

  main().catch((error) => {
    status("Python could not be loaded here.");
    showError(String(error.message || error));
  });
})();
