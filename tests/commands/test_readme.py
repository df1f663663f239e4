"""The README runs as written. Its Extending commands run exactly as printed, each one from a fresh shell (`bash -c`,
the venv's bin/ on PATH as `source .venv/bin/activate` puts it, no PYTHONPATH) in a folder that holds the example
files (`# NAME.py` blocks written out): so `_target_=my_rewards.brevity` and `plugins=[my_losses]` are found there
as a reader's shell finds them. That folder also holds `recipes/quickstart.yaml`, the packaged quickstart on the tiny
model for one step (a user's recipe of that name wins, README "Install and first run"), so that six runs take
seconds, not the quickstart's minutes; the commands themselves are not changed. The bad value the README shows fails
as shown, and the tool and environment commands leave room for a call."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import read_jsonl

from grpo_cli.config.compose import RECIPES_DIR

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def extending_section() -> str:
    return README.split("\n## Extending\n", 1)[1].split("\n## ", 1)[0]


def example_modules() -> dict[str, str]:
    """`NAME.py` -> source, for every python block of the section whose first line is `# NAME.py`."""
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", extending_section(), re.S)
    return {name: code for name, code in blocks}


def example_commands() -> list[str]:
    """The section's command lines, as printed."""
    return [line.strip() for line in extending_section().splitlines() if line.startswith("    grpo-train ")]


def fresh_shell(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """`line` run by bash as a reader's shell runs it after `source .venv/bin/activate`: this interpreter's bin/ first
    on PATH, no PYTHONPATH (the tests' own, set by conftest, would not be there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def example_folder(tmp_path) -> Path:
    """A folder holding the README's example files and a one-step quickstart on the tiny model."""
    for name, code in example_modules().items():
        (tmp_path / name).write_text(code)
    recipe = yaml.safe_load((RECIPES_DIR / "quickstart.yaml").read_text())
    recipe["defaults"] = [d if d != {"override /model": "smollm2-135m"} else {"override /model": "tiny"}
                          for d in recipe["defaults"]]
    recipe["trainer"].update(max_steps=1)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "quickstart.yaml").write_text("# @package _global_\n" + yaml.safe_dump(recipe))
    return tmp_path


def test_the_section_has_a_reward_a_loss_type_an_engine_a_tool_and_an_environment():
    assert set(example_modules()) == {"my_rewards.py", "my_losses.py", "my_engines.py", "my_tools.py", "my_envs.py"}
    assert len(example_commands()) == 6


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    """The run dir the console names when training starts (`training 1 steps in RUN_DIR; ...`)."""
    found = re.search(r"^training \d+ steps in (.+?); Ctrl-C", proc.stdout, re.M)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    return Path(found.group(1))


@pytest.mark.slow  # five grpo-train processes, each importing torch
def test_extending_commands_train_as_printed_from_a_fresh_shell(example_folder):
    reward, only, losses, engine, tool, env = example_commands()
    runs = {}
    for name, line in [("reward", reward), ("only", only), ("losses", losses), ("engine", engine), ("tool", tool),
                       ("env", env)]:
        proc = fresh_shell(line, example_folder)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        runs[name] = (run_dir_of(proc), proc.stdout + proc.stderr)
    # the folder's recipe
    assert "name_or_path: tiny-random" in (runs["reward"][0] / ".hydra" / "config.yaml").read_text()
    [row] = read_jsonl(runs["reward"][0] / "metrics.jsonl")
    assert "reward/brevity" in row  # my_rewards.brevity, imported from the folder, scored the completions
    [row] = read_jsonl(runs["only"][0] / "metrics.jsonl")
    assert [k for k in row if k.startswith("reward/")] == ["reward/brevity"]  # reward.only: the recipe's are gone
    config = (runs["losses"][0] / ".hydra" / "config.yaml").read_text()
    assert "loss_type: seq_sum" in config and "objective: clipped_pg" in config  # my_losses registered both
    assert re.search(r"\d+ completions in [\d.]+ s", runs["engine"][1])  # my_engines' engine generated
    [row] = read_jsonl(runs["tool"][0] / "metrics.jsonl")
    assert "episodes/turns_per_episode" in row  # rollouts were episodes with my_tools.word_count
    [row] = read_jsonl(runs["env"][0] / "metrics.jsonl")
    assert "reward/GuessEnv" in row and "episodes/turns_per_episode" in row  # my_envs.GuessEnv ran them


@pytest.mark.slow  # a grpo-train process
def test_the_bad_value_shown_fails_as_shown(tmp_path):
    shown = re.search(r"    \$ (grpo-train .+)\n    (grpo-train: .+)\n", README)
    proc = fresh_shell(shown.group(1), tmp_path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [shown.group(2)]


def example_arguments(fn) -> dict:
    """Arguments of a call to the tool `fn` on a quickstart prompt: its largest answer (18), its longest question."""
    from transformers.utils import get_json_schema

    value = {"integer": 18, "number": 18.0, "string": "What is 9 + 9? Answer with just the number.", "boolean": True}
    parameters = get_json_schema(fn)["function"]["parameters"]
    return {name: value[spec["type"]] for name, spec in parameters["properties"].items()}


def named_object(path: str):
    """What a dotted path (`module.name`) names, as Hydra's `_target_` resolves it."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.slow  # the tokenizer loads
def test_the_tool_and_environment_commands_leave_room_for_a_call_and_an_answer(example_folder, compose, monkeypatch):
    """rollout.max_new_tokens is the budget of a whole episode: a call (the embedded model's tokens of the Hermes
    `<tool_call>{json}</tool_call>` it writes) and then an answer of the quickstart's own budget must fit in it."""
    from grpo_cli.model.loading import load_tokenizer

    monkeypatch.syspath_prepend(str(example_folder))
    tokenizer = load_tokenizer("tiny-random")  # the embedded SmolLM2's tokenizer
    answer = compose(["+recipe=quickstart"]).rollout.max_new_tokens
    commands = [shlex.split(c)[1:] for c in example_commands() if "rollout.tools=" in c or "env._target_=" in c]
    assert len(commands) == 2
    for overrides in commands:
        cfg = compose(overrides)
        tools = [named_object(p) for p in cfg.rollout.tools]
        if cfg.env._target_:
            env = named_object(cfg.env._target_)
            tools += [fn for n, fn in inspect.getmembers(env, inspect.isfunction) if n[0] != "_" and
                      n not in ("reset", "get_reward")]
        assert tools
        for fn in tools:
            call = f"<tool_call>{json.dumps({'name': fn.__name__, 'arguments': example_arguments(fn)})}</tool_call>"
            needed = len(tokenizer(call)["input_ids"]) + answer
            assert cfg.rollout.max_new_tokens >= needed, (overrides, call, needed)
