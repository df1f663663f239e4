"""Episodes in training: the trainer generates them when rollout.tools or env._target_ is set, the loss and every
token count see only the model's tokens, rewards get the conversation and the environments as TRL passes them, the
environment's own reward joins the total (or is the only one) and passes a reward function's checks, what cannot
work is refused before the model loads, grpo-eval runs the same loop, and a run with tools resumes bitwise.

The tool calls come from `ScriptedPolicy` (tests/rollout/test_episodes.py) behind the real Engine seam, since the tiny
random model never writes one; the loss, the optimizer and everything else is the real trainer's."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAINER, make_trainer, read_jsonl, run_cli, straight_and_resumed
from test_episodes import ENVIRONMENT_FAILURES, ENVIRONMENT_NAMES, ChoosingPolicy, ScriptedPolicy, call, script

from grpo_cli.base.errors import ConfigError, RewardError
from grpo_cli.config import rules
from grpo_cli.rollout import episodes
from grpo_cli.rollout.episodes import EpisodeRunner
from grpo_cli.run import validate as config

TESTS = str(Path(__file__).parents[1])
TOOL = ["rollout.tools=[test_episodes.multiply]", "rollout.max_new_tokens=48", "rollout.tool_timeout_s=1.0",
        "data.prompts_per_step=2", "algo.num_generations=2"]
SEEN: dict = {}


def rows_with_answers(answers: str = "12", plain: str = "7"):
    return [{**script(call("multiply", a=3, b=4), answers), "answer": "12"}, {**script(plain), "answer": "8"}] * 4


def scripted(trainer, engine=ScriptedPolicy):
    trainer.engine = engine(trainer.tokenizer)
    return trainer


def remembers(prompts, completions, messages, environments=None, **_):
    """A reward that names `messages` (and `environments`): it sees the whole conversation."""
    SEEN["messages"], SEEN["environments"] = messages, environments
    return [float(any(m["role"] == "tool" for m in conversation)) for conversation in messages]


def plain(prompts, completions, **fields):
    """A reward that names neither: it gets the row fields and, as in TRL, the environments and token ids."""
    SEEN["plain"] = fields
    return [0.0] * len(completions)


def fields_only(prompts, completions, start, answer):
    """A reward without **kwargs: what it does not name never reaches it."""
    return [0.0] * len(completions)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_trainer_trains_on_episodes_and_counts_only_the_models_tokens(compose, tmp_path):
    trainer = scripted(make_trainer(compose, tmp_path, *TOOL, "algo.loss_type=dapo", "algo.mask_truncated=true",
                                    "algo.mini_batches=2", rows=rows_with_answers("12~~13", "7~~8")), ChoosingPolicy)
    generation = trainer.generate(0)
    roll = generation.rollout
    assert roll.tool_calls.tolist() == [1, 1, 0, 0] and generation.prompts == roll.prompts
    scores = trainer.score(generation)
    # the answer after the tool result counts (the call's own numbers come before it)
    assert scores.per_function["correct"] == [float(t.endswith(a)) for t, a in zip(roll.texts, "12 12 8 8".split(),
                                                                                   strict=True)]
    batch = trainer.make_batch(generation, scores)
    assert torch.equal(batch.mask, roll.loss_mask().float()) and bool((batch.mask < roll.completion_mask).any())
    ordered, minis = trainer.mini_batch_layout(batch)  # two mini-batches: select_groups carries the episodes
    assert ordered.rollout.tool_calls.tolist() == [1, 1, 0, 0] or ordered.rollout.tool_calls.tolist() == [0, 0, 1, 1]
    assert sum(m.tokens_total for m in minis) == float(roll.model_mask.sum())  # dapo's normaliser: model tokens
    metrics, _ = trainer.step(0)
    assert metrics["episodes/tool_calls_per_episode"] == 0.5 and metrics["episodes/failed_call_rate"] == 0.0
    assert metrics["episodes/turns_per_episode"] == 1.5 and metrics["episodes/cut_frac"] == 0.0
    assert metrics["completion_len"] == float(roll.model_mask.sum(1).float().mean())
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_the_loss_mask_of_an_episode_is_its_model_tokens(compose, mask_truncated):
    """The fast check that tool tokens never train: the step's batch of an episode (tool result tokens inside the
    completion, so in completion_mask for attention) masks exactly the tokens the model sampled."""
    from grpo_cli.config.schema import Config
    from grpo_cli.rollout import Generation
    from grpo_cli.rollout.episodes import Episodes
    from grpo_cli.step.batch import Scores, make_batch

    #  episode 0: 3 sampled, 2 tool-result tokens, 2 sampled; episode 1: 4 sampled, 3 padding
    completion = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    model = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    roll = Episodes(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), completion * 5, completion,
                    torch.tensor([False, False]), ["a", "b"], 2, model_mask=model, prompts=["p", "p"],
                    messages=[[], []], tool_calls=torch.tensor([1, 0]), failed_calls=torch.tensor([0, 0]),
                    turns=torch.tensor([2, 1]), cut=torch.tensor([False, False]))
    algo = Config.of(compose(["+recipe=quickstart", f"algo.mask_truncated={str(mask_truncated).lower()}",
                              "algo.num_generations=2"])).algo
    batch = make_batch(Generation(roll, [{}], ["p", "p"], {}), Scores(torch.tensor([1.0, 0.0]), {}, 0), algo,
                       torch.device("cpu"))
    assert torch.equal(batch.mask, model.float())
    assert torch.equal(roll.loss_mask(), model)


def test_dr_grpo_and_truncation_see_the_model_tokens(compose, tmp_path):
    trainer = scripted(make_trainer(compose, tmp_path, *TOOL, "algo.loss_type=dr_grpo", "rollout.max_new_tokens=22",
                                    "algo.mask_truncated=true", rows=rows_with_answers()))
    roll = trainer.generate(0).rollout
    # the call's 21 tokens fit the budget of 22, the answer does not: the episode is cut, out of the loss
    assert roll.cut.tolist() == [True, True, False, False] and torch.equal(roll.truncated, roll.cut)
    batch = trainer.make_batch(trainer.generate(0), trainer.score(trainer.generate(0)))
    assert float(batch.mask[:2].sum()) == 0 and torch.equal(batch.mask[2:], roll.model_mask[2:].float())
    assert int(roll.model_mask.sum(1).max()) <= 22  # the budget counts the model's tokens of the whole episode


def test_rewards_get_messages_and_environments_by_name_and_the_env_reward_joins(compose, tmp_path):
    SEEN.clear()
    rows = [{**script(call("increment", step=2), "Done."), "start": 1, "answer": "3"},
            {**script("Nothing."), "start": 5, "answer": "5"}]
    trainer = scripted(make_trainer(
        compose, tmp_path, "env._target_=test_episodes.CounterEnv", "rollout.max_new_tokens=48",
        "data.prompts_per_step=2", "algo.num_generations=2", "+reward.functions.remembers._target_="
        f"{__name__}.remembers", f"+reward.functions.plain._target_={__name__}.plain",
        f"+reward.functions.fields_only._target_={__name__}.fields_only", "+reward.functions.fields_only.weight=0",
        rows=rows))
    generation = trainer.generate(0)
    scores = trainer.score(generation)
    assert len(SEEN["environments"]) == 4 and SEEN["environments"][0].count == 3
    assert [m["role"] for m in SEEN["messages"][0]] == ["user", "assistant", "tool", "assistant"]
    # messages: by name only; TRL's loggers to every function of the user's that takes **kwargs, as TRL passes them
    assert sorted(SEEN["plain"]) == ["answer", "completion_ids", "environments", "log_extra", "log_metric", "start"]
    roll = generation.rollout
    assert SEEN["plain"]["completion_ids"][0] == roll.completion_ids[0][roll.completion_mask[0].bool()].tolist()
    assert scores.per_function["CounterEnv"] == [3.0, 3.0, 0.0, 0.0]  # get_reward(), weight 1
    weighted = [1.0 * c + 0.0 * b for c, b in zip(scores.per_function["correct"], scores.per_function["bare"],
                                                  strict=True)]
    expected = [w + r + env for w, r, env in zip(weighted, scores.per_function["remembers"],
                                                 scores.per_function["CounterEnv"], strict=True)]
    assert scores.totals.tolist() == pytest.approx(expected)


def test_select_and_concat_carry_the_episode_fields(compose, tmp_path):
    trainer = scripted(make_trainer(compose, tmp_path, *TOOL, rows=rows_with_answers()))
    roll = trainer.generate(0).rollout
    picked = roll.select_groups([1, 0])  # G = 2: rows 2, 3, 0, 1
    assert picked.tool_calls.tolist() == [0, 0, 1, 1] and picked.messages[2] == roll.messages[0]
    assert torch.equal(picked.model_mask[2], roll.model_mask[0])
    width = roll.completion_ids.shape[1] + 3
    wider = dataclasses.replace(roll, completion_ids=torch.nn.functional.pad(roll.completion_ids, (0, 3)),
                                completion_mask=torch.nn.functional.pad(roll.completion_mask, (0, 3)))
    joined = type(roll).join([roll, wider], trainer.tokenizer.pad_token_id)
    assert joined.model_mask.shape == (8, width) and joined.turns.tolist() == roll.turns.tolist() * 2
    assert len(joined.prompts) == 8 and joined.messages[4] == roll.messages[0]


class Judged:
    """An environment whose get_reward() gives what the test sets in `verdict`."""

    verdict: object = 1.0

    def reset(self, **kwargs) -> None:
        pass

    def get_reward(self):
        if Judged.verdict == "exit":
            sys.exit(0)
        if Judged.verdict == "raise":
            raise ValueError("no score yet")
        return Judged.verdict


def test_the_environments_reward_passes_the_checks_of_a_reward_function(compose, tmp_path):
    trainer = scripted(make_trainer(compose, tmp_path, f"env._target_={__name__}.Judged", "data.prompts_per_step=2",
                                    "algo.num_generations=2", rows=[{**script("12"), "answer": "12"}] * 2))
    generation = trainer.generate(0)
    for verdict, line in [
        (float("nan"), "environment Judged.get_reward gave nan for completion 0; rewards must be finite (or set "
                       "reward.on_error=zero)"),
        ("1.0", "environment Judged.get_reward returned str '1.0' for completion 0; it must return a number per "
                "completion (int, float, bool, or a numpy/torch scalar)"),
        ("exit", "environment Judged.get_reward raised SystemExit on completion 0: 0; fix it or set "
                 "reward.on_error=zero"),
    ]:
        Judged.verdict = verdict
        with pytest.raises(RewardError) as err:
            trainer.score(generation)
        assert str(err.value) == line
    Judged.verdict = "raise"
    trainer.rewards.on_error = "zero"
    scores = trainer.score(generation)
    Judged.verdict = 1.0
    assert scores.per_function["Judged"] == [0.0] * 4 and scores.errors == 4


def test_an_environment_that_owns_its_reward_may_be_the_only_one(compose, tmp_path):
    """TRL's IncrementEnv with no reward function (reward.functions=null): get_reward() is the reward, weight 1."""
    owned = ["env._target_=test_episodes.IncrementEnv", "reward.functions=null", "reward.accuracy=null"]
    config.validate(compose([*TINY_TRAINER, *owned]))  # refused before: no reward function
    refused = ("reward.functions=null is invalid: list at least one reward function with _target_ and weight, or "
               "set env._target_ to an environment with a get_reward() method")
    with pytest.raises(ConfigError, match=re.escape(refused)):
        config.validate(compose([*TINY_TRAINER, *owned[1:], "env._target_=test_episodes.MyEnv"]))
    trainer = scripted(make_trainer(compose, tmp_path, *owned, "data.prompts_per_step=2", "algo.num_generations=2",
                                    rows=[script(call("increment", step=3), "Done.")] * 2))
    metrics, batch = trainer.step(0)
    rewards = [float(env.counter == env.target) for env in batch.rollout.environments]
    assert list(batch.per_function) == ["IncrementEnv"] and batch.rewards.tolist() == rewards
    assert metrics["reward/IncrementEnv"] == metrics["reward"] == sum(rewards) / 4


