"""The trace page (book/your_trace.md) in a real browser, as the sizing page's test runs it
(Debian's Chromium through its chromedriver, the built site on a free local port, a local
Pyodide): it is handed the traces a two-rank launch of the scaling lab wrote and must show
what labs/trace.py computes from them, the planner's step beside them, one line for a file
that is not a trace, and stay responsive while it reads a large one in its worker; and real
GPU traces from outside the project (tests/data/traces) with their new figures: memory
copies, all-to-alls, the collectives by group, the timeline, the rank waited for."""

import gzip
import json
import time
from pathlib import Path

import pytest

from test_sizing_page import HTML, Site, browser, site   # noqa: F401 (fixtures), skips alike
from labkit.predict import trace_page, trace_reader
from labkit.runtime.launch import run_lab
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

PAGE = "your_trace.html"


# the traces chapter writes its runs' traces here (book/traces.md), before this test runs
CHAPTER_TRACES = HTML.parent / "traces" / "dp"


@pytest.fixture(scope="module")
def lab_traces(tmp_path_factory):
    """The two traces, one per rank, of DDP's profiled steps on two ranks: those the traces
    chapter wrote when it was executed in this build, else a launch of the lab's own."""
    traces = sorted(CHAPTER_TRACES.glob("ddp-strong-n2-rank*.json"))
    if len(traces) != 2:
        folder = tmp_path_factory.mktemp("prof")
        run_lab("scaling", 2, ["--strategy", "ddp", "--steps", 1, "--warmup", 1,
                               "--profile", folder], echo=False)
        traces = sorted(folder.glob("ddp-strong-n2-rank*.json"))
    assert len(traces) == 2
    return traces


@pytest.fixture(scope="module")
def page(site, browser, timeout=60):
    """The page, loaded once for this file's tests (its worker loads Pyodide once)."""
    browser.get(site.replace("sizing.html", PAGE))
    WebDriverWait(browser, timeout).until(
        lambda d: d.find_element(By.ID, "trace-files").is_enabled()
        or d.find_element(By.ID, "trace-error").is_displayed())
    error = browser.find_element(By.ID, "trace-error")
    assert not error.is_displayed(), error.text
    return browser


def hand_over(driver, paths, timeout=120):
    """Give the page the files; wait for its answer; the result's state (done or error)."""
    results = driver.find_element(By.ID, "trace-results")
    files = driver.find_element(By.ID, "trace-files")
    # a file input keeps what it was given before: empty it, and the result's state
    driver.execute_script("arguments[0].value = ''; arguments[1].dataset.state = ''",
                          files, results)
    files.send_keys("\n".join(str(p) for p in paths))
    WebDriverWait(driver, timeout).until(
        lambda d: results.get_attribute("data-state") in ("done", "error"))
    return results.get_attribute("data-state")


def rows(driver, index):
    tables = driver.find_elements(By.CSS_SELECTOR, "#trace-results table")
    return [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in tables[index].find_elements(By.CSS_SELECTOR, "tbody tr")]


def ms(seconds):
    return f"{1e3 * seconds:,.1f} ms"


def test_the_lab_s_traces_read_as_the_command_line_reads_them(page, lab_traces):
    browser = page
    assert hand_over(browser, lab_traces) == "done"
    expected = trace_page.answer([(p.name, p.read_text()) for p in lab_traces], {})["ranks"]
    shown = rows(browser, 0)
    assert [row[0] for row in shown] == ["0", "1"]
    for row, rank in zip(shown, expected):
        assert row[1:4] == ["cpu", str(rank["steps"]), ms(rank["step_s"])]
        assert row[6] == ms(rank["exposed_communication_s"])
        assert row[-1] == "all_reduce 2, broadcast 1"   # the buckets and the buffers, a step
    # the ranks' table and the collectives by group; the planner's only with a model named
    assert len(browser.find_elements(By.CSS_SELECTOR, "#trace-results table")) == 2
    assert "Traceback" not in browser.page_source


def test_the_planner_s_step_stands_beside_the_trace(page, lab_traces):
    browser = page
    fields = {"model": "llama3-8b", "gpus": "8", "global_batch_tokens": "1M",
              "layout": "tp=1,pp=1,dp=8"}
    Select(browser.find_element(By.NAME, "model")).select_by_value(fields["model"])
    for name in ("gpus", "global_batch_tokens", "layout"):
        element = browser.find_element(By.NAME, name)
        element.clear()
        element.send_keys(fields[name])
    assert hand_over(browser, lab_traces) == "done"
    predicted = trace_page.prediction(fields)
    shown = dict((row[0], row[1:]) for row in rows(browser, 2))
    assert shown["step"][1] == ms(predicted["step_s"])
    assert shown["computing"][1] == ms(predicted["compute_s"])
    assert predicted["command"] in browser.find_element(By.ID, "trace-results").text
    Select(browser.find_element(By.NAME, "model")).select_by_value("")   # the traces alone


