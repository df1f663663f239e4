"""GSM8K rewards: numeric correctness against the gold answer, and the ``#### <number>`` format.

Reward functions follow the TRL contract ``fn(prompts, completions, **row_fields) -> list[float]``:
row fields arrive as lists aligned with ``completions`` and unknown fields are ignored. Completions
are parsed as text only (see :mod:`grpo_cli.rewards.parsing`); ``None``/empty ones score 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, cast

from grpo_cli.config.prompts import ANSWER_FORMAT_INSTRUCTION, SYSTEM_PROMPTS
from grpo_cli.rewards.parsing import (
    NUMBER,
    AnswerReader,
    completion_text,
    extract_final_answer,
    gold_answer,
    parse_number,
)

__all__ = ["ANSWER_FORMAT_INSTRUCTION", "SYSTEM_PROMPT", "correctness", "final_answer", "format"]

SYSTEM_PROMPT = SYSTEM_PROMPTS["gsm8k"]

# The whole last line: "#### " then one number, optionally with "$", sign, thousands commas, decimals.
_ANSWER_LINE = re.compile(rf"####[ \t]*(?:\$-?|-?\$?)(?:{NUMBER})")


def correctness(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 where the completion's final answer (:func:`extract_final_answer`) equals the gold answer
    numerically (exact rational comparison), else 0.0.

    ``answer[i]`` may be a bare gold number (``"18"``, ``"1,234"``) or a full GSM8K solution ending in
    ``#### N``. Raises ``ValueError`` if ``answer`` and ``completions`` differ in length.
    """
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = parse_number(gold_answer(gold)) if gold is not None else None
        stated = extract_final_answer(completion_text(completion))
        scores.append(float(expected is not None and stated is not None and parse_number(stated) == expected))
    return scores


def final_answer(completion: Any) -> Fraction | None:
    """The number a completion states as its final answer, as :func:`correctness` reads it (majority@k's vote)."""
    stated = extract_final_answer(completion_text(completion))
    return None if stated is None else parse_number(stated)


cast(AnswerReader, correctness).parse_answer = final_answer


def format(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where the completion contains ``####`` exactly once, on its last non-blank line, as
    ``#### <number>`` and nothing else; 0.0 otherwise (absent, repeated, trailing text, units)."""
    return [float(_has_answer_line(completion_text(c))) for c in completions]


def _has_answer_line(text: str) -> bool:
    lines = text.rstrip().splitlines()
    return text.count("####") == 1 and bool(lines) and _ANSWER_LINE.fullmatch(lines[-1].strip()) is not None
