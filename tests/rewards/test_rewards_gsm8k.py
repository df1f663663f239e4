"""GSM8K answer extraction, numeric parsing and the correctness/format rewards."""

from __future__ import annotations

import json
import os
import re
import time
from fractions import Fraction
from pathlib import Path

import pytest

from grpo_cli.config.compose import SAMPLE_DATA_DIR
from grpo_cli.rewards import gsm8k
from grpo_cli.rewards.parsing import extract_final_answer, gold_answer, parse_number

# The reference-solution tests run on the GSM8K sample shipped in the package; point this variable at a
# directory holding GSM8K's full train.jsonl and test.jsonl to run them on the whole set instead.
FULL_SET_ENV = "GRPO_GSM8K_DIR"
SAMPLE_ROWS = {"test": 48, "train": 46}
FULL_ROWS = {"test": 1319, "train": 7473}

# (completion, gold answer, expected correctness)
CORRECTNESS_CASES = [
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18", 1.0),
    ("#### 18", "17", 0.0),
    ("Total cost is $1,234.00.\n#### $1,234.00", "1234", 1.0),
    ("The total is 1,234 dollars.\n#### 1,234", "1,234", 1.0),
    ("The temperature dropped by 5 degrees.\n#### -5", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("#### 18.00", "18", 1.0),
    ("#### 18.5", "18", 0.0),
    ("6 times 7 is 42. The answer is 42.", "42", 1.0),
    ("So THE ANSWER IS: 42", "42", 1.0),
    ("Final answer: 42", "42", 1.0),
    ("**Final Answer:** $18", "18", 1.0),
    ("First guess:\n#### 7\nWait, I forgot the 2 extra.\n#### 9", "9", 1.0),
    ("First guess:\n#### 7\nWait, I forgot the 2 extra.\n#### 9", "7", 0.0),
    ("Adding them up gives $\\boxed{72}$.", "72", 1.0),
    ("So the answer is \\boxed{\\$1,200}.", "1200", 1.0),
    ("That leaves \\boxed{\\frac{3}{4}} of the pie.", "0.75", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("<think>3 + 4 = 7</think><answer>7</answer>", "7", 1.0),
    ("<answer> 12 apples </answer>", "12", 1.0),
    ("Q: how many?\nA: 15", "15", 1.0),
    ("Answer: 15 cookies", "15", 1.0),
    ("She sold 5 eggs.\n#### 5 eggs.", "5", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("The discount is 25%.\n#### 25%", "25", 1.0),
    ("The answer is 25 percent of the price.", "25", 1.0),
    ("The answer is 3/4", "3/4", 1.0),
    ("16 - 3 - 4 = 9 eggs are left, 9 * 2 = 18, so she earns 18 dollars at the market", "18", 1.0),
    ("The answer is 42, since 6 * 7 = 42.", "42", 1.0),
    ("I am not sure how to solve this problem.", "4", 0.0),
    ("", "4", 0.0),
    (None, "4", 0.0),
    ("Janet sells 9 eggs.\nShe makes $18.\n#### 18", "Janet sells 9 eggs.\nShe makes $18.\n#### 18", 1.0),
    ("#### 2,125", "It costs <<2000+125=2125>>2125.\n#### 2,125", 1.0),
    # A markdown heading is not an answer line; the explicit statement below it wins.
    ("#### Step 1: add\n3 + 4 = 7 so the answer is 7", "7", 1.0),
    ("#### Step 1: add\n3 + 4 = 7 so the answer is 7", "1", 0.0),
    # Expressions are never evaluated.
    ("#### 2+2", "4", 0.0),
    ("\\boxed{6*7}", "42", 0.0),
    ("{{7*7}}", "49", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), CORRECTNESS_CASES)
def test_correctness_table(completion: str | None, gold: str, expected: float) -> None:
    assert gsm8k.correctness([None], [completion], answer=[gold]) == [expected]


def test_correctness_batch_ignores_extra_fields_and_checks_alignment() -> None:
    completions = ["#### 1", "#### 2", "no idea"]
    scores = gsm8k.correctness(
        ["p"] * 3, completions, answer=["1", "3", "4"], question=["q"] * 3, extra=[0] * 3
    )
    assert scores == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        gsm8k.correctness(["p"], ["#### 1", "#### 2"], answer=["1"])


def test_correctness_accepts_conversational_completions() -> None:
    completion = [{"role": "assistant", "content": "9 * 2 = 18\n#### 18"}]
    assert gsm8k.correctness([None], [completion], answer=["18"]) == [1.0]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("$1,234.00", Fraction(1234)),
        ("18 dollars", Fraction(18)),
        ("5 eggs.", Fraction(5)),
        ("18.", Fraction(18)),
        ("18.00", Fraction(18)),
        ("-5", Fraction(-5)),
        ("−5", Fraction(-5)),
        ("25%", Fraction(25)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("\\$18", Fraction(18)),
        ("18 \\text{ dollars}", Fraction(18)),
        ("1{,}000", Fraction(1000)),
        ("**42**", Fraction(42)),
        ("x = 18", Fraction(18)),
        ("16 - 3 - 4 = 9", Fraction(9)),
        ("0.5", Fraction(1, 2)),
    ],
)
def test_parse_number(raw: str, expected: Fraction) -> None:
    assert parse_number(raw) == expected


@pytest.mark.parametrize(
    "junk",
    ["", "   ", "abc", "n/a", "3/0", "1,23", "2+2", "{{7*7}}", "__import__('os')", "1" * 5000, None, 18],
)
def test_parse_number_rejects_junk(junk: object) -> None:
    assert parse_number(junk) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 7\n#### 9", "9"),
        ("\\boxed{1} then #### 2", "2"),
        ("<answer>3</answer> \\boxed{4}", "4"),
        ("The answer is 5. <answer>6</answer>", "6"),
        ("Answer: 8\nThe final answer is 7.", "7."),
        ("A: 8 and then 9 more", "8 and then 9 more"),
        ("a 1, b 2, c 3.", "3"),
        ("nothing here", None),
        ("", None),
    ],
)
def test_extract_final_answer_priority(text: str, expected: str | None) -> None:
    """The raw captured text is returned; parse_number reads the number at its start."""
    assert extract_final_answer(text) == expected


