"""Run dirs and sweep dirs written by earlier releases resume under this code.

tests/data/run_before_typed_config: commit 72f1e9a (the last before the structured configs of issue 50);
tests/data/run_before_folders: commit 6769b67 (the last before src/grpo_cli/ became folders, issue 62); both are
`grpo-train +recipe=quickstart model=tiny trainer.device=cpu rollout.max_new_tokens=4 data.prompts_per_step=2
algo.num_generations=2 trainer.log_samples_every=0 trainer.max_steps=1 trainer.save_every=1`.
tests/data/sweep_before_folders: commit 6769b67's `grpo-train -m` of the same with trainer.max_steps=3, seeds 0 and 1,
eval.final=false and hydra.sweep.dir=/tmp/oldgen/sweep, stopped by SIGTERM in job 1 after its first step (job 0
finished). Their .lock files, .hydra/hydra.yaml and multirun.yaml (which name the machine's paths; Hydra writes them
anew) are left out, and the sweep dir the records name is written SWEEP_DIR (the repository holds no machine's path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

DATA = Path(__file__).parents[1] / "data"
EARLIER_RUN = DATA / "run_before_typed_config"
ITS_OVERRIDES = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
                 "data.prompts_per_step=2", "algo.num_generations=2", "trainer.log_samples_every=0",
                 "trainer.save_every=1"]


@pytest.mark.slow
@pytest.mark.parametrize("earlier", ["run_before_typed_config", "run_before_folders"])
def test_a_run_dir_of_an_earlier_release_resumes(tmp_path, earlier):
    run = tmp_path / "run"
    shutil.copytree(DATA / earlier, run)
    proc = run_cli([*ITS_OVERRIDES, "trainer.max_steps=2", "trainer.resume=auto",
                    "trainer.resume_allow_changes=[trainer.max_steps]", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1], steps  # the earlier step kept, the next one added once
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


@pytest.mark.slow
def test_a_stopped_sweep_of_the_release_before_the_folders_goes_on(tmp_path):
    """The same sweep command again: job 0 (finished) is skipped, job 1 resumes from its checkpoint after 1 step."""
    sweep = tmp_path / "sweep"
    shutil.copytree(DATA / "sweep_before_folders", sweep)
    for file in sweep.rglob("*"):  # the paths the earlier release recorded, as if it had run here
        if file.is_file() and file.suffix in (".json", ".csv"):
            file.write_text(file.read_text().replace("SWEEP_DIR", str(sweep)))
    finished = (sweep / "0" / "metrics.jsonl").read_text()
    command = json.loads((sweep / ".grpo_sweep_command.json").read_text())["overrides"]  # the sweep's, in its order
    assert command == [*ITS_OVERRIDES[:-1], "trainer.max_steps=3", "trainer.save_every=1", "trainer.seed=0,1",
                       "eval.final=false"]
    proc = run_cli(["-m", *command, f"hydra.sweep.dir={sweep}"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (sweep / "0" / "metrics.jsonl").read_text() == finished  # skipped, untouched
    steps = [json.loads(line)["step"] for line in (sweep / "1" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], steps
    status = json.loads((sweep / "1" / "job_status.json").read_text())
    assert status["status"] == "ok", status
    assert len((sweep / "sweep_summary.csv").read_text().splitlines()) == 3  # a header and both jobs
