"""A verifier's score that is not a finite number is refused where the answer is parsed (rewards.remote.score_of):
JSON's NaN and Infinity, and a number too large for a float, which Python's json reads as inf. That completion fails
as garbage does (the others keep their scores, reward.on_error decides), rather than a NaN or inf score reaching
the weighted sum."""

from __future__ import annotations

import pytest
from test_remote_rewards import Server

from grpo_cli.base.errors import RewardError
from grpo_cli.rewards import CompletionsFailed, RewardFunction, RewardSet
from grpo_cli.rewards.remote import RemoteVerifier, ServiceError, score_of

# the answer for each completion, as the verifier writes it
ANSWERS = {"nan": b'{"score": NaN}', "inf": b'{"score": Infinity}', "minus": b"-Infinity", "huge": b'{"score": 1e999}',
           "fine": b'{"score": 0.5}', "bare": b"2"}


@pytest.fixture
def verifier():
    server = Server(lambda path, body: (200, ANSWERS[body["completion"]]))
    yield RemoteVerifier(url=server.url + "/score", retries=0)
    server.close()


@pytest.mark.parametrize("answer", [float("nan"), float("inf"), float("-inf"), {"score": float("nan")},
                                    {"score": float("inf")}])
def test_score_of_refuses_what_is_not_a_finite_number(answer):
    with pytest.raises(ServiceError, match=r"holds no finite number under \"score\""):
        score_of(answer)


def test_non_finite_answers_fail_their_completions_only(verifier):
    completions = ["fine", "nan", "inf", "bare", "minus", "huge"]
    with pytest.raises(CompletionsFailed) as failed:
        verifier(["p"] * len(completions), completions)
    assert failed.value.failed == [1, 2, 4, 5]
    assert [failed.value.scores[i] for i in (0, 3)] == [0.5, 2.0]
    assert str(failed.value) == ("the answer '{\"score\": NaN}' holds no finite number under \"score\" (the verifier "
                                 "must answer a number or {\"score\": number})")
    rewards = RewardSet([RewardFunction("verified", verifier, 1.0)], on_error="zero")
    scoring = rewards.score_all(["p"] * len(completions), completions, {})
    assert scoring.totals == [0.5, 0.0, 0.0, 2.0, 0.0, 0.0] and scoring.errors == 4
    with pytest.raises(RewardError, match=r"reward verified could not score completion 0 \(1 of 1 failed\): the "
                                          r"answer '\{\"score\": Infinity\}' holds no finite number"):
        RewardSet([RewardFunction("verified", verifier, 1.0)]).score(["p"], ["inf"], {})
