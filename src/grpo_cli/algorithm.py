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
from dataclasses import dataclass
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

    then aggregated by ``LOSS_TYPES[loss_type]`` (``dapo`` divides by ``total_tokens`` when given, else by
    this batch's tokens; ``dr_grpo`` needs ``max_new_tokens``)::

        grpo:    mean_i( sum_t m*l / max(1, sum_t m) )
        bnpo:    sum_{i,t} m*l / max(1, sum_{i,t} m)
        dapo:    sum_{i,t} m*l / max(1, total_tokens if given else sum_{i,t} m)
        dr_grpo: sum_{i,t} m*l / (B * max_new_tokens)

    Stats (0-dim float32, detached): ``kl`` = m-weighted mean of k3 (0 when ``ref_logp`` is None);
    ``clip_fraction/low`` = m-weighted share of ``ratio < 1-eps_low and A < 0``, ``clip_fraction/high`` of
    ``ratio > 1+eps_high and A > 0``, ``clip_fraction`` of either (their sum: the two never overlap);
    ``ratio_mean`` = m-weighted mean of ratio; ``num_tokens`` = sum m (to token-weight stats across
    micro-batches). See the module docstring for gradient accumulation.
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

    loss = LOSS_TYPES[loss_type].aggregate(per_token, m, max_new_tokens=max_new_tokens, total_tokens=total_tokens)

    with torch.no_grad():
        r = ratio.detach()
        clipped_low = (r < 1.0 - eps_low) & (adv < 0) & real
        clipped_high = (r > 1.0 + eps_high) & (adv > 0) & real
        denom_tok = n_tok.clamp_min(1.0)
        stats = {
            "kl": kl_stat,
            "clip_fraction": (clipped_low | clipped_high).float().sum() / denom_tok,
            "clip_fraction/low": clipped_low.float().sum() / denom_tok,
            "clip_fraction/high": clipped_high.float().sum() / denom_tok,
            "ratio_mean": torch.where(real, r, zero).sum() / denom_tok,
            "num_tokens": n_tok.detach().clone(),
        }
    return loss, stats
