"""The README's Extending examples work as written: each `# NAME.py` block is written out as a module and its
commands run through the real grpo-train (one tiny run with every example's overrides together)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_jsonl

REPO = Path(__file__).resolve().parents[1]


def extending_section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("\n## Extending\n", 1)[1].split("\n## ", 1)[0]


def example_modules() -> dict[str, str]:
    """`NAME.py` -> source, for every python block of the section whose first line is `# NAME.py`."""
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", extending_section(), re.S)
    return {name: code for name, code in blocks}


def example_commands() -> list[list[str]]:
    return [shlex.split(line.strip()) for line in extending_section().splitlines()
            if line.startswith("    grpo-train ")]


def test_the_section_has_a_reward_a_loss_type_an_engine_a_tool_and_an_environment():
    assert set(example_modules()) == {"my_rewards.py", "my_losses.py", "my_engines.py", "my_tools.py", "my_envs.py"}
    assert len(example_commands()) == 5


@pytest.mark.slow
def test_extending_examples_train_as_written(tmp_path):
    for name, code in example_modules().items():
        (tmp_path / name).write_text(code)
    overrides, plugins = [], []
    for command in example_commands():
        for arg in command[1:]:
            if arg.startswith("plugins="):
                plugins += arg.removeprefix("plugins=").strip("[]").split(",")
            elif arg not in overrides:
                overrides.append(arg)
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": f"{tmp_path}:{REPO / 'src'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_cli.train", *overrides, f"plugins=[{','.join(plugins)}]", "model=tiny",
         "trainer.max_steps=1", "trainer.log_samples_every=0", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert "reward/brevity" in row  # the reward ran
    assert "reward/GuessEnv" in row and "episodes/turns_per_episode" in row  # rollouts were episodes
    assert re.search(r"\d+ completions in [\d.]+ s", proc.stdout + proc.stderr)  # the engine generated
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "loss_type: seq_sum" in config  # the registered loss type was accepted and used
    assert "objective: clipped_pg" in config  # and the registered objective
