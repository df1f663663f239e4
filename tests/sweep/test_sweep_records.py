"""What a sweep's records can and cannot do to its answer: a damaged or missing record of a finished job is named
in one line by grpo-report and by the sweep summary, the ranking metric never changes in silence, the cells on
disk and the printed table agree; a sweep dir has one writer; a bad grid value is refused before any job runs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from omegaconf import OmegaConf
from test_sweep_cells import write_sweep

from grpo_cli.base.errors import ConfigError
from grpo_cli.commands import report
from grpo_cli.sweep import callback as sweep
from grpo_cli.sweep.summary import CELLS_CSV, FINAL_EVAL, SWEEP_ID_FILE, write_summary

TINY = ["+recipe=quickstart", "model=tiny", "trainer.max_steps=1", "rollout.max_new_tokens=4",
        "data.prompts_per_step=2", "algo.num_generations=2", "trainer.log_samples_every=0"]


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture
def finished(tmp_path) -> Path:
    """A sweep of two cells x two seeds whose jobs all wrote final_eval.json, summarised as the sweep left it."""
    jobs = [({"algo.beta": b, "trainer.seed": s}, acc, "ok")
            for b, accs in ((0.0, (0.8, 0.9)), (0.04, (0.2, 0.3))) for s, acc in enumerate(accs)]
    sweep_dir = write_sweep(tmp_path / "sweep", jobs)
    write_summary(sweep_dir)
    assert {c["rank_by"] for c in read_csv(sweep_dir / CELLS_CSV)} == {"final_eval_accuracy"}
    return sweep_dir


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": warning: " in line]


def test_a_truncated_final_eval_is_named_by_grpo_report_and_the_metric_change_is_said(finished, capsys):
    (finished / "3" / FINAL_EVAL).write_text('{"step": 4, "eval/accur')  # cut short
    assert report.main([str(finished)]) == 0
    out, err = capsys.readouterr()
    lines = warnings_of(err)
    assert any(line.startswith("grpo-report: warning: 3/final_eval.json is not valid JSON") for line in lines), err
    assert any("ranks the cells by mean_reward, not final_eval_accuracy" in line and "job(s) 3" in line
               for line in lines), err
    # the table printed and the file on disk say the same metric
    assert "ranked by mean_reward" in out
    assert {c["rank_by"] for c in read_csv(finished / CELLS_CSV)} == {"mean_reward"}
    job3 = next(r for r in read_csv(finished / "sweep_summary.csv") if r["job"] == "3")
    assert job3["status"] == "ok" and job3["error"].startswith("final_eval.json is not valid JSON")


def test_a_missing_final_eval_is_named_by_the_sweep_summary(finished, capsys):
    (finished / "1" / FINAL_EVAL).unlink()
    assert sweep.main([str(finished)]) == 0
    lines = warnings_of(capsys.readouterr().err)
    assert any(line.startswith("grpo_cli.sweep: warning: 1/final_eval.json is missing, though other finished jobs "
                               "have one") for line in lines), lines
    assert any("ranks the cells by mean_reward" in line for line in lines)
    assert {c["rank_by"] for c in read_csv(finished / CELLS_CSV)} == {"mean_reward"}


def test_a_named_metric_stays_and_the_damaged_job_leaves_its_cell(tmp_path, capsys):
    jobs = [({"algo.beta": b, "trainer.seed": s}, acc, "ok")
            for b, accs in ((0.0, (0.8, 0.9)), (0.04, (0.2, 0.3))) for s, acc in enumerate(accs)]
    sweep_dir = write_sweep(tmp_path / "sweep", jobs, metric="final_eval_accuracy")
    (sweep_dir / "0" / FINAL_EVAL).write_text("[1, 2]")
    assert sweep.main([str(sweep_dir)]) == 0
    lines = warnings_of(capsys.readouterr().err)
    assert len(lines) == 1 and "0/final_eval.json is a JSON list, not an object" in lines[0]
    cells = {c["algo.beta"]: c for c in read_csv(sweep_dir / CELLS_CSV)}
    assert {c["rank_by"] for c in cells.values()} == {"final_eval_accuracy"}
    assert cells["0.0"]["final_eval_accuracy_n"] == "1" and cells["0.04"]["final_eval_accuracy_n"] == "2"


def test_a_damaged_job_status_keeps_its_job_in_the_summary_and_says_so(finished, capsys):
    (finished / SWEEP_ID_FILE).write_text("abc\n")  # a sweep with an id: its jobs carry it
    for num in range(4):
        status = {"sweep_id": "abc", "job": num, "status": "ok"}
        (finished / str(num) / "job_status.json").write_text(json.dumps(status))
        (finished / str(num) / "adapter").mkdir()
    (finished / "2" / "job_status.json").write_text('{"sweep_id": "ab')
    assert sweep.main([str(finished)]) == 0
    lines = warnings_of(capsys.readouterr().err)
    assert any(line.startswith("grpo_cli.sweep: warning: 2/job_status.json is not valid JSON") and "read as ok" in line
               for line in lines), lines
    assert [r["job"] for r in read_csv(finished / "sweep_summary.csv")] == ["0", "1", "2", "3"]


def test_intact_records_give_no_line(finished, capsys):
    assert sweep.main([str(finished)]) == 0
    assert warnings_of(capsys.readouterr().err) == []


# ---- one writer per sweep dir -------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from omegaconf import OmegaConf
from grpo_cli.sweep import callback as sweep
sweep_dir = Path(sys.argv[1])
cb = sweep.SweepSummary()
cb.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "runtime": {"cwd": "/"},
                                                 "overrides": {"task": ["algo.beta=0.0,0.04"]}}}))
(sweep_dir / "ready").touch()
time.sleep(120)
"""


