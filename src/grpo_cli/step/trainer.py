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
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from transformers import TrainerState

from grpo_cli import algorithm
from grpo_cli.base.errors import Interrupted, InvariantError, OutOfMemory
from grpo_cli.base.stopping import StopRequest
from grpo_cli.config.rules import is_on_policy
from grpo_cli.config.schema import Config
from grpo_cli.model import adapters, sharding
from grpo_cli.model.loading import LoadedModel, load_policy, load_within_context
from grpo_cli.rewards import RewardSet
from grpo_cli.rewards.columns import check_columns
from grpo_cli.rollout import Generation, SamplingParams, completion_logprobs, episodes, make_engine, sampling_seed
from grpo_cli.rollout.ahead import AheadOfTheUpdate, Versions, versions_as_tensors, versions_from_tensors
from grpo_cli.rollout.placement import generating_ahead
from grpo_cli.step import distributed, dynamic_sampling, memory, parallel
from grpo_cli.step.batch import Batch, MiniBatch, Scores, make_batch, mini_batch_layout
from grpo_cli.step.evaluate import check_held_out_columns, eval_rows
from grpo_cli.step.optim import LRSchedule, build_optimizer
from grpo_cli.step.stats import StepStats, UpdateSums, check_first_update, check_invariants, metrics_row, over_ranks
from grpo_cli.tasks.prompts import EncodedPrompts, encode_prompts, given_as_chat, where_of
from grpo_cli.tasks.sources import PromptSampler, final_eval_on, load_rows

if TYPE_CHECKING:
    from peft import PeftModel


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def trainer_state(step: int, max_steps: int, steps_per_epoch: float, dist: distributed.Dist) -> TrainerState:
    """TRL's `trainer_state` for the rewards of `step` (transformers' TrainerState, as its Trainer keeps it): the
    steps done, max_steps, the passes over the training prompts so far and in all, which rank speaks."""
    return TrainerState(global_step=step, max_steps=max_steps, epoch=step / steps_per_epoch,
                        num_train_epochs=math.ceil(max_steps / steps_per_epoch), is_world_process_zero=dist.is_main,
                        is_local_process_zero=dist.local_rank == 0)


