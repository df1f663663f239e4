"""The quickstart recipe pays for correctness only, as README's Quickstart section says."""

from __future__ import annotations

from grpo_cli.rewards import RewardSet


def test_quickstart_rewards_the_right_sum_in_any_form(config) -> None:
    cfg = config(["+recipe=quickstart"])
    assert cfg.data.source == "sums" and cfg.reward.accuracy == "correct"
    rewards = RewardSet.from_config(cfg.reward)
    assert {f.name: f.weight for f in rewards.functions} == {"correct": 1.0, "bare": 0.0}
    replies = ["7 + 5 = 12", "12", "12.", "7 + 5 = 13", "To add 7 and 5,", "The answer is 12 apples"]
    totals, per_function, errors = rewards.score(["p"] * len(replies), replies, {"answer": ["12"] * len(replies)})
    assert totals == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert per_function["bare"] == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # logged as reward/bare, not paid for
    assert errors == 0


def test_quickstart_budget_is_no_larger_than_before(compose) -> None:
    """The quickstart must stay a few minutes on 2 CPU cores: at most the 50 x 4 x 8 x 8 tokens it had."""
    cfg = compose(["+recipe=quickstart"])
    tokens = cfg.trainer.max_steps * cfg.data.prompts_per_step * cfg.algo.num_generations * cfg.rollout.max_new_tokens
    assert tokens <= 50 * 4 * 8 * 8
    assert cfg.eval.every == 0 and cfg.trainer.nproc == 1
