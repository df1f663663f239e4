"""A prompt as the policy reads it: a row's chat messages through the tokenizer's chat template, as token ids."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.base.errors import DataError, error_line


class Row(dict):
    """A data row (a dict: its fields reach the rewards) that knows where it was read (`where`: FILE:LINE, FILE row
    N), so that what fails on it later (the tokenizer) names that place, and whether the data gave its prompt as chat
    messages (`chat`: TRL's conversational form, in which rewards get it); neither is a field of the row."""

    def __init__(self, fields: dict, where: str, chat: bool = False):
        super().__init__(fields)
        self.where, self.chat = where, chat


def given_as_chat(row: dict) -> bool:
    """Whether the data gave the row's prompt as chat messages (a generated row's is a question: text)."""
    return bool(getattr(row, "chat", False))


def where_of(row: dict) -> str:
    """How a message names a row: where it was read, else its prompt (a generated row)."""
    if isinstance(row, Row):
        return row.where
    text = repr(row.get("messages"))
    return f"the row whose prompt is {text[:60] + '...' if len(text) > 60 else text}"


def with_suffix(question: str, suffix: str) -> str:
    """The question with data.question_suffix added once: a question that already ends with it (rows written with
    the suffix, read with the config that adds it) keeps it as it is."""
    tail = suffix.strip()  # a suffix of blanks only is compared as it is
    return question if not suffix or (question.rstrip().endswith(tail) if tail else question.endswith(suffix)) \
        else question + suffix


def chat_messages(question: str, system_prompt: str | None, suffix: str = "") -> list[dict]:
    """A generated row's chat prompt: data.system_prompt, if any, then the question with data.question_suffix."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": with_suffix(question, suffix or "")}]


@dataclass
class EncodedPrompts:
    ids: list[list[int]]
    texts: list[str]
    kept: list[int]          # indices of the rows that survived `overlong=drop`
    truncated: int
    dropped: int


def encode_prompts(tokenizer, rows: list[dict], max_prompt_tokens: int, overlong: str = "truncate") -> EncodedPrompts:
    """Chat-template each row's messages; prompts longer than max_prompt_tokens lose their left end
    (`truncate`) or are dropped (`drop`). A prompt that the chat template or the tokenizer cannot take is a
    DataError naming its row."""
    ids, texts, kept, truncated, dropped = [], [], [], 0, 0
    for i, row in enumerate(rows):
        try:
            text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception as err:  # noqa: BLE001  jinja and the tokenizers raise many types for a prompt they refuse
            raise DataError(f"{where_of(row)}: the tokenizer's chat template cannot take its prompt "
                            f"({error_line(err)[:160]}); fix or drop that row") from None
        if len(tokens) > max_prompt_tokens:
            if overlong == "drop":
                dropped += 1
                continue
            tokens, truncated = tokens[-max_prompt_tokens:], truncated + 1
        ids.append(tokens)
        texts.append(text)
        kept.append(i)
    return EncodedPrompts(ids, texts, kept, truncated, dropped)
