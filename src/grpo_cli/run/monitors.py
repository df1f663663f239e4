"""The run's watches: numbers logged each step (monitor/*) and alarms, each said once in one line with its numbers,
after STEPS steps in a row past its threshold. W is WINDOW steps.

    frac_reward_zero_std       (the trainer's)  > 0.9: the groups' rewards are equal, there is nothing to learn
    truncated_frac             (the trainer's)  > 0.9: the rewards judge cut-off text
    monitor/length_ratio       completion_len over the last W steps / over the run's first W steps
                                                > 2 or < 0.5: completions padded (or cut) for the reward
    monitor/top_reward_share   the largest |weight x reward/NAME| over their sum, with two or more weighted rewards,
                               of the rewards that do not carry the task (reward.accuracy, reward.task_rewards)
                                                > 0.9: one reward carries the sum (a constant one is said so)
    monitor/kl_acceleration    the rise of kl's mean over the last W steps / its rise over the W steps before
                                                > 1.5 with kl > 0.1: kl growing faster and faster

Each value is a function of the run's metric rows, so a resumed run replays the rows it keeps (the same values,
streaks and alarms said) and grpo-report draws them for any run. The thresholds were checked on the quickstart's
recorded runs (docs/results/*_quickstart_*.csv), which raise no alarm: their kl rises fastest while it leaves 0,
under 0.1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

WINDOW = 5
STEPS = 10
LENGTH_RATIO = (0.5, 2.0)
TOP_SHARE = 0.9
KL_ACCELERATION, KL_FLOOR = 1.5, 0.1
ZERO_STD_SHARE, TRUNCATED_SHARE = 0.9, 0.9


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def length_ratio(lengths: list[float]) -> float | None:
    """Mean completion length over the last WINDOW steps over that of the first WINDOW (from 2 x WINDOW steps on)."""
    if len(lengths) < 2 * WINDOW or _mean(lengths[:WINDOW]) <= 0:
        return None
    return _mean(lengths[-WINDOW:]) / _mean(lengths[:WINDOW])


def reward_shares(row: dict, weights: dict[str, float]) -> dict[str, float]:
    """|weight x mean| of each weighted reward of a metrics row (a reward absent from `weights`, an environment's,
    weighs 1), as a share of their sum; empty with fewer than two or a zero sum."""
    parts = {k[len("reward/"):]: abs(weights.get(k[len("reward/"):], 1.0) * v) for k, v in row.items()
             if k.startswith("reward/") and _finite(v) and weights.get(k[len("reward/"):], 1.0) != 0}
    total = sum(parts.values())
    return {name: part / total for name, part in parts.items()} if len(parts) >= 2 and total > 0 else {}


def kl_acceleration(kls: list[float]) -> float | None:
    """The rise of kl's WINDOW-step mean over the last window, over its rise the window before (from 3 x WINDOW
    steps on, while the earlier rise is > 0)."""
    if len(kls) < 3 * WINDOW:
        return None
    first, middle, last = (_mean(kls[len(kls) - (3 - i) * WINDOW:len(kls) - (2 - i) * WINDOW]) for i in range(3))
    return (last - middle) / (middle - first) if middle > first else None


@dataclass(frozen=True)
class Alarm:
    key: str                                   # the metric it watches
    fires: Callable[[float, dict], bool]       # (value, this step's metrics) -> past the threshold
    says: Callable[[float, dict], str]         # the line


class Monitors:
    """`observe(metrics)` each step, in order: adds the monitor/* values to the step's metrics and returns the
    alarms that fire at it; `replay(rows)` takes a resumed run's earlier rows silently."""

    def __init__(self, weights: dict[str, float], carrying_task: frozenset[str] | set[str] = frozenset()):
        self.weights = weights
        self.carrying_task = frozenset(carrying_task)  # rewards that are the task: carrying the sum is their job
        self.reward_means: dict[str, list[float]] = {}
        self.lengths: list[float] = []
        self.kls: list[float] = []
        self.streaks: dict[str, int] = {}
        self.said: set[str] = set()
        self.alarms = (
            Alarm("frac_reward_zero_std", lambda v, _: v > ZERO_STD_SHARE, lambda v, _: (
                f"frac_reward_zero_std > {ZERO_STD_SHARE} for {STEPS} steps in a row: almost every group has equal "
                "rewards, so there is no learning signal; make the task easier, raise algo.num_generations or "
                "rollout.temperature")),
            Alarm("truncated_frac", lambda v, _: v > TRUNCATED_SHARE, lambda v, _: (
                f"truncated_frac > {TRUNCATED_SHARE} for {STEPS} steps in a row: almost every completion hits the "
                "length limit before EOS, so the rewards judge cut-off text; raise rollout.max_new_tokens (or set "
                "algo.mask_truncated=true)")),
            Alarm("monitor/length_ratio", lambda v, _: not LENGTH_RATIO[0] <= v <= LENGTH_RATIO[1], self._length_line),
            Alarm("monitor/top_reward_share", lambda v, _: v > TOP_SHARE, self._share_line),
            Alarm("monitor/kl_acceleration", lambda v, m: v > KL_ACCELERATION and _mean(self.kls[-WINDOW:]) > KL_FLOOR,
                  self._kl_line),
        )

    def values(self, metrics: dict) -> dict[str, float]:
        """This step's monitor/* values (those defined yet), its row appended to the history first."""
        if _finite(metrics.get("completion_len")):
            self.lengths.append(float(metrics["completion_len"]))
        if _finite(metrics.get("kl")):
            self.kls.append(float(metrics["kl"]))
        for key, value in metrics.items():
            if key.startswith("reward/") and _finite(value):
                self.reward_means.setdefault(key[len("reward/"):], []).append(float(value))
        shares = self._shares(metrics)
        found = {"monitor/length_ratio": length_ratio(self.lengths),
                 "monitor/top_reward_share": max(shares.values()) if shares else None,
                 "monitor/kl_acceleration": kl_acceleration(self.kls)}
        return {k: v for k, v in found.items() if v is not None}

    def observe(self, metrics: dict) -> list[str]:
        metrics.update(self.values(metrics))
        lines = []
        for alarm in self.alarms:
            value = metrics.get(alarm.key)
            if not (_finite(value) and alarm.fires(value, metrics)):
                self.streaks[alarm.key] = 0
                continue
            self.streaks[alarm.key] = self.streaks.get(alarm.key, 0) + 1
            if self.streaks[alarm.key] >= STEPS and alarm.key not in self.said:
                self.said.add(alarm.key)
                lines.append(alarm.says(value, metrics))
        return lines

    def replay(self, rows: list[dict]) -> tuple[list[dict], list[tuple[int, str]]]:
        """Observe earlier rows (a resumed run's, a report's: metrics.jsonl's, each with its step): copies of them with
        their monitor/* values, and the alarms said, with the step of each."""
        seen: list[dict] = []
        said: list[tuple[int, str]] = []
        for row in rows:
            copy = dict(row)
            said += [(copy["step"], line) for line in self.observe(copy)]
            seen.append(copy)
        return seen, said

    # ---- the lines ------------------------------------------------------------------------------------------
    def _length_line(self, ratio: float, _metrics: dict) -> str:
        first, last = _mean(self.lengths[:WINDOW]), _mean(self.lengths[-WINDOW:])
        return (f"monitor/length_ratio = {ratio:.2f} for {STEPS} steps in a row: completions average {last:.1f} "
                f"tokens over the last {WINDOW} steps against {first:.1f} over the first {WINDOW}; the policy may be "
                f"{'padding' if ratio > 1 else 'cutting'} its completions for the reward rather than solving the task; "
                "read samples.jsonl")

    def _shares(self, metrics: dict) -> dict[str, float]:
        """The rewards' shares of the weighted sum (reward_shares), less those that carry the task."""
        return {n: v for n, v in reward_shares(metrics, self.weights).items() if n not in self.carrying_task}

    def _share_line(self, share: float, metrics: dict) -> str:
        shares = reward_shares(metrics, self.weights)
        name = max(self._shares(metrics), key=shares.__getitem__)  # a subset of shares' names
        carries = (f"monitor/top_reward_share = {share:.2f} for {STEPS} steps in a row: reward/{name} (weight "
                   f"{self.weights.get(name, 1.0):g}, mean {metrics[f'reward/{name}']:.3f}) carries almost all of the "
                   f"weighted reward and {', '.join(f'reward/{n}' for n in shares if n != name)} next to nothing")
        recent = self.reward_means.get(name, [])[-STEPS:]
        if len(recent) == STEPS and max(recent) - min(recent) <= 1e-9:  # the same every step: no completion differs
            return (f"{carries}; its mean has not moved in those steps, so it gives every completion the same score "
                    f"and teaches nothing: it only hides the others in `reward`; lower its weight or drop it "
                    f"(reward.only=[...] names the functions to keep)")
        return (f"{carries}; the policy may be learning {name} alone: check that it cannot be earned without solving "
                f"the task (a reward that carries the task: name it in reward.task_rewards)")

    def _kl_line(self, acceleration: float, _metrics: dict) -> str:
        return (f"monitor/kl_acceleration = {acceleration:.2f} for {STEPS} steps in a row (kl {self.kls[-1]:.3f}, "
                f"mean {_mean(self.kls[-WINDOW:]):.3f} over the last {WINDOW} steps): kl rises faster and faster, the "
                "policy leaving the reference ever quicker, which reward hacking or too high a learning rate does; "
                "read samples.jsonl, raise algo.beta or lower optimizer.lr")
