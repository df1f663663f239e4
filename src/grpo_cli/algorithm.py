"""GRPO algorithm core: pure torch, one function per formula.

Every formula here, with the trainer code around it (accumulation, mini-batches, passes, metrics), is
written out in ``docs/algorithm.md``. Shapes: ``N = P*G`` completions (rows ``g*G .. g*G+G-1`` share
prompt ``g``), ``B`` rows in one (micro-)batch, ``T`` completion positions, ``V`` vocabulary size. ``m`` is
the completion mask (1 on real tokens, 0 on padding).

The loss types (``algo.loss_type``) live in one registry, :data:`LOSS_TYPES`: one function per type,
registered with :func:`register_loss_type` together with how its micro-batch losses add up. Config
validation, the trainer's accumulation weights (:func:`accumulation_weight`) and the README table
(:func:`loss_types_table`) all read it; adding a type is one function and its decorator.

Gradient accumulation. One optimizer update covers one mini-batch (the whole step's batch when
``algo.mini_batches=1``), cut into ``K`` micro-batches, possibly over several ranks. Each micro-batch loss
is multiplied by :func:`accumulation_weight` before backward, so that the summed gradient is the gradient
of the type's loss over the update's batch:

* ``grpo``, ``dr_grpo`` (means over rows): ``rows_in_micro / rows_in_update``.
* ``bnpo`` (token mean over each micro-batch, per the contract): ``1 / K``, the mean of the micro-batch
  losses. With one micro-batch on one rank it equals ``dapo``; with several it weighs each micro-batch
  equally whatever its token count, and differs from ``dapo``.
* ``dapo``: ``policy_loss`` gets ``total_tokens`` = real tokens in the whole update (all micro-batches and
  ranks) and the weight is 1.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from grpo_cli.registry import Registry

__all__ = [
    "group_advantages",
    "zero_std_group_fraction",
    "group_std_mean",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "head_token_logprobs",
    "kl_k3",
    "policy_loss",
    "LOSS_TYPES",
    "register_loss_type",
    "accumulation_weight",
    "loss_types_table",
]

Scale = Literal["group", "batch", "none"]
RatioLevel = Literal["token", "sequence"]
Accumulate = Literal["rows", "micro_batches", "sum"]

_SCALES = ("group", "batch", "none")
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


@dataclass(frozen=True)
class AdvantageEstimator:
    """One ``algo.advantage``: ``fn(rewards [N], group_size, *, eps, scale, lengths) -> A [N]``."""

    name: str
    fn: Callable[..., torch.Tensor]
    formula: str
    zero_sum_groups: bool        # every group's advantages sum to 0 (the live check asks it only then)
    scales: bool = False         # reads algo.scale_rewards (the others refuse a non-default one)
    note: str = ""


ADVANTAGES = Registry("advantage estimator", key="algo.advantage")  # name -> AdvantageEstimator


def register_advantage(name: str, *, formula: str, zero_sum_groups: bool, scales: bool = False,
                       note: str = "") -> Callable:
    """Decorator: register ``fn(rewards, group_size, *, eps, scale, lengths)`` as ``algo.advantage=name``."""

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        ADVANTAGES.register(name)(AdvantageEstimator(name, fn, formula, zero_sum_groups, scales, note))
        return fn

    return register


@register_advantage("grpo", formula="(r_i - mean_g) / (std_g + adv_eps)  (scale_rewards: group, batch or none)",
                    zero_sum_groups=True, scales=True, note="default: group z-scores (section 1)")
def grpo_advantages(rewards, group_size, *, eps=1e-4, scale="group", **_):
    return group_advantages(rewards, group_size, eps=eps, scale=scale)


@register_advantage("rloo", formula="(r_i - mean_g) * G / (G - 1)  = r_i - mean of the other G-1",
                    zero_sum_groups=True, note="leave-one-out baseline (RLOO; verl's rloo)")
def rloo_advantages(rewards, group_size, **_):
    r = _grouped(rewards, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).reshape(-1)


@register_advantage("reinforce_plus_plus_baseline",
                    formula="whiten_B(r_i - mean_g), whitened over the batch's loss tokens (unbiased var, +1e-8)",
                    zero_sum_groups=False, note="REINFORCE++ with a group baseline (verl's masked_whiten)")
def reinforce_plus_plus_baseline_advantages(rewards, group_size, *, lengths=None, **_):
    r = _grouped(rewards, group_size)
    centered = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
    w = torch.ones_like(centered) if lengths is None else lengths.detach().float().to(centered.device)
    total = w.sum()
    mean = (w * centered).sum() / total.clamp_min(1.0)
    var = (w * (centered - mean) ** 2).sum() / total.clamp_min(1.0)
    var = var * total / (total - 1).clamp_min(1.0)  # Bessel over tokens, as verl's masked_var(unbiased=True)
    return torch.where(w > 0, (centered - mean) * torch.rsqrt(var + 1e-8), torch.zeros_like(centered))


@register_advantage("opo", formula="r_i - sum_j |y_j| r_j / sum_j |y_j|  (length-weighted group baseline)",
                    zero_sum_groups=False, note="optimal-baseline OPO (verl's opo)")
def opo_advantages(rewards, group_size, *, lengths=None, **_):
    r = _grouped(rewards, group_size)
    w = torch.ones_like(r) if lengths is None else lengths.detach().float().to(r.device).view_as(r)
    baseline = (w * r).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return (r - baseline).reshape(-1)


@register_advantage("grpo_passk", formula="best of the group: (r_max - r_2nd) / (std_g + adv_eps); others 0",
                    zero_sum_groups=False, scales=True,
                    note="pass@k (verl's grpo_passk); scale_rewards=none leaves out the std")
def grpo_passk_advantages(rewards, group_size, *, eps=1e-4, scale="group", **_):
    r = _grouped(rewards, group_size)
    top, index = torch.topk(r, 2, dim=1)
    gap = top[:, 0] - top[:, 1]
    if scale != "none":
        gap = gap / (r.std(dim=1, unbiased=True) + eps)
    adv = torch.zeros_like(r)
    adv.scatter_(1, index[:, :1], gap.unsqueeze(1))
    return adv.reshape(-1)


def advantages_of(name: str, rewards: torch.Tensor, group_size: int, *, eps: float = 1e-4, scale: Scale = "group",
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``A [N]`` (detached) by the estimator ``algo.advantage=name``; ``lengths [N]`` = loss tokens per completion."""
    if name not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {tuple(ADVANTAGES)}, got advantage={name!r}")
    entry = ADVANTAGES[name]
    if scale != "group" and not entry.scales:
        raise ValueError(f"advantage={name!r} takes no scale_rewards (it is {entry.formula}), got scale={scale!r}")
    return entry.fn(rewards, group_size, eps=eps, scale=scale, lengths=lengths).detach()


