"""Sampling G completions per prompt with transformers' generate; ids, masks, texts, truncation flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EncodedPrompts:
    ids: list[list[int]]
    texts: list[str]
    kept: list[int]          # indices of the rows that survived `overlong=drop`
    truncated: int
    dropped: int


@dataclass
class Rollout:
    prompt_ids: torch.Tensor       # [N, Lp] left-padded
    prompt_mask: torch.Tensor      # [N, Lp]
    completion_ids: torch.Tensor   # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on real tokens up to and including EOS
    truncated: torch.Tensor        # [N] bool: hit max_new_tokens without EOS
    texts: list[str]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


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


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], *, num_generations: int, max_new_tokens: int,
             min_new_tokens: int = 0, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
             device=None) -> Rollout:
    """G completions for each prompt, ordered so rows g*G .. g*G+G-1 share prompt g."""
    device = device or next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, device)
    eos = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
        num_return_sequences=num_generations, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
        do_sample=not greedy, **sampling,
    )
    model.train(was_training)
    completion = out[:, ids.shape[1]:]
    cmask, truncated = completion_masks(completion, eos)
    completion = torch.where(cmask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(
        prompt_ids=ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=mask.repeat_interleave(num_generations, dim=0),
        completion_ids=completion,
        completion_mask=cmask,
        truncated=truncated,
        texts=texts,
    )