BUILT: list = []  # the instances `incrementing` built


def incrementing():
    """TRL's IncrementEnv built by a function, as TRL's environment_factory may be (a lambda or functools.partial
    in a script, a function in a module here)."""
    from test_episodes import IncrementEnv

    BUILT.append(IncrementEnv())
    return BUILT[-1]


def no_environment():
    return {"reset": None}


def failing_factory():
    raise RuntimeError("no license server")


def test_an_environment_built_by_a_function_trains_as_its_class_does(compose, tmp_path):
    """env._target_ naming a function that returns an environment: its instances' tools, get_reward() as the reward
    (named after their class), an instance of the function's per episode."""
    owned = ["env._target_=test_episode_training.incrementing", "reward.functions=null", "reward.accuracy=null"]
    BUILT.clear()
    config.validate(compose([*TINY_TRAINER, *owned]))  # get_reward() found through the function's instance
    trainer = scripted(make_trainer(compose, tmp_path, *owned, "data.prompts_per_step=2", "algo.num_generations=2",
                                    "rollout.max_new_tokens=48", rows=[script(call("increment", step=3), "Done.")] * 2))
    BUILT.clear()
    metrics, batch = trainer.step(0)
    assert [id(env) for env in batch.rollout.environments] == [id(env) for env in BUILT[-4:]]  # the function's
    assert sum(env.counter for env in BUILT) == 12  # each episode called its own instance's increment tool
    rewards = [float(env.counter == env.target) for env in batch.rollout.environments]
    assert list(batch.per_function) == ["IncrementEnv"] and batch.rewards.tolist() == rewards