def advantages_table() -> str:
    lines = ["| `algo.advantage` | A_i | groups sum to 0 | note |", "|---|---|---|---|"]
    for a in ADVANTAGES.values():
        lines.append(f"| `{a.name}` | `{a.formula}` | {'yes' if a.zero_sum_groups else 'no'} | {a.note} |")
    return "\n".join(lines)


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


def _outputs(ctx, logp: torch.Tensor, ent: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What a log-prob autograd Function returns: entropy without a gradient when it was not asked for."""
    if not with_entropy:
        ctx.mark_non_differentiable(ent)
    return logp, ent


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
        return _outputs(ctx, logp, ent, with_entropy)

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


def _check_head_args(hidden, weight, bias, tokens, temperature, chunk_size) -> None:
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating [B, T, H] tensor, got hidden shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"weight must be [V, H={hidden.shape[2]}], got weight shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V={weight.shape[0]}], got bias shape {tuple(bias.shape)}")
    _check_logits_tokens(hidden, tokens, temperature, chunk_size)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """LM head, log-softmax (+ entropy) and gather over blocks of ``chunk`` positions of the flattened
    ``hidden [N, H]``; no more than one block's fp32 logits ``[chunk, V]`` exist at any time.

    When ``hidden`` needs a gradient, the forward also keeps, per position, ``u = (onehot_y - p) @ W`` (the
    block's ``onehot - p`` rounded to W's dtype first, as autograd through the head would), i.e.
    ``tau * d logp / d h``: the one matmul the backward would otherwise redo after recomputing the logits. The
    backward of ``logp`` alone is then ``grad_h = g_logp / tau * u``. A gradient through the entropy
    (``d H / d z = -p (log p + H)``) or into a trainable head recomputes each block's logits instead.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_size, with_entropy, keep_grad):  # type: ignore[override]
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        u = torch.empty_like(hidden) if keep_grad else None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            z = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            if temperature != 1.0:
                z.div_(temperature)
            c_lse = torch.logsumexp(z, dim=-1)
            y = tokens[rows].unsqueeze(-1)
            lse[rows] = c_lse
            logp[rows] = z.gather(-1, y).squeeze(-1) - c_lse
            logp_all = z.sub_(c_lse.unsqueeze(-1))
            if not (with_entropy or keep_grad):
                continue
            p = logp_all.exp()
            if with_entropy:
                ent[rows] = -(p * logp_all.clamp_min_(_NEG_BIG)).sum(-1)
            if keep_grad:
                d = p.neg_().scatter_add_(-1, y, torch.ones_like(y, dtype=p.dtype))  # onehot_y - p
                u[rows] = d.to(weight.dtype) @ weight
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent, u)
        ctx.set_materialize_grads(False)
        return _outputs(ctx, logp, ent, with_entropy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        hidden, weight, bias, tokens, lse, ent, u = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tau = ctx.temperature
        g_ent = g_ent if ctx.with_entropy else None
        none = (None,) * 5
        if g_logp is None and g_ent is None:
            return None, None, None, *none
        if u is not None and g_ent is None and not (need_w or need_b):
            grad_h = (u.float() * (g_logp / tau).unsqueeze(-1)).to(hidden.dtype) if need_h else None
            return grad_h, None, None, *none
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for start in range(0, n, ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, n))
            # d logp_y / d z_j = 1[j=y] - p_j ;  d H / d z_j = -p_j (log p_j + H) ;  z = (h W^T + b) / tau
            z = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            logp_all = z.div_(tau).sub_(lse[rows].unsqueeze(-1))
            p = logp_all.exp()
            gz = torch.zeros_like(p)
            if g_logp is not None:
                gl = g_logp[rows].unsqueeze(-1)
                gz.sub_(p * gl).scatter_add_(-1, tokens[rows].unsqueeze(-1), gl)
            if g_ent is not None:
                ge = g_ent[rows].unsqueeze(-1)
                gz.sub_(p.mul_(logp_all.clamp_min_(_NEG_BIG).add_(ent[rows].unsqueeze(-1))).mul_(ge))
            gz = gz.div_(tau).to(weight.dtype)
            if need_h:
                grad_h[rows] = gz @ weight
            if need_w:
                grad_w += (gz.t() @ hidden[rows].to(weight.dtype)).float()
            if need_b:
                grad_b += gz.float().sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), *none)


