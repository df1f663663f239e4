"""The zero-std alarm fires: a run whose groups all have equal rewards is told so after 10 such steps, once."""

from __future__ import annotations

import pytest
from conftest import fit, make_trainer, read_jsonl

ZERO_STD = "frac_reward_zero_std > 0.9 for 10 steps in a row"


@pytest.mark.slow  # 11 steps of the tiny model in-process
def test_the_zero_std_alarm_fires_after_10_steps_of_equal_rewards(compose, tmp_path):
    """The quickstart reward scores every completion of the tiny random model 0: every group has zero spread."""
    trainer = make_trainer(compose, tmp_path, "rollout.max_new_tokens=2", "data.prompts_per_step=2",
                           "algo.num_generations=2", "trainer.max_steps=11", "trainer.save_every=0",
                           "trainer.log_samples_every=0")
    fit(trainer, tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["frac_reward_zero_std"] for r in rows] == [1.0] * 11
    warned = [r["step"] for r in rows if ZERO_STD in (r.get("warning") or "")]
    assert warned == [9], [r.get("warning") for r in rows]  # the tenth step in a row, and only once
    # the monitors beside it: the length ratio from the tenth step (two windows of 5); one weighted reward (the
    # quickstart's bare weighs 0) shares nothing
    assert [("monitor/length_ratio" in r) for r in rows] == [False] * 9 + [True] * 2
    assert not any("monitor/top_reward_share" in r for r in rows)
