"""How long `make test` took, in the build's units (COURSE.md, the budget: 150 units from a
fresh clone, setting up the environment included).

`make test` writes its start time first (`--start`), before the environment exists, and
calls this again last; the unit is the one the book build measured (scripts/book_cache.py).
It prints the figure and never fails: a busy machine must not fail the build, and the
status page shows each chapter's units against its own budget.

    python3 scripts/make_test_units.py --start     # first
    .venv/bin/python scripts/make_test_units.py    # last
"""

import json
import sys
import time

from book_cache import REPO, STATE   # the unit's record, where the book build keeps it

START = REPO / "_build" / "make_test_start"
UNIT = REPO / "_build" / ".jupyter_cache" / STATE
BUDGET_UNITS = 150


def main():
    if sys.argv[1:] == ["--start"]:
        START.parent.mkdir(parents=True, exist_ok=True)
        START.write_text(f"{time.time()}\n")
        return
    if not START.is_file() or not UNIT.is_file():
        print("make test: no start time or no unit measured: its units are not known")
        return
    wall = time.time() - float(START.read_text())
    state = json.loads(UNIT.read_text())
    units = wall / state["unit_s"]
    print(f"make test: {wall:.0f} s = {units:.1f} units of {state['unit_s']:.2f} s "
          f"(the unit measured {state['measured']}); the budget from a fresh clone is "
          f"{BUDGET_UNITS} units" + ("" if units <= BUDGET_UNITS else ": OVER BUDGET"))


if __name__ == "__main__":
    main()
