"""The step loop in-process on the tiny model: learning direction, exact accumulation, adapter round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_TRAINER, fit, fixed_batch, make_trainer, use_loss

from grpo_cli import algorithm
from grpo_cli.config.schema import Config
from grpo_cli.rollout import completion_logprobs


def varied_batch(trainer):
    """Fixed, varied rewards 0..G-1 within each group."""
    return fixed_batch(trainer, lambda i, G: i % G)


def logprobs(trainer, batch):
    with torch.no_grad():
        return completion_logprobs(trainer.model, batch.rollout, slice(0, batch.rewards.numel()), 0.8, None)[0]


@pytest.mark.slow
def test_loss_goes_down_on_a_fixed_batch(compose, tmp_path):
    """Against the rollout policy (old fixed), the clipped surrogate loss falls with each update."""
    trainer = make_trainer(compose, tmp_path, "algo.beta=0.0", "optimizer.lr=1e-3")
    batch = varied_batch(trainer)
    old = logprobs(trainer, batch)
    losses = []
    wide = algorithm.LossSettings(options=algorithm.ObjectiveOptions(eps_low=0.5, eps_high=0.5))
    for step in range(4):
        trainer.update(step, batch)
        loss, _ = algorithm.policy_loss(algorithm.LossInputs(logprobs(trainer, batch), batch.advantages, batch.mask,
                                                             old, settings=wide))
        losses.append(float(loss))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0, losses


@pytest.mark.slow
def test_micro_batches_give_the_full_batch_gradient(compose, tmp_path):
    """Exact accumulation for every loss type whose loss is defined over the whole update (bnpo is a mean
    of micro-batch token means by definition: tests/step/test_mini_batches.py)."""
    trainer = make_trainer(compose, tmp_path, "optimizer.lr=1e-30")
    batch = varied_batch(trainer)
    for loss_type in (name for name, t in algorithm.LOSS_TYPES.items() if t.accumulate != "micro_batches"):
        grads = []
        for micro_batch_size in (None, 4):
            use_loss(trainer, loss_type, micro_batch_size)
            trainer.update(0, batch)
            grads.append(torch.cat([p.grad.flatten() for p in trainer.params]))
        assert grads[0].abs().max() > 0
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_fresh_adapter_policy_equals_reference(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path)
    batch = varied_batch(trainer)
    policy = logprobs(trainer, batch)
    with trainer.model.disable_adapter():
        reference = logprobs(trainer, batch)
    assert torch.equal(policy, reference)
    assert float(((policy - reference) * batch.mask).abs().max()) == 0.0


@pytest.mark.slow
def test_saved_adapter_reproduces_log_probs(compose, tmp_path):
    from peft import PeftModel

    from grpo_cli.model.loading import load_base_model
    trainer = make_trainer(compose, tmp_path, "optimizer.lr=1e-2")
    batch = varied_batch(trainer)
    trainer.update(0, batch)
    trained = logprobs(trainer, batch)
    adapter_dir = tmp_path / "adapter"
    trainer.save_adapter(adapter_dir)
    sizes = dataclasses.asdict(trainer.cfg.model.tiny)
    base = load_base_model("tiny-random", trainer.tokenizer, torch.float32, tiny=sizes, seed=0)
    reloaded = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        again = completion_logprobs(reloaded, batch.rollout, slice(0, batch.rewards.numel()), 0.8, None)[0]
    with trainer.model.disable_adapter():
        untrained = logprobs(trainer, batch)
    assert not torch.allclose(trained, untrained)
    torch.testing.assert_close(again, trained)


@pytest.mark.slow  # one training step and its evaluation
def test_evaluator_is_given_at_construction(compose, tmp_path):
    """The evaluator is built from the loaded model only when eval.every asks for it, and the evaluation lands
    in the step's metrics."""
    from conftest import read_jsonl

    from grpo_cli.step.evaluate import Evaluator

    built = []

    def make_evaluator(lm):
        built.append(lm)
        return Evaluator.for_training(trainer_cfg, lm)

    assert make_trainer(compose, tmp_path / "never", make_evaluator=make_evaluator).evaluator is None and not built
    overrides = ("eval.every=1", "eval.num_prompts=2", "eval.max_new_tokens=4", "trainer.max_steps=1",
                 "trainer.log_samples_every=0")
    trainer_cfg = Config.of(compose([*TINY_TRAINER, *overrides]))
    (tmp_path / "every").mkdir()  # Hydra makes the run dir
    trainer = make_trainer(compose, tmp_path / "every", *overrides, make_evaluator=make_evaluator)
    assert built == [trainer.lm] and isinstance(trainer.evaluator, Evaluator)
    fit(trainer, tmp_path / "every")
    [row] = read_jsonl(tmp_path / "every" / "metrics.jsonl")
    assert row["eval/num_prompts"] == 2 and 0.0 <= row["eval/accuracy"] <= 1.0
