"""`optimizer.name` -> a torch optimizer over the LoRA parameters. Each optimizer lists the config keys it
reads; config.validate refuses any other key, so every key in `conf/optimizer/*.yaml` is used.

No torch import at module level: config validation reads OPTIMIZERS before anything heavy loads.
"""

from __future__ import annotations

from omegaconf import DictConfig

# keys every optimizer config has: the learning rate and its schedule (read by the trainer's scheduler)
COMMON_KEYS = ("name", "lr", "weight_decay", "warmup_steps", "schedule")
# name -> (torch.optim class, the extra keys it reads)
OPTIMIZERS = {
    "adamw": ("AdamW", ("betas",)),
    "sgd": ("SGD", ("momentum", "nesterov")),
}


def build_optimizer(params, cfg_opt: DictConfig):
    """The optimizer `cfg_opt.name` names, with the keys of its config (validated by config.validate)."""
    import torch

    class_name, _ = OPTIMIZERS[cfg_opt.name]
    kwargs = {"lr": cfg_opt.lr, "weight_decay": cfg_opt.weight_decay}
    if cfg_opt.name == "adamw":
        kwargs["betas"] = tuple(cfg_opt.betas)
    elif cfg_opt.name == "sgd":
        kwargs.update(momentum=cfg_opt.momentum, nesterov=cfg_opt.nesterov)
    return getattr(torch.optim, class_name)(params, **kwargs)
