"""Hangs, made on purpose: ranks that fall out of step, and how each one ends in a message.

Every rank runs --steps steps of all-reduces; in step --at-step, rank --rank breaks step:

  skip_collective  it skips the all-reduce: the others wait for it
  wrong_shape      it all-reduces a tensor of another shape: the ranks disagree about what
                   they are doing (TORCH_DISTRIBUTED_DEBUG=DETAIL names the op and both
                   shapes before anything is sent)
  sleep            it sleeps past --timeout before the all-reduce: the others give up
  exit             it exits (status 0, as a rank that returned early would) before the
                   all-reduce: on gloo its connections close and the others fail at once

None of them may hang. The process group's --timeout ends each wait, and every rank then
says in one line which all-reduce it was in, how long it waited, and what it was told.
What each rank issues is labkit/predict/hang_model.py's lab_program, from which the same model
predicts where each rank ends and after how long (where_ranks_wait).
--dump-stacks-after S is a progress alarm: every rank prints the stack of every thread once
one of its steps has run S seconds (faulthandler.dump_traceback_later, armed again at each
step; rank r 0.3 r s later, so that the dumps do not mix), which is how a stuck job shows
where it is stuck, in a collective or outside any; `kill -USR2 PID` prints them at any time
(faulthandler on SIGUSR2; SIGUSR1 is left to a training loop's checkpoint-and-requeue), and
py-spy dump --pid PID from outside.

On NCCL the lab sets TORCH_NCCL_BLOCKING_WAIT=1 (unless set), so that a timed-out wait
raises in the rank's own thread and the rank says its line; ProcessGroupNCCL then starts
no watchdog, and no flight recorder is written. --flight-recorder PREFIX leaves blocking
wait off and sets the flight recorder's variables, under this torch's names
(hang_model.flight_recorder_env: TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1,
TORCH_FR_DUMP_TEMP_FILE=PREFIX; before 2.8, TORCH_NCCL_TRACE_BUFFER_SIZE and
TORCH_NCCL_DEBUG_INFO_TEMP_FILE; it refuses blocking wait under either of its names, and
a buffer size of 0 under either name): the watchdog finds the stuck collective, every rank
writes PREFIX<rank>, and the watchdog tears the process down (after --timeout and, since
torch 2.8, the minute it leaves the dump), without a line of the lab's own; a rank outside
any collective (--mode sleep) is ended by its heartbeat monitor some 8 minutes later
(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC), or by torchrun once a peer has failed. Read the dumps
with `torchfrtrace DIR`. NCCL only: gloo has no watchdog.

Launch lines (from the repository root):
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=2 labs/hang.py \\
                           --mode skip_collective --timeout 3
  the mismatch named:    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone \\
                           --nproc_per_node=2 labs/hang.py --mode wrong_shape --timeout 3
  GPU box, NCCL:         the same with --nproc_per_node=8; with the watchdog and the
                           flight recorder: ... --timeout 30 --flight-recorder fr/rank_

It always fails (exit status 1) once a mode breaks step; with --mode none it runs clean
and writes JSON: `steps`, `mode`.
"""

import faulthandler
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

from labkit.runtime import distenv
from labkit.predict import hang_model

MODES = hang_model.MODES
STEPS = 5
NUMEL = 4
# --dump-stacks-after: rank r dumps this much later than rank r - 1, so that the ranks'
# dumps, which share one log, come one after another instead of interleaved line by line
DUMP_STAGGER_S = 0.3
# How long a rank stays after its line (distenv.fail's linger_s): the ranks wait in step, so
# their timeouts end within moments of one another (without it, a 3-rank test run here
# lost rank 1's line: rank 0 had exited first)
PEERS_LINE_S = 1.0
# `kill -USR2 PID`: every thread's stack. Not SIGUSR1, which a training loop under SLURM
# takes for checkpoint-and-requeue (the chapter on running at scale).
STACKS_SIGNAL = signal.SIGUSR2
# blocking wait, under the two names ProcessGroupNCCL reads (the second an older alias)
BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def issue(call, env):
    """One collective of the rank's program (hang_model.lab_program): the all-reduce, its
    sums checked, or the barrier."""
    # async_op=True, then wait(): since torch 2.8, ProcessGroupNCCL hands a collective
    # called without it to the watchdog but returns no work, so nothing calls wait() on
    # it; under TORCH_NCCL_BLOCKING_WAIT it is work.wait() that raises at the timeout
    if call.op == "barrier":
        dist.barrier(async_op=True).wait()
        return
    summed = torch.ones(call.numel, device=env.device)
    dist.all_reduce(summed, async_op=True).wait()
    if not bool((summed == env.world_size).all()):
        # gloo does not compare shapes: ranks that disagree may get wrong sums, silently
        raise RuntimeError(f"the sums are wrong ({summed.tolist()}, not {env.world_size} "
                           f"each): the ranks disagreed about the tensor; "
                           f"TORCH_DISTRIBUTED_DEBUG=DETAIL checks shapes before sending")


