"""No library's lines among the run's: the rollout worker, a process that spawn starts without the settings of
grpo-train's process, keeps transformers' deprecation warnings off the console as grpo-train does."""

from __future__ import annotations

import pytest
from conftest import run_cli


@pytest.mark.slow  # a grpo-train subprocess with its worker
@pytest.mark.timeout(300)
def test_a_worker_run_prints_only_its_own_lines(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
                    "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=3",
                    "rollout.placement=worker", "rollout.max_staleness=1", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    foreign = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("grpo-train: ")]
    assert foreign == [], proc.stderr
    assert "Warning" not in proc.stdout, proc.stdout
