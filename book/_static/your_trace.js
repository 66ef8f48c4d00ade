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
                "exposed", "overlap", "memory copies", "idle", "bubble", "collectives a step"],
          result.ranks.map((r) => [r.rank, r.kind, r.steps, ms(r.step_s), ms(r.compute_s),
                                   ms(r.communication_s), ms(r.exposed_communication_s),
                                   pct(r.overlap_fraction), ms(r.memory_copy_s), ms(r.idle_s),
                                   pct(r.bubble_fraction),
                                   Object.entries(r.collectives_per_step)
                                     .map(([k, v]) => `${k} ${count(v)}`).join(", ") || "none"]));
    drawTimelines(out, result.timelines);
    const byGroup = document.createElement("h3");
    byGroup.textContent = "Each rank's collectives, by process group";
    out.appendChild(byGroup);
    const rows = [];
    result.ranks.forEach((r) => r.collective_table.forEach((c) => rows.push([
      r.rank, c.group, c.kind, count(c.per_step), bytes(c.bytes),
      c.median_s === null ? "–" : ms(c.median_s), gbps(c.busbw_bytes_per_s),
      ms(r.exposed_by_group_s[c.group] || 0)])));
    table(out, ["rank", "group", "kind", "a step", "message (median)", "duration (median)",
                "bus bandwidth (median)", "group's exposed a step"], rows);
    const s = result.stragglers;
    if (s.matched) {
      const note = document.createElement("p");
      note.id = "trace-stragglers";
      const by = s.by_rank;
      note.textContent = `Across ranks, ${s.matched} collectives matched (the k-th of each ` +
        "group on every rank). Last to arrive: " + Object.entries(by)
          .map(([rank, b]) => `rank ${rank} ${b.last}×, others waited ${ms(b.caused_wait_s)} for it`)
          .join("; ") + (s.straggler === null ? "." : `. The straggler: rank ${s.straggler}.`);
      out.appendChild(note);
    }
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
    // each parallelism's exposed communication: the trace's from the process groups that
    // torch's DeviceMesh names (mesh_tp, mesh_dp_shard, ...), the planner's own parts
    const byPart = ["tp", "pp", "dp", "cp", "ep"]
      .filter((part) => slowest.exposed_by_part_s[part] !== undefined || p.exposed_by_part_s[part] > 0)
      .map((part) => [`… of which ${part}`, slowest.exposed_by_part_s[part] === undefined ? "–" :
                      ms(slowest.exposed_by_part_s[part]), ms(p.exposed_by_part_s[part])]);
    table(out, ["per step", "your trace", "planner"], [
      ["step", ms(slowest.step_s), ms(p.step_s)],
      ["computing", ms(slowest.compute_s), ms(p.compute_s)],
      ["exposed communication", ms(slowest.exposed_communication_s),
       ms(p.exposed_communication_s)],
      ...byPart,
      ["pipeline bubble", bubbleTrace, ms(p.bubble_s)],
    ]);
    const command = document.createElement("p");
    const code = document.createElement("code");
    code.textContent = p.command;
    command.append("The same prediction from the command line: ", code);
    out.appendChild(command);
  }

  const bytes = (b) => (b === null || b === undefined) ? "–" :
    b >= 2 ** 20 ? (b / 2 ** 20).toFixed(1) + " MiB" : (b / 2 ** 10).toFixed(1) + " KiB";
  const gbps = (x) => (x === null || x === undefined) ? "–" : (x / 1e9).toFixed(1) + " GB/s";

  // Each rank's profiled steps on one time axis: computing above, communicating below
  // (red where nothing computed), memory copies beside them, as the traces chapter draws it.
  function drawTimelines(target, timelines) {
    if (!timelines || !timelines.length) return;
    const ns = "http://www.w3.org/2000/svg";
    const end = Math.max(...timelines.map((t) => t.offset_ms + Math.max(0,
      ...["compute", "communication", "memory_copy"].flatMap((k) => t[k].map((i) => i[1])))));
    const width = 720, row = 36, left = 56, height = row * timelines.length + 28;
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("id", "trace-timeline");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("width", "100%");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "Each rank's profiled steps: computing, communicating, " +
                     "exposed communication and memory copies over time");
    const x = (t) => left + (width - left - 8) * t / (end || 1);
    const rect = (t, y, h, color) => {
      const r = document.createElementNS(ns, "rect");
      r.setAttribute("x", x(t[0]).toFixed(2));
      r.setAttribute("width", Math.max(0.5, x(t[1]) - x(t[0])).toFixed(2));
      r.setAttribute("y", y); r.setAttribute("height", h); r.setAttribute("fill", color);
      svg.appendChild(r);
    };
    const label = (text, px, py, anchor) => {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", px); t.setAttribute("y", py); t.setAttribute("font-size", "11");
      t.setAttribute("text-anchor", anchor || "start");
      t.textContent = text;
      svg.appendChild(t);
    };
    timelines.forEach((t, i) => {
      const y = i * row + 4, shift = (iv) => [iv[0] + t.offset_ms, iv[1] + t.offset_ms];
      label(`rank ${t.rank}`, 0, y + 18);
      t.compute.forEach((iv) => rect(shift(iv), y, 10, "#1f77b4"));
      t.communication.forEach((iv) => rect(shift(iv), y + 12, 10, "#b3b3b3"));
      t.exposed.forEach((iv) => rect(shift(iv), y + 12, 10, "#d62728"));
      t.memory_copy.forEach((iv) => rect(shift(iv), y + 24, 6, "#2ca02c"));
    });
    label("0 ms", left, height - 4);
    label(`${end.toFixed(1)} ms`, width - 8, height - 4, "end");
    const caption = document.createElement("p");
    caption.textContent = "Blue, computing; grey, a collective or transfer under way; red, " +
      "the part of it during which the rank computed nothing; green, memory copies. One " +
      "clock for all ranks (each file's baseTimeNanoseconds added): ranks on different " +
      "hosts line up only as well as their clocks agree.";
    const heading = document.createElement("h3");
    heading.textContent = "The profiled steps, drawn";
    target.append(heading, svg, caption);
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
