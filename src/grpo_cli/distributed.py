"""Data-parallel helpers on torch.distributed (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK).

Each rank takes whole prompt groups, so advantages need no communication. Gradients of the LoRA
parameters are summed across ranks in one flat all-reduce per optimiser step; the loss weights use the
step's global row and token counts, so the summed gradient equals the single-process gradient over the
whole batch exactly (for every loss_type). NCCL on GPUs, gloo on CPUs; a timeout turns a dead rank into
an error instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=int(os.environ.get("GRPO_DIST_TIMEOUT_S", "600")))


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: torch.device) -> Dist:
    """Join the process group torchrun describes in the environment; a no-op for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return Dist(rank, world, local_rank)


def local_device(device: torch.device, d: Dist) -> torch.device:
    """Under torchrun each process drives the GPU of its local rank."""
    if device.type == "cuda" and d.enabled:
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return device


def sum_floats(values: list[float], d: Dist, device) -> list[float]:
    if not d.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def sum_gradients(params: list[torch.nn.Parameter], d: Dist) -> None:
    """Sum the gradients across ranks in one flat buffer (LoRA gradients are small)."""
    if not d.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
