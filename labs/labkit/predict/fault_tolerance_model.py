"""Keeping a job alive without a restart, as cost models: replica groups that agree on a
quorum every step, drop a dead group and heal a returning one from a peer (torchft), and a
data order that survives the job's resizes.

Pure functions of the standard library, no process group. Times in seconds.

  quorum_decision       the lighthouse's rule for issuing a quorum (torchft 0.2.0,
                        src/lighthouse.rs, quorum_compute): all of the last quorum back,
                        or at least min_replicas, more than half of the groups still
                        heartbeating, and the others waited for until the join timeout
  quorum_issued_s       from a group's death to the lighthouse's quorum without it, once
                        the survivors have asked
  detection_window      from a group's death to the survivors' next quorum without it:
                        the step in flight's failure (at once on gloo, the collective
                        timeout on NCCL), then the join timeout or the dead group's
                        heartbeat expiry, whichever first, when the survivors are a
                        majority of the groups still heartbeating, else the expiry; and
                        the process group's rebuild
  state_bytes           the bytes a heal copies: parameters, the optimizer's buffers, the rest
  heal_copy_s           the copy's time: a latency per message (one per tensor) and the bytes
  timeout_rules         the order the timeouts must hold, each rule with its two sides
  fault_tolerant_goodput  the useful share of the time when failed groups drop out and come
                        back, against failure_model.expected_goodput's checkpoint-restart
  global_order          the data order that survives resizes: one seeded order of the whole
                        data set, epoch after epoch; a step's participant i of n takes the
                        batch after position p + i b, and p, in the checkpoint, moves n b
  sampler_resume_error  the samples DistributedSampler skips and repeats when a job saved at
                        one world size resumes at another, skipping the batches it trained
  stateful_resume_error the same for StatefulDataLoader, each rank loading its own state
  skipped_and_repeated  count both in what a run trained
"""

import functools
import math
import random

from . import failure_model


def quorum_decision(joined, heartbeating, previous, min_replicas, waited_s, join_timeout_s):
    """(issued, why): whether the lighthouse issues a quorum now, as torchft 0.2.0 decides.

    `joined`: the groups that asked for one in this round; `heartbeating`: those whose last
    heartbeat is within the heartbeat timeout (only they count, joined or not);
    `previous`: the last quorum's groups, or None; `waited_s`: since the first joined.
    A quorum whose every previous member is back is issued at once ("fast"). Else it needs
    min_replicas, more than half of the groups still heartbeating (two halves of a job cut
    apart must not both go on: "split brain"), and it waits for the heartbeating groups
    that have not joined, up to the join timeout."""
    alive = set(heartbeating)
    joined = set(joined) & alive
    if previous is not None and set(previous) <= joined:
        return True, "fast"
    if len(joined) < min_replicas:
        return False, "fewer than min_replicas"
    if len(joined) <= len(alive) // 2:
        return False, "not more than half of the heartbeating groups"
    if len(joined) < len(alive) and waited_s < join_timeout_s:
        return False, "waiting for stragglers"
    return True, "valid"


def quorum_issued_s(asked_s, survivors, join_timeout_s, heartbeat_timeout_s,
                    heartbeat_interval_s, beats_on=False):
    """(earliest, latest) seconds from a group's death to the lighthouse's quorum without
    it, the last survivor having asked asked_s after the death. Only rank 0 of a group
    heartbeats (its manager server): the dead group counts as alive until its last beat (up
    to one interval before the death) is heartbeat_timeout old, and with `beats_on` (a
    rank other than 0 died, and rank 0 goes on beating) it never expires. If the survivors
    are more than half of the groups still heartbeating (quorum_decision), they wait for it
    as for a straggler until the join timeout or its heartbeat's expiry, whichever comes
    first; if not (two groups, one dead), only the expiry lets them go on."""
    majority = survivors > (survivors + 1) // 2   # of the survivors and the dead one

    def issued(expired):
        waited = max(asked_s, expired)
        return min(asked_s + join_timeout_s, waited) if majority else waited

    return (issued(max(0.0, heartbeat_timeout_s - heartbeat_interval_s)),
            issued(math.inf if beats_on else heartbeat_timeout_s))


