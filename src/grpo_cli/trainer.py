"""The GRPO step loop (docs/algorithm.md, section 6) and the only place that calls backward.

    generate: prompts -> completions (adapter on) -> score: rewards -> advantages: group advantages, loss mask
    -> update: ref log-probs (adapter off) -> old log-probs (adapter on; only when off-policy) -> for each pass, for each mini-batch:
       (for each micro-batch: log-probs with grad -> policy_loss -> backward) -> sum over ranks -> clip
       -> optimizer step -> scheduler step

A step's rollout batch is split into `algo.mini_batches` mini-batches of whole groups, each one optimizer
update; `algo.num_iterations` passes go over them. Group g goes to mini-batch g mod mini_batches, so a
mini-batch holds the same groups whatever the number of ranks (each rank's share of the step's prompts
starts at a multiple of mini_batches). The scheduler counts optimizer updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from grpo_cli import algorithm, checkpoint, distributed, dynamic_sampling, rundir
from grpo_cli.checkpoint import restore_rng, rng_snapshot
from grpo_cli.data import PromptSampler, load_rows
from grpo_cli.errors import Interrupted, InvariantError
from grpo_cli.evaluate import final_eval_on
from grpo_cli.metrics import FINAL_EVAL, final_mean, read_metrics
from grpo_cli.models import LoadedModel, enable_activation_checkpointing, load_policy, load_within_context
from grpo_cli.optim import build_optimizer
from grpo_cli.rewards import RewardSet
from grpo_cli.rewards.aggregation import present_mean
from grpo_cli.rollout import Rollout, completion_logprobs, encode_prompts, make_engine, sampling_options
from grpo_cli.stopping import StopRequest
from grpo_cli.tracking import Tracker, open_tracker


@dataclass
class Generation:
    """One step's completions on this rank, not yet scored."""

    rollout: Rollout
    rows: list[dict]                 # the data row of each prompt
    prompts: list[str]               # the prompt text of each completion (G per prompt)
    stats: dict                      # generation timing and prompt counts, for the metrics


@dataclass
class Scores:
    """The rewards of one step's completions."""

    totals: torch.Tensor             # [N] weighted sum over the reward functions
    per_function: dict[str, list[float]]
    errors: int                      # reward calls that raised (reward.on_error=zero)


@dataclass
class Batch:
    """One step's rollouts, scored, ready for the loss."""

    rollout: Rollout
    prompts: list[str]
    rewards: torch.Tensor            # [N]
    per_function: dict[str, list[float]]
    advantages: torch.Tensor         # [N]
    mask: torch.Tensor               # [N, T] float: completion tokens that count in the loss
    reward_errors: int = 0
    stats: dict = field(default_factory=dict)

    def select_groups(self, groups: list[int]) -> Batch:
        """The batch of the given groups, in that order (rows stay grouped)."""
        roll, G = self.rollout, self.rollout.group_size
        rows = [g * G + i for g in groups for i in range(G)]

        def take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
            return t[torch.tensor(index, dtype=torch.long, device=t.device)]

        rollout = dataclasses.replace(
            roll, prompt_ids=take(roll.prompt_ids, groups), prompt_mask=take(roll.prompt_mask, groups),
            completion_ids=take(roll.completion_ids, rows), completion_mask=take(roll.completion_mask, rows),
            truncated=take(roll.truncated, rows), texts=[roll.texts[i] for i in rows])
        return dataclasses.replace(
            self, rollout=rollout, prompts=[self.prompts[i] for i in rows], rewards=take(self.rewards, rows),
            per_function={k: [v[i] for i in rows] for k, v in self.per_function.items()},
            advantages=take(self.advantages, rows), mask=take(self.mask, rows))


@dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer update in the (reordered) batch, its micro-batches, and its size over all ranks."""

    rows: slice
    micro: list[slice]
    rows_total: float
    tokens_total: float
    micro_total: float


@dataclass
class UpdateSums:
    """Sums over the micro-batches of one optimizer update; `reduced` adds them up over the ranks."""

    loss: float = 0.0          # sum of weight x micro-batch loss: the update's aggregated loss
    tokens: float = 0.0
    ratio: float = 0.0         # the rest are token-weighted sums
    kl: float = 0.0
    entropy: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    all_entropy: float = 0.0   # token-weighted entropy on every pass (the adaptive entropy coefficient reads it)

    def reduced(self, dist: distributed.Dist, device) -> UpdateSums:
        names = [f.name for f in dataclasses.fields(self)]
        return UpdateSums(*distributed.sum_floats([getattr(self, n) for n in names], dist, device))

    def __add__(self, other: UpdateSums) -> UpdateSums:
        return UpdateSums(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def mean(self, name: str) -> float:
        """Token mean of a token-weighted sum (without tokens: 1 for the ratio, 0 for the rest)."""
        return getattr(self, name) / self.tokens if self.tokens else (1.0 if name == "ratio" else 0.0)


@dataclass(frozen=True)
class StepStats:
    """What one step's optimizer updates measured, over all ranks: the typed record behind the metrics."""

    loss: float                # mean over the updates of each update's aggregated loss
    grad_norm: float           # mean over the updates of the gradient norm before clipping
    kl: float                  # token means over the first pass (each mini-batch at its update's policy)
    entropy: float
    clip_low: float            # token shares over every update of the step
    clip_high: float
    first_ratio: float         # mean ratio on the first mini-batch of the first pass
    first_kl: float            # its KL
    max_logp: float            # largest completion log-prob of the first pass on this rank
    updates: int               # optimizer updates taken (skipped non-finite ones included)

    @property
    def clip_fraction(self) -> float:
        return self.clip_low + self.clip_high


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mini_batch_groups(num_groups: int, mini_batches: int) -> list[list[int]]:
    """Groups of each mini-batch: group g goes to mini-batch g mod mini_batches."""
    return [list(range(j, num_groups, mini_batches)) for j in range(mini_batches)]


