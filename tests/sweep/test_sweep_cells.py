"""Seed-aware sweep cells end to end: sweep_cells.csv/json from synthetic sweep dirs (values worked out by hand),
eval.final's held-out score and sweep.metric, grpo-report's cell heatmap, curves and ranked table, and one real
`grpo-train -m` sweep over a beta x seed grid."""

from __future__ import annotations

import csv
import json
import math
import signal
from functools import partial
from pathlib import Path

import pytest
from conftest import run_cli
from omegaconf import OmegaConf
from rich.console import Console
from scipy import stats

from grpo_cli.base.errors import ConfigError
from grpo_cli.commands.report import make_report
from grpo_cli.config.schema import Config
from grpo_cli.run.validate import validate
from grpo_cli.step.evaluate import eval_rows
from grpo_cli.sweep import callback as sweep
from grpo_cli.sweep.stats import BEST, LEADS, TIED, UNTESTED, WORSE
from grpo_cli.tasks.sources import final_eval_on

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_job(sweep_dir: Path, num: int, overrides: dict, *, accuracy: float | None = None, status: str = "ok",
              steps: int = 4, reward: float = 0.5) -> None:
    """A job dir as Hydra, the trainer and SweepSummary leave it: overrides, metrics, status, final_eval.json."""
    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {k}={v}\n" for k, v in overrides.items()))
    rows = [{"step": s, "reward": reward + 0.1 * s * (num % 3), "kl": 0.01 * s} for s in range(steps)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "job_status.json").write_text(json.dumps({"sweep_id": None, "job": num, "status": status,
                                                     "error": "boom" if status == "failed" else None}))
    if accuracy is not None:
        (job / "final_eval.json").write_text(json.dumps({"step": steps, "eval/accuracy": accuracy}))


def write_sweep(sweep_dir: Path, jobs: list[tuple[dict, float | None, str]], metric: str = "auto") -> Path:
    sweep_dir.mkdir()
    (sweep_dir / "multirun.yaml").write_text(f"hydra:\n  mode: MULTIRUN\nsweep:\n  metric: {metric}\n")
    for num, (overrides, accuracy, status) in enumerate(jobs):
        write_job(sweep_dir, num, overrides, accuracy=accuracy, status=status)
    return sweep_dir


# beta 0.0: n = 5; beta 0.04: n = 2 plus a failed job; beta 0.1: n = 1; beta 0.2: n = 2, far below
ACCURACY = {0.0: [0.5, 0.6, 0.7, 0.8, 0.9], 0.04: [0.4, 0.6], 0.1: [0.3], 0.2: [0.10, 0.12]}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> Path:
    jobs = [({"algo.beta": b, "trainer.seed": s}, acc, "ok")
            for b, accs in ACCURACY.items() for s, acc in enumerate(accs)]
    jobs.append(({"algo.beta": 0.04, "trainer.seed": 2}, None, "failed"))
    sweep_dir = write_sweep(tmp_path_factory.mktemp("seeded") / "sweep", jobs)
    sweep.write_summary(sweep_dir)
    return sweep_dir


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_cells_n5_n2_n1_and_a_failed_job_by_hand(seeded):
    cells = {c["algo.beta"]: c for c in json.loads((seeded / "sweep_cells.json").read_text())}
    assert list(cells) == [0.0, 0.04, 0.1, 0.2]  # best first
    best, pair, single, low = cells[0.0], cells[0.04], cells[0.1], cells[0.2]
    assert {c["rank_by"] for c in cells.values()} == {"final_eval_accuracy"}  # auto: every ok job has it

    # n = 5: mean 0.7, std sqrt(0.1 / 4), half-width t(0.975, 4) * std / sqrt(5) with t = 2.7764 (t-table)
    assert best["final_eval_accuracy_n"] == 5 and best["final_eval_accuracy_mean"] == pytest.approx(0.7)
    assert best["final_eval_accuracy_std"] == pytest.approx(math.sqrt(0.025))
    half = 2.7764 * math.sqrt(0.025) / math.sqrt(5)
    assert best["final_eval_accuracy_ci_low"] == pytest.approx(0.7 - half, abs=1e-4)
    assert best["final_eval_accuracy_ci_high"] == pytest.approx(0.7 + half, abs=1e-4)
    assert (best["rank"], best["label"], best["p_vs_best"], best["note"]) == (1, BEST, None, "")

    # n = 2 (its third job failed): mean 0.5, std sqrt(0.02), half-width t(0.975, 1) * 0.1 with t = 12.7062
    assert (pair["jobs"], pair["ok"], pair["failed"], pair["seeds"]) == (3, 2, 1, [0, 1, 2])
    assert pair["final_eval_accuracy_n"] == 2 and pair["final_eval_accuracy_mean"] == pytest.approx(0.5)
    assert pair["final_eval_accuracy_ci_high"] == pytest.approx(0.5 + 12.7062 * 0.1, abs=1e-3)
    # Welch: t = -0.2 / sqrt(0.02 / 2 + 0.025 / 5), df = 0.015^2 / (0.01^2 / 1 + 0.005^2 / 4)
    t, df = -0.2 / math.sqrt(0.015), 0.015**2 / (0.01**2 + 0.005**2 / 4)
    assert pair["p_vs_best"] == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert pair["p_vs_best"] >= 0.05 and pair["label"] == TIED and pair["rank"] == 2

    # n = 1: a mean, no interval, not tested, and it says so
    assert single["final_eval_accuracy_n"] == 1 and single["final_eval_accuracy_mean"] == pytest.approx(0.3)
    assert single["final_eval_accuracy_std"] is None and single["final_eval_accuracy_ci_low"] is None
    assert single["label"] == UNTESTED and single["note"].startswith("n = 1: no interval")

    assert low["label"] == WORSE and low["p_vs_best"] < 0.05 and low["rank"] == 4


