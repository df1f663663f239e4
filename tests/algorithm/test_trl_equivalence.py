"""Our loss and LoRA gradients equal TRL 1.16's GRPOTrainer._compute_loss on one batch, for every option the two
share (docs/algorithm.md, "Equal to TRL").

One left-padded batch of P=2 prompts x G=4 completions on the tiny model, with EOS in mid-row and truncated rows,
off-policy old log-probs (a good share of tokens outside the clip range) and a reference that differs from the
policy. TRL's `_compute_loss` runs on a GRPOTrainer instance that holds only what that method reads (its
arguments come from a real GRPOConfig, its accelerator is a real single-process Accelerator). Its per-token
log-probs and entropies are ours (the same autograd graph into the LoRA weights: TRL's patched fused head needs a
whole trainer), so the loss formulas are compared exactly; `test_trl_logprobs_equal_ours` compares TRL's own
`selective_log_softmax` and `entropy_from_logits` on the same forward with ours.
"""

import dataclasses
import math
from collections import defaultdict

import pytest
import torch
from conftest import tiny_lora_policy

from grpo_cli import algorithm
from grpo_cli.rollout import Rollout, completion_logprobs

# trl loads its names lazily: GRPOTrainer's own import (~5 s) waits for the first test that uses it, so collecting
# this module (every xdist worker does, make test-fast too, which skips it) stays cheap
trl = pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # 30 loss computations on the tiny model: a few seconds each pass
P, G, T = 2, 4, 6
LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def setup():
    lm = tiny_lora_policy()
    with torch.no_grad():  # the tiny random model is near uniform: a sharper head spreads the entropies
        lm.model.get_output_embeddings().weight.mul_(10.0)
    gen = torch.Generator().manual_seed(0)
    vocab = lm.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (P, 5), generator=gen)
    prompt_mask = torch.ones(P, 5, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    prompt_ids[1, :2] = lm.tokenizer.pad_token_id
    completion_ids = torch.randint(3, vocab, (P * G, T), generator=gen)
    lengths = [2, 4, 6, 6, 3, 6, 1, 5]  # EOS in mid-row; the 6s are truncated (no EOS)
    completion_mask = torch.zeros(P * G, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion_mask[i, :n] = 1
        completion_ids[i, n:] = lm.tokenizer.pad_token_id
    truncated = torch.tensor([n == T for n in lengths])
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, [""] * (P * G), G)
    with torch.no_grad():
        logp = completion_logprobs(lm.model, rollout, slice(0, P * G), 1.0, None)[0]
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    ref = logp + 0.2 * torch.randn(logp.shape, generator=gen)
    advantages = algorithm.group_advantages(torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.0, 0.0, 0.2]), G)
    share = float((((old - logp).exp() - 1).abs() > 0.2)[completion_mask.bool()].float().mean())
    assert share > 0.3, share  # a good share of tokens lies outside the clip range
    return lm, rollout, old, ref, advantages


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None])


def ours(setup, *, beta, loss_type="grpo", ratio_level="token", settings=None, eps=0.2, eps_high=None):
    lm, rollout, old, ref, adv = setup
    lm.model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(lm.model, rollout, slice(0, P * G), 1.0, None, with_entropy=True)
    mask = rollout.completion_mask.float()
    settings = settings or algorithm.LossSettings()
    bounds = dataclasses.replace(settings.options, eps_low=eps, eps_high=eps if eps_high is None else eps_high)
    settings = dataclasses.replace(settings, beta=beta, options=bounds, loss_type=loss_type, ratio_level=ratio_level,
                                   max_new_tokens=T)
    loss, stats = algorithm.policy_loss(algorithm.LossInputs(logp, adv, mask, old, ref, entropy=entropy,
                                                             total_tokens=float(mask.sum()), settings=settings))
    algorithm.accumulated(loss, stats, 1.0, 1).backward()
    return float(loss.detach()), grads(lm.model)


