"""What a chapter needs besides its labs: its first cell is

    import sys; sys.path.insert(0, "../labs")    # labs/, from book/ or _notebooks/
    from labkit.runtime.notebook import run_lab, glue, table, plt, np

  run_lab        launch a lab under torchrun and get its JSON back (labkit.runtime.launch)
  lab_failure    launch a lab that must fail (a pitfall) and get the line that says why
                 (and, in .output, all it printed)
  glue           put a number computed in a cell into the prose, {glue:text}`name`
  table          a Markdown table from a header and rows
  gpu_references the GPU references of some labs under results/, each figure beside its
                 prediction, or a line saying none is recorded (labkit.runtime.references)
  format_bytes, format_percent, format_seconds   numbers written as a person would
  LABS           the labs folder, for a process that needs the path (ipyparallel engines)

Importing it also sets the book's plot style: figures sized for the page and fonts large
enough to read on a phone, where a figure shrinks to 360 pixels; and `plt.show()` then
refuses a figure with text too small to read there (phone_text_too_small).
"""

import numbers
import re

import matplotlib.pyplot as plt
import numpy as np
from IPython import get_ipython
from IPython.display import Markdown
from myst_nb import glue as _myst_glue

from . import references
from .launch import LABS_DIR as LABS
from .launch import LabError, keep_a_spare_python, run_lab

__all__ = ["LABS", "Markdown", "lab_failure", "format_bytes", "format_percent", "format_seconds", "glue",
           "gpu_references", "np", "plt", "run_lab", "table"]

# In a notebook's kernel, each launch finds a Python that imported torch while the kernel
# worked (labkit.runtime.spare_python); a script or a test importing this does not.
if getattr(get_ipython(), "kernel", None) is not None:
    keep_a_spare_python()

# A 6-inch figure at 144 dots per inch is 864 pixels wide: sharp on a desktop page, and
# on a phone, shrunk to about 360 pixels, 10.5-point text is still about 9 pixels tall.
plt.rcParams.update({
    "figure.figsize": (6.0, 3.8),
    "figure.dpi": 144,
    "savefig.dpi": 144,
    "figure.constrained_layout.use": True,
    "font.size": 10.5,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10.5,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 9.5,
    "legend.framealpha": 0.85,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "lines.markersize": 5,
})


# What a phone shows of a figure: the column of a 390-pixel-wide screen, 358 CSS pixels, the
# figure shrunk to fit; text smaller than PHONE_MIN_TEXT_PX there cannot be read without
# zooming (the book's 10-point labels on a 6-inch figure come out at 8.3)
PHONE_COLUMN_PX = 358
PHONE_MIN_TEXT_PX = 7.5


def phone_text_too_small(fig):
    """[(text, its height in CSS pixels on a phone)] of every visible text of `fig` drawn
    smaller than PHONE_MIN_TEXT_PX once the figure is shrunk to a phone's column."""
    width_px = fig.get_figwidth() * fig.dpi
    scale = min(1.0, PHONE_COLUMN_PX / width_px)
    small = []
    for text in fig.findobj(lambda artist: isinstance(artist, plt.Text)):
        if text.get_visible() and text.get_text().strip():
            px = text.get_fontsize() * fig.dpi / 72 * scale
            if px < PHONE_MIN_TEXT_PX:
                small.append((text.get_text(), round(float(px), 1)))
    return small


def _show_readable(*args, **kwargs):
    """plt.show, once every open figure's text reads on a phone (else the cell fails)."""
    for number in plt.get_fignums():
        if small := phone_text_too_small(plt.figure(number)):
            raise AssertionError(
                f"figure text below {PHONE_MIN_TEXT_PX} px on a phone's "
                f"{PHONE_COLUMN_PX}-px column: {small[:5]} (a larger font, or a narrower figure)")
    return _show(*args, **kwargs)


_show, plt.show = plt.show, _show_readable


