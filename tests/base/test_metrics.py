"""The one metrics.jsonl reader and the one "final" rule, as the trainer, the sweep summary and grpo-report see them."""

from __future__ import annotations

import json
import math

import pytest

from grpo_cli.base.errors import MetricsError, UserError
from grpo_cli.base.metrics import final_mean, read_metrics
from grpo_cli.commands import report
from grpo_cli.sweep import summary as sweep_summary

ROWS = [{"step": s, "reward": float(s), "kl": 0.01 * s} for s in range(20)]


def write(path, rows, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_final_mean_is_the_last_tenth():
    assert final_mean([1.0]) == 1.0
    assert final_mean([float(v) for v in range(20)]) == pytest.approx(18.5)  # the last 2 of 20
    assert final_mean([3.0, 5.0]) == 5.0  # at least one value
    assert math.isnan(final_mean([]))


@pytest.mark.parametrize("tail", ["", '{"step": 20, "rew', '{"step": 20, "reward": 1.0', "\n\n"])
def test_a_torn_last_line_is_skipped_the_same_way_everywhere(tmp_path, tail):
    run = tmp_path / "run"
    run.mkdir()
    write(run / "metrics.jsonl", ROWS, tail)
    rows = read_metrics(run / "metrics.jsonl")
    assert rows == ROWS
    assert report.final_value(rows) == final_mean([r["reward"] for r in ROWS]) == 18.5
    assert sweep_summary.metric_summary(rows)["final_reward"] == 18.5


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\nnot json\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2 is not JSON") as err:
        read_metrics(path)
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)


def test_missing_file_and_non_step_rows(tmp_path):
    assert read_metrics(tmp_path / "none.jsonl") == []
    write(tmp_path / "m.jsonl", [{"note": "no step"}, ROWS[0], [1, 2]])
    assert read_metrics(tmp_path / "m.jsonl") == [ROWS[0]]


def test_sweep_summary_marks_a_damaged_job_and_keeps_the_others(tmp_path):
    for job, damaged in ((0, False), (1, True)):
        d = tmp_path / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- algo.beta={job}\n")
        (d / "adapter").mkdir()
        write(d / "metrics.jsonl", ROWS)
        if damaged:
            (d / "metrics.jsonl").write_text("oops\n" + (d / "metrics.jsonl").read_text())
    rows = sweep_summary.write_summary(tmp_path).rows
    assert rows[0]["final_reward"] == 18.5 and rows[0]["error"] == ""
    assert math.isnan(rows[1]["final_reward"]) and "metrics.jsonl:1 is not JSON" in rows[1]["error"]
