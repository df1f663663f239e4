"""The data columns a reward takes: a parameter without a default that no column gives is refused before the model
loads (it used to be blamed on the reward at the first step, or, for TRL's `(completions, solution, **kwargs)`,
to bind the prompts as the completions); and that TRL form trained through grpo-train gets the completions as
completions and the column as `solution`."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY_TRAINER, read_jsonl, run_cli

from grpo_cli.base.errors import DataError
from grpo_cli.rewards import reward_arguments
from grpo_cli.rewards.columns import check_columns
from grpo_cli.tasks.prompts import Row, where_of


# ---- rewards named by _target_ below (this module is on the PYTHONPATH of the runs too) ---------------------------
def solution_scored(completions, solution, **kwargs):
    """TRL's documented form. Its score says what it was given: the completion's length mod 5 over 4, plus 1 where
    `solution` is the sum its own prompt asks for; given the prompts as completions it raises."""
    prompts = kwargs["prompts"]
    if any(c == p for c, p in zip(completions, prompts, strict=True)):
        raise ValueError("given the prompts as completions")
    sums = [sum(map(int, re.search(r"What is (\d+) \+ (\d+)\?", p).groups())) for p in prompts]
    return [len(c) % 5 / 4 + (str(s) == str(total)) for c, s, total in zip(completions, solution, sums, strict=True)]


def by_position(p, c, solution, **_):
    return [0.0] * len(c)


def with_threshold(completions, threshold, **kwargs):
    return [0.0] * len(completions)


def passed_names(completions, completion_ids, trainer_state=None, **kwargs):
    return [0.0] * len(completions)


def answer_needed(prompts, completions, answer):
    return [0.0] * len(completions)


class GoldJudge:
    def __init__(self, strict: bool = False):
        self.strict = strict

    def __call__(self, prompts, completions, gold, **kwargs):
        return [0.0] * len(completions)


def reward_config(compose, entries: dict[str, dict]):
    from grpo_cli.config.schema import Config

    overrides = [f"+reward.functions.{name}.{key}={value}" for name, entry in entries.items()
                 for key, value in {"weight": 1.0, **entry}.items()]
    return Config.of(compose([*TINY_TRAINER, "reward.functions=null", *overrides])).reward


def refusal(cfg_reward, rows) -> str:
    with pytest.raises(DataError) as err:
        check_columns(cfg_reward, rows, where=where_of)
    return str(err.value)


ROWS = [{"messages": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3"}]


def test_a_column_a_reward_needs_and_the_data_lacks_is_named(compose):
    trl = reward_config(compose, {"acc": {"_target_": "test_reward_columns.solution_scored"}})
    assert refusal(trl, ROWS) == ("reward.functions.acc (test_reward_columns.solution_scored) needs the column "
                                  "'solution', which the data does not have (its columns: answer); add that column, or "
                                  "give the parameter a default")
    check_columns(trl, [{**ROWS[0], "solution": "3"}])
    positional = reward_config(compose, {"pos": {"_target_": "test_reward_columns.by_position"}})
    assert "needs the column 'solution'" in refusal(positional, ROWS)
    judge = reward_config(compose, {"judge": {"_target_": "test_reward_columns.GoldJudge", "strict": True}})
    assert "(test_reward_columns.GoldJudge) needs the column 'gold'" in refusal(judge, ROWS)
    answer = reward_config(compose, {"a": {"_target_": "test_reward_columns.answer_needed"}})
    assert "(data.answer_column=COLUMN names the column that arrives as answer)" in refusal(answer, [
        {"messages": ROWS[0]["messages"], "solution": "3"}])


def test_what_the_trainer_passes_and_options_are_no_columns(compose):
    check_columns(reward_config(compose, {"t": {"_target_": "test_reward_columns.with_threshold", "threshold": 2}}),
                  ROWS)
    check_columns(reward_config(compose, {"n": {"_target_": "test_reward_columns.passed_names"}}), ROWS)
    check_columns(reward_config(compose, {"a": {"_target_": "test_reward_columns.answer_needed"}}), ROWS)


def test_a_column_named_as_what_the_trainer_passes_is_refused_not_passed_in_its_place(compose):
    """A data column "completions" would reach every reward in place of the model's completions (TRL's call raises
    on the doubled keyword); it is named with its row, before the model loads."""
    rows = [Row(ROWS[0], "data.jsonl:1"), Row({**ROWS[0], "completions": ["from the data"]}, "data.jsonl:2")]
    assert reward_arguments(lambda prompts, completions, **kw: [], ["P"], ["MODEL"], {"completions": ["DATA"]})[1][
        "completions"] == ["DATA"]  # why: the call itself lets a field win over the trainer's argument
    trl = reward_config(compose, {"acc": {"_target_": "test_reward_columns.solution_scored"}})
    assert refusal(trl, rows) == ("data.jsonl:2 has a column 'completions', the name under which every reward gets "
                                  "the model's completions: the column would take their place; rename the column")
    for name in ("prompts", "completion_ids", "trainer_state", "environments"):
        assert f"has a column {name!r}, the name under which" in refusal(trl, [Row({**ROWS[0], name: 1}, "d:1")])


def test_rows_that_lack_a_column_others_have_are_named(compose):
    trl = reward_config(compose, {"acc": {"_target_": "test_reward_columns.solution_scored"}})
    rows = [Row({**ROWS[0], "solution": "3"}, "data.jsonl:1"), Row(ROWS[0], "data.jsonl:2"),
            Row(ROWS[0], "data.jsonl:5")]
    assert refusal(trl, rows) == ("reward.functions.acc (test_reward_columns.solution_scored) needs the column "
                                  "'solution', which data.jsonl:2 lacks (and 1 more rows); give every row that column")


def test_a_function_that_names_completions_never_gets_the_prompts_by_position():
    """Without its `solution`, TRL's form fits the call by position, `fn(prompts, completions)`: the prompts would be
    its completions. It gets the call by keyword, which fails and says why."""
    args, kwargs = reward_arguments(solution_scored, ["the prompt"], ["the completion"], {})
    assert args == () and kwargs["completions"] == ["the completion"]
    args, _ = reward_arguments(by_position, ["the prompt"], ["the completion"], {"solution": ["3"]})
    assert args == (["the prompt"], ["the completion"])  # `lambda p, c, ...` takes them by position, as documented


def sums_jsonl(path, n: int = 4) -> None:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 1}?", "solution": str(2 * i + 1)}) + "\n"
                            for i in range(n)))


@pytest.mark.slow  # grpo-train subprocesses
def test_trl_form_trains_through_grpo_train_with_its_completions_and_solution(tmp_path):
    """Two steps with TRL's `(completions, solution, **kwargs)` as the only reward: each sample's reward in
    samples.jsonl is what the function gives for that sample's completion with the right solution, so it got the
    completions as completions and the column as `solution` (prompts as completions raise; a wrong solution scores
    1 less)."""
    sums_jsonl(tmp_path / "sums.jsonl")
    run = tmp_path / "run"
    proc = run_cli([*TINY_TRAINER, "data=hf", f"data.path={tmp_path / 'sums.jsonl'}", "data.prompts_per_step=2",
                    "algo.num_generations=4", "rollout.max_new_tokens=4", "trainer.max_steps=2",
                    "trainer.log_samples_every=1", "reward.functions=null", "reward.accuracy=null",
                    "+reward.functions.acc._target_=test_reward_columns.solution_scored",
                    "+reward.functions.acc.weight=1.0", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    samples = read_jsonl(run / "samples.jsonl")
    assert len(samples) == 16 and {s["step"] for s in samples} == {0, 1}
    for sample in samples:
        assert sample["reward"] == len(sample["completion"]) % 5 / 4 + 1, sample
    assert len({s["reward"] for s in samples}) > 1  # the completions differ, and so do their scores


@pytest.mark.slow
def test_grpo_train_refuses_a_missing_column_before_the_model_loads(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 2?", "answer": "3"}) + "\n")
    proc = run_cli([*TINY_TRAINER, "data=hf", f"data.path={path}", "reward.functions=null", "reward.accuracy=null",
                    "+reward.functions.acc._target_=test_reward_columns.solution_scored",
                    "+reward.functions.acc.weight=1.0", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: reward.functions.acc (test_reward_columns.solution_scored) needs the column 'solution', which the "
        "data does not have (its columns: answer); add that column, or give the parameter a default"]
    assert "training" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", ["grpo-train", "grpo-eval"])
def test_held_out_rows_without_the_accuracy_functions_column_are_refused_before_the_model_loads(tmp_path, command):
    """The training rows have `solution`, the held-out rows (data.eval_path) do not: the eval that reward.accuracy
    scores would fail only once it runs (for grpo-train, after the steps trained); both commands refuse it first."""
    sums_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "What is 1 + 2?", "answer": "3"}) + "\n")
    proc = run_cli([*TINY_TRAINER, "data=hf", f"data.path={tmp_path / 'train.jsonl'}",
                    f"data.eval_path={tmp_path / 'test.jsonl'}", "eval.final=true", "reward.functions=null",
                    "+reward.functions.acc._target_=test_reward_columns.solution_scored",
                    "+reward.functions.acc.weight=1.0", "reward.accuracy=acc", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path, command=command)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"{command}: reward.functions.acc (test_reward_columns.solution_scored) needs the column 'solution', which "
        "the held-out data (data.eval_split or data.eval_path) does not have (its columns: answer); add that column, "
        "or give the parameter a default"]
    assert "training" not in proc.stdout and "evaluating" not in proc.stdout
