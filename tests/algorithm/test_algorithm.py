"""Tests for grpo_cli.algorithm against the formulas of docs/algorithm.md (sections 1-5)."""

import dataclasses
import math

import pytest
import torch

from grpo_cli.algorithm import (
    LOSS_TYPES,
    LossInputs,
    LossSettings,
    ObjectiveOptions,
    group_advantages,
    group_std_mean,
    kl_k3,
    policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
    zero_std_group_fraction,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------

# Two groups of G=4: [1,0,0,0] (mean .25, unbiased std .5) and [1,1,0,0] (mean .5, std sqrt(1/3)).
HAND_REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_sum_to_zero_per_group(scale):
    r = torch.rand(40, generator=_gen(1)) * 3.0
    adv = group_advantages(r, 5, scale=scale)
    assert adv.shape == (40,)
    sums = adv.view(8, 5).sum(dim=1)
    assert torch.allclose(sums, torch.zeros(8), atol=1e-5)
    assert adv.abs().max() > 0.1


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gets_exact_zeros(scale):
    # float32 mean of [0.9]*3 is not exactly 0.9: r - mean is 6e-8, which /(0 + 1e-4) would leak 6e-4
    r = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.2, 0.9, 1.3, 1.3, 1.3])
    adv = group_advantages(r, 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.equal(adv[6:], torch.zeros(3))
    assert adv[3:6].abs().min() > 0.05
    assert torch.equal(group_advantages(torch.full((7,), 0.1), 7, scale=scale), torch.zeros(7))


def test_advantages_group_scale_hand_computed():
    adv = group_advantages(torch.tensor(HAND_REWARDS), 4)
    s1, s2 = 0.5 + 1e-4, math.sqrt(1.0 / 3.0) + 1e-4
    want = [0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-5)


def test_advantages_batch_scale_hand_computed():
    adv = group_advantages(torch.tensor(HAND_REWARDS), 4, scale="batch")
    # all 8 rewards: mean 3/8; sum of squared deviations = 3*(5/8)^2 + 5*(3/8)^2 = 1.875; /7
    std_b = math.sqrt(1.875 / 7.0) + 1e-4
    want = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert torch.allclose(adv, torch.tensor(want) / std_b, atol=1e-5)


def test_advantages_none_scale_hand_computed():
    adv = group_advantages(torch.tensor(HAND_REWARDS), 4, scale="none")
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))


