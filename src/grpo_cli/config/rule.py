"""The vocabulary of an option's declaration: `Rule` (a test of one value and the words for what passes) and the
rules most options use (integer, number, one_of, BOOLEAN, TEXT, ...), with `fail`, the one line of a bad value."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from omegaconf import DictConfig, ListConfig

from grpo_cli.base.errors import ConfigError


def shown(value) -> str:
    """A value as YAML spells it: true, false, null, a list in brackets."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


def fail(key: str, value, allowed: str):
    raise ConfigError(f"{key}={shown(value)} is invalid: {allowed}")


@dataclass(frozen=True)
class Rule:
    """A test of one value. `allowed` says what passes (a callable for a registry's names, read when asked);
    the error line says `verb allowed`, or `failure` where that reads better."""

    test: Callable[[object], bool]
    allowed: str | Callable[[], str]
    verb: str = "needs"
    failure: str = ""
    choices: Callable[[], tuple] | None = None  # a rule that allows a list of values: that list, read when asked

    def describe(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed

    def message(self, key: str) -> str:
        """`{name}` in the text becomes the key's last part (`needs 0 < clip_eps < 1`), `{key}` the whole key: advice
        names the key the user typed, whichever of the keys that share the rule it is."""
        text = self.failure or f"{self.verb} {self.describe()}"
        return text.replace("{name}", key.rpartition(".")[2]).replace("{key}", key)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(minimum: int | None = None) -> Rule:
    if minimum is None:
        return Rule(is_int, "an integer")
    return Rule(lambda v: is_int(v) and v >= minimum, f"an integer >= {minimum}")


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Rule:
    """A finite number within the bounds given; `*_open` leaves the bound itself out."""
    def test(v) -> bool:
        return is_number(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high))

    if low is None and high is None:
        return Rule(test, "a finite number")
    if high is None:
        return Rule(test, f"{{name}} {'>' if low_open else '>='} {low}")
    return Rule(test, f"{low} {'<' if low_open else '<='} {{name}} {'<' if high_open else '<='} {high}")


def one_of(*choices, names: Callable[[], tuple] | None = None) -> Rule:
    """One of `choices`, or of the names `names()` returns when asked (a plug-in registry)."""
    def current() -> tuple:
        return names() if names else choices

    return Rule(lambda v: any(v == c and type(v) is type(c) for c in current()),
                lambda: ", ".join(shown(c) for c in current()), verb="use one of", choices=current)


BOOLEAN = Rule(lambda v: isinstance(v, bool), "true or false", verb="use")
AUTO_OR_BOOLEAN = Rule(lambda v: v == "auto" or isinstance(v, bool), "auto, true or false", verb="use")
TEXT = Rule(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
ANY_TEXT = Rule(lambda v: isinstance(v, str), "a string")
MAPPING = Rule(lambda v: isinstance(v, DictConfig), "a mapping")
TEXT_LIST = Rule(lambda v: isinstance(v, ListConfig) and all(isinstance(t, str) for t in v), "a list of strings")
