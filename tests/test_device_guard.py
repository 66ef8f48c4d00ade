"""The device guard (LABS_DEVICE_GUARD=1, labkit/runtime/distenv.py): on CPU, tensors made
without naming a device land on `meta`, so a model never moved to env.device, or a tensor
made without device=, fails here as it would on a GPU.

Every lab's smallest case runs under it (a world of one where the lab allows it; the
labs with tests of their own under the guard are listed in GUARDED_ELSEWHERE). The guard
checks where tensors live, not what the lab computes: the labs' results are checked by
their own tests and the book.
"""

import textwrap

import pytest
from conftest import LABS, run_python_file

from labkit.runtime import distenv
from labkit.runtime.launch import run_lab

GUARD = {distenv.DEVICE_GUARD: "1"}

# lab -> (ranks: None for a plain `python` world of one, arguments): each lab's smallest case
SMALLEST = {
    "grad_averaging": (None, ["--steps", 2, "--samples", 64]),
    "scaling": (None, ["--steps", 3, "--warmup", 1]),
    "fsdp": (None, ["--steps", 1]),
    "mini_ddp": (None, ["--steps", 2, "--warmup", 1]),
    "tensor_parallel": (None, ["--steps", 1]),
    "context_parallel": (None, ["--steps", 1]),
    "hybrid": (None, ["--steps", 1]),
    "expert_parallel": (None, ["--steps", 1, "--balance-steps", 2]),
    "zero_libraries": (None, ["--library", "deepspeed-zero3", "--steps", 1]),
    "hang": (2, ["--mode", "none", "--timeout", 20]),
    # three steps: torch's PowerSGD hook compresses from its third; P = 3 divides H = 3
    "low_communication": (None, ["--steps", 3, "--sync-every", 3, "--fragments", 3,
                                 "--slow-ns-per-byte", 0, "--h-sweep", 3]),
    "fault_tolerance": (None, ["--groups", 2, "--state-mb", 0, "--no-checkpoint-restart"]),
    "data_order": (None, ["--resizes", "1:1"]),
}
GUARDED_ELSEWHERE = ("memory", "pipeline", "precision", "ring_allreduce")


@pytest.mark.parametrize("lab", SMALLEST)
def test_lab_keeps_its_tensors_on_its_device(lab):
    nproc, args = SMALLEST[lab]
    result = run_lab(lab, nproc, args, env=GUARD, echo=False)
    assert result["device_guard"] is True and result["device"] == "cpu"
    # under the guard a variant failing is a device error, wherever the lab records it
    not_run = {path: reason for path, reason in not_run_anywhere(result)
               if path.rsplit("/", 1)[-1] not in NOT_RUN_ON_A_CPU.get(lab, ())}
    assert not not_run, not_run


# what a lab cannot run on a CPU at all, whatever the guard
NOT_RUN_ON_A_CPU = {"low_communication": ("torch_hook_max_grad_diff",)}   # bf16 hook: NCCL


def not_run_anywhere(record, path=""):
    """(path, reason) of every {"not_run": reason} in a lab's JSON, however deep."""
    if isinstance(record, dict):
        if "not_run" in record:
            yield path, record["not_run"]
        for key, value in record.items():
            yield from not_run_anywhere(value, f"{path}/{key}")
    elif isinstance(record, list):
        for index, value in enumerate(record):
            yield from not_run_anywhere(value, f"{path}[{index}]")


def test_checkpoint_save_and_resume_keep_their_tensors_on_the_device(tmp_path):
    folder = tmp_path / "ckpt"
    run_lab("checkpoint", None, ["save", "--dir", folder, "--steps", 1], env=GUARD, echo=False)
    result = run_lab("checkpoint", None, ["resume", "--dir", folder, "--steps", 1], env=GUARD,
                     echo=False)
    assert result["device_guard"] is True and result["resumed_from_step"] == 1


def test_resilience_keeps_its_tensors_on_the_device(tmp_path):
    result = run_lab("resilience", None, ["--dir", tmp_path / "run", "--steps", 2, "--every", 1],
                     env=GUARD, echo=False)
    assert result["device_guard"] is True


def test_every_lab_is_guarded_somewhere():
    """A new lab joins the guard's list, or one of the files that guard their own."""
    labs = {p.stem for p in LABS.glob("*.py")} - {"plan", "trace", "ranks"}   # torch-free/bare
    assert labs == set(SMALLEST) | set(GUARDED_ELSEWHERE) | {"checkpoint", "resilience"}


MODEL_NEVER_MOVED = textwrap.dedent("""
    import argparse, torch
    from labkit.runtime import distenv
    args = argparse.Namespace(backend="gloo", seed=0, timeout=10, out=None)
    with distenv.initialize(args) as env:
        batch = torch.randn(2, 4, device=env.device)
        model = torch.nn.Linear(4, 3)             # built without device=: never moved
        {use}
""")


@pytest.mark.parametrize("use, words", [
    ("model(batch)", "device guard: aten.addmm"),           # beside the lab's tensors
    ("torch.distributed.all_reduce(model.weight)", "meta"),  # into a collective
])
def test_a_tensor_left_off_the_device_fails_under_the_guard(use, words, tmp_path):
    """What a GPU would refuse (a CPU model fed CUDA batches, a CPU tensor handed to
    NCCL) fails on CPU under the guard, and runs without it."""
    code = tmp_path / "never_moved.py"
    code.write_text(MODEL_NEVER_MOVED.format(use=use))
    plain = run_python_file(code)
    assert plain.returncode == 0, plain.stderr
    guarded = run_python_file(code, env_extra=GUARD)
    assert guarded.returncode != 0 and words in guarded.stderr, guarded.stderr[-2000:]


def test_host_side_work_says_cpu_under_the_guard(tmp_path):
    """What a lab keeps on the host names device="cpu" and works under the guard (the
    labs' own bookkeeping), while a bare factory call lands on meta."""
    code = tmp_path / "host_side.py"
    code.write_text(textwrap.dedent("""
        import argparse, torch
        from labkit.runtime import distenv
        args = argparse.Namespace(backend="gloo", seed=0, timeout=10, out=None)
        with distenv.initialize(args) as env:
            print(torch.zeros(2).device, torch.zeros(2, device="cpu").device, env.device)
    """))
    done = run_python_file(code, env_extra=GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["meta", "cpu", "cpu"], done.stderr
