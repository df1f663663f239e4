"""A multirun: the Hydra callback (callback.SweepSummary: one writer per sweep dir, every job validated before the
first starts), job records to the summary and ranked cells (summary), their intervals (stats), what a re-run
does with each job (rerun).

May import: run, step, rollout, rewards, algorithm, tasks, model, tracking, config, base.

`grpo_cli.sweep.SweepSummary` (hydra.callbacks' _target_) is loaded on first use, so that grpo-report's reading of
a sweep does not import what the callback validates with."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "SweepSummary":
        from grpo_cli.sweep.callback import SweepSummary

        return SweepSummary
    raise AttributeError(f"module 'grpo_cli.sweep' has no attribute {name!r}")
