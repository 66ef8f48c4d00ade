"""The fault-tolerance lab (torchft): what the chapter does not run. The chapter runs three
groups, one killed once, and asserts its exact results in hidden cells; here three groups
whose returning group is killed during its own heal (an odd world, a second return), replayed
in one process, two
groups (the survivor alone is no majority: only the dead group's heartbeat timeout lets it
go on) under checkpoint-restart too, a lighthouse that does not answer, fewer groups than
a quorum needs, the refusals, and the cost model's rules by hand."""

import math
import os
import socket
import subprocess
import sys

import pytest

import fault_tolerance
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.predict import fault_tolerance_model as ftm
from labkit.runtime.launch import run_lab

# short timeouts, in their order: collective < quorum < the lab's own (the agent's)
SMALL = ["--state-mb", 0, "--collective-timeout", 2, "--quorum-timeout", 5, "--timeout", 60]


@pytest.fixture(scope="module")
def odd():
    """Three groups; the first return of the killed group dies as its heal begins."""
    return run_lab("fault_tolerance", None, [*SMALL, "--die-in-heal", "--no-checkpoint-restart"],
                   echo=False)


@pytest.fixture(scope="module")
def pair():
    """Two groups, the second late; group 0 killed; then checkpoint-restart, every 2 steps.
    A join timeout shorter than the heartbeat's: the lone survivor must wait for the latter."""
    return run_lab("fault_tolerance", None, [*SMALL, "--groups", 2, "--every", 2,
                                             "--heartbeat-timeout-ms", 600,
                                             "--join-timeout-ms", 200], echo=False)


def survivors_went_on(run, groups):
    """No step committed twice, none lost; the job shrank by one group and came back."""
    assert run["steps_lost_by_survivors"] == 0
    per_step = run["replica_groups_per_step"]
    assert max(per_step) == groups and groups - 1 in per_step
    assert per_step[-1] == groups   # back to full strength at the end
    after = per_step[per_step.index(groups):]   # from the first step of every group
    assert after[0] == groups and groups - 1 in after   # the kill came after it
    assert run["healed_param_max_diff"] == 0.0   # every group ends on the same bits
    # the step in flight at the kill, on every survivor (more when a heal was killed too)
    assert run["attempts_discarded"] >= run["predicted_attempts_discarded"] == groups - 1
    # one process trains the committed steps again from what the groups recorded: the
    # gradients averaged over the participants give group 0's parameters to rounding,
    # averaged over every group (as if the missing one gave zeros) they do not
    assert run["replay_param_max_diff"] < 1e-5 < run["replay_fixed_param_max_diff"]
    # the lighthouse's decision: never before the model's earliest, given when they asked
    assert run["decision_s"] >= run["decision_window_s"][0] - 0.01
    assert run["detect_s"] >= run["detect_window_s"][0] - 0.01


@pytest.mark.timed
def test_a_group_killed_during_its_own_heal_heals_on_its_next_return(odd):
    assert_lab_metadata(odd, "fault_tolerance")
    (run,) = odd["runs"]
    survivors_went_on(run, 3)
    assert run["heals_died"] == 1
    heals = [(h["why"], h["start"]) for h in run["heals"]]
    assert heals[0] == ("late", 0) and ("return", 2) in heals and ("return", 1) not in heals
    # the state copied: the model and SGD's momentum, counted exactly
    params = fault_tolerance.SHAPE
    assert all(h["bytes"] == run["state_bytes"] for h in run["heals"])
    assert run["state_bytes"] == ftm.state_bytes(transformer_params(params), 1)
    data = run["data_while_out"]
    order = data["global_order"]   # skips only what torchft zeroed yet counted
    assert order["skipped_samples"] == order["predicted_skipped_samples"]
    assert order["repeated_samples"] == 0
    # torchft's sampler discards the batches of failed steps and heals, and a group
    # started again draws its shard from the start
    sampler = data["torchft_sampler"]
    assert sampler["skipped_samples"] > 0 and sampler["repeated_samples"] > 0


