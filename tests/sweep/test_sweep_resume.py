"""A sweep that survives a crash: a re-run of the same command skips finished jobs, resumes stopped ones,
starts changed ones over; a stop ends the whole sweep; another command into a used sweep dir is refused."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import prewarmed
import pytest
import yaml
from conftest import read_jsonl, run_cli, script
from omegaconf import OmegaConf

from grpo_cli.config.schema import Config
from grpo_cli.run.rundir import job_config
from grpo_cli.sweep import callback as sweep
from grpo_cli.sweep import rerun as sweep_rerun

TINY_SWEEP = ["-m", "+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "rollout.max_new_tokens=4",
              "algo.num_generations=2", "data.prompts_per_step=2", "trainer.device=cpu",
              "algo.beta=0.0,0.04", "trainer.seed=0,1,2"]
SKIPPED = "finished before with the same config; skipped"


def _metrics_files(sweep_dir: Path, jobs) -> dict:
    """Each job's metrics.jsonl: its bytes and its mtime (a job trained again rewrites both)."""
    return {j: ((sweep_dir / str(j) / "metrics.jsonl").read_bytes(),
                (sweep_dir / str(j) / "metrics.jsonl").stat().st_mtime_ns) for j in jobs}


def _stop_when(command: list[str], cwd: Path, ready: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `command`; SIGTERM its whole process group as soon as `ready` exists."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = prewarmed.popen([script("grpo-train"), *command], cwd=cwd, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_a_sweep_stopped_in_job_3_goes_on_where_it_stopped(tmp_path):
    sweep_dir = tmp_path / "sweep"
    command = [*TINY_SWEEP, f"hydra.sweep.dir={sweep_dir}"]

    # 1. SIGTERM once job 3 has a complete step: the whole sweep stops there, with a summary of what ran
    stopped = _stop_when(command, tmp_path, sweep_dir / "3" / "metrics.jsonl")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "stopped by SIGTERM in job 3 (algo.beta=0.04 trainer.seed=0)" in stopped.stderr
    assert "the sweep stops here" in stopped.stderr
    assert not (sweep_dir / "4").exists()  # no later job started
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"]) for r in rows] == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "stopped")]
    assert list((sweep_dir / "3" / "checkpoints").iterdir())
    finished = _metrics_files(sweep_dir, range(3))

    # 2. the same command again: jobs 0-2 skipped (not trained again), job 3 resumed, 4 and 5 run
    again = run_cli(command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    for num, overrides in enumerate(["algo.beta=0.0 trainer.seed=0", "algo.beta=0.0 trainer.seed=1",
                                     "algo.beta=0.0 trainer.seed=2"]):
        assert f"grpo-train: job {num} ({overrides}) {SKIPPED}" in again.stderr
    assert "job 3 (algo.beta=0.04 trainer.seed=0) did not finish; resuming it from" in again.stderr
    assert _metrics_files(sweep_dir, range(3)) == finished
    assert [r["step"] for r in read_jsonl(sweep_dir / "3" / "metrics.jsonl")] == [0, 1]  # each step once
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"], r["steps"]) for r in rows] == [(j, "ok", 2) for j in range(6)]
    status = json.loads((sweep_dir / "0" / "job_status.json").read_text())
    assert status["result"] == pytest.approx(rows[0]["final_reward"])  # what a skipped job returns to Hydra

    # 3. and once more: nothing is trained, every job says it was skipped, the summary still holds all six
    everything = _metrics_files(sweep_dir, range(6))
    third = run_cli(command, cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stderr.count(SKIPPED) == 6
    assert _metrics_files(sweep_dir, range(6)) == everything
    assert len(json.loads((sweep_dir / "sweep_summary.json").read_text())) == 6


# ---- in process: what a job does with what its dir holds ------------------------------------------
def _job(compose, sweep_dir: Path, num: int, *overrides: str):
    """(typed config, a config holding its Hydra part) of sweep job `num`, as decide_job gets them."""
    cfg = Config.of(compose(["+recipe=quickstart", "model=tiny", *overrides]))
    job_dir = sweep_dir / str(num)
    job_dir.mkdir(parents=True, exist_ok=True)
    hydra = OmegaConf.create({"hydra": {
        "sweep": {"dir": str(sweep_dir), "subdir": "${hydra.job.num}"}, "job": {"num": num},
        "runtime": {"output_dir": str(job_dir)}, "overrides": {"task": list(overrides)}}})
    return cfg, hydra, job_dir


def _previous(job_dir: Path, **fields) -> None:
    """What SweepSummary.on_job_start keeps of the job's earlier attempt."""
    (job_dir / sweep.JOB_STATUS).write_text(json.dumps({"status": "running", "previous": fields}))


def test_a_finished_job_is_skipped_with_its_result_or_started_over_when_its_config_changed(compose, tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / sweep.SWEEP_COMMAND_FILE).write_text(json.dumps(
        {"overrides": ["algo.beta=0.0,0.04", "trainer.max_steps=2"], "params": {}}))
    cfg, hydra, job_dir = _job(compose, sweep_dir, 1, "algo.beta=0.04", "trainer.max_steps=2")
    (job_dir / "adapter").mkdir()
    _previous(job_dir, status="ok", result=0.25, config=job_config(cfg.recorded))
    plan = sweep_rerun.decide_job(cfg, hydra)
    assert (plan.action, plan.result) == ("skip", 0.25)
    assert plan.line == f"job 1 (algo.beta=0.04) {SKIPPED}"  # the swept override names the job

    changed, hydra, _ = _job(compose, sweep_dir, 1, "algo.beta=0.04", "trainer.max_steps=3")
    plan = sweep_rerun.decide_job(changed, hydra)
    assert plan.action == "restart"
    assert plan.line == ("job 1 (algo.beta=0.04) finished before with another config (trainer.max_steps 2 -> 3); "
                         "starting it over")


def test_a_finished_job_trained_by_epochs_is_skipped_and_started_over_when_its_epochs_changed(compose, tmp_path):
    """The sweep's record of a finished job holds the composed max_steps that trainer.epochs replaced; the job's typed
    config the steps it gives: the steps follow from the epochs and the data, which are compared."""
    from grpo_cli.tasks.sources import steps_from_epochs

    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / sweep.SWEEP_COMMAND_FILE).write_text(json.dumps({"overrides": ["algo.beta=0.0,0.04"], "params": {}}))
    cfg, hydra, job_dir = _job(compose, sweep_dir, 1, "algo.beta=0.04", "trainer.epochs=0.01")
    (job_dir / "adapter").mkdir()
    _previous(job_dir, status="ok", result=0.25, config=job_config(cfg.recorded))  # as SweepSummary records it
    resolved = steps_from_epochs(cfg)
    assert resolved.trainer.max_steps != cfg.trainer.max_steps
    assert sweep_rerun.decide_job(resolved, hydra).action == "skip"
    changed, hydra, _ = _job(compose, sweep_dir, 1, "algo.beta=0.04", "trainer.epochs=0.02")
    plan = sweep_rerun.decide_job(steps_from_epochs(changed), hydra)
    assert plan.action == "restart" and "(trainer.epochs 0.01 -> 0.02)" in plan.line, plan.line


def test_an_unfinished_job_without_a_checkpoint_starts_over_and_an_empty_dir_starts_fresh(compose, tmp_path):
    sweep_dir = tmp_path / "sweep"
    cfg, hydra, job_dir = _job(compose, sweep_dir, 0, "algo.beta=0.0")
    assert sweep_rerun.decide_job(cfg, hydra).action == "fresh"
    (job_dir / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    _previous(job_dir, status="stopped")
    plan = sweep_rerun.decide_job(cfg, hydra)
    assert plan.action == "restart"
    assert plan.line == "job 0 (algo.beta=0.0) did not finish and has no intact checkpoint; starting it over"


# ---- in process: a re-run into a used sweep dir ------------------------------------------------------
def _multirun_config(sweep_dir: Path, overrides: list[str], overwrite: bool = False):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "runtime": {"cwd": str(sweep_dir.parent)},
                                       "overrides": {"task": overrides}, "sweeper": {"params": None}},
                             "trainer": {"overwrite": overwrite}})


