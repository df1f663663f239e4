"""A reward for tests on the tiny random model, imported by the grpo-train processes they start (tests/conftest.py
puts this folder on their PYTHONPATH): it varies with the completion, so groups have spread and the adapter moves.
The quickstart reward alone scores every random completion 0: nothing is learned, and a resume test that compares
adapters compares two untouched ones."""


def by_length(prompts, completions, **_):
    return [len(c) % 5 / 4 for c in completions]