@pytest.mark.parametrize(("target", "line"), [
    ("no_environment", "env._target_=test_episode_training.no_environment returns a dict, which has no reset(**row) "
                       "method; an environment needs reset(**row) -> str | None"),
    ("failing_factory", "env._target_=test_episode_training.failing_factory: environment failing_factory() raised "
                        "RuntimeError: no license server; an environment is built without arguments (TRL's "
                        "environment_factory): fix the function"),
])
def test_a_function_that_builds_no_environment_is_one_line_before_the_model_loads(compose, target, line):
    with pytest.raises(ConfigError) as err:
        EpisodeRunner.from_config(compose(["model=tiny", f"env._target_=test_episode_training.{target}"]))
    assert str(err.value).startswith(line), str(err.value)


class Multiplies:
    """An environment whose method has the name of a tool in rollout.tools."""

    def reset(self, **kwargs) -> None:
        pass

    def multiply(self, a: int, b: int) -> int:
        """Multiply.

        Args:
            a: One.
            b: Two.
        """
        return a * b


@pytest.mark.parametrize(("environment", "line"), ENVIRONMENT_FAILURES, ids=ENVIRONMENT_NAMES)
def test_an_environment_that_fails_on_the_first_row_is_refused_before_the_model_loads(config, environment, line):
    cfg = config(["+recipe=quickstart", "model=tiny", f"env._target_=test_episodes.{environment.__name__}"])
    with pytest.raises(ConfigError) as err:
        episodes.check_before_model_load(cfg)
    assert str(err.value) == (f"env._target_=test_episodes.{environment.__name__} fails on the run's first row, before "
                              "the model loads: " + line.replace("prompt, start, messages", "prompt, answer, messages"))


