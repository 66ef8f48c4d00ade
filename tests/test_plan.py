"""The planner (labs/labkit/predict/planner/, labs/plan.py): every configuration it returns uses
all N GPUs, fits the stated memory, adds its step time up and is ranked; its memory for the
course's model is the memory calculator's; its tensor-parallel term is the one traffic
model; recomputation, fused attention, interleaving, context and expert parallelism move
memory and time the way their definitions say; --layout ranks one layout; and neither the
planner nor the cost models import torch.

The step-time formulas checked by hand here are the flat rate's (Settings(rate="flat")),
every FLOP at one fraction of the peak; tests/test_planner_rate.py checks the shape rate,
the planner's default, against them."""

import dataclasses
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

import memory
import plan
from conftest import LABS, assert_fails_with_one_line, assert_refused
from labkit.predict import comm_model, memory_model, planner, time_model
from labkit.predict import precision_model as pm

CHAPTER = Path(__file__).resolve().parent.parent / "book" / "hybrid.md"

SHAPE_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--vocab", "128256",
             "--seq", "4096"]
CASES = {"70B on 256": [*SHAPE_70B, "--gpus", "256", "--global-batch-tokens", "4M"],
         "Llama 3 8B on 64, cp": ["--model", "llama3-8b", "--gpus", "64", "--cp", "1,2,4",
                                  "--global-batch-tokens", "2M"],
         "odd: 7B on 24, 40 GB": ["--params", "7B", "--gpus", "24", "--gpus-per-node", "4",
                                  "--gpu-memory-gb", "40", "--global-batch-tokens", "3M"],
         "MoE on 64": ["--layers", "8", "--hidden", "2048", "--heads", "16", "--vocab", "32000",
                       "--llama", "--experts", "16", "--top-k", "2", "--expert-hidden",
                       "1024", "--gpus", "64", "--global-batch-tokens", "1M"]}


def planned(capsys, argv):
    plan.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_predictions_import_no_torch():
    """labkit/predict/ runs in a browser (Pyodide), where there is no torch: every module
    found in that folder is imported, and the planner's command line run, with torch made
    unimportable, and nothing from labkit's other folders may come in with them; its
    subfolders' modules (the planner's package) too."""
    code = ("import sys, pathlib; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "import importlib, plan; "
            "folder = pathlib.Path(sys.argv[1]) / 'labkit' / 'predict'; "
            "names = sorted('.'.join(p.relative_to(folder).with_suffix('').parts) "
            "for p in folder.rglob('*.py') if p.stem != '__init__' "
            "and '__pycache__' not in p.parts); "
            "[importlib.import_module('labkit.predict.' + name) for name in names]; "
            "plan.run(plan.parse_args(['--model', 'llama3-8b', '--gpus', '8'])); "
            "print(len(names), sorted(m for m in sys.modules if m.startswith('labkit.') "
            "and not m.startswith('labkit.predict')))")
    done = subprocess.run([sys.executable, "-c", code, str(LABS)], capture_output=True,
                          text=True, check=True)
    count, others = done.stdout.strip().split(" ", 1)
    assert int(count) >= 9 + len(PLANNER_FILES) and others == "[]"


# The planner's package, each file importing only those before it (shapes at the bottom,
# the search at the top): no cycles, and a file's dependencies read from this list
PLANNER_FILES = ("shapes", "settings", "presets", "layout", "collectives", "tensor_parallel",
                 "data_parallel", "pipeline", "context_parallel", "expert_parallel",
                 "memory_per_gpu", "compute", "step", "search")


def test_the_planners_files_import_one_way():
    """Every file of labkit/predict/planner/ is in PLANNER_FILES, imports of its siblings
    only those listed before it, and of the rest of labkit only labkit/predict/'s modules;
    the package's __init__ re-exports the public names of all of them."""
    import ast
    folder = Path(planner.__file__).parent
    assert {p.stem for p in folder.glob("*.py")} == {"__init__", *PLANNER_FILES}
    for index, name in enumerate(PLANNER_FILES):
        tree = ast.parse((folder / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0:   # the standard library's
                    assert not node.module.startswith("labkit"), (name, node.module)
                elif node.level == 1:
                    assert node.module in PLANNER_FILES[:index], (name, node.module)
                else:   # from .. import the cost models beside the package
                    assert node.level == 2 and node.module is None and all(
                        (folder.parent / f"{alias.name}.py").is_file() for alias in node.names)
            if isinstance(node, ast.Import):   # the standard library's alone
                assert not any(a.name.startswith("labkit") for a in node.names), name
        public = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                  and not n.name.startswith("_")}
        public |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                   if isinstance(t, ast.Name) and not t.id.startswith("_")}
        module = getattr(planner, name)
        for attribute in public:
            assert getattr(planner, attribute) is getattr(module, attribute), (name, attribute)


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_every_configuration_uses_all_gpus_fits_and_is_ranked(capsys, argv):
    result = planned(capsys, argv)
    hw, model = result["hardware"], result["model"]
    limit, gpus = hw["gpu_memory_gb"] * 1e9, hw["gpus"]
    configurations = result["configurations"]
    assert configurations, "something must fit"
    sequences = result["global_batch_tokens"] // model["seq"]
    for c in configurations:
        assert c["dp"] * c["tp"] * c["pp"] * c["cp"] == gpus
        # the experts' etp x ep ranks tile a stage's tp x cp x dp (Megatron-Core's mesh)
        assert (c["tp"] * c["dp"] * c["cp"]) % (c["ep"] * c["etp"]) == 0
        assert (model["experts"] or 1) % c["ep"] == 0 and c["etp"] in {1, c["tp"]}
        assert hw["gpus_per_node"] % c["tp"] == 0   # tp inside a node
        assert c["dp"] * c["micro_batch"] * c["microbatches"] == sequences
        assert sum(c["stage_layers"]) == model["layers"] and len(c["stage_layers"]) == c["pp"]
        if c["chunks"] > 1:   # a layer in every chunk but the two end ones, which may hold none
            chunks = c["chunk_layers"]
            assert len(chunks) == c["pp"] * c["chunks"] and min(chunks[1:-1]) >= 1
            assert [sum(chunks[r::c["pp"]]) for r in range(c["pp"])] == c["stage_layers"]
        else:
            assert min(c["stage_layers"]) >= 1 and "chunk_layers" not in c
        assert c["memory_bytes"]["total"] <= c["memory_bytes"]["usable"] < limit
        assert c["recompute"] in planner.RECOMPUTE and c["checkpointing"] == (
            c["recompute"] == "full")
        times = c["time_s"]
        assert times["step"] == pytest.approx(sum(v for k, v in times.items() if k != "step"))
        assert 0 < c["mfu"] < c["mfu_with_attention"] <= result["settings"]["mfu"] * 1.5
    steps = [c["time_s"]["step"] for c in configurations]
    assert steps == sorted(steps)


def test_memory_equals_the_memory_calculator_for_the_courses_model(capsys):
    """For the course's GPT-style model, without dropout and without a fused attention,
    the planner's bytes on the fullest GPU are the memory calculator's (labs/memory.py
    predict), with and without full recomputation; under ZeRO-3 the planner adds the layer
    gathered whole while it runs, 16-bit weights and gradients (DeepSpeed's 4 bytes a
    parameter of the largest layer), which the calculator's model states leave out."""
    argv = [*SHAPE_70B, "--gpus", "256", "--global-batch-tokens", "4M",
            "--no-flash-attention", "--recompute", "none"]
    shape = SHAPE_70B
    for recompute in ("none", "full"):
        argv[-1] = recompute
        result = planned(capsys, argv)
        configurations = result["configurations"]
        model = planner.Model(**{k: v for k, v in result["model"].items()
                                 if k in {f.name for f in dataclasses.fields(planner.Model)}})
        sample = [c for c in configurations if c["chunks"] == 1][:3] + random.Random(0).sample(
            [c for c in configurations if c["chunks"] == 1], 6)
        for c in sample:
            memory.main(["predict", *shape, "--gpus", str(c["dp"]), "--pp", str(c["pp"]),
                         "--tp", str(c["tp"]), "--batch", str(c["micro_batch"]),
                         "--microbatches", str(c["microbatches"]), "--no-dropout", "--json",
                         "--stage-layers", ",".join(map(str, c["stage_layers"]))]
                        + (["--sequence-parallel"] if c["tp"] > 1 else []))
            row = json.loads(capsys.readouterr().out)[c["zero"]]
            key = "per_gpu_checkpointed" if recompute == "full" else "per_gpu"
            gathered = 4 * sum(model.layer_params(0, c["tp"])) if c["zero"] == "zero3" else 0
            assert row[key] + gathered == c["memory_bytes"]["total"], c


def test_one_model_of_tensor_parallel_traffic():
    """The planner's tp term prices comm_model.tensor_parallel_collectives for each pipeline
    rank, with the embedding's collectives on the first rank only and the head's and the
    loss's on the last only, each at its ring time on NVLink, and takes the slowest rank
    (10 collectives per layer and micro-batch with sequence parallelism, 14 recomputing);
    the chapter's table of what each axis sends lists the same function's collectives."""
    model = planner.PRESETS["llama3-70b"]
    hw = planner.Hardware(256)
    settings = planner.Settings(rate="flat", global_batch_tokens=4 * 2 ** 20)

    def priced(op, n, gather_bytes=2):
        if op == "all_reduce":
            return comm_model.allreduce_time(2 * n, tp, *hw.nvlink)
        return time_model.shard_collective_time(
            (gather_bytes if op == "all_gather" else 2) * n, tp, *hw.nvlink)

    for tp, pp, b, recompute in ((8, 4, 1, "none"), (8, 3, 2, "full"), (2, 8, 1, "none")):
        dp = 256 // (tp * pp)
        m = settings.global_batch_tokens // model.seq // dp // b
        config = {"dp": dp, "tp": tp, "pp": pp, "cp": 1, "ep": 1, "chunks": 1,
                  "micro_batch": b, "microbatches": m, "zero": "zero1", "recompute": recompute}
        per_layer = 14 if recompute == "full" else 10
        by_hand, fp8_by_hand, head_on_every_stage = [], [], []
        for rank, layers in enumerate(planner.stage_split(model, pp)):
            first, last = rank == 0, rank == pp - 1
            one = comm_model.tensor_parallel_collectives(
                layers, model.seq, b, model.hidden, tp, sequence_parallel=True,
                embedding=first, head=last, microbatches=1, recompute=recompute == "full")
            *micro_batch, replicated = one
            sbh = b * model.seq * model.hidden
            assert sum(n == sbh for _, n in micro_batch[:layers * per_layer]) == \
                layers * per_layer
            by_hand.append(m * sum(priced(*c) for c in micro_batch) + priced(*replicated))
            # FP8: the layers' gathers in one byte a value (Transformer Engine gathers FP8
            # inputs and gradients), the head's and embedding's and every reduction in two
            fp8_by_hand.append(m * (sum(priced(*c, 1) for c in micro_batch[:layers * per_layer])
                                    + sum(priced(*c) for c in micro_batch[layers * per_layer:]))
                               + priced(*replicated))
            # the old price: every stage charged the head's and the loss's collectives
            head_on_every_stage.append(m * sum(priced(*c) for c in comm_model.
                                               tensor_parallel_collectives(
                layers, model.seq, b, model.hidden, tp, sequence_parallel=True,
                embedding=False, head=True, microbatches=1, recompute=recompute == "full")[:-1]))
        got = planner.step_time(model, config, settings, hw)["tp"]
        assert got == pytest.approx(max(by_hand))
        assert got < max(head_on_every_stage)
        fp8 = planner.Settings(rate="flat", global_batch_tokens=settings.global_batch_tokens,
                               precision="fp8")
        assert planner.step_time(model, config, fp8, hw)["tp"] == pytest.approx(max(fp8_by_hand))
    assert "comm_model.tensor_parallel_collectives(" in CHAPTER.read_text()


