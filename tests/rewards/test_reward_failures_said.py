"""What a reward's failure says: never an empty `: ` after the exception's name (a MemoryError() has no message),
and under reward.on_error=zero the first failure of a scoring is kept, for the step's line on the console."""

from __future__ import annotations

import pytest

from grpo_cli.base.errors import RewardError
from grpo_cli.rewards import CompletionsFailed, RewardFunction, RewardSet


def out_of_memory(prompts, completions, **_):
    if any("big" in c for c in completions):
        raise MemoryError()
    return [1.0] * len(completions)


def silent(prompts, completions, **_):
    raise ValueError()


def refuses_some(prompts, completions, **_):
    raise CompletionsFailed("", [1.0] * len(completions), [0])


def rewards(fn, on_error="raise", name="r") -> RewardSet:
    return RewardSet([RewardFunction(name, fn, 1.0)], on_error=on_error)


def refusal(fn) -> str:
    with pytest.raises(RewardError) as err:
        rewards(fn).score(["p"] * 2, ["small", "big"], {})
    return str(err.value)


def test_an_exception_without_a_message_is_said_without_an_empty_colon():
    assert refusal(out_of_memory) == ("reward r raised MemoryError on completion 1 (out of memory); fix it or set "
                                      "reward.on_error=zero")
    assert refusal(silent) == "reward r raised ValueError on completion 0 (with no message); fix it or set " \
                              "reward.on_error=zero"
    assert refusal(refuses_some) == ("reward r could not score completion 0 (1 of 2 failed) (with no message); fix it "
                                     "or set reward.on_error=zero")


def test_on_error_zero_keeps_what_the_first_failure_was():
    scoring = rewards(out_of_memory, "zero", "oom").score_all(["p"] * 3, ["small", "big", "big too"], {})
    assert scoring.totals == [1.0, 0.0, 0.0] and scoring.errors == 2
    assert scoring.first_error == "reward oom raised MemoryError on completion 1 (out of memory)"
    assert rewards(refuses_some, "zero").score_all(["p"], ["a"], {}).first_error == \
        "reward r could not score completion 0 (with no message)"
    nan = rewards(lambda prompts, completions, **_: [float("nan")] * len(completions), "zero")
    assert nan.score_all(["p"] * 2, ["a", "b"], {}).first_error == "reward r gave nan for completion 0"
    assert rewards(out_of_memory, "zero").score_all(["p"], ["small"], {}).first_error is None
