"""`optimizer.name` -> a torch optimizer over the LoRA parameters, built by the builder registered under that name.

    @OPTIMIZERS.register("adamw")
    def adamw(params, *, lr, weight_decay, betas): ...   # its keyword parameters are the config keys it reads

A builder's keyword parameters are the keys of its `conf/optimizer/NAME.yaml` it reads; config validation
refuses any other key (beyond COMMON_KEYS), so every key there is used. A new optimizer is one builder plus
its YAML file. No torch import at module level: config validation reads OPTIMIZERS before anything heavy loads.
"""

from __future__ import annotations

import inspect

from omegaconf import DictConfig

from grpo_cli.registry import Registry

# keys every optimizer config has: the name, and the learning rate and its schedule (lr, warmup_steps and
# schedule are read by the trainer's scheduler as well)
COMMON_KEYS = ("name", "lr", "weight_decay", "warmup_steps", "schedule")
OPTIMIZERS = Registry("optimizer", key="optimizer.name")


def builder_keys(name: str) -> tuple[str, ...]:
    """The config keys the builder of optimizer `name` reads: its keyword parameters."""
    params = inspect.signature(OPTIMIZERS.lookup(name)).parameters
    return tuple(key for key, p in params.items() if p.kind is p.KEYWORD_ONLY)


def optimizer_keys(name: str) -> tuple[str, ...]:
    """The keys optimizer `name` reads beyond COMMON_KEYS (each must be in its config, and no other)."""
    return tuple(key for key in builder_keys(name) if key not in COMMON_KEYS)


def build_optimizer(params, cfg_opt: DictConfig):
    """The optimizer `cfg_opt.name` names, given the keys of its config it reads (validated by config.validate)."""
    return OPTIMIZERS.lookup(cfg_opt.name)(params, **{key: cfg_opt[key] for key in builder_keys(cfg_opt.name)})


@OPTIMIZERS.register("adamw")
def adamw(params, *, lr: float, weight_decay: float, betas):
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


@OPTIMIZERS.register("sgd")
def sgd(params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool):
    import torch

    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
