"""Per-token log-probabilities and entropy (docs/algorithm.md section 2), from logits or from the hidden states
that feed the LM head, optionally in chunks of positions with a recomputing backward so that no ``[B, T, V]`` fp32
tensor is ever held.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Stand-in for log(0) in entropy terms so that p*log(p) = 0 (not NaN) where a logit is -inf.
_NEG_BIG = torch.finfo(torch.float32).min


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
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy):
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
    def backward(ctx, g_logp, g_ent):
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


@dataclass(frozen=True)
class HeadProducts:
    """The two products with the LM head's weight that the log-prob pass makes: ``logits(h) = h W^T + b`` and
    ``back(d) = d W``. :func:`plain_head_products` is ``F.linear`` and a matmul; a caller may give others with the
    same numbers to rounding (``model.prepack``'s packed weights for a frozen head)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    back: Callable[[torch.Tensor], torch.Tensor]


def plain_head_products(weight: torch.Tensor, bias: torch.Tensor | None) -> HeadProducts:
    return HeadProducts(lambda h: torch.nn.functional.linear(h, weight, bias), lambda d: d @ weight)


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
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_size, with_entropy, keep_grad, products):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        u = torch.empty_like(hidden) if keep_grad else None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            z = products.logits(hidden[rows]).float()
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
                u[rows] = products.back(d.to(weight.dtype))
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.with_entropy, ctx.products = with_entropy, products
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent, u)
        ctx.set_materialize_grads(False)
        return _outputs(ctx, logp, ent, with_entropy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, tokens, lse, ent, u = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tau, products = ctx.temperature, ctx.products
        g_ent = g_ent if ctx.with_entropy else None
        none = (None,) * 6
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
            z = products.logits(hidden[rows]).float()
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
                grad_h[rows] = products.back(gz)
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
    products: HeadProducts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(logp [B, T], entropy [B, T] or None)`` of ``tokens`` from the hidden states that feed the LM
    head, never holding the logits of more than ``chunk_size`` positions (``None``: all at once)::

        z = (hidden W^T + b) / tau      logp = z_y - logsumexp_v(z_v)      entropy = -sum_v p_v log p_v

    ``hidden [B, T, H]`` is aligned with ``tokens`` (``hidden[:, t]`` predicts ``tokens[:, t]``), ``weight
    [V, H]`` and ``bias [V]`` are the head's. Equal to :func:`token_logprobs_and_entropy` of
    ``F.linear(hidden, weight, bias)``, and so is the gradient, which flows to ``hidden`` (and to ``weight``
    and ``bias`` when they require it). Both outputs are float32. ``products`` computes the two matmuls with the
    head (default :func:`plain_head_products`; give others only for a frozen head).
    """
    _check_head_args(hidden, weight, bias, tokens, temperature, chunk_size)
    b, t, h = hidden.shape
    flat = hidden.reshape(b * t, h)
    chunk = chunk_size or max(1, b * t)
    keep_grad = torch.is_grad_enabled() and hidden.requires_grad
    logp, ent = _ChunkedHeadLogprobs.apply(flat, weight, bias, tokens.reshape(-1).long(), float(temperature), chunk,
                                           with_entropy, keep_grad, products or plain_head_products(weight, bias))
    return logp.view(b, t), (ent.view(b, t) if with_entropy else None)
