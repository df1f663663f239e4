"""How the reward functions' scores become one reward per completion (`reward.aggregation`).

A function may return None for a completion it does not apply to: that function is then left out of that
completion's sum (and of its group's statistics under normalize_then_sum). A completion no function scored is an
error, not a silent 0.

    sum:                 r_i = sum_k w_k s_{k,i}                              (over the k with s_{k,i} not None)
    normalize_then_sum:  r_i = sum_k w_k (s_{k,i} - mean_g s_k) / (std_g s_k + 1e-4)   (GDPO; TRL's
                         multi_objective_aggregation; mean and Bessel std over the group's scored completions)
"""

from __future__ import annotations

import math

from grpo_cli.base.errors import RewardError

AGGREGATIONS = ("sum", "normalize_then_sum")
STD_EPS = 1e-4  # TRL's constant in normalize_then_sum


def _group_z(scores: list[float | None], group_size: int) -> list[float | None]:
    """Each present score minus its group's mean over the present ones, over their Bessel std + 1e-4."""
    out: list[float | None] = []
    for start in range(0, len(scores), group_size):
        group = scores[start:start + group_size]
        present = [s for s in group if s is not None]
        mean = sum(present) / len(present) if present else 0.0
        var = sum((s - mean) ** 2 for s in present) / (len(present) - 1) if len(present) > 1 else 0.0
        out += [None if s is None else (s - mean) / (math.sqrt(var) + STD_EPS) for s in group]
    return out


def combine(weights: dict[str, float], per_function: dict[str, list[float | None]], aggregation: str = "sum",
            group_size: int | None = None) -> list[float]:
    """The reward of each completion from the functions' scores (rows g*G .. g*G+G-1 share a prompt)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"reward.aggregation={aggregation} is invalid: use one of {', '.join(AGGREGATIONS)}")
    if aggregation == "normalize_then_sum":
        if not group_size:
            raise ValueError("reward.aggregation=normalize_then_sum needs the group size")
        per_function = {name: _group_z(scores, group_size) for name, scores in per_function.items()}
    n = len(next(iter(per_function.values()), []))
    totals: list[float] = []
    for i in range(n):
        present = [(name, s) for name, scores in per_function.items() if (s := scores[i]) is not None]
        if not present:
            raise RewardError(f"every reward function ({', '.join(per_function)}) returned None for completion {i}; "
                              "at least one must score each completion")
        totals.append(sum(weights[name] * s for name, s in present))
    return totals


def present_mean(scores: list[float | None]) -> float:
    """Mean of the scores that are not None (the metric reward/<name>); NaN when none is."""
    present = [s for s in scores if s is not None]
    return sum(present) / len(present) if present else math.nan
