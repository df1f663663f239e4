"""What a step measured: the sums of one optimizer update over its micro-batches and ranks (UpdateSums), the typed
record of a step's updates (StepStats), the metrics row built from them (docs/algorithm.md's metric names), and
the invariants algo.check holds a step to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpo_cli import algorithm
from grpo_cli.base.errors import InvariantError
from grpo_cli.rewards.aggregation import present_mean
from grpo_cli.step import distributed
from grpo_cli.step.batch import Batch, MiniBatch


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

    def add(self, loss: float, stats: dict, weight: float, micro_total: float, entropy, mask, first_pass: bool) -> None:
        """One micro-batch's share: its loss (`policy_loss`'s, with its stats) at its accumulation `weight`."""
        k = float(stats["num_tokens"])
        bonus = float(stats["entropy_bonus"])  # already in loss; accumulated weighs it by 1 / micro-batches
        self.loss += loss * weight + bonus * (weight - 1 / max(1.0, micro_total))
        self.all_entropy += float((entropy.detach() * mask).sum()) if entropy is not None else 0.0
        self.tokens += k
        self.ratio += float(stats["ratio_mean"]) * k
        self.clip_low += float(stats["clip_fraction/low"]) * k
        self.clip_high += float(stats["clip_fraction/high"]) * k
        if first_pass:
            self.kl += float(stats["kl"]) * k
            self.entropy += float((entropy.detach() * mask).sum())

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

    @classmethod
    def of(cls, losses: list[float], grad_norms: list[float], totals: UpdateSums, first: UpdateSums,
           minis: list[MiniBatch], max_logp: float) -> StepStats:
        """A step's record from its updates' losses and gradient norms, the sums over every update (`totals`) and
        over the first one (`first`)."""
        first_pass_tokens = max(1.0, sum(mini.tokens_total for mini in minis))  # kl, entropy: first pass only
        return cls(loss=sum(losses) / max(1, len(losses)), grad_norm=sum(grad_norms) / max(1, len(grad_norms)),
                   kl=totals.kl / first_pass_tokens, entropy=totals.entropy / first_pass_tokens,
                   clip_low=totals.mean("clip_low"), clip_high=totals.mean("clip_high"),
                   first_ratio=first.mean("ratio"), first_kl=first.mean("kl"), max_logp=max_logp, updates=len(losses))


def check_invariants(step: int, batch: Batch, stats: StepStats, algo) -> None:
    """algo.check after a step: log-probs are <= 0, and the advantages of each group sum to 0 where the
    estimator (algo.advantage) promises it."""
    if stats.max_logp > 1e-5:
        raise InvariantError(f"invariant 'logp <= 0' failed at step {step}: max logp {stats.max_logp:.3e}")
    group_sums = batch.advantages.detach().float().view(-1, algo.num_generations).sum(dim=1).abs().max()
    if algorithm.ADVANTAGES[algo.advantage].zero_sum_groups and float(group_sums) > 1e-3:
        raise InvariantError(f"invariant 'advantages sum to 0 per group' failed at step {step}: "
                             f"max |sum| {float(group_sums):.2e}")


def metrics_row(step: int, batch: Batch, stats: StepStats, seconds: float, num_generations: int,
                trainer_values: dict) -> dict:
    """The step's metrics row on this rank (docs/algorithm.md's names); `trainer_values`: what the trainer holds
    beyond the step (lr, skipped_updates, the sampler correction's metrics)."""
    G, r = num_generations, batch.rewards
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
        "lr": trainer_values.pop("lr"),
        "step_time_s": seconds,
        **{k: batch.stats.get(k, 0.0) for k in ("gen_tokens_per_s", "gen_time_s", "gen_compile_s", "gen_sync_s")},
        "reward_errors": batch.reward_errors, "skipped_updates": trainer_values.pop("skipped_updates"),
        **{k: batch.stats[k] for k in ("prompts_truncated", "prompts_dropped")},
        **{k: v for k, v in batch.stats.items() if k.startswith(("filter_", "rollout/", "sync/"))},
        **{f"episodes/{k}": v for k, v in batch.rollout.metrics().items()},
        **trainer_values,
        **{f"outcomes/{name}/{kind}": n for name, o in batch.outcomes.items() for kind, n in o.counts().items()},
    }
    # none of base.metrics.OWN_METRICS: log_metric refuses them
    return row | {name: total / calls for name, (total, calls) in batch.logged.items()}


def over_ranks(row: dict, dist: distributed.Dist, device, logged: dict[str, tuple[float, int]]) -> dict:
    """The row over every rank: every rank has as many rows, so rank means average exactly; counts add up; a name
    given to log_metric on any rank is the mean of all its values on every rank, as TRL averages them."""
    if not dist.enabled:
        return row
    summed = ("gen_tokens_per_s", "reward_errors", "prompts_truncated", "prompts_dropped",
              *(k for k in row if k.startswith("outcomes/")))
    averaged = ["reward", "reward_std", "frac_reward_zero_std", "completion_len", "truncated_frac",
                *(k for k in row if k.startswith("reward/"))]
    keys, names = [*averaged, *summed], distributed.names_on_any_rank(list(logged))
    totals = distributed.sum_floats([*(float(row[k]) for k in keys),
                                     *(float(x) for name in names for x in logged.get(name, (0.0, 0)))], dist, device)
    sums = totals[len(keys):]  # each logged name's sum of values, then their count
    return {**row, **{k: v if k in summed else v / dist.world_size for k, v in zip(keys, totals, strict=False)},
            **{name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names)}}


def check_first_update(step: int, first: UpdateSums, on_policy: bool, fresh: bool, beta: float) -> None:
    """algo.check: the first update of a step starts from the policy that sampled the rollout: ratio 1 (when there is
    an old pass to compare with) and, at step 0 with a `fresh` adapter, the reference policy: KL 0."""
    ratio, kl = first.mean("ratio"), first.mean("kl")
    if not on_policy and abs(ratio - 1.0) > 1e-3:
        raise InvariantError(f"invariant 'ratio == 1 on the first mini-batch of the first pass' failed at step "
                             f"{step}: mean ratio {ratio:.6f}")
    if fresh and beta > 0 and kl > 1e-6:
        raise InvariantError(f"invariant 'KL == 0 with a fresh adapter' failed at step {step} (first mini-batch): "
                             f"kl {kl:.3e}")