class GRPOTrainer:
    """Owns the objects a step needs; `step()` is one GRPO step (its optimizer updates). A run around the steps
    (its dir, resume, records, checkpoints) is grpo_cli.run.Run's: it asks, the trainer answers (`state_dict`,
    `load_state_dict`, `save_adapter`, `evaluate`, `close`), as torchtitan's trainer does.

    The config is validated before (run.validate: under torchrun it knows the real number of ranks).
    `make_evaluator(lm)` builds the evaluator of `eval.every` and `eval.final` from the loaded model. `log_dir`:
    where a vLLM server that rollout.placement=server starts writes its log. `load_model` loads the policy where `lm`
    is not given (load_policy's arguments; a sweep on one base adds its job's adapter to the shared one). Warnings go
    through errors.warn (the run's console while it logs)."""

    def __init__(self, cfg: Config, *, lm: LoadedModel | None = None, rows: list[dict] | None = None,
                 stop: StopRequest | None = None, make_evaluator: Callable[[LoadedModel], Callable] | None = None,
                 final_eval: bool | None = None, log_dir: Path | None = None,
                 load_model: Callable[..., LoadedModel] = load_policy):
        self.cfg, data = cfg, cfg.data
        self.algo, self.roll, self.tcfg = cfg.algo, cfg.rollout, cfg.trainer
        # this rank's GPU is bound and the process group joined before anything touches CUDA or loads a model
        self.dist, device = distributed.setup(self.tcfg.device if lm is None else str(lm.device))
        self.parallel = parallel.of(self.tcfg.parallel, self.dist)
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
        if evaluates and make_evaluator is not None:  # the held-out rows too: else the first eval, steps later
            check_held_out_columns(cfg, eval_rows(cfg), self.episodes)
        lengths = ("rollout.max_new_tokens", *(("eval.max_new_tokens",) if evaluates else ()))
        sharded = {"sharded": True} if self.parallel.sharded else {}  # hydra/launcher=shared_base: refused under fsdp
        self.lm = load_within_context(cfg, lengths, lambda: lm or load_model(cfg.model, device, seed=self.tcfg.seed,
                                                                             **sharded))
        self.model, self.tokenizer = cast("PeftModel", self.lm.model), self.lm.tokenizer
        self.engine = make_engine(self.roll, self.lm, max_prompt_tokens=data.max_prompt_tokens)
        self.memory = memory.plan(self.tcfg, self.lm, self.engine, chunk_size=self.tcfg.logprob_chunk_size,
                                  rows=data.prompts_per_step * self.algo.num_generations // self.dist.world_size,
                                  longest_row=data.max_prompt_tokens + self.roll.max_new_tokens)
        self.memory.apply(self.model)  # and with a budget, its line at start-up
        self.rewards = RewardSet.from_config(cfg.reward, device=self.lm.device, dtype=self.lm.dtype, stop=self.stop,
                                             environment=self.episodes and self.episodes.environment_class)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optimizer)
        self.lr_schedule = LRSchedule(self.optimizer, cfg.optimizer, self.tcfg.max_steps,
                                      updates_per_step=self.algo.mini_batches * self.algo.num_iterations)
        self.loss_settings = algorithm.loss_settings(self.algo, self.roll.max_new_tokens)
        self.entropy_control = algorithm.adaptive_entropy(self.algo)
        self.sampler_correction = algorithm.SamplerCorrection.of(self.algo)
        self.fresh_adapter, self.skipped_in_a_row, self.skipped_updates = True, 0, 0
        self.evaluator = make_evaluator(self.lm) if make_evaluator is not None and evaluates else None
        # rollout.placement=worker or server: started at the first step (from the resumed versions, if any)
        self.ahead: AheadOfTheUpdate | None = None
        self.resumed_versions: Versions | None = None  # rollout.placement: the versions a checkpoint kept
        self.last_eval: tuple[int, dict] | None = None  # (steps_done, metrics) of the latest held-out eval
        self.log_dir, self.steps_done = log_dir, 0

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
        sampling, stop = SamplingParams.of(self.roll), self.stop
        with self.memory.generating():
            roll = self.engine.generate(enc.ids, G, sampling, stop) if self.episodes is None else self.episodes.setup(
                self.tokenizer, self.lm.context_length).run(self.engine, rows, G, sampling, stop)
        if roll is None or roll.interrupted:  # None: a stop request came while a tool or the environment ran
            return None
        compile_s = self.engine.compile_s - compile_before  # paid once per run (per cache shape), kept apart
        gen_time = time.perf_counter() - t0 - compile_s
        return Generation(roll, rows, roll.prompt_texts(enc.texts), stats={
            "gen_time_s": gen_time, "gen_tokens_per_s": int(roll.loss_mask().sum()) / max(gen_time, 1e-9),
            "prompts_truncated": enc.truncated, "prompts_dropped": enc.dropped, "gen_compile_s": compile_s,
            "gen_sync_s": self.engine.sync_s})  # of gen_time_s: bringing the updated policy into the engine

    def score(self, generation: Generation) -> Scores | None:
        """Every reward function (an environment's get_reward() too) on every completion, with the fields of its
        prompt's data row (and the rollout's own reward_fields); None when a stop request came while a reward
        function ran. A row's `messages` go only to the functions that name them (rewards.reward_arguments)."""
        G, roll = self.algo.num_generations, generation.rollout
        fields = {k: [row[k] for row in generation.rows for _ in range(G)] for k in generation.rows[0]}
        chat = fields["messages"] if given_as_chat(generation.rows[0]) else None  # TRL: the first prompt's form
        try:
            scoring = self.rewards.score_all(generation.prompts, roll.texts, fields | roll.reward_fields(), G, chat)
        except Interrupted:
            return None
        return Scores(torch.tensor(scoring.totals), scoring.per_function, scoring.errors, scoring.outcomes,  # float32
                      scoring.failures, scoring.logged, scoring.extra)

    def generation(self, step: int) -> Generation | None:
        """The step's completions: generated here, or by the generator ahead of the update (rollout.placement)."""
        if self.roll.placement == "local":
            return self.generate(step)
        if self.ahead is None:
            self.ahead = generating_ahead(self.cfg, self.lm, self.prompts, self.dist.rank, start=step, stop=self.stop,
                                          history=self.resumed_versions, plan=self.memory, log_dir=self.log_dir)
        return self.ahead.generation(step)

    def make_batch(self, generation: Generation, scores: Scores) -> Batch:
        return make_batch(generation, scores, self.algo, self.lm.device)

    def micro_batches(self, batch: Batch, rows: slice) -> list[slice]:
        """The micro-batches of `rows`: trainer.micro_batch_size rows and the memory plan's tokens at most."""
        return self.memory.micro_batches(batch.rollout, rows, self.tcfg.micro_batch_size)

    def _logprobs(self, batch: Batch, rows: slice, *, grad: bool, with_entropy: bool = False):
        """Under fsdp: the root unit gathered (with grad: until the backward), the same decoder calls on every rank."""
        with torch.set_grad_enabled(grad), sharding.root_unsharded(self.model, reshard=not grad):
            return completion_logprobs(self.model, batch.rollout, rows, self.roll.temperature,
                                       self.memory.head_chunk or self.tcfg.logprob_chunk_size, with_entropy,
                                       uniform=self.lm.sharded)

    @torch.no_grad()
    def _no_grad_logprobs(self, batch: Batch, parts: list[slice], adapter: bool) -> torch.Tensor:
        """Old (adapter on) or reference (adapter off: the frozen base) log-probs of the whole batch (under fsdp as
        many passes as any rank makes: the idle ones on the first row, their result dropped)."""
        idle = [slice(0, 1)] * (self.parallel.passes([len(parts)])[0] - len(parts))
        with contextlib.nullcontext() if adapter else self.model.disable_adapter():
            return torch.cat([self._logprobs(batch, s, grad=False)[0] for s in parts + idle])[:batch.mask.shape[0]]

    def mini_batch_layout(self, batch: Batch) -> tuple[Batch, list[MiniBatch]]:
        return mini_batch_layout(batch, self.algo, self.micro_batches, self.dist, self.lm.device)

    def backward(self, batch: Batch, mini: MiniBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                 first_pass: bool, passes: int) -> tuple[UpdateSums, float]:
        """Accumulate the gradient of one mini-batch on this rank, micro-batch by micro-batch, in `passes` passes
        (under fsdp any rank's most: the rest idle, of weight 0); returns this rank's sums and the largest completion
        log-prob it saw (entropy and KL on the first pass only)."""
        sums, max_logp = UpdateSums(), -math.inf
        sampler = batch.rollout.sampler_logprobs  # the engine's own log-probs (vllm), None where it gives none
        settings = self.loss_settings if self.entropy_control is None else dataclasses.replace(
            self.loss_settings, entropy_coef=self.entropy_control.applied)
        for k in range(passes):
            self.parallel.before_pass(self.model, last=k == passes - 1)
            if k >= len(mini.micro):
                (self._logprobs(batch, slice(0, 1), grad=True)[0].sum() * 0.0).backward()
                continue
            rows = mini.micro[k]
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
            algorithm.accumulated(loss, stats, weight, mini.micro_total).backward()
            sums.add(float(loss.detach()), stats, weight, mini.micro_total, entropy, mask, first_pass)
            if first_pass and (real := mask.bool()).any():
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
        ref = ordered.rollout.ref_logprobs if algorithm.needs_reference(self.algo) else None  # the worker's pass
        if ref is None and algorithm.needs_reference(self.algo):
            ref = self._no_grad_logprobs(ordered, parts, adapter=False)
        old = self._no_grad_logprobs(ordered, parts, adapter=True) if not is_on_policy(self.algo) else None
        totals, first, max_logp, losses, grad_norms = UpdateSums(), None, -math.inf, [], []
        passes = self.parallel.passes([len(mini.micro) for mini in minis])
        for iteration in range(self.algo.num_iterations):
            for mini, n in zip(minis, passes, strict=True):
                if not mini.rows_total:  # all its groups were dropped (data.overlong=drop): nothing to learn
                    self.lr_schedule.step()
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                local, local_max_logp = self.backward(ordered, mini, old, ref, iteration == 0, n)
                self.parallel.reduce_gradients(self.params)
                sums = local.reduced(self.dist, self.lm.device)
                if first is None:
                    first = sums
                    if self.algo.check:
                        check_first_update(step, sums, old is None, self.fresh_adapter, self.algo.beta)
                grad_norms.append(self.optimizer_step(step, sums.loss))
                if self.entropy_control is not None:
                    self.entropy_control.update(sums.mean("all_entropy"))
                losses.append(sums.loss)
                totals, max_logp = totals + sums, max(max_logp, local_max_logp)
        self.fresh_adapter = False  # updated now: the policy has left the reference
        return StepStats.of(losses, grad_norms, totals, first or UpdateSums(), minis, max_logp)

    def step(self, step: int, on_phase: Callable[[int, str], None] = lambda k, what: None) -> tuple[dict, Batch] | None:
        """One GRPO update; None when a stop request came before the update began (the step is discarded,
        nothing of it has touched the weights, the optimiser or the logs). `on_phase(step, what)` hears the phases."""
        t0 = time.perf_counter()
        on_phase(step, "generating and scoring")
        self.rewards.trainer_state = trainer_state(step, self.tcfg.max_steps,
                                                   len(self.sampler.rows) / self.cfg.data.prompts_per_step, self.dist)
        if self.algo.filter_groups:
            batch = dynamic_sampling.filtered_batch(self, step)  # None: a stop request came first
        else:
            generation, batch = self.generation(step), None
            scores = None if generation is None else self.score(generation)  # None: a stop request came first
            if generation is not None and scores is not None:
                batch = self.make_batch(generation, scores)
        if distributed.any_rank(batch is None or self.stop()) or batch is None:  # None here made any_rank true
            return None
        on_phase(step, "updating")
        try:
            stats = self.update(step, batch)
        except (RuntimeError, MemoryError) as error:
            if not memory.is_out_of_memory(error):
                raise
            raise OutOfMemory(memory.out_of_memory_line(error, step, self.lm.device)) from None
        self.steps_done = step + 1
        if self.algo.check:
            check_invariants(step, batch, stats, self.algo)
        row = metrics_row(step, batch, stats, time.perf_counter() - t0, self.algo.num_generations, {
            "lr": self.lr_schedule.lr, "skipped_updates": self.skipped_updates, **self.sampler_correction.metrics()})
        return over_ranks(row, self.dist, self.lm.device, batch.logged), batch

    # ---- what a run asks of the step ------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of the state after `steps_done` steps: the adapter (whole on every rank), optimizer
        and schedule states, the step's counters, the policy versions in-flight batches need (rollout.placement)."""
        ahead = self.ahead
        return {"step": self.steps_done,
                "adapter": self.parallel.adapter(self.model, self.lm.adapter),  # fsdp: gathered, whole
                "optimizer": self.parallel.optimizer_state(self.optimizer),
                "lr_schedule": self.lr_schedule.state_dict(),
                "counters": {"skipped_updates": self.skipped_updates,
                             **(self.entropy_control.state() if self.entropy_control else {})},
                "rollout_versions": versions_as_tensors(ahead.versions_to_keep(self.steps_done)) if ahead else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` gave (the adapter as peft saves it). The configured optimizer hyperparameters win
        over the saved ones: a change that the run allowed is applied (unchanged: the same)."""
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.parallel.restore(self.model, self.optimizer, state["adapter"], state["optimizer"], self.lm.device,
                              self.lm.adapter)
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)
        self.lr_schedule.load_state_dict(state["lr_schedule"])  # the rate the configured schedule gives there
        counters = state["counters"]
        self.steps_done, self.skipped_updates = state["step"], counters.get("skipped_updates", 0)
        self.fresh_adapter = self.steps_done == 0
        if self.entropy_control is not None:
            self.entropy_control.restore(counters)
        if self.roll.placement != "local":
            self.resumed_versions = versions_from_tensors(state.get("rollout_versions") or {})

    def save_adapter(self, folder: Path, adapter: dict[str, torch.Tensor] | None = None) -> None:
        """The LoRA weights into `folder` as peft saves them, on rank 0: `adapter` (a state_dict's, as a checkpoint
        keeps it), else the trained one, called on every rank and refused on each when a weight is not finite."""
        if adapter is None:
            adapter = self.parallel.adapter(self.model, self.lm.adapter)  # fsdp: gathered, on every rank
            if not all(torch.isfinite(t).all() for t in adapter.values()):
                raise InvariantError("the adapter holds non-finite weights; it was not written (lower optimizer.lr)")
        if self.dist.is_main:
            adapters.save_adapter(self.model, folder, adapter, self.lm.adapter)

    def evaluate(self, final: bool = False, say: Callable[[str], None] = print) -> dict | None:
        """The greedy held-out eval of the policy after `steps_done` steps (eval.every; `final`: eval.final's, which
        reuses an eval.every eval of the same weights), said with `say` when it runs; on rank 0, None elsewhere and
        where there is none to run (under fsdp every rank takes part). A stop request during it raises Interrupted."""
        if self.evaluator is None or (final and not self.final_eval) or not self.parallel.evaluates():
            return None
        if self.last_eval is None or self.last_eval[0] != self.steps_done:
            say("final evaluation on the held-out prompts (eval.final)" if final else
                f"evaluating after step {self.steps_done - 1} on the held-out prompts")
            self.last_eval = (self.steps_done, self.evaluator(self.engine, stop=self.stop))
        return self.last_eval[1] if self.dist.is_main else None

    def close(self) -> None:
        """Stop the generator ahead of the update, if one runs."""
        if self.ahead is not None:
            self.ahead.close()

    # ---- bookkeeping ----------------------------------------------------------------------------
