"""A prompt as the policy reads it: a row's chat messages through the tokenizer's chat template, as token ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EncodedPrompts:
    ids: list[list[int]]
    texts: list[str]
    kept: list[int]          # indices of the rows that survived `overlong=drop`
    truncated: int
    dropped: int


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
