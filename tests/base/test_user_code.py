"""User code (rewards, plugins, environments, tools) that fails, in whatever way, is one line: exit 2 before the
model loads for its import and construction (an environment's too, and its reset on the first row), exit 1 during
training, naming the function (or the class and method), the exception and its message, with the checkpoint of
the last complete step. Settings that cannot work are refused the same way before the model loads."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import module_on_path, run_cli

TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=3", "data.prompts_per_step=2",
        "algo.num_generations=2", "trainer.max_steps=1"]

USER_CODE = '''
import sys

def interrupts(prompts, completions, **_):
    raise KeyboardInterrupt("pressed inside the reward")

def exits(prompts, completions, **_):
    sys.exit(3)

class Unbuildable:
    def __init__(self):
        raise ValueError("no table for Unbuildable")

    def __call__(self, prompts, completions, **_):
        return [0.0] * len(completions)

class ExitsWhenBuilt:
    def __init__(self):
        sys.exit("cannot start")

    def __call__(self, prompts, completions, **_):
        return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def user_env(tmp_path_factory) -> dict:
    env = module_on_path(tmp_path_factory, "user_rewards", USER_CODE)
    folder = env["PYTHONPATH"].split(":")[0]
    with open(f"{folder}/broken_syntax.py", "w") as f:
        f.write("def score(prompts, completions:\n    return []\n")
    with open(f"{folder}/exits_on_import.py", "w") as f:
        f.write("import sys\nsys.exit(4)\n")
    return env


# (extra overrides, exit code, the one line); "before the model loads": the `training N steps` line never comes
EARLY = [
    (["+reward.functions.x._target_=broken_syntax.score"],
     "grpo-train: reward.functions.x._target_=broken_syntax.score is invalid: cannot be imported (importing "
     "broken_syntax raised SyntaxError: '(' was never closed (broken_syntax.py, line 1)); fix the module"),
    (["+reward.functions.x._target_=exits_on_import.score"],
     "grpo-train: reward.functions.x._target_=exits_on_import.score is invalid: cannot be imported (importing "
     "exits_on_import raised SystemExit: 4); fix the module"),
    (["+reward.functions.x._target_=user_rewards.Unbuildable"],
     "grpo-train: reward.functions.x: building user_rewards.Unbuildable raised ValueError: no table for Unbuildable; "
     "fix its constructor or the entry's options"),
    (["+reward.functions.x._target_=user_rewards.ExitsWhenBuilt"],
     "grpo-train: reward.functions.x: building user_rewards.ExitsWhenBuilt raised SystemExit: cannot start; fix its "
     "constructor or the entry's options"),
    (["+plugins=[broken_syntax]"],
     "grpo-train: plugins=broken_syntax is invalid: importing it raised SyntaxError: '(' was never closed "
     "(broken_syntax.py, line 1); fix the module"),
    (["+plugins=[exits_on_import]"],
     "grpo-train: plugins=exits_on_import is invalid: importing it raised SystemExit: 4; fix the module"),
]


@pytest.mark.slow  # grpo-train subprocesses (no model is loaded)
@pytest.mark.parametrize("overrides,line", EARLY, ids=["syntax", "exit-on-import", "init-raises", "init-exits",
                                                      "plugin-syntax", "plugin-exits"])
def test_user_code_that_fails_to_import_or_build_is_one_line_before_the_model_loads(tmp_path, user_env, overrides,
                                                                                     line):
    run = tmp_path / "run"
    proc = run_cli([*TINY, *overrides, f"hydra.run.dir={run}"], tmp_path, env=user_env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line]
    assert "training" not in proc.stdout  # before the model loads
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target,named", [
    ("interrupts", "KeyboardInterrupt on completion 0: pressed inside the reward"),
    ("exits", "SystemExit on completion 0: 3")])
def test_a_reward_that_raises_a_base_exception_is_named_in_one_line_exit_1(tmp_path, user_env, target, named):
    """The reward thread catches BaseException: no thread traceback, and the exception it raised is the one named."""
    proc = run_cli([*TINY, f"+reward.functions.x._target_=user_rewards.{target}", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path, env=user_env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"grpo-train: reward x raised {named}; "
                                                "fix it or set reward.on_error=zero"]


ENVIRONMENTS = '''
import sys

class ExitsLater:
    """get_reward() calls sys.exit(0) from the second step on (2 prompts x 2 episodes a step)."""
    calls = 0

    def reset(self, **kwargs):
        return None

    def get_reward(self):
        ExitsLater.calls += 1
        if ExitsLater.calls > 4:
            sys.exit(0)
        return 0.5
'''


@pytest.mark.slow
def test_an_environment_that_exits_during_the_run_is_one_line_exit_1_and_keeps_the_last_step(tmp_path_factory,
                                                                                                tmp_path):
    """The issue's case: sys.exit(0) in get_reward ended the run with exit 0, no line and nothing recorded."""
    env, run = module_on_path(tmp_path_factory, "user_envs", ENVIRONMENTS), tmp_path / "run"
    proc = run_cli([*TINY, "trainer.max_steps=2", "trainer.save_every=0", "env._target_=user_envs.ExitsLater",
                    f"hydra.run.dir={run}"], tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: environment ExitsLater.get_reward raised SystemExit on completion 0: 0; fix it or set "
        f"reward.on_error=zero; the run stopped after 1 complete step(s), checkpoint {run}/checkpoints/step-000001; "
        f"once fixed, resume with the same command plus trainer.resume=auto hydra.run.dir={run}"]
    assert (run / "checkpoints" / "step-000001" / "adapter" / "adapter_model.safetensors").is_file()


NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
REFUSED = [  # (overrides, the start of the one line)
    (["env._target_=test_episodes.ResetExits"],
     "grpo-train: env._target_=test_episodes.ResetExits fails on the run's first row, before the model loads: "
     "environment ResetExits.reset raised SystemExit: 0 (given prompt, answer, messages); fix it"),
    (["rollout.tools=[test_episodes.multiply]", "rollout.tool_format=native"],
     "grpo-train: rollout.tool_format=native is invalid: the chat template of "),
    (["rollout.tools=[test_episodes.multiply]", "env._target_=test_episode_training.Multiplies"],
     "grpo-train: rollout.tools and the environment's methods offer multiply twice; every tool needs its own name"),
    pytest.param(["rollout.engine=vllm"], "grpo-train: rollout.engine=vllm is invalid: vLLM is not installed in this "
                 "Python", marks=NO_VLLM, id="vllm"),
]


@pytest.mark.slow  # grpo-train subprocesses (no model is loaded)
@pytest.mark.parametrize("overrides,line", REFUSED,
                         ids=["reset-exits", "native-template", "two-tools-one-name", "vllm"])
def test_what_cannot_work_is_refused_in_one_line_before_the_model_loads(tmp_path, overrides, line):
    run = tmp_path / "run"
    proc = run_cli([*TINY, *overrides, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [said] = proc.stderr.strip().splitlines()
    assert said.startswith(line), said
    assert "training" not in proc.stdout and not (run / "metrics.jsonl").exists()


COUNTED = '''
BUILT = []

class Counted:
    def __init__(self, scale=1.0):
        BUILT.append(scale)
        self.scale = scale

    def __call__(self, prompts, completions, **_):
        return [self.scale] * len(completions)
'''


def test_a_reward_built_before_the_model_loads_is_the_one_the_run_uses(tmp_path, monkeypatch, compose):
    (tmp_path / "counted_rewards.py").write_text(COUNTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import counted_rewards

    from grpo_cli.config.schema import Config
    from grpo_cli.rewards import RewardSet, build_before_model_load

    cfg = Config.of(compose(["+recipe=quickstart", "model=tiny", "+reward.functions.c._target_=counted_rewards.Counted",
                             "+reward.functions.c.scale=2.0"]))
    build_before_model_load(cfg.reward)
    assert counted_rewards.BUILT == [2.0]
    rewards = RewardSet.from_config(cfg.reward)
    assert counted_rewards.BUILT == [2.0]  # not built a second time
    assert rewards.score(["p"], ["c"], {"answer": ["1"]})[1]["c"] == [2.0]
    RewardSet.from_config(cfg.reward)  # a second run in the same process (a sweep job) builds its own
    assert counted_rewards.BUILT == [2.0, 2.0]