def test_an_environment_that_hangs_on_the_first_row_is_refused_at_its_deadline_before_the_model_loads(config):
    cfg = config(["+recipe=quickstart", "model=tiny", "env._target_=test_episodes.SlowReset", "env.timeout_s=0.3"])
    with pytest.raises(ConfigError) as err:
        episodes.check_before_model_load(cfg)
    assert str(err.value) == ("env._target_=test_episodes.SlowReset fails on the run's first row, before the model "
                              "loads: environment SlowReset.reset took over 0.3 s (env.timeout_s) and was abandoned; "
                              "fix it, or raise env.timeout_s (null = no limit)")


def test_settings_that_cannot_work_are_refused_before_the_model_loads(compose):
    quickstart = ["+recipe=quickstart", "model=tiny", "rollout.tools=[test_episodes.multiply]"]
    with pytest.raises(ConfigError, match=re.escape("rollout.tool_format=native is invalid: the chat template of ")):
        episodes.check_before_model_load(compose([*quickstart, "rollout.tool_format=native"]))
    with pytest.raises(ConfigError, match="rollout.tools and the environment's methods offer multiply twice"):
        episodes.check_before_model_load(compose([*quickstart, f"env._target_={__name__}.Multiplies"]))
    assert EpisodeRunner.from_config(compose(quickstart)).tool_output_max_chars == 10000


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_where_it_is_not_installed_names_the_venv_that_has_it(compose):
    with pytest.raises(ConfigError) as err:
        rules.check_libraries_installed(compose(["+recipe=quickstart", "rollout.engine=vllm"]))
    assert str(err.value).startswith("rollout.engine=vllm is invalid: vLLM is not installed in this Python")
    assert "make setup-vllm" in str(err.value) and ".venv-vllm/bin/grpo-train" in str(err.value)


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.tools=[no_such_module.fn]", "rollout.tools[0]=no_such_module.fn cannot be imported"),
    ("rollout.tools=[test_episode_training.SEEN]", "is a dict, not callable"),
    ("rollout.tools=[test_episode_training.undocumented]", "tool undocumented has no usable schema"),
    ("env._target_=test_episode_training.NoReset", "has no reset(**row) method"),
])
def test_a_bad_tool_or_environment_is_one_line_before_the_model_loads(compose, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        EpisodeRunner.from_config(compose(["model=tiny", override]))


def undocumented(x):
    return x


class NoReset:
    def step(self, action: str) -> str:
        """Acts.

        Args:
            action: what to do
        """
        return action


def test_the_evaluator_runs_the_same_loop(compose, tmp_path):
    from grpo_cli.step.evaluate import Evaluator

    trainer = scripted(make_trainer(compose, tmp_path, *TOOL, rows=rows_with_answers()))
    evaluator = Evaluator.from_config(trainer.cfg, trainer.tokenizer, rows_with_answers()[:2])
    assert evaluator.episodes is not None
    result = evaluator.run(trainer.engine)
    assert result["eval/accuracy"] == 0.5  # the call's row answers 12 after the result
    assert result["eval/tool_calls_per_episode"] == 0.5 and result["eval/episodes_with_a_successful_call"] == 0.5


# ---- through the CLI ------------------------------------------------------------------------------------------------
@pytest.fixture
def cli_env(tmp_path):
    rows = [{**script(call("multiply", a=3, b=4) + "~~" + call("multiply", a=3, b=5), "12~~15~~I do not know"),
             "answer": "12"}, {**script(call("explode", x=1), "Sorry.~~8"), "answer": "8"}]
    data = tmp_path / "rows.jsonl"
    import json

    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, {"PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)}


TRAIN = ["+recipe=quickstart", "model=tiny", "plugins=[scripted_engine]", "rollout.engine=scripted",
         "rollout.tools=[test_episodes.multiply,test_episodes.explode]", "rollout.max_new_tokens=48",
         "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=4", "trainer.save_every=2",
         "trainer.log_samples_every=1", "optimizer.lr=1e-2", "trainer.device=cpu"]


@pytest.mark.slow
def test_a_run_with_tools_resumes_bitwise_and_samples_show_the_conversation(cli_env, tmp_path):
    data, env = cli_env
    args = [*TRAIN, "data=hf", f"data.path={data}"]
    straight, resumed = straight_and_resumed(args, tmp_path, env)
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    keep = ("reward", "loss", "episodes/tool_calls_per_episode", "episodes/failed_call_rate")
    assert [{k: r[k] for k in keep} for r in a] == [{k: r[k] for k in keep} for r in b]
    assert any(r["episodes/failed_call_rate"] > 0 for r in a) and len({r["reward"] for r in a}) > 1
    final = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    assert final == (resumed / "adapter" / "adapter_model.safetensors").read_bytes()
    samples = read_jsonl(straight / "samples.jsonl")
    assert any("tool: error: explode raised ValueError" in s["conversation"] for s in samples)
    assert any("tool: 12" in s["conversation"] and s["tool_calls"] == 1 for s in samples)


# copied verbatim from TRL's docs/source/openenv.md, "Reward functions" (called by keyword, as TRL calls it)
TRL_REWARD = """def reward_func(environments, **kwargs) -> list[float]:
    return [env.reward for env in environments]
"""


@pytest.mark.slow
def test_the_environment_of_trls_docs_trains_unchanged_through_grpo_train(tmp_path):
    """MyEnv, copied from TRL's docs (tests/rollout/test_episodes.py), with the reward TRL's docs pair with it (it reads
    `environments`), trains on the tiny model and is evaluated by grpo-eval in the same loop."""
    (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), TESTS, os.environ.get("PYTHONPATH")) if p)}
    args = ["+recipe=quickstart", "model=tiny", "env._target_=test_episodes.MyEnv", "rollout.max_new_tokens=8",
            "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=2", "trainer.device=cpu",
            "+reward.functions.env._target_=trl_reward.reward_func", "trainer.log_samples_every=1"]
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 2 and "reward/env" in metrics[0] and "episodes/turns_per_episode" in metrics[0]
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert all("Initial observation for the model" in s["prompt"] for s in samples)  # reset's string, appended
    proc = run_cli([*args[:-3], "eval.num_prompts=2", f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, env=env,
                   command="grpo-eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sys.executable  # the CLI ran in this interpreter's venv


@pytest.mark.slow
def test_trls_environment_that_owns_its_reward_trains_through_grpo_train_with_no_reward_function(tmp_path):
    """TRL's documented IncrementEnv (tests/rollout/test_episodes.py) as the only reward, as in TRL's
    test_train_with_environment_owned_reward: grpo-train refused it for lacking reward functions."""
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "env._target_=test_episodes.IncrementEnv",
                    "reward.functions=null", "reward.accuracy=null", "rollout.max_new_tokens=8",
                    "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=1", "trainer.device=cpu",
                    f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [metrics] = read_jsonl(run / "metrics.jsonl")
    assert metrics["reward/IncrementEnv"] == metrics["reward"] == 0.0  # the tiny model calls no tool: no counter
    assert not any(k.startswith("reward/") and k != "reward/IncrementEnv" for k in metrics)


@pytest.mark.slow
def test_grpo_train_refuses_a_bad_tool_in_one_line_before_the_model_loads(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.tools=[no_such_module.calculator]",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "rollout.tools[0]=no_such_module.calculator cannot be imported" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