def test_cells_csv_matches_json_with_empty_cells_for_none(seeded):
    rows = read_csv(seeded / "sweep_cells.csv")
    cells = json.loads((seeded / "sweep_cells.json").read_text())
    assert len(rows) == len(cells) == 4
    assert list(rows[0])[:6] == ["algo.beta", "rank", "label", "p_vs_best", "rank_by", "note"]
    single = next(r for r in rows if r["algo.beta"] == "0.1")
    assert single["final_eval_accuracy_ci_low"] == "" and single["p_vs_best"] == "" and single["label"] == UNTESTED
    assert float(rows[0]["final_eval_accuracy_mean"]) == pytest.approx(cells[0]["final_eval_accuracy_mean"])
    summary = read_csv(seeded / "sweep_summary.csv")  # the per-job summary stays, with the seed and the score
    assert len(summary) == 11 and "trainer.seed" in summary[0] and summary[0]["final_eval_accuracy"] == "0.5"
    assert summary[-1]["status"] == "failed" and summary[-1]["final_eval_accuracy"] == ""


def test_grouping_ignores_only_the_seed_with_one_and_two_other_keys(tmp_path):
    grid = [({"algo.beta": b, "algo.clip_eps": c, "trainer.seed": s}, 0.5 + b + c + s / 100, "ok")
            for b in (0.0, 0.04) for c in (0.1, 0.2) for s in (0, 1, 2)]
    sweep.write_summary(write_sweep(tmp_path / "two", grid))
    cells = json.loads((tmp_path / "two" / "sweep_cells.json").read_text())
    assert sorted((c["algo.beta"], c["algo.clip_eps"], c["jobs"]) for c in cells) == [
        (0.0, 0.1, 3), (0.0, 0.2, 3), (0.04, 0.1, 3), (0.04, 0.2, 3)]
    assert all(c["seeds"] == [0, 1, 2] for c in cells)

    only_seed = [({"trainer.seed": s}, 0.5, "ok") for s in range(3)]
    sweep.write_summary(write_sweep(tmp_path / "seeds", only_seed))
    [cell] = json.loads((tmp_path / "seeds" / "sweep_cells.json").read_text())
    assert cell["jobs"] == 3 and cell["label"] == LEADS and "trainer.seed" not in cell  # a lone cell beats none

    no_seed = [({"algo.beta": b}, 0.5 + b, "ok") for b in (0.0, 0.04)]  # one job per cell
    sweep.write_summary(write_sweep(tmp_path / "noseed", no_seed))
    cells = json.loads((tmp_path / "noseed" / "sweep_cells.json").read_text())
    assert [c["final_eval_accuracy_n"] for c in cells] == [1, 1]
    # neither tested: the first has the highest mean, which is all one job per cell shows
    assert [c["label"] for c in cells] == [LEADS, UNTESTED] and all("no interval" in c["note"] for c in cells)


