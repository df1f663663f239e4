"""algo.sampler_correction: the weights of TRL 1.16's vllm_importance_sampling_* on the sampler's and the trainer's
log-probs, against hand-computed values and against TRL's own code on one batch; where they enter the loss; the
mismatch metrics. Pure math: no vLLM needed."""

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from grpo_cli import algorithm
from grpo_cli.algorithm import SamplerCorrection, sampler_correction_weights, sampler_mismatch_stats

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# two rows of three tokens; row 1's last token is padding. d = trainer - sampler
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -9.0]])
SAMPLER = torch.tensor([[-1.5, -0.5, -0.5], [-0.1, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_weights_by_hand():
    d = [[0.5, -1.5, 0.0], [-0.1, -2.0, 0.0]]
    raw = torch.tensor(d).exp()
    truncated = sampler_correction_weights(TRAINER, SAMPLER, MASK, "token_truncate", clip_min=0.3, clip_max=1.5)
    torch.testing.assert_close(truncated, torch.tensor([[1.5, 0.3, 1.0], [math.exp(-0.1), 0.3, 1.0]]))
    masked = sampler_correction_weights(TRAINER, SAMPLER, MASK, "token_mask", clip_min=0.3, clip_max=1.5)
    torch.testing.assert_close(masked, torch.tensor([[0.0, 0.0, 1.0], [math.exp(-0.1), 0.0, 1.0]]))
    open_bounds = sampler_correction_weights(TRAINER, SAMPLER, MASK, "token_mask", clip_min=None, clip_max=None)
    torch.testing.assert_close(open_bounds, raw)


def test_sequence_weights_by_hand():
    # row sums of d over real tokens: -1.0 and -2.1 (the padded position's -9 is masked out)
    truncated = sampler_correction_weights(TRAINER, SAMPLER, MASK, "sequence_truncate", clip_min=0.2, clip_max=3.0)
    torch.testing.assert_close(truncated, torch.tensor([[math.exp(-1.0)], [0.2]]))
    masked = sampler_correction_weights(TRAINER, SAMPLER, MASK, "sequence_mask", clip_min=0.2, clip_max=3.0)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(-1.0)], [0.0]]))
    assert sampler_correction_weights(TRAINER, SAMPLER, MASK, "none") is None


def test_nan_sampler_logprob_counts_as_no_correction():
    sampler = SAMPLER.clone()
    sampler[0, 1] = float("nan")
    w = sampler_correction_weights(TRAINER, sampler, MASK, "token_truncate", clip_max=None)
    assert float(w[0, 1]) == 1.0
    stats = sampler_mismatch_stats(TRAINER, sampler, MASK, w, "token_truncate")
    assert stats["sampler/logp_diff_max"] == pytest.approx(2.0)  # the NaN is left out, the padded 9 too


def test_mismatch_stats_by_hand():
    w = sampler_correction_weights(TRAINER, SAMPLER, MASK, "token_mask", clip_min=0.3, clip_max=1.5)
    stats = sampler_mismatch_stats(TRAINER, SAMPLER, MASK, w, "token_mask")
    assert stats["sampler/logp_diff_mean"] == pytest.approx((0.5 + 1.5 + 0.0 + 0.1 + 2.0) / 5)
    assert stats["sampler/logp_diff_max"] == pytest.approx(2.0)
    assert stats["sampler/corrected_frac"] == pytest.approx(3 / 5)
    w = sampler_correction_weights(TRAINER, SAMPLER, MASK, "sequence_mask", clip_min=0.2, clip_max=3.0)
    assert sampler_mismatch_stats(TRAINER, SAMPLER, MASK, w, "sequence_mask")["sampler/corrected_frac"] == 0.5