def test_gold_answer() -> None:
    assert gold_answer("Some reasoning <<1000+250=1250>>.\n#### 1,250") == "1250"
    assert gold_answer("  42 ") == "42"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("#### 7", 1.0),
        ("Reasoning.\n#### -1,234.5\n\n", 1.0),
        ("Reasoning.\n#### $18", 1.0),
        ("The answer is 7.", 0.0),
        ("\\boxed{7}", 0.0),
        ("#### 7\n#### 7", 0.0),
        ("#### 6\nOops, recount.\n#### 7", 0.0),
        ("#### 7\nHope that helps!", 0.0),
        ("#### seven", 0.0),
        ("#### 7 apples", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_format_reward(completion: str | None, expected: float) -> None:
    assert gsm8k.format([None], [completion], answer=["7"]) == [expected]


def test_prompts_state_the_rewarded_format() -> None:
    assert "#### <number>" in gsm8k.ANSWER_FORMAT_INSTRUCTION
    assert gsm8k.ANSWER_FORMAT_INSTRUCTION in gsm8k.SYSTEM_PROMPT


def _load(split: str) -> list[dict[str, str]]:
    """GSM8K rows of `split`: the whole set when GRPO_GSM8K_DIR is set (a missing file there fails the
    test), else the packaged sample; the row count is checked either way."""
    full_dir = os.environ.get(FULL_SET_ENV)
    path = (Path(full_dir) if full_dir else SAMPLE_DATA_DIR / "gsm8k") / f"{split}.jsonl"
    if not path.is_file():
        pytest.fail(f"{path} does not exist ({FULL_SET_ENV}={full_dir!r}); unset it to use the packaged sample")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == (FULL_ROWS if full_dir else SAMPLE_ROWS)[split], path
    return rows


@pytest.mark.parametrize("split", ["test", "train"])
def test_reference_solutions_score_correct_and_well_formatted(split: str) -> None:
    rows = _load(split)
    solutions = [row["answer"] for row in rows]
    assert gsm8k.correctness([None] * len(rows), solutions, answer=solutions) == [1.0] * len(rows)
    assert gsm8k.format([None] * len(rows), solutions) == [1.0] * len(rows)


@pytest.mark.parametrize("split", ["test", "train"])
def test_reference_solutions_with_wrong_final_number_score_zero(split: str) -> None:
    rows = _load(split)
    golds = [row["answer"] for row in rows]
    wrong = []
    for gold in golds:
        value = parse_number(gold_answer(gold))
        assert value is not None and value.denominator == 1, gold
        wrong.append(re.sub(r"####.*\Z", f"#### {value + 1}", gold.rstrip(), flags=re.DOTALL))
    assert all(w != g for w, g in zip(wrong, golds, strict=True))
    assert gsm8k.correctness([None] * len(rows), wrong, answer=golds) == [0.0] * len(rows)


def test_sample_covers_thousands_commas_and_negative_answers() -> None:
    """The sample keeps the gold-answer forms the parser must handle, not only the easy first rows."""
    golds = [gold_answer(row["answer"]) for row in _load("test")]
    raw = [row["answer"].rsplit("####", 1)[1] for row in _load("test")]
    assert any("," in r for r in raw)
    assert any(g.startswith("-") for g in golds)


def test_adversarial_long_completions_are_parsed_in_linear_time() -> None:
    """Unclosed markers repeated across ~200k characters must not trigger quadratic scans."""
    adversarial = [
        "\\boxed{" * 30_000,
        "<answer>" * 30_000,
        "the answer is " * 15_000,
        "A: " * 60_000,
        "\n" * 200_000,
        "#### " * 40_000,
        "1," * 100_000,
        "1" * 200_000,
        "=" * 200_000,
        "{" * 200_000,
    ]
    start = time.perf_counter()
    assert gsm8k.correctness([None] * 10, adversarial, answer=["4"] * 10) == [0.0] * 10
    assert gsm8k.format([None] * 10, adversarial) == [0.0] * 10
    assert time.perf_counter() - start < 10.0
