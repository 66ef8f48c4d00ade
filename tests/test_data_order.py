"""The data-order lab: what the chapter does not run. The chapter resumes 3 -> 3, 4 -> 3
and 2 -> 3 in one process and asserts its counts and its bit-identical resumes in hidden
cells; here other sizes, odd ones among them (6 -> 5, 1 -> 3), against the closed forms of
DistributedSampler's and StatefulDataLoader's errors, the same counts with the ranks shared
out over two processes, and the refusals."""

import pytest

import data_order
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.predict import fault_tolerance_model as ftm
from labkit.runtime.launch import run_lab

RESIZES = "6:5,1:3"


@pytest.fixture(scope="module")
def alone():
    return run_lab("data_order", None, ["--resizes", RESIZES], echo=False)


def test_each_design_against_its_prediction(alone):
    assert_lab_metadata(alone, "data_order")
    designs = alone["designs"]
    assert set(designs) == set(data_order.DESIGNS)
    for design in data_order.DESIGNS:
        for resize in designs[design]["resizes"]:
            assert (resize["skipped_samples"], resize["repeated_samples"]) == (
                resize["predicted_skipped_samples"], resize["predicted_repeated_samples"])
    for resize in designs["distributed_sampler"]["resizes"]:
        assert (resize["predicted_skipped_samples"], resize["predicted_repeated_samples"]) == \
            ftm.sampler_resume_error(data_order.DATASET, data_order.BATCH, data_order.SAVE_AT,
                                     resize["from"], resize["to"])
    assert [(r["skipped_samples"], r["repeated_samples"])
            for r in designs["distributed_sampler"]["resizes"]] == [(0, 20), (40, 0)]
    # the global order: nothing skipped or repeated, whatever the sizes
    assert designs["global_order"]["skipped_samples"] == 0
    assert designs["global_order"]["repeated_samples"] == 0
    # the stateful loader: shrinking, DistributedSampler's error; growing, the new ranks
    # start the epoch over while the others skip what nobody trains
    stateful = designs["stateful_dataloader"]["resizes"]
    assert [(r["skipped_samples"], r["repeated_samples"]) for r in stateful] == [(0, 20), (13, 13)]
    for resize in stateful:
        assert (resize["predicted_skipped_samples"], resize["predicted_repeated_samples"]) == \
            ftm.stateful_resume_error(data_order.DATASET, data_order.BATCH, data_order.SAVE_AT,
                                      resize["from"], resize["to"])
    for design in designs.values():   # no size unchanged: nothing to compare bit for bit
        assert design["bit_identical_resume"] is None
        assert [r["bit_identical_resume"] for r in design["resizes"]] == [None, None]


def test_the_ranks_shared_over_two_processes_train_the_same(alone):
    shared = run_lab("data_order", 2, ["--resizes", "6:5"], echo=False)
    assert shared["world_size"] == 2
    for name, design in shared["designs"].items():
        (resize,) = design["resizes"]
        assert resize == alone["designs"][name]["resizes"][0]


def test_bad_resizes_are_refused_in_one_line(script):
    assert_refused(data_order.parse_args, ["--resizes", "4-3"], "expected two world sizes")
    assert_refused(data_order.parse_args, ["--resizes", "7:3"], "a world of 7 does not split")
    assert_refused(data_order.parse_args, ["--designs", "random"], "invalid choice")
    assert_fails_with_one_line(script("data_order", "--resizes", "4:0"),
                               "expected two world sizes")
