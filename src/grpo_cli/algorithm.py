"""GRPO algorithm core: pure torch, one function per formula.

Every formula here, with the trainer code around it (accumulation, passes, metrics), is written out in
``docs/algorithm.md``. Shapes: ``N = P*G`` completions
(rows ``g*G .. g*G+G-1`` share prompt ``g``), ``B`` rows in one (micro-)batch, ``T`` completion positions,
``V`` vocabulary size. ``m`` is the completion mask (1 on real tokens, 0 on padding).

Gradient accumulation over ``K`` micro-batches (the step's gradient equals the full-batch gradient):

* ``grpo``:    multiply each micro-batch loss by ``rows_in_micro / rows_in_step`` (``1/K`` for equal rows).
* ``bnpo``:    token mean per micro-batch; ``1/K`` is exact only when every micro-batch holds the same
  number of real tokens (otherwise multiply by ``tokens_in_micro / tokens_in_step``, i.e. use ``dapo``).
* ``dapo``:    pass ``total_tokens`` = real tokens in the whole step (all micro-batches and ranks);
  do not divide.
* ``dr_grpo``: multiply by ``rows_in_micro / rows_in_step`` (``1/K`` for equal rows).
"""

import math
from typing import Literal

import torch

__all__ = [
    "group_advantages",
    "zero_std_group_fraction",
    "group_std_mean",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "kl_k3",
    "policy_loss",
]

Scale = Literal["group", "batch", "none"]
LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
RatioLevel = Literal["token", "sequence"]

_SCALES = ("group", "batch", "none")
_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
_RATIO_LEVELS = ("token", "sequence")
# Stand-in for log(0) in entropy terms so that p*log(p) = 0 (not NaN) where a logit is -inf.
_NEG_BIG = torch.finfo(torch.float32).min


# --------------------------------------------------------------------------------------------------
# 1. Advantages
# --------------------------------------------------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and reshape ``rewards [N]`` to ``[N/G, G]`` (floating point)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor, got rewards shape {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got group_size={group_size!r}")
    n = rewards.shape[0]
    if n == 0 or n % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards N={n} (N = prompts * group_size > 0)"
        )
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return r.view(n // group_size, group_size)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, eps: float = 1e-4, scale: Scale = "group"
) -> torch.Tensor:
    """Group-relative advantages ``A [N]`` (detached).

    For each group ``g`` (rows ``g*G .. g*G+G-1``), with Bessel (unbiased, ``/(G-1)``) std::

        mean_g = mean(r_g)
        A_i = (r_i - mean_g) / (std_g + eps)    scale="group"
        A_i = (r_i - mean_g) / (std_B + eps)    scale="batch"   (std_B over all N rewards)
        A_i =  r_i - mean_g                     scale="none"    (Dr. GRPO)

    A group whose rewards are all equal gets exactly zero advantages in every mode. ``eps`` is for
    stability only; a value near the reward scale (e.g. >= 1e-2 for 0/1 rewards) shrinks the signal.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite float > 0, got eps={eps!r}")
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got scale={scale!r}")
    r = _grouped(rewards, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = centered / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    elif scale == "batch":
        adv = centered / (r.reshape(-1).std(unbiased=True) + eps)
    else:
        adv = centered
    zero_std = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(zero_std, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def zero_std_group_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Metric ``frac_reward_zero_std``: share of groups whose ``G`` rewards are all equal."""
    r = _grouped(rewards, group_size)
    return (r == r[:, :1]).all(dim=1).float().mean().item()


def group_std_mean(rewards: torch.Tensor, group_size: int) -> float:
    """Metric ``reward_std``: ``mean_g std_g`` with the unbiased (Bessel) per-group std."""
    r = _grouped(rewards, group_size)
    return r.std(dim=1, unbiased=True).mean().item()


# --------------------------------------------------------------------------------------------------
# 2. Per-token log-probabilities (and entropy)
# --------------------------------------------------------------------------------------------------


