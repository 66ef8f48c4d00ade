"""Keep the book's execution cache honest, and measure the build's unit of time.

jupyter-cache (the book's `execute_notebooks: cache`) knows a chapter by its own cells
alone, but a chapter's outputs also depend on what its cells run: the labs, the committed
results it draws, the scripts it starts, the pinned packages. This script hashes those;
when the hash differs from the one the cache was filled under, or there is no cache, it
empties the cache, so that every chapter executes again, and measures the unit the
chapters' times are counted in: one bare 2-rank torchrun launch of labs/ranks.py
(COURSE.md, the budget). Both go into the cache's folder, beside the chapters
executed under them; the status page reads them (book/_ext/chapter_times.py).

The machine's speed drifts over a build (the same launch took 2.6 s and 3.9 s within an
hour here), so once the chapters have executed the book build measures the unit again
(`add_samples_after`, called by book/_ext/chapter_times.py) and the unit becomes the median
of both sets: measured where the chapters ran, not only in the seconds before them.

    .venv/bin/python scripts/book_cache.py [--cache _build/.jupyter_cache]
"""

import argparse
import datetime
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a chapter's execution depends on besides its own cells
INPUTS = ["labs", "results", "scripts/slurm", "requirements.txt"]
# two before the chapters and two after: the median of four follows the machine's load over
# the build, and one launch slowed by a passing load does not set the unit (one before and
# one after measured 3.58 and 5.61 s in one build here, with the chapters between them
# running as fast as in a build whose samples were 3.58 and 3.59); every sample is a
# launch make test pays for
UNIT_RUNS = 2
STATE = "book_inputs.json"   # in the cache's folder


def inputs_hash(repo=None):
    """One hash of every file under INPUTS (paths and contents), caches left out."""
    repo = REPO if repo is None else repo
    digest = hashlib.sha256()
    for name in INPUTS:
        root = repo / name
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(repo)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def unit_samples():
    """Seconds of a bare 2-rank torchrun launch of labs/ranks.py: each of UNIT_RUNS."""
    sys.path.insert(0, str(REPO / "labs"))
    from labkit.runtime.launch import run_lab
    samples = []
    for _ in range(UNIT_RUNS):
        start = time.perf_counter()
        run_lab("ranks", 2, echo=False)
        samples.append(time.perf_counter() - start)
    return samples


def measure_unit():
    """The unit before the chapters execute: its samples, their median, the machine."""
    sys.path.insert(0, str(REPO / "labs"))
    from labkit.runtime.distenv import hardware_description
    import torch
    samples = unit_samples()
    return {"unit_s": statistics.median(samples), "unit_samples_s": samples,
            "hardware": hardware_description(torch.device("cpu")),
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}


def with_samples_after(state, after):
    """`state` with the samples taken after the chapters, the unit the median of all."""
    return {**state, "unit_samples_after_s": after,
            "unit_s": statistics.median(state["unit_samples_s"] + after)}


def add_samples_after(cache=None):
    """Once the chapters measured under a fresh unit have executed, measure it again; a
    build that reused the cache (the state already has them) measures nothing."""
    state_file = Path(cache or REPO / "_build" / ".jupyter_cache") / STATE
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())
    if "unit_s" not in state or "unit_samples_after_s" in state:
        return state
    state = with_samples_after(state, unit_samples())
    state_file.write_text(json.dumps(state, indent=1) + "\n")
    print(f"book cache: the unit again, after the chapters: "
          f"{', '.join(f'{s:.2f}' for s in state['unit_samples_after_s'])} s; "
          f"the unit is {state['unit_s']:.2f} s, the median of all")
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=REPO / "_build" / ".jupyter_cache")
    args = parser.parse_args()
    state_file = args.cache / STATE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    current = inputs_hash(REPO)
    if state.get("inputs_sha256") == current and "unit_s" in state:
        print(f"book cache: labs, results and requirements unchanged; chapters whose cells "
              f"did not change are reused (unit {state['unit_s']:.2f} s)")
        return
    if args.cache.exists():
        print("book cache: labs, results or requirements changed: every chapter executes again")
        shutil.rmtree(args.cache)
    args.cache.mkdir(parents=True)
    state = {"inputs_sha256": current, **measure_unit()}
    state_file.write_text(json.dumps(state, indent=1) + "\n")
    print(f"book cache: the unit, a bare 2-rank launch, takes {state['unit_s']:.2f} s here "
          f"(median of {', '.join(f'{s:.2f}' for s in state['unit_samples_s'])})")


if __name__ == "__main__":
    main()
