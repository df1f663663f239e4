"""How the ranks share a step (`trainer.parallel`): what the trainer asks and each way answers.

    ddp    every rank holds the whole model; its LoRA gradients are summed in one all-reduce (distributed.py)
    fsdp   the frozen base sharded over the ranks (model/sharding.py, FSDP2): the gradients are reduce-scattered by
           FSDP in the backward of a mini-batch's last pass, the adapter and the optimizer state are gathered whole
           for a checkpoint and cut back into shards on resume, and every pass through the model is a collective:
           every rank makes as many (a rank with fewer micro-batches runs idle ones, of weight 0) and every rank
           takes part in an evaluation

A checkpoint is the same file either way (the whole adapter, the whole optimizer state as one process keeps it), so
a run resumes on any number of ranks, under either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_cli.model import adapters, sharding
from grpo_cli.step import distributed


class DataParallel:
    """trainer.parallel=ddp (and one process)."""

    sharded = False

    def __init__(self, ranks: distributed.Dist):
        self.ranks = ranks

    def evaluates(self) -> bool:
        """Whether this rank runs the held-out evaluation: rank 0 alone."""
        return self.ranks.is_main

    def passes(self, counts: list[int]) -> list[int]:
        """The passes this rank makes for `counts` micro-batches of each mini-batch: its own."""
        return counts

    def before_pass(self, model, last: bool) -> None:
        """Before each pass with grad of a mini-batch (`last`: its last one)."""

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        distributed.sum_gradients(params, self.ranks)

    def adapter(self, model, name: str = adapters.DEFAULT) -> dict[str, torch.Tensor]:
        """The trainable weights of adapter `name`, whole, under their `default` names (what a checkpoint keeps)."""
        return adapters.trainable_state(model, name)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def restore(self, model, optimizer: torch.optim.Optimizer, adapter: dict, optimizer_state: dict, device,
                name: str = adapters.DEFAULT) -> None:
        """The adapter (as peft saves it) and the optimizer state of a checkpoint into `model`'s adapter `name` and
        `optimizer`."""
        adapters.load_trainable_state(model, {k: v.to(device) for k, v in adapter.items()}, name)
        optimizer.load_state_dict(optimizer_state)


class FullyShardedDataParallel(DataParallel):
    """trainer.parallel=fsdp."""

    sharded = True

    def evaluates(self) -> bool:
        return True  # each decode step is a collective

    def passes(self, counts: list[int]) -> list[int]:
        """The most micro-batches any rank has, per mini-batch (one all-reduce)."""
        if not counts:
            return counts
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        most = torch.tensor(counts, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return [int(n) for n in most.tolist()]

    def before_pass(self, model, last: bool) -> None:
        """LoRA gradients accumulate unreduced on each rank until the last pass, whose backward reduce-scatters them
        (the order of DDP's sums: each rank's micro-batches, then across the ranks)."""
        model.set_requires_gradient_sync(last)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Done: FSDP reduce-scattered them in the last pass's backward."""

    def adapter(self, model, name: str = adapters.DEFAULT) -> dict[str, torch.Tensor]:
        return sharding.gathered_adapter(model)  # one adapter: a sweep on one base is refused under fsdp

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return sharding.gathered_optimizer_state(optimizer)

    def restore(self, model, optimizer: torch.optim.Optimizer, adapter: dict, optimizer_state: dict, device,
                name: str = adapters.DEFAULT) -> None:
        sharding.load_adapter(model, adapter)
        optimizer.load_state_dict(sharding.sharded_optimizer_state(optimizer, optimizer_state))


def of(name: str, ranks: distributed.Dist) -> DataParallel:
    """The way `trainer.parallel=NAME` shares a step over `ranks` (validated before: fsdp has 2 ranks or more)."""
    return FullyShardedDataParallel(ranks) if name == "fsdp" else DataParallel(ranks)