def _check_logits_tokens(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_size: int | None
) -> None:
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating [B, T, V] tensor, got logits shape {tuple(logits.shape)} "
            f"dtype {logits.dtype}"
        )
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must equal logits shape[:2] {tuple(logits.shape[:2])} "
            f"(logits shape {tuple(logits.shape)})"
        )
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got tokens dtype {tokens.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0, got temperature={temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or an int >= 1, got chunk_size={chunk_size!r}")


def _chunk_slices(b: int, t: int, chunk_size: int) -> list[tuple[slice, slice]]:
    """Blocks of at most ``chunk_size`` positions of the flattened ``B*T``, as views of ``[B, T]``.

    ``chunk_size >= T``: whole rows, ``chunk_size // T`` at a time. ``chunk_size < T``: one row,
    ``chunk_size`` positions at a time. Blocks are basic slices, so a non-contiguous ``logits`` (the
    caller's ``logits[:, :-1]``) is never copied whole.
    """
    if b == 0 or t == 0:
        return []
    if chunk_size >= t:
        rows = chunk_size // t
        return [(slice(i, min(i + rows, b)), slice(0, t)) for i in range(0, b, rows)]
    return [
        (slice(i, i + 1), slice(j, min(j + chunk_size, t))) for i in range(b) for j in range(0, t, chunk_size)
    ]


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked ``logp`` (and entropy) with a chunked, recomputing backward.

    Saves only ``logits`` (the caller's tensor), ``tokens``, and per-position ``lse`` / entropy, so
    neither pass holds more than a few fp32 ``[chunk, V]`` blocks (one chunk's worth) at a time.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy):  # type: ignore[override]
        b, t, _ = logits.shape
        logp = torch.empty((b, t), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        for bs, ts in _chunk_slices(b, t, chunk_size):
            z = logits[bs, ts].float().div(temperature)
            c_lse = torch.logsumexp(z, dim=-1)
            lse[bs, ts] = c_lse
            logp[bs, ts] = z.gather(-1, tokens[bs, ts].unsqueeze(-1)).squeeze(-1) - c_lse
            if with_entropy:
                logp_all = z.sub_(c_lse.unsqueeze(-1))
                ent[bs, ts] = -(logp_all.exp() * logp_all.clamp_min(_NEG_BIG)).sum(-1)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(logits, tokens, lse, ent)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        logits, tokens, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        tau = ctx.temperature
        b, t, _ = logits.shape
        grad = torch.zeros_like(logits)
        for bs, ts in _chunk_slices(b, t, ctx.chunk_size):
            # d logp_y / d z_j = 1[j=y] - p_j ;  d H / d z_j = -p_j (log p_j + H) ;  z = logits / tau
            logp_all = logits[bs, ts].float().div(tau).sub_(lse[bs, ts].unsqueeze(-1))
            p = logp_all.exp()
            gl = g_logp[bs, ts].unsqueeze(-1)
            gz = p * -gl
            if ctx.with_entropy and g_ent is not None:
                ge = g_ent[bs, ts].unsqueeze(-1)
                gz.sub_(p.mul_(logp_all.clamp_min_(_NEG_BIG).add_(ent[bs, ts].unsqueeze(-1))).mul_(ge))
            gz.scatter_add_(-1, tokens[bs, ts].unsqueeze(-1), gl)
            grad[bs, ts] = gz.div_(tau)
        return grad, None, None, None, None


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_size: int | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_logits_tokens(logits, tokens, temperature, chunk_size)
    tokens = tokens.long()
    if chunk_size is not None:
        logp, ent = _ChunkedLogprobs.apply(logits, tokens, float(temperature), chunk_size, with_entropy)
        return logp, (ent if with_entropy else None)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all.clamp_min(_NEG_BIG)).sum(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Per-token log-probabilities ``logp [B, T]`` (float32, differentiable w.r.t. ``logits``).

    ``logits [B, T, V]`` are already aligned: ``logits[:, t]`` predicts ``tokens[:, t]``::

        logp_{b,t} = logits_{b,t}[y_{b,t}] / tau - logsumexp_v(logits_{b,t}[v] / tau)

    Computed in float32 whatever the dtype of ``logits``; the gradient has the dtype of ``logits``.
    ``chunk_size=None`` builds the full fp32 log-softmax ``[B, T, V]``. ``chunk_size=c`` processes at
    most ``c`` positions of the flattened ``B*T`` at a time (whole rows when ``c >= T``), in the
    forward and in a recomputing backward, so extra memory is ``O(c*V)`` plus ``O(B*T)``.
    """
    return _logprobs(logits, tokens, temperature, chunk_size, with_entropy=False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(logp [B, T], entropy [B, T])``, both float32 and differentiable w.r.t. ``logits``.

    ``logp`` is exactly :func:`token_logprobs` (same temperature, same chunking); the entropy is that of
    the sampling distribution::

        p = softmax(logits / tau)      entropy_{b,t} = -sum_v p_v log p_v
    """
    logp, ent = _logprobs(logits, tokens, temperature, chunk_size, with_entropy=True)
    assert ent is not None
    return logp, ent


# --------------------------------------------------------------------------------------------------
# 3. KL and the per-token objective; 4. aggregation; 5. masks
# --------------------------------------------------------------------------------------------------


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref), elementwise::

        kl = exp(ref - logp) - (ref - logp) - 1   (>= 0; exactly 0 where ref == logp)

    Computed as ``expm1(d) - d`` (clamped at 0) so rounding never makes it negative.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}"
        )
    d = ref_logp - logp
    return (torch.expm1(d) - d).clamp_min(0.0)


def _check_policy_args(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    eps_low: float,
    eps_high: float,
    loss_type: str,
    ratio_level: str,
    max_new_tokens: int | None,
    total_tokens: int | float | None,
) -> None:
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a floating [B, T] tensor, got logp shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
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
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {_LOSS_TYPES}, got loss_type={loss_type!r}")
    if ratio_level not in _RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {_RATIO_LEVELS}, got ratio_level={ratio_level!r}")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be None or an int >= 1, got max_new_tokens={max_new_tokens!r}")
    if loss_type == "dr_grpo" and max_new_tokens is None:
        raise ValueError("loss_type='dr_grpo' requires max_new_tokens, got max_new_tokens=None")
    if total_tokens is not None and not (
        isinstance(total_tokens, (int, float)) and not isinstance(total_tokens, bool) and total_tokens >= 0
    ):
        raise ValueError(f"total_tokens must be None or a number >= 0, got total_tokens={total_tokens!r}")


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
    loss_type: LossType = "grpo",
    ratio_level: RatioLevel = "token",
    max_new_tokens: int | None = None,
    total_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss of one (micro-)batch and its detached scalar stats.

    Inputs ``logp, old_logp, ref_logp, mask [B, T]``, ``advantages [B]``. ``old_logp=None`` means
    ``old = logp.detach()`` (ratio 1: the plain policy gradient); ``ref_logp`` may be None only when
    ``beta == 0``; ``eps_high=None`` means ``eps_low``. ``old``, ``ref`` and ``advantages`` are detached.
    Positions with ``m = 0`` are replaced (``torch.where``) before any arithmetic, so NaN/inf there
    reaches neither the loss, the stats nor the gradient::

        ratio_{i,t} = exp(logp_{i,t} - old_{i,t})                          ratio_level="token"
        ratio_i     = exp(sum_t m*(logp-old) / max(1, sum_t m))            ratio_level="sequence" (GSPO)
        surr_{i,t}  = min(ratio*A_i, clip(ratio, 1-eps_low, 1+eps_high)*A_i)
        l_{i,t}     = -surr_{i,t} + beta * kl_k3(logp, ref)_{i,t}

        grpo:    mean_i( sum_t m*l / max(1, sum_t m) )
        bnpo:    sum_{i,t} m*l / max(1, sum_{i,t} m)
        dapo:    sum_{i,t} m*l / max(1, total_tokens if given else sum_{i,t} m)
        dr_grpo: sum_{i,t} m*l / (B * max_new_tokens)

    Stats (0-dim float32, detached): ``kl`` = m-weighted mean of k3 (0 when ``ref_logp`` is None),
    ``clip_fraction`` = m-weighted share of ``(ratio < 1-eps_low and A < 0) or (ratio > 1+eps_high and
    A > 0)``, ``ratio_mean`` = m-weighted mean of ratio, ``num_tokens`` = sum m (to token-weight stats
    across micro-batches). See the module docstring for gradient accumulation.
    """
    if eps_high is None:
        eps_high = eps_low
    _check_policy_args(
        logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high,
        loss_type, ratio_level, max_new_tokens, total_tokens,
    )  # fmt: skip
    real = mask.bool()
    m = real.float()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)

    lp = torch.where(real, logp.float(), zero)
    old = lp.detach() if old_logp is None else torch.where(real, old_logp.detach().float(), zero)
    log_ratio = lp - old
    n_row = m.sum(dim=-1)
    n_tok = n_row.sum()
    if ratio_level == "sequence":
        log_ratio = (log_ratio.sum(dim=-1) / n_row.clamp_min(1.0)).unsqueeze(-1).expand_as(lp)
    ratio = torch.exp(log_ratio)

    adv = advantages.detach().float().unsqueeze(-1)
    surr = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    per_token = -surr
    if ref_logp is not None:
        kl = kl_k3(lp, torch.where(real, ref_logp.detach().float(), zero))
        if beta > 0:
            per_token = per_token + beta * kl
        kl_stat = torch.where(real, kl.detach(), zero).sum() / n_tok.clamp_min(1.0)
    else:
        kl_stat = zero.clone()
    per_token = torch.where(real, per_token, zero)

    if loss_type == "grpo":
        loss = (per_token.sum(dim=-1) / n_row.clamp_min(1.0)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / n_tok.clamp_min(1.0)
    elif loss_type == "dapo":
        denom = n_tok.clamp_min(1.0) if total_tokens is None else max(1.0, float(total_tokens))
        loss = per_token.sum() / denom
    else:  # dr_grpo
        assert max_new_tokens is not None
        loss = per_token.sum() / float(lp.shape[0] * max_new_tokens)

    with torch.no_grad():
        r = ratio.detach()
        clipped = ((r < 1.0 - eps_low) & (adv < 0)) | ((r > 1.0 + eps_high) & (adv > 0))
        denom_tok = n_tok.clamp_min(1.0)
        stats = {
            "kl": kl_stat,
            "clip_fraction": (clipped & real).float().sum() / denom_tok,
            "ratio_mean": torch.where(real, r, zero).sum() / denom_tok,
            "num_tokens": n_tok.detach().clone(),
        }
    return loss, stats
