"""The calculator recipe's parts (`+recipe=calculator`): a `calculator` tool and the `products` data source.

`calculator` is a tool as `rollout.tools` takes them: type hints and a Google-style docstring give its schema.
It only multiplies: two integer arguments are what the 135M model fills in well once the call is opened for it
(a free-text expression argument drew extra keys and prose in the probes). `products`
asks for the product of two numbers drawn from [data.low, data.high] (three-digit by default in the recipe),
which the embedded 135M model rarely gets right alone.
"""

from __future__ import annotations

import random

from grpo_cli.data import HELD_OUT_OFFSET, SOURCES, Source, _messages


def calculator(a: int, b: int) -> int:
    """Multiplies two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def product_rows(size: int, seed: int, low: int, high: int, suffix: str, system_prompt) -> list[dict]:
    """`What is a * b?` with a, b drawn from [low, high]."""
    rng = random.Random(seed)
    pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(size)]
    return [{"messages": _messages(f"What is {a} * {b}?", system_prompt, suffix), "answer": str(a * b)} for a, b in pairs]


@SOURCES.register("products")
class Products(Source):
    def rows(self, cfg_data, split: str, seed: int) -> list[dict]:
        size, seed = (cfg_data.size, seed) if split == "train" else (cfg_data.get("eval_size", 200), seed + HELD_OUT_OFFSET)
        return product_rows(size, seed, cfg_data.low, cfg_data.high, cfg_data.get("question_suffix") or "",
                            cfg_data.get("system_prompt"))