def trl_loss(setup, tmp_path, *, beta, loss_type="grpo", level="token", **args):
    """TRL's _compute_loss on our batch: the prompt repeated per completion, old and ref log-probs given."""
    lm, rollout, old, ref, adv = setup
    args.setdefault("use_bias_correction_kl", False)  # TRL's default is True; ours (the contract's plain k3) False
    config = trl.GRPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=loss_type, importance_sampling_level=level,
                            report_to=[], use_cpu=True, max_completion_length=T, **args)
    trainer = object.__new__(trl.GRPOTrainer)
    from accelerate import Accelerator

    epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
    trainer.__dict__.update(
        args=config, model=lm.model, accelerator=Accelerator(cpu=True), beta=beta, loss_type=loss_type,
        epsilon_low=config.epsilon, epsilon_high=epsilon_high,
        importance_sampling_level=level, top_entropy_quantile=config.top_entropy_quantile,
        off_policy_mask_threshold=config.off_policy_mask_threshold, use_vllm=False,
        vllm_importance_sampling_correction=False, max_completion_length=T, current_gradient_accumulation_steps=1,
        entropy_coef=config.entropy_coef, use_adaptive_entropy=False, _entropy_bonus_enabled=config.entropy_coef != 0.0,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _last_world_entropy=math.inf)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **_):
        # the same log-probs and entropies as ours (test_trl_logprobs_equal_ours compares TRL's own functions)
        return (*completion_logprobs(model, rollout, slice(0, P * G), 1.0, None, with_entropy=True), None)

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    lm.model.zero_grad(set_to_none=True)
    lm.model.train()
    inputs = {"prompt_ids": rollout.prompt_ids.repeat_interleave(G, 0),
              "prompt_mask": rollout.prompt_mask.repeat_interleave(G, 0),
              "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": rollout.completion_mask.sum()}
    loss = trainer._compute_loss(lm.model, inputs)
    loss.backward()
    return float(loss.detach()), grads(lm.model)


def S(**kw):  # noqa: N802 - a short name for the cases table
    option_names = {f.name for f in algorithm.ObjectiveOptions.__dataclass_fields__.values()}
    options = {k: kw.pop(k) for k in list(kw) if k in option_names}
    return algorithm.LossSettings(options=algorithm.ObjectiveOptions(**options), **kw)


