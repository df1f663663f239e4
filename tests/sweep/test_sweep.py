"""Sweeps through the real grpo-train (-m): job dirs, sweep_summary.csv/json, failed jobs, submitit_local;
plus the summary/callback pieces in-process and the launcher/sweeper presets."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import module_on_path, read_jsonl, run_cli
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from grpo_cli.sweep import callback as sweep

TINY = ["+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "rollout.max_new_tokens=4",
        "data.prompts_per_step=2", "algo.num_generations=2", "trainer.log_samples_every=1"]


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def job_config(job_dir: Path) -> dict:
    return yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())


def final_reward(rows: list[dict]) -> float:
    rewards = [r["reward"] for r in rows]
    tail = rewards[-max(1, len(rewards) // 10):]
    return sum(tail) / len(tail)


# ---- a 2 x 2 grid, basic launcher ----------------------------------------------------------------
@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("grid")
    sweep_dir = cwd / "sweep"
    proc = run_cli(["-m", *TINY, "algo.beta=0.0,0.04", "algo.clip_eps=0.1,0.2", f"hydra.sweep.dir={sweep_dir}"],
                   cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cwd / "stderr.txt").write_text(proc.stderr)
    return sweep_dir


@pytest.mark.slow
def test_grid_over_clip_eps_on_policy_warns_once(grid):
    lines = [line for line in (grid.parent / "stderr.txt").read_text().splitlines() if "warning" in line]
    assert lines == [lines[0]] and lines[0].startswith("grpo-train: warning: sweeping algo.clip_eps measures nothing")
    assert "algo.mini_batches > 1" in lines[0]


@pytest.mark.slow
def test_grid_has_one_dir_per_job_with_its_own_outputs(grid):
    jobs = sorted((d for d in grid.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    assert [d.name for d in jobs] == ["0", "1", "2", "3"]
    pairs = []
    for d in jobs:
        rows = read_jsonl(d / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1]
        assert (d / "adapter" / "adapter_model.safetensors").is_file()
        assert {s["step"] for s in read_jsonl(d / "samples.jsonl")} == {0, 1}
        cfg = job_config(d)
        pairs.append((cfg["algo"]["beta"], cfg["algo"]["clip_eps"]))
        overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
        assert f"algo.beta={cfg['algo']['beta']}" in overrides
        assert f"algo.clip_eps={cfg['algo']['clip_eps']}" in overrides
        assert not (d / "error.txt").exists()
        assert json.loads((d / "job_status.json").read_text())["status"] == "ok"
    # Hydra's order: the last swept key varies fastest
    assert pairs == [(0.0, 0.1), (0.0, 0.2), (0.04, 0.1), (0.04, 0.2)]


@pytest.mark.slow
def test_grid_summary_csv_and_json(grid):
    rows = read_csv(grid / "sweep_summary.csv")
    assert len(rows) == 4
    assert list(rows[0])[:4] == ["job", "overrides", "algo.beta", "algo.clip_eps"]
    data = json.loads((grid / "sweep_summary.json").read_text())
    assert len(data) == 4
    for i, (row, js) in enumerate(zip(rows, data, strict=True)):
        cfg = job_config(grid / str(i))
        beta, clip = cfg["algo"]["beta"], cfg["algo"]["clip_eps"]
        assert row["job"] == str(i) and js["job"] == i
        assert row["overrides"] == js["overrides"] == f"algo.beta={beta} algo.clip_eps={clip}"
        assert float(row["algo.beta"]) == js["algo.beta"] == beta
        assert float(row["algo.clip_eps"]) == js["algo.clip_eps"] == clip
        metrics = read_jsonl(grid / str(i) / "metrics.jsonl")
        assert math.isfinite(js["final_reward"])
        assert js["final_reward"] == pytest.approx(final_reward(metrics)) == pytest.approx(float(row["final_reward"]))
        assert js["best_reward"] == pytest.approx(max(m["reward"] for m in metrics))
        assert js["mean_reward"] == pytest.approx(sum(m["reward"] for m in metrics) / len(metrics))
        assert js["final_kl"] == pytest.approx(metrics[-1]["kl"])
        assert js["final_clip_fraction"] == pytest.approx(metrics[-1]["clip_fraction"])
        for side in ("low", "high"):
            assert js[f"final_clip_fraction/{side}"] == pytest.approx(metrics[-1][f"clip_fraction/{side}"])
            assert float(row[f"final_clip_fraction/{side}"]) == js[f"final_clip_fraction/{side}"]
        for key in ("clip_fraction", "clip_fraction/low", "clip_fraction/high"):
            assert js[f"mean_{key}"] == pytest.approx(sum(m[key] for m in metrics) / len(metrics))
            assert float(row[f"mean_{key}"]) == pytest.approx(js[f"mean_{key}"])
        assert js["eval_accuracy"] is None and row["eval_accuracy"] == ""
        assert js["steps"] == 2 and row["steps"] == "2"
        assert js["status"] == row["status"] == "ok" and js["error"] == row["error"] == ""
        assert js["dir"] == str(i)


# ---- one job fails, the other still runs ---------------------------------------------------------
FAILING_REWARD = "def boom(prompts, completions, **kwargs):\n    raise RuntimeError('no score today')\n"


@pytest.mark.slow
def test_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path, tmp_path_factory):
    sweep_dir = tmp_path / "sweep"
    env = module_on_path(tmp_path_factory, "failing_reward", FAILING_REWARD)
    # the failing reward comes first: job 0 fails while it trains (its values are valid), job 1 must still run
    failing_then_fine = "+reward.functions.x._target_=failing_reward.boom,grpo_cli.rewards.arithmetic.bare_number"
    proc = run_cli(["-m", *TINY, failing_then_fine, f"hydra.sweep.dir={sweep_dir}"], tmp_path, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the summary callback ended the sweep (Hydra did not re-raise the failure past it)
    assert "Error executing job" not in proc.stderr
    assert f"grpo-train: 1 of 2 sweep jobs failed; summary {sweep_dir / 'sweep_summary.csv'}" in proc.stderr
    assert "no score today" in proc.stderr

    error_line = (sweep_dir / "0" / "error.txt").read_text().splitlines()[0]
    assert error_line.startswith("grpo-train: ") and "no score today" in error_line
    assert not (sweep_dir / "0" / "adapter").exists()
    ok = read_jsonl(sweep_dir / "1" / "metrics.jsonl")
    assert [r["step"] for r in ok] == [0, 1] and "reward/x" in ok[0]
    assert (sweep_dir / "1" / "adapter" / "adapter_model.safetensors").is_file()

    rows = read_csv(sweep_dir / "sweep_summary.csv")
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == [d["status"] for d in data] == ["failed", "ok"]
    assert rows[0]["error"] == data[0]["error"] == error_line
    assert rows[0]["overrides"] == "+reward.functions.x._target_=failing_reward.boom"
    assert data[0]["reward.functions.x._target_"] == "failing_reward.boom"
    assert data[0]["final_reward"] is None and rows[0]["final_reward"] == "" and data[0]["steps"] == 0
    assert data[1]["error"] == "" and data[1]["final_reward"] == pytest.approx(final_reward(ok))
    assert data[1]["overrides"] == "+reward.functions.x._target_=grpo_cli.rewards.arithmetic.bare_number"


# ---- submitit_local launcher ---------------------------------------------------------------------
@pytest.mark.slow
def test_submitit_local_runs_two_jobs(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "hydra/launcher=submitit_local", "algo.beta=0.0,0.04", f"hydra.sweep.dir={sweep_dir}"],
                   tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert any((sweep_dir / ".submitit").iterdir())  # the jobs ran as submitit subprocesses
    betas = []
    for i in (0, 1):
        assert [r["step"] for r in read_jsonl(sweep_dir / str(i) / "metrics.jsonl")] == [0, 1]
        assert (sweep_dir / str(i) / "adapter" / "adapter_model.safetensors").is_file()
        betas.append(job_config(sweep_dir / str(i))["algo"]["beta"])
    assert betas == [0.0, 0.04]
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [(d["job"], d["overrides"], d["status"]) for d in data] == [
        (0, "algo.beta=0.0", "ok"), (1, "algo.beta=0.04", "ok")]
    assert all(math.isfinite(d["final_reward"]) for d in data)


# ---- pieces, in-process --------------------------------------------------------------------------
def test_device_for_job_cycles_over_devices():
    assert [sweep.device_for_job(n, 4) for n in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [sweep.device_for_job(n, 1) for n in range(3)] == [0, 0, 0]
    # n_jobs == device count: jobs that run together never share a device
    assert len({sweep.device_for_job(n, 8) for n in range(16, 24)}) == 8
    with pytest.raises(ValueError):
        sweep.device_for_job(0, 0)


def test_job_dirs_are_found_in_job_order_at_any_depth(tmp_path):
    for job in ("10", "2", "0", "b/1", "a/3"):
        (tmp_path / job / ".hydra").mkdir(parents=True)
    (tmp_path / ".submitit" / "x" / ".hydra").mkdir(parents=True)  # hidden dirs hold no jobs
    (tmp_path / "2" / "inner" / ".hydra").mkdir(parents=True)      # nor does the inside of a job
    found = [d.relative_to(tmp_path).as_posix() for d in sweep.find_job_dirs(tmp_path)]
    assert found == ["0", "2", "10", "a/3", "b/1"]


def test_override_key_drops_hydra_prefixes():
    from grpo_cli.config import override_key

    assert [override_key(line) for line in ("+recipe=gsm8k", "++algo.beta=0.1", "~eval.adapter", "a.b=c=d", "x")] == \
        ["recipe", "algo.beta", "eval.adapter", "a.b", "x"]


def test_error_line():
    assert sweep.error_line(RuntimeError("grpo-train: x=1 is invalid: no")) == "grpo-train: x=1 is invalid: no"
    assert sweep.error_line(KeyError("k")) == "KeyError: 'k'"
    assert sweep.error_line(ValueError("first\nsecond")) == "ValueError: first"


def _job_config(sweep_dir: Path, num: int, sweeper: str = sweep.BASIC_SWEEPER):
    from hydra.types import RunMode

    job_dir = sweep_dir / str(num)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"algo.beta={num / 10}", "model=tiny"]))
    cfg = OmegaConf.create({"hydra": {
        "mode": RunMode.MULTIRUN, "sweep": {"dir": str(sweep_dir), "subdir": "${hydra.job.num}"},
        "job": {"num": num}, "runtime": {"output_dir": str(job_dir), "cwd": str(sweep_dir.parent)},
        "sweeper": {"_target_": sweeper}, "launcher": {"_target_": "basic"},
        "overrides": {"task": [f"algo.beta={num / 10}", "model=tiny"]},
    }, "trainer": {"device": "auto"}})
    (job_dir / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": {
        "job": {"num": num}, "overrides": {"task": [f"algo.beta={num / 10}", "model=tiny"]}}}))
    return cfg, job_dir


def test_callback_records_a_failure_and_keeps_the_basic_sweep_going(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    cb = sweep.SweepSummary()
    cb.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "runtime": {"cwd": "/"}}}))
    stale, _ = _job_config(sweep_dir, 5)  # a job dir left by an earlier sweep into the same dir
    (sweep_dir / "5" / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward": 9.0}) + "\n")

    cfg0, dir0 = _job_config(sweep_dir, 0)
    cb.on_job_start(cfg0)
    metrics_rows = [{"step": s, "reward": r, "kl": 0.1 * s, "clip_fraction": 0.0}
                    for s, r in enumerate([0.1, 0.5, 0.3])]
    (dir0 / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics_rows) + '{"step": 3, "rew')
    ret = JobReturn(status=JobStatus.COMPLETED, _return_value=0.3)
    cb.on_job_end(cfg0, ret)

    cfg1, dir1 = _job_config(sweep_dir, 1)
    cb.on_job_start(cfg1)
    try:
        raise RuntimeError("grpo-train: reward.functions.x._target_=a.b is invalid: cannot be imported")
    except RuntimeError as err:
        failed = JobReturn(status=JobStatus.FAILED, _return_value=err)
    cb.on_job_end(cfg1, failed)
    assert failed.status == JobStatus.COMPLETED and math.isnan(failed.return_value)  # BasicSweeper goes on
    assert (dir1 / "error.txt").read_text().startswith("grpo-train: reward.functions.x._target_=a.b is invalid")
    assert "Traceback" in (dir1 / "error.txt").read_text()

    data = json.loads((sweep_dir / "sweep_summary.json").read_text())  # written after each job already
    assert [(d["job"], d["overrides"], d["algo.beta"], d["status"]) for d in data] == [
        (0, "algo.beta=0.0", 0.0, "ok"), (1, "algo.beta=0.1", 0.1, "failed")]
    assert data[0]["final_reward"] == 0.3 and data[0]["best_reward"] == 0.5 and data[0]["steps"] == 3
    assert data[0]["mean_reward"] == pytest.approx(0.3)
    assert data[0]["final_kl"] == pytest.approx(0.2)
    assert "model" not in data[0]  # the same in every job: not a swept key

    end_cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "runtime": {"cwd": "/"}}})
    with pytest.raises(SystemExit) as stop:
        cb.on_multirun_end(end_cfg)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "1 of 2 sweep jobs failed" in err and "a.b is invalid" in err


def test_callback_leaves_other_sweepers_failures_alone(tmp_path):
    cfg, job_dir = _job_config(tmp_path / "sweep", 0,
                               sweeper="hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper")
    cb = sweep.SweepSummary()
    cb.on_job_start(cfg)
    failed = JobReturn(status=JobStatus.FAILED, _return_value=ValueError("boom"))
    cb.on_job_end(cfg, failed)
    assert failed.status == JobStatus.FAILED  # Optuna marks the trial FAIL itself (NaN would crash it)
    assert (job_dir / "error.txt").read_text().startswith("ValueError: boom")


def _sweep_config(task: list[str], params: dict | None = None, mini_batches: int = 1, num_iterations: int = 1):
    return OmegaConf.create({"hydra": {"overrides": {"task": task}, "sweeper": {"params": params}},
                             "algo": {"mini_batches": mini_batches, "num_iterations": num_iterations}})


def test_on_policy_clip_sweep_warning():
    grid = ["+recipe=quickstart", "algo.beta=0.0,0.04", "algo.clip_eps=0.1,0.3"]
    line = sweep.on_policy_clip_sweep(_sweep_config(grid))
    assert line and "sweeping algo.clip_eps measures nothing" in line and "algo.num_iterations > 1" in line
    assert "algo.clip_eps_high" in sweep.on_policy_clip_sweep(_sweep_config(["algo.clip_eps_high=0.2,0.28"]))
    assert sweep.on_policy_clip_sweep(_sweep_config([], params={"algo.clip_eps": "interval(0.05, 0.3)"}))  # Optuna
    cispo = _sweep_config(["algo.objective=cispo", "algo.clip_eps=0.1,0.3"])
    cispo.algo.objective = "cispo"
    assert sweep.on_policy_clip_sweep(cispo) is None  # no clip to act: each job's own warning says so
    # clipping can act, or the user compares on- and off-policy on purpose, or clip eps is not swept: no warning
    assert sweep.on_policy_clip_sweep(_sweep_config(grid, mini_batches=4)) is None
    assert sweep.on_policy_clip_sweep(_sweep_config(grid, num_iterations=2)) is None
    assert sweep.on_policy_clip_sweep(_sweep_config([*grid, "algo.mini_batches=1,4"])) is None
    assert sweep.on_policy_clip_sweep(_sweep_config(["+recipe=quickstart,gsm8k", "algo.clip_eps=0.1,0.3"])) is None
    assert sweep.on_policy_clip_sweep(_sweep_config(["algo.beta=0.0,0.04", "algo.clip_eps=0.1"])) is None


# ---- presets -------------------------------------------------------------------------------------
def _compose_hydra(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_callback_is_registered():
    cfg = _compose_hydra([])
    assert cfg.hydra.callbacks.sweep_summary._target_ == "grpo_cli.sweep.SweepSummary"


def test_optuna_preset_maximises_the_reward():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    s = _compose_hydra(["hydra/sweeper=optuna_reward"]).hydra.sweeper
    assert s._target_.endswith("OptunaSweeper") and s.direction == "maximize"
    assert s.params == {"algo.beta": "interval(0.0, 0.1)", "algo.clip_eps": "interval(0.05, 0.3)"}
    assert s.max_failure_rate == 1.0 and s.n_trials >= 1


@pytest.mark.slow
def test_optuna_sweep_of_the_real_cli_reports_its_best_trial(tmp_path):
    """`grpo-train -m hydra/sweeper=optuna_reward`: each trial's return value is its final reward, so Optuna's
    best value is the best final_reward of the sweep summary, and its parameters lie in the preset's intervals."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "optuna"
    proc = run_cli(["-m", "hydra/sweeper=optuna_reward", *TINY, "algo.mini_batches=2", "hydra.sweeper.n_trials=3",
                    f"hydra.sweep.dir={sweep_dir}"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert best["best_value"] == pytest.approx(max(r["final_reward"] for r in rows))
    assert 0.0 <= best["best_params"]["algo.beta"] <= 0.1 and 0.05 <= best["best_params"]["algo.clip_eps"] <= 0.3
    assert len({(r["algo.beta"], r["algo.clip_eps"]) for r in rows}) == 3  # three sampled points, one per trial


def test_slurm_preset(monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.delenv("SLURM_PARTITION", raising=False)
    launcher = _compose_hydra(["hydra/launcher=slurm"]).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.partition == "gpu" and launcher.gpus_per_node == 1 and launcher.timeout_min == 240
    monkeypatch.setenv("SLURM_PARTITION", "a100")
    assert _compose_hydra(["hydra/launcher=slurm"]).hydra.launcher.partition == "a100"


@pytest.mark.parametrize("argv, words", [([], "usage: python -m grpo_cli.sweep SWEEP_DIR"),
                                         (["/no/such/sweep"], "no such directory, /no/such/sweep")])
def test_main_bad_input_is_one_line_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        sweep.main(argv)
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("grpo_cli.sweep: ") and words in err[0]
