"""A run dir written before the typed config (commit 72f1e9a, the last before the structured configs of issue 50)
resumes under this code: tests/data/run_before_typed_config is that commit's `grpo-train +recipe=quickstart
model=tiny trainer.device=cpu rollout.max_new_tokens=4 data.prompts_per_step=2 algo.num_generations=2
trainer.log_samples_every=0 trainer.max_steps=1 trainer.save_every=1` (its .lock and .hydra/hydra.yaml, which
names the machine's paths, left out)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

EARLIER_RUN = Path(__file__).parents[1] / "data" / "run_before_typed_config"
ITS_OVERRIDES = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
                 "data.prompts_per_step=2", "algo.num_generations=2", "trainer.log_samples_every=0",
                 "trainer.save_every=1"]


@pytest.mark.slow
def test_a_run_dir_of_the_release_before_the_typed_config_resumes(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(EARLIER_RUN, run)
    proc = run_cli([*ITS_OVERRIDES, "trainer.max_steps=2", "trainer.resume=auto",
                    "trainer.resume_allow_changes=[trainer.max_steps]", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1], steps  # the earlier step kept, the next one added once
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
