"""The reserved KV cache (rollout/kv_cache.py): every update returns what transformers' DynamicLayer returns,
through growth past the reserve and after the batch operations generate uses; and a rollout with it draws the
tokens the plain cache draws."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from grpo_cli.rollout.kv_cache import ReservedLayer, reserve


def states(g: torch.Generator, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)


def test_a_reserved_layer_returns_what_a_dynamic_layer_returns():
    g = torch.Generator().manual_seed(0)
    plain = DynamicLayer()
    plain.update(*states(g, 3, 5))
    reserved = ReservedLayer(plain.keys, plain.values, extra=2)
    for step in range(7):  # past the reserve of 2, twice
        if step == 3:  # generate's batch operations replace the tensors: the next update must not write stale rows
            for layer in (plain, reserved):
                layer.batch_select_indices(torch.tensor([2, 0]))
        if step == 5:
            for layer in (plain, reserved):
                layer.reorder_cache(torch.tensor([1, 0]))
        new = states(g, plain.keys.shape[0], 1)
        want, got = plain.update(*new), reserved.update(*new)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        assert reserved.get_seq_length() == plain.get_seq_length()


def test_reserve_moves_only_plain_dynamic_layers():
    g = torch.Generator().manual_seed(1)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(*states(g, 2, 3), layer)
    assert all(type(layer) is ReservedLayer for layer in reserve(cache, 8).layers)
    assert cache.get_seq_length() == 3
    empty = DynamicCache()
    assert reserve(empty, 8) is empty and not empty.layers


def test_a_rollout_with_the_reserved_cache_draws_the_plain_caches_tokens():
    """The hf engine's prefilled cache is reserved; transformers' own generate on the repeated prompts (its plain
    cache, no prefill) draws the same greedy tokens."""
    from conftest import tiny_lora_policy

    from grpo_cli.rollout import HFEngine, SamplingParams
    from grpo_cli.rollout.common import eos_ids, left_pad

    lm = tiny_lora_policy()
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    roll = HFEngine(lm.model, lm.tokenizer, lm.device).generate(prompts, 2, SamplingParams(
        max_new_tokens=12, min_new_tokens=12, greedy=True))
    ids, mask = left_pad(prompts, lm.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        out = lm.model.generate(input_ids=ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0),
                                max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=eos_ids(lm.model, lm.tokenizer))
    assert torch.equal(roll.completion_ids, out[:, ids.shape[1]:])
