"""The loss of one micro-batch (docs/algorithm.md sections 3-5): the chosen objective, the masks, the KL term,
the aggregation and the entropy bonus put together, with its stats.
"""

import math
from dataclasses import dataclass

import torch

from grpo_cli.algorithm.aggregation import LOSS_TYPES
from grpo_cli.algorithm.entropy import high_entropy_mask
from grpo_cli.algorithm.kl import kl_estimate
from grpo_cli.algorithm.policy_losses import (
    OBJECTIVES,
    RATIO_LEVELS,
    ObjectiveInputs,
    ObjectiveOptions,
    RatioLevel,
    check_objective,
    off_policy_keep,
)


def _check_policy_args(logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high, loss_type, ratio_level,
                       max_new_tokens, total_tokens, sampler_logp=None) -> None:
    """policy_loss's arguments (typed there), with eps_high resolved."""
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a floating [B, T] tensor, got logp shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask), ("sampler_logp", sampler_logp)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match logp shape {shape}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be (B,) = {shape[:1]} for logp shape {shape}"
        )
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite float >= 0, got beta={beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta > 0, got ref_logp=None with beta={beta!r}")
    if not (isinstance(eps_low, (int, float)) and 0 < eps_low < 1):
        raise ValueError(f"eps_low must be in (0, 1), got eps_low={eps_low!r}")
    if not (isinstance(eps_high, (int, float)) and 0 < eps_high < 1):
        raise ValueError(f"eps_high must be in (0, 1), got eps_high={eps_high!r}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got loss_type={loss_type!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got ratio_level={ratio_level!r}")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be None or an int >= 1, got max_new_tokens={max_new_tokens!r}")
    given = {"max_new_tokens": max_new_tokens, "total_tokens": total_tokens}
    for key in LOSS_TYPES[loss_type].requires:
        if given[key] is None:
            raise ValueError(f"loss_type={loss_type!r} requires {key}, got {key}=None")
    if total_tokens is not None and not (
        isinstance(total_tokens, (int, float)) and not isinstance(total_tokens, bool) and total_tokens >= 0
    ):
        raise ValueError(f"total_tokens must be None or a number >= 0, got total_tokens={total_tokens!r}")


@dataclass(frozen=True)
class LossSettings:
    """The knobs of :func:`policy_loss` beyond the contract's clipped surrogate; the defaults are today's loss."""

    objective: str = "grpo"
    options: ObjectiveOptions | None = None     # None: eps_low / eps_high of policy_loss, the other defaults
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False        # kl times the (token or sequence) ratio, as TRL's default
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0


def _masks(settings: LossSettings, lp, behaviour, adv, m, real, entropy) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy-term multiplier [B, T] or [B, 1], the tokens the entropy bonus averages over); `behaviour`: the
    log-probs of the sampling policy, as the sampler or the trainer computed them."""
    keep, tokens = torch.ones_like(adv), m
    if settings.off_policy_mask_threshold is not None:
        behaviour = torch.where(real, behaviour.detach().float(), torch.zeros((), device=lp.device))
        keep = off_policy_keep(lp, behaviour, adv, m, settings.off_policy_mask_threshold)
    if settings.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy, got entropy=None")
        high = high_entropy_mask(entropy, real, settings.top_entropy_quantile).float()
        keep, tokens = keep * high, m * high
    return keep, tokens


def _stats(ratio, adv, real, n_tok, eps_low, eps_high, kl_stat, extra) -> dict[str, torch.Tensor]:
    zero = torch.zeros((), dtype=torch.float32, device=ratio.device)
    with torch.no_grad():
        r = ratio.detach()
        clipped_low = (r < 1.0 - eps_low) & (adv < 0) & real
        clipped_high = (r > 1.0 + eps_high) & (adv > 0) & real
        denom_tok = n_tok.clamp_min(1.0)
        return {
            "kl": kl_stat,
            "clip_fraction": (clipped_low | clipped_high).float().sum() / denom_tok,
            "clip_fraction/low": clipped_low.float().sum() / denom_tok,
            "clip_fraction/high": clipped_high.float().sum() / denom_tok,
            "ratio_mean": torch.where(real, r, zero).sum() / denom_tok,
            "num_tokens": n_tok.detach().clone(),
            **{k: v.detach() for k, v in extra.items()},
        }


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    eps_low: float,
    eps_high: float | None = None,
    loss_type: str = "grpo",
    ratio_level: RatioLevel = "token",
    max_new_tokens: int | None = None,
    total_tokens: int | float | None = None,
    settings: LossSettings | None = None,
    entropy: torch.Tensor | None = None,
    sampler_weights: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one (micro-)batch and its detached scalar stats (docs/algorithm.md, sections 3-4).

    Inputs ``logp, old_logp, ref_logp, mask [B, T]``, ``advantages [B]``, ``entropy [B, T]`` (only for
    ``top_entropy_quantile`` and ``entropy_coef``). ``old_logp=None`` means ``old = logp.detach()`` (ratio 1: the
    plain policy gradient); ``ref_logp`` may be None only when ``beta == 0``; ``eps_high=None`` means ``eps_low``.
    Positions with ``m = 0`` are replaced (``torch.where``) before any arithmetic, so NaN/inf there reaches
    neither the loss, the stats nor the gradient::

        ratio_{i,t} = exp(logp_{i,t} - old_{i,t})                          ratio_level="token"
        ratio_i     = exp(sum_t m*(logp-old) / max(1, sum_t m))            ratio_level="sequence" (GSPO)
        l_{i,t}     = OBJECTIVES[settings.objective](...) * keep_{i,t} + beta * kl_{i,t}
        loss        = LOSS_TYPES[loss_type](l, m) - entropy_coef * mean_{tokens kept}(entropy)

    With the default ``settings`` the objective is the clipped surrogate
    ``-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A)`` and ``kl`` is k3; ``keep`` is 1 unless the off-policy
    mask or the high-entropy tokens are asked for; ``sampler_weights`` ([B, T] or [B, 1], from
    :func:`sampler_correction_weights`) multiply the objective's term too; the off-policy mask measures the drift
    from ``sampler_logp [B, T]`` (the engine's own log-probs) where given, as TRL, else from ``old``. ``dapo``
    divides by ``total_tokens`` when given (else this batch's tokens); ``dr_grpo`` needs ``max_new_tokens``.

    Stats (0-dim float32, detached): ``kl`` = m-weighted mean of the KL term (0 when ``ref_logp`` is None);
    ``clip_fraction/low`` = m-weighted share of ``ratio < 1-eps_low and A < 0``, ``clip_fraction/high`` of
    ``ratio > 1+eps_high and A > 0``, ``clip_fraction`` of either; ``ratio_mean``; ``num_tokens`` = sum m; the
    objective's own stats; ``entropy_bonus`` (with its gradient, already subtracted: :func:`accumulated`)."""
    eps_high = eps_low if eps_high is None else eps_high
    settings = settings or LossSettings()
    _check_policy_args(logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high,
                       loss_type, ratio_level, max_new_tokens, total_tokens, sampler_logp)  # fmt: skip
    check_objective(settings.objective, ratio_level, loss_type)
    options = settings.options or ObjectiveOptions(eps_low=eps_low, eps_high=eps_high)
    real = mask.bool()
    m = real.float()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    lp = torch.where(real, logp.float(), zero)
    old = lp.detach() if old_logp is None else torch.where(real, old_logp.detach().float(), zero)
    log_ratio = lp - old
    n_row = m.sum(dim=-1)
    n_tok = n_row.sum()
    seq_log_ratio = (log_ratio.sum(dim=-1) / n_row.clamp_min(1.0)).unsqueeze(-1).expand_as(lp)
    ratio = torch.exp(seq_log_ratio if ratio_level == "sequence" else log_ratio)
    adv = advantages.detach().float().unsqueeze(-1)
    out = OBJECTIVES[settings.objective].per_token(ObjectiveInputs(lp, ratio, log_ratio, adv, m, options))
    per_token, extra = out if isinstance(out, tuple) else (out, {})
    keep, bonus_tokens = _masks(settings, lp, old if sampler_logp is None else sampler_logp, adv, m, real, entropy)
    per_token = per_token * keep * (1.0 if sampler_weights is None else sampler_weights.detach().float())  # not the KL
    kl_stat = zero.clone()
    if ref_logp is not None:
        kl = kl_estimate(lp, torch.where(real, ref_logp.detach().float(), zero), settings.kl_estimator)
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        if beta > 0:
            per_token = per_token + beta * kl
        kl_stat = torch.where(real, kl.detach(), zero).sum() / n_tok.clamp_min(1.0)
    per_token = torch.where(real, per_token, zero)
    loss = LOSS_TYPES[loss_type].aggregate(per_token, m, max_new_tokens=max_new_tokens, total_tokens=total_tokens)
    bonus = zero.clone()
    if settings.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy, got entropy=None")
        ent = torch.where(real, entropy.float(), zero)
        bonus = settings.entropy_coef * (ent * bonus_tokens).sum() / bonus_tokens.sum().clamp_min(1.0)
        loss = loss - bonus
    stats = _stats(ratio, adv, real, n_tok, eps_low, eps_high, kl_stat, extra)
    stats["entropy_bonus"] = bonus
    return loss, stats