def test_a_second_sweep_into_a_busy_sweep_dir_is_refused_naming_the_first_pid(tmp_path, capsys, signal_handlers_kept):
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(sweep_dir)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (sweep_dir / "ready").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (sweep_dir / "ready").exists(), "the first sweep did not start"
        sweep_id = (sweep_dir / SWEEP_ID_FILE).read_text()
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "runtime": {"cwd": "/"},
                                             "overrides": {"task": ["algo.beta=0.0,0.04"]}}})
        with pytest.raises(SystemExit) as refused:
            sweep.SweepSummary().on_multirun_start(config)  # the same command, at the same time
        assert refused.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"hydra.sweep.dir={sweep_dir} is in use by" in err[0]
        assert f"pid {first.pid} " in err[0] and "pick another hydra.sweep.dir" in err[0]
        assert (sweep_dir / SWEEP_ID_FILE).read_text() == sweep_id  # nothing of the first one's was touched
    finally:
        first.kill()
        first.wait()
    sweep.SweepSummary().on_multirun_start(config)  # its process is gone: the dir is free again


def test_one_sweep_started_twice_in_one_process_takes_its_own_lock(tmp_path, signal_handlers_kept):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}, "runtime": {"cwd": "/"},
                                         "overrides": {"task": ["algo.beta=0.0,0.04"]}}})
    callback = sweep.SweepSummary()
    callback.on_multirun_start(config)
    callback.on_multirun_start(config)
    callback.on_multirun_end(config)
    sweep.SweepSummary().on_multirun_start(config)  # released at the end


# ---- every job checked before the first starts ------------------------------------------------------
def test_check_jobs_names_the_first_bad_job(compose):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = hydra_compose("config", overrides=["+recipe=quickstart", "model=tiny"], return_hydra_config=True)
        OmegaConf.update(config, "hydra.overrides.task",
                         ["+recipe=quickstart", "model=tiny", "algo.beta=0.0,0.04", "rollout.temperature=1.0,-2"])
        assert [o[-2:] for o in sweep.job_overrides(config)] == [
            ["algo.beta=0.0", "rollout.temperature=1.0"], ["algo.beta=0.0", "rollout.temperature=-2"],
            ["algo.beta=0.04", "rollout.temperature=1.0"], ["algo.beta=0.04", "rollout.temperature=-2"]]
        with pytest.raises(ConfigError) as bad:
            sweep.check_jobs(config)
    assert str(bad.value).startswith("job 1 (algo.beta=0.0 rollout.temperature=-2): rollout.temperature=-2 is invalid")
    assert str(bad.value).endswith("; no job was started") and "\n" not in str(bad.value)


@pytest.mark.slow
def test_a_bad_grid_value_is_refused_before_any_job_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "algo.beta=0.0,-1", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("grpo-train: job 1 (algo.beta=-1): algo.beta=-1 is invalid: needs beta >= 0; no job "
                                   "was started")
    assert not (sweep_dir / "0").exists()  # job 0, valid, did not run first


@pytest.mark.slow
def test_a_grid_naming_a_reward_that_cannot_be_imported_is_refused_before_any_job_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "+reward.functions.x._target_=grpo_cli.rewards.arithmetic.bare_number,nowhere.missing",
                    f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("grpo-train: job 1 (+reward.functions.x._target_=nowhere.missing): "
                           "reward.functions.x._target_=nowhere.missing is invalid: cannot be imported")
    assert not (sweep_dir / "0").exists()