@pytest.mark.timed
def test_detection_waits_for_the_join_timeout_when_the_survivors_are_a_majority(odd):
    timeouts = odd["timeouts"]
    (run,) = odd["runs"]
    join, expiry = (timeouts["join_timeout_ms"] / 1e3,
                    (timeouts["heartbeat_timeout_ms"] - timeouts["heartbeat_interval_ms"]) / 1e3)
    # a lower bound: a busy machine only makes it later
    assert run["decision_s"] >= run["asked_s"] + min(join, max(0, expiry - run["asked_s"])) - 0.01
    if run["asked_s"] + join < expiry:   # the join timeout's case: issued before the expiry
        assert run["decision_s"] < expiry + run["step_spread_s"]


@pytest.mark.timed
def test_a_lone_survivor_waits_for_the_dead_groups_heartbeat_to_expire(pair):
    (run,) = pair["runs"]
    survivors_went_on(run, 2)
    assert [h["why"] for h in run["heals"]] == ["late", "return"]
    timeouts = pair["timeouts"]
    earliest, _ = ftm.detection_window(1, timeouts["join_timeout_ms"] / 1e3,
                                       timeouts["heartbeat_timeout_ms"] / 1e3,
                                       timeouts["heartbeat_interval_ms"] / 1e3)
    assert earliest == pytest.approx(0.5)   # not the 0.2 s join timeout: no majority
    assert run["detect_s"] >= earliest - 0.01
    assert run["decision_s"] >= max(run["asked_s"], earliest) - 0.01


@pytest.mark.timed   # not timed itself: it shares the timed tests' launch, which runs once
def test_checkpoint_restart_trains_again_the_steps_since_the_last_save(pair):
    restart = pair["checkpoint_restart"]
    fail, every = pair["args"]["fail_at_step"], restart["every"]
    assert restart["killed_at_step"] == fail and restart["saved_steps"][:2] == [2, 4]
    assert restart["resumed_from_step"] == fail // every * every
    assert restart["steps_lost"] == fail - fail // every * every == 1
    assert restart["restart_s"] > 0


def test_a_lighthouse_that_does_not_answer_fails_in_one_line(script):
    with socket.socket() as probe:   # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = script("fault_tolerance", "--group", 0, "--lighthouse", f"http://127.0.0.1:{port}",
                  "--connect-timeout", 1)
    assert_fails_with_one_line(done, "did not answer within --connect-timeout 1 s")


def test_fewer_groups_than_a_quorum_needs_wait_say_so_and_time_out(script):
    done = script("fault_tolerance", "--groups", 2, "--min-replicas", 3, "--quorum-timeout", 1,
                  "--state-mb", 0, "--no-checkpoint-restart")
    assert "waiting for a quorum of --min-replicas 3 groups" in done.stdout
    assert_fails_with_one_line(done, "no quorum of --min-replicas 3 within --quorum-timeout 1 s")


def test_without_torchft_the_lab_says_so_in_one_line(tmp_path):
    """On torch < 2.7 torchft does not import: a stand-in package that fails as it would.
    A fresh Python, not the forked launcher, whose parent has imported the real torchft."""
    (tmp_path / "torchft").mkdir()
    (tmp_path / "torchft" / "__init__.py").write_text(
        "raise ImportError('torchft 0.2.0 needs torch >= 2.7')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, str(fault_tolerance.__file__), "--state-mb", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert_fails_with_one_line(done, "torchft does not import (torchft 0.2.0 needs torch >= 2.7)")


@pytest.mark.parametrize("argv, words", [
    (["--groups", 1], "--groups must be at least 2"),
    (["--late-group", 1, "--fail-group", 1], "two different groups"),
    (["--fail-group", 3], "--fail-group 3 is not one of --groups 3"),
    (["--fail-at-step", 8], "past the last step"),
    (["--group", 0], "--group needs --lighthouse"),
])
def test_bad_input_is_refused_in_one_line(argv, words):
    if argv[0] == "--group":   # refused once the lab runs, not by the parser
        args = fault_tolerance.parse_args(argv)
        with pytest.raises(SystemExit) as error:
            fault_tolerance.run_one_group(args)
        assert words in str(error.value)
        return
    assert_refused(fault_tolerance.parse_args, argv, words)


def transformer_params(shape):
    from labkit.predict import memory_model
    return memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab, shape.seq)


