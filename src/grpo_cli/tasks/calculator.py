"""The calculator recipe's tool (`+recipe=calculator`).

`calculator` is a tool as `rollout.tools` takes them: type hints and a Google-style docstring give its schema.
It only multiplies: two integer arguments are what the 135M model fills in well once the call is opened for it
(a free-text expression argument drew extra keys and prose in a trial run). The recipe asks for the
product of two numbers drawn from [data.low, data.high] (three-digit in the recipe), which the embedded 135M model
rarely gets right alone.
"""

from __future__ import annotations


def calculator(a: int, b: int) -> int:
    """Multiplies two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