def glue(name, value):
    """Glue `value` under `name` for the prose ({glue:text}`name:.2f`), showing nothing here.

    NumPy scalars become plain Python numbers first: glued as they are, they render as
    `np.float64(...)` and break the format specifications of {glue:text}."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
    _myst_glue(name, value, display=False)


def table(header, rows):
    """A Markdown table from a header and rows of cells (formatted already, or anything
    whose str() reads well). A number stays whole on a narrow screen (keep_whole)."""
    lines = ["| " + " | ".join(map(keep_whole, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(keep_whole(cell) for cell in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


def gpu_references(*labs):
    """The "On a GPU box" section's references of `labs` (make gpu-references), as Markdown."""
    return Markdown("\n\n".join(references.section(lab) for lab in labs))


def keep_whole(cell):
    """A table cell's text with no line break inside a number: a browser may break after
    the hyphen of 3.0e-08, at the dash of 4.97–5.75 and at the space of 17.2 GB, so the
    exponent's minus becomes a non-breaking hyphen, the range's dash is joined to its
    numbers, and a number keeps its unit (a no-break space)."""
    text = str(cell)
    text = re.sub(r"(?<=\d)e-(?=\d)", "e\u2011", text)
    text = re.sub(r"(?<=\d)–(?=\d)", "\u2060–\u2060", text)
    return re.sub(r"(?<=\d) (?=(?:[kMGTP]?B(?:/s)?|ms|µs|s|%)(?!\w))", "\u00a0", text)


def _three_digits(value):
    """A positive number with three significant digits and no exponent: 519, 3.7, 0.0123."""
    text = f"{value:.3g}"
    if "e" in text:   # 3 digits of a value >= 1000 give 1.23e+03: write it out instead
        text = f"{value:.0f}"
    return text


def format_bytes(count):
    """Bytes in decimal units (1 GB = 10^9 bytes, as the ZeRO paper and GPU datasheets
    count): 518_656_000_000 -> "519 GB", 3_700_000 -> "3.7 MB", 640 -> "640 B"."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{_three_digits(count / size)} {unit}"
    return f"{count:g} B"


def format_percent(fraction):
    """A share as a percentage that never rounds a small share away: 0.001 -> "0.1 %",
    0.0123 -> "1.2 %", 0.5 -> "50 %"."""
    percent = 100 * fraction
    if percent == 0 or abs(percent) >= 10:
        return f"{percent:.0f} %"
    if abs(percent) >= 1:
        return f"{percent:.1f} %"
    return f"{percent:.2g} %"


def format_seconds(seconds):
    """A duration in the unit that suits it: 4.2e-5 -> "42 µs", 0.0123 -> "12.3 ms",
    2.5 -> "2.5 s"."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= size:
            return f"{_three_digits(seconds / size)} {unit}"
    return f"{_three_digits(seconds / 1e-9)} ns"


class LabFailure(str):
    """The lines in which a failed lab said why (a str, so print() shows them), with
    `.output`: everything it printed, for what else it said (a dump of its stacks)."""

    def __new__(cls, said, output):
        failure = super().__new__(cls, said)
        failure.output = output
        return failure


def lab_failure(lab, nproc=1, args=(), env=None):
    """Run a lab that is meant to fail, and return the lines in which it said why (its own
    error lines, which LabError's message lists first) as a LabFailure; if it succeeds
    instead, raise, so that the chapter (and the build) fails."""
    try:
        run_lab(lab, nproc, args, env=env, echo=False)
    except LabError as error:
        lines = str(error).splitlines()
        said = []
        if len(lines) > 1 and lines[1] == "Its errors:":
            for line in lines[2:]:
                if not line.startswith("  "):
                    break   # "Its output (...)": the tail of everything it printed
                said.append(line.strip())
        return LabFailure("\n".join(said or lines[:1]), error.output)
    raise AssertionError(f"{lab} {' '.join(map(str, args))} was expected to fail and did not")