def test_large_eps_shrinks_advantages():
    r = torch.tensor(HAND_REWARDS)
    small = group_advantages(r, 4)
    big = group_advantages(r, 4, eps=1.0)
    assert torch.all(big.abs() < small.abs())
    assert torch.allclose(big[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / 1.5, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantage_sign_is_sign_of_centered_reward(scale):
    r = torch.randn(60, generator=_gen(2))
    adv = group_advantages(r, 6, scale=scale)
    centered = r.view(10, 6) - r.view(10, 6).mean(dim=1, keepdim=True)
    assert torch.equal(torch.sign(adv), torch.sign(centered.reshape(-1)))


def test_advantages_accept_int_rewards_and_are_detached():
    adv = group_advantages(torch.tensor([1, 0, 1, 1]), 2, scale="none")
    assert adv.dtype == torch.float32
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    r = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not group_advantages(r, 2).requires_grad


def test_zero_std_fraction_and_group_std_mean():
    r = torch.tensor(HAND_REWARDS + [0.5, 0.5, 0.5, 0.5])
    assert zero_std_group_fraction(r, 4) == pytest.approx(1.0 / 3.0)
    assert group_std_mean(r, 4) == pytest.approx((0.5 + math.sqrt(1.0 / 3.0) + 0.0) / 3.0, abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# --------------------------------------------------------------------------------------------------


def _logits_tokens(b=3, t=5, v=11, seed=0, dtype=torch.float32):
    g = _gen(seed)
    logits = (torch.randn(b, t, v, generator=g) * 3.0).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    return logits, tokens


def _direct_logp(logits, tokens, tau=1.0):
    return torch.log_softmax(logits.double() / tau, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 5, 7, 100])
def test_logprobs_nonpositive_and_match_log_softmax(chunk_size):
    logits, tokens = _logits_tokens()
    logp = token_logprobs(logits, tokens, chunk_size=chunk_size)
    assert logp.shape == (3, 5) and logp.dtype == torch.float32
    assert torch.all(logp <= 1e-5)
    assert torch.allclose(logp.double(), _direct_logp(logits, tokens), atol=1e-5)
    assert logp.min() < -1.0


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 5, 6, 11, 15, 1000])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_chunked_equals_unchunked_values_and_grads(chunk_size, tau):
    base, tokens = _logits_tokens(b=3, t=5, v=13, seed=3)
    w = torch.randn(3, 5, generator=_gen(4))
    we = torch.randn(3, 5, generator=_gen(5))
    out = {}
    for cs in (None, chunk_size):
        logits = base.clone().requires_grad_(True)
        logp, ent = token_logprobs_and_entropy(logits, tokens, temperature=tau, chunk_size=cs)
        ((logp * w).sum() + (ent * we).sum()).backward()
        out[cs] = (logp.detach(), ent.detach(), logits.grad.clone())
        logits2 = base.clone().requires_grad_(True)
        (token_logprobs(logits2, tokens, temperature=tau, chunk_size=cs) * w).sum().backward()
        out[(cs, "lp")] = logits2.grad.clone()
    for a, b in zip(out[None], out[chunk_size], strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(out[(None, "lp")], out[(chunk_size, "lp")], atol=1e-5)
    assert out[None][2].abs().max() > 1e-2


def test_chunked_on_noncontiguous_slice_matches():
    full, _ = _logits_tokens(b=2, t=7, v=9, seed=6)
    tokens = torch.randint(0, 9, (2, 6), generator=_gen(7))
    grads = []
    for cs in (None, 4):
        x = full.clone().requires_grad_(True)
        sliced = x[:, :-1]  # caller's alignment slice: a non-contiguous view
        assert not sliced.is_contiguous()
        token_logprobs(sliced, tokens, chunk_size=cs).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert torch.equal(grads[1][:, -1], torch.zeros(2, 9))


def test_chunked_gradcheck_double():
    logits, tokens = _logits_tokens(b=2, t=3, v=5, seed=8, dtype=torch.float64)
    logits.requires_grad_(True)

    def f(x):
        logp, ent = token_logprobs_and_entropy(x, tokens, temperature=0.8, chunk_size=2)
        return logp, ent

    # the chunked path computes in fp32, so use loose tolerances on a double input
    assert torch.autograd.gradcheck(f, (logits,), eps=1e-3, atol=2e-3, rtol=2e-3)


def test_chunked_never_saves_full_fp32_vocab_tensor():
    b, t, v = 4, 6, 32
    logits, tokens = _logits_tokens(b=b, t=t, v=v, dtype=torch.bfloat16)
    logits.requires_grad_(True)

    def saved_fp32_full(chunk_size):
        saved = []

        def pack(x):
            saved.append((x.dtype, x.numel()))
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            token_logprobs_and_entropy(logits, tokens, chunk_size=chunk_size)
        return [s for s in saved if s[0] == torch.float32 and s[1] >= b * t * v]

    assert saved_fp32_full(None)  # the unchunked path does keep a full fp32 log-softmax
    assert saved_fp32_full(5) == []


def test_temperature_applied():
    logits, tokens = _logits_tokens(seed=9)
    for cs in (None, 3):
        hot = token_logprobs(logits, tokens, temperature=2.0, chunk_size=cs)
        assert torch.allclose(hot.double(), _direct_logp(logits, tokens, tau=2.0), atol=1e-5)
        assert not torch.allclose(hot, token_logprobs(logits, tokens, chunk_size=cs), atol=1e-2)
        # dividing the logits by tau by hand gives the same thing
        assert torch.allclose(hot, token_logprobs(logits / 2.0, tokens, chunk_size=cs), atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_bf16_logits(chunk_size):
    logits, tokens = _logits_tokens(b=2, t=4, v=17, seed=10, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(logits, tokens, chunk_size=chunk_size)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # computed in fp32 from the bf16 values: matches a float64 computation on those values
    assert torch.allclose(logp.double(), _direct_logp(logits.detach().float(), tokens), atol=1e-5)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_(True)
    lp32, ent32 = token_logprobs_and_entropy(ref, tokens)
    (lp32.sum() + ent32.sum()).backward()
    assert torch.allclose(logits.grad.float(), ref.grad, atol=2e-2)


@pytest.mark.parametrize("chunk_size", [None, 1, 6])
def test_entropy_matches_direct(chunk_size):
    logits, tokens = _logits_tokens(seed=11)
    _, ent = token_logprobs_and_entropy(logits, tokens, temperature=1.3, chunk_size=chunk_size)
    p = torch.softmax(logits.double() / 1.3, -1)
    want = -(p * p.log()).sum(-1)
    assert torch.allclose(ent.double(), want, atol=1e-5)
    assert torch.all(ent >= 0) and torch.all(ent <= math.log(11) + 1e-5)


def test_entropy_finite_with_neg_inf_logits():
    logits, tokens = _logits_tokens(b=1, t=2, v=6, seed=12)
    logits[..., 0] = float("-inf")
    tokens[:] = 1
    for cs in (None, 1):
        x = logits.clone().requires_grad_(True)
        logp, ent = token_logprobs_and_entropy(x, tokens, chunk_size=cs)
        (logp.sum() + ent.sum()).backward()
        assert torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[..., 0], torch.zeros(1, 2))


# --------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------


def test_kl_nonnegative_and_formula():
    g = _gen(13)
    logp = torch.randn(50, 20, generator=g) * 3 - 2
    ref = logp + torch.randn(50, 20, generator=g) * torch.logspace(-9, 0, 20)
    kl = kl_k3(logp, ref)
    assert torch.all(kl >= 0)
    d = (ref - logp).double()
    assert torch.allclose(kl.double(), d.exp() - d - 1, atol=1e-6)
    assert kl.max() > 0.1


def test_kl_exactly_zero_when_equal():
    logp = -torch.rand(7, 9, generator=_gen(14)) * 5
    assert torch.equal(kl_k3(logp, logp.clone()), torch.zeros(7, 9))


def test_kl_value():
    # logp=-1, ref=-2: d=-1 -> e^-1 + 1 - 1 = e^-1
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-2.0])).item() == pytest.approx(math.exp(-1), abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Loss: independent pure-Python reference
# --------------------------------------------------------------------------------------------------


def _ref_loss(
    logp, old, ref, adv, mask, beta, eps_low, eps_high, loss_type, ratio_level, mnt=None, total=None
):
    """Section 3-4 written with Python lists and math.*; returns (loss, kl, clip_fraction, ratio_mean,
    clip_fraction/low, clip_fraction/high)."""
    rows = []
    kl_sum = clip_n = ratio_sum = low_n = high_n = 0.0
    n_all = 0
    for i in range(len(logp)):
        idx = [t for t in range(len(logp[i])) if mask[i][t] == 1]
        if ratio_level == "sequence":
            s = sum(logp[i][t] - old[i][t] for t in idx) / max(1, len(idx))
            ratios = {t: math.exp(s) for t in idx}
        else:
            ratios = {t: math.exp(logp[i][t] - old[i][t]) for t in idx}
        ls = []
        for t in idx:
            r, a = ratios[t], adv[i]
            surr = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            d = ref[i][t] - logp[i][t]
            kl = math.exp(d) - d - 1
            ls.append(-surr + beta * kl)
            kl_sum += kl
            ratio_sum += r
            clip_n += (r < 1 - eps_low and a < 0) or (r > 1 + eps_high and a > 0)
            low_n += r < 1 - eps_low and a < 0
            high_n += r > 1 + eps_high and a > 0
        n_all += len(idx)
        rows.append(ls)
    tot = sum(sum(ls) for ls in rows)
    if loss_type == "grpo":
        loss = sum(sum(ls) / max(1, len(ls)) for ls in rows) / len(rows)
    elif loss_type == "bnpo":
        loss = tot / max(1, n_all)
    elif loss_type == "dapo":
        loss = tot / max(1, n_all if total is None else total)
    else:
        loss = tot / (len(rows) * mnt)
    n = max(1, n_all)
    return loss, kl_sum / n, clip_n / n, ratio_sum / n, low_n / n, high_n / n


def _batch(b=4, t=6, seed=20, spread=0.4):
    g = _gen(seed)
    logp = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = logp + torch.randn(b, t, generator=g) * spread
    ref = logp + torch.randn(b, t, generator=g) * spread
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


def test_loss_types_trivial_hand_numbers():
    # ratio == 1, beta == 0: l_{i,t} = -A_i on real tokens. A = [2, -1]; row lengths 2 and 3.
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    want = {
        "grpo": (-4 / 2 + 3 / 3) / 2,
        "bnpo": (-4 + 3) / 5,
        "dapo": (-4 + 3) / 10,
        "dr_grpo": (-4 + 3) / 8,
    }
    for lt, w in want.items():
        settings = LossSettings(loss_type=lt, max_new_tokens=4)
        loss, stats = policy_loss(LossInputs(logp, adv, mask, total_tokens=10 if lt == "dapo" else None,
                                             settings=settings))
        assert loss.item() == pytest.approx(w, abs=1e-6), lt
        assert stats["num_tokens"].item() == 5.0
        assert stats["kl"].item() == 0.0 and stats["clip_fraction"].item() == 0.0
        assert stats["clip_fraction/low"].item() == stats["clip_fraction/high"].item() == 0.0
        assert stats["ratio_mean"].item() == pytest.approx(1.0)
    loss, _ = policy_loss(LossInputs(logp, adv, mask, settings=LossSettings(loss_type="dapo")))
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_loss_matches_reference(loss_type, ratio_level, beta):
    logp, old, ref, adv, mask = _batch(spread=0.4 if ratio_level == "token" else 1.0)
    total = 40 if loss_type == "dapo" else None
    settings = LossSettings(beta=beta, options=ObjectiveOptions(eps_low=0.2, eps_high=0.28), loss_type=loss_type,
                            ratio_level=ratio_level, max_new_tokens=8)
    loss, stats = policy_loss(LossInputs(logp, adv, mask, old, ref, total_tokens=total, settings=settings))
    want = _ref_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), beta, 0.2, 0.28,
                     loss_type, ratio_level, mnt=8, total=total)
    assert loss.item() == pytest.approx(want[0], abs=1e-5)
    assert stats["kl"].item() == pytest.approx(want[1], abs=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(want[2], abs=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(want[3], abs=1e-5)
    assert stats["clip_fraction/low"].item() == pytest.approx(want[4], abs=1e-6)
    assert stats["clip_fraction/high"].item() == pytest.approx(want[5], abs=1e-6)
    assert stats["num_tokens"].item() == mask.sum().item()
    assert 0 < want[2] < 1  # the batch really exercises clipping
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def clipped(eps_low: float, eps_high: float | None = None, **settings) -> LossSettings:
    """The settings of the clipped surrogate with these bounds (eps_high: eps_low where not given)."""
    bounds = ObjectiveOptions(eps_low=eps_low, eps_high=eps_low if eps_high is None else eps_high)
    return LossSettings(options=bounds, **settings)


def test_clip_fraction_hand_made_ratios():
    ratios = torch.tensor([[0.5, 1.3, 1.0, 1.1], [0.5, 1.3, 0.9, 1.0]])
    old = torch.full((2, 4), -1.0)
    logp = old + ratios.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    # A>0 row: only 1.3 (> 1.2) is clipped; A<0 row: only 0.5 (< 0.8) is clipped -> 2/8
    _, s = policy_loss(LossInputs(logp, adv, mask, old))
    assert s["clip_fraction"].item() == pytest.approx(0.25)
    assert s["clip_fraction/low"].item() == pytest.approx(0.125)   # the A<0 row's 0.5
    assert s["clip_fraction/high"].item() == pytest.approx(0.125)  # the A>0 row's 1.3
    assert s["ratio_mean"].item() == pytest.approx(ratios.mean().item(), abs=1e-6)
    # eps_high = 0.35: 1.3 no longer clipped on the high side -> 1/8
    _, s = policy_loss(LossInputs(logp, adv, mask, old, settings=clipped(0.2, 0.35)))
    assert s["clip_fraction"].item() == pytest.approx(0.125)
    assert (s["clip_fraction/low"].item(), s["clip_fraction/high"].item()) == pytest.approx((0.125, 0.0))
    # eps_low = 0.6: 0.5 no longer clipped on the low side -> 1/8
    _, s = policy_loss(LossInputs(logp, adv, mask, old, settings=clipped(0.6, 0.2)))
    assert s["clip_fraction"].item() == pytest.approx(0.125)
    assert (s["clip_fraction/low"].item(), s["clip_fraction/high"].item()) == pytest.approx((0.0, 0.125))
    # masking the clipped A<0 token: 1 of 7 real tokens
    mask[1, 0] = 0
    _, s = policy_loss(LossInputs(logp, adv, mask, old))
    assert s["clip_fraction"].item() == pytest.approx(1 / 7)


def _agg_weights(mask, loss_type, mnt=None, total=None):
    m = mask.double()
    b = m.shape[0]
    if loss_type == "grpo":
        return m / m.sum(-1, keepdim=True).clamp_min(1) / b
    if loss_type == "bnpo":
        return m / m.sum().clamp_min(1)
    if loss_type == "dapo":
        return m / (m.sum().clamp_min(1) if total is None else total)
    return m / (b * mnt)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("use_old", [False, True])
def test_ratio_one_gradient_is_plain_policy_gradient(loss_type, use_old):
    logp, _, _, adv, mask = _batch(seed=21)
    x = logp.clone().requires_grad_(True)
    old = x.detach() if use_old else None
    loss, _ = policy_loss(LossInputs(x, adv, mask, old, settings=LossSettings(loss_type=loss_type, max_new_tokens=9)))
    loss.backward()
    want = -adv.double()[:, None] * _agg_weights(mask, loss_type, mnt=9)
    assert torch.allclose(x.grad.double(), want, atol=1e-7)
    assert x.grad.abs().max() > 1e-3


def test_ratio_one_gradient_through_logits():
    logits, tokens = _logits_tokens(b=3, t=4, v=7, seed=22)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = torch.tensor([0.5, -1.5, 2.0])
    x1 = logits.clone().requires_grad_(True)
    loss, _ = policy_loss(LossInputs(token_logprobs(x1, tokens, chunk_size=3), adv, mask))
    loss.backward()
    x2 = logits.clone().requires_grad_(True)
    w = (-adv[:, None] * _agg_weights(mask, "grpo")).float()
    (w * token_logprobs(x2, tokens)).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_padding_changes_nothing_even_with_nan(loss_type, ratio_level):
    logp, old, ref, adv, mask = _batch(seed=23)
    settings = LossSettings(beta=0.1, loss_type=loss_type, ratio_level=ratio_level, max_new_tokens=10)

    def run(lp, o, r, m):
        x = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(LossInputs(x, adv, m, o, r, settings=settings))
        loss.backward()
        return loss.detach(), stats, x.grad

    base = run(logp, old, ref, mask)
    # garbage in padded positions, plus two extra all-padding columns
    pad = torch.zeros(4, 2, dtype=mask.dtype)
    m2 = torch.cat([mask, pad], 1)
    garbage = [float("nan"), float("inf"), float("-inf"), 1e30]

    def dirty(t, k):
        t2 = torch.cat([t, torch.zeros(4, 2)], 1)
        return torch.where(m2.bool(), t2, torch.tensor(garbage[k % 4]))

    got = run(dirty(logp, 0), dirty(old, 1), dirty(ref, 2), m2.bool())
    assert torch.isfinite(got[0]) and got[0].item() == pytest.approx(base[0].item(), abs=1e-6)
    for k in base[1]:
        assert got[1][k].item() == pytest.approx(base[1][k].item(), abs=1e-6), k
    assert torch.isfinite(got[2]).all()
    assert torch.allclose(got[2][:, :6], base[2], atol=1e-7)
    assert torch.equal(got[2][~m2.bool()], torch.zeros(int((m2 == 0).sum())))


def test_sequence_level_ratio_hand_computed():
    # one sequence, 2 real tokens: logp-old = 0.1, 0.3 -> ratio = exp(0.2) = 1.2214, broadcast
    logp = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.3, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    r = math.exp(0.2)
    # A > 0, eps 0.3: unclipped. grpo loss = -(r*A + r*A)/2 = -r*A
    loss, s = policy_loss(LossInputs(logp, torch.tensor([2.0]), mask, old,
                                     settings=clipped(0.3, ratio_level="sequence")))
    assert loss.item() == pytest.approx(-2.0 * r, abs=1e-6)
    assert s["ratio_mean"].item() == pytest.approx(r, abs=1e-6)
    assert s["clip_fraction"].item() == 0.0
    loss.backward()
    # d/dlogp_t of -(1/2) sum_t A*exp(mean(logp-old)) = -(1/2) * 2 * A * r * (1/2) = -A*r/2 per token
    assert torch.allclose(logp.grad, torch.tensor([[-r, -r, 0.0]]), atol=1e-6)
    # A > 0, eps 0.2: ratio 1.2214 > 1.2 is clipped on every token -> loss = -1.2*A, zero gradient
    logp.grad = None
    loss, s = policy_loss(LossInputs(logp, torch.tensor([2.0]), mask, old,
                                     settings=LossSettings(ratio_level="sequence")))
    assert loss.item() == pytest.approx(-2.4, abs=1e-6)
    assert s["clip_fraction"].item() == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))
    # token level differs: per-token ratios exp(.1), exp(.3); only exp(.3)=1.35 is clipped
    loss, s = policy_loss(LossInputs(logp, torch.tensor([2.0]), mask, old))
    assert loss.item() == pytest.approx(-(2 * math.exp(0.1) + 2 * 1.2) / 2, abs=1e-6)
    assert s["clip_fraction"].item() == 0.5


