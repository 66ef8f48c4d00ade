"""Command lines that fail in one line: the argparse types and the error every lab (and
the planner) reports bad input with. No torch: labs/plan.py runs without it."""

import argparse
import os
import re
import sys
import time
from pathlib import Path

# A rank other than 0 that fails quietly waits up to this long before exiting: torchrun
# stops every rank as soon as one exits, so a rank 1 that exited first (its import of torch
# was faster) would have rank 0 killed before it printed the line. Waiting, it is stopped
# once rank 0 has exited instead; the limit is for a rank 0 that did not fail.
QUIET_EXIT_WAIT_S = 10.0


class LabInputError(SystemExit):
    """Bad input: the process exits with status 1; `fail` has printed the one line. str()
    is that line, for code (and tests) that catch it in-process."""

    def __init__(self, message):
        super().__init__(1)   # an int code: Python exits with it and prints nothing more
        self.message = message

    def __str__(self):
        return self.message


def lab_name():
    """The running lab's name: its script's file name, `labs/<name>.py`."""
    return Path(sys.argv[0]).stem or "lab"


def fail(message, every_rank=None, linger_s=0.0):
    """Exit with one line, `<lab>: error: <message>`, and status 1.

    Bad input is the same on every rank, so rank 0 alone prints it (N copies of one line,
    then torchrun's report, would bury it) and the other ranks exit quietly with the same
    status. A failure a rank met while running (called while handling a RuntimeError or an
    OSError, e.g. a collective's timeout) is that rank's own: every rank prints its line.
    every_rank=True/False says which, instead of guessing from the exception.

    linger_s: for a failure the other ranks are meeting too (a timeout they all wait out),
    how long this rank stays after its line before exiting. torchrun stops every rank as
    soon as one exits, so the first to leave would cut off a peer whose wait ended a moment
    later, before it said its own line.
    """
    line = f"{lab_name()}: error: {message}"
    if every_rank is None:
        every_rank = isinstance(sys.exc_info()[1], (RuntimeError, OSError))
    # printed here, before the `with initialize()` block's clean-up runs, not at exit
    if every_rank or os.environ.get("RANK", "0") == "0":
        sys.stderr.write(line + "\n")   # one write: two ranks' lines never run together
        sys.stderr.flush()
        time.sleep(linger_s)
    elif "WORLD_SIZE" in os.environ:
        time.sleep(QUIET_EXIT_WAIT_S)
    raise LabInputError(line)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line, `<lab>: error: ...`, without usage."""

    def error(self, message):
        # A value refused by one of the types below reads "--steps must be at least 1, got
        # 0", not argparse's "argument --steps: must be ...".
        fail(re.sub(r"^argument (\S+): (must be |cannot be )", r"\1 \2", message))


def at_least(minimum):
    """An argparse type: a whole number >= minimum, or a one-line error naming the option."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = at_least(1)


def number_above(minimum, inclusive=False):
    """An argparse type: a number > minimum (>= with `inclusive`), or a one-line error."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(
                f"must be at least {minimum:g}, got {text}" if inclusive else
                "must be positive, got " + text if minimum == 0 else
                f"must be more than {minimum:g}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def int_list(minimum=1):
    """An argparse type: comma-separated whole numbers, each >= minimum ("2,3,4")."""
    one = at_least(minimum)

    def parse(text):
        values = [one(part) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got nothing")
        return values
    parse.__name__ = "list of integers"
    return parse


def choice_list(choices, every=None):
    """An argparse type: comma-separated names from `choices`, or "all" for every one
    (for those of `every`, if given: pitfalls that must be asked for by name stay out)."""
    def parse(text):
        if text == "all":
            return list(choices if every is None else every)
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {unknown[0] if unknown else '(none)'!r} (choose from "
                f"{', '.join(choices)}, or all)")
        return names
    parse.__name__ = "list of names"
    return parse
