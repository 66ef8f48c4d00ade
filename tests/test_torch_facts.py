"""What the book says about torch's own behaviour, checked against the torch installed."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_fsdp1_refuses_the_cpu_unless_told_the_device(world_of_one):
    # fsdp.md: "FSDP1 refuses a model on the CPU when no device_id is given; with
    # device_id=torch.device("cpu") it runs on gloo."
    with pytest.raises(RuntimeError, match="non-CPU accelerator"):
        FullyShardedDataParallel(torch.nn.Linear(4, 4))
    wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
    wrapped(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in wrapped.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is the mesh's device here")
def test_fully_shard_reshards_by_default_and_moves_to_the_mesh_device(world_of_one):
    # fsdp.md: reshard_after_forward defaults to None (True but for the root); fully_shard
    # moves the parameters to its mesh's device, the CPU when there is no accelerator.
    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    model = fully_shard(torch.nn.Linear(4, 4))
    assert all(p.device.type == "cpu" for p in model.parameters())
