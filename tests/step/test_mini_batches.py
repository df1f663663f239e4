"""Mini-batches (algo.mini_batches): each step's rollout batch is split into optimizer updates of whole
groups, so that all but the first are off-policy and clip eps acts. Also bnpo against dapo, the scheduler's
unit, resume, and the clip-eps test on the embedded model."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from conftest import VARIED_REWARD as VARIED_BY_LENGTH
from conftest import fixed_batch, gradients_at_step, make_trainer, read_jsonl, straight_and_resumed, use_loss

from grpo_cli import algorithm
from grpo_cli.config.schema import Config
from grpo_cli.rollout import completion_logprobs
from grpo_cli.run.runner import train
from grpo_cli.step.batch import mini_batch_groups
from grpo_cli.step.optim import lr_factor
from grpo_cli.step.trainer import GRPOTrainer


def varied_batch(trainer):
    """Fixed rewards, varied within each group and not in group order."""
    return fixed_batch(trainer, lambda i, G: (i * 7 % 5) % G)


def lora_state(trainer: GRPOTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def grads(trainer: GRPOTrainer) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainer.params])


# ---- the split -----------------------------------------------------------------------------------
def test_mini_batch_groups_do_not_depend_on_the_number_of_ranks():
    assert mini_batch_groups(8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mini_batch_groups(4, 1) == [[0, 1, 2, 3]]
    for prompts, ranks, mini in ((8, 2, 2), (16, 4, 2), (12, 3, 4)):
        share = prompts // ranks
        over_ranks = [sorted(r * share + g for r in range(ranks) for g in mini_batch_groups(share, mini)[j])
                      for j in range(mini)]
        assert over_ranks == mini_batch_groups(prompts, mini)


@pytest.mark.slow
def test_select_groups_keeps_each_completion_with_its_prompt(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path)
    batch = varied_batch(trainer)
    G = trainer.algo.num_generations
    picked = batch.select_groups([2, 0])
    rows = [*range(2 * G, 3 * G), *range(0, G)]
    assert torch.equal(picked.rollout.completion_ids, batch.rollout.completion_ids[rows])
    assert torch.equal(picked.advantages, batch.advantages[rows]) and torch.equal(picked.mask, batch.mask[rows])
    assert picked.prompts == [batch.prompts[i] for i in rows]
    with torch.no_grad():
        whole = completion_logprobs(trainer.model, batch.rollout, slice(0, 4 * G), 0.8, None)[0]
        part = completion_logprobs(trainer.model, picked.rollout, slice(0, 2 * G), 0.8, None)[0]
    real = picked.rollout.completion_mask.bool()
    torch.testing.assert_close(part[real], whole[rows][real], rtol=1e-5, atol=1e-6)


# ---- one mini-batch is the plain GRPO update -----------------------------------------------------
def reference_update(trainer: GRPOTrainer, batch) -> float:
    """Section 7 of the contract by hand for mu = 1, one update over the whole batch: reference log-probs
    with the adapter off, the loss, backward, clip, AdamW step. Returns the loss."""
    algo, rows = trainer.algo, slice(0, batch.rewards.numel())
    temperature, chunk = trainer.roll.temperature, trainer.tcfg.logprob_chunk_size
    trainer.model.train()
    with torch.no_grad(), trainer.model.disable_adapter():
        ref = completion_logprobs(trainer.model, batch.rollout, rows, temperature, chunk)[0]
    trainer.optimizer.zero_grad(set_to_none=True)
    logp = completion_logprobs(trainer.model, batch.rollout, rows, temperature, chunk)[0]
    bounds = algorithm.ObjectiveOptions(eps_low=algo.clip_eps, eps_high=algo.clip_eps)
    settings = algorithm.LossSettings(beta=algo.beta, options=bounds, loss_type=algo.loss_type,
                                      max_new_tokens=trainer.roll.max_new_tokens)
    loss, _ = algorithm.policy_loss(algorithm.LossInputs(logp, batch.advantages, batch.mask, ref_logp=ref,
                                                         settings=settings))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainer.params, trainer.tcfg.max_grad_norm)
    trainer.optimizer.step()
    return float(loss.detach())


@pytest.mark.slow
def test_one_mini_batch_reproduces_the_plain_update(compose, tmp_path):
    overrides = ("optimizer.lr=1e-2", "algo.beta=0.1", "algo.mini_batches=1", "algo.num_iterations=1")
    ours, by_hand = make_trainer(compose, tmp_path, *overrides), make_trainer(compose, tmp_path, *overrides)
    batch = varied_batch(ours)
    before = lora_state(ours)
    assert all(torch.equal(a, b) for a, b in zip(before, lora_state(by_hand), strict=True))
    stats = ours.update(0, batch)
    want_loss = reference_update(by_hand, batch)
    after, want = lora_state(ours), lora_state(by_hand)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the update moved the adapter
    assert all(torch.equal(a, b) for a, b in zip(after, want, strict=True))
    assert stats.loss == want_loss and stats.updates == 1 and stats.clip_fraction == 0.0
    # with micro-batches the same gradient up to float rounding: compared before Adam, which divides by the root
    # of its second moment and so turns a one-ulp difference in a near-zero gradient element into a visible one
    micro = make_trainer(compose, tmp_path, *overrides, "trainer.micro_batch_size=8")
    again = make_trainer(compose, tmp_path, *overrides)
    micro_grads, whole_grads = gradients_at_step(micro), gradients_at_step(again)
    micro.update(0, batch)
    reference_update(again, batch)
    for got, want in zip(micro_grads, whole_grads, strict=True):
        # an element is a sum over the batch's tokens, regrouped by micro-batch: fp32 reordering moves it by at
        # most ~n * 2**-24 * sum|terms| (n ~ 200 tokens here: ~1.2e-5), so the bound scales with the tensor's
        # largest gradient (the size of its terms), not with the element, which cancellation can bring near 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * float(want.abs().max()))
    # and the update with SGD (linear in the gradient) lands where the whole-batch one does, to the same rounding
    sgd = ("optimizer=sgd", "optimizer.momentum=0.0")
    micro_sgd = make_trainer(compose, tmp_path, *overrides, *sgd, "trainer.micro_batch_size=8")
    whole_sgd = make_trainer(compose, tmp_path, *overrides, *sgd)
    micro_sgd.update(0, batch)
    reference_update(whole_sgd, batch)
    for got, want, start in zip(lora_state(micro_sgd), lora_state(whole_sgd), before, strict=True):
        torch.testing.assert_close(got - start, want - start, rtol=1e-4,
                                   atol=2e-5 * float((want - start).abs().max()))


# ---- several mini-batches ------------------------------------------------------------------------
@pytest.mark.slow
def test_later_mini_batches_are_off_policy_and_clip(compose, tmp_path):
    results = {}
    for clip in (0.05, 0.3):
        trainer = make_trainer(compose, tmp_path, "algo.mini_batches=4", f"algo.clip_eps={clip}",
                               "optimizer.lr=3e-2", "algo.beta=0.1")
        batch = varied_batch(trainer)
        stats = trainer.update(0, batch)
        assert stats.updates == 4 and trainer.lr_schedule.updates == 4
        assert abs(stats.first_ratio - 1.0) < 1e-6  # the first update starts from the rollout policy
        assert stats.first_kl == 0.0                # and that policy is the reference (fresh adapter)
        results[clip] = (stats, lora_state(trainer))
    assert results[0.05][0].clip_fraction > results[0.3][0].clip_fraction
    assert results[0.05][0].clip_fraction > 0
    assert any(not torch.equal(a, b) for a, b in zip(results[0.05][1], results[0.3][1], strict=True))


@pytest.mark.slow
def test_scheduler_counts_optimizer_updates(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "algo.mini_batches=2", "algo.num_iterations=2", "optimizer.lr=1e-3",
                           "optimizer.warmup_steps=2", "optimizer.schedule=linear", "trainer.max_steps=3")
    batch = varied_batch(trainer)
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    trainer.update(0, batch)
    factor = partial(lr_factor, "linear", 2 * 4, 3 * 4)  # warmup 2 steps and 3 steps of 2 x 2 updates each
    assert seen == pytest.approx([1e-3 * factor(k) for k in range(4)])
    assert seen == pytest.approx([1e-3 * k / 8 for k in (1, 2, 3, 4)])


# ---- bnpo: the token mean over each micro-batch ---------------------------------------------------
@pytest.mark.slow
def test_bnpo_differs_from_dapo_with_micro_batches_and_equals_it_without(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "optimizer.lr=1e-30", "algo.beta=0.1")
    batch = varied_batch(trainer)
    batch.mask[0, 1:] = 0  # micro-batches with different token counts
    got = {}
    for micro in (None, 8):
        for loss_type in ("bnpo", "dapo"):
            use_loss(trainer, loss_type, micro)
            trainer.update(0, batch)
            got[loss_type, micro] = grads(trainer)
    assert got["bnpo", None].abs().max() > 0
    torch.testing.assert_close(got["bnpo", None], got["dapo", None], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got["dapo", 8], got["dapo", None], rtol=1e-4, atol=1e-7)
    assert not torch.allclose(got["bnpo", 8], got["dapo", 8], rtol=1e-3, atol=1e-6)

    # bnpo with micro-batches is the mean over the micro-batches of their token means (the contract)
    rows_all = slice(0, batch.rewards.numel())
    with torch.no_grad(), trainer.model.disable_adapter():
        ref = completion_logprobs(trainer.model, batch.rollout, rows_all, 0.8, None)[0]
    trainer.optimizer.zero_grad(set_to_none=True)
    parts = [slice(i, i + 8) for i in range(0, batch.rewards.numel(), 8)]
    for rows in parts:
        logp = completion_logprobs(trainer.model, batch.rollout, rows, 0.8, None)[0]
        settings = algorithm.LossSettings(beta=0.1, loss_type="bnpo")
        loss, _ = algorithm.policy_loss(algorithm.LossInputs(logp, batch.advantages[rows], batch.mask[rows],
                                                             ref_logp=ref[rows], settings=settings))
        (loss / len(parts)).backward()
    torch.testing.assert_close(got["bnpo", 8], grads(trainer), rtol=1e-4, atol=1e-7)


# ---- resume ---------------------------------------------------------------------------------------
VARIED_REWARD = "def varied(prompts, completions, **_):\n    return [float(len(c) % 3) for c in completions]\n"


@pytest.mark.slow
def test_resume_with_mini_batches_is_bitwise_identical(tmp_path):
    """A run resumed from its step-2 checkpoint ends with the same adapter and learning rates as the run
    that went straight through (the scheduler counts the 2 x 2 updates of each step)."""
    (tmp_path / "my_rewards.py").write_text(VARIED_REWARD)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    args = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
            "algo.num_generations=4", "algo.mini_batches=2", "algo.num_iterations=2", "optimizer.lr=1e-2",
            "optimizer.schedule=cosine", "optimizer.warmup_steps=1", "trainer.max_steps=4", "trainer.save_every=2",
            "trainer.log_samples_every=0", "+reward.functions.varied._target_=my_rewards.varied"]
    straight, resumed = straight_and_resumed(args, tmp_path, env)
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [r["lr"] for r in a] == [r["lr"] for r in b] and len({r["lr"] for r in a}) == 4
    assert any(r["clip_fraction"] > 0 or r["loss"] != 0 for r in a)  # the run learned something to resume
    first = (straight / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors").read_bytes()
    final = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    assert first != final
    assert final == (resumed / "adapter" / "adapter_model.safetensors").read_bytes()


# ---- the test, on the tiny model ---------------------------------------------------------
# the tiny model with a reward that varies (conftest.VARIED_REWARD) and a learning rate that moves it off-policy
# within a step
CLIPPED = ["+recipe=quickstart", "model=tiny", "data.prompts_per_step=4", "algo.num_generations=4",
           "rollout.max_new_tokens=6", "trainer.max_steps=2", "optimizer.lr=1e-2", "trainer.device=cpu",
           "trainer.log_samples_every=0", *VARIED_BY_LENGTH]


@pytest.mark.slow
def test_clip_eps_changes_training_only_when_updates_are_off_policy(compose, tmp_path):
    """Two 2-step runs of the tiny model that differ only in algo.clip_eps (0.05 vs 0.3): with 4
    mini-batches they clip and end with different adapters; with 1 mini-batch and num_iterations=1 (fully
    on-policy) nothing is clipped and the adapters are identical. The four runs share one loaded model,
    each starting from the same fresh adapter."""
    from grpo_cli.model.loading import load_policy

    lm = None
    runs = {}
    for mini in (4, 1):
        for clip in (0.05, 0.3):
            cfg = compose([*CLIPPED, f"algo.mini_batches={mini}", f"algo.clip_eps={clip}"])
            if lm is None:
                lm = load_policy(Config.of(cfg).model, "cpu", seed=cfg.trainer.seed)
                fresh = {n: p.detach().clone() for n, p in lm.model.named_parameters() if p.requires_grad}
            with torch.no_grad():
                for n, p in lm.model.named_parameters():
                    if p.requires_grad:
                        p.copy_(fresh[n])
            run_dir = tmp_path / f"m{mini}-clip{clip}"
            run_dir.mkdir()
            train(cfg, run_dir, lm=lm)
            adapter = {n: p.detach().clone() for n, p in lm.model.named_parameters() if p.requires_grad}
            runs[mini, clip] = (read_jsonl(run_dir / "metrics.jsonl"), adapter)

    def same(a, b):
        return all(torch.equal(a[n], b[n]) for n in a)

    for (mini, clip), (rows, adapter) in runs.items():
        assert [r["step"] for r in rows] == [0, 1] and not same(adapter, fresh), (mini, clip)
        for r in rows:
            assert r["clip_fraction"] == pytest.approx(r["clip_fraction/low"] + r["clip_fraction/high"])
    assert max(r["clip_fraction"] for r in runs[4, 0.05][0]) > 0
    assert not same(runs[4, 0.05][1], runs[4, 0.3][1])
    assert all(r["clip_fraction"] == 0 for mini_1 in (runs[1, 0.05], runs[1, 0.3]) for r in mini_1[0])
    assert same(runs[1, 0.05][1], runs[1, 0.3][1])
    assert [r["reward"] for r in runs[1, 0.05][0]] == [r["reward"] for r in runs[1, 0.3][0]]