def head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(logp [B, T], entropy [B, T] or None)`` of ``tokens`` from the hidden states that feed the LM
    head, never holding the logits of more than ``chunk_size`` positions (``None``: all at once)::

        z = (hidden W^T + b) / tau      logp = z_y - logsumexp_v(z_v)      entropy = -sum_v p_v log p_v

    ``hidden [B, T, H]`` is aligned with ``tokens`` (``hidden[:, t]`` predicts ``tokens[:, t]``), ``weight
    [V, H]`` and ``bias [V]`` are the head's. Equal to :func:`token_logprobs_and_entropy` of
    ``F.linear(hidden, weight, bias)``, and so is the gradient, which flows to ``hidden`` (and to ``weight``
    and ``bias`` when they require it). Both outputs are float32.
    """
    _check_head_args(hidden, weight, bias, tokens, temperature, chunk_size)
    b, t, h = hidden.shape
    flat = hidden.reshape(b * t, h)
    chunk = chunk_size or max(1, b * t)
    keep_grad = torch.is_grad_enabled() and hidden.requires_grad
    logp, ent = _ChunkedHeadLogprobs.apply(flat, weight, bias, tokens.reshape(-1).long(), float(temperature), chunk,
                                           with_entropy, keep_grad)
    return logp.view(b, t), (ent.view(b, t) if with_entropy else None)


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


# 4. Aggregation: the loss-type registry. Each function gets the per-token losses ``l [B, T]`` (already 0
# on padding), the float mask ``m [B, T]`` and the keyword context of ``policy_loss``, and returns the
# loss of one micro-batch.


@dataclass(frozen=True)
class LossType:
    """One ``algo.loss_type``: its aggregation, its formula (for the docs) and how micro-batches add up."""

    name: str
    aggregate: Callable[..., torch.Tensor]
    formula: str
    accumulate: Accumulate   # rows | micro_batches | sum: see accumulation_weight
    requires: tuple[str, ...] = ()  # policy_loss keywords that must not be None
    note: str = ""


LOSS_TYPES = Registry("loss type", key="algo.loss_type")  # name -> LossType, filled by register_loss_type

_ACCUMULATE_DOC = {
    "rows": "weighted by rows: `rows_in_micro / rows_in_update`",
    "micro_batches": "mean of the micro-batch losses: `1 / micro_batches_in_update`",
    "sum": "summed (the normaliser is already the whole update's token count)",
}


def register_loss_type(name: str, *, formula: str, accumulate: Accumulate, requires: tuple[str, ...] = (),
                       note: str = "") -> Callable:
    """Decorator: register ``fn(l, m, *, max_new_tokens, total_tokens) -> loss`` as ``algo.loss_type=name``."""
    if accumulate not in _ACCUMULATE_DOC:
        raise ValueError(f"accumulate must be one of {tuple(_ACCUMULATE_DOC)}, got accumulate={accumulate!r}")

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        LOSS_TYPES.register(name)(LossType(name, fn, formula, accumulate, tuple(requires), note))
        return fn

    return register


@register_loss_type("grpo", formula="mean_i( sum_t m*l / max(1, sum_t m) )", accumulate="rows",
                    note="default: per-sequence mean, then mean over sequences")
def grpo_loss(per_token: torch.Tensor, m: torch.Tensor, **_) -> torch.Tensor:
    return (per_token.sum(dim=-1) / m.sum(dim=-1).clamp_min(1.0)).mean()


@register_loss_type("bnpo", formula="sum_{i,t} m*l / max(1, sum_{i,t} m)", accumulate="micro_batches",
                    note="token mean over each micro-batch: equals dapo only when an update is one micro-batch "
                         "on one rank")
def bnpo_loss(per_token: torch.Tensor, m: torch.Tensor, **_) -> torch.Tensor:
    return per_token.sum() / m.sum().clamp_min(1.0)


@register_loss_type("dapo", formula="sum_{i,t} m*l / max(1, tokens of the whole update)", accumulate="sum",
                    note="token mean over the whole update, across micro-batches and ranks")
def dapo_loss(per_token: torch.Tensor, m: torch.Tensor, *, total_tokens: float | None = None, **_) -> torch.Tensor:
    denom = m.sum().clamp_min(1.0) if total_tokens is None else max(1.0, float(total_tokens))
    return per_token.sum() / denom


@register_loss_type("dr_grpo", formula="sum_{i,t} m*l / (B * max_new_tokens)", accumulate="rows",
                    requires=("max_new_tokens",), note="constant normaliser, no length bias (Dr. GRPO)")
def dr_grpo_loss(per_token: torch.Tensor, m: torch.Tensor, *, max_new_tokens: int, **_) -> torch.Tensor:
    return per_token.sum() / float(per_token.shape[0] * max_new_tokens)


def accumulation_weight(loss_type: str, *, rows: int, rows_total: float, micro_batches_total: float) -> float:
    """What a micro-batch loss is multiplied by before backward, so that the gradients summed over the
    micro-batches (and ranks) of one update equal the gradient of ``loss_type``'s loss over the update.

    ``rows`` = rows in this micro-batch; ``rows_total`` / ``micro_batches_total`` = rows / micro-batches of the
    whole update, over all ranks.
    """
    mode = LOSS_TYPES[loss_type].accumulate
    if mode == "rows":
        return rows / max(1.0, float(rows_total))
    if mode == "micro_batches":
        return 1.0 / max(1.0, float(micro_batches_total))
    return 1.0


def loss_types_table() -> str:
    """The table of loss types in docs/algorithm.md, written from the registry."""
    lines = ["| `algo.loss_type` | loss of one micro-batch | micro-batch losses of one update are | note |",
             "|---|---|---|---|"]
    for t in LOSS_TYPES.values():
        lines.append(f"| `{t.name}` | `{t.formula}` | {_ACCUMULATE_DOC[t.accumulate]} | {t.note} |")
    return "\n".join(lines)


# 3b. KL estimators (algo.kl_estimator): per-token estimates of KL(pi || ref) from d = ref - logp, as verl's
# kl_penalty names them (http://joschu.net/blog/kl-approx.html).
_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k3": lambda d: (torch.expm1(d) - d).clamp_min(0.0),
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d.square(),
    "abs": lambda d: d.abs(),
    "low_var_kl": lambda d: (torch.expm1(d.clamp(-20.0, 20.0)) - d.clamp(-20.0, 20.0)).clamp(-10.0, 10.0),
}
KL_ESTIMATORS = tuple(_KL_ESTIMATORS)
KL_FORMULAS = {
    "k3": "exp(ref - logp) - (ref - logp) - 1",
    "k1": "logp - ref",
    "k2": "(logp - ref)^2 / 2",
    "abs": "|logp - ref|",
    "low_var_kl": "clamp(k3 with ref - logp clamped to [-20, 20], -10, 10)  (verl)",
}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) by ``estimator`` (one of :data:`KL_ESTIMATORS`); ``k3`` is :func:`kl_k3`."""
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got kl_estimator={estimator!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}")
    return _KL_ESTIMATORS[estimator](ref_logp - logp)


