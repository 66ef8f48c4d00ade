"""Talking less (labs/low_communication.py, labkit/predict/low_communication_model.py): every
method's bytes against the cost model exactly, at an odd world size and with fragments that
do not divide the layers; DiLoCo that must equal DDP does; bad input in one line."""

import pytest
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused, run_script

import low_communication as lab
from labkit.predict import low_communication_model as model
from labkit.runtime.launch import run_lab


def test_powersgd_compresses_what_torchs_hook_compresses():
    # 256 x 64 at rank 2: (256 + 64) x 2 x 2 = 1,280 < 16,384, compressed; a bias of 64 is a
    # 64 x 1 matrix, never worth it; 4 x 4 at rank 2: (4 + 4) x 2 x 2 = 32 > 16, sent whole
    assert model.powersgd_split([(256, 64), (64,), (4, 4)], 2) == (64 + 16, 256 * 2, 64 * 2)
    # a rank above a side is capped there, as torch caps it
    assert model.powersgd_split([(300, 3)], 8) == (900, 0, 0)


def test_fragments_cover_the_layers_unevenly_where_they_must():
    assert model.fragments_of(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert model.fragments_of(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        model.fragments_of(4, 5)


def test_streaming_diloco_sends_diloco_s_bytes_spread_over_the_period():
    shapes = [(64, 64)] * 4
    common = dict(sync_every=4)
    diloco = model.bytes_sent_per_rank("diloco", 8, shapes, 3, **common)
    streaming = model.bytes_sent_per_rank("streaming_diloco", 8, shapes, 3,
                                          fragment_values=[8192, 4096, 4096], **common)
    assert streaming == diloco == model.bytes_sent_per_rank("ddp", 8, shapes, 3) / 4
    # at most a fragment at once, where DiLoCo sends everything in one step
    peak = model.peak_bytes_per_sync("streaming_diloco", shapes, 3,
                                     fragment_values=[8192, 4096, 4096], **common)
    assert peak == model.peak_bytes_per_sync("diloco", shapes, 3, **common) / 2


def test_the_crossover_is_where_saved_bytes_pay_for_the_added_compute():
    # 1 MB saved a step at 10 ms more compute: below 100 MB/s the compressed method wins
    assert model.crossover_bandwidth(2e6, 0.05, 1e6, 0.06) == pytest.approx(1e8)
    assert model.crossover_bandwidth(1e6, 0.05, 2e6, 0.05) is None


@pytest.fixture(scope="module")
def three_ranks():
    return run_lab("low_communication", 3,
                   ["--steps", 6, "--sync-every", 3, "--fragments", 3, "--slow-ns-per-byte", 2],
                   echo=False)


def test_every_method_sends_what_the_model_says(three_ranks):
    assert_lab_metadata(three_ranks, "low_communication")
    methods = three_ranks["methods"]
    assert set(methods) == set(model.METHODS)
    for name, m in methods.items():
        assert m["bytes_sent_per_rank_per_step"] == m["predicted_bytes_sent_per_rank_per_step"], name
        assert len(m["loss_curve"]) == 6 and m["final_loss"] == m["loss_curve"][-1]
    ddp = methods["ddp"]["bytes_sent_per_rank_per_step"]
    assert methods["bf16"]["bytes_sent_per_rank_per_step"] == ddp / 2
    assert methods["powersgd"]["bytes_sent_per_rank_per_step"] < ddp / 2
    assert methods["diloco"]["bytes_sent_per_rank_per_step"] == ddp / 3   # H = 3
    # streaming: the same bytes, a third of them at a time at most (3 fragments of 4 layers)
    assert (methods["streaming_diloco"]["peak_bytes_per_step"]
            < methods["diloco"]["peak_bytes_per_step"])


def test_diloco_that_must_equal_ddp_does_and_the_others_differ(three_ranks):
    checks, methods = three_ranks["checks"], three_ranks["methods"]
    assert checks["diloco_h1_max_param_diff_vs_ddp"] <= 1e-5
    assert methods["ddp"]["max_param_diff_vs_ddp"] == 0.0
    for name in ("powersgd", "local_sgd", "diloco", "streaming_diloco"):
        assert methods[name]["max_param_diff_vs_ddp"] > 1e-4, name


def test_bad_input_is_refused_in_one_line():
    assert_refused(lab.parse_args, ["--fragments", 5], "more than the model's 4 layers")
    assert_refused(lab.parse_args, ["--powersgd-rank", 1000], "above the smaller side")
    assert_refused(lab.parse_args, ["--method", "gossip"], "gossip")
    done = run_script("low_communication", "--sync-every", 9, "--steps", 4)
    assert_fails_with_one_line(done, "--sync-every 9 is more than --steps 4")


def test_the_shapes_are_the_course_transformers():
    from labkit.model.transformer import Transformer
    shape = lab.SHAPE
    real = [tuple(p.shape) for p in Transformer(shape).parameters()]
    assert model.transformer_shapes(shape.layers, shape.hidden, shape.vocab, shape.seq) == real