def test_a_file_that_is_not_a_trace_is_one_line(page, tmp_path):
    browser = page
    not_json = tmp_path / "notes.json"
    not_json.write_text("rank 0 was slow\n")
    assert hand_over(browser, [not_json]) == "error"
    error = browser.find_element(By.ID, "trace-error").text
    assert error == ("notes.json: not a trace (not JSON; torch.profiler's export_chrome_trace "
                     "writes JSON)")
    other = tmp_path / "metrics.json"
    other.write_text(json.dumps({"loss": [2.3, 2.1]}))
    assert hand_over(browser, [other]) == "error"
    assert browser.find_element(By.ID, "trace-error").text.startswith(
        "metrics.json: a trace of another format")


def large_trace(path, events):
    """A CPU trace of two profiled steps with `events` operators and gloo collectives."""
    step_us = events * 10
    records = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}",
                "ts": i * step_us, "dur": step_us, "pid": 1, "tid": 1} for i in (1, 2)]
    filler = {"Input Dims": [[4096, 4096], [4096, 4096]], "Input type": ["float", "float"],
              "Concrete Inputs": ["", ""], "External id": 0, "Record function id": 0}
    for i in range(events):
        on_gloo = i % 10 == 0
        records.append({"ph": "X", "cat": "user_annotation" if on_gloo else "cpu_op",
                        "name": "gloo:all_reduce" if on_gloo else "aten::mm",
                        "ts": step_us + i * 10, "dur": 8, "pid": 1, "tid": 2 if on_gloo else 1,
                        "args": filler})
    path.write_text(json.dumps({"traceEvents": records, "distributedInfo": {"rank": 0}}))
    return path


def test_a_large_trace_leaves_the_page_responsive(page, tmp_path):
    browser = page
    trace = large_trace(tmp_path / "large-rank0.json", 60_000)
    size_mb = trace.stat().st_size / 1e6
    files = browser.find_element(By.ID, "trace-files")
    results = browser.find_element(By.ID, "trace-results")
    browser.execute_script("arguments[0].value = ''; arguments[1].dataset.state = 'reading'",
                           files, results)
    files.send_keys(str(trace))
    slowest = 0.0
    while results.get_attribute("data-state") == "reading":   # the page answers meanwhile
        start = time.perf_counter()
        browser.execute_script("return document.getElementById('trace-status').textContent")
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.1)
    WebDriverWait(browser, 120).until(lambda d: results.get_attribute("data-state") == "done")
    status = browser.find_element(By.ID, "trace-status").text
    print(f"\ntrace page: {size_mb:.0f} MB read; {status}; the page answered within "
          f"{slowest * 1e3:.0f} ms throughout")
    assert slowest < 2.0   # the main thread never blocked on the file
    expected = trace_reader.analyze(json.loads(trace.read_text()))
    assert rows(browser, 0)[0][-1] == f"all_reduce {expected['collectives']['all_reduce'] / 2:g}"


REAL = Path(__file__).parent.parent / "data" / "traces"


def test_real_gpu_traces_show_copies_all_to_alls_groups_and_the_timeline(page):
    """Ranks 0 and 1 of a TorchRec job (HTA's test traces), gzipped as they are kept: the
    page shows what trace_page.answer computes from them, draws both ranks, and names the
    rank the other waited for."""
    browser = page
    paths = [REAL / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
    assert hand_over(browser, paths) == "done"
    expected = trace_page.answer([(p.name, gzip.decompress(p.read_bytes()).decode())
                                  for p in paths], {})
    shown = rows(browser, 0)
    for row, rank in zip(shown, expected["ranks"]):
        assert row[1] == "cuda" and row[6] == ms(rank["exposed_communication_s"])
        assert row[8] == ms(rank["memory_copy_s"]) and row[9] == ms(rank["idle_s"])
        assert row[10] == "–"   # not a pipeline stage: its SendRecv kernels are all-to-alls
        assert row[-1] == "all_gather 1, all_reduce 2, all_to_all 2"
    groups = rows(browser, 1)
    assert [row[:4] for row in groups[:3]] == [["0", "unknown", "all_gather", "1"],
                                               ["0", "unknown", "all_reduce", "2"],
                                               ["0", "unknown", "all_to_all", "2"]]
    timeline = browser.find_element(By.ID, "trace-timeline")
    drawn = sum(len(t[k]) for t in expected["timelines"]
                for k in ("compute", "communication", "exposed", "memory_copy"))
    assert len(timeline.find_elements(By.TAG_NAME, "rect")) == drawn
    assert [t.text for t in timeline.find_elements(By.TAG_NAME, "text")][:2] == [
        "rank 0", "rank 1"]
    straggler = expected["stragglers"]["straggler"]
    assert browser.find_element(By.ID, "trace-stragglers").text.endswith(
        f"The straggler: rank {straggler}.")


def test_a_trace_past_the_browser_s_longest_string_is_refused_in_one_line(page, tmp_path):
    """A .gz of 9 kB that unzips to 600 MiB: refused by its unzipped size, past the 2^29 - 24
    characters Chrome holds in one string, before the browser fails to make it one."""
    path = tmp_path / "huge-rank0.json.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [')
        for _ in range(600):
            f.write(b" " * 2 ** 20)
    assert hand_over(page, [path], timeout=300) == "error"
    error = page.find_element(By.ID, "trace-error").text
    assert error.startswith("huge-rank0.json.gz: ") and "more than a browser can hold" in error
    assert "\n" not in error
