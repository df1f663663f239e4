"""What a reward function may return, the jsonl prompt forms, and the limits checked before a model works."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from conftest import data_config

from grpo_cli.base.errors import ConfigError, DataError, RewardError
from grpo_cli.config.compose import check_interpolations
from grpo_cli.config.rules import check_context_length
from grpo_cli.rewards import RewardFunction, RewardSet, to_scores
from grpo_cli.run.validate import validate
from grpo_cli.tasks.sources import load_rows


# ---- reward return values ---------------------------------------------------------------------------------------
def test_numbers_of_every_kind_are_scores():
    returned = [1, 2.5, True, False, np.float32(0.5), np.int64(3), np.bool_(True), torch.tensor(0.25), np.array(1.5)]
    assert to_scores("f", returned, len(returned)) == [1.0, 2.5, 1.0, 0.0, 0.5, 3.0, 1.0, 0.25, 1.5]
    assert to_scores("f", np.array([1.0, 2.0]), 2) == [1.0, 2.0]
    assert to_scores("f", torch.tensor([1.0, 2.0]), 2) == [1.0, 2.0]
    assert to_scores("f", (x for x in (0.0, 1.0)), 2) == [0.0, 1.0]


@pytest.mark.parametrize("returned,shown", [
    (["1.0", 1.0], "returned str '1.0' for completion 0"),  # a numeric string too: no silent float()
    ([1.0, None], "returned NoneType None for completion 1"),
    ([[1.0], [2.0]], "returned list [1.0] for completion 0"),
    ([torch.tensor([1.0]), 1.0], "returned Tensor tensor([1.]) for completion 0"),
    ([1 + 2j, 1.0], "returned complex (1+2j) for completion 0"),
    (None, "returned NoneType None, not a list of 2 scores"),
    (0.5, "returned float 0.5, not a list of 2 scores"),
    ("ab", "returned str 'ab', not a list of 2 scores"),
    ({"a": 1.0, "b": 0.0}, "returned dict"),
    ([1.0], "returned 1 scores for 2 completions"),
])
def test_non_numbers_and_wrong_counts_are_refused_alike(returned, shown):
    with pytest.raises(RewardError) as err:
        to_scores("mine", returned, 2)
    message = str(err.value)
    assert message.startswith("reward mine " + shown), message
    assert message.endswith("it must return a number per completion (int, float, bool, or a numpy/torch scalar)")


def test_a_broken_return_is_refused_even_with_on_error_zero():
    """on_error=zero forgives a function that raises on some input, not one that returns the wrong thing."""
    def raises(prompts, completions, **_):
        raise ValueError("no")

    def strings(prompts, completions, **_):
        return ["0.5"] * len(completions)

    totals, _, errors = RewardSet([RewardFunction("raises", raises, 1.0)], "zero").score(["p"] * 2, ["a", "b"], {})
    assert totals == [0.0, 0.0] and errors == 2
    with pytest.raises(RewardError, match="reward strings returned str '0.5' for completion 0"):
        RewardSet([RewardFunction("strings", strings, 1.0)], "zero").score(["p"] * 2, ["a", "b"], {})


# ---- how a reward is called -------------------------------------------------------------------------------------
def reward_score(environments, **kwargs):  # verbatim from TRL's examples/scripts/grpo_2048.py
    return [env.score for env in environments]


def reward_len(completions, **kwargs):  # verbatim from TRL's GRPO quick start
    return [-abs(20 - len(completion)) for completion in completions]


async def async_reward(completions, **kwargs):  # TRL: a reward function may be async
    return [float(c == "b") for c in completions]


class Board:
    def __init__(self, score: float):
        self.score = score


class LoopBoundJudge:
    """An async reward class whose state is bound to the event loop of its first call, as an asyncio.Semaphore or an
    async HTTP client's connections are: TRL runs every async reward on one loop."""

    def __init__(self):
        self.loop = None
        self.lock = asyncio.Lock()

    async def __call__(self, completions, **kwargs):
        loop = asyncio.get_running_loop()
        self.loop = self.loop or loop
        if loop is not self.loop:
            raise RuntimeError("bound to a different event loop")
        async with self.lock:
            await asyncio.sleep(0)
        return [1.0] * len(completions)


def test_an_async_reward_keeps_its_event_loop_from_call_to_call():
    """Each call ran on a new loop (asyncio.run): the second step's call of a judge holding loop-bound state
    raised RuntimeError (... bound to a different event loop)."""
    rewards = RewardSet([RewardFunction("judge", LoopBoundJudge(), 1.0)])
    for _ in range(3):
        assert rewards.score(["p"] * 2, ["a", "b"], {})[1] == {"judge": [1.0, 1.0]}


def test_rewards_are_called_by_keyword_as_trl_calls_them():
    """TRL calls `fn(prompts=..., completions=..., **fields)`: its functions that name only some of those run here
    unchanged; one that takes them by position under other names still does, and one without **kwargs gets only
    what it names."""
    fields = {"answer": ["x", "y"], "completion_ids": [[1, 2, 3], [4]], "environments": [Board(2.0), Board(5.0)]}
    functions = {
        "score": reward_score, "len": reward_len, "async": async_reward,
        "positional": lambda p, c, **_: [float(len(p[0]))] * len(c),
        "named": lambda prompts, completions, answer: [float(a == "y") for a in answer],
        "ids": lambda completions, completion_ids, **kwargs: [float(len(ids)) for ids in completion_ids],
    }
    rewards = RewardSet([RewardFunction(name, fn, 1.0) for name, fn in functions.items()])
    _, per_function, errors = rewards.score(["pp", "pp"], ["a" * 20, "b"], fields)
    assert per_function == {"score": [2.0, 5.0], "len": [0.0, -19.0], "async": [0.0, 1.0], "positional": [2.0, 2.0],
                            "named": [0.0, 1.0], "ids": [3.0, 1.0]} and errors == 0


