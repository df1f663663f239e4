"""The entry points: grpo-train, grpo-eval, grpo-report and grpo-export (cli: Hydra and the one-line checks,
then a handful of calls each), grpo-report's tables (report), grpo-export (export). Thin: the work is below.

May import: sweep, run, step, rollout, rewards, algorithm, tasks, model, tracking, config, base."""