# 3c. The objective registry (algo.objective): what one completion token contributes before aggregation.


@dataclass(frozen=True)
class ObjectiveOptions:
    """The options an objective may read (algo.* keys of the same names; eps_high already resolved)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float | None = None               # two-sided clipping: the ratio capped at delta (clip objectives)
    cispo_max_ratio: float = 5.0             # cispo's cap of the detached ratio (TRL's epsilon_high for cispo)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective function is given; every tensor is 0 on padding. ``logp`` carries the gradient; ``ratio``
    is the importance ratio at the chosen ``ratio_level`` (one value per row, broadcast, at ``sequence``) and
    carries it too; ``log_ratio`` is the per-token ``logp - old``; ``adv`` is ``[B, 1]``; ``m`` the float mask."""

    logp: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    adv: torch.Tensor
    m: torch.Tensor
    options: ObjectiveOptions


@dataclass(frozen=True)
class Objective:
    """One ``algo.objective``: its per-token loss function, its formula (for the docs) and the settings it allows."""

    name: str
    per_token: Callable[[ObjectiveInputs], torch.Tensor | tuple[torch.Tensor, dict]]
    formula: str
    ratio_levels: tuple[str, ...] = _RATIO_LEVELS
    aggregations: tuple[str, ...] | None = None   # None: every loss type
    note: str = ""


