"""Execute one chapter as the book build does (cells run in book/), without building the
book: for working on a chapter. Prints each failing cell's error and the time it took.

    .venv/bin/python scripts/run_chapter.py book/pipeline.md [--out executed.ipynb]
"""

import argparse
import datetime
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=Path)
    parser.add_argument("--out", type=Path, help="write the executed notebook here")
    parser.add_argument("--cells", type=float, metavar="SECONDS", default=None,
                        help="list the cells that took at least this long, with their time")
    args = parser.parse_args()
    notebook = jupytext.read(args.chapter)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(args.chapter.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        print(f"{args.chapter}: executed in {time.perf_counter() - start:.1f} s")
        if args.out:
            nbformat.write(notebook, args.out)
    if args.cells is not None:
        for index, cell in enumerate(notebook.cells):
            timing = cell.get("metadata", {}).get("execution", {})
            if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
                took = (datetime.datetime.fromisoformat(timing["shell.execute_reply"][:26])
                        - datetime.datetime.fromisoformat(timing["iopub.execute_input"][:26])
                        ).total_seconds()
                if took >= args.cells:
                    first = cell.source.strip().splitlines()
                    print(f"  cell {index:3d}: {took:6.1f} s  {first[0][:70] if first else ''}")
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("name") == "stderr":
                print(f"stderr output (the build fails on it):\n{output['text']}",
                      file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