def test_sweep_metric_auto_falls_back_to_mean_reward_and_can_be_named(tmp_path):
    jobs = [({"algo.beta": 0.0}, 0.5, "ok"), ({"algo.beta": 0.04}, None, "ok")]  # one job lacks final_eval.json
    sweep.write_summary(write_sweep(tmp_path / "auto", jobs))
    assert {c["rank_by"] for c in json.loads((tmp_path / "auto" / "sweep_cells.json").read_text())} == {"mean_reward"}
    sweep.write_summary(write_sweep(tmp_path / "named", jobs, metric="best_reward"))
    cells = json.loads((tmp_path / "named" / "sweep_cells.json").read_text())
    assert {c["rank_by"] for c in cells} == {"best_reward"} and cells[0]["best_reward_n"] == 1


# ---- config: eval.final and sweep.metric ---------------------------------------------------------
@pytest.fixture(scope="module")
def base_cfg():
    from grpo_cli.config.compose import default_config

    return default_config()


def with_values(cfg, **dotted):
    cfg = cfg.copy()
    for key, value in dotted.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def typed_with(cfg, **dotted) -> Config:
    """The typed config of `cfg` with the values (what the components below the entry points read)."""
    return Config.of(with_values(cfg, **dotted))


def test_eval_final_auto_is_on_in_a_sweep_with_a_held_out_split(base_cfg):
    assert final_eval_on(typed_with(base_cfg), multirun=True)
    assert not final_eval_on(typed_with(base_cfg), multirun=False)
    assert final_eval_on(typed_with(base_cfg, eval__final=True), multirun=False)
    assert not final_eval_on(typed_with(base_cfg, eval__final=False), multirun=True)
    no_split = typed_with(base_cfg, data__source="jsonl", data__eval_path=None)
    assert not final_eval_on(no_split, multirun=True)
    assert not final_eval_on(typed_with(base_cfg, reward__accuracy=None), multirun=True)


def test_held_out_rows_do_not_depend_on_the_seed(base_cfg):
    rows = eval_rows(typed_with(base_cfg, trainer__seed=0, eval__num_prompts=5))
    assert len(rows) == 5 and rows == eval_rows(typed_with(base_cfg, trainer__seed=7, eval__num_prompts=5))