def lr_lambda(schedule: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


class GRPOTrainer:
    """Owns the objects a run needs; `step()` is one GRPO step (its optimizer updates), `fit()` the whole run.

    The config is validated before (config.validate: under torchrun it knows the real number of ranks).
    `make_evaluator(lm)` builds the evaluator of `eval.every` from the loaded model. Warnings go through
    errors.warn (the run's console while it logs)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, lm: LoadedModel | None = None, rows: list[dict] | None = None,
                 stop: StopRequest | None = None, *, make_evaluator: Callable[[LoadedModel], Callable] | None = None,
                 final_eval: bool | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.algo, self.roll, self.tcfg = cfg.algo, cfg.rollout, cfg.trainer
        # this rank's GPU is bound and the process group joined before anything touches CUDA or loads a model
        self.dist, device = distributed.setup(self.tcfg.device if lm is None else str(lm.device))
        self.stop = stop or StopRequest()
        seed_everything(self.tcfg.seed)
        rows = rows if rows is not None else load_rows(cfg.data, split="train", seed=self.tcfg.seed)  # bad data fails before the model loads
        self.sampler = PromptSampler(rows, cfg.data.prompts_per_step, self.tcfg.seed)
        # eval.final resolved (auto: in a sweep) by the CLI, which knows; a trainer built by hand is a single run
        self.final_eval = final_eval_on(cfg, multirun=False) if final_eval is None else final_eval
        evaluates = bool(cfg.eval.every) or self.final_eval
        lengths = ("rollout.max_new_tokens", *(("eval.max_new_tokens",) if evaluates else ()))
        self.lm = load_within_context(cfg, lengths, lambda: lm or load_policy(cfg.model, device, seed=self.tcfg.seed))
        self.model, self.tokenizer = self.lm.model, self.lm.tokenizer
        if self.tcfg.get("gradient_checkpointing"):
            enable_activation_checkpointing(self.model)
        self.engine = make_engine(self.roll, self.lm, max_prompt_tokens=cfg.data.max_prompt_tokens)
        self.rewards = RewardSet.from_config(cfg.reward, device=self.lm.device, dtype=self.lm.dtype, stop=self.stop)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        opt = cfg.optimizer
        self.optimizer = build_optimizer(self.params, opt)
        # the scheduler counts optimizer updates; warmup and max_steps are in training steps
        per_step = self.algo.mini_batches * self.algo.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(opt.schedule, opt.warmup_steps * per_step, self.tcfg.max_steps * per_step))
        self.eps_high = self.algo.clip_eps_high if self.algo.clip_eps_high is not None else self.algo.clip_eps
        self.fresh_adapter = True
        self.zero_std_streak, self.warned_zero_std = 0, False
        self.truncated_streak, self.warned_truncated = 0, False
        self.entropy_control = algorithm.adaptive_entropy(self.algo)
        self.skipped_in_a_row = 0
        self.skipped_updates = 0
        self.evaluator = make_evaluator(self.lm) if make_evaluator is not None and evaluates else None
        self.last_eval: tuple[int, dict] | None = None  # (complete steps, result) of the newest eval.every eval
        self.last_checkpoint: tuple[int, Path] | None = None  # (complete steps, folder) of the newest one

    # ---- one step -------------------------------------------------------------------------------
    def generate(self, step: int, draw: int = 0) -> Generation | None:
        """This rank's share of the step's prompts and their G completions each; None when a stop request
        ended generation. `draw` > 0: a further round of algo.filter_groups (dynamic_sampling.py)."""
        G = self.algo.num_generations
        rows = self.sampler.batch(step) if not draw else \
            dynamic_sampling.extra_prompts(self.sampler, step, draw, self.algo.filter_max_draws)
        if self.dist.enabled:  # whole groups per rank: the rank's contiguous share of the step's prompts
            share = len(rows) // self.dist.world_size
            rows = rows[self.dist.rank * share:(self.dist.rank + 1) * share]
        enc = encode_prompts(self.tokenizer, rows, self.cfg.data.max_prompt_tokens, self.cfg.data.get("overlong", "truncate"))
        if not enc.ids:
            raise InvariantError(f"every prompt of step {step} is over data.max_prompt_tokens={self.cfg.data.max_prompt_tokens} "
                                 "and was dropped; raise it or use data.overlong=truncate")
        rows = [rows[i] for i in enc.kept]
        # sampling depends on (seed, step, rank) only: exact resume
        torch.manual_seed(self.tcfg.seed * 100_003 + step * 1_009 + self.dist.rank + draw * dynamic_sampling.DRAW_SEED)
        t0, compile_before = time.perf_counter(), self.engine.compile_s
        roll = self.engine.generate(enc.ids, G, max_new_tokens=self.roll.max_new_tokens,
                                    min_new_tokens=self.roll.min_new_tokens, **sampling_options(self.roll),
                                    stop=self.stop)
        if roll.interrupted:
            return None
        compile_s = self.engine.compile_s - compile_before  # paid once per run (per cache shape), kept apart
        gen_time = time.perf_counter() - t0 - compile_s
        gen_tokens = int(roll.completion_mask.sum())
        return Generation(roll, rows, [text for text in enc.texts for _ in range(G)], stats={
            "gen_time_s": gen_time, "gen_tokens_per_s": gen_tokens / max(gen_time, 1e-9),
            "prompts_truncated": enc.truncated, "prompts_dropped": enc.dropped, "gen_compile_s": compile_s,
        })

    def score(self, generation: Generation) -> Scores | None:
        """Every reward function on every completion, with the fields of its prompt's data row; None when a stop
        request came while a reward function ran."""
        G = self.algo.num_generations
        fields = {k: [row[k] for row in generation.rows for _ in range(G)] for k in generation.rows[0]}  # messages: only for rewards naming it
        try:
            totals, per_function, errors = self.rewards.score(generation.prompts, generation.rollout.texts, fields,
                                                              group_size=G)
        except Interrupted:
            return None
        return Scores(torch.tensor(totals, dtype=torch.float32), per_function, errors)

    def advantages(self, generation: Generation, scores: Scores) -> Batch:
        """Group advantages of the rewards, and the completion tokens that count in the loss."""
        roll = generation.rollout
        mask = roll.completion_mask.float()
        if self.algo.mask_truncated:
            mask = mask * (~roll.truncated).float().unsqueeze(1)
        advantages = algorithm.advantages_of(self.algo.get("advantage", "grpo"), scores.totals, self.algo.num_generations,
                                             eps=self.algo.adv_eps, scale=self.algo.scale_rewards, lengths=mask.sum(1))
        return Batch(roll, generation.prompts, scores.totals, scores.per_function, advantages.to(self.lm.device), mask,
                     scores.errors, stats=generation.stats)

    @property
    def off_policy(self) -> bool:
        """More than one optimizer update per rollout batch: old log-probs are needed and clipping acts."""
        return self.algo.mini_batches > 1 or self.algo.num_iterations > 1

    def micro_batches(self, rows: slice) -> list[slice]:
        size = self.tcfg.micro_batch_size or (rows.stop - rows.start)
        return [slice(i, min(i + size, rows.stop)) for i in range(rows.start, rows.stop, max(1, size))]

    def _logprobs(self, batch: Batch, rows: slice, *, grad: bool, with_entropy: bool = False):
        with torch.set_grad_enabled(grad):
            return completion_logprobs(self.model, batch.rollout, rows, self.roll.temperature,
                                       self.tcfg.logprob_chunk_size, with_entropy)

    @torch.no_grad()
    def _no_grad_logprobs(self, batch: Batch, parts: list[slice], adapter: bool) -> torch.Tensor:
        """Old (adapter on) or reference (adapter off: the frozen base) log-probs of the whole batch."""
        with contextlib.nullcontext() if adapter else self.model.disable_adapter():
            return torch.cat([self._logprobs(batch, s, grad=False)[0] for s in parts])

    def plan(self, batch: Batch) -> tuple[Batch, list[MiniBatch]]:
        """The batch reordered so that each mini-batch is a run of rows, and the mini-batches with their
        micro-batches and sizes over all ranks (one all-reduce)."""
        G, mini = self.algo.num_generations, self.algo.mini_batches
        groups = mini_batch_groups(batch.rewards.numel() // G, mini)
        ordered = batch if mini == 1 else batch.select_groups([g for part in groups for g in part])
        spans, start = [], 0
        for part in groups:
            spans.append(slice(start, start + len(part) * G))
            start += len(part) * G
        micro = [self.micro_batches(rows) for rows in spans]
        local = [[float(rows.stop - rows.start), float(ordered.mask[rows].sum()), float(len(parts))]
                 for rows, parts in zip(spans, micro, strict=True)]
        total = distributed.sum_floats([x for counts in local for x in counts], self.dist, self.lm.device)
        return ordered, [MiniBatch(rows, parts, *total[3 * j:3 * j + 3])
                         for j, (rows, parts) in enumerate(zip(spans, micro, strict=True))]

    def backward(self, batch: Batch, mini: MiniBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                 first_pass: bool) -> tuple[UpdateSums, float]:
        """Accumulate the gradient of one mini-batch on this rank, micro-batch by micro-batch; returns this
        rank's sums and the largest completion log-prob it saw (entropy and KL on the first pass only)."""
        sums, max_logp = UpdateSums(), -math.inf
        for rows in mini.micro:
            logp, entropy = self._logprobs(batch, rows, grad=True,
                                           with_entropy=first_pass or algorithm.needs_entropy(self.algo))
            mask, aggregation = batch.mask[rows], algorithm.aggregation_of(self.algo)
            loss, stats = algorithm.policy_loss(
                logp, None if old is None else old[rows], None if ref is None else ref[rows],
                batch.advantages[rows], mask, beta=self.algo.beta, eps_low=self.algo.clip_eps,
                eps_high=self.eps_high, loss_type=aggregation, ratio_level=self.algo.ratio_level,
                max_new_tokens=self.roll.max_new_tokens, total_tokens=mini.tokens_total, entropy=entropy,
                settings=algorithm.loss_settings(self.algo, self.entropy_control and self.entropy_control.applied),
            )
            weight = algorithm.accumulation_weight(aggregation, rows=rows.stop - rows.start,
                                                   rows_total=mini.rows_total, micro_batches_total=mini.micro_total)
            total = algorithm.accumulated(loss, stats, weight, mini.micro_total)
            total.backward()
            k = float(stats["num_tokens"])
            bonus = float(stats["entropy_bonus"])  # already in loss; accumulated weighs it by 1 / micro-batches
            sums.loss += float(loss.detach()) * weight + bonus * (weight - 1 / max(1.0, mini.micro_total))
            sums.all_entropy += float((entropy.detach() * mask).sum()) if entropy is not None else 0.0
            sums.tokens += k
            sums.ratio += float(stats["ratio_mean"]) * k
            sums.clip_low += float(stats["clip_fraction/low"]) * k
            sums.clip_high += float(stats["clip_fraction/high"]) * k
            if first_pass:
                sums.kl += float(stats["kl"]) * k
                sums.entropy += float((entropy.detach() * mask).sum())
                real = mask.bool()
                if real.any():
                    max_logp = max(max_logp, float(logp.detach()[real].max()))
        return sums, max_logp

    def optimizer_step(self, step: int, loss: float) -> float:
        """Clip and apply the summed gradient, or skip it when it is not finite (stopping after
        trainer.max_skipped in a row); the scheduler advances either way. Returns the norm before clipping."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.max_grad_norm))
        if math.isfinite(grad_norm) and math.isfinite(loss):
            self.optimizer.step()
            self.engine.policy_changed()
            self.skipped_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.tcfg.max_skipped:
                raise InvariantError(f"{self.skipped_in_a_row} non-finite updates in a row at step {step} "
                                     f"(loss {loss}, grad norm {grad_norm}); lower optimizer.lr or check the rewards")
        self.scheduler.step()
        return grad_norm

    def update(self, step: int, batch: Batch) -> StepStats:
        """Every optimizer update of one step: `num_iterations` passes over the mini-batches."""
        self.model.train()
        ordered, plan = self.plan(batch)
        parts = [rows for mini in plan for rows in mini.micro]
        ref = self._no_grad_logprobs(ordered, parts, adapter=False) if self.algo.beta > 0 else None
        old = self._no_grad_logprobs(ordered, parts, adapter=True) if self.off_policy else None
        totals, first, max_logp, losses, grad_norms = UpdateSums(), None, -math.inf, [], []
        for iteration in range(self.algo.num_iterations):
            for mini in plan:
                if not mini.rows_total:  # all its groups were dropped (data.overlong=drop): nothing to learn
                    self.scheduler.step()
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                local, local_max_logp = self.backward(ordered, mini, old, ref, first_pass=iteration == 0)
                distributed.sum_gradients(self.params, self.dist)
                sums = local.reduced(self.dist, self.lm.device)
                if first is None:
                    first = sums
                    if self.algo.check:
                        self.check_first_update(step, sums, on_policy=old is None)
                grad_norms.append(self.optimizer_step(step, sums.loss))
                if self.entropy_control is not None:
                    self.entropy_control.update(sums.mean("all_entropy"))
                losses.append(sums.loss)
                totals, max_logp = totals + sums, max(max_logp, local_max_logp)
        first = first or UpdateSums()
        self.fresh_adapter = False  # updated now: the policy has left the reference
        first_pass_tokens = max(1.0, sum(mini.tokens_total for mini in plan))  # kl, entropy: first pass only
        return StepStats(
            loss=sum(losses) / max(1, len(losses)), grad_norm=sum(grad_norms) / max(1, len(grad_norms)),
            kl=totals.kl / first_pass_tokens, entropy=totals.entropy / first_pass_tokens,
            clip_low=totals.mean("clip_low"), clip_high=totals.mean("clip_high"),
            first_ratio=first.mean("ratio"), first_kl=first.mean("kl"), max_logp=max_logp, updates=len(losses))

    def stop_agreed(self, local: bool) -> bool:
        """True on every rank when any rank was asked to stop (ranks stop at the same point)."""
        return distributed.sum_floats([float(local)], self.dist, self.lm.device)[0] > 0

    def step(self, step: int) -> tuple[dict, Batch] | None:
        """One GRPO update; None when a stop request came before the update began (the step is discarded,
        nothing of it has touched the weights, the optimiser or the logs)."""
        t0 = time.perf_counter()
        if self.algo.get("filter_groups"):
            batch = dynamic_sampling.filtered_batch(self, step)  # None: a stop request came first
        else:
            generation, batch = self.generate(step), None
            scores = None if generation is None else self.score(generation)  # None: a stop request came first
            if scores is not None:
                batch = self.advantages(generation, scores)
        if self.stop_agreed(batch is None or self.stop()):
            return None
        stats = self.update(step, batch)
        if self.algo.check:
            self.check_invariants(step, batch, stats)
        metrics = self.metrics(step, batch, stats, time.perf_counter() - t0)
        return metrics, batch

    # ---- bookkeeping ----------------------------------------------------------------------------
    def metrics(self, step: int, batch: Batch, stats: StepStats, seconds: float) -> dict:
        G = self.algo.num_generations
        r = batch.rewards
        lengths = batch.rollout.completion_mask.sum(dim=1).float()
        row = {
            "step": step,
            "reward": float(r.mean()),
            "reward_std": algorithm.group_std_mean(r, G),
            **{f"reward/{name}": present_mean(v) for name, v in batch.per_function.items()},
            "frac_reward_zero_std": algorithm.zero_std_group_fraction(r, G),
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            "clip_fraction/low": stats.clip_low,
            "clip_fraction/high": stats.clip_high,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "entropy": stats.entropy,
            "completion_len": float(lengths.mean()),
            "truncated_frac": float(batch.rollout.truncated.float().mean()),
            "lr": self.scheduler.get_last_lr()[0],
            "step_time_s": seconds,
            "gen_tokens_per_s": batch.stats["gen_tokens_per_s"],
            "gen_time_s": batch.stats["gen_time_s"],
            "gen_compile_s": batch.stats.get("gen_compile_s", 0.0),
            "reward_errors": batch.reward_errors,
            "skipped_updates": self.skipped_updates,
            "prompts_truncated": batch.stats["prompts_truncated"],
            "prompts_dropped": batch.stats["prompts_dropped"],
            **{k: v for k, v in batch.stats.items() if k.startswith("filter_")},
        }
        if self.dist.enabled:  # every rank has as many rows: rank means average exactly; counts add up
            summed = ("gen_tokens_per_s", "reward_errors", "prompts_truncated", "prompts_dropped")
            averaged = ["reward", "reward_std", "frac_reward_zero_std", "completion_len", "truncated_frac",
                        *(k for k in row if k.startswith("reward/"))]
            keys = [*averaged, *summed]
            totals = distributed.sum_floats([float(row[k]) for k in keys], self.dist, self.lm.device)
            for k, v in zip(keys, totals, strict=True):
                row[k] = v if k in summed else v / self.dist.world_size
        return row

    def check_first_update(self, step: int, first: UpdateSums, on_policy: bool) -> None:
        """The first update of a step starts from the policy that sampled the rollout: ratio 1 (when there is
        an old pass to compare with) and, at step 0 with a fresh adapter, the reference policy: KL 0."""
        ratio, kl = first.mean("ratio"), first.mean("kl")
        if not on_policy and abs(ratio - 1.0) > 1e-3:
            raise InvariantError(f"invariant 'ratio == 1 on the first mini-batch of the first pass' failed at step "
                                 f"{step}: mean ratio {ratio:.6f}")
        if self.fresh_adapter and self.algo.beta > 0 and kl > 1e-6:
            raise InvariantError(f"invariant 'KL == 0 with a fresh adapter' failed at step {step} (first mini-batch): "
                                 f"kl {kl:.3e}")

    def check_invariants(self, step: int, batch: Batch, stats: StepStats) -> None:
        G = self.algo.num_generations
        if stats.max_logp > 1e-5:
            raise InvariantError(f"invariant 'logp <= 0' failed at step {step}: max logp {stats.max_logp:.3e}")
        group_sums = batch.advantages.detach().float().view(-1, G).sum(dim=1).abs().max()
        if algorithm.ADVANTAGES[self.algo.get("advantage", "grpo")].zero_sum_groups and float(group_sums) > 1e-3:
            raise InvariantError(f"invariant 'advantages sum to 0 per group' failed at step {step}: max |sum| {float(group_sums):.2e}")

    def save_samples(self, tracker: Tracker, step: int, batch: Batch) -> None:
        every = self.tcfg.log_samples_every
        if not every or step % every:
            return
        rows = []
        for i, text in enumerate(batch.rollout.texts):
            rows.append({"prompt": batch.prompts[i], "completion": text, "reward": float(batch.rewards[i]),
                         "advantage": float(batch.advantages[i]),
                         **{f"reward/{k}": v[i] for k, v in batch.per_function.items()}})
        tracker.samples(step, rows)

    # ---- the run --------------------------------------------------------------------------------
    def fit(self) -> dict:
        """The whole run: resume, the steps (each evaluated, logged, checkpointed on schedule), the adapter, the
        summary. A stop request (SIGINT/SIGTERM) during generation discards the step in progress; during the
        update the step finishes; either way the state after the last complete step is checkpointed."""
        start = self.resume()
        if self.dist.is_main:  # a final eval of an earlier attempt does not describe this one's weights
            (self.run_dir / FINAL_EVAL).unlink(missing_ok=True)
        tracker = self.open_tracker(start)
        t_start = time.time()
        # the CLI installs the handlers for the whole run (model load included); a bare fit() does it here
        with contextlib.nullcontext() if self.stop.installed_now else self.stop.installed():
            last_complete = rng_snapshot()
            for step in range(start, self.tcfg.max_steps):
                result = self.step(step)
                if result is None:  # stopped before the update: checkpoint the state after `step` complete steps
                    restore_rng(last_complete)
                    raise Interrupted(self.stop.signum or signal.SIGTERM, self.checkpoint_at(step),
                                      completed=step, discarded=True)
                self.record(tracker, step, *result)
                last_complete = rng_snapshot()
                self.checkpoint_if_due(step + 1)
            adapter_dir = self.save_adapter()
            final_eval = self.final_evaluation(tracker)  # polls the stop request too
        return self.finish(tracker, adapter_dir, time.time() - t_start, final_eval)

    def resume(self) -> int:
        """Restore the newest checkpoint when trainer.resume asks for one; returns the step to start at."""
        if not self.tcfg.get("resume"):
            return 0
        found = checkpoint.find(self.run_dir, str(self.tcfg.resume))
        if found is None:
            return 0
        state = checkpoint.load(found, self.model, self.optimizer, self.scheduler)
        start = state["step"]
        self.last_checkpoint = (start, found)
        self.skipped_updates = state.get("skipped_updates", 0)
        if self.entropy_control is not None:
            self.entropy_control.restore(state)
        self.fresh_adapter = start == 0
        if self.dist.is_main:
            rundir.roll_back_records(self.run_dir, start, found)
        return start

    def open_tracker(self, start: int) -> Tracker:
        """Rank 0 logs (metrics.jsonl, the logger's sink, the console); the other ranks' tracker has no sinks."""
        if not self.dist.is_main:
            return Tracker([])
        return open_tracker(self.run_dir, self.cfg.logger, OmegaConf.to_container(self.cfg, resolve=True),
                            self.tcfg.max_steps, start, resume=bool(self.tcfg.get("resume")))

    def record(self, tracker: Tracker, step: int, metrics: dict, batch: Batch) -> None:
        """Everything a finished step leaves behind but the checkpoint: warnings, eval, metrics, samples."""
        self.track_zero_std(metrics, tracker)
        self.truncated_streak, warning = algorithm.truncation_warning(metrics, self.truncated_streak, self.warned_truncated)
        if warning:
            self.warned_truncated = True
            metrics["warning"] = f"{metrics['warning']}; {warning}" if "warning" in metrics else warning
            tracker.warn(warning)
        every = self.cfg.eval.every
        if self.evaluator is not None and every and (step + 1) % every == 0:
            if self.dist.is_main:
                tracker.say(f"evaluating after step {step + 1} on the held-out prompts")
                try:
                    result = self.evaluator(self.engine, stop=self.stop)
                    metrics.update(result)
                    self.last_eval = (step + 1, result)
                except Interrupted:
                    tracker.warn(f"evaluation after step {step + 1} was stopped; its metrics are left out")
            distributed.barrier(self.dist)
        tracker.log(metrics)
        self.save_samples(tracker, step, batch)

    def checkpoint_if_due(self, done: int) -> None:
        """Checkpoint every trainer.save_every steps, and on a stop request that came during the update (the
        step was finished; then raise Interrupted). Every rank stops at the same step."""
        stopping = self.stop_agreed(self.stop())
        every = self.tcfg.save_every
        if (every and done % every == 0) or stopping:
            ckpt = self.save_checkpoint(done)
            if stopping:
                raise Interrupted(self.stop.signum or signal.SIGTERM, ckpt, completed=done)

    def final_evaluation(self, tracker: Tracker) -> dict | None:
        """eval.final: the greedy eval of the trained policy on the held-out prompts, written to final_eval.json
        (rank 0; None elsewhere or when off). An eval.every eval after the last step is reused: same prompts, same
        weights, greedy. A stop request here raises Interrupted with a checkpoint after the last step, whose
        resume runs only this eval."""
        if not self.final_eval or self.evaluator is None:
            return None
        steps = self.tcfg.max_steps
        result = None
        if self.dist.is_main:
            if self.last_eval is not None and self.last_eval[0] == steps:
                result = self.last_eval[1]
            else:
                tracker.say("final evaluation on the held-out prompts (eval.final)")
                try:
                    result = self.evaluator(self.engine, stop=self.stop)
                except Interrupted:
                    raise Interrupted(self.stop.signum or signal.SIGTERM, self.checkpoint_at(steps),
                                      completed=steps) from None
            result = {"step": steps, **result}
            rundir.replace_text(self.run_dir / FINAL_EVAL, json.dumps(result, indent=2) + "\n")
        distributed.barrier(self.dist)
        return result

    def finish(self, tracker: Tracker, adapter_dir: Path, seconds: float, final_eval: dict | None = None) -> dict:
        """The run's summary (rank 0: from metrics.jsonl, so a resumed run counts every step once)."""
        if not self.dist.is_main:
            return {"final_reward": float("nan"), "adapter": str(adapter_dir)}
        rewards = [row["reward"] for row in read_metrics(self.run_dir / "metrics.jsonl")]
        summary = {
            "steps": len(rewards),
            "first_reward": sum(rewards[:10]) / max(1, len(rewards[:10])),
            "last_reward": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
            "final_reward": final_mean(rewards),
            **({"final_eval_accuracy": final_eval["eval/accuracy"]} if final_eval else {}),
            "time_s": seconds,
            "adapter": str(adapter_dir),
        }
        tracker.close(summary)
        return summary

    def track_zero_std(self, metrics: dict, tracker: Tracker) -> None:
        self.zero_std_streak = self.zero_std_streak + 1 if metrics["frac_reward_zero_std"] > 0.9 else 0
        if self.zero_std_streak >= 10 and not self.warned_zero_std:
            self.warned_zero_std = True
            text = ("frac_reward_zero_std > 0.9 for 10 steps in a row: almost every group has equal rewards, so there "
                    "is no learning signal; make the task easier, raise algo.num_generations or rollout.temperature")
            metrics["warning"] = text
            tracker.warn(text)

    def checkpoint_at(self, done: int) -> Path:
        """A checkpoint of the state after `done` complete steps: the one this run last wrote or resumed from
        when it is that state, else a new one (weights, optimiser and RNG are still those after `done`)."""
        if self.last_checkpoint is not None and self.last_checkpoint[0] == done \
                and self.last_checkpoint[1].parent == checkpoint.checkpoint_root(self.run_dir):
            return self.last_checkpoint[1]
        return self.save_checkpoint(done)

    def save_checkpoint(self, done: int) -> Path:
        path = checkpoint.step_dir(self.run_dir, done)
        if self.dist.is_main:
            path = checkpoint.save(self.run_dir, done, self.model, self.optimizer, self.scheduler,
                                   {"skipped_updates": self.skipped_updates, "fingerprint": rundir.fingerprint(self.cfg),
                                    **(self.entropy_control.state() if self.entropy_control else {})},
                                   self.tcfg.keep_last)
        distributed.barrier(self.dist)
        self.last_checkpoint = (done, path)
        return path

    def save_adapter(self) -> Path:
        for p in self.params:
            if not torch.isfinite(p).all():
                raise InvariantError("the adapter holds non-finite weights; it was not written (lower optimizer.lr)")
        out = self.run_dir / "adapter"
        if self.dist.is_main:
            self.model.save_pretrained(out, save_embedding_layers=False)  # LoRA weights only; the base is not resized
        distributed.barrier(self.dist)
        return out
