"""What autograd keeps for the backward pass, counted: the bytes of every tensor saved in a
forward pass, by the block that saved it.

Every tensor saved for backward passes through a saved-tensors pack hook. Each storage is
counted once (views of one buffer, such as Q, K and V cut from one fused projection, share
it), and parameters and buffers are not activations. A DTensor counts its local shard.
"""

import torch

from .distenv import local_tensor


def _storage(tensor):
    local = local_tensor(tensor)
    return local.untyped_storage()


def count_activation_bytes(model, forward):
    """Run `forward()` (a forward pass and its loss) on `model`, whose blocks are
    `model.blocks`; return {block index or "outside": bytes kept for backward}."""
    module_state = {_storage(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
    owner, kept = ["outside"], {}

    def pack(tensor):
        storage = _storage(tensor)
        if storage.data_ptr() not in module_state:
            kept.setdefault(storage.data_ptr(), (owner[0], storage.nbytes()))
        return tensor

    handles = []
    for index, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(
            lambda module, inputs, index=index: owner.__setitem__(0, index)))
        handles.append(block.register_forward_hook(
            lambda module, inputs, output: owner.__setitem__(0, "outside")))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = forward()   # kept until the count is done: the graph holds what it saved
    finally:
        for handle in handles:
            handle.remove()
    del loss
    by_owner = {}
    for who, nbytes in kept.values():
        by_owner[who] = by_owner.get(who, 0) + nbytes
    return by_owner
