"""The GRPO step loop (docs/algorithm.md, section 6) and the only place that calls backward.

    prompts -> rollout (adapter on) -> rewards -> group advantages -> ref log-probs (adapter off)
    -> for each pass, micro-batch: log-probs with grad -> policy_loss -> backward -> clip -> step
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from grpo_cli import algorithm, checkpoint, distributed
from grpo_cli.data import PromptSampler, load_rows
from grpo_cli.errors import Interrupted, InvariantError
from grpo_cli.models import LoadedModel, load_policy
from grpo_cli.rewards import RewardSet
from grpo_cli.rollout import Rollout, completion_logits, encode_prompts, generate
from grpo_cli.tracking import Tracker


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def completion_logprobs(model, rollout: Rollout, rows: slice, temperature: float, chunk_size: int | None,
                        with_entropy: bool = False):
    """Per-token log-probs (and entropy) of the completion tokens of `rows` under `model`."""
    logits = completion_logits(model, rollout, rows)
    if with_entropy:
        return algorithm.token_logprobs_and_entropy(logits, rollout.completion_ids[rows], temperature=temperature,
                                                    chunk_size=chunk_size)
    return algorithm.token_logprobs(logits, rollout.completion_ids[rows], temperature=temperature,
                                    chunk_size=chunk_size), None


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
    """Owns the objects a run needs; `step()` is one GRPO update, `fit()` the whole run."""

    def __init__(self, cfg: DictConfig, run_dir: Path, lm: LoadedModel | None = None, rows: list[dict] | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.algo, self.roll, self.tcfg = cfg.algo, cfg.rollout, cfg.trainer
        seed_everything(self.tcfg.seed)
        rows = rows if rows is not None else load_rows(cfg.data, split="train", seed=self.tcfg.seed)  # bad data fails before the model loads
        self.sampler = PromptSampler(rows, cfg.data.prompts_per_step, self.tcfg.seed)
        self.lm = lm or load_policy(cfg.model, self.tcfg.device, seed=self.tcfg.seed)
        self.dist = distributed.setup(self.lm.device)
        if self.dist.enabled and cfg.data.prompts_per_step % self.dist.world_size:
            raise InvariantError(f"data.prompts_per_step={cfg.data.prompts_per_step} must divide evenly over "
                                 f"{self.dist.world_size} ranks (whole groups per rank)")
        self.model, self.tokenizer = self.lm.model, self.lm.tokenizer
        self.rewards = RewardSet.from_config(cfg.reward)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, weight_decay=opt.weight_decay,
                                           betas=tuple(opt.get("betas", (0.9, 0.999))))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(opt.schedule, opt.warmup_steps, self.tcfg.max_steps))
        self.eps_high = self.algo.clip_eps_high if self.algo.clip_eps_high is not None else self.algo.clip_eps
        self.fresh_adapter = True
        self.zero_std_streak, self.warned_zero_std = 0, False
        self.skipped_in_a_row = 0
        self.skipped_updates = 0
        self.evaluator = None

    # ---- one step -------------------------------------------------------------------------------
    def rollout(self, step: int) -> Batch:
        G = self.algo.num_generations
        rows = self.sampler.batch(step)
        if self.dist.enabled:  # whole groups per rank: the rank's contiguous share of the step's prompts
            share = len(rows) // self.dist.world_size
            rows = rows[self.dist.rank * share:(self.dist.rank + 1) * share]
        enc = encode_prompts(self.tokenizer, rows, self.cfg.data.max_prompt_tokens, self.cfg.data.get("overlong", "truncate"))
        if not enc.ids:
            raise InvariantError(f"every prompt of step {step} is over data.max_prompt_tokens={self.cfg.data.max_prompt_tokens} "
                                 "and was dropped; raise it or use data.overlong=truncate")
        rows = [rows[i] for i in enc.kept]
        # sampling depends on (seed, step, rank) only: exact resume
        torch.manual_seed(self.tcfg.seed * 100_003 + step * 1_009 + self.dist.rank)
        t0 = time.perf_counter()
        roll = generate(self.model, self.tokenizer, enc.ids, num_generations=G,
                        max_new_tokens=self.roll.max_new_tokens, min_new_tokens=self.roll.min_new_tokens,
                        temperature=self.roll.temperature, top_p=self.roll.top_p, device=self.lm.device)
        gen_time = time.perf_counter() - t0
        prompts = [text for text in enc.texts for _ in range(G)]
        fields = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != "messages"}
        totals, per_fn, errors = self.rewards.score(prompts, roll.texts, fields)
        rewards = torch.tensor(totals, dtype=torch.float32)
        advantages = algorithm.group_advantages(rewards, G, eps=self.algo.adv_eps, scale=self.algo.scale_rewards)
        mask = roll.completion_mask.float()
        if self.algo.mask_truncated:
            mask = mask * (~roll.truncated).float().unsqueeze(1)
        gen_tokens = int(roll.completion_mask.sum())
        return Batch(roll, prompts, rewards, per_fn, advantages.to(self.lm.device), mask, errors, stats={
            "gen_time_s": gen_time, "gen_tokens_per_s": gen_tokens / max(gen_time, 1e-9),
            "prompts_truncated": enc.truncated, "prompts_dropped": enc.dropped,
        })

    def micro_batches(self, n: int) -> list[slice]:
        size = self.tcfg.micro_batch_size or n
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _logprobs(self, batch: Batch, rows: slice, *, grad: bool, with_entropy: bool = False):
        with torch.set_grad_enabled(grad):
            return completion_logprobs(self.model, batch.rollout, rows, self.roll.temperature,
                                       self.tcfg.logprob_chunk_size, with_entropy)

    @torch.no_grad()
    def _no_grad_logprobs(self, batch: Batch, parts: list[slice], adapter: bool) -> torch.Tensor:
        """Old (adapter on) or reference (adapter off: the frozen base) log-probs of the whole batch."""
        with contextlib.nullcontext() if adapter else self.model.disable_adapter():
            return torch.cat([self._logprobs(batch, s, grad=False)[0] for s in parts])

    def loss_weight(self, rows: slice, batch: Batch, n_global: float, tokens_global: float) -> float:
        """What each micro-batch loss is multiplied by so that the accumulated gradient, summed over ranks,
        equals the gradient of the loss over the whole step's batch."""
        loss_type = self.algo.loss_type
        if loss_type == "dapo":
            return 1.0  # normalised by the whole step's token count already
        if loss_type == "bnpo":
            return float(batch.mask[rows].sum()) / max(1.0, tokens_global)
        return (rows.stop - rows.start) / n_global  # grpo, dr_grpo: means over rows

    def update(self, step: int, batch: Batch) -> dict:
        n = batch.rewards.numel()
        parts = self.micro_batches(n)
        self.model.train()
        ref = self._no_grad_logprobs(batch, parts, adapter=False) if self.algo.beta > 0 else None
        old = self._no_grad_logprobs(batch, parts, adapter=True) if self.algo.num_iterations > 1 else None
        local_tokens = float(batch.mask.sum())
        total_tokens, n_global = distributed.sum_floats([local_tokens, float(n)], self.dist, self.lm.device)
        sums = {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "loss": 0.0, "max_logp": -math.inf}
        tokens_seen = 0.0
        grad_norms = []
        for iteration in range(self.algo.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            pass_loss, pass_ratio, pass_tokens = 0.0, 0.0, 0.0
            for rows in parts:
                first = iteration == 0
                logp, entropy = self._logprobs(batch, rows, grad=True, with_entropy=first)
                mask = batch.mask[rows]
                loss, stats = algorithm.policy_loss(
                    logp, None if old is None else old[rows], None if ref is None else ref[rows],
                    batch.advantages[rows], mask, beta=self.algo.beta, eps_low=self.algo.clip_eps,
                    eps_high=self.eps_high, loss_type=self.algo.loss_type, ratio_level=self.algo.ratio_level,
                    max_new_tokens=self.roll.max_new_tokens, total_tokens=total_tokens,
                )
                weight = self.loss_weight(rows, batch, n_global, total_tokens)
                (loss * weight).backward()
                k = float(stats["num_tokens"])
                pass_loss += float(loss.detach()) * weight
                pass_ratio += float(stats["ratio_mean"]) * k
                pass_tokens += k
                sums["clip_fraction"] += float(stats["clip_fraction"]) * k
                tokens_seen += k
                if first:
                    sums["kl"] += float(stats["kl"]) * k
                    sums["entropy"] += float((entropy.detach() * mask).sum())
                    real = mask.bool()
                    if real.any():
                        sums["max_logp"] = max(sums["max_logp"], float(logp.detach()[real].max()))
            distributed.sum_gradients(self.params, self.dist)
            pass_loss, pass_ratio, pass_tokens = distributed.sum_floats([pass_loss, pass_ratio, pass_tokens], self.dist,
                                                                        self.lm.device)
            sums["loss"] += pass_loss
            if iteration == 0 and old is not None and self.algo.check and pass_tokens:
                ratio = pass_ratio / pass_tokens
                if abs(ratio - 1.0) > 1e-3:
                    raise InvariantError(f"invariant 'ratio == 1 on the first pass' failed at step {step}: mean ratio {ratio:.6f}")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.max_grad_norm))
            grad_norms.append(grad_norm)
            if math.isfinite(grad_norm) and math.isfinite(pass_loss):
                self.optimizer.step()
                self.skipped_in_a_row = 0
            else:
                self.optimizer.zero_grad(set_to_none=True)
                self.skipped_updates += 1
                self.skipped_in_a_row += 1
                if self.skipped_in_a_row >= self.tcfg.max_skipped:
                    raise InvariantError(f"{self.skipped_in_a_row} non-finite updates in a row at step {step} "
                                         f"(loss {pass_loss}, grad norm {grad_norm}); lower optimizer.lr or check the rewards")
        reduced = distributed.sum_floats([sums["kl"], sums["clip_fraction"], sums["entropy"], tokens_seen], self.dist,
                                         self.lm.device)
        sums["kl"], sums["clip_fraction"], sums["entropy"], tokens_seen = reduced
        first_tokens = total_tokens or 1.0
        return {
            "kl": sums["kl"] / first_tokens,
            "clip_fraction": sums["clip_fraction"] / max(tokens_seen, 1.0),
            "entropy": sums["entropy"] / first_tokens,
            "loss": sums["loss"] / self.algo.num_iterations,
            "grad_norm": grad_norms[-1],
            "max_logp": sums["max_logp"],
        }

    def step(self, step: int) -> tuple[dict, Batch]:
        t0 = time.perf_counter()
        batch = self.rollout(step)
        update = self.update(step, batch)
        self.scheduler.step()
        if self.algo.check:
            self.check_invariants(step, batch, update)
        metrics = self.metrics(step, batch, update, time.perf_counter() - t0)
        self.fresh_adapter = False
        return metrics, batch

    # ---- bookkeeping ----------------------------------------------------------------------------
    def metrics(self, step: int, batch: Batch, update: dict, seconds: float) -> dict:
        G = self.algo.num_generations
        r = batch.rewards
        lengths = batch.rollout.completion_mask.sum(dim=1).float()
        row = {
            "step": step,
            "reward": float(r.mean()),
            "reward_std": algorithm.group_std_mean(r, G),
            **{f"reward/{name}": sum(v) / len(v) for name, v in batch.per_function.items()},
            "frac_reward_zero_std": algorithm.zero_std_group_fraction(r, G),
            "kl": update["kl"],
            "clip_fraction": update["clip_fraction"],
            "loss": update["loss"],
            "grad_norm": update["grad_norm"],
            "entropy": update["entropy"],
            "completion_len": float(lengths.mean()),
            "truncated_frac": float(batch.rollout.truncated.float().mean()),
            "lr": self.scheduler.get_last_lr()[0],
            "step_time_s": seconds,
            "gen_tokens_per_s": batch.stats["gen_tokens_per_s"],
            "gen_time_s": batch.stats["gen_time_s"],
            "reward_errors": batch.reward_errors,
            "skipped_updates": self.skipped_updates,
            "prompts_truncated": batch.stats["prompts_truncated"],
            "prompts_dropped": batch.stats["prompts_dropped"],
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

    def check_invariants(self, step: int, batch: Batch, update: dict) -> None:
        G = self.algo.num_generations
        if update["max_logp"] > 1e-5:
            raise InvariantError(f"invariant 'logp <= 0' failed at step {step}: max logp {update['max_logp']:.3e}")
        group_sums = batch.advantages.detach().float().view(-1, G).sum(dim=1).abs().max()
        if float(group_sums) > 1e-3:
            raise InvariantError(f"invariant 'advantages sum to 0 per group' failed at step {step}: max |sum| {float(group_sums):.2e}")
        if self.fresh_adapter and self.algo.beta > 0 and update["kl"] > 1e-6:
            raise InvariantError(f"invariant 'KL == 0 with a fresh adapter' failed at step {step}: kl {update['kl']:.3e}")

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
        cfg, run_dir = self.cfg, self.run_dir
        start = 0
        if cfg.trainer.get("resume"):
            found = checkpoint.find(run_dir, str(cfg.trainer.resume))
            if found is not None:
                state = checkpoint.load(found, self.model, self.optimizer, self.scheduler)
                start = state["step"]
                self.skipped_updates = state.get("skipped_updates", 0)
                self.fresh_adapter = start == 0
                if self.dist.is_main:
                    shutil_copy_metrics(found, run_dir)
        main = self.dist.is_main
        tracker = (Tracker(run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True), cfg.trainer.max_steps, start)
                   if main else SilentTracker())
        for text in getattr(self, "startup_warnings", []):
            tracker.warn(text)
        stop = {"signum": None}

        def on_signal(signum, _frame):
            stop["signum"] = signum

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        t_start = time.time()
        try:
            for step in range(start, cfg.trainer.max_steps):
                metrics, batch = self.step(step)
                self.track_zero_std(metrics, tracker)
                if self.evaluator is not None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                    if main:
                        metrics.update(self.evaluator(self.model))
                    distributed.barrier(self.dist)
                tracker.log(metrics)
                self.save_samples(tracker, step, batch)
                done = step + 1
                # every rank stops at the same step when any of them got the signal
                stopping = distributed.sum_floats([float(stop["signum"] or 0)], self.dist, self.lm.device)[0] > 0
                if (cfg.trainer.save_every and done % cfg.trainer.save_every == 0) or stopping:
                    ckpt = self.save_checkpoint(done)
                    if stopping:
                        raise Interrupted(stop["signum"] or signal.SIGTERM, ckpt)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        adapter_dir = self.save_adapter()
        if not main:
            return {"final_reward": float("nan"), "adapter": str(adapter_dir)}
        rewards = [row["reward"] for row in read_metrics(run_dir / "metrics.jsonl")]
        tail = rewards[-max(1, len(rewards) // 10):]
        summary = {
            "steps": len(rewards),
            "first_reward": sum(rewards[:10]) / max(1, len(rewards[:10])),
            "last_reward": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
            "final_reward": sum(tail) / len(tail),
            "time_s": time.time() - t_start,
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

    def save_checkpoint(self, done: int) -> Path:
        path = checkpoint.checkpoint_root(self.run_dir) / f"{checkpoint.PREFIX}{done:06d}"
        if self.dist.is_main:
            path = checkpoint.save(self.run_dir, done, self.model, self.optimizer, self.scheduler,
                                   {"skipped_updates": self.skipped_updates}, self.tcfg.keep_last)
        distributed.barrier(self.dist)
        return path

    def save_adapter(self) -> Path:
        for p in self.params:
            if not torch.isfinite(p).all():
                raise InvariantError("the adapter holds non-finite weights; it was not written (lower optimizer.lr)")
        out = self.run_dir / "adapter"
        if self.dist.is_main:
            self.model.save_pretrained(out)
        distributed.barrier(self.dist)
        return out


class SilentTracker:
    """What ranks other than 0 log to: nothing (rank 0 writes metrics, samples, W&B and the console)."""

    def log(self, row: dict) -> None: ...
    def samples(self, step: int, rows: list[dict]) -> None: ...
    def warn(self, text: str) -> None: ...
    def close(self, summary: dict) -> None: ...


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shutil_copy_metrics(checkpoint_dir: Path, run_dir: Path) -> None:
    """metrics.jsonl goes back to what it was at the checkpoint, so every step appears exactly once."""
    import shutil

    saved = checkpoint_dir / "metrics.jsonl"
    if saved.is_file():
        shutil.copy2(saved, run_dir / "metrics.jsonl")
    else:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