# ---- jsonl prompt forms -----------------------------------------------------------------------------------------
def jsonl_cfg(tmp_path, rows, **extra):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return data_config(source="jsonl", path=str(path), question_suffix=extra.get("suffix", ""),
                       system_prompt=extra.get("system")), path


def test_three_prompt_forms(tmp_path):
    cfg, _ = jsonl_cfg(tmp_path, [
        {"prompt": "What is 1 + 1?", "answer": "2"},
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
        {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 3 + 3?"}],
         "answer": "6"},
    ], suffix=" Just the number.", system="Be brief.")
    rows = load_rows(cfg)
    assert [r["answer"] for r in rows] == ["2", "4", "6"] and all("prompt" not in r for r in rows)
    assert rows[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 1 + 1? Just the number."}]
    assert rows[1]["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2 + 2? Just the number."}]
    # its own system turn is kept, data.system_prompt is not added on top
    assert rows[2]["messages"] == [{"role": "system", "content": "Add."},
                                   {"role": "user", "content": "What is 3 + 3? Just the number."}]


def test_a_multi_turn_prompt_gets_the_suffix_on_its_last_user_turn(tmp_path):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "What is 4 + 4?"}]
    cfg, _ = jsonl_cfg(tmp_path, [{"messages": turns, "answer": "8"}], suffix="!")
    assert load_rows(cfg)[0]["messages"] == [*turns[:2], {"role": "user", "content": "What is 4 + 4?!"}]
    assert turns[2]["content"] == "What is 4 + 4?"  # the row itself is left alone


@pytest.mark.parametrize("row,words", [
    ({"question": "q", "answer": "1"}, ["lacks a prompt", '"prompt" (text, or a list of chat messages) or "messages"']),
    ({"messages": "What is 1 + 1?"},
     ['"messages" is not a list of chat messages', '{"role": "user", "content": "..."}']),
    ({"prompt": [{"content": "no role"}]}, ['"prompt" is not a list of chat messages']),
    ({"prompt": []}, ['"prompt" is not a list of chat messages']),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     ['"messages" ends with an assistant turn', "a field such as answer"]),
    ('["a", "list"]', ["is a JSON list, not an object"]),
])
def test_other_rows_are_refused_naming_the_accepted_forms(tmp_path, row, words):
    cfg, path = jsonl_cfg(tmp_path, [{"prompt": "fine", "answer": "1"}, row])
    with pytest.raises(DataError) as err:
        load_rows(cfg)
    message = str(err.value)
    assert message.startswith(f"{path}:2") and "\n" not in message
    for word in words:
        assert word in message, message


# ---- limits ---------------------------------------------------------------------------------------------------
def test_context_length_check(compose):
    cfg = compose(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=768"])
    check_context_length(cfg, 1024, ("rollout.max_new_tokens",))  # 768 + 256 fits exactly
    check_context_length(cfg, None, ("rollout.max_new_tokens",))  # unknown context: nothing to check
    with pytest.raises(ConfigError) as err:
        check_context_length(cfg, 1000, ("rollout.max_new_tokens",))
    assert str(err.value) == ("rollout.max_new_tokens=768 is invalid: with data.max_prompt_tokens=256 a sequence "
                              "reaches 1024 tokens, beyond the 1000-token context of tiny-random; use "
                              "rollout.max_new_tokens<=744 or lower data.max_prompt_tokens")


def test_declared_context_length_from_the_config_alone(tmp_path, compose):
    from transformers import LlamaConfig

    from grpo_cli.model.loading import declared_context_length

    assert declared_context_length(compose(["model=tiny"]).model) == 1024
    assert declared_context_length(compose(["model=tiny", "model.tiny.max_position_embeddings=4096"]).model) == 4096
    assert declared_context_length(compose(["model=smollm2-135m"]).model) is None  # read from the loaded model
    LlamaConfig(max_position_embeddings=512).save_pretrained(tmp_path)  # a local model dir: AutoConfig, no weights
    assert declared_context_length(compose(["model=tiny", f"model.name_or_path={tmp_path}"]).model) == 512


def test_broken_interpolation_is_one_line(compose):
    cfg = compose(["+recipe=quickstart", "algo.beta=${oops}"])
    with pytest.raises(ConfigError) as err:
        check_interpolations(cfg)
    assert str(err.value).startswith("algo.beta=${oops} is invalid: it does not resolve "
                                     "(Interpolation key 'oops' not found)")
    check_interpolations(compose(["+recipe=quickstart", "eval.max_new_tokens=${rollout.max_new_tokens}"]))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_prompts_per_step_must_divide_over_the_ranks(compose, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    validate(compose(["+recipe=quickstart", "trainer.nproc=2"]))  # 4 prompts over 2 ranks
    with pytest.raises(ConfigError, match=r"data.prompts_per_step=4 is invalid: must divide over the 3 ranks"):
        validate(compose(["+recipe=quickstart", "trainer.nproc=3"]))
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun's word wins inside a job
    with pytest.raises(ConfigError, match=r"must divide over the 8 ranks .* e.g. data.prompts_per_step=8"):
        validate(compose(["+recipe=quickstart"]))
