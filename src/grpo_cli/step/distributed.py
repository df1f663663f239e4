"""Data-parallel helpers on torch.distributed (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK).

Each rank takes whole prompt groups, so advantages need no communication. Gradients of the LoRA
parameters are summed across ranks in one flat all-reduce per optimiser step; the loss weights use the
step's global row and token counts, so the summed gradient equals the single-process gradient over the
whole batch exactly (for every loss_type). NCCL on GPUs, gloo on CPUs; a timeout turns a dead rank into
an error instead of a hang. Each rank binds cuda:LOCAL_RANK and joins the group before its model loads.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo_cli.base.errors import ConfigError

DEFAULT_TIMEOUT_S = 600


def collective_timeout(env: Mapping[str, str]) -> timedelta:
    """How long a collective waits for the other ranks: GRPO_DIST_TIMEOUT_S seconds (600 unless set)."""
    given = env.get("GRPO_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"GRPO_DIST_TIMEOUT_S={given} is invalid: give the seconds a collective waits for the other "
                          f"ranks, a number > 0 (default {DEFAULT_TIMEOUT_S})")
    return timedelta(seconds=seconds)


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


def placement(device: str, env: Mapping[str, str], cuda_devices: int) -> str:
    """The device this process trains on, from `trainer.device` and the torchrun environment alone.

    `auto` is CUDA when a device is visible, else the CPU. Under torchrun each rank owns the GPU of its
    local rank (`cuda:LOCAL_RANK`), so that N ranks on a node use N GPUs, not N copies on cuda:0."""
    if device == "auto":
        device = "cuda" if cuda_devices > 0 else "cpu"
    if device == "cpu" or "WORLD_SIZE" not in env:
        return device
    world, local_rank = int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if device.startswith("cuda:") and world > 1:
        raise ConfigError(f"trainer.device={device} is invalid with {world} ranks: every rank would use that one GPU; "
                          "use trainer.device=auto or cuda (each rank takes cuda:LOCAL_RANK)")
    if device == "cuda":
        if local_rank >= cuda_devices:
            raise ConfigError(f"LOCAL_RANK={local_rank} but only {cuda_devices} CUDA device(s) are visible "
                              "(CUDA_VISIBLE_DEVICES); start at most that many processes per node")
        return f"cuda:{local_rank}"
    return device


def setup(device_name: str) -> tuple[Dist, str]:
    """Bind this process to its device and join the process group torchrun describes, before anything
    else touches CUDA or loads a model. Returns the Dist and the device to load the model on."""
    env = os.environ
    device = placement(device_name, env, torch.cuda.device_count() if device_name != "cpu" else 0)
    cuda = device.startswith("cuda")
    if cuda and ":" in device:
        torch.cuda.set_device(torch.device(device))
    if "WORLD_SIZE" not in env:
        return Dist(), device
    world, rank, local_rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if cuda:  # NCCL bound to this rank's GPU from the start (no guessing, no hang on a wrong device)
            dist.init_process_group(backend="nccl", timeout=collective_timeout(env), device_id=torch.device(device))
        else:
            dist.init_process_group(backend="gloo", timeout=collective_timeout(env))
    return Dist(rank, world, local_rank), device


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


def world_size() -> int:
    """Processes of this job: the joined group's, else 1."""
    return dist.get_world_size() if dist.is_initialized() else 1


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is on any rank: ranks stop at the same point."""
    if world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    votes = torch.tensor([float(flag)], device=device)
    dist.all_reduce(votes)
    return bool(votes.item() > 0)


def names_on_any_rank(names: list[str]) -> list[str]:
    """The names given on any rank, sorted: the same list, in the same order, on every rank (TRL's gather_object)."""
    if world_size() == 1:
        return sorted(names)
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, names)
    return sorted({name for given in gathered for name in given})


def collective_failure(error: BaseException) -> str | None:
    """What a failed collective says, in a few words, when `error` is one (another rank died, hung past
    GRPO_DIST_TIMEOUT_S or closed its connection: gloo's RuntimeError, NCCL's and the store's DistError); None for any
    other error."""
    text = str(error)
    if not (isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in text)):
        return None
    text = re.sub(r"^\[[^\]]*\] ?", "", text.strip().splitlines()[0] if text.strip() else type(error).__name__)
    return text.split(". ")[0].rstrip(".")[:160]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def teardown() -> None:
    if dist.is_initialized():  # also a one-rank torchrun job, which has a group but no collectives
        dist.destroy_process_group()
