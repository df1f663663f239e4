"""Sampling G completions per prompt with transformers' generate; ids, masks, texts, truncation flags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList


@dataclass
class EncodedPrompts:
    ids: list[list[int]]
    texts: list[str]
    kept: list[int]          # indices of the rows that survived `overlong=drop`
    truncated: int
    dropped: int


@dataclass
class Rollout:
    """G completions for each of P prompts; completion row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor       # [P, Lp] left-padded, one row per prompt (shared by its G completions)
    prompt_mask: torch.Tensor      # [P, Lp]
    completion_ids: torch.Tensor   # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on real tokens up to and including EOS
    truncated: torch.Tensor        # [N] bool: hit max_new_tokens without EOS
    texts: list[str]
    group_size: int
    interrupted: bool = False      # a stop request ended generation early: the caller discards it


def encode_prompts(tokenizer, rows: list[dict], max_prompt_tokens: int, overlong: str = "truncate") -> EncodedPrompts:
    """Chat-template each row's messages; prompts longer than max_prompt_tokens lose their left end
    (`truncate`) or are dropped (`drop`)."""
    ids, texts, kept, truncated, dropped = [], [], [], 0, 0
    for i, row in enumerate(rows):
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) > max_prompt_tokens:
            if overlong == "drop":
                dropped += 1
                continue
            tokens, truncated = tokens[-max_prompt_tokens:], truncated + 1
        ids.append(tokens)
        texts.append(text)
        kept.append(i)
    return EncodedPrompts(ids, texts, kept, truncated, dropped)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def completion_masks(completion_ids: torch.Tensor, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS; truncated = no EOS at all."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    seen_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~seen_before).long(), ~is_eos.any(dim=1)


class StopWhenRequested(StoppingCriteria):
    """Ends `generate` at the decode step after `stop()` turns true (polled once per decode step)."""

    def __init__(self, stop: Callable[[], bool]):
        self.stop, self.fired = stop, False

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.fired = self.fired or bool(self.stop())
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """One forward over the P prompts; returns (logits at each prompt's last position [P, 1, V], KV cache).
    Gradients flow through the cache when grad is enabled, so G completions can share one prompt pass."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                use_cache=True, logits_to_keep=1)
    return out.logits, out.past_key_values


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], *, num_generations: int, max_new_tokens: int,
             min_new_tokens: int = 0, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
             device=None, stop: Callable[[], bool] | None = None) -> Rollout:
    """G completions for each prompt, ordered so rows g*G .. g*G+G-1 share prompt g.

    The prompts are prefilled once and their KV cache repeated G times, instead of prefilling every
    prompt G times as `num_return_sequences` would. `stop` is polled at every decode step; when it
    turns true generation ends there and the Rollout comes back with `interrupted=True`."""
    device = device or next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, device)
    eos = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    cache = None
    if ids.shape[1] > 1:
        _, cache = prefill(model, ids[:, :-1], mask[:, :-1])
        cache.batch_repeat_interleave(num_generations)
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
    stopper = StopWhenRequested(stop) if stop is not None else None
    out = model.generate(
        input_ids=ids.repeat_interleave(num_generations, dim=0),
        attention_mask=mask.repeat_interleave(num_generations, dim=0), past_key_values=cache,
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos, do_sample=not greedy, **sampling,
        stopping_criteria=StoppingCriteriaList([stopper]) if stopper else None,
    )
    model.train(was_training)
    completion = out[:, ids.shape[1]:]
    cmask, truncated = completion_masks(completion, eos)
    completion = torch.where(cmask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(ids, mask, completion, cmask, truncated, texts, num_generations,
                   interrupted=bool(stopper and stopper.fired))


def completion_logits(model, rollout: Rollout, rows: slice) -> torch.Tensor:
    """Logits [R, T, V] that predict the completion tokens of `rows`, computed only at completion positions.

    The prompts of `rows` are run once each (not once per completion) and their KV cache is indexed out
    to the rows; the gradient through the shared prompt pass is the sum over its rows, as with copies."""
    G = rollout.group_size
    first, last = rows.start // G, (rows.stop - 1) // G
    p_ids, p_mask = rollout.prompt_ids[first:last + 1], rollout.prompt_mask[first:last + 1]
    prompt_logits, cache = prefill(model, p_ids, p_mask)
    owner = torch.arange(rows.start, rows.stop, device=p_ids.device) // G - first
    cache.reorder_cache(owner)
    c_ids = rollout.completion_ids[rows]
    first_logits = prompt_logits[owner]
    if c_ids.shape[1] == 1:
        return first_logits
    full_mask = torch.cat([p_mask[owner], rollout.completion_mask[rows]], dim=1)
    c_pos = p_mask[owner].sum(dim=1, keepdim=True) + torch.arange(c_ids.shape[1] - 1, device=c_ids.device)
    out = model(input_ids=c_ids[:, :-1], attention_mask=full_mask[:, :-1], position_ids=c_pos,
                past_key_values=cache, use_cache=True)
    return torch.cat([first_logits, out.logits], dim=1)