# ---------------------------------------------------------------- the cost model by hand
def test_the_lighthouse_rule():
    decide = ftm.quorum_decision
    # every member of the last quorum back: at once, even with a newcomer
    assert decide({"a", "b", "c"}, {"a", "b", "c"}, {"a", "b"}, 2, 0, 1) == (True, "fast")
    assert decide({"a"}, {"a", "b"}, {"a", "b"}, 1, 9, 1)[0] is False   # 1 of 2: split brain
    assert decide({"a", "b"}, {"a", "b", "c"}, {"a", "b", "c"}, 1, 0.1, 1) == (
        False, "waiting for stragglers")
    assert decide({"a", "b"}, {"a", "b", "c"}, {"a", "b", "c"}, 1, 1.0, 1) == (True, "valid")
    assert decide({"a", "b"}, {"a", "b"}, None, 3, 9, 1) == (False, "fewer than min_replicas")
    # a joined group whose heartbeat has expired does not count
    assert decide({"a", "b"}, {"a"}, None, 2, 9, 1)[0] is False


def test_the_detection_window():
    # three groups, one dead: the two survivors wait for it as a straggler
    assert ftm.detection_window(2, 0.2, 1.0, 0.1, tick_s=0.01) == pytest.approx((0.2, 0.21))
    # a join timeout longer than the heartbeat's: the heartbeat decides
    assert ftm.detection_window(2, 60, 5, 0.1) == pytest.approx((4.9, 5.0))
    # two groups, one dead: the heartbeat timeout, whatever the join timeout
    assert ftm.detection_window(1, 0.2, 1.0, 0.1) == pytest.approx((0.9, 1.0))
    assert ftm.detection_window(1, 0.2, 1.0, 0.1, min_replicas=2) == (math.inf, math.inf)
    # NCCL: the step in flight ends at the collective timeout; if a rank other than 0 died,
    # its group's rank 0 goes on beating and the survivors wait the whole join timeout
    assert ftm.detection_window(7, 60, 5, 0.1, step_s=6, collective_timeout_s=60,
                                fails_at_once=False) == pytest.approx((60, 66))
    assert ftm.detection_window(7, 60, 5, 0.1, step_s=6, collective_timeout_s=60,
                                fails_at_once=False, beats_on=True) == pytest.approx((60, 126))
    assert ftm.detection_window(1, 60, 5, 0.1, beats_on=True) == (4.9, math.inf)
    assert ftm.detection_window(2, 0.2, 1.0, 0.1, rebuild_s=0.05) == pytest.approx((0.25, 0.25))
    # once asked: the join timeout from the ask, or at once if the heartbeat has expired
    assert ftm.quorum_issued_s(0.1, 2, 0.6, 1.0, 0.1) == pytest.approx((0.7, 0.7))
    assert ftm.quorum_issued_s(5.0, 2, 0.6, 1.0, 0.1) == (5.0, 5.0)
    assert ftm.quorum_issued_s(0.1, 1, 0.6, 1.0, 0.1) == pytest.approx((0.9, 1.0))


def test_the_timeout_rules():
    lab = fault_tolerance
    rules = ftm.timeout_rules(0.05, 0.1, lab.COLLECTIVE_TIMEOUT_S, lab.HEARTBEAT_INTERVAL_MS / 1e3,
                              lab.HEARTBEAT_TIMEOUT_MS / 1e3, lab.JOIN_TIMEOUT_MS / 1e3,
                              lab.QUORUM_TIMEOUT_S, 120)
    assert ftm.broken_rules(rules) == []
    # a step slower than the quorum timeout: the survivors give up waiting
    slow = ftm.timeout_rules(12, 0.1, 60, 0.1, 1, 0.2, 10, 120)
    assert "the longer of the join and heartbeat timeouts, and a step < the quorum timeout" \
        in ftm.broken_rules(slow)
    # a peer stuck on a dead group for a collective timeout longer than the quorum's
    stuck = ftm.timeout_rules(0.05, 0.1, 20, 0.1, 1, 0.2, 10, 120)
    assert ftm.broken_rules(stuck) == ["the collective timeout < the quorum timeout"]