def _grads(logp, old, ref, adv, mask, settings: LossSettings, scale=1.0, total_tokens=None):
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(LossInputs(x, adv, mask, old, ref, total_tokens=total_tokens, settings=settings))
    (loss * scale).backward()
    return x.grad, loss.detach(), stats


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batches_accumulate_to_full_batch_gradient(loss_type, ratio_level):
    logp, old, ref, adv, _ = _batch(b=4, t=5, seed=24)
    # equal real-token counts per half (7 and 7) so 1/K is exact for bnpo
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    total = int(mask.sum())
    settings = clipped(0.2, 0.25, beta=0.05, loss_type=loss_type, ratio_level=ratio_level, max_new_tokens=5)
    full, full_loss, _ = _grads(logp, old, ref, adv, mask, settings)
    k = 2
    scale = 1.0 if loss_type == "dapo" else 1.0 / k
    whole = total if loss_type == "dapo" else None
    acc = torch.zeros_like(logp)
    acc_loss = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        g, lo, _ = _grads(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], settings, scale=scale, total_tokens=whole)
        acc[sl] += g
        acc_loss += lo.item() * scale
    assert torch.allclose(acc, full, atol=1e-7)
    assert acc_loss == pytest.approx(full_loss.item(), abs=1e-6)
    assert full.abs().max() > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_uneven_micro_batches_weighted_by_rows(loss_type):
    logp, old, ref, adv, mask = _batch(b=4, t=5, seed=25)
    settings = LossSettings(beta=0.05, loss_type=loss_type, max_new_tokens=5)
    full, _, _ = _grads(logp, old, ref, adv, mask, settings)
    whole = int(mask.sum()) if loss_type == "dapo" else None
    acc = torch.zeros_like(logp)
    for sl, rows in ((slice(0, 3), 3), (slice(3, 4), 1)):
        scale = 1.0 if loss_type == "dapo" else rows / 4
        acc[sl] += _grads(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], settings, scale=scale, total_tokens=whole)[0]
    assert torch.allclose(acc, full, atol=1e-7)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_beta_term_adds_beta_times_aggregated_kl(loss_type):
    logp, _, ref, adv, mask = _batch(seed=26, spread=0.7)
    beta = 0.4
    settings = LossSettings(loss_type=loss_type, max_new_tokens=7)
    g0, l0, s0 = _grads(logp, None, ref, adv, mask, settings)
    g1, l1, s1 = _grads(logp, None, ref, adv, mask, dataclasses.replace(settings, beta=beta))
    w = _agg_weights(mask, loss_type, mnt=7)
    d = (ref - logp).double()
    k3 = d.exp() - d - 1
    assert l1.item() - l0.item() == pytest.approx(beta * (w * k3).sum().item(), abs=1e-5)
    assert l1.item() - l0.item() > 1e-3
    # d/dlogp of beta*k3 = beta * (1 - exp(ref - logp))
    assert torch.allclose((g1 - g0).double(), beta * w * (1 - d.exp()), atol=1e-6)
    want_kl = (k3 * mask).sum().item() / mask.sum().item()
    assert s0["kl"].item() == pytest.approx(want_kl, abs=1e-5)  # logged even when beta == 0
    assert s1["kl"].item() == pytest.approx(want_kl, abs=1e-5)


