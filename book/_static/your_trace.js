// The trace page: hands the reader's files and the run's fields to trace_worker.js, where
// Pyodide runs the course's trace reader and planner, and draws what comes back. Nothing
// is computed here and nothing leaves the browser.
(function () {
  "use strict";
  const config = window.SIZING_CONFIG;
  const $ = (id) => document.getElementById(id);
  let worker = null, ready = false;

  function status(text) { $("trace-status").textContent = text; }
  function showError(text) {
    $("trace-error").textContent = text;
    $("trace-error").hidden = !text;
  }
  const ms = (s) => (1e3 * s).toLocaleString("en-US", { maximumFractionDigits: 1,
                                                        minimumFractionDigits: 1 }) + " ms";
  const pct = (f) => (f === null || f === undefined) ? "–" : (100 * f).toFixed(0) + " %";
  const count = (x) => Number.isInteger(x) ? String(x) : x.toFixed(1);

  function table(target, headers, rows) {
    const wrapper = document.createElement("div");
    wrapper.className = "sizing-table";
    const t = document.createElement("table");
    const head = t.createTHead().insertRow();
    headers.forEach((h) => { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); });
    const body = t.createTBody();
    rows.forEach((r) => {
      const row = body.insertRow();
      r.forEach((v) => { row.insertCell().textContent = v; });
    });
    wrapper.appendChild(t);
    target.appendChild(wrapper);
  }

  function render(result) {
    const out = $("trace-results");
    out.replaceChildren();
    const heading = document.createElement("h3");
    heading.textContent = "Per rank, per profiled step";
    out.appendChild(heading);
    table(out, ["rank", "kind", "steps", "step", "computing", "communicating",
                "exposed", "overlap", "idle", "bubble", "collectives a step"],
          result.ranks.map((r) => [r.rank, r.kind, r.steps, ms(r.step_s), ms(r.compute_s),
                                   ms(r.communication_s), ms(r.exposed_communication_s),
                                   pct(r.overlap_fraction), ms(r.idle_s), pct(r.bubble_fraction),
                                   Object.entries(r.collectives_per_step)
                                     .map(([k, v]) => `${k} ${count(v)}`).join(", ") || "none"]));
    const p = result.prediction;
    if (!p) return;
    const slowest = result.ranks.reduce((a, b) => (b.step_s > a.step_s ? b : a));
    const h = document.createElement("h3");
    h.textContent = "Beside the planner's prediction";
    out.appendChild(h);
    const layout = p.layout;
    const note = document.createElement("p");
    note.textContent = `${p.named ? "Your layout" : "The planner's best layout"}: ` +
      `tp=${layout.tp}, pp=${layout.pp}, dp=${layout.dp}, cp=${layout.cp}, ep=${layout.ep}, ` +
      `${layout.zero}, micro-batch ${layout.micro_batch} × ${layout.microbatches}, ` +
      `recompute ${layout.recompute}, on H100 SXM nodes. Your trace: rank ${slowest.rank}, ` +
      "the slowest.";
    out.appendChild(note);
    const bubbleTrace = slowest.bubble_fraction === null ? "–" :
      ms(slowest.bubble_fraction * slowest.step_s);
    table(out, ["per step", "your trace", "planner"], [
      ["step", ms(slowest.step_s), ms(p.step_s)],
      ["computing", ms(slowest.compute_s), ms(p.compute_s)],
      ["exposed communication", ms(slowest.exposed_communication_s),
       ms(p.exposed_communication_s)],
      ["pipeline bubble", bubbleTrace, ms(p.bubble_s)],
    ]);
    const command = document.createElement("p");
    const code = document.createElement("code");
    code.textContent = p.command;
    command.append("The same prediction from the command line: ", code);
    out.appendChild(command);
  }

  function fields() {
    const data = {};
    new FormData($("trace-run")).forEach((value, key) => { data[key] = value; });
    if (!data.model) return {};   // no run named: the traces alone
    return data;
  }

  function read(files) {
    if (!ready || !files.length) return;
    showError("");
    $("trace-results").replaceChildren();
    $("trace-results").dataset.state = "reading";
    status(`Reading ${files.length} file${files.length > 1 ? "s" : ""}…`);
    worker.postMessage({ type: "analyze", files: Array.from(files), fields: fields() });
  }

  function main() {
    if (!config) { status("The page's configuration did not load."); return; }
    worker = new Worker(new URL("../_static/trace_worker.js", window.location.href));
    worker.onmessage = (event) => {
      const m = event.data;
      if (m.type === "ready") {
        ready = true;
        $("trace-files").disabled = false;
        status("Ready: choose or drop your traces, one per rank.");
      } else if (m.type === "progress") {
        status(m.text);
      } else if (m.type === "failed") {
        status(ready ? "Ready." : "Python could not be loaded here: `python labs/trace.py " +
               "analyze` reads the same traces from the command line.");
        showError(m.text);
        $("trace-results").dataset.state = "error";
      } else if (m.type === "result") {
        if (m.reply.error) {
          showError(m.reply.error);
          status("Ready.");
          $("trace-results").dataset.state = "error";
          return;
        }
        render(m.reply.ok);
        $("trace-results").dataset.state = "done";
        status(`Read in ${m.seconds.toFixed(1)} s.`);
      }
    };
    worker.onerror = (event) => {
      showError(`The reader stopped: ${event.message || "out of memory?"}`);
      $("trace-results").dataset.state = "error";
    };
    const base = new URL("../_static/labkit/", window.location.href).href;
    const pyodide = new URL(config.pyodide, window.location.href).href;
    worker.postMessage({ type: "init", config: { ...config, pyodide, base } });
    status(`Loading Python (Pyodide ${config.version})…`);
    $("trace-files").addEventListener("change", (e) => read(e.target.files));
    const zone = $("trace-drop");
    zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (e) => {
      e.preventDefault();
      zone.classList.remove("over");
      read(e.dataTransfer.files);
    });
    $("trace-run").addEventListener("submit", (e) => {
      e.preventDefault();
      read($("trace-files").files);
    });
  }

  main();
})();
