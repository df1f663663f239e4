"""A sweep run again: whether a sweep dir holds this sweep, and what each job does with its earlier attempt.

The same command run again into the same `hydra.sweep.dir` continues that sweep (one summary of all its jobs).
Each job then decides before its run dir is claimed (`decide_job`, from the record of its previous attempt that
`sweep.SweepSummary.on_job_start` keeps in job_status.json): finished with the same composed config -> skipped,
its recorded result returned to the sweeper; unfinished with a checkpoint that fits -> resumed; changed, or
unfinished without a fitting checkpoint -> started over; one line says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_cli.base.redaction import hidden_overrides
from grpo_cli.config import override_key
from grpo_cli.config.schema import Config
from grpo_cli.run import rundir
from grpo_cli.run.rundir import RUN_CONTROL_KEYS
from grpo_cli.sweep.summary import (
    JOB_STATUS,
    SWEEP_COMMAND_FILE,
    SWEEP_ID_FILE,
    load_yaml,
    read_json,
    swept_keys,
)


def sweep_dir_of(config: DictConfig, in_job: bool = False) -> Path:
    """The sweep dir; in a job, the job dir less its subdir (the job's cwd may not be the launch dir)."""
    if in_job:
        job_dir, sub = job_dir_of(config), Path(str(config.hydra.sweep.subdir))
        if sub.parts and not sub.is_absolute() and job_dir.parts[-len(sub.parts):] == sub.parts:
            return job_dir.parents[len(sub.parts) - 1]
    base = OmegaConf.select(config, "hydra.runtime.cwd") or os.getcwd()
    return Path(base, str(config.hydra.sweep.dir)).resolve()


def job_dir_of(config: DictConfig) -> Path:
    return Path(str(config.hydra.runtime.output_dir))


def sweep_command(overrides, params) -> dict:
    """What makes two sweeps the same: the command's overrides (less those that only say how to start) and
    the sweeper's search space."""
    return {"overrides": [o for o in hidden_overrides(overrides) if override_key(o.partition("=")[0])
                          not in RUN_CONTROL_KEYS],
            "params": {str(k): str(v) for k, v in (params or {}).items()}}


def continues_sweep(sweep_dir: Path, command: dict) -> bool:
    """True when `sweep_dir` holds a sweep of the same command (its jobs are carried on, not started over)."""
    recorded = read_json(sweep_dir / SWEEP_COMMAND_FILE)
    if not recorded:  # a sweep of an older grpo-cli: its multirun.yaml (basic sweeper) holds the command
        hydra = load_yaml(sweep_dir / "multirun.yaml").get("hydra") or {}
        recorded = sweep_command((hydra.get("overrides") or {}).get("task"), (hydra.get("sweeper") or {}).get("params"))
    return (sweep_dir / SWEEP_ID_FILE).is_file() and recorded == command


@dataclass
class JobDecision:
    """What a sweep job does with what an earlier attempt of its sweep left in its dir: `fresh` (nothing
    there), `skip` (finished with the same config: `result` is what it returned), `resume` (from its newest
    checkpoint) or `restart` (the dir's run is deleted first); `line` says which and why; `decision` is what
    rundir.claim acts on (None for a skipped job)."""

    action: str
    line: str | None = None
    result: Any = None
    decision: Any = None


def job_name(config: DictConfig) -> str:
    """`job N (the overrides this sweep varies)`, for the lines about one job."""
    command = read_json(sweep_dir_of(config, in_job=True) / SWEEP_COMMAND_FILE)
    swept = swept_keys(command.get("overrides"), command.get("params"))
    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    shown = [o for o in overrides if override_key(o.partition("=")[0]) in swept] or overrides
    return f"job {config.hydra.job.num} ({' '.join(shown)})"


def decide_job(cfg: Config, config: DictConfig) -> JobDecision:
    """Decide what a sweep job does with `cfg` (its typed config), given `config` (a config holding its
    `hydra` part), from the record of its previous attempt that `SweepSummary.on_job_start` kept in
    job_status.json (Hydra has rewritten `.hydra/` by then): rundir.decide_resume, the one resume decision, takes it
    whole; here the job's name is put before its line, and a skipped job gets its recorded result."""
    job_dir = job_dir_of(config)
    previous = read_json(job_dir / JOB_STATUS).get("previous") or {}
    name = job_name(config)
    decision = rundir.decide_resume(cfg, job_dir, sweep_job=True, previous=previous)
    line = f"{name} {decision.line}" if decision.line else None
    if decision.action == "skip":
        return JobDecision("skip", line, previous.get("result"))
    return JobDecision(decision.action, line, decision=decision)