def test_the_global_order_is_one_permutation_per_epoch_whatever_the_world():
    order = ftm.global_order(0, 12, 0, 36)
    for epoch in range(3):
        assert sorted(order[12 * epoch:12 * (epoch + 1)]) == list(range(12))
    assert order[:12] != order[12:24]   # each epoch shuffled anew
    # two worlds cut the same stream: 3 ranks x 2, then 2 ranks x 3, take positions 0-11
    threes = [ftm.participant_positions(0, r, 3, 2) for r in range(3)]
    twos = [ftm.participant_positions(6, r, 2, 3) for r in range(2)]
    covered = [p for first, last in threes + twos for p in range(first, last)]
    assert sorted(covered) == list(range(12))


def test_the_stateful_loaders_resume_error():
    # shrinking: every rank has a state, DistributedSampler's error
    assert ftm.stateful_resume_error(240, 4, 5, 4, 3) == ftm.sampler_resume_error(240, 4, 5, 4, 3)
    # growing 2 -> 3: rank 2 starts over (positions 2, 5, ..., 38 again), ranks 0 and 1 skip
    # the positions of theirs between 40 and 60 (42, ..., 57 and 40, ..., 58)
    assert ftm.stateful_resume_error(240, 4, 5, 2, 3) == (13, 13)
    assert ftm.stateful_resume_error(240, 4, 5, 3, 3) == (0, 0)


def test_distributed_samplers_resume_error_and_the_counts():
    assert ftm.sampler_resume_error(240, 4, 5, 4, 3) == (0, 20)   # fewer ranks: repeated
    assert ftm.sampler_resume_error(240, 4, 5, 2, 3) == (20, 0)   # more ranks: skipped
    assert ftm.sampler_resume_error(240, 4, 5, 3, 3) == (0, 0)
    assert ftm.skipped_and_repeated([1, 2, 2, 2, 4], range(5)) == (2, 2)


def test_per_step_fault_tolerance_keeps_more_than_checkpoint_restart_at_scale():
    from labkit.predict import failure_model as fm
    mtbf = fm.job_mtbf(fm.device_mtbf(fm.LLAMA3_DAYS * 86_400, fm.LLAMA3_INTERRUPTIONS,
                                      fm.LLAMA3_GPUS), fm.LLAMA3_GPUS)
    _, restart = ftm.checkpoint_restart_goodput(60, 600, mtbf)
    live = ftm.fault_tolerant_goodput(10, 0.01, 5, 5, 600, 128, mtbf)
    assert live > restart
    # an hourly 60 s save still costs its share, 60 / 3600 of the time
    saving = ftm.fault_tolerant_goodput(10, 0.01, 5, 5, 600, 128, mtbf, 60, 3600)
    assert saving == pytest.approx(live * (1 - 60 / 3600))
    with pytest.raises(ValueError):
        ftm.fault_tolerant_goodput(10, 0.01, 5, 5, 600, 1, mtbf)


def test_the_manager_server_binds_the_advertised_ipv4_address_and_a_name_is_left_alone(
        monkeypatch):
    """torchft 0.2 binds its manager server to [::]; the lab narrows it to --hostname when
    that is an IPv4 address, and leaves a name (whose address on this host need not be the
    one other nodes reach) to torchft."""
    torchft_manager = pytest.importorskip("torchft.manager")
    binds = []
    monkeypatch.setattr(torchft_manager, "ManagerServer", lambda **options: binds.append(options))
    fault_tolerance.manager_server_on("node.example")
    fault_tolerance.manager_server_on("::1")
    torchft_manager.ManagerServer(bind="[::]:0", store_addr="s")
    fault_tolerance.manager_server_on("127.0.0.1")
    torchft_manager.ManagerServer(bind="[::]:29512", store_addr="s")
    assert binds == [{"bind": "[::]:0", "store_addr": "s"},
                     {"bind": "127.0.0.1:29512", "store_addr": "s"}]
