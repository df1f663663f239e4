"""Answer extraction and numeric parsing shared by the reward functions.

Model output is only ever treated as text: nothing in this module evaluates,
executes or sympy-parses it. Numbers are recognised with linear-time regular
expressions and compared as exact :class:`fractions.Fraction` values, so
``18.00 == 18`` and ``\\frac{3}{4} == 0.75`` without any expression evaluation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Protocol

__all__ = ["NUMBER", "AnswerReader", "completion_text", "extract_final_answer", "gold_answer", "parse_number"]


class AnswerReader(Protocol):
    """A reward function that says how it reads the answer a completion gives (majority@k's vote,
    step/evaluate.py): a module sets it as `cast(AnswerReader, fn).parse_answer = ...`."""

    parse_answer: Callable[[Any], object]


_MAX_PARSE_CHARS = 1_000  # parse_number only looks at this prefix of its input
_MAX_NUMBER_CHARS = 100  # longer digit runs are rejected, not truncated or converted
_MAX_BOXED_CHARS = 500  # longer \boxed{...} bodies are ignored

# Unsigned decimal: thousands-grouped or plain digits, optional decimals; or a bare ".5".
NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"

_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_COMMAND = re.compile(r"\\[a-zA-Z]+|\\[()\[\]]")
# fmt: off
_REPLACEMENTS = (
    ("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\;", " "), ("\\:", " "), ("\\ ", " "), ("~", " "),
    ("\\$", ""), ("\\%", "%"), ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""),
    ("\\cdot", "*"), ("\\times", "*"), ("×", "*"), ("\\div", "/"), ("÷", "/"),
    ("\\approx", "="), ("≈", "="), ("−", "-"), ("**", " "), ("`", ""),
)
# fmt: on
_CURRENCY = re.compile(r"[$€£¥₹]")
_LEADING_NUMBER = re.compile(
    rf"[\s:=(\[*_\"'<>#]*(?P<sign>[-+])?\s*(?P<num>{NUMBER})(?:\s*/\s*(?P<den>\d+))?"
)
# What may not follow a number for it to be "the answer": more arithmetic or more digits.
_EXPRESSION_TAIL = re.compile(r"\s*(?:[-+*/^]\s*[\d.(]|[,.]?\d)")

_HASH = re.compile(r"####[ \t]*([^\n]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG = re.compile(r"<(/?)answer>", re.IGNORECASE)
_BRACE = re.compile(r"[{}]")
_PHRASE = re.compile(
    r"\b(?:final\s+answer|the\s+answer)\b(?:\s*\*\*)?(?:\s+is\b)?[\s*_:=]*([^\n]*)", re.IGNORECASE
)
_LABEL = re.compile(r"^[ \t*_>#-]*(?:a|answer)[ \t*_]*:[ \t*_]*([^\n]*)", re.IGNORECASE | re.MULTILINE)
_NUMBER_TOKEN = re.compile(rf"(?<![\w.])-?(?:{NUMBER})(?:/\d+)?")


def completion_text(completion: Any) -> str:
    """Return the text of one completion; never raises.

    Accepts a plain string, ``None`` (-> ``""``), or a TRL conversational completion
    (a message dict or a list of them), whose last message's ``content`` is used.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""


def _normalize(s: str) -> str:
    """Reduce LaTeX/markdown/currency decoration to plain text; purely textual."""
    s = _LATEX_FRAC.sub(r"\1/\2", s)
    s = _LATEX_TEXT.sub(r" \1 ", s)
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _LATEX_COMMAND.sub(" ", s).replace("{", "").replace("}", "")
    return _CURRENCY.sub("", s)


def _leading_number(s: str) -> Fraction | None:
    """The number that starts ``s`` (after punctuation), unless it begins an arithmetic expression."""
    m = _LEADING_NUMBER.match(s)
    if m is None or len(m["num"]) > _MAX_NUMBER_CHARS or _EXPRESSION_TAIL.match(s, m.end()):
        return None
    try:
        value = Fraction(m["num"].replace(",", ""))
        if m["den"] is not None:
            value /= int(m["den"])
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m["sign"] == "-" else value


def parse_number(s: str) -> Fraction | None:
    """Parse a stated answer such as ``"$1,234.00"``, ``"18 dollars."``, ``"-5"``, ``"25%"``,
    ``"3/4"``, ``"\\frac{3}{4}"`` or ``"\\$18 \\text{ dollars}"`` into an exact Fraction.

    The number must start the string (leading punctuation, markdown and currency are
    ignored); trailing words/units/periods are ignored; a percent sign is dropped
    (``"25%" -> 25``). If the string starts with a variable or an expression
    (``"x = 18"``, ``"16 - 3 - 4 = 9"``) the text after the last ``=`` is used instead.
    Returns ``None`` for anything else (including non-strings and numbers of more than
    100 characters); never raises, never evaluates.
    """
    if not isinstance(s, str):
        return None
    s = _normalize(s[:_MAX_PARSE_CHARS])
    value = _leading_number(s)
    if value is None and "=" in s:
        value = _leading_number(s.rsplit("=", 1)[1])
    return value


def _boxed_answers(text: str) -> list[str]:
    """Bodies of ``\\boxed{...}`` with balanced braces, in order of their closing brace (long ones skipped)."""
    bodies = {m.end() for m in _BOXED.finditer(text)}  # offsets just after a boxed "{"
    found, opened = [], []
    for brace in _BRACE.finditer(text):  # one pass with a stack of open-brace offsets
        if brace[0] == "{":
            opened.append(brace.end())
        elif opened:
            start = opened.pop()
            if start in bodies and brace.start() - start <= _MAX_BOXED_CHARS:
                found.append(text[start : brace.start()])
    return found


def _tagged_answers(text: str) -> list[str]:
    """Bodies of ``<answer>...</answer>`` (case-insensitive; innermost opening tag), in one linear pass."""
    found, opened = [], None
    for tag in _TAG.finditer(text):
        if not tag[1]:
            opened = tag.end()
        elif opened is not None:
            found.append(text[opened : tag.start()])
            opened = None
    return found


# Candidate finders in priority order; the last parseable candidate of the first productive one wins.
_FINDERS: tuple[Callable[[str], list[str]], ...] = (
    _HASH.findall,
    _boxed_answers,
    _tagged_answers,
    _PHRASE.findall,
    _LABEL.findall,
    _NUMBER_TOKEN.findall,
)


def extract_final_answer(text: str) -> str | None:
    """Return the raw string a careful grader would take as the final answer, or ``None``.

    Markers are tried in priority order: a ``#### N`` line, ``\\boxed{N}``,
    ``<answer>N</answer>``, "the answer is N" / "final answer: N" (case-insensitive),
    a line ``A: N`` / ``Answer: N``, and finally the last number in the text. Within
    one marker kind the last occurrence whose text parses (:func:`parse_number`) wins;
    a marker kind with no parseable occurrence (e.g. a markdown ``#### Step 1`` heading,
    ``\\boxed{x}``) falls through to the next kind. Exactly one candidate is chosen, so
    hedging with several answers gains nothing.
    """
    if not isinstance(text, str):
        return None
    for finder in _FINDERS:
        for candidate in reversed(finder(text)):
            if parse_number(candidate) is not None:
                return candidate.strip()
    return None


def gold_answer(answer: str) -> str:
    """Gold answer from a GSM8K ``answer`` field: the text after ``####``, stripped and
    with commas removed; a string without ``####`` is returned stripped."""
    answer = str(answer)
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()
