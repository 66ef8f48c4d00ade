"""Keeping a job alive without a restart, as cost models: replica groups that agree on a
quorum every step, drop a dead group and heal a returning one from a peer (torchft), and a
data order that survives the job's resizes.

Pure functions of the standard library, no process group. Times in seconds.

  quorum_decision       the lighthouse's rule for issuing a quorum (torchft 0.2.0,
                        src/lighthouse.rs, quorum_compute): all of the last quorum back,
                        or at least min_replicas, more than half of the groups still
                        heartbeating, and the others waited for until the join timeout
  detection_window      from a group's death to the survivors' next quorum without it:
                        the join timeout when the survivors are a majority of the groups
                        still heartbeating, else the dead group's heartbeat timeout
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


def detection_window(survivors, join_timeout_s, heartbeat_timeout_s, heartbeat_interval_s,
                     tick_s=0.0, step_s=0.0, min_replicas=1):
    """(earliest, latest) seconds from a group's death to the survivors' next quorum.

    The dead group stops heartbeating when it dies, and counts as alive until its last
    beat (up to one interval before the death) is heartbeat_timeout old. The survivors
    ask for a quorum once their step in flight has failed (up to step_s). If they are more
    than half of the groups still heartbeating (quorum_decision), they wait for the dead
    one as for a straggler, up to the join timeout; if not (two groups, one dead), only its
    heartbeat's expiry lets them go on. The lighthouse decides every tick_s. Fewer survivors
    than min_replicas: never (inf), until a group comes back."""
    if survivors < min_replicas:
        return math.inf, math.inf
    expiry = (heartbeat_timeout_s - heartbeat_interval_s, heartbeat_timeout_s)
    if survivors > (survivors + 1) // 2:   # a majority of the survivors and the dead one
        earliest = min(join_timeout_s, expiry[0])
        latest = min(join_timeout_s + step_s, expiry[1])
    else:
        earliest, latest = expiry
    return max(0.0, earliest), latest + tick_s


def state_bytes(parameters, optimizer_buffers_per_parameter, bytes_per_value=4, other_bytes=0):
    """Bytes of a group's state, what a heal copies: the parameters and the optimizer's
    buffers (1 per parameter for SGD with momentum, 2 for Adam), plus `other_bytes`."""
    return (1 + optimizer_buffers_per_parameter) * parameters * bytes_per_value + other_bytes


def heal_copy_s(copied_bytes, tensors, latency_s, bandwidth_bytes_per_s):
    """Seconds to copy a state from a peer, as torchft's PGTransport does: its size and its
    pickled description first, then each tensor on its own, waiting for each (from host
    memory), so every one of the tensors + 2 messages pays the link's latency once, and
    the bytes its bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("the bandwidth must be positive")
    return (tensors + 2) * latency_s + copied_bytes / bandwidth_bytes_per_s


def timeout_rules(slowest_step_s, heal_copy_s, collective_timeout_s, heartbeat_interval_s,
                  heartbeat_timeout_s, join_timeout_s, quorum_timeout_s, agent_timeout_s,
                  beats=3):
    """The order the timeouts must hold, as rules [(name, shorter, longer)], each rule
    holding when shorter < longer. A collective's timeout outlasts a slow step and a
    heal; a healthy group's beats come several times per heartbeat timeout; the quorum's
    outlasts what it waits for: a straggler up to the join timeout, a dead group of a split
    job up to its heartbeat timeout, plus a step, and a peer stuck on a dead group (in a
    collective, or sending it a heal) up to the collective timeout; and the agent that
    restarts a process making no progress (torchrun's, a watchdog's, the scheduler's) waits
    longer than both, or it restarts the survivors themselves."""
    return [
        ("a slow step and a heal's copy < the collective timeout",
         slowest_step_s + heal_copy_s, collective_timeout_s),
        ("a slow step < the join timeout", slowest_step_s, join_timeout_s),
        (f"{beats} heartbeat intervals < the heartbeat timeout",
         beats * heartbeat_interval_s, heartbeat_timeout_s),
        ("the longer of the join and heartbeat timeouts, and a step < the quorum timeout",
         max(join_timeout_s, heartbeat_timeout_s) + slowest_step_s, quorum_timeout_s),
        ("the collective timeout < the quorum timeout", collective_timeout_s, quorum_timeout_s),
        ("the quorum timeout < the agent's", quorum_timeout_s, agent_timeout_s),
    ]


def broken_rules(rules):
    """The names of the rules (timeout_rules) that do not hold."""
    return [name for name, shorter, longer in rules if not shorter < longer]


def fault_tolerant_goodput(step_s, quorum_s, detect_s, heal_stall_s, group_return_s, groups,
                           mtbf_s):
    """The useful share of the time when a failed replica group drops out and comes back.

    Every step asks for a quorum (quorum_s, what async quorum does not hide). A failure,
    one every mtbf_s, costs every group the step in flight, the wait until the quorum
    drops the dead group (detect_s) and the peer's copy of the state when it heals
    (heal_stall_s); and for group_return_s (a new node, a start, the heal) the job runs on
    groups - 1 of its groups: 1/groups of its throughput less. Nothing is trained twice."""
    if groups < 2:
        raise ValueError("per-step fault tolerance needs at least two replica groups")
    per_failure = step_s + detect_s + heal_stall_s + group_return_s / groups
    return max(0.0, step_s / (step_s + quorum_s) * (1 - per_failure / mtbf_s))


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


def skipped_and_repeated(trained, expected):
    """(skipped, repeated): the ids of `expected` (each once) never trained, and the
    trainings beyond the first of any id, in `trained` (a list of ids)."""
    counts = {}
    for sample in trained:
        counts[sample] = counts.get(sample, 0) + 1
    skipped = sum(1 for sample in set(expected) if sample not in counts)
    repeated = sum(count - 1 for count in counts.values() if count > 1)
    return skipped, repeated
