// The trace page's worker: Pyodide and the course's trace reader run here, off the page's
// thread, so that a trace of hundreds of megabytes never freezes the page. Each file is
// read (and gunzipped, if it is a .gz), parsed, and slimmed to the complete events with the
// fields the reader uses before it reaches Python (labkit.predict.trace_page says which).
"use strict";
let answer = null;   // the Python function, once loaded
// The longest string V8 holds (String::kMaxLength, 2^29 - 24 characters on 64-bit; node's
// buffer.constants.MAX_STRING_LENGTH prints it): a trace's text past it cannot be made
// into one string to parse, in Chrome, so it is refused with one line, counted after
// unzipping (the command line, labs/trace.py, reads any size). Firefox allows longer.
const MAX_CHARS = 2 ** 29 - 24;
// the args the reader reads: the launch's correlation, and a collective's own
const ARGS = ["correlation", "Collective name", "In msg nelems", "Out msg nelems",
  "Group size", "dtype", "Process Group Name", "Process Group Description",
  "Process Group Ranks"];

function progress(text) { postMessage({ type: "progress", text }); }

async function init(config) {
  importScripts(config.pyodide + "pyodide.js");
  const pyodide = await loadPyodide({ indexURL: config.pyodide });
  for (const folder of ["", ...config.folders]) {
    pyodide.FS.mkdirTree(`/home/pyodide/labkit/${folder}`);
  }
  await Promise.all(config.modules.map(async (name) => {
    const response = await fetch(new URL(`${name}.py`, config.base));
    if (!response.ok) throw new Error(`could not load labkit/${name}.py`);
    pyodide.FS.writeFile(`/home/pyodide/labkit/${name}.py`, await response.text());
  }));
  answer = pyodide.runPython(`
import json, sys
sys.path.insert(0, "/home/pyodide")
from labkit.predict import sizing, trace_page, trace_reader

def answer(names, texts, fields):
    try:
        return json.dumps({"ok": trace_page.answer(list(zip(names, texts)), json.loads(fields))})
    except (trace_reader.TraceError, sizing.SizingError) as error:
        return json.dumps({"error": str(error)})
    except Exception as error:   # a bug, not the reader's file: one line all the same
        return json.dumps({"error": f"internal error: {type(error).__name__}: {error}"})
answer
`);
}

function tooLong(name, bytes) {
  return new Error(`${name}: ${(bytes / 2 ** 20).toFixed(0)} MiB of JSON is more than a ` +
    "browser can hold as one string (512 MiB); run python labs/trace.py analyze on it instead");
}

async function textOf(file) {
  const head = new Uint8Array(await file.slice(0, 2).arrayBuffer());
  if (head[0] === 0x1f && head[1] === 0x8b) {   // gzip: torch's tensorboard_trace_handler
    // unzipped chunk by chunk, so that a small .gz that unzips past the limit is refused
    // by its unzipped size, before the browser fails to make it a string
    const reader = file.stream().pipeThrough(new DecompressionStream("gzip")).getReader();
    const chunks = [];
    let bytes = 0;
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      bytes += value.length;
      if (bytes > MAX_CHARS) { await reader.cancel(); throw tooLong(file.name, bytes); }
      chunks.push(value);
    }
    return await new Blob(chunks).text();
  }
  if (file.size > MAX_CHARS) throw tooLong(file.name, file.size);
  return await file.text();
}

// The complete ("X") events, each with the fields the reader reads, and the file's rank.
function slim(text) {
  let trace;
  try {
    trace = JSON.parse(text);
  } catch (error) {
    return text.slice(0, 64);   // not JSON: the reader says so in its own words
  }
  const events = Array.isArray(trace) ? trace : (trace && trace.traceEvents);
  if (!Array.isArray(events)) return JSON.stringify({ other: true });
  const kept = [];
  for (const e of events) {
    if (!e || e.ph !== "X") continue;
    const k = { ph: "X", name: e.name, cat: e.cat, ts: e.ts, dur: e.dur, pid: e.pid, tid: e.tid };
    if (e.args) {
      for (const key of ARGS) {
        if (e.args[key] !== undefined) (k.args = k.args || {})[key] = e.args[key];
      }
    }
    kept.push(k);
  }
  return JSON.stringify({ traceEvents: kept, distributedInfo: trace.distributedInfo || {},
                          baseTimeNanoseconds: trace.baseTimeNanoseconds || 0 });
}

async function analyze(files, fields) {
  const names = [], texts = [];
  for (const file of files) {
    progress(`Reading ${file.name} (${(file.size / 1e6).toFixed(1)} MB)…`);
    let text;
    try {
      text = await textOf(file);
    } catch (error) {
      return { error: String(error.message || error) };
    }
    progress(`Slimming ${file.name}…`);
    names.push(file.name);
    texts.push(slim(text));
  }
  progress("Reading the traces in Python…");
  return JSON.parse(answer(names, texts, JSON.stringify(fields)));
}

self.onmessage = async (event) => {
  const message = event.data;
  try {
    if (message.type === "init") {
      await init(message.config);
      postMessage({ type: "ready" });
    } else if (message.type === "analyze") {
      const started = performance.now();
      const reply = await analyze(message.files, message.fields);
      postMessage({ type: "result", reply, seconds: (performance.now() - started) / 1000 });
    }
  } catch (error) {
    postMessage({ type: "failed", text: String(error.message || error) });
  }
};
