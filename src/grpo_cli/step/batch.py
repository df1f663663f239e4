"""One step's scored rollouts as the loss reads them: the Batch record (its per-row fields declared as the
Rollout's are, so mini-batches and dynamic sampling select and join it whole), the group advantages and loss mask
that make it (make_batch), and the layout of its groups into mini-batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo_cli import algorithm
from grpo_cli.config.schema import AlgoConfig
from grpo_cli.rewards import Outcomes
from grpo_cli.rollout import Generation, Rollout
from grpo_cli.rollout import rows as row_ops
from grpo_cli.step import distributed


@dataclass
class Scores:
    """The rewards of one step's completions."""

    totals: torch.Tensor             # [N] weighted sum over the reward functions
    per_function: dict[str, list[float | None]]  # None: the function does not apply to that completion
    errors: int                      # reward calls that raised (reward.on_error=zero)
    outcomes: dict[str, Outcomes] = field(default_factory=dict)  # of the functions that give them (rewards.Scored)
    failures: list[str | None] | None = None  # per completion: what failed under on_error=zero, or None
    logged: dict[str, tuple[float, int]] = field(default_factory=dict)  # their log_metric: sum, calls
    extra: dict[str, list] = field(default_factory=dict)  # their log_extra columns, a value per completion


@dataclass
class Batch:
    """One step's rollouts, scored, ready for the loss; its per-row fields are declared as the Rollout's are."""

    rollout: Rollout = row_ops.nested()
    prompts: list[str] = row_ops.per_row()
    rewards: torch.Tensor = row_ops.per_row()               # [N]
    per_function: dict[str, list[float | None]] = row_ops.per_row_dict()
    advantages: torch.Tensor = row_ops.per_row()            # [N]
    mask: torch.Tensor = row_ops.per_token()                # [N, T] float: completion tokens that count in the loss
    reward_errors: int = row_ops.summed(default=0)
    stats: dict = field(default_factory=dict)
    outcomes: dict[str, Outcomes] = row_ops.per_row_dict(default_factory=dict)  # of the rewards that say them
    reward_failures: list[str | None] | None = row_ops.per_row(default=None)  # what each of reward_errors was
    logged: dict[str, tuple[float, int]] = field(default_factory=dict)  # log_metric's sums (a draw's: the first's)
    extra: dict[str, list] = row_ops.per_row_dict(default_factory=dict)  # their log_extra columns, to samples.jsonl

    def select_groups(self, groups: list[int]) -> Batch:
        """The batch of the given groups, in that order (rows stay grouped)."""
        G = self.rollout.group_size
        return row_ops.select(self, [g * G + i for g in groups for i in range(G)], groups)


@dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer update in the (reordered) batch, its micro-batches, and its size over all ranks."""

    rows: slice
    micro: list[slice]
    rows_total: float
    tokens_total: float
    micro_total: float


def make_batch(generation: Generation, scores: Scores, algo: AlgoConfig, device) -> Batch:
    """The step's Batch: the group advantages of its rewards, and the completion tokens that count in the loss:
    the model's own (an episode's tool tokens never count), less the truncated completions' with
    algo.mask_truncated."""
    roll = generation.rollout
    mask = roll.loss_mask().float()
    if algo.mask_truncated:
        mask = mask * (~roll.truncated).float().unsqueeze(1)
    advantages = algorithm.advantages_of(algo.advantage, scores.totals, algo.num_generations, eps=algo.adv_eps,
                                         scale=algo.scale_rewards, lengths=mask.sum(1))
    return Batch(roll, generation.prompts, scores.totals, scores.per_function, advantages.to(device), mask,
                 scores.errors, stats=generation.stats, outcomes=scores.outcomes,
                 reward_failures=scores.failures, logged=scores.logged, extra=scores.extra)


def mini_batch_groups(num_groups: int, mini_batches: int) -> list[list[int]]:
    """Groups of each mini-batch: group g goes to mini-batch g mod mini_batches."""
    return [list(range(j, num_groups, mini_batches)) for j in range(mini_batches)]


def mini_batch_layout(batch: Batch, algo: AlgoConfig, micro_batches: Callable[[Batch, slice], list[slice]],
                      dist: distributed.Dist, device) -> tuple[Batch, list[MiniBatch]]:
    """The batch reordered so that each mini-batch is a run of rows, and the mini-batches with their micro-batches
    (`micro_batches(batch, rows)`) and sizes over all ranks (one all-reduce)."""
    G, mini = algo.num_generations, algo.mini_batches
    groups = mini_batch_groups(batch.rewards.numel() // G, mini)
    ordered = batch if mini == 1 else batch.select_groups([g for part in groups for g in part])
    spans, start = [], 0
    for part in groups:
        spans.append(slice(start, start + len(part) * G))
        start += len(part) * G
    micro = [micro_batches(ordered, rows) for rows in spans]
    local = [[float(rows.stop - rows.start), float(ordered.mask[rows].sum()), float(len(parts))]
             for rows, parts in zip(spans, micro, strict=True)]
    total = distributed.sum_floats([x for counts in local for x in counts], dist, device)
    return ordered, [MiniBatch(rows, parts, *total[3 * j:3 * j + 3])
                     for j, (rows, parts) in enumerate(zip(spans, micro, strict=True))]
