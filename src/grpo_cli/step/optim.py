"""`optimizer.name` -> a torch optimizer over the LoRA parameters, built by the builder registered under that name.

    @OPTIMIZERS.register("adamw")
    def adamw(params, *, lr, weight_decay, betas): ...   # its keyword parameters are the config keys it reads

A builder's keyword parameters are the keys of its `conf/optimizer/NAME.yaml` it reads; config validation
refuses any other key (beyond COMMON_KEYS), so every key there is used. A new optimizer is one builder plus
its YAML file.

The learning rate is a pure function of the optimizer-update count (`lr_factor`); `LRSchedule` sets it on the
optimizer's param groups and keeps that count, all a checkpoint needs of it. No torch import at module level:
config validation reads OPTIMIZERS before anything heavy loads.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from grpo_cli.base.registry import Registry
from grpo_cli.config.schema import OptimizerConfig, fail

# keys every optimizer config has: the name, and the learning rate and its schedule (lr, warmup_steps and
# schedule are read by LRSchedule as well)
COMMON_KEYS = ("name", "lr", "weight_decay", "warmup_steps", "schedule")
OPTIMIZERS = Registry("optimizer", key="optimizer.name")


def builder_keys(name: str) -> tuple[str, ...]:
    """The config keys the builder of optimizer `name` reads: its keyword parameters."""
    params = inspect.signature(OPTIMIZERS.lookup(name)).parameters
    return tuple(key for key, p in params.items() if p.kind is p.KEYWORD_ONLY)


def optimizer_keys(name: str) -> tuple[str, ...]:
    """The keys optimizer `name` reads beyond COMMON_KEYS (each must be in its config, and no other)."""
    return tuple(key for key in builder_keys(name) if key not in COMMON_KEYS)


def given_keys(optimizer: OptimizerConfig) -> dict[str, Any]:
    """The keys its config gives beyond the common ones (an optimizer's own: betas, momentum, a plug-in's)."""
    own = {"betas": optimizer.betas, "momentum": optimizer.momentum, "nesterov": optimizer.nesterov}
    return {**{k: v for k, v in own.items() if v is not None}, **optimizer.plugin_keys}


def check_optimizer(optimizer: OptimizerConfig) -> None:
    """An optimizer config holds the common keys and exactly the extra keys its optimizer.name reads."""
    given, wanted = given_keys(optimizer), optimizer_keys(optimizer.name)
    allowed = (*COMMON_KEYS, *wanted)
    for key, value in given.items():
        if key not in allowed:
            fail(f"optimizer.{key}", value, f"optimizer.name={optimizer.name} does not use it (its keys: "
                                            f"{', '.join(allowed)}); pick optimizer=NAME as a group")
    for key in wanted:
        if key not in given:
            fail(f"optimizer.{key}", None, f"optimizer.name={optimizer.name} needs it; pick optimizer="
                                           f"{optimizer.name} as a group rather than only optimizer.name")
    if optimizer.nesterov and not (optimizer.momentum is not None and optimizer.momentum > 0):
        fail("optimizer.nesterov", True, "needs optimizer.momentum > 0")


def build_optimizer(params, cfg_opt: OptimizerConfig):
    """The optimizer `cfg_opt.name` names, given the keys of its config it reads (check_optimizer)."""
    given = given_keys(cfg_opt)
    return OPTIMIZERS.lookup(cfg_opt.name)(params, **{key: given[key] if key in given else getattr(cfg_opt, key)
                                                       for key in builder_keys(cfg_opt.name)})


@OPTIMIZERS.register("adamw")
def adamw(params, *, lr: float, weight_decay: float, betas):
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


@OPTIMIZERS.register("sgd")
def sgd(params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool):
    import torch

    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)


def lr_factor(schedule: str, warmup: int, total: int, updates: int) -> float:
    """The factor on optimizer.lr after `updates` optimizer updates: linear warmup over `warmup` updates, then
    constant, linear or cosine decay to `total` updates."""
    if warmup and updates < warmup:
        return (updates + 1) / warmup
    progress = (updates - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


class LRSchedule:
    """The learning rate of every param group, optimizer.lr x lr_factor(updates). warmup_steps and max_steps
    are in training steps, each `updates_per_step` optimizer updates (skipped non-finite ones included)."""

    def __init__(self, optimizer, cfg_opt: OptimizerConfig, max_steps: int, updates_per_step: int):
        self.optimizer, self.base_lr, self.schedule = optimizer, float(cfg_opt.lr), cfg_opt.schedule
        self.warmup, self.total = cfg_opt.warmup_steps * updates_per_step, max_steps * updates_per_step
        self.updates = 0
        self.apply()

    @property
    def lr(self) -> float:
        """The rate the next update uses."""
        return self.base_lr * lr_factor(self.schedule, self.warmup, self.total, self.updates)

    def apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        """One optimizer update done (or skipped)."""
        self.updates += 1
        self.apply()

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """The update count of a checkpoint; the rate follows from it and the configured schedule."""
        self.updates = int(state["updates"])
        self.apply()
