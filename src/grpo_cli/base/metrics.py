"""The names of a run dir's records, reading `metrics.jsonl` (one JSON object per step, appended by
tracking.JsonlSink), and the one rule for a run's "final" value. The run's summary, the sweep summary and
grpo-report all use these. `final_eval.json` (FINAL_EVAL) holds eval.final's result: the run writes it, the
sweep summary reads it. A record written in one piece is written whole or not at all (`replace_text`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from grpo_cli.base.errors import MetricsError

METRICS = "metrics.jsonl"  # one row per step: the source of truth
SAMPLES = "samples.jsonl"  # sample completions every trainer.log_samples_every steps
FINAL_EVAL = "final_eval.json"
ADAPTER_DIR = "adapter"  # the trained LoRA weights
CHECKPOINTS_DIR = "checkpoints"  # checkpoint.step_dir: one folder per checkpoint
TENSORBOARD_DIR = "tensorboard"  # logger=tensorboard's event files

# the names of a step's row of metrics.jsonl (step.stats.metrics_row; eval's, the monitors' warning, the sampler
# correction's) and their prefixes: what a reward's TRL-style log_metric may not take
# (tests/step/test_trainer.py holds metrics_row to them)
OWN_METRICS = ("step", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_fraction", "loss", "grad_norm",
               "entropy", "completion_len", "truncated_frac", "lr", "step_time_s", "gen_tokens_per_s", "gen_time_s",
               "gen_compile_s", "gen_sync_s", "reward_errors", "skipped_updates", "prompts_truncated",
               "prompts_dropped", "warning", "entropy_coef")
OWN_METRIC_PREFIXES = ("reward/", "clip_fraction/", "filter_", "rollout/", "sync/", "episodes/", "outcomes/", "eval/",
                       "sampler/", "monitor/")


def read_metrics(path: Path) -> list[dict]:
    """The step rows (objects with a `step`) of a metrics.jsonl; [] when the file does not exist.

    A torn last line, from a run that is still writing or died mid-write, is skipped. Any other line that
    is not JSON means the file was damaged and raises MetricsError naming the line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == last:
                break
            raise MetricsError(f"{path}:{i + 1} is not JSON (the file was edited or damaged); "
                               "fix or delete that line") from None
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def final_mean(values: list[float]) -> float:
    """Mean of the last 10 % of the values (at least one); NaN when there are none. What `final reward` means
    everywhere: the console summary, the value grpo-train returns to a sweeper, the sweep summary, the report."""
    if not values:
        return math.nan
    tail = values[-max(1, len(values) // 10):]
    return sum(tail) / len(tail)


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it (named for this process), then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