def test_fresh_adapter_kl_zero_and_float_mask_equals_bool_mask():
    logp, old, _, adv, mask = _batch(seed=27)
    settings = LossSettings(beta=0.1)
    l1, s1 = policy_loss(LossInputs(logp, adv, mask.float(), old, logp.clone(), settings=settings))
    l2, s2 = policy_loss(LossInputs(logp, adv, mask.bool(), old, logp.clone(), settings=settings))
    assert s1["kl"].item() == 0.0
    assert l1.item() == l2.item()


# --------------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.zeros(8), group_size=1), "group_size"),
        (dict(rewards=torch.zeros(8), group_size=3), "group_size=3"),
        (dict(rewards=torch.zeros(0), group_size=2), "group_size"),
        (dict(rewards=torch.zeros(2, 4), group_size=2), r"rewards shape \(2, 4\)"),
        (dict(rewards=torch.zeros(8), group_size=4, eps=0.0), "eps=0.0"),
        (dict(rewards=torch.zeros(8), group_size=4, eps=-1e-4), "eps=-0.0001"),
        (dict(rewards=torch.zeros(8), group_size=4, scale="std"), "scale='std'"),
    ],
)
def test_group_advantages_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)


def test_metric_helpers_validate():
    with pytest.raises(ValueError, match="group_size=3"):
        zero_std_group_fraction(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size=1"):
        group_std_mean(torch.zeros(8), 1)


@pytest.mark.parametrize("fn", [token_logprobs, token_logprobs_and_entropy])
def test_logprob_errors(fn):
    logits, tokens = _logits_tokens()
    with pytest.raises(ValueError, match="temperature=0"):
        fn(logits, tokens, temperature=0)
    with pytest.raises(ValueError, match="temperature=-1.0"):
        fn(logits, tokens, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        fn(logits, tokens, chunk_size=0)
    with pytest.raises(ValueError, match=r"tokens shape \(3, 4\).*\(3, 5\)"):
        fn(logits, tokens[:, :4])
    with pytest.raises(ValueError, match=r"logits shape \(3, 5\)"):
        fn(logits[..., 0], tokens)
    with pytest.raises(ValueError, match="tokens dtype"):
        fn(logits, tokens.float())


def test_kl_shape_error():
    with pytest.raises(ValueError, match=r"ref_logp shape \(2, 3\).*logp shape \(2, 4\)"):
        kl_k3(torch.zeros(2, 4), torch.zeros(2, 3))


def _loss_inputs(**override) -> LossInputs:
    """A small batch's inputs with beta 0.1 and clip bounds 0.2, with the `override`s: the tensors and the batch's
    token count of LossInputs, the clip bounds and the other keys of LossSettings."""
    logp, old, ref, adv, mask = _batch(b=2, t=3, seed=28)
    given = dict(logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, beta=0.1, eps_low=0.2) | override
    bounds = {key: given.pop(key) for key in ("eps_low", "eps_high") if key in given}
    bounds.setdefault("eps_high", bounds["eps_low"])
    settings = {key: given.pop(key) for key in ("beta", "loss_type", "ratio_level", "max_new_tokens") if key in given}
    return LossInputs(**given, settings=LossSettings(options=ObjectiveOptions(**bounds), **settings))


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(eps_low=0.0), "eps_low=0.0"),
        (dict(eps_low=1.0), "eps_low=1.0"),
        (dict(eps_high=0.0), "eps_high=0.0"),
        (dict(eps_high=1.5), "eps_high=1.5"),
        (dict(beta=-0.1), "beta=-0.1"),
        (dict(ref_logp=None), "ref_logp.*beta=0.1"),
        (dict(loss_type="ppo"), "loss_type='ppo'"),
        (dict(ratio_level="seq"), "ratio_level='seq'"),
        (dict(loss_type="dr_grpo"), "max_new_tokens"),
        (dict(loss_type="dr_grpo", max_new_tokens=0), "max_new_tokens=0"),
        (dict(total_tokens=-1), "total_tokens=-1"),
        (dict(old_logp=torch.zeros(2, 4)), r"old_logp shape \(2, 4\).*\(2, 3\)"),
        (dict(ref_logp=torch.zeros(3, 3)), r"ref_logp shape \(3, 3\).*\(2, 3\)"),
        (dict(mask=torch.ones(2)), r"mask shape \(2,\).*\(2, 3\)"),
        (dict(advantages=torch.zeros(2, 1)), r"advantages shape \(2, 1\)"),
        (dict(logp=torch.zeros(2, 3, 1)), r"logp shape \(2, 3, 1\)"),
    ],
)
def test_policy_loss_errors(override, match):
    inputs = _loss_inputs(**override)
    with pytest.raises(ValueError, match=match):
        policy_loss(inputs)


