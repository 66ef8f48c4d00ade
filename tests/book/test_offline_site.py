"""The site built to read offline (`make book OFFLINE=1`, which `make test` builds where npm
is present), in Debian's Chromium with every host but this machine unresolvable: a GPU
cluster without internet access, as a reader there would open it.

- No page requests anything outside the site: the browser's own list of what each page
  loaded (Resource Timing) holds only the site's address.
- Every equation renders, at 1280 and at 390 px: as many MathJax containers as the page
  has equations, no MathJax error, no raw TeX left in the text.
- Each displayed equation, each table, each figure and each table a cell printed (its rows
  kept whole, its other lines wrapped) fits its column, or scrolls sideways in its own box: the box lies inside the column and every box around it that clips (the theme's
  numbered equations clip what overflows them), it really scrolls, and it says so with a
  scroll bar that takes room or a shadow at its edge (a phone overlays its scroll bars).

The sizing page's own test checks that it answers with the site's Pyodide (test_sizing_page).

Without the offline build (no npm), Chromium, chromedriver or selenium it skips, saying which.
"""

import functools
import http.server
import re
import shutil
import threading

import pytest

from test_sizing_page import HTML   # skips alike when the browser is missing

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# the pages load the site's MathJax (a copy left in _static/ by an earlier offline build
# does not make an online build offline: its pages would wait on the CDN)
if not ((HTML / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()
        and "_static/mathjax/tex-mml-chtml.js" in (HTML / "book" / "intro.html").read_text()):
    pytest.skip("the offline site's test needs the site built with make book OFFLINE=1 "
                "(npm for MathJax and Pyodide)", allow_module_level=True)

from selenium import webdriver   # noqa: E402 (after the skip: test_sizing_page checked it)
from selenium.webdriver.chrome.options import Options   # noqa: E402
from selenium.webdriver.chrome.service import Service   # noqa: E402

WIDTHS = (1280, 390)
# The pages with mathematics, and how many equations each has (Sphinx writes each one as a
# span.math or a div.math holding \(...\) or \[...\]), read from the built files
PAGES = {path.relative_to(HTML).as_posix(): count for path in sorted(HTML.glob("book/*.html"))
         if (count := len(re.findall(r'class="math[" ]', path.read_text())))}
# the pages with tables, or figures, whose width is checked alike
TABLE_PAGES = [path.relative_to(HTML).as_posix() for path in sorted(HTML.glob("book/*.html"))
               if "<table" in path.read_text() or "<figure" in path.read_text()]


class QuietSite(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def origin():
    handler = functools.partial(QuietSite, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)   # a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     f"--window-size={WIDTHS[0]},1000",
                     # no name resolves but this machine's: a request outside fails, as
                     # on a cluster without internet (and the check below names it)
                     "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                     "--disable-background-networking", "--disable-component-update"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


# In the page: wait until MathJax has typeset it, then report what a reader would see
TYPESET = """
const done = arguments[arguments.length - 1];
const start = Date.now();
(function wait() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done(true), (e) => done(String(e)));
  } else if (Date.now() - start > 30000) { done("MathJax never started"); }
  else { setTimeout(wait, 50); }
})();
"""

REPORT = """
const article = document.querySelector("article") || document.body;
// text a reader sees outside code, MathJax's own output and scripts: raw TeX would be here
const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT, {acceptNode(node) {
  return node.parentElement.closest("pre, code, script, style, mjx-container, .highlight")
    ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT; }});
const raw = [];
while (walker.nextNode()) {
  const text = walker.currentNode.textContent;
  if (/\\\\[(\\[]|\\\\[)\\]]/.test(text)) raw.push(text.trim().slice(0, 80));
}
const column = article.getBoundingClientRect();
// What of `content` a reader cannot see: the part past the right edge of the column or of
// any box around it that clips (overflow other than visible), unless a box between them
// scrolls and shows that it does. Returns "" when all is seen, else why not.
function rightClip(el, stop) {
  let right = column.right;
  for (let box = el.parentElement; box && box !== stop; box = box.parentElement) {
    if (getComputedStyle(box).overflowX !== "visible") {
      right = Math.min(right, box.getBoundingClientRect().right);
    }
  }
  return right;
}
// Whether `el`, a box that scrolls sideways, is seen doing so: "" if so, else why not
function scrollSeen(el) {
  const style = getComputedStyle(el);
  const own = el.getBoundingClientRect();
  // the scrolling box itself must be whole on the page, not cut by a box around it
  if (own.right > rightClip(el, article) + 1) return "its scrolling box is cut off";
  if (el.scrollWidth <= el.clientWidth + 1) return "its box does not scroll";
  const borders = parseFloat(style.borderTopWidth) + parseFloat(style.borderBottomWidth);
  const bar = el.offsetHeight - el.clientHeight - borders;
  const shadow = style.backgroundImage.includes("gradient")
    && style.backgroundAttachment.includes("local");
  if (bar < 4 && !shadow) return "it scrolls with no scroll bar or shadow to show it";
  return "";
}
function unseen(content, outer) {
  const box = content.getBoundingClientRect();
  if (box.width === 0 || box.right <= rightClip(content, article) + 1) return "";
  for (let el = content.parentElement; el && el !== outer.parentElement; el = el.parentElement) {
    if (["auto", "scroll"].includes(getComputedStyle(el).overflowX)) return scrollSeen(el);
  }
  return `cut off ${Math.round(box.right - rightClip(content, article))} px, with nothing to scroll`;
}
const overflowing = [];
for (const eq of article.querySelectorAll('mjx-container[display="true"]')) {
  const why = unseen(eq.firstElementChild || eq, eq.closest("div.math") || eq);
  if (why) overflowing.push(`${eq.textContent.slice(0, 50)}: ${why}`);
}
const tables = [];
for (const table of article.querySelectorAll("table")) {
  const why = unseen(table, table.closest(".pst-scrollable-table-container, .table-wrapper, "
                                          + ".sizing-table") || table.parentElement);
  if (why) tables.push(`${(table.querySelector("caption, th") || table).textContent
                         .trim().slice(0, 50)}: ${why}`);
}
// a figure's image is seen whole: it fits the column (a phone shrinks it, and the reader
// zooms), or scrolls and shows it
const figures = [];
for (const img of article.querySelectorAll("figure img")) {
  const why = unseen(img, img.closest("figure"));
  if (why) figures.push(`${img.alt.slice(0, 50)}: ${why}`);
}
// the rows of a table a cell printed keep their lines (book/_ext/aligned_outputs.py): a row
// wider than the column scrolls the output's box and shows it; its other lines wrap, so
// that the box scrolls for a row only
const outputs = [];
const aligned = article.querySelectorAll("div.aligned-output pre");
for (const pre of aligned) {
  const rows = [...pre.querySelectorAll("span.output-row")];
  const wraps = rows.length ? getComputedStyle(rows[0]).whiteSpace : "";
  const widest = Math.max(0, ...rows.map((row) => row.getBoundingClientRect().width));
  const scrolls = pre.scrollWidth > pre.clientWidth + 1;
  const why = !rows.length ? "no row marked"
    : wraps !== "pre" ? `its rows wrap (white-space: ${wraps})`
    : scrolls && widest <= pre.clientWidth ? "it scrolls for a line that is not a row"
    : scrolls ? scrollSeen(pre) : "";
  if (why) outputs.push(`${pre.textContent.trim().slice(0, 50)}: ${why}`);
}
return {containers: article.querySelectorAll("mjx-container").length,
        errors: document.querySelectorAll("mjx-merror").length,
        raw, overflowing, tables, figures, outputs, aligned: aligned.length,
        requested: performance.getEntriesByType("resource").map((entry) => entry.name)};
"""


def narrow(driver, width):
    """A viewport `width` CSS pixels wide, as a phone's: headless Chromium keeps a window
    at least 500 px wide, so the page is given the width through DevTools instead."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": width < 500})
    assert driver.execute_script("return window.innerWidth") == width


@pytest.fixture(scope="module")
def seen(origin, browser):
    """Each page with equations, typeset at each width: what the page showed and loaded.
    A page is loaded once and the window narrowed: MathJax's output is the same, the
    layout is what changes."""
    browser.set_script_timeout(60)
    reports = {}
    for page in sorted(set(PAGES) | set(TABLE_PAGES)):
        narrow(browser, WIDTHS[0])
        browser.get(f"{origin}/{page}")
        # a page without mathematics loads no MathJax: nothing to wait for
        typeset = browser.execute_async_script(TYPESET) if page in PAGES else None
        for width in WIDTHS:
            narrow(browser, width)
            reports[page, width] = {"typeset": typeset, **browser.execute_script(REPORT)}
    return reports


def test_the_pages_with_equations_are_found():
    assert len(PAGES) >= 10 and sum(PAGES.values()) > 100, PAGES


def test_every_equation_renders(seen):
    for (page, width), report in seen.items():
        if page not in PAGES:
            continue
        where = f"{page} at {width} px"
        assert report["typeset"] is True, f"{where}: {report['typeset']}"
        assert report["errors"] == 0, f"{where}: {report['errors']} MathJax errors"
        assert report["containers"] == PAGES[page], where
        assert report["raw"] == [], f"{where}: raw TeX {report['raw']}"


def test_each_displayed_equation_fits_or_scrolls_in_its_own_box(seen):
    for (page, width), report in seen.items():
        assert report["overflowing"] == [], f"{page} at {width} px: {report['overflowing']}"


def test_each_table_fits_or_scrolls_in_its_own_box(seen):
    assert len(TABLE_PAGES) >= 10, TABLE_PAGES
    for (page, width), report in seen.items():
        assert report["tables"] == [], f"{page} at {width} px: {report['tables']}"


def test_each_figure_fits_or_scrolls_in_its_own_box(seen):
    assert sum(1 for page in TABLE_PAGES if "<figure" in (HTML / page).read_text()) >= 10
    for (page, width), report in seen.items():
        assert report["figures"] == [], f"{page} at {width} px: {report['figures']}"


def test_each_output_table_keeps_its_rows_and_scrolls_in_its_own_box(seen):
    assert sum(1 for (_, width), report in seen.items()
               if width == WIDTHS[0] and report["aligned"]) >= 5
    for (page, width), report in seen.items():
        assert report["outputs"] == [], f"{page} at {width} px: {report['outputs']}"


def test_no_page_requests_anything_outside_the_site(origin, seen):
    for (page, _), report in seen.items():
        outside = [url for url in report["requested"] if not url.startswith(origin + "/")]
        assert outside == [], f"{page}: {outside}"
    assert any("/_static/mathjax/" in url for report in seen.values()
               for url in report["requested"])
