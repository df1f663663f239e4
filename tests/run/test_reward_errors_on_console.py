"""reward.on_error=zero: the scores that failed and count as 0 are said on the console at every step where it
happens (with the first failure), not only counted in metrics.jsonl's reward_errors."""

from __future__ import annotations

import json
import re

import pytest
from conftest import read_jsonl, run_cli


def rows_file(path) -> None:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(1, 5)))


@pytest.mark.slow  # a grpo-train subprocess
def test_failures_under_on_error_zero_are_said_at_their_step(tmp_path):
    """Four prompts, two a step: the reward runs out of memory on the prompt "What is 3 + 1?" only, so one of the two
    steps has its four completions scored 0; that step, and only that one, has its line."""
    (tmp_path / "my_rewards.py").write_text(
        "def oom(prompts, completions, **_):\n"
        "    if any('What is 3 +' in p for p in prompts):\n"
        "        raise MemoryError()\n"
        "    return [len(c) % 3 / 2 for c in completions]\n")
    rows_file(tmp_path / "rows.jsonl")
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=3", "data=hf",
                    f"data.path={tmp_path / 'rows.jsonl'}", "data.prompts_per_step=2", "algo.num_generations=4",
                    "trainer.max_steps=2", "reward.on_error=zero", "reward.functions=null", "reward.accuracy=null",
                    "+reward.functions.oom._target_=my_rewards.oom", "+reward.functions.oom.weight=1.0",
                    f"hydra.run.dir={run}"], tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [r["reward_errors"] for r in read_jsonl(run / "metrics.jsonl")]
    assert sorted(errors) == [0, 4], errors
    said = [line for line in proc.stdout.splitlines() if "failed and count as 0" in line]
    step = errors.index(4)
    assert len(said) == 1 and re.fullmatch(
        rf"warning: step {step}: 4 reward scores failed and count as 0 \(reward.on_error=zero\); the first: reward oom "
        r"raised MemoryError on completion [0-7] \(out of memory\)", said[0].strip()), proc.stdout
