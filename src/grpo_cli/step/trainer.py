"""The GRPO step loop (docs/algorithm.md, section 6) and the only place that calls backward.

    generate: prompts -> completions (adapter on) -> score: rewards -> advantages: group advantages, loss mask
    -> update: ref log-probs (adapter off) -> old log-probs (adapter on; only when off-policy) -> for each pass,
       for each mini-batch: (for each micro-batch: log-probs with grad -> policy_loss -> backward) -> sum over ranks
       -> clip -> optimizer step -> learning-rate schedule step

A step's rollout batch is split into `algo.mini_batches` mini-batches of whole groups, each one optimizer
update; `algo.num_iterations` passes go over them. Group g goes to mini-batch g mod mini_batches, so a
mini-batch holds the same groups whatever the number of ranks (each rank's share of the step's prompts
starts at a multiple of mini_batches). The learning-rate schedule counts optimizer updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from grpo_cli import algorithm
from grpo_cli.base.errors import Interrupted, InvariantError
from grpo_cli.base.stopping import StopRequest
from grpo_cli.config.rules import is_on_policy
from grpo_cli.config.schema import AlgoConfig, Config
from grpo_cli.model.loading import LoadedModel, load_policy, load_within_context
from grpo_cli.rewards import Outcomes, RewardSet
from grpo_cli.rewards.aggregation import present_mean
from grpo_cli.rewards.columns import check_columns
from grpo_cli.rollout import (
    Generation,
    Rollout,
    completion_logprobs,
    episodes,
    make_engine,
    sampling_options,
    sampling_seed,
)
from grpo_cli.rollout import rows as row_ops
from grpo_cli.step import distributed, dynamic_sampling, memory
from grpo_cli.step.evaluate import final_eval_on
from grpo_cli.step.optim import LRSchedule, build_optimizer
from grpo_cli.tasks.prompts import EncodedPrompts, encode_prompts, where_of
from grpo_cli.tasks.sources import PromptSampler, load_rows


@dataclass
class Scores:
    """The rewards of one step's completions."""

    totals: torch.Tensor             # [N] weighted sum over the reward functions
    per_function: dict[str, list[float]]
    errors: int                      # reward calls that raised (reward.on_error=zero)
    outcomes: dict[str, Outcomes] = field(default_factory=dict)  # of the functions that give them (rewards.Scored)
    failures: list[str | None] | None = None  # per completion: what failed under on_error=zero, or None


@dataclass
class Batch:
    """One step's rollouts, scored, ready for the loss; its per-row fields are declared as the Rollout's are."""

    rollout: Rollout = row_ops.nested()
    prompts: list[str] = row_ops.per_row()
    rewards: torch.Tensor = row_ops.per_row()               # [N]
    per_function: dict[str, list[float]] = row_ops.per_row_dict()
    advantages: torch.Tensor = row_ops.per_row()            # [N]
    mask: torch.Tensor = row_ops.per_token()                # [N, T] float: completion tokens that count in the loss
    reward_errors: int = row_ops.summed(default=0)
    stats: dict = field(default_factory=dict)
    outcomes: dict[str, Outcomes] = row_ops.per_row_dict(default_factory=dict)  # of the rewards that say them
    reward_failures: list[str | None] | None = row_ops.per_row(default=None)  # what each of reward_errors was

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
                 reward_failures=scores.failures)


def mini_batch_groups(num_groups: int, mini_batches: int) -> list[list[int]]:
    """Groups of each mini-batch: group g goes to mini-batch g mod mini_batches."""
    return [list(range(j, num_groups, mini_batches)) for j in range(mini_batches)]


