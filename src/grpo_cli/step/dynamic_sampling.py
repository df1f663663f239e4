"""Dynamic sampling (DAPO; verl's `algorithm.filter_groups`): `algo.filter_groups=true`.

A group whose G rewards all agree has zero advantages and teaches nothing (bar the KL term). With filtering, a
step drops those groups and draws more prompts, G completions each, until `data.prompts_per_step` groups have
signal, in at most `algo.filter_max_draws` generation rounds. At the bound the step trains on the groups with
signal it found, filled up to `data.prompts_per_step` with the first round's zero-signal groups (the batch keeps its
size, so mini-batches and the loss normalisers mean what they say), and counts it (`filter_bound_hit`).

Round 0 is the step's usual batch (`PromptSampler.batch(step)`); round d > 0 takes its prompts from a second
shuffled stream of the training rows at position (step, d) and samples with its own seed, so a step's rounds depend
only on (seed, step): resume stays exact without extra sampler state. Advantages are computed again over the
kept groups (a batch-level estimator sees the batch it trains on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Protocol

import torch

from grpo_cli import algorithm
from grpo_cli.rollout import rows as row_ops
from grpo_cli.tasks.sources import PromptSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.config.schema import AlgoConfig, Config
    from grpo_cli.rollout import Generation
    from grpo_cli.step.batch import Batch, Scores


class Rounds(Protocol):
    """What a step with dynamic sampling asks of the trainer (step/trainer.py's GRPOTrainer, which imports this)."""

    cfg: Config
    algo: AlgoConfig
    tokenizer: PreTrainedTokenizerBase

    def generate(self, step: int, draw: int = 0) -> Generation | None: ...

    def score(self, generation: Generation) -> Scores | None: ...

    def make_batch(self, generation: Generation, scores: Scores) -> Batch: ...


def extra_prompts(sampler: PromptSampler, step: int, draw: int, max_draws: int) -> list[dict]:
    """The prompts of round `draw` >= 1 of `step`: a stream of its own, shuffled with another seed."""
    stream = PromptSampler(sampler.rows, sampler.batch_size, sampler.seed * 31 + 17)
    return stream.batch(step * (max_draws - 1) + draw - 1)


def signal_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal."""
    r = rewards.view(-1, group_size)
    return [g for g in range(r.shape[0]) if not bool((r[g] == r[g, 0]).all())]


def concat_batches(batches: list, pad_token_id: int):
    """One batch of the given batches' groups, in order, every field of theirs and of their rollouts carried
    (rollout/rows.py: prompts left-padded, completions right-padded)."""
    return row_ops.join(batches, pad_token_id)


def filtered_batch(trainer: Rounds, step: int) -> Batch | None:
    """The step's batch with dynamic sampling (see the module docstring); None when a stop request came."""
    algo, G = trainer.algo, trainer.algo.num_generations
    want = trainer.cfg.data.prompts_per_step
    kept: list[Batch] = []
    first: Batch | None = None
    generated, extra_s = 0, 0.0
    for draw in range(algo.filter_max_draws):
        t0 = time.perf_counter()
        generation = trainer.generate(step, draw=draw)
        scores = None if generation is None else trainer.score(generation)
        if generation is None or scores is None:
            return None
        batch = trainer.make_batch(generation, scores)
        extra_s += time.perf_counter() - t0 if draw else 0.0
        first = first or batch
        groups = signal_groups(batch.rewards, G)
        generated += batch.rewards.numel() // G
        kept.append(batch.select_groups(groups[:want - sum(b.rewards.numel() // G for b in kept)]))
        if sum(b.rewards.numel() // G for b in kept) >= want:
            break
    assert first is not None  # algo.filter_max_draws >= 1: round 0 made a batch or returned
    found = sum(b.rewards.numel() // G for b in kept)
    if found < want:  # at the bound: fill with the first round's groups without signal
        quiet = [g for g in range(first.rewards.numel() // G) if g not in signal_groups(first.rewards, G)]
        kept.append(first.select_groups(quiet[:want - found]))
    batch = concat_batches([b for b in kept if b.rewards.numel()], trainer.tokenizer.pad_token_id)
    advantages = algorithm.advantages_of(algo.advantage, batch.rewards, G, eps=algo.adv_eps,
                                         scale=algo.scale_rewards, lengths=batch.mask.sum(1))
    stats = {**first.stats, "filter_dropped_frac": 1.0 - found / max(1, generated), "filter_draws": draw + 1,
             "filter_extra_gen_time_s": extra_s, "filter_bound_hit": float(found < want),
             "filter_groups_with_signal": float(min(found, want))}
    return dataclasses.replace(batch, advantages=advantages.to(batch.advantages.device), stats=stats)