OBJECTIVES = Registry("objective", key="algo.objective")  # name -> Objective, filled by register_objective


def register_objective(name: str, *, formula: str, ratio_levels: tuple[str, ...] = _RATIO_LEVELS,
                       aggregations: tuple[str, ...] | None = None, note: str = "") -> Callable:
    """Decorator: register ``fn(x: ObjectiveInputs) -> l [B, T]`` (or ``(l, stats)``) as ``algo.objective=name``.

    ``l`` is the per-token policy loss (the KL term, the masks and the aggregation are added around it);
    ``stats`` are extra detached scalars. ``ratio_levels`` / ``aggregations`` name the settings that make sense."""
    bad = set(ratio_levels) - set(_RATIO_LEVELS)
    if not ratio_levels or bad:
        raise ValueError(f"ratio_levels must be a non-empty subset of {_RATIO_LEVELS}, got ratio_levels={ratio_levels!r}")

    def register(fn: Callable) -> Callable:
        OBJECTIVES.register(name)(Objective(name, fn, formula, tuple(ratio_levels),
                                            None if aggregations is None else tuple(aggregations), note))
        return fn

    return register


def _clipped_surrogate(x: ObjectiveInputs) -> torch.Tensor:
    o = x.options
    clipped = x.ratio.clamp(1.0 - o.eps_low, 1.0 + o.eps_high) * x.adv
    ratio = x.ratio if o.delta is None else x.ratio.clamp(max=o.delta)
    return -torch.minimum(ratio * x.adv, clipped)


@register_objective("grpo", formula="-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A), with r capped at delta when set",
                    note="default: the clipped surrogate (PPO / GRPO; GSPO at ratio_level=sequence)")
def grpo_objective(x: ObjectiveInputs) -> torch.Tensor:
    return _clipped_surrogate(x)


@register_objective("cispo", formula="-sg(min(r, cispo_max_ratio)) * A * logp",
                    note="MiniMax-M1 / ScaleRL: the ratio is capped and detached, every token keeps its gradient")
def cispo_objective(x: ObjectiveInputs) -> tuple[torch.Tensor, dict]:
    capped = x.ratio.clamp(max=x.options.cispo_max_ratio).detach()
    hit = ((x.ratio.detach() > x.options.cispo_max_ratio) & (x.adv > 0)).float() * x.m
    return -capped * x.adv * x.logp, {"cispo_clip_fraction": hit.sum() / x.m.sum().clamp_min(1.0)}


@register_objective("sapo", formula="-sigmoid(tau*(r-1)) * 4/tau * A, tau = sapo_temperature_pos if A > 0 else _neg",
                    note="soft adaptive gate instead of a hard clip (SAPO)")
def sapo_objective(x: ObjectiveInputs) -> torch.Tensor:
    o = x.options
    tau = torch.full_like(x.adv, o.sapo_temperature_neg).masked_fill(x.adv > 0, o.sapo_temperature_pos)
    return -torch.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau * x.adv


@register_objective("luspo", formula="|y_i| * grpo's l at the sequence ratio", ratio_levels=("sequence",),
                    aggregations=("grpo",),
                    note="length-unbiased sequence loss: the per-sequence mean becomes the per-sequence sum")
def luspo_objective(x: ObjectiveInputs) -> torch.Tensor:
    return _clipped_surrogate(x) * x.m.sum(dim=-1, keepdim=True)