class GRPOTrainer:
    """Owns the objects a step needs; `step()` is one GRPO step (its optimizer updates). A run around the steps
    (its dir, resume, records, checkpoints) is grpo_cli.run.Run's.

    The config is validated before (run.validate: under torchrun it knows the real number of ranks).
    `make_evaluator(lm)` builds the evaluator of `eval.every` and `eval.final` from the loaded model. Warnings go
    through errors.warn (the run's console while it logs)."""

    def __init__(self, cfg: Config, *, lm: LoadedModel | None = None, rows: list[dict] | None = None,
                 stop: StopRequest | None = None, make_evaluator: Callable[[LoadedModel], Callable] | None = None,
                 final_eval: bool | None = None):
        self.cfg, data = cfg, cfg.data
        self.algo, self.roll, self.tcfg = cfg.algo, cfg.rollout, cfg.trainer
        # this rank's GPU is bound and the process group joined before anything touches CUDA or loads a model
        self.dist, device = distributed.setup(self.tcfg.device if lm is None else str(lm.device))
        self.stop = stop or StopRequest()
        seed_everything(self.tcfg.seed)
        if rows is None:  # bad data fails before the model loads
            rows = load_rows(data, split="train", seed=self.tcfg.seed)
        self.sampler = PromptSampler(rows, data.prompts_per_step, self.tcfg.seed)
        self.episodes = episodes.EpisodeRunner.from_config(cfg)  # None: single-turn; a bad tool fails before the load
        check_columns(cfg.reward, rows, episodes.reward_field_names(self.episodes), where=where_of)  # before the load
        # eval.final resolved (auto: in a sweep) by the CLI, which knows; a trainer built by hand is a single run
        self.final_eval = final_eval_on(cfg, multirun=False) if final_eval is None else final_eval
        evaluates = bool(cfg.eval.every) or self.final_eval
        lengths = ("rollout.max_new_tokens", *(("eval.max_new_tokens",) if evaluates else ()))
        self.lm = load_within_context(cfg, lengths, lambda: lm or load_policy(cfg.model, device, seed=self.tcfg.seed))
        self.model, self.tokenizer = self.lm.model, self.lm.tokenizer
        self.engine = make_engine(self.roll, self.lm, max_prompt_tokens=data.max_prompt_tokens)
        self.memory = memory.plan(self.tcfg, self.lm, self.engine, chunk_size=self.tcfg.logprob_chunk_size,
                                  rows=data.prompts_per_step * self.algo.num_generations // self.dist.world_size,
                                  longest_row=data.max_prompt_tokens + self.roll.max_new_tokens)
        self.memory.apply(self.model)  # and with a budget, its line at start-up
        self.rewards = RewardSet.from_config(cfg.reward, device=self.lm.device, dtype=self.lm.dtype, stop=self.stop,
                                             environment=self.episodes and self.episodes.environment_factory)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        opt = cfg.optimizer
        self.optimizer = build_optimizer(self.params, opt)
        self.lr_schedule = LRSchedule(self.optimizer, opt, self.tcfg.max_steps,
                                      updates_per_step=self.algo.mini_batches * self.algo.num_iterations)
        self.fresh_adapter = True
        self.loss_settings = algorithm.loss_settings(self.algo, self.roll.max_new_tokens)
        self.entropy_control = algorithm.adaptive_entropy(self.algo)
        self.sampler_correction = algorithm.SamplerCorrection.of(self.algo)
        self.skipped_in_a_row = self.skipped_updates = 0
        self.evaluator = make_evaluator(self.lm) if make_evaluator is not None and evaluates else None
        self.generation_source = self.generate  # rollout.placement=worker: Run puts the rollout worker's here

    # ---- one step -------------------------------------------------------------------------------
    def prompts(self, step: int, draw: int = 0) -> tuple[list[dict], EncodedPrompts]:
        """This rank's share of the step's kept prompt rows, encoded; `draw` > 0: a round of algo.filter_groups."""
        rows = self.sampler.batch(step) if not draw else \
            dynamic_sampling.extra_prompts(self.sampler, step, draw, self.algo.filter_max_draws)
        if self.dist.enabled:  # whole groups per rank: the rank's contiguous share of the step's prompts
            share = len(rows) // self.dist.world_size
            rows = rows[self.dist.rank * share:(self.dist.rank + 1) * share]
        enc = encode_prompts(self.tokenizer, rows, self.cfg.data.max_prompt_tokens, self.cfg.data.overlong)
        if not enc.ids:
            raise InvariantError(f"every prompt of step {step} is over "
                                 f"data.max_prompt_tokens={self.cfg.data.max_prompt_tokens} "
                                 "and was dropped; raise it or use data.overlong=truncate")
        return [rows[i] for i in enc.kept], enc

    def generate(self, step: int, draw: int = 0) -> Generation | None:
        """The step's prompts (`prompts`) and their G completions each; None when a stop request ended generation."""
        G = self.algo.num_generations
        rows, enc = self.prompts(step, draw)
        torch.manual_seed(sampling_seed(self.tcfg.seed, step, self.dist.rank, draw))  # exact resume
        t0, compile_before = time.perf_counter(), self.engine.compile_s
        options = dict(max_new_tokens=self.roll.max_new_tokens, min_new_tokens=self.roll.min_new_tokens,
                       **sampling_options(self.roll), stop=self.stop)
        with self.memory.generating():
            roll = self.engine.generate(enc.ids, G, **options) if self.episodes is None else self.episodes.run(
                self.engine, self.tokenizer, rows, G, context_length=self.lm.context_length, **options)
        if roll is None or roll.interrupted:  # None: a stop request came while a tool or the environment ran
            return None
        compile_s = self.engine.compile_s - compile_before  # paid once per run (per cache shape), kept apart
        gen_time = time.perf_counter() - t0 - compile_s
        gen_tokens = int(roll.loss_mask().sum())
        return Generation(roll, rows, roll.prompt_texts(enc.texts), stats={
            "gen_time_s": gen_time, "gen_tokens_per_s": gen_tokens / max(gen_time, 1e-9),
            "prompts_truncated": enc.truncated, "prompts_dropped": enc.dropped, "gen_compile_s": compile_s,
            "gen_sync_s": self.engine.sync_s,  # of gen_time_s: bringing the updated policy into the engine
        })

    def score(self, generation: Generation) -> Scores | None:
        """Every reward function (an environment's get_reward() too) on every completion, with the fields of its
        prompt's data row (and the rollout's own reward_fields); None when a stop request came while a reward
        function ran. A row's `messages` go only to the functions that name them (rewards.reward_arguments)."""
        G, roll = self.algo.num_generations, generation.rollout
        fields = {k: [row[k] for row in generation.rows for _ in range(G)] for k in generation.rows[0]}
        try:
            scoring = self.rewards.score_all(generation.prompts, roll.texts, fields | roll.reward_fields(),
                                             group_size=G)
        except Interrupted:
            return None
        return Scores(torch.tensor(scoring.totals), scoring.per_function, scoring.errors, scoring.outcomes,  # float32
                      scoring.failures)

    def make_batch(self, generation: Generation, scores: Scores) -> Batch:
        return make_batch(generation, scores, self.algo, self.lm.device)

    def micro_batches(self, batch: Batch, rows: slice) -> list[slice]:
        """The micro-batches of `rows`: trainer.micro_batch_size rows and the memory plan's tokens at most."""
        return self.memory.micro_batches(batch.rollout, rows, self.tcfg.micro_batch_size)

    def _logprobs(self, batch: Batch, rows: slice, *, grad: bool, with_entropy: bool = False):
        with torch.set_grad_enabled(grad):
            return completion_logprobs(self.model, batch.rollout, rows, self.roll.temperature,
                                       self.memory.head_chunk or self.tcfg.logprob_chunk_size, with_entropy)

    @torch.no_grad()
    def _no_grad_logprobs(self, batch: Batch, parts: list[slice], adapter: bool) -> torch.Tensor:
        """Old (adapter on) or reference (adapter off: the frozen base) log-probs of the whole batch."""
        with contextlib.nullcontext() if adapter else self.model.disable_adapter():
            return torch.cat([self._logprobs(batch, s, grad=False)[0] for s in parts])

    def mini_batch_layout(self, batch: Batch) -> tuple[Batch, list[MiniBatch]]:
        """The batch reordered so that each mini-batch is a run of rows, and the mini-batches with their
        micro-batches and sizes over all ranks (one all-reduce)."""
        G, mini = self.algo.num_generations, self.algo.mini_batches
        groups = mini_batch_groups(batch.rewards.numel() // G, mini)
        ordered = batch if mini == 1 else batch.select_groups([g for part in groups for g in part])
        spans, start = [], 0
        for part in groups:
            spans.append(slice(start, start + len(part) * G))
            start += len(part) * G
        micro = [self.micro_batches(ordered, rows) for rows in spans]
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
        sampler = batch.rollout.sampler_logprobs  # the engine's own log-probs (vllm), None where it gives none
        settings = self.loss_settings if self.entropy_control is None else dataclasses.replace(
            self.loss_settings, entropy_coef=self.entropy_control.applied)
        for rows in mini.micro:
            logp, entropy = self._logprobs(batch, rows, grad=True,
                                           with_entropy=first_pass or algorithm.needs_entropy(self.algo))
            mask = batch.mask[rows]
            loss, stats = algorithm.policy_loss(algorithm.LossInputs(
                logp, batch.advantages[rows], mask, old_logp=None if old is None else old[rows],
                ref_logp=None if ref is None else ref[rows], entropy=entropy,
                sampler_weights=self.sampler_correction.weights(logp, old, sampler, rows, mask, first_pass),
                sampler_logp=None if sampler is None else sampler[rows].to(logp.device),
                total_tokens=mini.tokens_total, settings=settings))
            weight = algorithm.accumulation_weight(settings.loss_type, rows=rows.stop - rows.start,
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
        """Clip and apply the summed gradient, or skip it when it is not finite (stopping after trainer.max_skipped
        in a row); the learning-rate schedule advances either way. Returns the norm before clipping."""
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
        self.lr_schedule.step()
        return grad_norm

    def update(self, step: int, batch: Batch) -> StepStats:
        """Every optimizer update of one step: `num_iterations` passes over the mini-batches."""
        self.engine.update_begins()
        self.model.train()
        ordered, minis = self.mini_batch_layout(batch)
        parts = [rows for mini in minis for rows in mini.micro]
        ref = ordered.rollout.ref_logprobs if self.algo.beta > 0 else None  # the rollout worker's pass, if it made one
        ref = self._no_grad_logprobs(ordered, parts, adapter=False) if self.algo.beta > 0 and ref is None else ref
        old = self._no_grad_logprobs(ordered, parts, adapter=True) if not is_on_policy(self.algo) else None
        totals, first, max_logp, losses, grad_norms = UpdateSums(), None, -math.inf, [], []
        for iteration in range(self.algo.num_iterations):
            for mini in minis:
                if not mini.rows_total:  # all its groups were dropped (data.overlong=drop): nothing to learn
                    self.lr_schedule.step()
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
        first_pass_tokens = max(1.0, sum(mini.tokens_total for mini in minis))  # kl, entropy: first pass only
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
        if self.algo.filter_groups:
            batch = dynamic_sampling.filtered_batch(self, step)  # None: a stop request came first
        else:
            generation, batch = self.generation_source(step), None
            scores = None if generation is None else self.score(generation)  # None: a stop request came first
            if scores is not None:
                batch = self.make_batch(generation, scores)
        if self.stop_agreed(batch is None or self.stop()):
            return None
        stats = self.update(step, batch)
        if self.algo.check:
            check_invariants(step, batch, stats, self.algo)
        metrics = self.metrics(step, batch, stats, time.perf_counter() - t0)
        return metrics, batch

    # ---- bookkeeping ----------------------------------------------------------------------------
    def metrics(self, step: int, batch: Batch, stats: StepStats, seconds: float) -> dict:
        G = self.algo.num_generations
        r = batch.rewards
        lengths = batch.rollout.loss_mask().sum(dim=1).float()
        row = {
            "step": step,
            "reward": float(r.mean()),
            "reward_std": algorithm.group_std_mean(r, G),
            **{f"reward/{name}": present_mean(v) for name, v in batch.per_function.items()},
            "frac_reward_zero_std": algorithm.zero_std_group_fraction(r, G),
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            "clip_fraction/low": stats.clip_low, "clip_fraction/high": stats.clip_high,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "entropy": stats.entropy,
            "completion_len": float(lengths.mean()),
            "truncated_frac": float(batch.rollout.truncated.float().mean()),
            "lr": self.lr_schedule.lr,
            "step_time_s": seconds,
            **{k: batch.stats.get(k, 0.0) for k in ("gen_tokens_per_s", "gen_time_s", "gen_compile_s", "gen_sync_s")},
            "reward_errors": batch.reward_errors, "skipped_updates": self.skipped_updates,
            **{k: batch.stats[k] for k in ("prompts_truncated", "prompts_dropped")},
            **{k: v for k, v in batch.stats.items() if k.startswith(("filter_", "rollout/", "sync/"))},
            **{f"episodes/{k}": v for k, v in batch.rollout.metrics().items()},
            **self.sampler_correction.metrics(),
            **{f"outcomes/{name}/{kind}": n for name, o in batch.outcomes.items() for kind, n in o.counts().items()},
        }
        if self.dist.enabled:  # every rank has as many rows: rank means average exactly; counts add up
            summed = ("gen_tokens_per_s", "reward_errors", "prompts_truncated", "prompts_dropped",
                      *(k for k in row if k.startswith("outcomes/")))
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


def check_invariants(step: int, batch: Batch, stats: StepStats, algo) -> None:
    """algo.check after a step: log-probs are <= 0, and the advantages of each group sum to 0 where the
    estimator (algo.advantage) promises it."""
    if stats.max_logp > 1e-5:
        raise InvariantError(f"invariant 'logp <= 0' failed at step {step}: max logp {stats.max_logp:.3e}")
    group_sums = batch.advantages.detach().float().view(-1, algo.num_generations).sum(dim=1).abs().max()
    if algorithm.ADVANTAGES[algo.advantage].zero_sum_groups and float(group_sums) > 1e-3:
        raise InvariantError(f"invariant 'advantages sum to 0 per group' failed at step {step}: "
                             f"max |sum| {float(group_sums):.2e}")