def detection_window(survivors, join_timeout_s, heartbeat_timeout_s, heartbeat_interval_s,
                     tick_s=0.0, step_s=0.0, min_replicas=1, collective_timeout_s=0.0,
                     rebuild_s=0.0, beats_on=False, fails_at_once=True):
    """(earliest, latest) seconds from a group's death to the survivors' next quorum, the
    cross-group process group rebuilt without it.

    The survivors ask for a quorum once their step in flight has failed: within step_s of the
    death when the dead peer's connections close at once and every survivor sees it, only
    at collective_timeout_s when a survivor waits on another survivor rather than on the
    dead one (gloo's all-reduce passes data between peers in rounds), and always then
    without `fails_at_once` (NCCL, where a dead peer usually raises nothing). Then the
    lighthouse decides (quorum_issued_s), at its next tick (tick_s), and every survivor
    rebuilds the process group (rebuild_s). Fewer survivors than min_replicas: never (inf),
    until a group comes back."""
    if survivors < min_replicas:
        return math.inf, math.inf
    timing = (survivors, join_timeout_s, heartbeat_timeout_s, heartbeat_interval_s, beats_on)
    earliest = quorum_issued_s(0.0 if fails_at_once else collective_timeout_s, *timing)[0]
    latest = quorum_issued_s(collective_timeout_s + step_s, *timing)[1] + tick_s
    return earliest + rebuild_s, latest + rebuild_s


def state_bytes(parameters, optimizer_buffers_per_parameter, bytes_per_value=4, other_bytes=0):
    """Bytes of a group's state, what a heal copies: the parameters and the optimizer's
    buffers (1 per parameter for SGD with momentum, 2 for Adam), plus `other_bytes`."""
    return (1 + optimizer_buffers_per_parameter) * parameters * bytes_per_value + other_bytes


