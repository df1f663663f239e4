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


@dataclass(frozen=True)
class LossSettings:
    """How a run computes the loss of a micro-batch (the algo.* keys, fixed for the run; `algorithm.loss_settings`
    reads them); the defaults are the contract's clipped surrogate without a KL term."""

    beta: float = 0.0                           # KL coefficient; > 0 needs ref_logp
    options: ObjectiveOptions = ObjectiveOptions()  # the clip bounds and each objective's knobs
    loss_type: str = "grpo"                     # how token losses add up (LOSS_TYPES)
    ratio_level: RatioLevel = "token"
    max_new_tokens: int | None = None           # dr_grpo's constant normaliser
    objective: str = "grpo"
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False        # kl times the (token or sequence) ratio, as TRL's default
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class LossInputs:
    """What the loss of one (micro-)batch is computed from: its tensors (``[B, T]``, the advantages ``[B]``), the
    batch's token count and the run's settings. ``old_logp=None`` means ``old = logp.detach()`` (ratio 1: the plain
    policy gradient); ``ref_logp`` may be None only when ``settings.beta == 0``; ``entropy`` is needed only for
    ``top_entropy_quantile`` and ``entropy_coef``; ``sampler_weights`` (``[B, T]`` or ``[B, 1]``, from
    :func:`sampler_correction_weights`) multiply the objective's term; ``sampler_logp`` are the engine's own
    log-probs; ``total_tokens`` is dapo's normaliser (else this batch's tokens)."""

    logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sampler_weights: torch.Tensor | None = None
    sampler_logp: torch.Tensor | None = None
    total_tokens: int | float | None = None
    settings: LossSettings = LossSettings()


def _check_shapes(x: LossInputs) -> None:
    if x.logp.dim() != 2 or not x.logp.is_floating_point():
        raise ValueError(f"logp must be a floating [B, T] tensor, got logp shape {tuple(x.logp.shape)}")
    shape = tuple(x.logp.shape)
    for name in ("old_logp", "ref_logp", "mask", "sampler_logp"):
        given = getattr(x, name)
        if given is not None and tuple(given.shape) != shape:
            raise ValueError(f"{name} shape {tuple(given.shape)} does not match logp shape {shape}")
    if tuple(x.advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages shape {tuple(x.advantages.shape)} must be (B,) = {shape[:1]} for logp shape {shape}"
        )