def trl_weights(mode, clip_min, clip_max, old, sampling, completion_mask):
    """The importance-sampling block of TRL 1.16's GRPOTrainer._generate_and_score_completions, run as TRL wrote it."""
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                         "                mask =")
    end = source.index("            # Compute the per-token log probabilities for the reference model", start)
    block = textwrap.dedent(source[start:end])
    self = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                           vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    scope = {"self": self, "torch": torch, "math": math, "old_per_token_logps": old, "tool_mask": None,
             "sampling_per_token_logps": sampling, "completion_mask": completion_mask}
    exec(block, scope)  # noqa: S102 - TRL's own source, to compare with
    assert trl.__version__ == "1.16.0"
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.slow  # imports TRL
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_weights_equal_trls(mode, bounds):
    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(8, 12, generator=gen) * 3
    sampler = trainer + 0.4 * torch.randn(8, 12, generator=gen)
    mask = (torch.arange(12)[None, :] < torch.randint(3, 13, (8, 1), generator=gen)).long()
    clip_min, clip_max = bounds
    want = trl_weights(mode, clip_min, clip_max, trainer, sampler, mask)
    got = sampler_correction_weights(trainer, sampler, mask, mode, clip_min=clip_min, clip_max=clip_max)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if mode.startswith("token"):
        assert got.shape == (8, 12)
    else:
        assert got.shape == (8, 1)


def test_weights_multiply_the_policy_term_only():
    """TRL multiplies the per-token policy loss by the weights before adding beta * KL: so does policy_loss."""
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 5, generator=gen) * 2
    ref = logp + 0.1 * torch.randn(4, 5, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(4, 5)
    w = torch.rand(4, 5, generator=gen) * 2
    beta = 0.1
    settings = algorithm.LossSettings(beta=beta)
    loss, _ = algorithm.policy_loss(algorithm.LossInputs(logp, adv, mask, ref_logp=ref, sampler_weights=w,
                                                         settings=settings))
    kl = algorithm.kl_k3(logp, ref)
    want = ((-adv[:, None] * w + beta * kl).sum(-1) / 5).mean()  # ratio 1: the surrogate is -A
    torch.testing.assert_close(loss, want)
    plain, _ = algorithm.policy_loss(algorithm.LossInputs(logp, adv, mask, ref_logp=ref, settings=settings))
    assert abs(float(plain) - float(loss)) > 1e-3


def test_sampler_correction_records_the_first_pass_only():
    correction = SamplerCorrection("token_mask", 0.3, 1.5)
    rows = slice(0, 2)
    w = correction.weights(TRAINER, None, SAMPLER, rows, MASK, record=True)
    assert w is not None and float(w[0, 0]) == 0.0
    correction.weights(TRAINER, None, SAMPLER, rows, MASK, record=False)
    metrics = correction.metrics()
    assert metrics["sampler/corrected_frac"] == pytest.approx(3 / 5)
    assert correction.metrics() == {}  # forgotten once read
    # an engine without sampler log-probs
    assert correction.weights(TRAINER, None, None, rows, MASK, record=True) is None
    assert SamplerCorrection("none").weights(TRAINER, None, SAMPLER, rows, MASK, record=True) is None


def test_weights_compare_the_sampler_with_the_old_log_probs_not_the_current_ones():
    """Off-policy (several updates per rollout) the policy that sampled is `old`, not the policy being trained: the
    weights must not follow `logp` as it moves away."""
    correction = SamplerCorrection("token_truncate", None, None)
    current = TRAINER - 0.7  # the policy after an update
    rows = slice(0, 2)
    w = correction.weights(current, TRAINER, SAMPLER, rows, MASK, record=True)
    torch.testing.assert_close(w, sampler_correction_weights(TRAINER, SAMPLER, MASK, "token_truncate", None, None))
    assert not torch.allclose(w, sampler_correction_weights(current, SAMPLER, MASK, "token_truncate", None, None))
    assert correction.metrics()["sampler/logp_diff_mean"] == pytest.approx((0.5 + 1.5 + 0.0 + 0.1 + 2.0) / 5)


def test_mismatch_metrics_are_token_means_over_the_micro_batches():
    """Micro-batches of 1 and 4 real tokens: the step's mean is over its 5 tokens, not the mean of 2 means."""
    correction = SamplerCorrection("token_mask", 0.3, 1.5)
    trainer = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-3.0, 0.0, 0.0, 0.0], [-1.2, -1.2, -1.2, -1.2]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    for rows in (slice(0, 1), slice(1, 2)):
        correction.weights(trainer[rows], None, sampler, rows, mask[rows], record=True)
    metrics = correction.metrics()
    assert metrics["sampler/logp_diff_mean"] == pytest.approx((2.0 + 4 * 0.2) / 5)
    assert metrics["sampler/logp_diff_max"] == pytest.approx(2.0)
    assert metrics["sampler/corrected_frac"] == pytest.approx(1 / 5)  # exp(2) = 7.4 > 1.5: masked; exp(0.2) kept


