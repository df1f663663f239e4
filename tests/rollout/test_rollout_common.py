"""Which completion tokens count in the loss: every token up to and including the first EOS, none of the padding
after it, and every token of a truncated row (no EOS within max_new_tokens). A model trained without its EOS in
the loss never learns to stop."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer

from grpo_cli import algorithm
from grpo_cli.model.loading import load_base_model, load_tokenizer
from grpo_cli.rollout import HFEngine, SamplingParams
from grpo_cli.rollout.common import completion_masks, finish_rollout, left_pad


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


def words(tokenizer, text: str = "The answer is 5 apples") -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_mask_is_one_up_to_and_including_the_first_eos(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    other_eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # a model's generation_config may add EOS ids
    w = words(tokenizer)
    assert len(w) >= 6 and eos not in w and other_eos not in w
    rows = [
        (w[:3] + [eos] + [pad, pad], [1, 1, 1, 1, 0, 0], False),       # stopped: its EOS counts, the padding does not
        (w[:6], [1, 1, 1, 1, 1, 1], True),                            # truncated: counts to its end
        ([eos] + [pad] * 5, [1, 0, 0, 0, 0, 0], False),                # EOS first: only the EOS
        (w[:5] + [eos], [1, 1, 1, 1, 1, 1], False),                    # EOS on the last position
        ([w[0], other_eos, w[1], eos, w[2], pad], [1, 1, 0, 0, 0, 0], False),  # the first EOS of any id ends it
    ]
    ids = torch.tensor([r[0] for r in rows])
    mask, truncated = completion_masks(ids, sorted({eos, other_eos}))
    assert mask.tolist() == [r[1] for r in rows]
    assert truncated.tolist() == [r[2] for r in rows]


def test_finish_rollout_pads_after_the_first_eos_and_keeps_its_mask(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    w = words(tokenizer)
    prompt_ids, prompt_mask = left_pad([w[:2], w[:3]], pad, "cpu")
    completion = torch.tensor([w[:2] + [eos] + w[2:4], w[:5]])  # row 0 sampled on after its EOS
    roll = finish_rollout(tokenizer, [eos], prompt_ids, prompt_mask, completion, num_generations=1, interrupted=False)
    assert roll.completion_ids.tolist() == [w[:2] + [eos, pad, pad], w[:5]]
    assert roll.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert roll.truncated.tolist() == [False, True]
    assert roll.texts == [tokenizer.decode(w[:2]), tokenizer.decode(w[:5])]


def expected_mask(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return [1] * (i + 1) + [0] * (len(tokens) - i - 1), False
    return [1] * len(tokens), True


def test_the_loss_counts_what_the_engine_generated_up_to_its_eos(tokenizer):
    """The tiny model's sampled tokens, one of them made the model's EOS: the engine's rows stop there, and the
    policy loss has a gradient on every token up to and including that EOS, none after; a row that never met
    an EOS has a gradient on all of its tokens."""
    model = load_base_model("tiny-random", tokenizer, torch.float32, tiny={"hidden_size": 64, "num_layers": 2,
                                                                           "num_heads": 4})
    engine = HFEngine(model, tokenizer)
    prompts = [words(tokenizer, "What is 2 + 3?"), words(tokenizer, "Hi")]
    torch.manual_seed(0)
    free = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8)).completion_ids
    stop_token = int(free[0, 2])  # row 0 stops after three tokens once this token is an EOS
    assert stop_token not in free[0, :2].tolist()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_token]
    torch.manual_seed(0)
    roll = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8))

    stops = {tokenizer.eos_token_id, stop_token}
    wanted = [expected_mask(row, stops) for row in free.tolist()]
    assert roll.completion_mask.tolist() == [m for m, _ in wanted]
    assert roll.truncated.tolist() == [t for _, t in wanted]
    assert roll.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert any(t for _, t in wanted), "a truncated row is part of what this test pins"

    logp = torch.zeros(roll.completion_ids.shape, requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = algorithm.policy_loss(algorithm.LossInputs(logp, advantages, roll.completion_mask))
    loss.backward()
    assert (logp.grad != 0).long().tolist() == [m for m, _ in wanted]


@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_trainer_loss_mask_is_the_completion_mask_less_truncated_rows_if_asked(compose, tmp_path, mask_truncated):
    """A real training step of the tiny model with a quarter of its vocabulary made EOS: rows stop early (with
    padding after the EOS) or run to max_new_tokens; the loss counts exactly the completion mask, and with
    algo.mask_truncated=true none of a truncated row."""
    trainer = make_trainer(compose, tmp_path, f"algo.mask_truncated={str(mask_truncated).lower()}")
    eos = trainer.tokenizer.eos_token_id
    trainer.model.generation_config.eos_token_id = list(range(eos, trainer.model.config.vocab_size, 4))
    _, batch = trainer.step(0)
    roll = batch.rollout
    assert roll.truncated.any() and not roll.truncated.all()
    assert (roll.completion_mask[~roll.truncated] == 0).any()  # padding after an EOS
    kept = (~roll.truncated).float().unsqueeze(1) if mask_truncated else torch.ones(len(roll.truncated), 1)
    assert torch.equal(batch.mask, roll.completion_mask.float() * kept)