def _check_settings(x: LossInputs) -> None:
    settings, beta = x.settings, x.settings.beta
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite float >= 0, got beta={beta!r}")
    if beta > 0 and x.ref_logp is None:
        raise ValueError(f"ref_logp is required when beta > 0, got ref_logp=None with beta={beta!r}")
    for name in ("eps_low", "eps_high"):
        eps = getattr(settings.options, name)
        if not (isinstance(eps, (int, float)) and 0 < eps < 1):
            raise ValueError(f"{name} must be in (0, 1), got {name}={eps!r}")
    loss_type, ratio_level, tokens = settings.loss_type, settings.ratio_level, settings.max_new_tokens
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got loss_type={loss_type!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got ratio_level={ratio_level!r}")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"max_new_tokens must be None or an int >= 1, got max_new_tokens={tokens!r}")
    given = {"max_new_tokens": tokens, "total_tokens": x.total_tokens}
    for key in LOSS_TYPES[loss_type].requires:
        if given[key] is None:
            raise ValueError(f"loss_type={loss_type!r} requires {key}, got {key}=None")
    total = x.total_tokens
    if total is not None and not (isinstance(total, (int, float)) and not isinstance(total, bool) and total >= 0):
        raise ValueError(f"total_tokens must be None or a number >= 0, got total_tokens={total!r}")


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


def policy_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one (micro-)batch and its detached scalar stats (docs/algorithm.md, sections 3-4).

    Positions with ``m = 0`` are replaced (``torch.where``) before any arithmetic, so NaN/inf there reaches
    neither the loss, the stats nor the gradient::

        ratio_{i,t} = exp(logp_{i,t} - old_{i,t})                          ratio_level="token"
        ratio_i     = exp(sum_t m*(logp-old) / max(1, sum_t m))            ratio_level="sequence" (GSPO)
        l_{i,t}     = OBJECTIVES[settings.objective](...) * keep_{i,t} + beta * kl_{i,t}
        loss        = LOSS_TYPES[loss_type](l, m) - entropy_coef * mean_{tokens kept}(entropy)

    With the default settings the objective is the clipped surrogate
    ``-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A)`` and ``kl`` is k3; ``keep`` is 1 unless the off-policy
    mask or the high-entropy tokens are asked for; the sampler weights multiply the objective's term too; the
    off-policy mask measures the drift from ``sampler_logp`` where given, as TRL, else from ``old``. ``dapo``
    divides by ``total_tokens`` when given (else this batch's tokens); ``dr_grpo`` needs ``max_new_tokens``.

    Stats (0-dim float32, detached): ``kl`` = m-weighted mean of the KL term (0 when ``ref_logp`` is None);
    ``clip_fraction/low`` = m-weighted share of ``ratio < 1-eps_low and A < 0``, ``clip_fraction/high`` of
    ``ratio > 1+eps_high and A > 0``, ``clip_fraction`` of either; ``ratio_mean``; ``num_tokens`` = sum m; the
    objective's own stats; ``entropy_bonus`` (with its gradient, already subtracted: :func:`accumulated`)."""
    settings = x.settings
    _check_shapes(x)
    _check_settings(x)
    check_objective(settings.objective, settings.ratio_level, settings.loss_type)
    options = settings.options
    real = x.mask.bool()
    m = real.float()
    zero = torch.zeros((), dtype=torch.float32, device=x.logp.device)
    lp = torch.where(real, x.logp.float(), zero)
    old = lp.detach() if x.old_logp is None else torch.where(real, x.old_logp.detach().float(), zero)
    log_ratio = lp - old
    n_row = m.sum(dim=-1)
    n_tok = n_row.sum()
    seq_log_ratio = (log_ratio.sum(dim=-1) / n_row.clamp_min(1.0)).unsqueeze(-1).expand_as(lp)
    ratio = torch.exp(seq_log_ratio if settings.ratio_level == "sequence" else log_ratio)
    adv = x.advantages.detach().float().unsqueeze(-1)
    out = OBJECTIVES[settings.objective].per_token(ObjectiveInputs(lp, ratio, log_ratio, adv, m, options))
    per_token, extra = out if isinstance(out, tuple) else (out, {})
    behaviour = old if x.sampler_logp is None else x.sampler_logp
    keep, bonus_tokens = _masks(settings, lp, behaviour, adv, m, real, x.entropy)
    weights = 1.0 if x.sampler_weights is None else x.sampler_weights.detach().float()
    per_token = per_token * keep * weights  # not the KL
    kl_stat = zero.clone()
    if x.ref_logp is not None:
        kl = kl_estimate(lp, torch.where(real, x.ref_logp.detach().float(), zero), settings.kl_estimator)
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        if settings.beta > 0:
            per_token = per_token + settings.beta * kl
        kl_stat = torch.where(real, kl.detach(), zero).sum() / n_tok.clamp_min(1.0)
    per_token = torch.where(real, per_token, zero)
    loss = LOSS_TYPES[settings.loss_type].aggregate(per_token, m, max_new_tokens=settings.max_new_tokens,
                                                    total_tokens=x.total_tokens)
    bonus = zero.clone()
    if settings.entropy_coef:
        if x.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy, got entropy=None")
        entropy = torch.where(real, x.entropy.float(), zero)
        bonus = settings.entropy_coef * (entropy * bonus_tokens).sum() / bonus_tokens.sum().clamp_min(1.0)
        loss = loss - bonus
    stats = _stats(ratio, adv, real, n_tok, options.eps_low, options.eps_high, kl_stat, extra)
    stats["entropy_bonus"] = bonus
    return loss, stats
