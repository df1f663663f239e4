"""The Python entry point (grpo_cli/commands/api.py): `grpo_cli.train(*overrides, rewards=...)`, as a notebook uses
it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import read_jsonl

import grpo_cli
from grpo_cli.base.errors import ConfigError


def python(code: str, cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter in `cwd`, as the cells of a notebook run one after another."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_importing_grpo_cli_stays_cheap_and_train_is_there(tmp_path):
    proc = python("""
        import sys, grpo_cli
        print(sorted(m for m in ("grpo_cli.commands.api", "torch", "hydra", "transformers") if m in sys.modules))
        print(callable(grpo_cli.train), grpo_cli.TrainResult._fields)
    """, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True ('run_dir', 'summary')"]


def test_a_bad_value_is_the_one_line_config_error_raised_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^algo.clip_eps=2 is invalid: needs 0 < clip_eps < 1$"):
        grpo_cli.train("+recipe=quickstart", "algo.clip_eps=2")
    with pytest.raises(ConfigError, match=r"^recipe 'nope' not found"):
        grpo_cli.train("+recipe=nope")
    with pytest.raises(ConfigError, match=r"^'-m' is no override"):
        grpo_cli.train("-m", "+recipe=quickstart")
    with pytest.raises(ConfigError, match=r"each of its own name"):
        grpo_cli.train("+recipe=quickstart", rewards=[lambda completions, **_: [], lambda completions, **_: []])
    with pytest.raises(ConfigError, match=r"^rewards= and reward.only=\[m.f\] both choose the reward functions"):
        grpo_cli.train("+recipe=quickstart", "reward.only=[m.f]", "algo.clip_eps=2",
                       rewards=[lambda completions, **_: []])
    with pytest.raises(ConfigError, match=r"^run_dir='a' and hydra.run.dir=b name two run dirs; give one of them$"):
        grpo_cli.train("+recipe=quickstart", "hydra.run.dir=b", "algo.clip_eps=2", run_dir="a")  # before any value
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    from hydra.core.hydra_config import HydraConfig

    assert not HydraConfig.initialized()  # nothing of the refused runs is left behind in this process


@pytest.mark.slow  # two runs of the quickstart on the tiny model in a fresh interpreter
def test_a_notebook_trains_the_quickstart_for_2_steps_and_then_with_its_own_reward(tmp_path):
    proc = python(f"""
        import json, grpo_cli

        run_dir, summary = grpo_cli.train("+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "algo.beta=0.02",
                                          run_dir="{tmp_path / 'quickstart'}")
        print(json.dumps({{"run_dir": str(run_dir), **summary}}))

        def short(completions, **kwargs):   # a reward defined in the notebook itself
            return [1.0 if len(c) < 12 else 0.0 for c in completions]

        constant = lambda completions, **kwargs: [0.5] * len(completions)
        result = grpo_cli.train("+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "data.prompts_per_step=2",
                                "algo.num_generations=2", rewards=[short, constant], run_dir="{tmp_path / 'mine'}")
        print(json.dumps({{"run_dir": str(result.run_dir), **result.summary}}))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    run = tmp_path / "quickstart"
    assert first["run_dir"] == str(run) and first["steps"] == 2 and first["adapter"] == str(run / "adapter")
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and "reward/correct" in rows[0]
    assert "beta: 0.02" in (run / ".hydra" / "config.yaml").read_text()  # what grpo-eval/-report/-export read
    assert "algo.beta=0.02" in (run / ".hydra" / "overrides.yaml").read_text()
    assert (run / "adapter" / "adapter_config.json").is_file()
    mine = read_jsonl(tmp_path / "mine" / "metrics.jsonl")
    assert second["steps"] == 2
    assert sorted(k for k in mine[0] if k.startswith("reward/")) == ["reward/reward", "reward/short"]
    assert mine[0]["reward/reward"] == 0.5  # the lambda, named `reward`
