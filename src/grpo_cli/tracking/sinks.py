"""The seam every metric sink plugs into, and what every run has whatever logger it picks: the protocol
(`MetricSink`, `NullSink` to build on), what a logger's sink factory is told (`RunInfo`), the registry of loggers
(`LOGGERS`: `none` here, `wandb` in wandb_sink.py, or a user's own), the run dir's record files (`JsonlSink`),
and the credentials no sink may show (`redact`, `scrub_secrets`).

A logger inside the package imports this module rather than the package, whose __init__ imports the loggers
to register them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from grpo_cli.base.metrics import METRICS, SAMPLES
from grpo_cli.base.redaction import REDACTED, is_secret_key, redact, secret_values  # noqa: F401  re-exported
from grpo_cli.base.registry import Registry


# ---- secrets -------------------------------------------------------------------------------------
def scrub_secrets(obj, values: list[str] | None = None):
    """Drop any config entry whose key looks like a credential, at any depth, and blank out any string that
    contains a credential value from the environment (e.g. an override that pasted WANDB_API_KEY)."""
    values = secret_values() if values is None else values
    if isinstance(obj, dict):
        return {k: scrub_secrets(v, values) for k, v in obj.items() if not is_secret_key(k)}
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v, values) for v in obj]
    if isinstance(obj, str):
        return redact(obj, values)
    return obj


def _plain(obj):
    """A DictConfig/ListConfig (or anything else) as plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        pass
    return obj

# ---- the protocol ---------------------------------------------------------------------------------
class MetricSink(Protocol):
    """Where a run's records go. `close` may return entries for the run's summary (e.g. where W&B put the run),
    which the sinks closed after it (the console, last) show."""

    def log(self, row: dict) -> None: ...
    def samples(self, step: int, rows: list[dict]) -> None: ...
    def warn(self, text: str) -> None: ...
    def close(self, summary: dict) -> dict | None: ...


class NullSink:
    """A sink that drops everything: the base for a sink that needs only some of the calls."""

    def log(self, row: dict) -> None: ...
    def samples(self, step: int, rows: list[dict]) -> None: ...
    def warn(self, text: str) -> None: ...

    def close(self, summary: dict) -> dict | None:
        return None


@dataclass(frozen=True)
class RunInfo:
    """What a logger's sink factory gets to know about the run."""

    run_dir: Path
    config: dict                  # the resolved config, plain containers
    total_steps: int
    start_step: int = 0
    resume: bool = False
    say: Callable[[str], None] = print   # a line for the user (the console)


# name -> sink factory `(cfg_logger: schema.LoggerConfig, run: RunInfo) -> MetricSink | None` (None: nothing to add)
LOGGERS = Registry("logger", key="logger.backend")


@LOGGERS.register("none")
def no_logger(cfg_logger: dict, run: RunInfo) -> None:
    """metrics.jsonl and the console only."""
    return None

# ---- metrics.jsonl, samples.jsonl ----------------------------------------------------------------
class JsonlSink(NullSink):
    """The run dir's records: one metrics.jsonl row per step (fsynced: the source of truth), samples.jsonl."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS
        self.samples_path = Path(run_dir) / SAMPLES

    def log(self, row: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
