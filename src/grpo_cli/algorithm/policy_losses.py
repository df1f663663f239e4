"""The per-token policy loss (``algo.objective``, docs/algorithm.md section 3): what one completion token
contributes before the KL term, the masks and the aggregation are added around it.

Each objective is one function of :class:`ObjectiveInputs` registered in :data:`OBJECTIVES` with
:func:`register_objective`, its formula beside it; the off-policy sequence mask, which multiplies any of them, ends
the file.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_cli.base.registry import Registry

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class ObjectiveOptions:
    """The options an objective may read (algo.* keys of the same names; eps_high already resolved)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float | None = None               # two-sided clipping: the ratio capped at delta (clip objectives)
    cispo_max_ratio: float = 5.0             # cispo's cap of the detached ratio (TRL's epsilon_high for cispo)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective function is given; every tensor is 0 on padding. ``logp`` carries the gradient; ``ratio``
    is the importance ratio at the chosen ``ratio_level`` (one value per row, broadcast, at ``sequence``) and
    carries it too; ``log_ratio`` is the per-token ``logp - old``; ``adv`` is ``[B, 1]``; ``m`` the float mask."""

    logp: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    adv: torch.Tensor
    m: torch.Tensor
    options: ObjectiveOptions


@dataclass(frozen=True)
class Objective:
    """One ``algo.objective``: its per-token loss function, its formula (for the docs) and the settings it allows."""

    name: str
    per_token: Callable[[ObjectiveInputs], torch.Tensor | tuple[torch.Tensor, dict]]
    formula: str
    ratio_levels: tuple[str, ...] = RATIO_LEVELS
    aggregations: tuple[str, ...] | None = None   # None: every loss type
    note: str = ""


OBJECTIVES = Registry("objective", key="algo.objective")  # name -> Objective, filled by register_objective


def register_objective(name: str, *, formula: str, ratio_levels: tuple[str, ...] = RATIO_LEVELS,
                       aggregations: tuple[str, ...] | None = None, note: str = "") -> Callable:
    """Decorator: register ``fn(x: ObjectiveInputs) -> l [B, T]`` (or ``(l, stats)``) as ``algo.objective=name``.

    ``l`` is the per-token policy loss (the KL term, the masks and the aggregation are added around it);
    ``stats`` are extra detached scalars. ``ratio_levels`` / ``aggregations`` name the settings that make sense."""
    bad = set(ratio_levels) - set(RATIO_LEVELS)
    if not ratio_levels or bad:
        raise ValueError(f"ratio_levels must be a non-empty subset of {RATIO_LEVELS}, "
                         f"got ratio_levels={ratio_levels!r}")

    def register(fn: Callable) -> Callable:
        OBJECTIVES.register(name)(Objective(name, fn, formula, tuple(ratio_levels),
                                            None if aggregations is None else tuple(aggregations), note))
        return fn

    return register


def _clipped_surrogate(x: ObjectiveInputs) -> torch.Tensor:
    o = x.options
    clipped = x.ratio.clamp(1.0 - o.eps_low, 1.0 + o.eps_high) * x.adv
    ratio = x.ratio if o.delta is None else x.ratio.clamp(max=o.delta)
    return -torch.minimum(ratio * x.adv, clipped)


@register_objective("grpo", formula="-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A), with r capped at delta when set",
                    note="default: the clipped surrogate (PPO / GRPO; GSPO at ratio_level=sequence)")
def grpo_objective(x: ObjectiveInputs) -> torch.Tensor:
    return _clipped_surrogate(x)


@register_objective("cispo", formula="-sg(min(r, cispo_max_ratio)) * A * logp",
                    note="MiniMax-M1 / ScaleRL: the ratio is capped and detached, every token keeps its gradient")
def cispo_objective(x: ObjectiveInputs) -> tuple[torch.Tensor, dict]:
    capped = x.ratio.clamp(max=x.options.cispo_max_ratio).detach()
    hit = ((x.ratio.detach() > x.options.cispo_max_ratio) & (x.adv > 0)).float() * x.m
    return -capped * x.adv * x.logp, {"cispo_clip_fraction": hit.sum() / x.m.sum().clamp_min(1.0)}


@register_objective("sapo", formula="-sigmoid(tau*(r-1)) * 4/tau * A, tau = sapo_temperature_pos if A > 0 else _neg",
                    note="soft adaptive gate instead of a hard clip (SAPO)")
def sapo_objective(x: ObjectiveInputs) -> torch.Tensor:
    o = x.options
    tau = torch.full_like(x.adv, o.sapo_temperature_neg).masked_fill(x.adv > 0, o.sapo_temperature_pos)
    return -torch.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau * x.adv


@register_objective("luspo", formula="|y_i| * grpo's l at the sequence ratio", ratio_levels=("sequence",),
                    aggregations=("grpo",),
                    note="length-unbiased sequence loss: the per-sequence mean becomes the per-sequence sum")
def luspo_objective(x: ObjectiveInputs) -> torch.Tensor:
    return _clipped_surrogate(x) * x.m.sum(dim=-1, keepdim=True)


def vespo_weights(log_ratio: torch.Tensor, m: torch.Tensor, adv: torch.Tensor, o: ObjectiveOptions) -> torch.Tensor:
    """VESPO's detached gamma weight per sequence ``[B, 1]``: ``phi(w) = exp(lam + k log w - lam w)`` (phi(1) = 1),
    ``w = exp(sum_t m * clamp(logp - old, -20, 20))`` clamped to ``[1e-8, e^20]``, (k, lam) by the sign of A."""
    low = math.log(1e-8)
    log_w = (log_ratio.detach().clamp(-20.0, 20.0) * m).sum(dim=-1, keepdim=True).clamp(low, 20.0)
    nonneg = adv >= 0
    k = torch.full_like(log_w, o.vespo_k_neg).masked_fill(nonneg, o.vespo_k_pos)
    lam = torch.full_like(log_w, o.vespo_lambda_neg).masked_fill(nonneg, o.vespo_lambda_pos).clamp_min(1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register_objective("vespo", formula="-sg(phi(w_i)) * A * logp, phi(w) = exp(lam + k log w - lam w), w = the "
                    "sequence ratio", ratio_levels=("token",),
                    note="gamma-weighted sequence ratio (VESPO); its sequence weight is built in")
def vespo_objective(x: ObjectiveInputs) -> tuple[torch.Tensor, dict]:
    phi = vespo_weights(x.log_ratio, x.m, x.adv, x.options)
    rows = (x.m.sum(dim=-1) > 0).float()
    return -phi * x.adv * x.logp, {"vespo_phi_mean": (phi.squeeze(-1) * rows).sum() / rows.sum().clamp_min(1.0)}


def check_objective(objective: str, ratio_level: str, loss_type: str) -> None:
    """ValueError in one line when the objective does not take this ratio level or loss type."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {tuple(OBJECTIVES)}, got objective={objective!r}")
    entry = OBJECTIVES[objective]
    if ratio_level not in entry.ratio_levels:
        raise ValueError(f"objective={objective!r} needs ratio_level in {entry.ratio_levels}, got "
                         f"ratio_level={ratio_level!r}")
    if entry.aggregations is not None and loss_type not in entry.aggregations:
        raise ValueError(f"objective={objective!r} needs aggregation in {entry.aggregations}, got {loss_type!r}")


def objectives_table() -> str:
    """The table of objectives in docs/algorithm.md, written from the registry."""
    lines = ["| `algo.objective` | per-token policy loss `l` | ratio_level | note |", "|---|---|---|---|"]
    for o in OBJECTIVES.values():
        lines.append(f"| `{o.name}` | `{o.formula}` | {', '.join(o.ratio_levels)} | {o.note} |")
    return "\n".join(lines)


def off_policy_keep(logp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, m: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[B, 1]``: keep a sequence when ``A >= 0`` or its token-mean
    ``behaviour - logp`` (detached) is at most ``threshold``. ``behaviour`` is the log-prob of the policy that
    sampled: the sampler's own where it reported one, else the trainer's old log-probs (TRL 1.16's choice). A token
    the sampler could not score (NaN) adds no evidence: it counts as 0, as in TRL."""
    seq_kl = torch.nan_to_num((behaviour - logp.detach()) * m, nan=0.0).sum(dim=-1, keepdim=True) \
        / m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return ((adv >= 0) | (seq_kl <= threshold)).float()
