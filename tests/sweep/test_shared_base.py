"""hydra/launcher=shared_base through the real grpo-train -m: a 2 x 2 grid on the tiny model whose jobs train as
adapters of one loaded base, each job's records equal to the same job run by the basic launcher; a sweep whose jobs
cannot share a base refused before anything loads; a failing job ends alone; SIGTERM stops every job with its
checkpoint and the same command resumes each exactly."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import yaml
from conftest import VARIED_REWARD, assert_learned, module_on_path, read_jsonl, run_cli
from test_sweep import read_csv
from test_sweep_resume import _stop_when

from grpo_cli.base.errors import ConfigError
from grpo_cli.sweep import shared_base

# the basic sweep of tests/sweep/test_sweep.py, three steps, a reward that varies and a learning rate that moves the
# adapter, over algo.beta x optimizer.lr
GRID = ["-m", "+recipe=quickstart", "model=tiny", "trainer.device=cpu", "trainer.max_steps=3",
        "rollout.max_new_tokens=6", "data.prompts_per_step=2", "algo.num_generations=4",
        "trainer.log_samples_every=1", *VARIED_REWARD, "algo.beta=0.0,0.04", "optimizer.lr=1e-2,3e-3"]
SHARED = "hydra/launcher=shared_base"
TIMING = ("_time_s", "_per_s", "gen_compile_s", "gen_sync_s")  # wall-clock fields: never equal between two runs


def sweep(tmp_path_factory, label: str, *extra: str) -> Path:
    cwd = tmp_path_factory.mktemp(label)
    proc = run_cli([*GRID, *extra, f"hydra.sweep.dir={cwd / 'sweep'}"], cwd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cwd / "stderr.txt").write_text(proc.stderr)
    (cwd / "stdout.txt").write_text(proc.stdout)
    return cwd / "sweep"


@pytest.fixture(scope="module")
def basic(tmp_path_factory) -> Path:
    return sweep(tmp_path_factory, "basic")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return sweep(tmp_path_factory, "shared", SHARED)


def numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith(TIMING)}


def assert_jobs_equal(alone: Path, together: Path, tolerance: float) -> None:
    """Every job's metrics (to `tolerance`; 0: bit for bit), samples, adapter and status as the job alone has them."""
    from safetensors.torch import load_file

    for job in range(4):
        rows, others = read_jsonl(alone / str(job) / "metrics.jsonl"), read_jsonl(together / str(job) / "metrics.jsonl")
        assert [r["step"] for r in others] == [0, 1, 2]
        for row, other in zip(rows, others, strict=True):
            row, other = numbers(row), numbers(other)
            assert row.keys() == other.keys()
            for key, value in row.items():
                if isinstance(value, float) and tolerance:
                    assert math.isclose(value, other[key], rel_tol=tolerance, abs_tol=tolerance), (job, key)
                else:
                    assert value == other[key], (job, row["step"], key)
        samples = [(s["completion"], s["reward"]) for s in read_jsonl(alone / str(job) / "samples.jsonl")]
        assert samples == [(s["completion"], s["reward"]) for s in read_jsonl(together / str(job) / "samples.jsonl")]
        a = load_file(alone / str(job) / "adapter" / "adapter_model.safetensors")
        b = load_file(together / str(job) / "adapter" / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        assert all((a[k] - b[k]).abs().max() <= tolerance for k in a)
        status = json.loads((together / str(job) / "job_status.json").read_text())
        assert status["status"] == "ok" and status["config"] == json.loads(
            (alone / str(job) / "job_status.json").read_text())["config"]


@pytest.mark.slow
def test_each_job_on_one_base_equals_the_job_run_by_the_basic_launcher(basic, shared):
    """The default engine on the CPU (merged) generates each job's rows in a pass of its own: bit for bit."""
    assert_learned(basic / "3")  # the jobs learned: equal records can differ
    assert len({json.dumps(numbers(read_jsonl(basic / str(j) / "metrics.jsonl")[-1])) for j in range(4)}) == 4
    assert_jobs_equal(basic, shared, tolerance=0.0)
    stderr = (shared.parent / "stderr.txt").read_text()
    assert stderr.count("grpo-train: loading tiny-random once for the sweep's jobs") == 1
    assert "generation: one pass per job on one merged engine" in stderr
    assert "job 3: step 2 done (3/3)" in (shared.parent / "stdout.txt").read_text()  # each job's lines, labelled
    cells = [{k: v for k, v in row.items() if "time" not in k} for row in read_csv(shared / "sweep_cells.csv")]
    assert cells == [{k: v for k, v in row.items() if "time" not in k} for row in read_csv(basic / "sweep_cells.csv")]
    for job in range(4):  # Hydra's own records of each job, as the basic launcher writes them
        overrides = yaml.safe_load((shared / str(job) / ".hydra" / "overrides.yaml").read_text())
        assert overrides == yaml.safe_load((basic / str(job) / ".hydra" / "overrides.yaml").read_text())


@pytest.mark.slow
def test_one_batch_across_the_adapters_on_the_hf_engine_equals_each_job_alone(tmp_path_factory):
    """rollout.engine=hf: every job's rows in one generate call (peft's adapter_names), to 1e-5 of the basic
    launcher's jobs (here, with the same prompts in every job, bit for bit)."""
    alone = sweep(tmp_path_factory, "hf_basic", "rollout.engine=hf")
    together = sweep(tmp_path_factory, "hf_shared", "rollout.engine=hf", SHARED)
    assert "generation: one batch across the jobs' adapters (hf)" in (together.parent / "stderr.txt").read_text()
    assert_jobs_equal(alone, together, tolerance=1e-5)


# ---- what cannot share a base, before anything loads ---------------------------------------------
def test_the_keys_the_jobs_of_one_base_may_differ_in():
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()

    def jobs(*per_job: list[str], base: tuple[str, ...] = ("+recipe=quickstart", "model=smollm2-135m")):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return [compose("config", [*base, *overrides], return_hydra_config=True) for overrides in per_job]

    fine = jobs(["algo.beta=0.0", "trainer.seed=0", "optimizer.lr=1e-5", "reward.functions.bare.weight=0.5"],
                ["algo.beta=0.04", "trainer.seed=1", "optimizer.lr=1e-4", "model.lora.r=32", "eval.num_prompts=10"])
    shared_base.check_shareable(fine, ["a", "b"])
    for first, second, key in [
        (["rollout.max_new_tokens=12"], ["rollout.max_new_tokens=16"], "rollout.max_new_tokens"),
        (["algo.num_generations=8"], ["algo.num_generations=4"], "algo.num_generations"),
        (["data.prompts_per_step=4"], ["data.prompts_per_step=2"], "data.prompts_per_step"),
        (["model.dtype=float32"], ["model.dtype=bfloat16"], "model.dtype"),
        (["model.lora.target_modules=[q_proj]"], ["model.lora.target_modules=all-linear"],
         "model.lora.target_modules"),
    ]:
        with pytest.raises(ConfigError) as refused:
            shared_base.check_shareable(jobs(first, second), ["a", "b"])
        assert f"job 1 (b) differs from job 0 (a) in {key} (" in str(refused.value)
    with pytest.raises(ConfigError, match="model=tiny draws its random base from trainer.seed"):
        shared_base.check_shareable(jobs(["trainer.seed=0"], ["trainer.seed=1"], base=("model=tiny",)), ["a", "b"])
    with pytest.raises(ConfigError, match=r"rollout.placement=worker is invalid with hydra/launcher=shared_base"):
        shared_base.check_shareable(jobs(["rollout.placement=worker"], ["rollout.placement=worker"]), ["a", "b"])


@pytest.mark.slow
def test_a_sweep_whose_jobs_differ_in_the_base_is_refused_in_one_line_before_anything_loads(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli([*GRID[:-2], "rollout.max_new_tokens=4,6", SHARED, f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == ("grpo-train: hydra/launcher=shared_base trains every job on one loaded base: job 1 "
                         "(rollout.max_new_tokens=6) differs from job 0 (rollout.max_new_tokens=4) in "
                         f"rollout.max_new_tokens (4 -> 6); the jobs on one base share it (they may differ in "
                         f"{', '.join(shared_base.MAY_DIFFER)}, but algo.num_generations); sweep "
                         "rollout.max_new_tokens with hydra/launcher=basic or joblib")
    assert "Traceback" not in proc.stderr and not (sweep_dir / "0").exists()


# ---- one job's failure is its own; a stop is every job's -------------------------------------------
FAILING_REWARD = "def boom(prompts, completions, **kwargs):\n    raise RuntimeError('no score today')\n"


@pytest.mark.slow
def test_a_job_that_fails_ends_alone_and_the_others_go_on(tmp_path, tmp_path_factory):
    """A reward that raises (jobs 0, 1) and non-finite updates (job 3) end their jobs, each recorded so; job 2 trains
    its three steps."""
    sweep_dir = tmp_path / "sweep"
    env = module_on_path(tmp_path_factory, "failing_reward", FAILING_REWARD)
    proc = run_cli([*GRID[:-2], "+reward.functions.x._target_=failing_reward.boom,grpo_cli.rewards.arithmetic."
                    "bare_number", "optimizer.lr=1e-2,1e30", "trainer.max_skipped=1", SHARED,
                    f"hydra.sweep.dir={sweep_dir}"], tmp_path, env=env, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    status = [json.loads((sweep_dir / str(j) / "job_status.json").read_text()) for j in range(4)]
    assert [s["status"] for s in status] == ["failed", "failed", "ok", "failed"]
    assert "reward x raised RuntimeError on completion 0: no score today" in status[0]["error"]
    assert "reward x raised RuntimeError on completion 0: no score today" in status[1]["error"]
    assert "non-finite updates in a row" in status[3]["error"]
    assert [r["step"] for r in read_jsonl(sweep_dir / "2" / "metrics.jsonl")] == [0, 1, 2]
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"]) for r in rows] == [(0, "failed"), (1, "failed"), (2, "ok"), (3, "failed")]
    assert "3 of 4 sweep jobs failed" in proc.stderr


@pytest.mark.slow
def test_sigterm_stops_every_job_with_its_checkpoint_and_the_same_command_resumes_each_exactly(tmp_path, basic):
    sweep_dir = tmp_path / "sweep"
    command = [*GRID, SHARED, f"hydra.sweep.dir={sweep_dir}"]
    # every job has a complete step (the last to write one is job 3): SIGTERM the sweep
    stopped = _stop_when(command, tmp_path, sweep_dir / "3" / "metrics.jsonl")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.stderr.count("SIGTERM received: stopping now") == 1
    for job in range(4):
        status = json.loads((sweep_dir / str(job) / "job_status.json").read_text())
        assert status["status"] == "stopped", status
        assert f"stopped by SIGTERM in job {job} (" in status["error"]
        assert list((sweep_dir / str(job) / "checkpoints").iterdir())
        assert not (sweep_dir / str(job) / "adapter").exists()

    again = run_cli(command, tmp_path, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    for job in range(4):
        assert f"job {job} (" in again.stderr and "did not finish; resuming it from" in again.stderr
    assert_jobs_equal(basic, sweep_dir, tolerance=0.0)  # and so equal to each job alone, straight through
