"""Mini-DDP: naive, bucketed and overlapped data parallelism, and torch DDP, each equal to
one process trained on the whole batch. The chapter runs N = 2 with and without the
simulated slow link; here N = 3 with both, a world of one, and bad input."""

import pytest

import mini_ddp
from conftest import assert_fails_with_one_line, assert_refused
from labkit.predict import time_model
from labkit.runtime.launch import run_lab

FAST = ["--steps", 4, "--warmup", 1]


def check(result, world_size):
    assert result["world_size"] == world_size
    for link in result["links"]:
        assert list(link["variants"]) == list(mini_ddp.VARIANTS)
        for name, row in link["variants"].items():
            assert row["max_param_diff"] <= 1e-5, name
            assert row["step_time_s"] > 0 and row["step_time_spread_s"] >= 0
    assert sum(result["bucket_bytes"]) == sum(result["param_bytes"])
    assert result["bucket_bytes"] == time_model.bucket_bytes(result["param_bytes"],
                                                             (1 << 20, 1 << 20))
    # the scratch buckets are torch DDP's own, as its logging data gives them after its
    # rebuild; in its first iteration DDP all-reduces everything as one bucket
    assert result["torch_ddp_bucket_bytes"] == result["bucket_bytes"]
    assert result["torch_ddp_first_bucket_bytes"] == [sum(result["param_bytes"])]
    assert len(result["bucket_bytes"]) > 1  # several buckets, or there is nothing to overlap
    assert all(result[f"{phase}_time_s"] > 0 for phase in ("forward", "backward", "optimizer"))


def test_every_variant_equals_the_reference_at_n_3_with_and_without_the_slow_link():
    result = run_lab("mini_ddp", 3, [*FAST, "--comm-delay-ns-per-byte", "0,2"], echo=False)
    check(result, 3)
    assert [link["comm_delay_ns_per_byte"] for link in result["links"]] == [0, 2]
    # 2.14 MB at 2 ns per byte sent: the naive variant waits at least that long
    waited = sum(time_model.delay_s(b, 3, 2.0) for b in result["param_bytes"])
    assert result["links"][1]["variants"]["naive"]["step_time_s"] > waited


def test_a_world_of_one_runs_without_torchrun():
    check(run_lab("mini_ddp", None, [*FAST, "--variants", "all"], echo=False), 1)


def test_a_parameter_that_gets_no_gradient_is_reported():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    link = mini_ddp.Link(world_size=1, ns_per_byte=0)
    overlapped = mini_ddp.Overlapped(model, link, bucket_bytes_cap=1)
    (model.weight.sum()).backward()  # the bias gets no gradient
    with pytest.raises(RuntimeError, match="unused parameter"):
        overlapped.after_backward()


@pytest.mark.parametrize("args, words", [
    (["--variants", "fast"], "invalid choice: 'fast'"),
    (["--batch", 0], "--batch must be at least 1"),
    (["--steps", 2, "--warmup", 2], "--warmup must be"),
    (["--comm-delay-ns-per-byte", -1], "cannot be negative"),
    (["--comm-delay-ns-per-byte", "0,x"], "must be numbers"),
    (["--bucket-mb", 0], "--bucket-mb must be positive"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(mini_ddp.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    assert_fails_with_one_line(script("mini_ddp", "--batch", 0), "--batch must be at least 1")
