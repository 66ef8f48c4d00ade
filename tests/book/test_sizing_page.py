"""The sizing page (book/sizing.md) in a real browser: Debian's Chromium, headless, driven
through its chromedriver, the built site served on a free local port with a local Pyodide
(npm's package at the release _config.yml pins, `make pyodide`) in place of the CDN.

It fills the form with the ZeRO paper's example and reads its four figures, asks the
planner the 70B-on-256-H100s question and compares the answer with labs/plan.py's, gives
a bad input and sees one line, measures the time from page load to the first answer, and
checks that on a phone's width the answer (step time, MFU, total memory) shows without
scrolling the table.
Without Chromium, chromedriver, selenium or the local Pyodide it skips, saying which.
"""

import functools
import http.server
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HTML = REPO / "_build" / "html"
VERSION = re.search(r'sizing_pyodide_version: "([^"]+)"',
                    (REPO / "_config.yml").read_text()).group(1)
PYODIDE = REPO / ".venv" / f"pyodide-{VERSION}"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FIRST_RESULT_GOAL_S = 5.0   # what a reader should wait here, with the local Pyodide

missing = [what for what, present in (
    ("the built page (make book)", (HTML / "book" / "sizing.html").is_file()),
    ("Chromium (apt install chromium)", CHROMIUM),
    ("chromedriver (apt install chromium-driver)", CHROMEDRIVER),
    (f"a local Pyodide {VERSION} (make pyodide, which needs npm)",
     (PYODIDE / "pyodide.js").is_file())) if not present]
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    missing.append("selenium (make venv)")
if missing:
    pytest.skip("the sizing page's browser test needs " + ", ".join(missing),
                allow_module_level=True)


def built_config():
    """The page's configuration as the build wrote it (book/_ext/sizing_page.py)."""
    return json.loads(re.search(r"= (\{.*\});", (
        HTML / "_static" / "sizing-config.js").read_text()).group(1))


# A site built to read offline (make book OFFLINE=1) serves its own Pyodide
SERVES_PYODIDE = not built_config()["pyodide"].startswith(("http:", "https:"))


class Site(http.server.SimpleHTTPRequestHandler):
    """The built site. Where it loads Pyodide from the CDN, Pyodide comes from the local
    copy instead: the page's configuration script is then the one a build with
    sizing_pyodide_dir set would write."""

    def translate_path(self, path):
        if path.startswith("/pyodide/"):
            return str(PYODIDE / path[len("/pyodide/"):].split("?")[0])
        return super().translate_path(path)

    def do_GET(self):
        if self.path.split("?")[0] == "/_static/sizing-config.js" and not SERVES_PYODIDE:
            config = built_config()
            body = f"window.SIZING_CONFIG = {json.dumps({**config, 'pyodide': '/pyodide/'})};"
            self.send_response(200)
            self.send_header("Content-Type", "text/javascript")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site():
    handler = functools.partial(Site, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)   # a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/book/sizing.html"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1400"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def ready(driver, timeout=60):
    """Wait until Python has loaded and answered once; the seconds the page measured."""
    WebDriverWait(driver, timeout).until(
        lambda d: d.find_element(By.ID, "sizing-results").get_attribute("data-first-result-s")
        or d.find_element(By.ID, "sizing-error").is_displayed())
    error = driver.find_element(By.ID, "sizing-error")
    assert not error.is_displayed(), error.text
    return float(driver.find_element(By.ID, "sizing-results").get_attribute("data-first-result-s"))


def fill(driver, **values):
    for name, value in values.items():
        element = driver.find_element(By.NAME, name)
        if element.tag_name == "select":
            Select(element).select_by_value(value)
        else:
            element.clear()
            element.send_keys(value)
    driver.find_element(By.ID, "sizing-submit").click()


