"""Hangs, made on purpose: ranks that fall out of step, and how each one ends in a message.

Every rank runs --steps steps of all-reduces; in step --at-step, rank --rank breaks step:

  skip_collective  it skips the all-reduce: the others wait for it
  wrong_shape      it all-reduces a tensor of another shape: the ranks disagree about what
                   they are doing (TORCH_DISTRIBUTED_DEBUG=DETAIL names the op and both
                   shapes before anything is sent)
  sleep            it sleeps past --timeout before the all-reduce: the others give up

None of them may hang. The process group's --timeout ends each wait, and every rank then
says in one line which all-reduce it was in, how long it waited, and what it was told.
What each rank issues is labkit/predict/hang_model.py's lab_program, from which the same model
predicts where each rank ends and after how long (where_ranks_wait).
--dump-stacks-after S makes every rank print the stack of every thread after S seconds
(faulthandler.dump_traceback_later; rank r 0.3 r s later, so that the dumps do not mix),
which is how a stuck job shows where it is stuck;
`kill -USR1 PID` does the same at any time (faulthandler on a signal), and py-spy dump
--pid PID from outside.

Launch lines (from the repository root):
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=2 labs/hang.py \\
                           --mode skip_collective --timeout 3
  the mismatch named:    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone \\
                           --nproc_per_node=2 labs/hang.py --mode wrong_shape --timeout 3
  GPU box, NCCL:         the same with --nproc_per_node=8; the NCCL watchdog and flight
                           recorder (TORCH_NCCL_*) say more, see the chapter

It always fails (exit status 1) once a mode breaks step; with --mode none it runs clean
and writes JSON: `steps`, `mode`.
"""

import faulthandler
import os
import re
import signal
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


def issue(call, env):
    """One collective of the rank's program (hang_model.lab_program): the all-reduce, its
    sums checked, or the barrier."""
    # async_op=True, then wait(): on NCCL a collective called without it returns no work,
    # and under TORCH_NCCL_BLOCKING_WAIT it is work.wait() that raises at the timeout
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
                     f"{time.perf_counter() - started:.1f} s: {told}", every_rank=True)


def program(args, rank):
    """The collectives this rank issues, in order: the cost model's, which predicts from
    them where each rank waits (hang_model.where_ranks_wait)."""
    return hang_model.lab_program(args.mode, rank, args.steps, args.at_step, args.rank,
                                  NUMEL, args.timeout)


def run(args, env):
    if args.dump_stacks_after is not None:
        faulthandler.dump_traceback_later(args.dump_stacks_after + DUMP_STAGGER_S * env.rank,
                                          exit=False)
    for call in program(args, env.rank):
        time.sleep(call.late_s)   # outside any collective, as a slow rank would be
        guarded(call.label, lambda: issue(call, env), env)
    faulthandler.cancel_dump_traceback_later()
    return {"steps": args.steps, "mode": args.mode}


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--mode", choices=MODES, default="skip_collective")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    parser.add_argument("--at-step", type=distenv.at_least(0), default=2,
                        help="the step in which --rank breaks step")
    parser.add_argument("--rank", type=distenv.at_least(0), default=1,
                        help="the rank that breaks step")
    parser.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                        help="every rank prints every thread's stack after S seconds")
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    if args.at_step >= args.steps:
        distenv.fail(f"--at-step {args.at_step} is past the last step ({args.steps - 1})")
    return args


def main():
    args = parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # kill -USR1 PID: the stacks
    # On NCCL a timed-out collective is otherwise found by the watchdog thread, which
    # aborts the process (SIGABRT) before the rank can say what it was doing; with
    # blocking wait (no watchdog then, and no flight-recorder dump), the wait on each
    # collective's work raises at --timeout and `guarded` reports it. (Read when the group
    # is created; gloo ignores it.)
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    with distenv.initialize(args) as env:
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
