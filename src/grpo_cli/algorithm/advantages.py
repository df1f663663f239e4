"""Advantage estimators (``algo.advantage``, docs/algorithm.md section 1): rewards ``r [N]`` of ``N = P*G``
completions, rows ``g*G .. g*G+G-1`` sharing prompt ``g``, to advantages ``A [N]``.

Each estimator is one function registered in :data:`ADVANTAGES` with :func:`register_advantage`, its formula beside
it; config validation, the trainer and the docs table (:func:`advantages_table`) read the registry.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_cli.base.registry import Registry

Scale = Literal["group", "batch", "none"]
_SCALES = ("group", "batch", "none")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and reshape ``rewards [N]`` to ``[N/G, G]`` (floating point)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor, got rewards shape {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got group_size={group_size!r}")
    n = rewards.shape[0]
    if n == 0 or n % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards N={n} (N = prompts * group_size > 0)"
        )
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return r.view(n // group_size, group_size)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, eps: float = 1e-4, scale: Scale = "group"
) -> torch.Tensor:
    """Group-relative advantages ``A [N]`` (detached).

    For each group ``g`` (rows ``g*G .. g*G+G-1``), with Bessel (unbiased, ``/(G-1)``) std::

        mean_g = mean(r_g)
        A_i = (r_i - mean_g) / (std_g + eps)    scale="group"
        A_i = (r_i - mean_g) / (std_B + eps)    scale="batch"   (std_B over all N rewards)
        A_i =  r_i - mean_g                     scale="none"    (Dr. GRPO)

    A group whose rewards are all equal gets exactly zero advantages in every mode. ``eps`` is for
    stability only; a value near the reward scale (e.g. >= 1e-2 for 0/1 rewards) shrinks the signal.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite float > 0, got eps={eps!r}")
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got scale={scale!r}")
    r = _grouped(rewards, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = centered / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    elif scale == "batch":
        adv = centered / (r.reshape(-1).std(unbiased=True) + eps)
    else:
        adv = centered
    zero_std = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(zero_std, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


@dataclass(frozen=True)
class AdvantageEstimator:
    """One ``algo.advantage``: ``fn(rewards [N], group_size, *, eps, scale, lengths) -> A [N]``."""

    name: str
    fn: Callable[..., torch.Tensor]
    formula: str
    zero_sum_groups: bool        # every group's advantages sum to 0 (the live check asks it only then)
    scales: bool = False         # reads algo.scale_rewards (the others refuse a non-default one)
    note: str = ""


ADVANTAGES = Registry("advantage estimator", key="algo.advantage")  # name -> AdvantageEstimator


def register_advantage(name: str, *, formula: str, zero_sum_groups: bool, scales: bool = False,
                       note: str = "") -> Callable:
    """Decorator: register ``fn(rewards, group_size, *, eps, scale, lengths)`` as ``algo.advantage=name``."""

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        ADVANTAGES.register(name)(AdvantageEstimator(name, fn, formula, zero_sum_groups, scales, note))
        return fn

    return register


@register_advantage("grpo", formula="(r_i - mean_g) / (std_g + adv_eps)  (scale_rewards: group, batch or none)",
                    zero_sum_groups=True, scales=True, note="default: group z-scores (section 1)")
def grpo_advantages(rewards, group_size, *, eps=1e-4, scale="group", **_):
    return group_advantages(rewards, group_size, eps=eps, scale=scale)


@register_advantage("rloo", formula="(r_i - mean_g) * G / (G - 1)  = r_i - mean of the other G-1",
                    zero_sum_groups=True, note="leave-one-out baseline (RLOO; verl's rloo)")
def rloo_advantages(rewards, group_size, **_):
    r = _grouped(rewards, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).reshape(-1)


@register_advantage("reinforce_plus_plus_baseline",
                    formula="whiten_B(r_i - mean_g), whitened over the batch's loss tokens (unbiased var, +1e-8)",
                    zero_sum_groups=False, note="REINFORCE++ with a group baseline (verl's masked_whiten)")
def reinforce_plus_plus_baseline_advantages(rewards, group_size, *, lengths=None, **_):
    r = _grouped(rewards, group_size)
    centered = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
    w = torch.ones_like(centered) if lengths is None else lengths.detach().float().to(centered.device)
    total = w.sum()
    mean = (w * centered).sum() / total.clamp_min(1.0)
    var = (w * (centered - mean) ** 2).sum() / total.clamp_min(1.0)
    var = var * total / (total - 1).clamp_min(1.0)  # Bessel over tokens, as verl's masked_var(unbiased=True)
    return torch.where(w > 0, (centered - mean) * torch.rsqrt(var + 1e-8), torch.zeros_like(centered))


@register_advantage("opo", formula="r_i - sum_j |y_j| r_j / sum_j |y_j|  (length-weighted group baseline)",
                    zero_sum_groups=False, note="optimal-baseline OPO (verl's opo)")
def opo_advantages(rewards, group_size, *, lengths=None, **_):
    r = _grouped(rewards, group_size)
    w = torch.ones_like(r) if lengths is None else lengths.detach().float().to(r.device).view_as(r)
    baseline = (w * r).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return (r - baseline).reshape(-1)


@register_advantage("grpo_passk", formula="best of the group: (r_max - r_2nd) / (std_g + adv_eps); others 0",
                    zero_sum_groups=False, scales=True,
                    note="pass@k (verl's grpo_passk); scale_rewards=none leaves out the std")
def grpo_passk_advantages(rewards, group_size, *, eps=1e-4, scale="group", **_):
    r = _grouped(rewards, group_size)
    top, index = torch.topk(r, 2, dim=1)
    gap = top[:, 0] - top[:, 1]
    if scale != "none":
        gap = gap / (r.std(dim=1, unbiased=True) + eps)
    adv = torch.zeros_like(r)
    adv.scatter_(1, index[:, :1], gap.unsqueeze(1))
    return adv.reshape(-1)


def advantages_of(name: str, rewards: torch.Tensor, group_size: int, *, eps: float = 1e-4, scale: Scale = "group",
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``A [N]`` (detached) by the estimator ``algo.advantage=name``; ``lengths [N]`` = loss tokens per completion."""
    if name not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {tuple(ADVANTAGES)}, got advantage={name!r}")
    entry = ADVANTAGES[name]
    if scale != "group" and not entry.scales:
        raise ValueError(f"advantage={name!r} takes no scale_rewards (it is {entry.formula}), got scale={scale!r}")
    return entry.fn(rewards, group_size, eps=eps, scale=scale, lengths=lengths).detach()


def advantages_table() -> str:
    lines = ["| `algo.advantage` | A_i | groups sum to 0 | note |", "|---|---|---|---|"]
    for a in ADVANTAGES.values():
        lines.append(f"| `{a.name}` | `{a.formula}` | {'yes' if a.zero_sum_groups else 'no'} | {a.note} |")
    return "\n".join(lines)


def zero_std_group_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Metric ``frac_reward_zero_std``: share of groups whose ``G`` rewards are all equal."""
    r = _grouped(rewards, group_size)
    return (r == r[:, :1]).all(dim=1).float().mean().item()


def group_std_mean(rewards: torch.Tensor, group_size: int) -> float:
    """Metric ``reward_std``: ``mean_g std_g`` with the unbiased (Bessel) per-group std."""
    r = _grouped(rewards, group_size)
    return r.std(dim=1, unbiased=True).mean().item()