def vespo_weights(log_ratio: torch.Tensor, m: torch.Tensor, adv: torch.Tensor, o: ObjectiveOptions) -> torch.Tensor:
    """VESPO's detached gamma weight per sequence ``[B, 1]``: ``phi(w) = exp(lam + k log w - lam w)`` (phi(1) = 1),
    ``w = exp(sum_t m * clamp(logp - old, -20, 20))`` clamped to ``[1e-8, e^20]``, (k, lam) by the sign of A."""
    low = math.log(1e-8)
    log_w = (log_ratio.detach().clamp(-20.0, 20.0) * m).sum(dim=-1, keepdim=True).clamp(low, 20.0)
    nonneg = adv >= 0
    k = torch.full_like(log_w, o.vespo_k_neg).masked_fill(nonneg, o.vespo_k_pos)
    lam = torch.full_like(log_w, o.vespo_lambda_neg).masked_fill(nonneg, o.vespo_lambda_pos).clamp_min(1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register_objective("vespo", formula="-sg(phi(w_i)) * A * logp, phi(w) = exp(lam + k log w - lam w), w = the "
                    "sequence ratio", ratio_levels=("token",),
                    note="gamma-weighted sequence ratio (VESPO); its sequence weight is built in")
def vespo_objective(x: ObjectiveInputs) -> tuple[torch.Tensor, dict]:
    phi = vespo_weights(x.log_ratio, x.m, x.adv, x.options)
    rows = (x.m.sum(dim=-1) > 0).float()
    return -phi * x.adv * x.logp, {"vespo_phi_mean": (phi.squeeze(-1) * rows).sum() / rows.sum().clamp_min(1.0)}


def check_objective(objective: str, ratio_level: str, loss_type: str) -> None:
    """ValueError in one line when the objective does not take this ratio level or loss type."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {tuple(OBJECTIVES)}, got objective={objective!r}")
    entry = OBJECTIVES[objective]
    if ratio_level not in entry.ratio_levels:
        raise ValueError(f"objective={objective!r} needs ratio_level in {entry.ratio_levels}, got "
                         f"ratio_level={ratio_level!r}")
    if entry.aggregations is not None and loss_type not in entry.aggregations:
        raise ValueError(f"objective={objective!r} needs aggregation in {entry.aggregations}, got {loss_type!r}")


def objectives_table() -> str:
    """The table of objectives in docs/algorithm.md, written from the registry."""
    lines = ["| `algo.objective` | per-token policy loss `l` | ratio_level | note |", "|---|---|---|---|"]
    for o in OBJECTIVES.values():
        lines.append(f"| `{o.name}` | `{o.formula}` | {', '.join(o.ratio_levels)} | {o.note} |")
    return "\n".join(lines)


# 3d. Token masks besides padding: the off-policy sequence mask and the high-entropy tokens.


def off_policy_keep(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, m: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[B, 1]``: keep a sequence when ``A >= 0`` or its token-mean
    ``old - logp`` (detached) is at most ``threshold``."""
    seq_kl = ((old - logp.detach()) * m).sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return ((adv >= 0) | (seq_kl <= threshold)).float()


def high_entropy_mask(entropy: torch.Tensor, real: torch.Tensor, quantile: float) -> torch.Tensor:
    """The real tokens whose entropy is at least the ``1 - quantile`` quantile of this micro-batch's real tokens
    (``top_entropy_quantile``: the share kept)."""
    values = entropy.detach()[real].float()
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() * real.float() >= threshold) & real


@dataclass
class AdaptiveEntropy:
    """``algo.entropy_target``: the entropy coefficient as a controller (TRL's use_adaptive_entropy). After each
    optimizer update with token-mean entropy ``H``: ``coef += delta`` when ``H <= target``, else ``coef -= delta``,
    within ``[0, coef_max]``; the bonus applies (with the coefficient of the previous update) only while the last
    measured ``H <= target``."""

    coef: float
    target: float
    delta: float
    coef_max: float = 1.0
    last_entropy: float = math.inf

    @property
    def applied(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        step = self.delta if entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, 0.0), self.coef_max)
        self.last_entropy = entropy

    def state(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def restore(self, state: dict) -> None:
        self.coef = float(state.get("entropy_coef", self.coef))
        self.last_entropy = float(state.get("last_entropy", self.last_entropy))


# 4. The loss of one micro-batch.


def _check_policy_args(logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high, loss_type, ratio_level,
                       max_new_tokens, total_tokens) -> None:
    """policy_loss's arguments (typed there), with eps_high resolved."""
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
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got loss_type={loss_type!r}")
    if ratio_level not in _RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {_RATIO_LEVELS}, got ratio_level={ratio_level!r}")
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


def _masks(settings: LossSettings, lp, old, adv, m, real, entropy) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy-term multiplier [B, T] or [B, 1], the tokens the entropy bonus averages over)."""
    keep, tokens = torch.ones_like(adv), m
    if settings.off_policy_mask_threshold is not None:
        keep = off_policy_keep(lp, old, adv, m, settings.off_policy_mask_threshold)
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
    :func:`sampler_correction_weights`) multiply the objective's term too. ``dapo`` divides by ``total_tokens`` when given (else this batch's
    tokens); ``dr_grpo`` needs ``max_new_tokens``.

    Stats (0-dim float32, detached): ``kl`` = m-weighted mean of the KL term (0 when ``ref_logp`` is None);
    ``clip_fraction/low`` = m-weighted share of ``ratio < 1-eps_low and A < 0``, ``clip_fraction/high`` of
    ``ratio > 1+eps_high and A > 0``, ``clip_fraction`` of either; ``ratio_mean``; ``num_tokens`` = sum m; the
    objective's own stats; and ``entropy_bonus`` (with its gradient: ``entropy_coef * mean entropy``, already
    subtracted from the loss; see :func:`accumulated`).
    """
    eps_high = eps_low if eps_high is None else eps_high
    settings = settings or LossSettings()
    _check_policy_args(logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high,
                       loss_type, ratio_level, max_new_tokens, total_tokens)  # fmt: skip
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
    keep, bonus_tokens = _masks(settings, lp, old, adv, m, real, entropy)
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


