"""The mesh lab: data x pipeline x context x tensor parallelism on one device mesh, against
one process trained on the whole batch, with each dimension's bytes counted against the
cost models. The chapter runs dp 2 x pp 2 x tp 2 on 8 ranks with DDP, dp 2 x tp 2 with
FSDP2 and cp 2 x tp 2, and asserts the same (hybrid.md, hidden cells); here the other
layouts and odd degrees."""

import pytest

import hybrid
from conftest import assert_fails_with_one_line, assert_refused
from labkit.parallel import mesh
from labkit.runtime.launch import run_lab

# (dp, pp, cp, tp, data parallelism): the layouts the chapter does not run (it asserts
# its three, exactly): pairs of axes without the others, an odd degree of FSDP2 over three
# data-parallel ranks (its padding makes their shards unequal), tensor parallelism over
# three ranks, and context parallelism over three ranks beside data parallelism (a sequence
# of 12 tokens, 6 zig-zag chunks). One launch of 6 ranks: the first layout on the whole
# world, then the others (--then), side by side on blocks of its ranks, the last two from
# rank 0 again, one after the other, since neither fits in the ranks left.
LAYOUTS = [(2, 1, 3, 1, "ddp"), (3, 1, 1, 1, "fsdp"), (1, 1, 1, 3, "ddp"),
           (1, 2, 1, 2, "ddp"), (2, 2, 1, 1, "ddp")]
WORLD = 6
SEQ = 12   # cuts into 2 x 3 chunks


def layout_option(dp, pp, cp, tp, data_parallel):
    return f"dp={dp},pp={pp},cp={cp},tp={tp},data-parallel={data_parallel}"


@pytest.fixture(scope="module")
def launch():
    (dp, pp, cp, tp, data_parallel), *then = LAYOUTS
    return run_lab("hybrid", WORLD, [
        "--dp", dp, "--pp", pp, "--cp", cp, "--tp", tp, "--data-parallel", data_parallel,
        "--seq", SEQ, "--then", *(layout_option(*layout) for layout in then)], echo=False)


@pytest.fixture(scope="module", params=range(len(LAYOUTS)),
                ids=lambda index: "dp%d-pp%d-cp%d-tp%d-%s" % LAYOUTS[index])
def result(request, launch):
    return launch if request.param == 0 else launch["then"][request.param - 1]


def test_the_layouts_of_one_launch_run_side_by_side_then_from_rank_0_again(launch):
    assert launch["world_size"] == WORLD and (launch["first_rank"], launch["ranks"]) == (0, 6)
    assert [(r["first_rank"], r["ranks"]) for r in launch["then"]] == [(0, 3), (3, 3), (0, 4),
                                                                       (0, 4)]
    assert [(r["dp"], r["pp"], r["cp"], r["tp"], r["data_parallel"]) for r in launch["then"]] \
        == LAYOUTS[1:]
    assert hybrid.first_ranks([hybrid.parse_args(["--dp", 8])] * 4, 8) == [0, 0, 0, 0]
    halves = hybrid.parse_args(["--dp", 4])
    assert hybrid.first_ranks([halves] * 5, 8) == [0, 0, 4, 0, 4]


def test_the_trained_model_is_the_single_process_one(result):
    assert result["max_param_diff"] <= 1e-5


def test_the_mesh_puts_tp_innermost_and_matches_init_device_mesh(result):
    dp, pp, cp, tp = result["dp"], result["pp"], result["cp"], result["tp"]
    world, first = dp * pp * cp * tp, result["first_rank"]
    assert result["ranks"] == world
    assert result["groups_match_init_device_mesh"] is True
    assert [e["rank"] for e in result["mesh"]] == list(range(first, first + world))
    assert [(e["dp"], e["pp"], e["cp"], e["tp"]) for e in result["mesh"]] == [
        (d, p, c, t) for d in range(dp) for p in range(pp) for c in range(cp) for t in range(tp)]
    assert result["groups"] == {dim: [[first + r for r in g] for g in groups]
                                for dim, groups in mesh.groups(dp, pp, tp, cp).items()}
    for dim, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
        groups = result["groups"][dim]
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(first, first + world))