def test_off_policy_mask_measures_the_drift_from_the_sampler_when_it_reported_log_probs():
    """TRL 1.16 measures the off-policy sequence mask against the sampler's log-probs where a sampler gave them: on
    policy (old = logp) a sampler that disagrees still drops a negative-advantage sequence; without them none drops."""
    logp = TRAINER.clone()
    adv = torch.tensor([-1.0, 1.0])
    settings = algorithm.LossSettings(off_policy_mask_threshold=0.1)
    # mean sampler - logp = 1 > 0.1 on row 0
    off_policy = algorithm.LossInputs(logp, adv, MASK, sampler_logp=logp + 1.0, settings=settings)
    dropped, _ = algorithm.policy_loss(off_policy)
    kept, _ = algorithm.policy_loss(algorithm.LossInputs(logp, adv, MASK, settings=settings))
    assert float(kept) == pytest.approx((1.0 - 1.0) / 2)         # -A per token, per-sequence mean, mean of rows
    assert float(dropped) == pytest.approx((0.0 - 1.0) / 2)      # row 0 (A < 0) dropped
    nan_sampler = logp.clone()
    nan_sampler[0, 1] = float("nan")                             # an unscored token adds no evidence (TRL)
    with_nan, _ = algorithm.policy_loss(algorithm.LossInputs(logp, adv, MASK, sampler_logp=nan_sampler,
                                                             settings=settings))
    assert float(with_nan) == pytest.approx(float(kept))


@pytest.mark.slow  # imports TRL
def test_off_policy_mask_equals_trls_with_a_sampler():
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(24, 10, generator=gen) * 3
    sampler = logp + 0.3 * torch.randn(24, 10, generator=gen)
    sampler[sampler > 0] = 0.0
    sampler[2, 3] = float("nan")
    adv = torch.randn(24, generator=gen)
    mask = (torch.arange(10)[None, :] < torch.randint(2, 11, (24, 1), generator=gen)).float()
    want = GRPOTrainer.get_off_policy_mask(adv[:, None], logp, sampler, mask, 0.05)
    got = algorithm.off_policy_keep(logp, sampler, adv[:, None], mask, 0.05)
    assert torch.equal(got, want) and 0 < float(got.sum()) < 24


@pytest.mark.slow
def test_the_trainer_masks_against_the_rollouts_sampler_log_probs(compose, tmp_path):
    """A rollout whose sampler disagrees with the trainer (its log-probs 1 nat above the trainer's on every token):
    on policy, with algo.off_policy_mask_threshold, the update drops every sequence with A < 0, i.e. equals the
    update with those advantages set to 0; the same batch without sampler log-probs drops none."""
    import dataclasses

    from conftest import fixed_batch, gradients_at_step, make_trainer

    from grpo_cli.rollout import completion_logprobs

    overrides = ("algo.off_policy_mask_threshold=0.1", "algo.beta=0.0", "optimizer=sgd", "optimizer.momentum=0.0")
    trainers = [make_trainer(compose, tmp_path, *overrides) for _ in range(3)]
    batch = fixed_batch(trainers[0], lambda i, G: (i * 7 % 5) % G)
    assert bool((batch.advantages < 0).any()) and bool((batch.advantages > 0).any())
    with torch.no_grad():
        logp = completion_logprobs(trainers[0].model, batch.rollout, slice(0, batch.rewards.numel()),
                                   trainers[0].roll.temperature, None)[0]
    disagreeing = dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout, sampler_logprobs=logp + 1.0))
    without_negatives = dataclasses.replace(batch, advantages=batch.advantages.clamp_min(0.0))
    grads = [gradients_at_step(t) for t in trainers]
    for trainer, b in zip(trainers, (disagreeing, without_negatives, batch), strict=True):
        trainer.update(0, b)
    for got, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(a, b) for a, b in zip(grads[2], grads[1], strict=True))