def test_beta_zero_allows_missing_ref():
    loss, stats = policy_loss(_loss_inputs(beta=0.0, ref_logp=None))
    assert torch.isfinite(loss) and stats["kl"].item() == 0.0


# --------------------------------------------------------------------------------------------------
# The loss-type registry
# --------------------------------------------------------------------------------------------------


def test_accumulation_weights_follow_the_registry():
    from grpo_cli.algorithm import accumulation_weight

    counts = dict(rows=3, rows_total=12, micro_batches_total=4)
    assert accumulation_weight("grpo", **counts) == accumulation_weight("dr_grpo", **counts) == 0.25
    assert accumulation_weight("bnpo", **counts) == 0.25  # 1 / micro-batches, whatever the rows
    assert accumulation_weight("bnpo", rows=1, rows_total=12, micro_batches_total=4) == 0.25
    assert accumulation_weight("dapo", **counts) == 1.0
    assert {t.accumulate for t in LOSS_TYPES.values()} == {"rows", "micro_batches", "sum"}


def test_a_new_loss_type_is_one_function_and_one_entry(compose):
    """Registering a type is all it takes: policy_loss, the accumulation weight and config validation see it."""
    from grpo_cli.algorithm import accumulation_weight, register_loss_type
    from grpo_cli.run.validate import validate

    @register_loss_type("seq_sum_mean", formula="mean_i( sum_t m*l )", accumulate="rows", note="test only")
    def seq_sum_mean(per_token, m, **_):
        return per_token.sum(dim=-1).mean()

    try:
        logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -0.2]])
        mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        loss, _ = policy_loss(LossInputs(logp, torch.tensor([2.0, -1.0]), mask,
                                         settings=LossSettings(loss_type="seq_sum_mean")))
        assert loss.item() == pytest.approx((-4 + 3) / 2)
        assert accumulation_weight("seq_sum_mean", rows=1, rows_total=4, micro_batches_total=2) == 0.25
        validate(compose(["+recipe=quickstart", "algo.loss_type=seq_sum_mean"]))
        with pytest.raises(ValueError, match="registered twice"):
            register_loss_type("seq_sum_mean", formula="x", accumulate="rows")(seq_sum_mean)
    finally:
        del LOSS_TYPES["seq_sum_mean"]


def test_the_documented_loss_table_is_the_registry():
    from pathlib import Path

    from grpo_cli.algorithm import loss_types_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "algorithm.md").read_text()
    assert loss_types_table() in doc, (
        "docs/algorithm.md's loss-type table is out of date; paste the output of "
        "python -c 'from grpo_cli.algorithm import loss_types_table; print(loss_types_table())'")