def test_counted_bytes_and_state_equal_the_cost_models_exactly(result):
    assert result["comm_bytes_per_rank"] == result["predicted_comm_bytes_per_rank"]
    assert result["state_bytes_per_rank"] == result["predicted_state_bytes_per_rank"]
    dp, pp, tp = result["dp"], result["pp"], result["tp"]
    if result["data_parallel"] == "fsdp" and dp > 1:
        # ZeRO-3: 3 m gathers and reduce-scatters; DDP's one all-reduce would be 2
        assert result["comm_bytes_per_rank"]["dp"][0] > 2 * result["state_bytes_per_rank"][0][
            "params"] * (dp - 1) * result["microbatches"]
    # a dimension of one sends nothing, and every dimension of more than one sends something
    for dim, size in (("dp", dp), ("pp", pp), ("cp", result["cp"]), ("tp", tp)):
        sent = result["comm_bytes_per_rank"][dim]
        assert all(b == 0 for b in sent) if size == 1 else all(b > 0 for b in sent), dim


def test_tp_and_fsdp_divide_the_state_and_ddp_does_not(result):
    """Under DDP every data-parallel replica holds the same bytes, a whole tensor-parallel
    slice of its stage; FSDP2's shards of it add up to that slice exactly, however unequal
    its padding makes them. Tensor parallelism divides the state by t, but for the
    replicated LayerNorms and biases."""
    per_rank = [s["total"] for s in result["state_bytes_per_rank"]]
    dp, pp, tp = result["dp"], result["pp"], result["tp"]
    replica = hybrid.parse_args(["--dp", dp, "--pp", pp, "--tp", tp, "--cp", result["cp"],
                                 "--seq", result["shape"]["seq"]])   # whole replicas
    per_rank = dict(zip((e["rank"] for e in result["mesh"]), per_rank))
    for group in result["groups"]["dp"]:
        stage = result["mesh"][group[0] - result["first_rank"]]["pp"]
        whole = hybrid.predictions(hybrid.shape_from_args(replica), replica, stage)[0]["total"]
        if result["data_parallel"] == "ddp":
            assert all(per_rank[r] == whole for r in group)
        else:
            assert sum(per_rank[r] for r in group) == whole
            assert all(per_rank[r] < whole for r in group) or dp == 1
    if pp == 1 and tp > 1:
        model = 3 * 4 * hybrid.memory_model.transformer_params(
            *(result["shape"][k] for k in ("layers", "hidden", "vocab", "seq")))
        slice_ = hybrid.predictions(hybrid.shape_from_args(replica), replica, 0)[0]["total"]
        assert model / tp < slice_ < model / tp * 1.2


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(hybrid.parse_args, ["--tp", "0"], "--tp must be at least 1")
    assert_refused(hybrid.parse_args, ["--schedule", "interleaved"], "invalid choice")
    assert_fails_with_one_line(script("hybrid", "--dp", "2"),
                               "--dp 2 x --pp 1 x --cp 1 x --tp 1 = 2, but the world has 1 rank")
    assert_fails_with_one_line(script("hybrid", "--pp", "5"),
                               "a world of 1 rank is not a multiple of --pp 5")
    assert_refused(hybrid.parse_args, ["--then", "dp=2,ep=2"], "keys dp, pp, cp, tp, data-parallel")
    assert_refused(hybrid.parse_args, ["--then", "tp=0"], "tp=0: a degree is a whole number")
    assert_refused(hybrid.parse_args, ["--then", "cp=2,data-parallel=fsdp"],
                   "--then cp=2,data-parallel=fsdp: --cp with --data-parallel fsdp is not built")
    assert_refused(hybrid.parse_args, ["--then", "tp=4"],
                   "--then tp=4: --heads 6 does not split over --tp 4")
    with pytest.raises(SystemExit) as error:   # checked once the world's size is known
        hybrid.layouts(hybrid.parse_args(["--then", "dp=2"]), 1)
    assert "--then dp=2: the layout needs 2 ranks, but the world has 1 rank" in str(error.value)


def test_degrees_the_model_cannot_take_are_refused():
    for argv, words in ((["--tp", "4", "--heads", "6"], "--heads 6 does not split over --tp 4"),
                        (["--pp", "3", "--layers", "2"], "--layers 2 cannot give each of --pp 3"),
                        (["--dp", "5"], "--batch 24 does not divide into --dp 5"),
                        (["--cp", "3"], "--seq 8 does not cut into 2 x --cp 3 equal chunks"),
                        (["--cp", "2", "--data-parallel", "fsdp"], "--cp with --data-parallel fsdp")):
        args = hybrid.parse_args(argv)
        with pytest.raises(SystemExit) as error:
            hybrid.check(args, (args.dp or 1) * args.pp * args.cp * args.tp)
        assert words in str(error.value)