def table_rows(driver, table_id):
    """Each body row of a result table as {header: cell text}: the tests read a column by
    its name, whatever its place."""
    table = driver.find_element(By.ID, table_id)
    headers = [cell.text for cell in table.find_elements(By.CSS_SELECTOR, "thead th")]
    return [dict(zip(headers, (cell.text for cell in row.find_elements(By.TAG_NAME, "td"))))
            for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")]


def narrow(driver, width):
    """A viewport `width` CSS pixels wide, as a phone's: headless Chromium keeps a window
    at least 500 px wide, so the page is given the width through DevTools instead."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": width < 500})
    assert driver.execute_script("return window.innerWidth") == width


@pytest.fixture(scope="module")
def page(site, browser):
    """The page, loaded once for this file's tests (loading Pyodide is most of a test's
    time): the seconds from its load to its first answer."""
    browser.get(site)
    return ready(browser)


def test_the_page_answers_first_within_the_goal(page, browser):
    first = page
    print(f"\nsizing page: first answer {first:.2f} s after load (local Pyodide {VERSION})")
    assert "Traceback" not in browser.page_source
    assert first < 60   # loaded at all; the goal is reported, a busy machine may miss it
    if first > FIRST_RESULT_GOAL_S:
        print(f"sizing page: above the {FIRST_RESULT_GOAL_S:g} s goal on this machine")


def test_a_site_that_reads_offline_loads_pyodide_from_itself(page, browser, site):
    if not SERVES_PYODIDE:
        pytest.skip("this site loads Pyodide from the CDN (make book OFFLINE=1 serves it)")
    origin = site.split("/book/")[0] + "/"
    requested = browser.execute_script(
        "return performance.getEntriesByType('resource').map((entry) => entry.name)")
    assert any(url.startswith(origin + "_static/pyodide/") for url in requested), requested
    assert [url for url in requested if not url.startswith(origin)] == []


def test_the_zero_papers_example(page, browser):
    """Rajbhandari et al.'s 7.5B parameters on 64 GPUs with Adam in mixed precision:
    120, 31.4, 16.6 and 1.9 GB of model states per GPU."""
    fill(browser, model="params", params="7.5B", gpus="64", precision="mixed",
         optimizer="adam")
    rows = table_rows(browser, "sizing-memory")
    assert {row[""]: row["total GB"] for row in rows} == {"DDP": "120.0", "ZeRO-1": "31.4",
                                                 "ZeRO-2": "16.6", "ZeRO-3": "1.9"}


def test_the_planner_agrees_with_the_command_line(page, browser, capsys):
    import plan   # labs/ is on the path (tests/conftest.py)
    fill(browser, model="llama3-70b", gpus="256", global_batch_tokens="4M", layout="")
    first_row = table_rows(browser, "sizing-best")[0]
    plan.main(["--model", "llama3-70b", "--gpus", "256", "--global-batch-tokens", "4M",
               "--json"])
    best = json.loads(capsys.readouterr().out)["configurations"][0]
    label = f"tp {best['tp']} · pp {best['pp']} · dp {best['dp']}"
    if best["chunks"] > 1:
        label += f", v {best['chunks']}"
    assert first_row["layout"] == label
    assert first_row["recompute"] == best["recompute"]
    assert first_row["step s"] == f"{best['time_s']['step']:.2f}"


def test_bad_input_is_one_line_in_the_form(page, browser):
    fill(browser, gpus="many")
    error = browser.find_element(By.ID, "sizing-error")
    WebDriverWait(browser, 10).until(lambda d: error.is_displayed())
    assert error.text == "gpus: 'many' is not a whole number"
    fill(browser, gpus="256", layout="tp=3,pp=1,dp=1")
    assert "does not fit: dp x tp x pp x cp = 3, not the 256 GPUs" in browser.find_element(
        By.ID, "sizing-layout").text
    assert "Traceback" not in browser.page_source


# What the page answers, by table: a reader must see these without scrolling the table
ANSWER_COLUMNS = {"sizing-best": ("layout", "step s", "MFU"), "sizing-memory": ("", "total GB")}


@pytest.mark.parametrize("width", (1280, 390))
def test_the_answer_shows_without_scrolling_the_table(page, browser, width):
    """At a desktop's and at a phone's width the answer's columns lie inside the window
    (they come first), and the column that names each row stays in view when the rest of
    a wide table is scrolled. The page is not reloaded: only its layout changes."""
    fill(browser, model="llama3-70b", gpus="256", global_batch_tokens="4M", layout="")
    narrow(browser, width)
    try:
        for table_id, names in ANSWER_COLUMNS.items():
            seen = browser.execute_script("""
                const table = document.getElementById(arguments[0]);
                const box = table.parentElement;
                const place = (cell) => { const r = cell.getBoundingClientRect();
                                          return [cell.textContent, r.left, r.right]; };
                const headers = [...table.querySelectorAll("thead th")].map(place);
                box.scrollLeft = box.scrollWidth;   // as far right as a reader can scroll
                const held = place(table.querySelector("tbody td"));
                box.scrollLeft = 0;
                return {headers, held, view: document.documentElement.clientWidth,
                        scrolls: box.scrollWidth > box.clientWidth};""", table_id)
            where = {text: (left, right) for text, left, right in seen["headers"]}
            for name in names:
                left, right = where[name]
                assert 0 <= left and right <= seen["view"] + 0.5, (
                    f"{table_id}: column {name!r} at {left:.0f}-{right:.0f} px, "
                    f"outside the {seen['view']} px window at {width} px")
            if seen["scrolls"]:
                assert seen["held"][1] >= 0, f"{table_id}: its first column scrolled away"
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
