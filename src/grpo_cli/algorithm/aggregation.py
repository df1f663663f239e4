"""Aggregation (``algo.aggregation``, alias ``algo.loss_type``; docs/algorithm.md section 4): from the per-token
losses ``l [B, T]`` (already 0 on padding) and the float mask ``m [B, T]`` to the loss of one micro-batch, and how
the micro-batch losses of one optimizer update add up.

Gradient accumulation. One optimizer update covers one mini-batch (the whole step's batch when
``algo.mini_batches=1``), cut into ``K`` micro-batches, possibly over several ranks. Each micro-batch loss
is multiplied by :func:`accumulation_weight` before backward, so that the summed gradient is the gradient
of the type's loss over the update's batch:

* ``grpo``, ``dr_grpo`` (means over rows): ``rows_in_micro / rows_in_update``.
* ``bnpo`` (token mean over each micro-batch, per the contract): ``1 / K``, the mean of the micro-batch
  losses. With one micro-batch on one rank it equals ``dapo``; with several it weighs each micro-batch
  equally whatever its token count, and differs from ``dapo``.
* ``dapo``: ``policy_loss`` gets ``total_tokens`` = real tokens in the whole update (all micro-batches and
  ranks) and the weight is 1.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_cli.base.registry import Registry

Accumulate = Literal["rows", "micro_batches", "sum"]


@dataclass(frozen=True)
class LossType:
    """One ``algo.loss_type``: its aggregation, its formula (for the docs) and how micro-batches add up."""

    name: str
    aggregate: Callable[..., torch.Tensor]
    formula: str
    accumulate: Accumulate   # rows | micro_batches | sum: see accumulation_weight
    requires: tuple[str, ...] = ()  # policy_loss keywords that must not be None
    note: str = ""


LOSS_TYPES = Registry("loss type", key="algo.loss_type")  # name -> LossType, filled by register_loss_type

_ACCUMULATE_DOC = {
    "rows": "weighted by rows: `rows_in_micro / rows_in_update`",
    "micro_batches": "mean of the micro-batch losses: `1 / micro_batches_in_update`",
    "sum": "summed (the normaliser is already the whole update's token count)",
}


def register_loss_type(name: str, *, formula: str, accumulate: Accumulate, requires: tuple[str, ...] = (),
                       note: str = "") -> Callable:
    """Decorator: register ``fn(l, m, *, max_new_tokens, total_tokens) -> loss`` as ``algo.loss_type=name``."""
    if accumulate not in _ACCUMULATE_DOC:
        raise ValueError(f"accumulate must be one of {tuple(_ACCUMULATE_DOC)}, got accumulate={accumulate!r}")

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        LOSS_TYPES.register(name)(LossType(name, fn, formula, accumulate, tuple(requires), note))
        return fn

    return register


@register_loss_type("grpo", formula="mean_i( sum_t m*l / max(1, sum_t m) )", accumulate="rows",
                    note="default: per-sequence mean, then mean over sequences")
def grpo_loss(per_token: torch.Tensor, m: torch.Tensor, **_) -> torch.Tensor:
    return (per_token.sum(dim=-1) / m.sum(dim=-1).clamp_min(1.0)).mean()


@register_loss_type("bnpo", formula="sum_{i,t} m*l / max(1, sum_{i,t} m)", accumulate="micro_batches",
                    note="token mean over each micro-batch: equals dapo only when an update is one micro-batch "
                         "on one rank")
def bnpo_loss(per_token: torch.Tensor, m: torch.Tensor, **_) -> torch.Tensor:
    return per_token.sum() / m.sum().clamp_min(1.0)


@register_loss_type("dapo", formula="sum_{i,t} m*l / max(1, tokens of the whole update)", accumulate="sum",
                    note="token mean over the whole update, across micro-batches and ranks")
def dapo_loss(per_token: torch.Tensor, m: torch.Tensor, *, total_tokens: float | None = None, **_) -> torch.Tensor:
    denom = m.sum().clamp_min(1.0) if total_tokens is None else max(1.0, float(total_tokens))
    return per_token.sum() / denom


@register_loss_type("dr_grpo", formula="sum_{i,t} m*l / (B * max_new_tokens)", accumulate="rows",
                    requires=("max_new_tokens",), note="constant normaliser, no length bias (Dr. GRPO)")
def dr_grpo_loss(per_token: torch.Tensor, m: torch.Tensor, *, max_new_tokens: int, **_) -> torch.Tensor:
    return per_token.sum() / float(per_token.shape[0] * max_new_tokens)


def accumulation_weight(loss_type: str, *, rows: int, rows_total: float, micro_batches_total: float) -> float:
    """What a micro-batch loss is multiplied by before backward, so that the gradients summed over the
    micro-batches (and ranks) of one update equal the gradient of ``loss_type``'s loss over the update.

    ``rows`` = rows in this micro-batch; ``rows_total`` / ``micro_batches_total`` = rows / micro-batches of the
    whole update, over all ranks.
    """
    mode = LOSS_TYPES[loss_type].accumulate
    if mode == "rows":
        return rows / max(1.0, float(rows_total))
    if mode == "micro_batches":
        return 1.0 / max(1.0, float(micro_batches_total))
    return 1.0


def loss_types_table() -> str:
    """The table of loss types in docs/algorithm.md, written from the registry."""
    lines = ["| `algo.loss_type` | loss of one micro-batch | micro-batch losses of one update are | note |",
             "|---|---|---|---|"]
    for t in LOSS_TYPES.values():
        lines.append(f"| `{t.name}` | `{t.formula}` | {_ACCUMULATE_DOC[t.accumulate]} | {t.note} |")
    return "\n".join(lines)


def accumulated(loss: torch.Tensor, stats: dict[str, torch.Tensor], weight: float,
                micro_batches_total: float) -> torch.Tensor:
    """What a micro-batch sends to backward: the loss type's part times its accumulation ``weight``, and the
    entropy bonus (a token mean of each micro-batch, as TRL's) divided by the update's number of micro-batches."""
    bonus = stats["entropy_bonus"]
    if not bonus.requires_grad and float(bonus) == 0.0:  # no bonus: exactly the loss type's weighted loss
        return loss * weight
    return (loss + bonus) * weight - bonus / max(1.0, float(micro_batches_total))