def heal_copy_s(copied_bytes, tensors, latency_s, bandwidth_bytes_per_s):
    """Seconds to copy a state from a peer, as torchft's PGTransport does: its size and its
    pickled description first, then each tensor on its own, so every one of the tensors
    + 2 messages pays the link's latency once, and the bytes its bandwidth. An upper end
    for the latencies: the sender waits for each send only for tensors in host memory (a
    GPU's are pipelined, and cost nearly one latency in all). Not counted: the receiver's
    side, which without an in-place state_dict= callback allocates every tensor and copies
    it to host memory, and whatever else the two processes run meanwhile."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("the bandwidth must be positive")
    return (tensors + 2) * latency_s + copied_bytes / bandwidth_bytes_per_s


def timeout_rules(slowest_step_s, heal_copy_s, collective_timeout_s, heartbeat_interval_s,
                  heartbeat_timeout_s, join_timeout_s, quorum_timeout_s, agent_timeout_s,
                  beats=3):
    """The order the timeouts must hold, as rules [(name, shorter, longer)], each rule
    holding when shorter < longer. A collective's timeout outlasts a slow step and a heal; so
    does the join timeout, or the group that sent a heal is late for the next quorum, left
    out, and must heal in turn; a healthy group's beats come several times per heartbeat
    timeout; the quorum's outlasts what it waits for: a straggler up to the join timeout, a
    dead group of a split job up to its heartbeat timeout, plus a step, and a peer stuck on
    a dead group (in a collective, or sending it a heal) up to the collective timeout; and
    whatever ends a job that makes no progress (the lab's --timeout, a scheduler's limit)
    waits longer than the quorum may take, or it ends the survivors themselves. (A process
    group's heartbeat monitor inside a group goes the other way: below the quorum timeout,
    so that a stuck group dies and restarts before the others' quorum gives up.)"""
    return [
        ("a slow step and a heal's copy < the collective timeout",
         slowest_step_s + heal_copy_s, collective_timeout_s),
        # the group that sends a heal commits its step only once the copy is done
        ("a slow step and a heal's copy < the join timeout", slowest_step_s + heal_copy_s,
         join_timeout_s),
        (f"{beats} heartbeat intervals < the heartbeat timeout",
         beats * heartbeat_interval_s, heartbeat_timeout_s),
        ("the longer of the join and heartbeat timeouts, and a step < the quorum timeout",
         max(join_timeout_s, heartbeat_timeout_s) + slowest_step_s, quorum_timeout_s),
        ("the collective timeout < the quorum timeout", collective_timeout_s, quorum_timeout_s),
        ("the quorum timeout < the job's own limit on no progress", quorum_timeout_s,
         agent_timeout_s),
    ]


def broken_rules(rules):
    """The names of the rules (timeout_rules) that do not hold."""
    return [name for name, shorter, longer in rules if not shorter < longer]


def fault_tolerant_goodput(step_s, quorum_s, detect_s, heal_stall_s, group_return_s, groups,
                           mtbf_s, save_s=0.0, save_interval_s=math.inf):
    """The useful share of the time when a failed replica group drops out and comes back.

    Every step asks for a quorum (quorum_s, what async quorum does not hide). A failure,
    one every mtbf_s, costs every group the step in flight, the wait until the quorum
    drops the dead group (detect_s) and the peer's copy of the state when it heals
    (heal_stall_s); and for group_return_s (a new node, a start, the heal) the job runs on
    groups - 1 of its groups: 1/groups of its throughput less. Nothing is trained twice.
    The blocking saves the job still makes, save_s every save_interval_s (for what per-step
    fault tolerance does not survive: every copy lost at once), take their share too."""
    if groups < 2:
        raise ValueError("per-step fault tolerance needs at least two replica groups")
    per_failure = step_s + detect_s + heal_stall_s + group_return_s / groups
    saving = save_s / save_interval_s
    return max(0.0, step_s / (step_s + quorum_s) * (1 - saving) * (1 - per_failure / mtbf_s))


def checkpoint_restart_goodput(save_s, restart_s, mtbf_s, write_s=0.0):
    """The at-scale chapter's checkpoint-restart at Young's interval (failure_model):
    (interval, goodput)."""
    interval = failure_model.young_daly_interval(save_s, mtbf_s, write_s)
    return interval, failure_model.expected_goodput(interval, save_s, restart_s, mtbf_s, write_s)


@functools.lru_cache(maxsize=8)
def _epoch_order(seed, dataset_size, epoch):
    order = list(range(dataset_size))
    random.Random(f"{seed}/{epoch}").shuffle(order)   # a string seed: the same everywhere
    return order


def global_order(seed, dataset_size, start, count):
    """The sample ids at positions start .. start + count - 1 of the global order: the data
    set shuffled by (seed, epoch), epoch after epoch, one stream for the whole job. Position
    p is sample _epoch_order(p // size)[p % size]; nothing in it depends on the world size."""
    return [_epoch_order(seed, dataset_size, p // dataset_size)[p % dataset_size]
            for p in range(start, start + count)]


def participant_positions(position, participant, participants, batch):
    """(first, last + 1) positions of the global order that participant i of n trains in a
    step that starts at `position`; the step moves the position by n * batch."""
    if not 0 <= participant < participants:
        raise ValueError(f"participant {participant} is not one of {participants}")
    first = position + participant * batch
    return first, first + batch


def sampler_resume_error(dataset_size, batch, steps_done, world_before, world_after):
    """(skipped, repeated) samples of the epoch when DistributedSampler's job saves after
    `steps_done` steps at one world size and resumes at another by skipping the batches
    each rank trained: rank r of N trains positions r, r + N, ... of the epoch's order, so
    the N ranks' first k b positions each are the order's first N k b. Resumed at N', each
    rank skips its first k b, the order's first N' k b: fewer than trained repeats the
    difference, more skips it. (The data set divides by every world size and batch here:
    DistributedSampler pads an epoch that does not with repeated samples of its own.)"""
    trained = world_before * steps_done * batch
    passed = world_after * steps_done * batch
    if max(trained, passed) > dataset_size:
        raise ValueError("the resume must fall within the epoch")
    return max(0, passed - trained), max(0, trained - passed)


def stateful_resume_error(dataset_size, batch, steps_done, world_before, world_after):
    """(skipped, repeated) samples of the epoch when each rank of a StatefulDataLoader over
    DistributedSampler saves its own state after `steps_done` steps at one world size and
    resumes at another. A rank that loads a state fast-forwards a fresh sampler of the new
    world by the k b samples it had yielded; a rank that has none (the world grew) starts
    the epoch from its first sample. Rank r of N' then trains positions r + N' j of the
    epoch's order, j from k b (a state) or from 0 (none). Shrinking, every rank has a
    state: DistributedSampler's error (sampler_resume_error). Growing, ranks below N skip
    what lies between N k b and N' k b, and the new ranks repeat what lies below N k b."""
    trained_before = world_before * steps_done * batch
    if max(trained_before, world_after * steps_done * batch) > dataset_size:
        raise ValueError("the resume must fall within the epoch")
    per_rank = dataset_size // world_after
    skipped = repeated = 0
    for rank in range(world_after):
        first = steps_done * batch if rank < world_before else 0
        for j in range(per_rank):
            position = rank + world_after * j
            if j < first and position >= trained_before:
                skipped += 1
            elif j >= first and position < trained_before:
                repeated += 1
    return skipped, repeated


def skipped_and_repeated(trained, expected):
    """(skipped, repeated): the ids of `expected` (each once) never trained, and the
    trainings beyond the first of any id, in `trained` (a list of ids)."""
    counts = {}
    for sample in trained:
        counts[sample] = counts.get(sample, 0) + 1
    skipped = sum(1 for sample in set(expected) if sample not in counts)
    repeated = sum(count - 1 for count in counts.values() if count > 1)
    return skipped, repeated
