"""How long `make test` took, in the build's units (COURSE.md, the budget: 150 units from a
fresh clone, setting up the environment included).

`make test` writes its start time first (`--start`), before the environment exists, and
calls this again last; the unit is the one the book build measured (scripts/book_cache.py).
It prints the figure and never fails: a busy machine must not fail the build, and the
status page shows each chapter's units against its own budget. Where /proc/stat is there
(Linux), it also prints how busy the machine's cores were meanwhile, and the least `make
test` could take if that work kept every core busy: what a better order of the same work
could still gain, and what only less work can.

    python3 scripts/make_test_units.py --start     # first
    .venv/bin/python scripts/make_test_units.py    # last
"""

import json
import os
import sys
import time

from book_cache import REPO, STATE   # the unit's record, where the book build keeps it

START = REPO / "_build" / "make_test_start"
UNIT = REPO / "_build" / ".jupyter_cache" / STATE
BUDGET_UNITS = 150


def cpu_seconds():
    """(seconds the machine's cores spent busy, and in all), since boot, or None."""
    try:
        fields = [int(field) for field in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user, nice, system, irq, softirq; of the rest, idle, iowait and steal (the time a
    # virtual machine's host gave to another) are not work done here
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    ticks = os.sysconf("SC_CLK_TCK")
    return busy / ticks, sum(fields[:8]) / ticks


def main():
    if sys.argv[1:] == ["--start"]:
        START.parent.mkdir(parents=True, exist_ok=True)
        START.write_text(json.dumps({"time": time.time(), "cpu": cpu_seconds()}) + "\n")
        return
    if not START.is_file() or not UNIT.is_file():
        print("make test: no start time or no unit measured: its units are not known")
        return
    start = json.loads(START.read_text())
    wall = time.time() - start["time"]
    state = json.loads(UNIT.read_text())
    units = wall / state["unit_s"]
    print(f"make test: {wall:.0f} s = {units:.1f} units of {state['unit_s']:.2f} s "
          f"(the unit measured {state['measured']}); the budget from a fresh clone is "
          f"{BUDGET_UNITS} units" + ("" if units <= BUDGET_UNITS else ": OVER BUDGET"))
    now = cpu_seconds()
    if start["cpu"] and now:
        busy, total = now[0] - start["cpu"][0], now[1] - start["cpu"][1]
        cores = os.cpu_count()
        print(f"make test: the machine's {cores} cores were busy {cores * busy / total:.2f} "
              f"of {cores} on average ({busy:.0f} CPU-seconds); that work on every core "
              f"without a pause: {busy / cores:.0f} s = {busy / cores / state['unit_s']:.1f} "
              f"units")


if __name__ == "__main__":
    main()