def guarded(what, collective, env):
    """Run `collective`; if the group's timeout (or DETAIL's check) ends it, exit with one
    line saying what this rank was doing, for how long, and what it was told."""
    started = time.perf_counter()
    try:
        collective()
    except (RuntimeError, dist.DistError) as error:
        told = " ".join(str(error).split())
        # DETAIL's fingerprints: keep the op, the shapes and the dtypes, not the options
        told = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\)\)\)", ")", told)[:600]
        distenv.fail(f"rank {env.rank}: {what} ended after "
                     f"{time.perf_counter() - started:.1f} s: {told}", every_rank=True,
                     linger_s=PEERS_LINE_S)


def program(args, rank):
    """The collectives this rank issues, in order: the cost model's, which predicts from
    them where each rank waits (hang_model.where_ranks_wait)."""
    return hang_model.lab_program(args.mode, rank, args.steps, args.at_step, args.rank,
                                  NUMEL, args.timeout)


def dump_stacks_on_signal():
    """`kill -USR2 PID` prints every thread's stack, and the process goes on."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def run(args, env):
    for call in program(args, env.rank):
        if args.dump_stacks_after is not None:
            # the progress alarm, armed again for each step (it replaces the last one)
            faulthandler.dump_traceback_later(
                args.dump_stacks_after + DUMP_STAGGER_S * env.rank, exit=False)
        time.sleep(call.late_s)   # outside any collective, as a slow rank would be
        guarded(call.label, lambda: issue(call, env), env)
    faulthandler.cancel_dump_traceback_later()
    if args.mode == "exit" and env.rank == args.rank:
        # it leaves: no clean-up, no goodbye to the group, its connections simply close
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return {"steps": args.steps, "mode": args.mode}


def arm_flight_recorder(prefix):
    """Leave blocking wait off, so that ProcessGroupNCCL's watchdog runs, and have every
    rank record its last collectives and write them to `prefix`<rank> on a timeout."""
    # ProcessGroupNCCL reads blocking wait under both names
    blocking = [name for name in BLOCKING_WAIT if os.environ.get(name, "0") not in ("0", "")]
    if blocking:
        distenv.fail(f"--flight-recorder needs blocking wait off: unset {' and '.join(blocking)}")
    # an inherited 0 would silence the recorder: TORCH_FR_BUFFER_SIZE records nothing, and
    # ProcessGroupNCCL writes no dump unless TORCH_NCCL_TRACE_BUFFER_SIZE (which it alone
    # reads, 2000 if unset) is above 0, whatever the other says
    for name in hang_model.FR_BUFFER_SIZES:
        value = os.environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) > 0):
            distenv.fail(f"--flight-recorder needs {name} unset or above 0, not {value!r}: "
                         f"with it, no collective is recorded or no dump written")
    # this torch's names for them (hang_model.flight_recorder_env): the prefix as asked and
    # the dump on timeout on, the buffer's size unless already set (above 0)
    for name, value in hang_model.flight_recorder_env(torch.__version__, prefix).items():
        if name.endswith("_SIZE"):
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value
    folder = os.path.dirname(prefix)
    if folder:
        os.makedirs(folder, exist_ok=True)


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--mode", choices=MODES, default="skip_collective")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    parser.add_argument("--at-step", type=distenv.at_least(0), default=2,
                        help="the step in which --rank breaks step")
    parser.add_argument("--rank", type=distenv.at_least(0), default=1,
                        help="the rank that breaks step")
    parser.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                        help="a progress alarm: every rank prints every thread's stack once "
                             "a step has run S seconds")
    parser.add_argument("--flight-recorder", default=None, metavar="PREFIX",
                        help="NCCL: leave blocking wait off (the watchdog ends a stuck "
                             "collective) and write each rank's flight recorder to "
                             "PREFIX<rank>")
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    if args.at_step >= args.steps:
        distenv.fail(f"--at-step {args.at_step} is past the last step ({args.steps - 1})")
    return args


def main():
    args = parse_args()
    dump_stacks_on_signal()   # kill -USR2 PID: the stacks
    # On NCCL a timed-out collective is otherwise found by ProcessGroupNCCL's watchdog
    # thread, which tears the process down before the rank can say what it was doing; with
    # blocking wait (no watchdog then, and no flight-recorder dump), the wait on each
    # collective's work raises at --timeout and `guarded` reports it. --flight-recorder
    # chooses the watchdog and its dump instead. (Read when the group is created; gloo
    # ignores them.)
    if args.flight_recorder:
        arm_flight_recorder(args.flight_recorder)
    else:
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    with distenv.initialize(args) as env:
        if args.flight_recorder and env.backend != "nccl":
            distenv.fail(f"--flight-recorder needs NCCL: {env.backend} has no watchdog "
                         f"to find a stuck collective, and writes no dump")
        if args.mode != "none" and env.world_size < 2:
            distenv.fail("a rank can only fall out of step with another: run 2 or more")
        if args.mode != "none" and args.rank >= env.world_size:
            distenv.fail(f"--rank {args.rank} is not a rank of a world of {env.world_size}")
        env.print0(f"{env.world_size} ranks, {args.steps} all-reduces; rank {args.rank} "
                   f"breaks step {args.at_step}: {args.mode} (--timeout {args.timeout:g} s, "
                   f"TORCH_DISTRIBUTED_DEBUG={os.environ.get('TORCH_DISTRIBUTED_DEBUG', 'OFF')})")
        env.write_result(args, run(args, env))


if __name__ == "__main__":
    main()