def test_tensor_parallel_overlap_hides_each_collective_behind_its_own_product():
    """--tp-comm-overlap: each of a layer's ten sequence-parallel collectives is charged
    only for what outlasts the linear layer's product beside it (Transformer Engine's
    ring-exchange, pipelined and bulk pairs); an FP8 run moves eight of them in one byte a
    value, the bulk reduce-scatters in two; the head's, the loss's and the replicated
    gradients' stay whole. By hand for one layer of Llama 3 70B on a link slow enough that
    some products do not hide their collective, then: never more than without the
    overlap, and all of it once no product can hide anything."""
    model = planner.PRESETS["llama3-70b"]
    hw = planner.Hardware(64, nvlink_gb_s=100)
    rate = hw.peak_tflops * 1e12 * planner.COMPUTE_EFFICIENCY
    b, seq, tp = 1, model.seq, 4
    h, kv, f = model.hidden, model.kv_dim, model.ffn
    assert model.linear_flops_per_token(0) == (2 * h * (h + 2 * kv), 2 * h * h, 4 * h * f,
                                               2 * f * h)
    outside = planner.tensor_parallel_time(1, seq, b, h, tp, False, 1, False, hw) - \
        10 * time_model.shard_collective_time(2 * b * seq * h, tp, *hw.nvlink)
    exposed = {}
    for fp8 in (False, True):
        speed = pm.FP8_MATMUL_RATIO if fp8 else 1
        # forward FLOPs of the four linears on one of tp ranks, over the micro-batch's tokens
        qkv, proj, fc1, fc2 = (flops * b * seq / tp / rate / speed for flops in (
            2 * h * (h + 2 * kv), 2 * h * h, 4 * h * f, 2 * f * h))
        narrow, wide = (time_model.shard_collective_time(value_bytes * b * seq * h, tp,
                                                         *hw.nvlink)
                        for value_bytes in ((1 if fp8 else 2), 2))
        pairs = [(narrow, qkv), (narrow, proj), (narrow, fc1), (narrow, fc2),   # forward
                 (narrow, fc2), (narrow, proj),                                 # dgrad
                 (narrow, fc1), (wide, fc1), (narrow, qkv), (wide, qkv)]        # bulk
        exposed[fp8] = sum(max(0.0, comm - product) for comm, product in pairs)
        assert planner.tensor_parallel_overlapped_time(
            model, ((0, 1),), seq, b, tp, False, 1, False, hw, rate, fp8) == pytest.approx(
            exposed[fp8] + outside)
    # the MLP's products hide their collectives; the attention's (h x h and QKV) do not
    assert 0 < exposed[False] and 0 < exposed[True]

    # a mixture-of-experts layer: its attention's five hide behind their products; its
    # shared expert, a tensor-parallel MLP, hides its five behind its own products; the
    # routed experts' tokens move by the dispatcher's collectives (expert parallelism's)
    deepseek = planner.PRESETS["deepseek-v3"]
    for moe in (deepseek, dataclasses.replace(deepseek, shared_experts=0)):
        layer = moe.dense_layers
        qkv, proj, fc1, fc2 = (flops * b * moe.seq / tp / rate
                               for flops in moe.linear_flops_per_token(layer))
        share = moe.shared_experts / (moe.top_k + moe.shared_experts)
        fc1, fc2 = fc1 * share, fc2 * share       # the shared expert's products alone
        one = time_model.shard_collective_time(2 * b * moe.seq * moe.hidden, tp, *hw.nvlink)
        moe_pairs = [qkv, proj, proj, qkv, qkv] + [fc1, fc2, fc2, fc1, fc1] * (share > 0)
        moe_outside = planner.tensor_parallel_time(1, moe.seq, b, moe.hidden, tp, False, 1,
                                                   False, hw) - 10 * one
        assert planner.tensor_parallel_overlapped_time(
            moe, ((layer, 1),), moe.seq, b, tp, False, 1, False, hw, rate,
            False) == pytest.approx(sum(max(0.0, one - p) for p in moe_pairs) + moe_outside)
    # without the overlap, a MoE layer without a shared expert issues its attention's half
    assert planner.tensor_parallel_time(1, moe.seq, b, moe.hidden, tp, False, 1, False, hw,
                                        moe_layers=1) == pytest.approx(moe_outside + 5 * one)

    slow = planner.Hardware(64, nvlink_gb_s=1)   # a link no product can hide
    for hw_ in (hw, slow):
        for recompute in (False, True):
            plain = planner.tensor_parallel_time(8, seq, b, h, tp, False, 4, recompute, hw_)
            hidden = planner.tensor_parallel_overlapped_time(
                model, ((0, 8),), seq, b, tp, False, 4, recompute, hw_, rate, False)
            assert hidden < plain
            if hw_ is slow:   # each collective outlasts its product by that product's time
                qkv, proj, fc1, fc2 = (flops * b * seq / tp / rate
                                       for flops in model.linear_flops_per_token(0))
                forward = qkv + proj + fc1 + fc2
                backward = fc2 + proj + 2 * fc1 + 2 * qkv
                saved = 4 * 8 * (forward * (1 + recompute) + backward)   # m 4, 8 layers
                assert plain - hidden == pytest.approx(saved)

    # the step time takes it, as a setting of the run
    config = layout(dp=4, tp=4, pp=4, microbatches=32)
    on, off = (planner.step_time(model, config, planner.Settings(rate="flat",
        global_batch_tokens=128 * model.seq, tp_comm_overlap=overlap), hw)
        for overlap in (True, False))
    assert on["tp"] < off["tp"] and on["compute"] == off["compute"]
    argv = ["--model", "llama3-70b", "--gpus", "64", "--global-batch-tokens", "1M"]
    assert plan.settings_from_args(plan.parse_args([*argv, "--tp-comm-overlap"])).tp_comm_overlap
    assert not plan.settings_from_args(plan.parse_args(argv)).tp_comm_overlap


def test_torch_tensor_parallelism_issues_eight_collectives_and_async_tp_fuses_six():
    """--torch-tp: torch's sequence parallelism keeps the gathered inputs, so a layer
    issues eight collectives (forward: all-gathers before QKV and the MLP's first matrix,
    reduce-scatters after the output projection and the second matrix; backward: the
    gradient's all-gathers before the output projection's and the second matrix's dgrad,
    reduce-scatters after QKV's and the first matrix's dgrad); under FP8 (torchao) the
    all-gathers carry one byte. --async-tp fuses six with their products: not the two
    backward reduce-scatters, whose input sums several products. By hand for one layer
    of Llama 3 70B on a slow link."""
    model = planner.PRESETS["llama3-70b"]
    hw = planner.Hardware(64, nvlink_gb_s=100)
    rate = hw.peak_tflops * 1e12 * planner.COMPUTE_EFFICIENCY
    b, seq, tp = 1, model.seq, 4
    outside = planner.tensor_parallel_time(1, seq, b, model.hidden, tp, False, 1, False, hw) \
        - 10 * time_model.shard_collective_time(2 * b * seq * model.hidden, tp, *hw.nvlink)
    for fp8 in (False, True):
        speed = pm.FP8_MATMUL_RATIO if fp8 else 1
        qkv, proj, fc1, fc2 = (flops * b * seq / tp / rate / speed
                               for flops in model.linear_flops_per_token(0))
        narrow, wide = (time_model.shard_collective_time(value_bytes * b * seq * model.hidden,
                                                         tp, *hw.nvlink)
                        for value_bytes in ((1 if fp8 else 2), 2))
        forward = [(narrow, qkv), (wide, proj), (narrow, fc1), (wide, fc2)]
        backward = [(narrow, proj), (wide, 0.0), (narrow, fc2), (wide, 0.0)]
        for recompute in (False, True):
            pairs = forward * (1 + recompute) + backward
            fused = sum(max(0.0, comm - product) for comm, product in pairs)
            plain = sum(comm for comm, _ in pairs)    # 8 collectives, 12 recomputing
            assert len(pairs) == (12 if recompute else 8)
            for is_fused, by_hand in ((True, fused), (False, plain)):
                assert planner.tensor_parallel_overlapped_time(
                    model, ((0, 1),), seq, b, tp, False, 1, recompute, hw, rate, fp8,
                    "torch", is_fused) == pytest.approx(by_hand + outside)
            assert fused < plain
    # settings of the run, from the command line; one kind of tensor parallelism at a time
    argv = ["--model", "llama3-70b", "--gpus", "64", "--global-batch-tokens", "1M"]
    settings = plan.settings_from_args(plan.parse_args([*argv, "--async-tp"]))
    assert settings.async_tp and not settings.tp_comm_overlap
    config = layout(dp=4, tp=4, pp=4, microbatches=32)
    step = {name: planner.step_time(model, config, dataclasses.replace(settings, **kw), hw)
            for name, kw in (("async", {}), ("torch", {"async_tp": False, "torch_tp": True}),
                             ("megatron", {"async_tp": False}))}
    # fewer collectives than Megatron's ten (fourteen recomputing), then six of them hidden
    assert step["async"]["tp"] < step["torch"]["tp"] < step["megatron"]["tp"]
    assert step["async"]["compute"] == step["megatron"]["compute"]
    for flags in (["--async-tp", "--tp-comm-overlap"], ["--torch-tp", "--tp-comm-overlap"]):
        with pytest.raises(SystemExit):
            plan.parse_args([*argv, *flags])