@pytest.mark.parametrize(("values", "words"), [
    ({"sweep__metric": "accuracy"},
     "sweep.metric=accuracy is invalid: use one of auto, final_eval_accuracy, mean_reward"),
    ({"sweep__metric": "final_eval_accuracy", "eval__final": False}, "sweep.metric=final_eval_accuracy is invalid"),
    # eval.final=auto runs no final eval without held-out prompts or reward.accuracy: every cell would be empty
    ({"sweep__metric": "final_eval_accuracy", "reward__accuracy": None},
     "sweep.metric=final_eval_accuracy is invalid: needs the final eval, which eval.final=auto runs only where"),
    ({"eval__final": True, "reward__accuracy": None}, "reward.accuracy=null is invalid: eval.final=true needs"),
    ({"eval__final": "yes"}, "eval.final=yes is invalid: use auto, true or false"),
])
def test_bad_eval_final_or_sweep_metric_is_one_line(base_cfg, values, words):
    with pytest.raises(ConfigError) as err:
        validate(with_values(base_cfg, **values))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_ranking_by_the_final_eval_needs_held_out_prompts_under_eval_final_auto(base_cfg, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    no_split = {"data__source": "jsonl", "data__path": str(rows), "sweep__metric": "final_eval_accuracy"}
    with pytest.raises(ConfigError, match="give held-out prompts \\(data.eval_path or data.eval_split\\)"):
        validate(with_values(base_cfg, **no_split))
    assert validate(with_values(base_cfg, **no_split, data__eval_path=str(rows))) is not None
    assert validate(with_values(base_cfg, **no_split, eval__final=True)) is not None  # asked for: it runs


@pytest.mark.slow  # one training step and one evaluation
def test_final_eval_reuses_an_eval_after_the_last_step_and_replaces_a_stale_file(compose, tmp_path):
    from conftest import TINY_TRAINER, fit, make_trainer, read_jsonl

    from grpo_cli.step.evaluate import Evaluator

    overrides = ("eval.final=true", "eval.every=1", "eval.num_prompts=2", "eval.max_new_tokens=4",
                 "trainer.max_steps=1", "trainer.log_samples_every=0")
    calls = []

    def make_evaluator(lm):
        evaluator = Evaluator.for_training(Config.of(compose([*TINY_TRAINER, *overrides])), lm)
        return lambda engine, stop=None: calls.append(1) or evaluator(engine, stop)

    run = tmp_path / "run"
    run.mkdir()
    (run / "final_eval.json").write_text('{"eval/accuracy": 7}')  # an earlier attempt's
    summary = fit(make_trainer(compose, run, *overrides, make_evaluator=make_evaluator), run)
    [row] = read_jsonl(run / "metrics.jsonl")
    final = json.loads((run / "final_eval.json").read_text())
    assert len(calls) == 1  # eval.every's eval after the last step is the final one: same prompts, same weights
    assert final["step"] == 1 and final["eval/accuracy"] == row["eval/accuracy"] == summary["final_eval_accuracy"]


@pytest.mark.slow  # one training step; its final eval stopped, then resumed
def test_a_stop_during_the_final_eval_checkpoints_and_the_resume_runs_only_the_eval(compose, tmp_path):
    from conftest import TINY_TRAINER, fit, make_trainer, read_jsonl

    from grpo_cli.base.errors import Interrupted
    from grpo_cli.step.evaluate import Evaluator

    overrides = ("eval.final=true", "eval.num_prompts=2", "eval.max_new_tokens=4", "trainer.max_steps=1",
                 "trainer.log_samples_every=0")
    trainers = []

    def stopped_evaluator(lm):
        evaluator = Evaluator.for_training(Config.of(compose([*TINY_TRAINER, *overrides])), lm)

        def run(engine, stop=None):
            trainers[0].stop.request(signal.SIGTERM)  # as if SIGTERM came while it generates
            return evaluator(engine, stop)
        return run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainers.append(make_trainer(compose, run_dir, *overrides, make_evaluator=stopped_evaluator))
    with pytest.raises(Interrupted) as stopped:
        fit(trainers[0], run_dir)
    assert stopped.value.completed == 1 and stopped.value.checkpoint_dir.name == "step-000001"
    assert not (run_dir / "final_eval.json").exists() and (run_dir / "adapter").is_dir()

    evaluator = partial(Evaluator.for_training, Config.of(compose([*TINY_TRAINER, *overrides])))
    resumed = make_trainer(compose, run_dir, *overrides, f"trainer.resume={stopped.value.checkpoint_dir}",
                           make_evaluator=evaluator)
    summary = fit(resumed, run_dir)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0]  # no step was trained again
    assert json.loads((run_dir / "final_eval.json").read_text())["eval/accuracy"] == summary["final_eval_accuracy"]


# ---- grpo-report ---------------------------------------------------------------------------------
def assert_png(f: Path) -> None:
    data = f.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, f


def report_of(sweep_dir: Path) -> tuple[str, str]:
    console = Console(record=True, width=160)
    page = make_report(sweep_dir, console=console).read_text()
    return page, console.export_text()


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_report_of_a_seeded_sweep_ranks_cells(seeded):
    page, terminal = report_of(seeded)
    for name in ("sweep_heatmap.png", "sweep_cell_curves.png"):
        assert_png(seeded / name)
        assert f"src='{name}'" in page
    assert "<tr class='best'>" in page and "<tr class='tied'>" in page and "<tr class='worse'>" in page
    assert "0.7000 ± 0.1963" in page and "0.3000 (n = 1)" in page
    lines = terminal.splitlines()
    assert "ranked by final_eval_accuracy" in terminal
    assert any("★ best" in line and "0.7000 ± 0.1963" in line for line in lines)
    assert any("≈ tied with best" in line and "0.5000 ± 1.2706" in line for line in lines)


