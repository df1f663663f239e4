"""The `hf` engine: transformers' generate on the policy itself (through the peft LoRA layers), with each
prompt prefilled once and its KV cache repeated for its G completions. What `auto` picks for a quantized base."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from grpo_cli.model import sharding
from grpo_cli.rollout.common import (
    ENGINES,
    Engine,
    Rollout,
    SamplingParams,
    StopFn,
    cache_kwarg,
    eos_ids,
    finish_rollout,
    left_pad,
    prefill,
    sampling_kwargs,
    stop_criteria,
)
from grpo_cli.rollout.kv_cache import reserve


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], *, num_generations: int, max_new_tokens: int,
             min_new_tokens: int = 0, device=None, stop_strings: Sequence[str] = (), stop: StopFn | None = None,
             adapters: list[str] | None = None, draw=None, **sampling) -> Rollout:
    """G completions for each prompt, ordered so rows g*G .. g*G+G-1 share prompt g; `sampling`: the
    keywords of `sampling_kwargs` (greedy, temperature, top_p, top_k, min_p, repetition_penalty; `draw`: its
    sampler). `adapters`: the peft adapter of each prompt, one batch mixing several adapters of one base (peft's
    adapter_names; rollout.shared).

    The prompts are prefilled once and their KV cache repeated G times, instead of prefilling every
    prompt G times as `num_return_sequences` would; the cache has room for the completions reserved
    (rollout/kv_cache.py), so a decode step writes its token in place instead of copying the cache."""
    device = device or next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, device)
    eos = eos_ids(model, tokenizer)
    criteria, fired = stop_criteria(stop, stop_strings, tokenizer, ids.shape[1])
    was_training = model.training
    model.eval()
    # a sharded base (trainer.parallel=fsdp): every decode step all-gathers each layer, a collective, so the ranks
    # step together to the longest (synced_gpus) and agree on the prefill; peft's generate bypasses the root unit.
    # `adapters` (a sweep on one base): each prompt's adapter, a mixed batch
    sharded = sharding.is_sharded(model)
    mixed = {} if adapters is None else {"adapter_names": list(adapters)}
    try:
        cache, sync = {}, {"synced_gpus": True} if sharded else {}
        if (sharding.smallest(ids.shape[1]) if sharded else ids.shape[1]) > 1:
            _, kv = prefill(model, ids[:, :-1], mask[:, :-1], **mixed)
            kv.batch_repeat_interleave(num_generations)
            cache = {cache_kwarg(model): reserve(kv, max_new_tokens)}
        if adapters is not None:
            mixed = {"adapter_names": [name for name in adapters for _ in range(num_generations)]}
        with sharding.root_unsharded(model):
            out = model.generate(
                input_ids=ids.repeat_interleave(num_generations, dim=0),
                attention_mask=mask.repeat_interleave(num_generations, dim=0), **cache, **sync,
                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos, stopping_criteria=criteria, **sampling_kwargs(**sampling, device=device, draw=draw),
                **mixed,
            )
    finally:
        model.train(was_training)
    return finish_rollout(tokenizer, eos, ids, mask, out[:, ids.shape[1]:], num_generations, fired(), stop_strings)


@ENGINES.register("hf")
class HFEngine(Engine):
    """Generation through the peft model itself (LoRA applied per layer): nothing to refresh after an update."""

    name = "hf"

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None) -> Rollout:
        """See Engine.generate; `generate`'s keywords are the fields of `sampling`."""
        return generate(self.model, self.tokenizer, prompt_ids, num_generations=num_generations, device=self.device,
                        stop=stop, **asdict(sampling))
