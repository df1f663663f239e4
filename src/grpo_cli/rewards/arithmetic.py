"""Rewards for short arithmetic answers (the quickstart task). Text is parsed, never evaluated."""

from __future__ import annotations

import re
from typing import cast

from grpo_cli.rewards.parsing import AnswerReader

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BARE = re.compile(r"\s*-?\d+(?:\.\d+)?\.?\s*")


def _same_number(text: str, target) -> bool:
    try:
        return float(text) == float(str(target).strip())
    except ValueError:
        return False


def correct_last_number(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the last number in the completion equals `answer`, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        numbers = _NUMBER.findall(completion or "")
        scores.append(1.0 if numbers and _same_number(numbers[-1], gold) else 0.0)
    return scores


def last_number(completion) -> float | None:
    """The last number in the completion, as :func:`correct_last_number` reads it (majority@k's vote)."""
    numbers = _NUMBER.findall(completion or "")
    return float(numbers[-1]) if numbers else None


cast(AnswerReader, correct_last_number).parse_answer = last_number


def bare_number(prompts, completions, **_) -> list[float]:
    """1.0 when the whole reply is a single number (an optional final period allowed), else 0.0."""
    return [1.0 if _BARE.fullmatch(completion or "") else 0.0 for completion in completions]