def test_expert_overlap_hides_the_dispatch_behind_the_computation_as_far_as_it_lasts():
    """--ep-overlap (Megatron-Core's --overlap-moe-expert-parallel-comm): the dispatcher's
    collectives run beside another micro-batch's computation; only what outlasts it is
    charged."""
    model = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                          expert_hidden=1024)
    config = layout(dp=64, tp=1, pp=1, ep=8, microbatches=8)
    for gpus, slow in ((64, False), (64, True)):
        hw = planner.Hardware(gpus, nvlink_gb_s=0.01 if slow else 360)   # ep 8: one node
        plain, hidden = (planner.step_time(model, config, planner.Settings(rate="flat",
            global_batch_tokens=2 ** 20, ep_overlap=overlap), hw) for overlap in (False, True))
        work = plain["compute"] + plain["recompute"]
        assert hidden["ep"] == pytest.approx(max(0.0, plain["ep"] - work))
        assert (hidden["ep"] > 0) == slow
    argv = ["--model", "deepseek-v3", "--gpus", "64", "--global-batch-tokens", "1M"]
    assert plan.settings_from_args(plan.parse_args([*argv, "--ep-overlap"])).ep_overlap


def layout(**overrides):
    base = {"dp": 8, "tp": 8, "pp": 4, "cp": 1, "ep": 1, "chunks": 1, "micro_batch": 1,
            "microbatches": 16, "zero": "zero1", "recompute": "none"}
    return {**base, **overrides}


def test_recomputation_trades_memory_for_compute():
    """Selective recomputation drops the s x s attention matrix that an unfused attention
    keeps (heads x s values per token and layer) for attention's forward again; full
    recomputation keeps each layer's input for a whole forward again."""
    model, hw = planner.PRESETS["llama3-70b"], planner.Hardware(256)
    plain = planner.Settings(rate="flat", global_batch_tokens=4 * 2 ** 20, flash_attention=False)
    mem = {r: planner.memory(model, layout(recompute=r), plain, hw) for r in planner.RECOMPUTE}
    time_ = {r: planner.step_time(model, layout(recompute=r), plain, hw)
             for r in planner.RECOMPUTE}
    assert mem["none"]["total"] > mem["selective"]["total"] > mem["full"]["total"]
    assert time_["none"]["recompute"] == 0 < time_["selective"]["recompute"] \
        < time_["full"]["recompute"] == pytest.approx(time_["full"]["compute"] / 3)
    # what selective drops, on the first stage: its layers' attention matrices, in flight
    layers = planner.stage_split(model, 4)[mem["none"]["stage"]]
    in_flight = memory_model.pipeline_peak_microbatches("1f1b", 4, 16)[mem["none"]["stage"]]
    matrix = 2 * model.heads * model.seq / 8 * model.seq * layers * in_flight
    assert mem["none"]["total"] - mem["selective"]["total"] == pytest.approx(matrix)
    # a fused attention keeps no matrix: selective recomputation saves nothing more
    fused = planner.Settings(rate="flat", global_batch_tokens=4 * 2 ** 20)
    assert planner.memory(model, layout(), fused, hw) == mem["selective"]


def test_fp8_runs_the_linear_products_faster_gathers_less_and_can_keep_less():
    """--precision fp8: the layers' linear products FP8_MATMUL_RATIO times faster, the
    rest (attention's products, the embedding and head) as before; ZeRO-3's all-gathers
    carry the linear weights in one byte; --fp8-activations keeps the linear layers'
    inputs at half a 16-bit value (a dense Llama layer: QKV and MLP inputs, attention's
    output, the last MLP matrix's input)."""
    model, hw = planner.PRESETS["llama3-8b"], planner.Hardware(64)
    bf16 = planner.Settings(rate="flat", global_batch_tokens=2 ** 21)
    fp8 = planner.Settings(rate="flat", global_batch_tokens=2 ** 21, precision="fp8")
    kept = planner.Settings(
            rate="flat", global_batch_tokens=2 ** 21, precision="fp8", fp8_activations=True)
    config = layout(dp=16, tp=4, pp=1, zero="zero3", microbatches=4)
    rate = hw.peak_tflops * 1e12 * bf16.mfu
    saved = 6 * model.active_matrix_params() * (1 - 1 / pm.FP8_MATMUL_RATIO) * 2 ** 21 / 64 / rate
    times = {s: planner.step_time(model, config, s, hw) for s in (bf16, fp8)}
    assert times[bf16]["compute"] - times[fp8]["compute"] == pytest.approx(saved)
    # three quarters of an 8B model's FLOPs at 8K tokens are its layers' linear products,
    # which FP8 runs at the H100's measured FP8 rate over its bf16 one (1,402.6 over 794.5
    # TFLOP/s), not the datasheet's twice
    assert pm.FP8_MATMUL_RATIO == pytest.approx(1402.6 / 794.5)
    assert pm.FP8_MATMUL_RATIO < pm.FP8_PEAK_RATIO
    assert 0.7 < saved / times[bf16]["compute"] / (1 - 1 / pm.FP8_MATMUL_RATIO) < 0.8
    # a Llama layer's matrices: Q, O (h^2 each), K, V (h x kv each), three of h x f
    h, f, kv = model.hidden, model.ffn, model.kv_dim
    assert model.active_matrix_params() == model.layers * (2 * h * h + 2 * h * kv + 3 * h * f)
    # the all-gathers shrink, the reduce-scatters do not: the data-parallel time drops
    # by less than a third (two gathers and one reduce per unit, gathers at ~1/2)
    assert pm.gather_bytes_per_value("bf16", 0.9) == 2.0
    assert pm.gather_bytes_per_value("fp8", 0.9) == pytest.approx(1.1)
    dp = {s: planner.data_parallel_time("zero3", 1e9, 1, 32, 16, 2, hw,
                                        pm.gather_bytes_per_value(s.precision, 0.9))
          for s in (bf16, fp8)}
    assert 1 / 3 * (1 - 1.1 / 2) < 1 - dp[fp8] / dp[bf16] < 2 / 3 * (1 - 1.1 / 2) + 1e-9
    # DeepSeek-V3's cache per token on one of 4 ranks: the QKV and MLP inputs (split by
    # sequence parallelism) halved; attention's output (split by tp) at 12 of 16 bits;
    # SwiGLU's gate and up halved and its product recomputed: 2f of its 3f
    plain = model.layer_activation_values(0, 4)
    assert plain - model.layer_activation_values(0, 4, fp8_activations=True) == \
        pytest.approx(0.5 * 2 * h / 4 + (0.25 * h + 2 * f) / 4)
    mem = {s: planner.memory(model, config, s, hw) for s in (fp8, kept)}
    assert mem[kept]["activations"] < mem[fp8]["activations"]
    assert mem[kept]["states"] == mem[fp8]["states"]   # the same master weights and state


def test_auto_recomputation_picks_the_cheapest_that_fits(capsys):
    auto = planned(capsys, ["--model", "llama3-70b", "--gpus", "64", "--global-batch-tokens",
                            "1M"])["configurations"]
    every = planner.configurations(planner.PRESETS["llama3-70b"], planner.Settings(
        global_batch_tokens=2 ** 20), planner.Hardware(64))
    key = lambda c: tuple(c[k] for k in ("dp", "tp", "pp", "cp", "ep", "chunks",  # noqa: E731
                                         "micro_batch", "zero"))
    for c in auto[:20]:
        same = [o for o in every if key(o) == key(c)]
        assert c["time_s"]["step"] == min(o["time_s"]["step"] for o in same)
    assert {c["recompute"] for c in auto} > {"none"}   # some fit only by recomputing