def test_a_signal_between_jobs_ends_the_sweep_before_the_next_job(tmp_path, capsys, signal_handlers_kept):
    sweep_dir = tmp_path / "sweep"
    callback = sweep.SweepSummary()
    callback.on_multirun_start(_multirun_config(sweep_dir, ["algo.beta=0.0,0.04"]))
    assert pickle.loads(pickle.dumps(callback))._between_jobs is None  # joblib/submitit workers get a copy
    os.kill(os.getpid(), signal.SIGTERM)  # no job runs: the sweep's own handler takes it
    config = _multirun_config(sweep_dir, ["algo.beta=0.04"])
    config.hydra.update({"job": {"num": 1}, "runtime": {"output_dir": str(sweep_dir / "1"), "cwd": str(tmp_path)},
                         "sweep": {"dir": str(sweep_dir), "subdir": "1"}, "mode": sweep.RunMode.MULTIRUN})
    with pytest.raises(SystemExit) as exit_info:
        callback.on_job_start(config)
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1].endswith(  # after the program's name
        ": stopped by SIGTERM before job 1 (algo.beta=0.04) started; the sweep stops here; run the same command "
        "again to go on from this job")
    assert not (sweep_dir / "1" / sweep.JOB_STATUS).exists()


def test_the_same_command_continues_its_sweep_and_another_command_is_refused(tmp_path, capsys, signal_handlers_kept):
    sweep_dir = tmp_path / "sweep"
    callback = sweep.SweepSummary()
    first = ["algo.beta=0.0,0.04", "trainer.seed=0,1,2"]
    callback.on_multirun_start(_multirun_config(sweep_dir, first))
    sweep_id = (sweep_dir / sweep.SWEEP_ID_FILE).read_text()
    (sweep_dir / "0" / ".hydra").mkdir(parents=True)  # a job of it ran
    (sweep_dir / sweep.SUMMARY_CSV).write_text("job\n0\n")

    callback.on_multirun_start(_multirun_config(sweep_dir, first))
    assert (sweep_dir / sweep.SWEEP_ID_FILE).read_text() == sweep_id  # one sweep: one summary of all its jobs
    assert (sweep_dir / sweep.SUMMARY_CSV).is_file()
    callback.on_multirun_start(_multirun_config(sweep_dir, [*first, "trainer.resume=auto"]))  # what it does anyway
    assert (sweep_dir / sweep.SWEEP_ID_FILE).read_text() == sweep_id
    (sweep_dir / sweep.SWEEP_COMMAND_FILE).unlink()  # an older grpo-cli's sweep: its multirun.yaml has the command
    (sweep_dir / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": first}}}))
    callback.on_multirun_start(_multirun_config(sweep_dir, first))
    assert (sweep_dir / sweep.SWEEP_ID_FILE).read_text() == sweep_id

    with pytest.raises(SystemExit) as exit_info:
        callback.on_multirun_start(_multirun_config(sweep_dir, ["algo.beta=0.1,0.2"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"hydra.sweep.dir={sweep_dir} holds the jobs of another sweep command" in err
    assert (sweep_dir / sweep.SWEEP_ID_FILE).read_text() == sweep_id

    callback.on_multirun_start(_multirun_config(sweep_dir, ["algo.beta=0.1,0.2", "trainer.overwrite=true"], True))
    assert (sweep_dir / sweep.SWEEP_ID_FILE).read_text() != sweep_id  # a new sweep, every job started over


def test_sweep_seeds_above_one_is_refused_in_one_line(compose):
    from grpo_cli.base.errors import ConfigError
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError, match=r"sweep.seeds=3 is invalid: averaging one trial over several seeds is not "
                                          r"supported .*sweep trainer.seed=0,1,2"):
        validate(compose(["model=tiny", "sweep.seeds=3"]))
