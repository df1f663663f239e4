"""The reward-hacking monitors and the alarms (grpo_cli.run.monitors): each value, each alarm once after 10 steps in a
row with its numbers, none on the quickstart's recorded runs, a resumed run's replay, and grpo-report's panel."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import pytest

from grpo_cli.run.monitors import STEPS, WINDOW, Monitors, kl_acceleration, length_ratio, reward_shares

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def row(step: int, **values) -> dict:
    return {"step": step, "frac_reward_zero_std": 0.0, "truncated_frac": 0.0, "completion_len": 20.0, "kl": 0.0,
            **values}


def run(monitors: Monitors, rows: list[dict]) -> list[tuple[int, str]]:
    """Every alarm said while observing `rows`, with its step."""
    return [(r["step"], line) for r in rows for line in monitors.observe(r)]


def test_the_values():
    assert length_ratio([10.0] * 9) is None  # two windows first
    assert length_ratio([10.0] * 5 + [12.0] * 5) == pytest.approx(1.2)
    assert length_ratio([10.0] * 5 + [30.0] * 10) == pytest.approx(3.0)
    shares = reward_shares({"reward/correct": 0.1, "reward/format": 0.9, "reward/bare": 0.5, "reward_std": 3.0},
                           {"correct": 1.0, "format": 1.0, "bare": 0.0})
    assert shares == pytest.approx({"correct": 0.1, "format": 0.9})  # bare weighs 0: not part of the sum
    assert reward_shares({"reward/correct": 0.5}, {"correct": 1.0}) == {}  # one weighted reward: nothing to share
    assert reward_shares({"reward/correct": 0.5, "reward/Env": 0.5}, {"correct": 3.0})["correct"] == pytest.approx(0.75)
    assert kl_acceleration([0.1] * 14) is None
    doubling = [0.01 * 2 ** (t / WINDOW) for t in range(15)]
    assert kl_acceleration(doubling) == pytest.approx(2.0)  # the rise doubles when kl doubles every window
    assert kl_acceleration([0.2] * 5 + [0.1] * 10) is None  # falling, then flat: no rise to compare with


def test_each_alarm_is_said_once_after_10_steps_in_a_row_with_its_numbers():
    monitors = Monitors({"correct": 1.0, "format": 0.2})
    rows = [row(s, completion_len=10.0 if s < 5 else 25.0, truncated_frac=0.95 if s >= 3 else 0.5,
                **{"reward/correct": 0.0, "reward/format": 1.0}) for s in range(30)]
    said = run(monitors, rows)
    by_key = {line.split()[0]: (step, line) for step, line in said}
    assert sorted(by_key) == ["monitor/length_ratio", "monitor/top_reward_share", "truncated_frac"]
    assert by_key["truncated_frac"][0] == 12  # past 0.9 from step 3 on: the 10th step in a row
    assert by_key["monitor/top_reward_share"][0] == 9  # format carries everything from step 0
    assert by_key["monitor/top_reward_share"][1].startswith(
        "monitor/top_reward_share = 1.00 for 10 steps in a row: reward/format (weight 0.2, mean 1.000) carries almost "
        "all of the weighted reward and reward/correct next to nothing")
    assert by_key["monitor/length_ratio"][0] == 18  # defined from step 9 (2.5 x), past 2 for 10 steps at step 18
    assert "completions average 25.0 tokens over the last 5 steps against 10.0 over the first 5; the policy may be " \
           "padding" in by_key["monitor/length_ratio"][1]
    assert len(said) == 3  # once each
    assert rows[29]["monitor/length_ratio"] == pytest.approx(2.5) and rows[0].get("monitor/length_ratio") is None


def test_a_streak_broken_before_10_steps_says_nothing():
    monitors = Monitors({})
    rows = [row(s, frac_reward_zero_std=1.0 if s % 10 != 9 else 0.0) for s in range(40)]
    assert run(monitors, rows) == []
    rows = [row(s, frac_reward_zero_std=1.0) for s in range(12)]
    assert [step for step, _ in run(Monitors({}), rows)] == [9]


def test_kl_growing_faster_and_faster_is_said_and_a_kl_that_levels_off_is_not():
    exploding = [row(s, kl=0.01 * 2 ** (s / WINDOW)) for s in range(40)]  # doubles every 5 steps
    said = run(Monitors({}), exploding)
    assert len(said) == 1 and said[0][1].startswith("monitor/kl_acceleration = 2.00 for 10 steps in a row (kl ")
    fires_at = said[0][0]
    assert exploding[fires_at]["kl"] > 0.1 and fires_at >= 3 * WINDOW - 1 + STEPS - 1
    quadratic = [row(s, kl=0.001 * s * s) for s in range(60)]  # a steady push away from the reference
    assert run(Monitors({}), quadratic) == []


def recorded_quickstart_runs() -> dict[tuple, list[dict]]:
    runs = defaultdict(list)
    for name in ("new_cpu_defaults_quickstart_2026-12-03.csv", "bf16_cpu_quickstart_2026-12-02.csv"):
        with (RESULTS / name).open() as f:
            for r in csv.DictReader(f):
                key = (name, r.get("dtype"), r["seed"])
                runs[key].append({k: float(v) for k, v in r.items() if k not in ("dtype", "seed")})
    return runs


def test_the_quickstarts_recorded_runs_raise_no_alarm():
    """Real runs that learned (docs/results/cpu-defaults.md, bf16-on-the-cpu.md): their kl rises fastest while it
    leaves 0, and levels off."""
    runs = recorded_quickstart_runs()
    assert len(runs) == 9
    for key, rows in runs.items():
        monitors = Monitors({"correct": 1.0, "bare": 0.0})
        rows = [{"truncated_frac": 0.0, "frac_reward_zero_std": 0.0, **r} for r in rows]
        assert run(monitors, rows) == [], key
        assert any("monitor/kl_acceleration" in r for r in rows)


def test_a_resumed_run_replays_its_rows_to_the_same_values_and_alarms():
    rows = [row(s, completion_len=10.0 + s, frac_reward_zero_std=1.0, kl=0.01 * 2 ** (s / WINDOW)) for s in range(30)]
    straight = Monitors({})
    said = run(straight, [dict(r) for r in rows])
    resumed = Monitors({})
    seen, replayed = resumed.replay(rows[:14])
    said_after = run(resumed, [dict(r) for r in rows[14:]])
    assert replayed + said_after == said
    assert replayed and said_after and len(said) == 3  # zero-std before the resume; length and kl after it
    again = [dict(r) for r in rows]
    run(Monitors({}), again)
    assert seen == again[:14]


@pytest.mark.slow  # matplotlib
def test_the_report_draws_the_monitors_and_lists_the_alarms(tmp_path):
    from grpo_cli.commands.report import make_report

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        "reward:\n  functions:\n    correct: {_target_: m.c, weight: 1.0}\n    format: {_target_: m.f, weight: 0.2}\n")
    rows = [row(s, reward=0.2, **{"reward/correct": 0.0, "reward/format": 1.0}) for s in range(12)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = make_report(run_dir).read_text()
    assert (run_dir / "monitors.png").read_bytes()[:4] == b"\x89PNG"
    assert "<h2>Reward-hacking monitors</h2>" in page and "src='monitors.png'" in page
    assert "<li>step 9: monitor/top_reward_share = 1.00 for 10 steps in a row: reward/format (weight 0.2" in page