def test_the_bubble_interleaving_and_fewer_microbatches_than_stages():
    """Interleaving v chunks divides 1F1B's idle time by v (m >= p); with m < p (Llama 3's
    case) the step waits for one micro-batch's trip through all stages. Each slot of the
    fill and drain lasts a micro-batch's computation and its exposed traffic, the
    pipeline's sends included (Narayanan et al., 2021, section 2.2): (p - 1)/(v m) of
    both; interleaved, the sends run beside the computation by Megatron-LM's default and
    wait only there."""
    model = planner.Model(64, 4096, 32, 2048, 51200)   # 64 layers, the head on the last
    hw, settings = planner.Hardware(64), planner.Settings(
            rate="flat", global_batch_tokens=64 * 2048 * 2)
    for m, v in ((16, 1), (16, 2), (16, 4), (4, 1), (4, 2)):
        config = layout(pp=8, tp=8, dp=1, microbatches=m, chunks=v, micro_batch=128 // m)
        t = planner.step_time(model, config, settings, hw)
        work = t["compute"] + t["recompute"]
        imbalance = planner.stage_imbalance(model, planner.stage_split(model, 8, v))
        fraction = time_model.pipeline_bubble_fraction(8, m, v)
        # eight nodes: each send on the network, its 1/tp of a micro-batch's activations
        sends = m * v * 2 * (hw.network[0] + 2 * (128 // m) * 2048 * 4096 / 8 / hw.network[1])
        assert t["pp"] == (0.0 if v > 1 else pytest.approx(sends))
        traffic = t["tp"] + sends
        assert t["bubble"] == pytest.approx((work * imbalance + traffic) / (1 - fraction)
                                            - work - traffic)
        # the old price, the computation's alone, was short by the traffic's share
        assert t["bubble"] - (work * imbalance / (1 - fraction) - work) == pytest.approx(
            traffic * fraction / (1 - fraction))
        if m >= 8:
            # Narayanan et al.'s (p - 1)/(v m) of the micro-batches' time on the slowest
            # stage, and that stage's lead on the mean one
            slowest = work * imbalance
            assert t["bubble"] == pytest.approx(7 / (v * m) * (slowest + traffic)
                                                + slowest - work)
        if m >= 8:
            assert fraction == pytest.approx(7 / (v * m + 7))
        else:
            assert fraction == pytest.approx((v * 8 + m - 1 - v * m) / (v * 8 + m - 1))


def test_data_parallel_groups_across_nodes_are_hierarchical():
    hw = planner.Hardware(256)
    bytes_ = 1e9
    for size, per_node in ((32, 1), (64, 2), (8, 8)):
        got = planner.group_time("all_reduce", bytes_, size, per_node, hw)
        if size <= per_node:
            assert got == comm_model.allreduce_time(bytes_, size, *hw.nvlink)
        else:
            assert got == time_model.nccl_allreduce_time(bytes_, size, per_node,
                                                         hw.nvlink, hw.network)
            assert planner.group_time("reduce_scatter", bytes_, size, per_node, hw) == \
                time_model.hierarchical_shard_collective_time(bytes_, size, per_node,
                                                              hw.nvlink, hw.network)
    assert planner.members_per_node(8, 32, hw) == 1 and planner.members_per_node(2, 60, hw) == 4


def test_all_gathers_and_reduce_scatters_across_nodes_are_rings():
    """NCCL has no tree for these two: over 2,048 GPUs (256 nodes) a 1 MB all-gather, where
    a tree all-reduce's log2 latency wins, still pays its ring's 2,047 steps, 255 of them
    across the network (NCCL's tuning model); priced as half the tree-choosing all-reduce
    it came out several times too cheap."""
    hw, bytes_, size = planner.Hardware(2048), 1e6, 2048
    gather = planner.group_time("all_gather", bytes_, size, 8, hw)
    assert gather == time_model.hierarchical_shard_collective_time(bytes_, size, 8, hw.nvlink,
                                                                   hw.network)
    nodes = size // 8
    assert gather == pytest.approx((size - nodes) * hw.nvlink[0] + (nodes - 1) * hw.network[0]
                                   + (size - 1) / size * bytes_
                                   / min(hw.nvlink[1], 8 * hw.network[1]))
    tree_halved = planner.group_time("all_reduce", bytes_, size, 8, hw) / 2
    assert gather > 3 * tree_halved
    assert planner.group_time("all_gather", bytes_, 8, 8, hw) == \
        time_model.shard_collective_time(bytes_, 8, *hw.nvlink)


def test_context_parallelism_splits_activations_and_hides_its_ring_on_long_sequences():
    model = planner.PRESETS["llama3-8b"]
    hw = planner.Hardware(64)
    long = dataclasses_replace(model, seq=65536)
    settings = planner.Settings(rate="flat", global_batch_tokens=16 * 65536)
    one = planner.memory(long, layout(dp=8, tp=8, pp=1, cp=1, microbatches=2), settings, hw)
    two = planner.memory(long, layout(dp=4, tp=8, pp=1, cp=2, microbatches=4), settings, hw)
    assert two["activations"] == pytest.approx(one["activations"] / 2 * 2, rel=1e-9) or \
        two["activations"] < one["activations"]
    # at 64K tokens a block's attention outlasts passing its K and V: nothing exposed
    assert planner.step_time(long, layout(dp=4, tp=8, pp=1, cp=2, microbatches=4),
                             settings, hw)["cp"] == 0
    short = planner.Settings(rate="flat", global_batch_tokens=64 * 1024)
    tiny = dataclasses_replace(model, seq=1024)
    assert planner.step_time(tiny, layout(dp=1, tp=8, pp=1, cp=8, microbatches=64),
                             short, hw)["cp"] > 0


def dataclasses_replace(model, **changes):
    return dataclasses.replace(model, **changes)


def test_pipeline_sends_split_over_tensor_and_context_parallel_ranks():
    """Each tensor-parallel rank sends its 1/tp of a micro-batch's b s h activations
    (sequence parallelism), of its s/cp tokens: one forward and one backward per
    micro-batch and chunk."""
    model, hw = planner.PRESETS["llama3-70b"], planner.Hardware(512)
    settings = planner.Settings(rate="flat", global_batch_tokens=4 * 2 ** 20)
    for tp, cp in ((1, 1), (8, 1), (8, 2)):
        config = layout(dp=512 // (tp * cp * 8), tp=tp, pp=8, cp=cp, microbatches=8)
        got = planner.step_time(model, config, settings, hw)["pp"]
        alpha, beta = hw.network
        expected = 8 * 1 * 2 * (alpha + 2 * 1 * (model.seq // cp) * model.hidden / tp / beta)
        assert got == pytest.approx(expected), (tp, cp)


def test_grouped_query_attention_shrinks_gpt_layers_too():
    """kv_heads narrows K and V in a GPT-style layer as in a Llama-style one: fewer
    parameters, and so fewer FLOPs; plan.py's --kv-heads counts without --llama."""
    full = planner.Model(4, 1024, 16, 2048, 50000)
    grouped = planner.Model(4, 1024, 16, 2048, 50000, kv_heads=4)
    h, kv = 1024, 4 * 64
    assert full.attention() == (4 * h * h + 3 * h, 5 * h)
    assert grouped.attention() == (2 * h * h + 2 * h * kv + h + 2 * kv, 5 * h)
    assert full.params() - grouped.params() == 4 * (2 * h * (h - kv) + 2 * (h - kv))
    args = plan.parse_args(["--layers", 4, "--hidden", 1024, "--heads", 16, "--vocab", 50000,
                            "--kv-heads", 4, "--gpus", 8])
    assert args.model_shape.params() == grouped.params()


def test_latent_attention_attends_in_its_own_head_widths():
    """DeepSeek-V3's heads attend in 192 dimensions (128 + 64 rotary) and return 128: its
    attention products per token are 6 L s heads (192 + 128), not 12 L h s, and the
    context-parallel ring passes K and V of those widths."""
    model = planner.PRESETS["deepseek-v3"]
    assert (model.qk_dim, model.v_dim) == (192, 128)
    assert model.attention_flops_per_token() == 6 * 61 * 4096 * 128 * (192 + 128)
    assert model.attention_widths() == (128 * 192, 128 * 192, 128 * 128, 128 * 128)
    llama = planner.PRESETS["llama3-70b"]
    assert llama.attention_flops_per_token() == 12 * llama.layers * llama.hidden * llama.seq
    assert llama.attention_widths() == (8192, 1024, 1024, 8192)


def test_the_end_stages_give_up_layers_and_schedules_must_be_able_to_run(capsys):
    """Llama 3 405B on 16 stages: the cut the planner chooses is the one Llama 3 ran, a
    layer off each end stage (Dubey et al., 2024, section 3.3.2), since the last one also
    runs the head; interleaved, its end chunks hold only the embedding and the head, as
    Llama 3's did, and Megatron-Bridge's DeepSeek-V3 layout on H100s comes out as
    published; a layer in every other chunk and, as in Megatron-LM, micro-batches in
    multiples of pp; --layout says the cut."""
    llama405 = planner.PRESETS["llama3-405b"]
    assert planner.stage_split(llama405, 16) == (7,) + (8,) * 14 + (7,)
    even = tuple(memory_model.stage_layers(126, 16))
    llama3_cut = (7,) + (8,) * 14 + (7,)
    flops = {cut: max(planner.stage_flops(llama405, cut)) for cut in (even, llama3_cut)}
    assert flops[llama3_cut] < flops[even]
    # interleaved: 8 chunks of a layer, the first and last with none (section 3.3.2)
    assert planner.chunk_split(llama405, 16, 8) == (0,) + (1,) * 126 + (0,)
    assert planner.stage_split(llama405, 16, 8) == (7,) + (8,) * 14 + (7,)
    # Megatron-Bridge's DeepSeek-V3 on 1,024 H100s: pp 8 x v 4, embedding + 1 layer,
    # 30 x 2, the multi-token prediction and loss (not modelled) with no layer
    assert planner.chunk_split(planner.PRESETS["deepseek-v3"], 8, 4) == (1,) + (2,) * 30 + (0,)
    # a rank holds the layers of its chunks: DeepSeek-V3's first rank, layer 0 (dense) and
    # six MoE layers, not the first seven (three dense), so more of the experts' weights
    deepseek = planner.PRESETS["deepseek-v3"]
    assert planner.stage_spans(planner.chunk_split(deepseek, 8, 4), 4)[0] == (
        0, ((0, 1), (15, 2), (31, 2), (47, 2)))
    held = {v: planner.stage_footprints(deepseek, planner.chunk_split(deepseek, 8, v), 1, 8,
                                        8, "zero1", "none", True, chunks=v)[0][0]["params"]
            for v in (1, 4)}
    assert planner.stage_split(deepseek, 8, 1)[0] == planner.stage_split(deepseek, 8, 4)[0] == 7
    assert held[4] > held[1]
    assert planner.most_moe_layers(deepseek, planner.chunk_split(deepseek, 8, 4), 4) == 8
    # 7 layers a rank in 2 chunks: chunks of 3 and 4, every rank the same work
    gpt462 = planner.Model(112, 18432, 144, 4096, 131072)
    cut = planner.chunk_split(gpt462, 16, 2)
    assert sorted(set(cut)) == [3, 4] and planner.stage_split(gpt462, 16, 2) == (7,) * 16
    assert planner.stage_imbalance(gpt462, cut, True, 2) == planner.stage_imbalance(
        gpt462, planner.chunk_split(gpt462, 16), True, 1)
    # each rank's chunks: the virtual stages r, r + pp, ... in order
    assert planner.stage_spans((1, 2, 3, 4), 2) == [(0, ((0, 1), (3, 3))), (1, ((1, 2), (6, 4)))]
    ten = planner.Model(10, 256, 4, 128, 1000)   # 2 x 4 chunks of 10 layers: 5 a rank,
    assert planner.stage_split(ten, 2, 4) == (5, 5)     # the head's chunk the smallest
    assert planner.chunk_split(ten, 2, 4)[-1] == min(planner.chunk_split(ten, 2, 4)[1::2])
    assert planner.stage_split(planner.Model(10, 256, 4, 128, 1000), 4, 4) is None   # 16 > 12
    hw, settings = planner.Hardware(16384), planner.Settings(
            rate="flat", global_batch_tokens=16 * 2 ** 20)
    assert "a multiple of pp 16" in planner.why_not(
        llama405, layout(dp=128, pp=16, chunks=2, microbatches=24), settings, hw)
    assert "more than the 10 layers and two end chunks without one" in planner.why_not(
        planner.Model(10, 256, 4, 128, 1000), layout(dp=1, tp=1, pp=4, chunks=4),
        settings, planner.Hardware(4))
    # the last stage runs the logits' product, 6 V h per token, whether or not the head
    # shares the embedding's weights (tying saves memory, not the product)
    gpt = planner.Model(8, 256, 4, 128, 1000)
    for model in (gpt, dataclasses_replace(gpt, tied=True)):
        first, *_, last = planner.stage_flops(model, (4, 4))
        assert last - first == 6 * model.vocab * model.hidden
    plan.main(["--model", "llama3-405b", "--gpus", "16384", "--global-batch-tokens", "16M",
               "--layout", "tp=8,pp=16,dp=128", "--json"])
    mine = json.loads(capsys.readouterr().out)["layout"]
    assert mine["stage_layers"][0] + mine["stage_layers"][-1] < 2 * max(mine["stage_layers"])
    assert sum(mine["stage_layers"]) == 126 and ("chunk_layers" in mine) == (mine["chunks"] > 1)
    # interleaved, --layout says each chunk's layers too, in the JSON and in the text
    argv = ["--model", "llama3-405b", "--gpus", "16384", "--global-batch-tokens", "16M",
            "--layout", "tp=8,pp=16,dp=128,v=8"]
    plan.main([*argv, "--json"])
    mine = json.loads(capsys.readouterr().out)["layout"]
    assert mine["chunks"] == 8 and mine["chunk_layers"] == [0] + [1] * 126 + [0]
    plan.main(argv)
    assert "in 8 chunks each, the virtual stages in order hold 0, 1, 1" in capsys.readouterr().out


def deepseek_v3_as_published():
    """DeepSeek-V3 on 2,048 H800s as its report ran it (§3.2, §4.2): (model, hardware,
    settings, layout without DualPipe)."""
    return (planner.PRESETS["deepseek-v3"], planner.Hardware(gpus=2048, nvlink_gb_s=160),
            planner.Settings(rate="flat", global_batch_tokens=15360 * 4096),
            dict(dp=128, tp=1, pp=16, cp=1, ep=64, chunks=1, micro_batch=1,
                 microbatches=120, zero="zero1", recompute="full"))


def test_dualpipe_halves_the_bubble_and_hides_the_all_to_alls():
    """DeepSeek-V3's Table 2: DualPipe idles (pp/2 - 1)(F&B + B - 3W) per micro-batch
    against 1F1B's (pp - 1)(F + B), 2/3 (pp/2 - 1) against pp - 1 of a micro-batch's work
    with W = B/2; and it runs one micro-batch's all-to-alls beside another's compute."""
    model, hw, settings, base = deepseek_v3_as_published()
    one = planner.step_time(model, base, settings, hw)
    two = planner.step_time(model, {**base, "dualpipe": 1}, settings, hw)
    work = one["compute"] + one["recompute"]
    slowest = work * planner.stage_imbalance(model, planner.stage_split(model, 16))
    # full recomputation: F the forward (its recomputation's time), B = the forward again
    # and the backward proper, W half of that: 2B - 2F = 2 x compute - 2F
    forward = two["recompute"]
    assert two["bubble"] == pytest.approx(
        slowest - work + 7 * (2 * two["compute"] - 2 * forward) / work * slowest / 120)
    # 1F1B: (p - 1)/m of the computation and of the traffic each micro-batch waits for
    traffic = one["tp"] + one["pp"] + one["cp"] + one["ep"]
    assert one["bubble"] == pytest.approx((slowest + traffic) * (1 + 15 / 120) - work - traffic)
    plain = planner.step_time(model, {**base, "dualpipe": 1, "recompute": "none"}, settings, hw)
    work = plain["compute"]
    slowest = work * planner.stage_imbalance(model, planner.stage_split(model, 16))
    assert plain["bubble"] == pytest.approx(
        slowest - work + 7 * (2 * work - 4 * forward) / work * slowest / 120)
    assert one["ep"] > 0 and two["ep"] == 0 and two["pp"] == 0   # all hidden: ep + pp < work
    assert one["ep"] + one["pp"] < work


def test_zb_h1_is_priced_by_the_walk_of_its_order():
    """A layout that names ZB-H1 (zb=1, torch's ScheduleInterleavedZeroBubble) idles what
    time_model.zero_bubble_bubble_fraction walks at the step's F, I and W (W as long as
    F, I the rest of the backward), the same function the pipeline lab measures its runs
    against; less than 1F1B at the same layout. Its memory counts the micro-batches its
    order keeps from a forward to its W: p on every rank, where 1F1B's later ranks hold
    fewer, so never less than 1F1B's."""
    model = planner.Model(64, 4096, 32, 2048, 51200)
    hw = planner.Hardware(64)
    # attention unfused: a third of every product in the forward, as of the linear ones
    settings = planner.Settings(rate="flat", global_batch_tokens=64 * 2048 * 2,
                                flash_attention=False)
    base = layout(pp=8, tp=8, dp=1, microbatches=16, micro_batch=8)
    one, zb = (planner.step_time(model, config, settings, hw)
               for config in (base, {**base, "zb": 1}))
    work = zb["compute"] + zb["recompute"]
    forward = work / 3   # no recomputation: a third of the products
    slowest = work * planner.stage_imbalance(model, planner.stage_split(model, 8, flash=False),
                                             flash=False)
    fraction = time_model.zero_bubble_bubble_fraction("zb1p", 8, 16, forward,
                                                      work - 2 * forward, forward, 1)
    traffic = zb["tp"] + zb["pp"] + zb["cp"] + zb["ep"]
    assert zb["bubble"] == pytest.approx((slowest + traffic) / (1 - fraction) - work - traffic)
    assert 0 < zb["bubble"] < one["bubble"] and zb["compute"] == one["compute"]
    assert memory_model.zero_bubble_peak_microbatches("zb1p", 8, 16, 1) == [8] * 8
    assert planner.memory(model, {**base, "zb": 1}, settings, hw)["total"] >= \
        planner.memory(model, base, settings, hw)["total"]
    assert planner.parse_layout("tp=8,pp=8,dp=1,zb=1")["zb"] == 1
    assert "one schedule" in planner.why_not(model, {**base, "zb": 1, "dualpipe": 1},
                                             settings, hw)


def test_an_fp32_gradient_buffer_takes_two_bytes_more_and_reduces_in_fp32():
    """Megatron-LM's bf16 keeps its gradients in fp32 (18 bytes per parameter with Adam,
    its distributed-optimizer guide): under ZeRO-1 the gradients are whole on every rank,
    so the states grow by 2 bytes per parameter of the stage, and the reduce-scatter
    carries 4 bytes per gradient."""
    model, hw = planner.PRESETS["llama3-8b"], planner.Hardware(64)
    mixed = planner.Settings(rate="flat", global_batch_tokens=2 ** 21)
    fp32 = planner.Settings(rate="flat", global_batch_tokens=2 ** 21, states="fp32_grads")
    config = layout(dp=16, tp=4, pp=1, zero="zero1", microbatches=4)
    grow = planner.memory(model, config, fp32, hw)["grads"] / planner.memory(
        model, config, mixed, hw)["grads"]
    assert grow == 2
    assert sum(memory_model.bytes_per_parameter("adam", "fp32_grads")) == 18
    rs = {b: planner.priced([("reduce_scatter", 1e9)], 64, 8, hw, reduce_bytes=b) for b in (2, 4)}
    assert rs[4] > 1.9 * rs[2]
    assert plan.settings_from_args(plan.parse_args(
        ["--model", "llama3-8b", "--gpus", "8", "--fp32-grads"])).states == "fp32_grads"


def test_full_recomputation_repeats_the_expert_all_to_alls():
    model = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                          expert_hidden=1024)
    hw, settings = planner.Hardware(64), planner.Settings(rate="flat", global_batch_tokens=2 ** 20)
    base = layout(dp=64, tp=1, pp=1, ep=8, microbatches=8)
    t = {r: planner.step_time(model, {**base, "recompute": r}, settings, hw)["ep"]
         for r in ("none", "full")}
    assert t["full"] == pytest.approx(1.5 * t["none"])   # 6 all-to-alls a layer, not 4


def test_expert_parallelism_divides_the_experts_and_pays_its_all_to_alls():
    model = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                          expert_hidden=1024)
    hw, settings = planner.Hardware(64), planner.Settings(rate="flat", global_batch_tokens=2 ** 20)
    dense, experts_1 = planner.stage_params(model, 0, 8, 1, 1, True, True)
    _, experts_8 = planner.stage_params(model, 0, 8, 1, 8, True, True)
    assert experts_8 == experts_1 / 8
    assert model.params() == dense + experts_1
    assert model.active_params() == model.params() - 8 * 14 * 3 * 2048 * 1024
    t = planner.step_time(model, layout(dp=64, tp=1, pp=1, ep=8, microbatches=8), settings, hw)
    assert t["ep"] > 0
    assert planner.why_not(model, layout(dp=64, tp=1, pp=1, ep=32), settings, hw)
    assert "mixture-of-experts" in planner.why_not(planner.PRESETS["llama3-8b"],
                                                   layout(dp=2, ep=2), settings, hw)


def test_expert_tensor_parallelism_splits_the_experts_or_keeps_them_whole():
    """etp: the experts' matrices split as attention's (tp) or whole (1). Megatron-Core
    lays etp x ep x edp over a stage's tp x cp x dp ranks, etp innermost; its all-to-all
    dispatcher then gathers each received copy over the etp ranks."""
    model = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                          expert_hidden=1024)
    hw, settings = planner.Hardware(64), planner.Settings(rate="flat", global_batch_tokens=2 ** 20)
    h, k, f = model.hidden, model.top_k, model.expert_hidden
    # the experts' weights: split etp ways, not tp
    (dense2, split), (dense1, whole) = (model.layer_params(1, 2, 8, False, etp)
                                        for etp in (2, 1))
    assert dense1 == dense2 and whole == 2 * split == 16 / 8 * 3 * h * f
    # their data parallelism: tp x cp x dp / (ep x etp) ranks hold the same expert
    assert planner.expert_replicas(32, 2, 8, 1) == 8 and planner.expert_replicas(32, 2, 8) == 4
    # memory: whole experts hold twice the weights over twice the replicas; the dispatcher
    # gathers the routed copies' inputs (h each) of the etp ranks
    assert model.layer_activation_values(1, 2, etp=2) - model.layer_activation_values(
        1, 2, etp=1) == k * h * (2 - 1) / 2
    # the dispatcher's passes: the all-to-all over ep ranks etp apart (ep 8 inside one node
    # when etp is 1, over two nodes at etp 2), and at etp 2 the copies' all-gather
    tokens = 2048 / 2
    a2a_inside = hw.nvlink[0] + 2 * tokens * h * k * 7 / 8 / hw.nvlink[1]
    assert planner.dispatch_collective_time(model, tokens, 8, 1, hw) == pytest.approx(a2a_inside)
    gather = time_model.shard_collective_time(2 * 2 * tokens * k * h, 2, *hw.nvlink)
    two_nodes = planner.dispatch_collective_time(model, tokens, 8, 2, hw) - gather
    assert two_nodes > a2a_inside                                  # over the network
    # without expert parallelism, Megatron-Core's all-gather dispatcher gathers each token
    # once, not its top_k copies: the cheaper, and priced
    all_gather = time_model.shard_collective_time(2 * 2 * tokens * h, 2, *hw.nvlink)
    assert all_gather < gather
    assert planner.dispatch_collective_time(model, tokens, 1, 2, hw) == pytest.approx(all_gather)
    # a step: 4 passes a MoE layer and micro-batch; with tp 2 the MoE layers' MLPs issue no
    # tensor-parallel collectives of their own
    base = layout(dp=32, tp=2, pp=1, ep=8, micro_batch=1, microbatches=16)
    t = {etp: planner.step_time(model, {**base, "etp": etp}, settings, hw) for etp in (1, 2)}
    for etp in (1, 2):
        assert t[etp]["ep"] == pytest.approx(4 * 8 * 16 * planner.dispatch_collective_time(
            model, tokens, 8, etp, hw))
    assert t[1]["tp"] == t[2]["tp"] == pytest.approx(planner.tensor_parallel_time(
        8, 2048, 1, h, 2, True, 16, False, hw, moe_layers=8))
    assert t[1]["ep"] < t[2]["ep"]
    # what cannot be laid out
    assert "etp 3" in planner.why_not(model, {**base, "etp": 3}, settings, hw)
    assert planner.why_not(model, {**base, "ep": 16, "etp": 2, "dp": 32}, settings, hw) is None
    assert "ep x etp" in planner.why_not(model, {**base, "dp": 4, "pp": 8, "ep": 16, "etp": 2},
                                         settings, hw)
    assert "mixture-of-experts" in planner.why_not(planner.PRESETS["llama3-8b"],
                                                   layout(dp=2, etp=1), settings, hw)
    # --layout: etp is tp unless given
    assert planner.parse_layout("tp=2,pp=8,dp=64,ep=64")["etp"] == 2
    assert planner.parse_layout("tp=2,pp=8,dp=64,ep=64,etp=1")["etp"] == 1


def test_small_expert_products_are_bound_by_their_memory_traffic():
    """The roofline by hand for DeepSeek-V3's experts: 128 tokens through an expert of
    7,168 x 2,048 (SwiGLU: 4,096 wide in, 2,048 out) move more bytes than the FLOPs'
    time lets HBM carry, in forward and in both products of backward (the weights'
    gradient read and written in the gradient buffer's bytes); 8,192 tokens do not."""
    model, hw = planner.PRESETS["deepseek-v3"], planner.Hardware(64)
    rate = 0.55 * 989e12
    h, f, bandwidth = 7168, 2048, 3.35e12

    def by_hand(rows, grad_bytes=2):
        slow = flops = 0
        for k, n in ((h, 2 * f), (f, h)):
            product = 2 * rows * k * n
            for traffic in (2 * (rows * k + k * n + rows * n),            # forward, dX
                            2 * (rows * k + k * n + rows * n),
                            2 * (rows * k + rows * n) + 2 * grad_bytes * k * n):   # dW +=
                slow += max(product / rate, traffic / bandwidth)
                flops += product / rate
        return slow / flops

    # one rank's micro-batch of 4,096 tokens, top 8 of 256 experts: 128 tokens an expert
    slowdown = planner.expert_matmul_slowdown(model, 4096, 1, 1, rate, hw)
    assert slowdown == pytest.approx(by_hand(128)) and 1.6 < slowdown < 1.9
    # an fp32 gradient buffer doubles what the weights' gradient moves
    fp32_buffer = planner.expert_matmul_slowdown(model, 4096, 1, 1, rate, hw, grad_bytes=4)
    assert fp32_buffer == pytest.approx(by_hand(128, grad_bytes=4)) and fp32_buffer > slowdown
    # the tokens of 64 expert-parallel ranks meet on each expert: compute-bound
    assert planner.expert_matmul_slowdown(model, 4096, 1, 64, rate, hw) == 1.0
    # a step pays it on the routed experts' share of the compute, and only there
    settings = planner.Settings(rate="flat", global_batch_tokens=2 ** 22)
    few, many = (planner.step_time(model, layout(dp=64, tp=1, pp=1, ep=ep, micro_batch=1,
                                                 microbatches=16), settings, hw)
                 for ep in (1, 64))
    routed = 6 * 8 * 58 * 3 * h * f * 2 ** 22 / 64 / rate
    assert few["compute"] - many["compute"] == pytest.approx(routed * (slowdown - 1))
    dense = planner.PRESETS["llama3-8b"]
    layers = sum(sum(dense.layer_params(i)) for i in range(dense.layers))
    executed = 6 * layers + 6 * dense.vocab * dense.hidden \
        + dense.attention_flops_per_token() / 3 * 3.5 * 0.5
    assert planner.step_time(dense, layout(dp=64), settings, hw)["compute"] == pytest.approx(
        executed * 2 ** 22 / 64 / rate)


def test_deepseek_v3_has_its_published_size():
    model = planner.PRESETS["deepseek-v3"]
    assert model.params() == memory_model.deepseek_v3_params()["total"]
    assert model.active_params() == memory_model.deepseek_v3_params()["active"]
    assert 0.66e12 < model.params() < 0.68e12 and 36e9 < model.active_params() < 38e9


def test_llama_presets_have_their_published_sizes():
    for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9)):
        assert planner.PRESETS[name].params() / 1e9 == pytest.approx(billions, abs=0.05)
    gpt = planner.Model(24, 2304, 24, 2048, 51200)
    assert gpt.params() == memory_model.transformer_params(24, 2304, 51200, 2048)


def test_a_layout_is_ranked_among_all(capsys):
    """--layout: the layout's best configuration, where it ranks (1 + how many are
    faster), and the best step time; a layout that cannot run says why."""
    argv = ["--model", "llama3-70b", "--gpus", "256", "--global-batch-tokens", "4M"]
    result = planned(capsys, [*argv, "--layout", "tp=8,pp=4,dp=8"])
    mine, found = result["layout"], result["configurations"]
    assert (mine["tp"], mine["pp"], mine["dp"], mine["cp"], mine["ep"]) == (8, 4, 8, 1, 1)
    assert mine["reason"] is None and mine["best_step_time_s"] == found[0]["time_s"]["step"]
    assert mine["rank"] == 1 + sum(c["time_s"]["step"] < mine["step_time_s"] for c in found)
    same = [c for c in found if (c["tp"], c["pp"], c["dp"], c["cp"]) == (8, 4, 8, 1)]
    assert mine["step_time_s"] == same[0]["time_s"]["step"]
    chunks = planned(capsys, [*argv, "--layout", "tp=8,pp=4,dp=8,v=2"])["layout"]
    assert chunks["chunks"] == 2
    wrong = planned(capsys, [*argv, "--layout", "tp=8,pp=3,dp=10"])["layout"]
    assert wrong["rank"] is None and "256 GPUs" in wrong["reason"]
    small = planned(capsys, ["--model", "llama3-405b", "--gpus", "8", "--global-batch-tokens",
                             "64K", "--layout", "tp=8,pp=1,dp=1"])
    assert small["layout"]["rank"] is None and "GB per GPU" in small["layout"]["reason"]


def test_flop_conventions_by_hand():
    """Narayanan et al.'s Eq. 3 per token, 6 psi, and 6 psi with attention's products; the
    planner's two MFUs count 6 psi and 6 psi + 12 L h s."""
    layers, hidden, seq, vocab = 2, 64, 32, 100
    psi = memory_model.transformer_params(layers, hidden, vocab, seq)
    flops = memory_model.flops_per_token
    assert flops(layers, hidden, seq, vocab) == 6 * psi
    assert flops(layers, hidden, seq, vocab, "attention") == 6 * psi + 12 * layers * hidden * seq
    by_hand = 4 * layers * (24 * hidden ** 2 + 4 * seq * hidden) + 3 * 2 * vocab * hidden
    assert flops(layers, hidden, seq, vocab, "megatron") == pytest.approx(by_hand)
    tied = memory_model.transformer_params(layers, hidden, vocab, seq, tied_head=True)
    assert psi - tied == vocab * hidden
    assert flops(layers, hidden, seq, vocab, "attention", tied_head=True) \
        == 6 * tied + 12 * layers * hidden * seq
    model = planner.Model(layers, hidden, 4, seq, vocab)
    settings, hw = planner.Settings(rate="flat", global_batch_tokens=seq * 8), planner.Hardware(8)
    ratio = planner.mfu(model, settings, hw, 1.0, True) / planner.mfu(model, settings, hw, 1.0)
    assert ratio == pytest.approx(flops(layers, hidden, seq, vocab, "attention") / (6 * psi))


def test_what_does_not_fit_is_left_out(capsys):
    one = planned(capsys, [*SHAPE_70B, "--gpus", "8", "--global-batch-tokens", "32K"])
    assert all(c["zero"] == "zero3" or c["tp"] * c["pp"] > 1 for c in one["configurations"])
    with pytest.raises(SystemExit):
        plan.main([*SHAPE_70B, "--gpus", "1", "--global-batch-tokens", "32K"])
    assert "no configuration fits" in capsys.readouterr().out


def test_a_shape_from_a_parameter_count_has_about_that_many():
    for count in (1.3e9, 13e9, 70e9, 175e9):
        model = planner.shape_from_params(count, 2048)
        assert abs(model.params() - count) / count < 0.1, (count, model)
        assert model.hidden % model.heads == 0


def test_degree_lists():
    assert plan.degrees("1,2,4") == [1, 2, 4] and plan.degrees("1-4") == [1, 2, 3, 4]
    assert math.isclose(plan.fraction("0.5"), 0.5)


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(plan.parse_args, ["--gpus", "8"], "give --model NAME, --params P")
    assert_refused(plan.parse_args, ["--params", "7B", "--layers", "2", "--gpus", "8"], "not both")
    assert_refused(plan.parse_args, ["--params", "7B", "--gpus", "8", "--mfu", "1.5"], "at most 1")
    assert_refused(plan.parse_args, ["--params", "7B", "--gpus", "8", "--seq", "3000",
                                     "--global-batch-tokens", "4M"], "not a whole number")
    assert_refused(plan.parse_args, ["--model", "llama3-8b", "--gpus", "8", "--layout", "tp=x"],
                   "not a layout")
    assert_refused(plan.parse_args, ["--model", "llama3-8b", "--gpus", "8", "--cp", "0"],
                   "at least 1")
    assert_refused(plan.parse_args, ["--layers", "2", "--hidden", "64", "--heads", "4",
                                     "--vocab", "100", "--experts", "4", "--top-k", "8",
                                     "--expert-hidden", "32", "--gpus", "8"], "--top-k")
    assert_refused(plan.parse_args, ["--model", "llama3-8b", "--gpus", "8", "--fp8-activations"],
                   "--fp8-activations needs --precision fp8")
    assert_fails_with_one_line(script("plan", "--params", "lots", "--gpus", "8"), "--params")


def test_when_communication_binds_by_hand():
    """Austin et al.'s two rules in NCCL's terms: a data-parallel replica is compute-bound
    when backward's 4 FLOPs per parameter and token outlast the ring all-reduce's 2 x 2
    bytes per parameter; tensor parallelism when an MLP's forward, 4 b s h F / t FLOPs,
    outlasts its all-gather and reduce-scatter of b s h bf16 values."""
    rate, beta = 1e15, 1e11
    tokens = comm_model.data_parallel_min_tokens(rate, beta)
    params = 1e9
    assert 4 * params * tokens / rate == pytest.approx(2 * 2 * params / beta)
    degree = comm_model.tensor_parallel_max_degree(28672, rate, beta)
    bsh, ffn = 4096 * 8192, 28672
    assert 4 * bsh * ffn / degree / rate == pytest.approx(2 * 2 * bsh / beta)


def test_dualpipe_holds_two_stages_per_rank():
    model, hw, settings, layout = deepseek_v3_as_published()
    one = planner.memory(model, layout, settings, hw)
    two = planner.memory(model, {**layout, "dualpipe": 1}, settings, hw)
    # stage r sits on ranks r and 15 - r of every pipeline: 2 x 128 replicas of it
    cut = planner.stage_split(model, 16)
    footprints = planner.stage_footprints(model, cut, 1, 64, 256, "zero1", "full", True)
    r = two["stage"]
    assert two["stages"] == (r, 15 - r)
    # each of its two stages with its own weights and gradients, and ZeRO-1 state sharded
    # over both copies' replicas (as memory_model.moe_bytes_per_gpu(param_copies=2))
    assert two["states"] == footprints[r][0]["total"] + footprints[15 - r][0]["total"]
    one_copy = planner.stage_footprints(model, cut, 1, 64, 128, "zero1", "full", True)
    for stage in (r, 15 - r):
        for part in ("params", "grads"):     # unsharded by ZeRO-1: as many as one copy's
            assert footprints[stage][0][part] == one_copy[stage][0][part]
        assert footprints[stage][0]["optimizer"] == pytest.approx(
            one_copy[stage][0]["optimizer"] / 2)
    assert one["states"] < two["states"] < 2 * one["states"]
    # 16 - r and r + 1 micro-batches' layer inputs (full recomputation), and one layer
    # rebuilt at a time or the head's logits
    kept = planner.VALUE_BYTES * model.seq * ((16 - r) * footprints[r][1]
                                              + (r + 1) * footprints[15 - r][1])
    rebuilt = planner.VALUE_BYTES * model.seq * max(footprints[r][2], footprints[15 - r][2])
    assert two["activations"] == pytest.approx(kept + max(rebuilt, two["logits"]))
    assert planner.parse_layout("tp=1,pp=16,dp=128,ep=64,dualpipe=1")["dualpipe"] == 1
    assert "DualPipe needs" in planner.why_not(model, {**layout, "pp": 8, "dp": 256, "chunks": 2,
                                                       "dualpipe": 1}, settings, hw)
    assert "DualPipe needs" in planner.why_not(model, {**layout, "microbatches": 30,
                                                       "dualpipe": 1}, settings, hw)


def test_context_parallelism_as_each_source_runs_it():
    """cp_scheme "ring" (Megatron-Core's default, Transformer Engine's p2p): per layer,
    cp - 1 steps pass one K and V block forward and two backward (K and V again and the
    gradients of the block before), each step exposing what outlasts its block's
    attention; full recomputation passes the forward's again. "allgather" (Llama 3's): K
    and V gathered before the forward, again before the backward, their gradients
    reduce-scattered, all three exposed. By hand on one node; the old ring passed two
    blocks a step."""
    model = planner.Model(2, 1024, 8, 4096, 32000, gpt=False, kv_heads=2)
    hw = planner.Hardware(8, nvlink_gb_s=1)
    rate = hw.peak_tflops * 1e12 * planner.COMPUTE_EFFICIENCY
    tp, cp, m, seq = 2, 4, 2, 4096 // 4
    block = 2 * seq * (256 + 256) / tp                  # this rank's K and V, bf16
    send = hw.nvlink[0] + block / hw.nvlink[1]
    forward = 2 * seq * seq * (1024 + 1024) / tp * 0.5 / rate   # causal, load-balanced
    backward = 2.5 * forward                            # a fused kernel's
    gather = time_model.shard_collective_time(block * cp, cp, *hw.nvlink)
    for recompute, forwards in (("none", 1), ("full", 2)):
        config = layout(dp=1, tp=tp, pp=1, cp=cp, microbatches=m, recompute=recompute)
        ring = planner.step_time(model, config, planner.Settings(rate="flat",
            global_batch_tokens=m * 4096), hw)["cp"]
        assert ring == pytest.approx((cp - 1) * (forwards * max(0.0, send - forward)
                                                 + max(0.0, 2 * send - backward)) * 2 * m)
        allgather = planner.step_time(model, config, planner.Settings(rate="flat",
            global_batch_tokens=m * 4096, cp_scheme="allgather"), hw)["cp"]
        assert allgather == pytest.approx((forwards + 2) * gather * 2 * m)
    two_blocks = (cp - 1) * max(0.0, 2 * send - 3 * forward) * 2 * m   # the old price
    assert planner.step_time(model, layout(dp=1, tp=tp, pp=1, cp=cp, microbatches=m),
                             planner.Settings(
                                     rate="flat", global_batch_tokens=m * 4096), hw)["cp"] \
        > two_blocks
    assert planner.Settings(global_batch_tokens=1).cp_scheme == "ring"
    assert plan.settings_from_args(plan.parse_args(
        ["--model", "llama3-8b", "--gpus", "8", "--cp-scheme", "allgather"])).cp_scheme \
        == "allgather"


def test_a_fused_attentions_backward_is_two_and_a_half_forwards():
    """FlashAttention's backward recomputes Q K^T: 5 products against the forward's 2
    (time_model.attention_products_flops), where the conventional count, which the MFU
    keeps, has twice the forward; the step runs 3.5 forwards' worth, half of them under a
    causal mask."""
    model = planner.Model(4, 1024, 8, 2048, 1000, gpt=False)
    conventional = model.attention_flops_per_token()
    assert conventional == 12 * 4 * 1024 * 2048
    products = time_model.attention_products_flops(2048, 1, 1024)
    assert products["backward"] == 2.5 * products["forward"]
    assert model.attention_flops_executed_per_token(True) == conventional / 3 * 3.5 * 0.5
    assert model.attention_flops_executed_per_token(False) == conventional
    hw, settings = planner.Hardware(8), planner.Settings(rate="flat", global_batch_tokens=8 * 2048)
    rate = hw.peak_tflops * 1e12 * settings.mfu
    linear = 6 * sum(sum(model.layer_params(i)) for i in range(4)) + 6 * 1000 * 1024
    t = planner.step_time(model, layout(dp=8, tp=1, pp=1, microbatches=1), settings, hw)
    assert t["compute"] == pytest.approx((linear + conventional / 3 * 3.5 * 0.5) * 2048 / rate)
    assert t["compute"] > (linear + conventional * 0.5) * 2048 / rate   # the old, 2x
    assert planner.mfu(model, settings, hw, 1.0, True) == pytest.approx(
        (6 * model.params() + conventional) * 8 * 2048 / (8 * hw.peak_tflops * 1e12))


def test_the_embedding_lookup_costs_no_flops():
    """The input embedding is a lookup: an untied model runs the same FLOPs as the same
    model with its head tied to the embedding, the head's 6 V h a token in both (the old
    price charged the untied embedding 6 FLOPs a parameter too)."""
    untied = planner.Model(4, 1024, 8, 2048, 50000, gpt=False)
    tied = dataclasses.replace(untied, tied=True)
    assert untied.params() - tied.params() == 50000 * 1024
    hw, settings = planner.Hardware(8), planner.Settings(rate="flat", global_batch_tokens=8 * 2048)
    config = layout(dp=8, tp=1, pp=1, microbatches=1)
    times = [planner.step_time(m, config, settings, hw)["compute"] for m in (untied, tied)]
    assert times[0] == times[1]
    rate = hw.peak_tflops * 1e12 * settings.mfu
    old = (6 * untied.params() + untied.attention_flops_executed_per_token()) * 2048 / rate
    # the lookup's V h, and the final norm's h, which no matrix product runs either
    assert old - times[0] == pytest.approx(6 * (50000 * 1024 + 1024) * 2048 / rate)
    assert sum(planner.chunk_flops(untied, (2, 2))) == sum(planner.chunk_flops(tied, (2, 2)))


def test_the_all_reduce_is_nccls_inside_a_node_and_across():
    """One all-reduce model everywhere: inside a node NCCL's ring and tree priced by
    time_model.nccl_allreduce_time come out as the flat ring, comm_model.allreduce_time,
    the planner's; across nodes the planner takes NCCL's faster of the two."""
    hw = planner.Hardware(64)
    for bytes_ in (1e3, 1e6, 1e9):
        inside = planner.group_time("all_reduce", bytes_, 8, 8, hw)
        assert inside == pytest.approx(time_model.nccl_allreduce_time(bytes_, 8, 8, hw.nvlink,
                                                                      hw.network))
        assert inside == comm_model.allreduce_time(bytes_, 8, *hw.nvlink)
        assert planner.group_time("all_reduce", bytes_, 64, 8, hw) == \
            time_model.nccl_allreduce_time(bytes_, 64, 8, hw.nvlink, hw.network)


def test_a_tied_head_on_its_own_stage_keeps_a_copy_and_sums_its_gradient():
    """Megatron-LM keeps a copy of a tied embedding on the last stage for the head and
    all-reduces the embedding's gradient between the first and the last stage: the last
    stage holds V h / tp more (memory_model.stage_params_per_rank says so too), and the
    step pays that all-reduce, exposed; on one stage nothing."""
    model = planner.Model(8, 1024, 8, 2048, 50000, tied=True)
    h, vocab, tp = 1024, 50000, 2
    for pp, split in ((1, (8,)), (2, (4, 4))):
        starts = (0, 4)
        for stage, layers in enumerate(split):
            held = planner.stage_params(model, starts[stage], layers, tp, 1, stage == 0,
                                        stage == pp - 1)[0]
            assert held == memory_model.stage_params_per_rank(
                8, h, vocab, 2048, pp, tp, stage, tied_head=True, split=list(split))
    last = planner.stage_params(model, 4, 4, tp, 1, False, True)[0]
    assert last - 4 * sum(model.layer_params(0, tp)) == 2 * h + vocab * h / tp   # the copy
    hw = planner.Hardware(16)
    summed = planner.tied_embedding_seconds(model, tp, 2, False, hw, 4)
    assert summed == planner.group_time("all_reduce", 4 * vocab * h / tp, 2, 1, hw) > 0
    assert planner.tied_embedding_seconds(model, tp, 1, False, hw, 4) == 0
    assert planner.tied_embedding_seconds(dataclasses.replace(model, tied=False), tp, 2,
                                          False, hw, 4) == 0
    settings = planner.Settings(rate="flat", global_batch_tokens=32 * 2048, zero=("zero3",))
    config = layout(dp=4, tp=tp, pp=2, microbatches=8, zero="zero3")
    assert planner.step_time(model, config, settings, hw)["dp"] >= summed


def test_parameters_gathered_after_the_step_hide_only_behind_the_next_forward():
    """ZeRO-1 and ZeRO-2 all-gather the updated parameters after the optimizer's step: only
    the next step's first forward, which needs them layer by layer, can hide that, and the
    reductions have the backward to themselves (the old price hid both behind the
    backward, in one window). The reductions carry the gradients in
    Settings.grad_reduce, fp32 by default, as Megatron-LM with bf16, Llama 3 and
    torchtitan reduce them. By hand on a slow network."""
    model = planner.PRESETS["llama3-8b"]
    hw = planner.Hardware(64, network_gb_s=6)
    cut = planner.chunk_split(model, 1, 1, True)
    assert planner.Settings(global_batch_tokens=1).grad_reduce == "fp32"
    for zero in ("zero1", "zero2"):
        config = layout(dp=64, tp=1, pp=1, zero=zero, microbatches=4, recompute="full")
        for grad_reduce, value_bytes in (("fp32", 4), ("bf16", 2)):
            settings = planner.Settings(
                    rate="flat", global_batch_tokens=2 ** 21, grad_reduce=grad_reduce)
            t = planner.step_time(model, config, settings, hw)
            forward, backward = t["recompute"], t["compute"] - t["recompute"]
            (reduced, gathered), = planner.rank_data_parallel_parts(
                model, cut, 1, 1, zero, 4, 64, "bf16", hw, value_bytes)
            reduce_window = backward if zero == "zero2" else backward / 4
            assert t["dp"] == pytest.approx(max(0.0, reduced - reduce_window)
                                            + max(0.0, gathered - forward / 4))
            # the old price: one window, the backward's, for the reductions and the gather
            assert t["dp"] != pytest.approx(max(0.0, reduced + gathered - reduce_window))
        fp32, bf16 = (planner.rank_data_parallel_parts(model, cut, 1, 1, zero, 4, 64, "bf16",
                                                       hw, b)[0][0] for b in (4, 2))
        assert fp32 > 1.9 * bf16
    assert plan.settings_from_args(plan.parse_args(
        ["--model", "llama3-8b", "--gpus", "8", "--grad-reduce", "bf16"])).grad_reduce == "bf16"


def test_sequence_parallelism_is_a_setting():
    """Without sequence parallelism (Megatron-LM's 2021 runs) a layer all-reduces its two
    outputs forward and their gradients backward, and keeps its norms' and matrices'
    inputs whole on every rank; the overlaps that need it are refused."""
    model, hw = planner.PRESETS["llama3-70b"], planner.Hardware(64)
    off = planner.Settings(rate="flat", global_batch_tokens=2 ** 20, sequence_parallel=False)
    on = planner.Settings(rate="flat", global_batch_tokens=2 ** 20)
    config = layout(dp=2, tp=8, pp=4, microbatches=64)
    split = planner.stage_split(model, 4)
    by_hand = max(64 * sum(comm_model.allreduce_time(2 * n, 8, *hw.nvlink) for _, n in
                           comm_model.tensor_parallel_collectives(
                               layers, model.seq, 1, model.hidden, 8, embedding=r == 0,
                               head=r == 3, microbatches=1))
                  for r, layers in enumerate(split))
    assert planner.step_time(model, config, off, hw)["tp"] == pytest.approx(by_hand)
    h = model.hidden
    assert model.layer_activation_values(0, 8, False) - model.layer_activation_values(0, 8) \
        == pytest.approx(4 * h - 4 * h / 8)
    assert planner.memory(model, config, off, hw)["activations"] > \
        planner.memory(model, config, on, hw)["activations"]
    assert "sequence parallelism" in planner.why_not(
        model, config, dataclasses.replace(off, async_tp=True), hw)
    assert not plan.settings_from_args(plan.parse_args(
        ["--model", "llama3-8b", "--gpus", "8", "--no-sequence-parallel"])).sequence_parallel


def test_overlapped_pipeline_sends_wait_only_in_the_fill_and_drain():
    """pp_async: the sends beside the computation are exposed only in the bubble's slots;
    in series, every one is. Megatron-LM's default (None) overlaps them with the
    interleaved schedule only; Llama 3 ran them asynchronously."""
    model, hw = planner.Model(64, 4096, 32, 2048, 51200), planner.Hardware(64)
    tokens = 128 * 2048
    for v in (1, 2):
        config = layout(pp=8, tp=8, dp=1, microbatches=16, micro_batch=8, chunks=v)
        runs = {a: planner.step_time(model, config, planner.Settings(rate="flat",
            global_batch_tokens=tokens, pp_async=a), hw) for a in (None, True, False)}
        sends = runs[False]["pp"]
        assert sends > 0 and runs[True]["pp"] == 0
        assert runs[True]["bubble"] == pytest.approx(runs[False]["bubble"])
        assert runs[True]["step"] == pytest.approx(runs[False]["step"] - sends)
        assert runs[None]["pp"] == (0 if v > 1 else sends)
    assert plan.settings_from_args(plan.parse_args(
        ["--model", "llama3-8b", "--gpus", "8", "--pp-async", "yes"])).pp_async is True


def test_a_layout_fits_the_memory_the_runtime_leaves():
    """A layout fits when its tensors fit the nominal memory less the CUDA context's and
    NCCL's buffers (1.06 GB measured on eight H100s; 4.34 GB after an all-to-all, which a
    mixture of experts over ep > 1 ranks runs)."""
    model, settings = planner.PRESETS["llama3-8b"], planner.Settings(
            rate="flat", global_batch_tokens=2 ** 21)
    config = layout(dp=16, tp=4, pp=1, microbatches=4)
    mem = planner.memory(model, config, settings, planner.Hardware(64))
    assert mem["usable"] == 80e9 - 1.06e9 and mem["reserve"] == 1.06e9
    tight = planner.Hardware(64, gpu_memory_gb=(mem["total"] + 0.5e9) / 1e9)
    assert mem["total"] < tight.gpu_memory_gb * 1e9 and not planner.evaluate(
        model, config, settings, tight)["fits"]
    found = planner.rank_layout(model, {"dp": 16, "tp": 4, "pp": 1}, settings, tight, [])
    assert found["rank"] is None or found["memory_bytes"]["total"] <= mem["total"] - 0.5e9
    moe = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                        expert_hidden=1024)
    moe_mem = planner.memory(moe, layout(dp=64, tp=1, pp=1, ep=8, microbatches=8),
                             planner.Settings(rate="flat", global_batch_tokens=2 ** 20),
                             planner.Hardware(64))
    assert moe_mem["reserve"] == pytest.approx(4.34e9)


