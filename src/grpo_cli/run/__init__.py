"""A run: one attempt in a run directory (runner.Run and `train(cfg, dir)`), the config checked against every
component before anything loads (validate), the directory's rules (rundir: one writer, the resume decision, the
fingerprint), atomic checkpoints (checkpoint), the run's watches (monitors).

May import: step, rollout, rewards, algorithm, tasks, model, tracking, config, base.

`grpo_cli.run.train` and `grpo_cli.run.Run` are public: loaded on first use, so that reading a run directory
(rundir) does not import torch."""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("train", "Run"):
        from grpo_cli.run import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'grpo_cli.run' has no attribute {name!r}")