def set_sweep_id(job_dir: Path, sweep_id: str) -> None:
    status = json.loads((job_dir / "job_status.json").read_text())
    (job_dir / "job_status.json").write_text(json.dumps({**status, "sweep_id": sweep_id}))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_report_reads_only_this_sweeps_jobs_and_their_own_records_and_says_what_it_left_out(tmp_path):
    """Records that the page mixed in: a job of an earlier sweep in the same dir (drawn, listed), the final eval an
    earlier attempt of a job that failed now left (in the summary's column), and one job's damaged metrics.jsonl
    (which stopped the whole page)."""
    jobs = [({"algo.beta": b, "trainer.seed": s}, 0.5 + b + s / 10, "ok") for b in (0.0, 0.1) for s in (0, 1)]
    sweep_dir = write_sweep(tmp_path / "sweep", jobs)
    write_job(sweep_dir, 4, {"algo.beta": 3.0, "trainer.seed": 0}, accuracy=0.99)  # the earlier sweep's
    write_job(sweep_dir, 5, {"algo.beta": 0.1, "trainer.seed": 2}, accuracy=0.95, status="failed")
    (sweep_dir / ".grpo_sweep_id").write_text("now\n")
    for num in (0, 1, 2, 3, 5):
        set_sweep_id(sweep_dir / str(num), "now")
    set_sweep_id(sweep_dir / "4", "before")
    metrics = sweep_dir / "1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")

    page = make_report(sweep_dir).read_text()
    assert "Left out, as an earlier sweep's in this dir (their status records name another sweep): 4" in page
    assert "algo.beta=3.0" not in page and "job 4:" not in page
    assert "Skipped jobs without metrics: 1; damaged: 1 (" in page and "job 0:" in page
    rows = {r["dir"]: r for r in read_csv(sweep_dir / "sweep_summary.csv")}
    assert sorted(rows) == ["0", "1", "2", "3", "5"]
    assert rows["5"]["status"] == "failed" and rows["5"]["final_eval_accuracy"] in ("", "nan")
    assert rows["2"]["final_eval_accuracy"] == "0.6"


def test_p_values_keep_the_digits_that_keep_their_side_of_alpha():
    from grpo_cli.commands.cells import p_value

    assert [p_value(p) for p in (None, 0.5, 0.051, 0.049966, 0.0499999, 0.05, 0.012345)] == [
        "-", "0.5", "0.051", "0.04997", "0.0499999", "0.05", "0.012"]


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_report_of_sweeps_without_seeds_and_with_three_keys(tmp_path):
    no_seed = write_sweep(tmp_path / "noseed", [({"algo.beta": b}, 0.5 + b, "ok") for b in (0.0, 0.04, 0.1)])
    page, terminal = report_of(no_seed)
    assert_png(no_seed / "sweep_heatmap.png") and assert_png(no_seed / "sweep_cell_curves.png")
    assert "src='sweep_heatmap.png'" in page and "no interval" in terminal

    three = write_sweep(tmp_path / "three", [({"algo.beta": b, "algo.clip_eps": c, "rollout.temperature": t}, 0.5, "ok")
                                             for b in (0.0, 0.04) for c in (0.1, 0.2) for t in (0.7, 1.0)])
    page, _ = report_of(three)
    assert_png(three / "sweep_heatmap.png")
    assert "the heatmap shows algo.beta x algo.clip_eps; rollout.temperature also swept" in page


# ---- the real CLI --------------------------------------------------------------------------------
@pytest.mark.slow
def test_beta_by_seed_sweep_writes_cells_with_final_eval(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", "+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "eval.num_prompts=4",
                    "rollout.max_new_tokens=4", "data.prompts_per_step=2", "algo.num_generations=2",
                    "algo.beta=0.0,0.04", "trainer.seed=0,1", f"hydra.sweep.dir={sweep_dir}"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = read_csv(sweep_dir / "sweep_summary.csv")
    assert len(jobs) == 4 and all(0 <= float(j["final_eval_accuracy"]) <= 1 for j in jobs)
    for num in range(4):
        final = json.loads((sweep_dir / str(num) / "final_eval.json").read_text())
        assert final["step"] == 2 and final["eval/num_prompts"] == 4
    cells = read_csv(sweep_dir / "sweep_cells.csv")
    assert [c["algo.beta"] for c in sorted(cells, key=lambda c: c["algo.beta"])] == ["0.0", "0.04"]
    assert all(c["final_eval_accuracy_n"] == "2" and c["rank_by"] == "final_eval_accuracy" for c in cells)
    page, _ = report_of(sweep_dir)
    assert "src='sweep_heatmap.png'" in page and "src='sweep_cell_curves.png'" in page
