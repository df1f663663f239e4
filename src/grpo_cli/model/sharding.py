"""The frozen base sharded over the ranks with FSDP2 (`trainer.parallel=fsdp`): each decoder layer and the root (the
peft model) are `fully_shard` units, so a rank holds 1/N of every frozen weight and all-gathers a layer only while
it runs.

The arrangement, as measured (docs/usage.md, "Past one GPU"): no MixedPrecisionPolicy. FSDP2 all-gathers every
parameter in its own dtype, so a bf16 (or 4-bit) base and fp32 LoRA weights share a unit; only the trainable
parameters of one unit must share a dtype, and LoRA's all do. A MixedPrecisionPolicy(param_dtype=bf16) would run the
LoRA weights in bf16. Every unit sums its gradients (divide factor 1, sum-only collectives: gloo has neither AVG nor
PREMUL_SUM for a reduce-scatter), the convention the loss weights are written for (distributed.py).

Every collective here is called by every rank in the same order: the adapter is gathered on every rank, and each
pass through the model is one all-gather per unit, so every rank makes the same passes (step/parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a (peft-wrapped) transformers causal LM: the units FSDP shards one by one."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.get_decoder().layers)


def shard(model, pad_token_id: int, device: torch.device) -> torch.nn.Module:
    """`model` sharded in place over the default process group onto `device` (the rank's: FSDP moves each unit's
    shard there, so a base left on the CPU never reaches the device whole): each decoder layer, then the root. A first
    forward through the root (one token) makes it FSDP's root unit: the log-prob pass calls the decoder directly, and
    a layer whose forward ran first would take that role."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the default would be CUDA wherever it exists
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in model.modules():  # each call acts on its own unit only, so every unit gets them
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    with torch.no_grad():
        model(input_ids=torch.tensor([[pad_token_id]], device=device), use_cache=False)
    model.reshard()
    if device.type == "cpu":  # the whole weights are freed now: their pages go back, not kept by the allocator
        from grpo_cli.model.allocator import release_free_memory

        release_free_memory()
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def root_unsharded(model, reshard: bool = True) -> Iterator[None]:
    """The root unit's own weights (embeddings, the tied head, the final norm) gathered around a pass that does not
    enter through the root's forward (the decoder called directly, the head's weight read, peft's generate); resharded
    after it unless `reshard` is False (a pass with grad: its backward reshards). Nothing where `model` is not
    sharded."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        if reshard:
            model.reshard()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def smallest(value: int) -> int:
    """The smallest of every rank's `value` (an all-reduce): a choice every rank makes alike."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def gathered_adapter(model) -> dict[str, torch.Tensor]:
    """The trained LoRA weights, whole, on every rank (one all-gather per LoRA tensor, the base never gathered), under
    the model's parameter names."""
    return {name: full(p.detach()) for name, p in trainable(model).items()}


def like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` (a tensor of `param`'s global shape, the same on every rank) as `param` is laid out: this rank's shard
    of it where `param` is a DTensor (no communication), else itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def load_adapter(model, weights: dict[str, torch.Tensor]) -> None:
    """LoRA weights as peft saves them (names without the adapter's) into the sharded model: each rank keeps its shard
    of each. Every LoRA tensor must be there."""
    params = trainable(model)
    by_saved_name = {name.replace(".default.", "."): name for name in params}
    missing = sorted(set(by_saved_name) - set(weights))
    if missing:
        raise KeyError(f"the adapter holds no {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for saved, name in by_saved_name.items():
            param = params[name]
            local = like(param, weights[saved].to(param.dtype))
            target = param.to_local() if hasattr(param, "to_local") else param
            target.copy_(local.to_local() if hasattr(local, "to_local") else local)


def gathered_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with every sharded state tensor gathered whole (every rank calls it): the file a
    one-process run writes, so a checkpoint resumes on any number of ranks."""
    state = optimizer.state_dict()
    return {**state, "state": {index: {key: full(value) for key, value in entry.items()}
                               for index, entry in sorted(state["state"].items())}}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A whole optimizer state (`gathered_optimizer_state`'s, or a one-process run's) laid out as this rank's
    optimizer holds its parameters, for `optimizer.load_state_dict`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {**state, "state": {index: {key: like(params[index], value) if value.shape == params[index].shape
                                       else value for key, value in entry.items()}
                               for index, entry in state["state"].items()}}


def local_bytes(model, *, frozen: bool = True) -> int:
    """Bytes of the frozen (or trainable) parameters this rank holds: its shard of each under FSDP, tied ones once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad == frozen:
            continue
        t = p.to_local() if hasattr(p, "to_local") else p
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