def test_the_search_tries_every_interleaving_the_cut_allows():
    """Not only 2 and 4 chunks a rank: every v whose chunks hold the layers evenly but for
    the end ones, as the published layouts ran (NeMo's Llama 3 70B at v 5, GPT-3 175B at 6,
    Nemotron-4 340B at 12, Llama 3 405B at 8, DeepSeek-V3 on H100s at 4)."""
    presets = planner.PRESETS
    assert 5 in planner.interleavings(presets["llama3-70b"], 4)
    assert {6, 12} <= set(planner.interleavings(presets["gpt3-175b"], 8))
    assert 8 in planner.interleavings(presets["llama3-405b"], 16)
    assert 4 in planner.interleavings(presets["deepseek-v3"], 8)
    assert 3 not in planner.interleavings(presets["llama3-70b"], 8)   # 24 chunks of 80
    assert planner.interleavings(presets["llama3-70b"], 1) == [1]
    model = planner.Model(12, 1024, 8, 1024, 1000)
    found = planner.configurations(model, planner.Settings(
            rate="flat", global_batch_tokens=64 * 1024),
                                   planner.Hardware(8))
    assert {c["chunks"] for c in found if c["pp"] == 2} > {1, 2, 4}


def test_an_fp8_dispatch_sends_what_goes_to_the_experts_in_one_byte():
    """dispatch_bytes: DeepSeek-V3 dispatches in FP8 (forward the activations, backward
    the gradients before the down-projections) and combines in bf16: two of a layer's four
    passes at one byte a value."""
    model = planner.Model(8, 2048, 16, 2048, 32000, gpt=False, experts=16, top_k=2,
                          expert_hidden=1024)
    hw = planner.Hardware(64)
    config = layout(dp=64, tp=1, pp=1, ep=8, microbatches=8)
    runs = {b: planner.step_time(model, config, planner.Settings(rate="flat",
        global_batch_tokens=2 ** 20, dispatch_bytes=b), hw)["ep"] for b in (1, 2)}
    one, two = (planner.dispatch_collective_time(model, 2048, 8, 1, hw, b) for b in (1, 2))
    assert runs[2] == pytest.approx(4 * two * 8 * 8)
    assert runs[1] == pytest.approx(2 * (one + two) * 8 * 8) and runs[1] < runs[2]
    assert plan.settings_from_args(plan.parse_args(
        ["--model", "deepseek-v3", "--gpus", "64", "--dispatch-bytes", "1"])).dispatch_bytes == 1