def accumulated(loss: torch.Tensor, stats: dict[str, torch.Tensor], weight: float,
                micro_batches_total: float) -> torch.Tensor:
    """What a micro-batch sends to backward: the loss type's part times its accumulation ``weight``, and the
    entropy bonus (a token mean of each micro-batch, as TRL's) divided by the update's number of micro-batches."""
    bonus = stats["entropy_bonus"]
    if not bonus.requires_grad and float(bonus) == 0.0:  # no bonus: exactly the loss type's weighted loss
        return loss * weight
    return (loss + bonus) * weight - bonus / max(1.0, float(micro_batches_total))


# 6. The algo.* settings as the trainer reads them.


def aggregation_of(algo) -> str:
    """The loss type of ``algo`` (its typed view or validated config): ``algo.aggregation``, or its alias ``algo.loss_type`` (TRL's name)
    when aggregation is left at the default."""
    aggregation = algo.aggregation
    return aggregation if aggregation != "grpo" else algo.loss_type


def loss_settings(algo, entropy_coef: float | None = None) -> LossSettings:
    """The :class:`LossSettings` of ``algo``; ``entropy_coef`` overrides algo.entropy_coef (the adaptive value)."""
    eps_high = algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps
    options = ObjectiveOptions(
        eps_low=algo.clip_eps, eps_high=eps_high, delta=algo.delta,
        cispo_max_ratio=algo.cispo_max_ratio,
        sapo_temperature_pos=algo.sapo_temperature_pos,
        sapo_temperature_neg=algo.sapo_temperature_neg,
        **{k: getattr(algo, k) for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
    return LossSettings(
        objective=algo.objective, options=options, kl_estimator=algo.kl_estimator,
        use_bias_correction_kl=bool(algo.use_bias_correction_kl),
        off_policy_mask_threshold=algo.off_policy_mask_threshold,
        top_entropy_quantile=algo.top_entropy_quantile,
        entropy_coef=algo.entropy_coef if entropy_coef is None else entropy_coef)


def needs_entropy(algo) -> bool:
    """Whether every pass (not only the first, for the metric) needs the per-token entropy."""
    return (algo.top_entropy_quantile < 1.0 or bool(algo.entropy_coef)
            or algo.entropy_target is not None)


def adaptive_entropy(algo) -> AdaptiveEntropy | None:
    target = algo.entropy_target
    if target is None:
        return None
    return AdaptiveEntropy(coef=algo.entropy_coef, target=target, delta=algo.entropy_coef_delta)


def config_problem(algo, world_size: int = 1) -> tuple[str, object, str] | None:
    """(key, value, what is wrong) for a combination of algo.* keys that makes no sense (or is not supported), else
    None."""
    if algo.filter_groups and world_size > 1:
        return ("algo.filter_groups", True, f"is not supported over {world_size} ranks yet (each rank would keep a "
                                            "different number of groups); use trainer.nproc=1")
    loss_type, aggregation = algo.loss_type, algo.aggregation
    if loss_type != "grpo" and aggregation != "grpo" and loss_type != aggregation:
        return ("algo.loss_type", loss_type, f"is an alias of algo.aggregation, which says {aggregation}; set only "
                                             "algo.aggregation")
    objective = algo.objective
    entry = OBJECTIVES.get(objective)
    if entry is not None and algo.ratio_level not in entry.ratio_levels:
        return ("algo.ratio_level", algo.ratio_level, f"does not suit algo.objective={objective}: use "
                                                      f"algo.ratio_level={entry.ratio_levels[0]}")
    if entry is not None and entry.aggregations is not None and aggregation_of(algo) not in entry.aggregations:
        return ("algo.aggregation", aggregation_of(algo), f"does not suit algo.objective={objective}: use "
                                                          f"algo.aggregation={entry.aggregations[0]}")
    advantage = ADVANTAGES.get(algo.advantage)
    if advantage is not None and not advantage.scales and algo.scale_rewards != "group":
        return ("algo.scale_rewards", algo.scale_rewards, f"is read by algo.advantage=grpo or grpo_passk only, not "
                                                          f"{advantage.name}; leave it at group")
    delta, eps_high = algo.delta, algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps
    if delta is not None and delta <= 1 + eps_high:
        return ("algo.delta", delta, f"needs delta > 1 + clip_eps_high ({1 + eps_high}) or the upper clip never acts")
    if algo.entropy_target is not None and algo.entropy_coef > 1.0:
        return ("algo.entropy_coef", algo.entropy_coef, "needs <= 1 with algo.entropy_target (the adaptive bound)")
    return None


TRUNCATED_WARN_FRAC, TRUNCATED_WARN_STEPS = 0.9, 10


def truncation_warning(metrics: dict, streak: int, warned: bool) -> tuple[int, str | None]:
    """(the new streak of steps with truncated_frac > 0.9, the warning to give once when it reaches 10, else None)."""
    streak = streak + 1 if metrics["truncated_frac"] > TRUNCATED_WARN_FRAC else 0
    if streak < TRUNCATED_WARN_STEPS or warned:
        return streak, None
    return streak, (f"truncated_frac > {TRUNCATED_WARN_FRAC} for {TRUNCATED_WARN_STEPS} steps in a row: almost every "
                    "completion hits the length limit before EOS, so the rewards judge cut-off text; raise "
                    "rollout.max_new_tokens (or set algo.mask_truncated=true)")


# --------------------------------------------------------------------------------------------------
# 8. Sampler correction: the sampling engine (vLLM) and the trainer compute different log-probs
# --------------------------------------------------------------------------------------------------

SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor | None:
    """Importance weights of TRL 1.16's ``vllm_importance_sampling_mode`` (None for ``none``), detached, that
    multiply the policy term of each token (not the KL term)::

        d_{i,t} = m * (trainer - sampler)           (NaN sampler log-probs count as d = 0)
        w       = exp(d_{i,t})        [B, T]        token_*
                  exp(sum_t d_{i,t})  [B, 1]        sequence_*
        *_truncate: w clamped to [clip_min, clip_max];  *_mask: w = 0 outside [clip_min, clip_max]

    ``trainer_logp`` is the trainer's log-prob of the policy that sampled (the old log-probs), ``sampler_logp``
    the engine's own; a bound of None is open."""
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction {mode!r} is not one of {', '.join(SAMPLER_CORRECTIONS)}")
    if mode == "none":
        return None
    diff = torch.nan_to_num((trainer_logp.detach().float() - sampler_logp.float()) * mask.float(), nan=0.0)
    weights = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else torch.clamp(weights, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def sampler_mismatch_stats(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                           weights: torch.Tensor | None, mode: str) -> dict[str, float]:
    """``sampler/logp_diff_mean`` and ``_max``: |trainer - sampler| over the completion tokens (NaN left out);
    ``sampler/corrected_frac``: the share of tokens (token_*) or sequences (sequence_*) whose weight the bounds
    changed (masked to 0, or truncated)."""
    real = mask.bool()
    delta = (trainer_logp.detach().float() - sampler_logp.float()).abs()[real]
    delta = delta[~torch.isnan(delta)]
    stats = {"sampler/logp_diff_mean": float(delta.mean()) if delta.numel() else 0.0,
             "sampler/logp_diff_max": float(delta.max()) if delta.numel() else 0.0, "sampler/corrected_frac": 0.0}
    if weights is not None:
        raw = sampler_correction_weights(trainer_logp, sampler_logp, mask, mode.split("_")[0] + "_truncate",
                                         clip_min=None, clip_max=None)  # the weights before any bound
        changed = weights != raw
        chosen = changed[real] if mode.startswith("token") else changed[real.any(dim=-1)].flatten()
        stats["sampler/corrected_frac"] = float(chosen.float().mean()) if chosen.numel() else 0.0
    return stats


@dataclass
class SamplerCorrection:
    """``algo.sampler_correction`` as the trainer applies it: the weights of each micro-batch, and the mismatch
    metrics of the step's first pass, averaged over its micro-batches (this rank's)."""

    mode: str = "none"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    recorded: list = field(default_factory=list)

    @classmethod
    def of(cls, algo) -> "SamplerCorrection":
        return cls(algo.sampler_correction, algo.sampler_clip_min, algo.sampler_clip_max, [])

    def weights(self, logp, old, sampler_logprobs, rows: slice, mask, record: bool) -> torch.Tensor | None:
        """The weights for the micro-batch `rows` (its log-probs `logp`; `old`: the batch's old log-probs, None
        on-policy) of a rollout whose sampler log-probs are `sampler_logprobs` (None without correction, or without
        the sampler's log-probs: an engine sampling with the trainer's own numerics); `record`: keep its mismatch
        stats for `metrics`."""
        if sampler_logprobs is None:
            return None
        trainer_logp = logp.detach() if old is None else old[rows]
        sampler_logp = sampler_logprobs[rows].to(trainer_logp.device)
        w = sampler_correction_weights(trainer_logp, sampler_logp, mask, self.mode, self.clip_min, self.clip_max)
        if record:
            self.recorded.append(sampler_mismatch_stats(trainer_logp, sampler_logp, mask, w, self.mode))
        return w

    def metrics(self) -> dict[str, float]:
        """The recorded stats (a mean over micro-batches; the max of the maxima), then forgotten."""
        done, self.recorded = self.recorded or [], []
        if not done:
            return {}
        out = {k: sum(s[k] for s in done) / len(done) for k in done[0]}
        out["sampler/logp_diff_max"] = max(s["sampler/logp_diff_max"] for s in done)
        return out