# (id, TRL's arguments, ours): the options the two share. eps 0.2 unless named.
CASES = [
    *[(f"{lt}-{level}-beta{beta}", dict(loss_type=lt, level=level, beta=beta),
       dict(loss_type=lt, ratio_level=level, beta=beta))
      for lt in ("grpo", "bnpo", "dapo", "dr_grpo") for level in ("token", "sequence") for beta in (0.0, 0.04)],
    ("eps_high", dict(beta=0.04, epsilon_high=0.28), dict(beta=0.04, eps_high=0.28)),
    ("delta", dict(beta=0.0, delta=1.3), dict(beta=0.0, settings=S(delta=1.3))),
    ("bias_correction_kl", dict(beta=0.1, use_bias_correction_kl=True),
     dict(beta=0.1, settings=S(use_bias_correction_kl=True))),
    ("bias_correction_kl-sequence", dict(beta=0.1, level="sequence", use_bias_correction_kl=True),
     dict(beta=0.1, ratio_level="sequence", settings=S(use_bias_correction_kl=True))),
    ("cispo", dict(beta=0.04, loss_type="cispo", epsilon_high=1.2),
     dict(beta=0.04, loss_type="dapo", settings=S(objective="cispo", cispo_max_ratio=1.2))),
    ("sapo", dict(beta=0.04, loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
     dict(beta=0.04, settings=S(objective="sapo"))),
    ("sapo-sequence", dict(beta=0.0, loss_type="sapo", level="sequence", sapo_temperature_neg=2.0),
     dict(beta=0.0, ratio_level="sequence", settings=S(objective="sapo", sapo_temperature_neg=2.0))),
    ("luspo-beta0", dict(beta=0.0, loss_type="luspo", level="sequence"),
     dict(beta=0.0, ratio_level="sequence", settings=S(objective="luspo"))),
    ("vespo", dict(beta=0.04, loss_type="vespo"), dict(beta=0.04, loss_type="dapo", settings=S(objective="vespo"))),
    ("top_entropy_quantile", dict(beta=0.04, top_entropy_quantile=0.5),
     dict(beta=0.04, settings=S(top_entropy_quantile=0.5))),
    ("off_policy_mask_threshold", dict(beta=0.04, off_policy_mask_threshold=0.02),
     dict(beta=0.04, settings=S(off_policy_mask_threshold=0.02))),
    ("entropy_coef", dict(beta=0.04, entropy_coef=0.05), dict(beta=0.04, settings=S(entropy_coef=0.05))),
    ("entropy_coef-top_entropy-dapo", dict(beta=0.0, loss_type="dapo", entropy_coef=0.05, top_entropy_quantile=0.5),
     dict(beta=0.0, loss_type="dapo", settings=S(entropy_coef=0.05, top_entropy_quantile=0.5))),
]


@pytest.mark.parametrize("trl_args, our_args", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_loss_and_gradients_equal_trls(setup, tmp_path, trl_args, our_args):
    want_loss, want_grad = trl_loss(setup, tmp_path, **trl_args)
    got_loss, got_grad = ours(setup, **our_args)
    if "settings" in our_args or "eps_high" in our_args:  # the option acts on this batch
        plain = {k: v for k, v in our_args.items() if k not in ("settings", "eps_high")}
        if our_args.get("settings") is not None and our_args["settings"].objective in ("cispo", "vespo"):
            plain["loss_type"] = "dapo"
        plain_loss, plain_grad = ours(setup, **plain)
        assert abs(plain_loss - got_loss) > 10 * LOSS_RTOL * abs(got_loss) or \
            float((plain_grad - got_grad).abs().max()) > 10 * GRAD_ATOL
    assert want_grad.abs().max() > 0
    rel = abs(got_loss - want_loss) / max(abs(want_loss), 1e-12)
    grad_diff = float((got_grad - want_grad).abs().max())
    print(f"TRL-EQUIV loss_rel={rel:.2e} grad_abs={grad_diff:.2e}")
    assert rel <= LOSS_RTOL, (got_loss, want_loss)
    assert grad_diff <= GRAD_ATOL, grad_diff


def test_luspo_kl_term_differs_on_purpose(setup, tmp_path):
    """TRL's luspo sums the beta*KL term over each sequence's tokens; ours keeps it a per-sequence token mean (the
    objective is length-scaled, the KL is not): equal at beta=0 (above), different here."""
    want, _ = trl_loss(setup, tmp_path, beta=0.1, loss_type="luspo", level="sequence")
    got, _ = ours(setup, beta=0.1, ratio_level="sequence", settings=S(objective="luspo"))
    assert abs(got - want) / abs(want) > 1e-3


def test_trl_defaults_to_the_bias_corrected_kl(setup, tmp_path):
    """TRL's GRPOConfig has use_bias_correction_kl=True; ours defaults to the contract's plain k3."""
    assert trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True).use_bias_correction_kl is True
    want, _ = trl_loss(setup, tmp_path, beta=0.1, use_bias_correction_kl=True)
    got, _ = ours(setup, beta=0.1)
    assert abs(got - want) / abs(want) > 1e-3


def test_trl_logprobs_equal_ours(setup):
    """TRL's log-prob and entropy functions on the model's logits over prompt + completion (left-padded, position ids
    from the attention mask) equal our completion_logprobs."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    lm, rollout, *_ = setup
    with torch.no_grad():
        logp, entropy = completion_logprobs(lm.model, rollout, slice(0, P * G), 1.0, None, with_entropy=True)
        ids = torch.cat([rollout.prompt_ids.repeat_interleave(G, 0), rollout.completion_ids], 1)
        attention = torch.cat([rollout.prompt_mask.repeat_interleave(G, 0), rollout.completion_mask], 1)
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        logits = lm.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -T - 1:-1].float()
    real = rollout.completion_mask.bool()
    torch.testing.assert_close(selective_log_softmax(logits, ids[:, -T:])[real], logp[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits)[real], entropy[real], rtol=0, atol=1e-4)
    assert float(entropy[real].std()) > 0.05  # the entropies differ, so top_entropy_quantile picks tokens
