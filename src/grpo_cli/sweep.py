"""Sweeps (`grpo-train -m ...`): the per-sweep summary, failed-job handling and GPU placement.

`SweepSummary` is a Hydra callback registered in `conf/config.yaml` (`hydra.callbacks.sweep_summary`), so
it runs under every launcher (basic, joblib, submitit_local, slurm) and every sweeper (basic, Optuna):

* each job dir gets `job_status.json` (running -> ok | failed) and, for a failed job, `error.txt` (its
  one-line error, then the traceback);
* the sweep dir gets `sweep_summary.csv` and `sweep_summary.json`: one row per job with its swept
  overrides, final/best reward, final KL and clip fractions (total, low, high), eval accuracy, the held-out
  accuracy of eval.final (`final_eval_accuracy`, from the job's final_eval.json), steps and status; and
  `sweep_cells.csv` / `.json`: one row per cell (jobs that differ only in trainer.seed) with n, mean, std and
  a 95 % t-interval of each metric over its seeds, ranked by `sweep.metric` with Welch's p-value against the
  best cell and a label (sweep_stats.py). They are
  rewritten after every job (so a sweep that dies still leaves one) and once more at the end;
* a failed job does not stop the others. Hydra 1.3's BasicLauncher runs every job of a batch even when
  one raises, but BasicSweeper then re-raises the first failure after the batch: later batches
  (`hydra.sweeper.max_batch_size`) never start and `on_multirun_end` is never called. So under the basic
  sweeper a failed job's JobReturn is turned into a completed one returning NaN (after the error is
  recorded); the Optuna sweeper keeps its own policy (`max_failure_rate`, 1.0 in our preset; it cannot
  take NaN: with optuna 2.x telling NaN makes the plugin raise);
* at the end, when any job failed, the process exits 1 with one line per failed job;
* at the start, a sweep over `algo.clip_eps` / `algo.clip_eps_high` whose jobs are all fully on-policy
  (`algo.mini_batches=1` and `algo.num_iterations=1`, neither of them nor the recipe swept) gets one
  warning line: clipping has no effect there, so that axis of the sweep measures nothing.

A sweep survives a crash: the same command run again into the same `hydra.sweep.dir` continues that sweep
(one summary of all its jobs). Each job then decides before its run dir is claimed (`plan_job`, from the
record of its previous attempt that `on_job_start` keeps in job_status.json): finished with the same composed
config -> skipped, its recorded result returned to the sweeper; unfinished with a checkpoint that fits ->
resumed; changed, or unfinished without a fitting checkpoint -> started over; one line says which. Another
command into a used sweep dir is refused (trainer.overwrite=true starts every job over). SIGINT/SIGTERM stops
the whole sweep: the running job checkpoints and is recorded `stopped`, the summary is written, the process
exits 128 + signal, and no later job starts.

`python -m grpo_cli.sweep DIR` rebuilds the summary and cells of a sweep dir (e.g. after a sweep was killed).

GPU placement under `hydra/launcher=joblib`: with `trainer.device=auto` and several visible CUDA devices,
job N runs on `cuda:(N % device_count)` (torch.cuda.set_device in the worker, so `cuda` means that
device). With `hydra.launcher.n_jobs` equal to the device count each running job has its own GPU;
with n_jobs = k x device count, k jobs share each GPU. (Placement is by job number: when jobs take very
different times, a later job can land on a GPU whose earlier job is still running.) Set `trainer.device`
to anything but auto to place jobs yourself. The submitit launchers need none of this: each job is its own
process and gets its GPUs from `gpus_per_node` (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import sys
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from grpo_cli.errors import (
    ConfigError,
    MetricsError,
    RunError,
    UserError,
    error_line,
    exit_with,
    one_line,
    program,
    warn,
)
from grpo_cli.metrics import FINAL_EVAL, final_mean, read_metrics
from grpo_cli.overrides import override_key
from grpo_cli.rundir import replace_text
from grpo_cli.stopping import StopRequest
from grpo_cli.sweep_stats import SEED_KEY, cell_keys, cell_table

log = logging.getLogger(__name__)

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_JSON = "sweep_summary.json"
CELLS_CSV = "sweep_cells.csv"
CELLS_JSON = "sweep_cells.json"
SWEEP_ID_FILE = ".grpo_sweep_id"
SWEEP_COMMAND_FILE = ".grpo_sweep_command.json"  # what a re-run into the same dir is compared with
LOCK_FILE = ".sweep_summary.lock"
JOB_STATUS = "job_status.json"
ERROR_FILE = "error.txt"
CLIP_KEYS = ("clip_fraction", "clip_fraction/low", "clip_fraction/high")
# final_reward: mean of the last 10 % of steps; final_*: the last step's value; mean_*: over every step of the run
# (mean_reward ranks how fast runs learn when they all end at the task's ceiling; a run whose groups all agree at
# the end clips nothing then: its advantages are 0, however far the ratio moved)
# final_eval_accuracy: eval.final's greedy accuracy on the held-out prompts, the same prompts for every job
METRIC_COLUMNS = ["final_reward", "mean_reward", "best_reward", "final_kl", *(f"final_{k}" for k in CLIP_KEYS),
                  *(f"mean_{k}" for k in CLIP_KEYS), "eval_accuracy", "final_eval_accuracy", "steps"]
# what sweep.metric may name: the columns where higher is better
RANK_METRICS = ("final_eval_accuracy", "mean_reward", "final_reward", "best_reward", "eval_accuracy")
# the columns of sweep_cells.csv that get n, mean, std and a 95 % interval over the seeds (and sweep.metric)
CELL_METRICS = ("final_eval_accuracy", "mean_reward", "final_reward", "best_reward", "final_kl", "eval_accuracy")
CELL_COLUMNS = ("jobs", "ok", "failed", "seeds")
RANK_COLUMNS = ("rank", "label", "p_vs_best", "rank_by", "note", "p_paired_vs_best")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


# ---- pure helpers --------------------------------------------------------------------------------
def device_for_job(job_num: int, device_count: int) -> int:
    """The CUDA device index for sweep job `job_num` when `device_count` devices are visible."""
    if device_count < 1:
        raise ValueError(f"device_count={device_count}: needs at least one device")
    return int(job_num) % device_count


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def metric_summary(rows: list[dict]) -> dict:
    rewards = [_number(r.get("reward")) for r in rows]
    rewards = [r for r in rewards if not math.isnan(r)]
    last = rows[-1] if rows else {}
    evals = [_number(r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {
        "final_reward": final_mean(rewards),
        "mean_reward": _mean(rewards),
        "best_reward": max(rewards) if rewards else math.nan,
        "final_kl": _number(last.get("kl")),
        **{f"final_{k}": _number(last.get(k)) for k in CLIP_KEYS},
        **{f"mean_{k}": _mean([_number(r.get(k)) for r in rows]) for k in CLIP_KEYS},
        "eval_accuracy": evals[-1] if evals else math.nan,
        "steps": len(rows),
    }


# ---- overrides -----------------------------------------------------------------------------------
def parse_overrides(lines: list[str]) -> dict[str, tuple[str, str, Any]]:
    """`key -> (override line, value text, value)` for a job's task overrides, in their order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: dict[str, tuple[str, str, Any]] = {}
    parser = OverridesParser.create()
    for line in lines:
        key, _, text = line.partition("=")
        key, value = override_key(key), text
        with contextlib.suppress(Exception):  # an override we cannot read back keeps its text
            ov = parser.parse_override(line)
            key = override_key(ov.get_key_element())
            value = ov.value()
            text = "" if value is None else ov.get_value_element_as_str()
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = text
        out[key] = (line, text, value)
    return out


def swept_in_command(lines: list[str]) -> list[str]:
    """Keys that the sweep's own command line sweeps (`a=1,2`, `range(..)`, `choice(..)`, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    parser = OverridesParser.create()
    for line in lines:
        with contextlib.suppress(Exception):
            ov = parser.parse_override(line)
            if ov.is_sweep_override():
                keys.append(override_key(ov.get_key_element()))
    return keys


def on_policy_clip_sweep(config: DictConfig) -> str | None:
    """The warning for a sweep that varies a clip epsilon while every job is fully on-policy; else None."""
    from grpo_cli.config import CLIP_EPS_KEYS, is_on_policy, on_policy_clip_warning

    swept = set(swept_in_command([str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]))
    swept |= {override_key(str(k)) for k in (OmegaConf.select(config, "hydra.sweeper.params") or {})}
    clip = [k for k in CLIP_EPS_KEYS if k in swept]
    policy_swept = {"algo.mini_batches", "algo.num_iterations", "recipe"} & swept  # jobs may differ: say nothing
    if not clip or policy_swept or OmegaConf.select(config, "algo") is None or not is_on_policy(config):
        return None
    return on_policy_clip_warning(clip, sweep=True)


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ---- the summary ---------------------------------------------------------------------------------
def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Every dir under the sweep dir that holds a `.hydra/` (a job), without looking inside jobs; in job
    order (numbered dirs by number: 2 before 10)."""
    sweep_dir, found = Path(sweep_dir), []
    for root, dirs, _files in os.walk(sweep_dir):
        if ".hydra" in dirs and Path(root) != sweep_dir:
            found.append(Path(root))
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .submitit, .hydra of the sweep
    return sorted(found, key=lambda d: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                        for p in d.relative_to(sweep_dir).parts])


def collect(sweep_dir: Path) -> tuple[list[dict], list[str]]:
    """(rows, swept keys) for the jobs of the sweep in `sweep_dir` (jobs of an older sweep in the same dir
    are left out when the sweep recorded its id)."""
    sweep_dir = Path(sweep_dir)
    sweep_id = (sweep_dir / SWEEP_ID_FILE).read_text().strip() if (sweep_dir / SWEEP_ID_FILE).is_file() else None
    jobs = []
    for job_dir in find_job_dirs(sweep_dir):
        status = _read_json(job_dir / JOB_STATUS)
        if sweep_id and status.get("sweep_id") != sweep_id:
            continue
        hydra_cfg = _load_yaml(job_dir / ".hydra" / "hydra.yaml").get("hydra", {}) or {}
        overrides = (hydra_cfg.get("overrides") or {}).get("task")
        if overrides is None:
            loaded = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) \
                if (job_dir / ".hydra" / "overrides.yaml").is_file() else []
            overrides = loaded or []
        num = (hydra_cfg.get("job") or {}).get("num", status.get("job"))
        params = ((hydra_cfg.get("sweeper") or {}).get("params") or {})
        jobs.append((job_dir, num, parse_overrides([str(o) for o in overrides]), list(params), status))

    multirun = _load_yaml(sweep_dir / "multirun.yaml").get("hydra", {}) or {}
    swept = set(swept_in_command([str(o) for o in (multirun.get("overrides") or {}).get("task") or []]))
    swept |= {override_key(str(k)) for k in ((multirun.get("sweeper") or {}).get("params") or {})}
    for _, _, _, params, _ in jobs:
        swept |= {override_key(str(k)) for k in params}
    all_keys: list[str] = []
    for _, _, ovs, _, _ in jobs:
        all_keys += [k for k in ovs if k not in all_keys]
    for key in all_keys:  # anything that differs between jobs was swept, however it was asked for
        if len({ovs[key][1] if key in ovs else None for _, _, ovs, _, _ in jobs}) > 1:
            swept.add(key)
    keys = [k for k in all_keys if k in swept]

    rows = []
    for job_dir, num, ovs, _, status in jobs:
        error = status.get("error")
        state = status.get("status")
        if state is None or (state == "running" and (job_dir / ERROR_FILE).is_file()):
            if (job_dir / ERROR_FILE).is_file():
                state = "failed"
                error = error or (job_dir / ERROR_FILE).read_text(errors="replace").partition("\n")[0]
            else:
                state = "ok" if (job_dir / "adapter").is_dir() else "incomplete"
        row = {
            "job": int(num) if isinstance(num, int) or str(num).isdigit() else num,
            "overrides": " ".join(ovs[k][0] for k in keys if k in ovs),
        }
        for key in keys:
            row[key] = ovs[key][2] if key in ovs else None
        try:
            row.update(metric_summary(read_metrics(job_dir / "metrics.jsonl")))
        except MetricsError as err:  # one damaged job must not hide the others
            row.update(metric_summary([]))
            error = error or str(err)
        row["final_eval_accuracy"] = _number(_read_json(job_dir / FINAL_EVAL).get("eval/accuracy"))
        row.update({"status": state, "error": error or "", "dir": str(job_dir.relative_to(sweep_dir))})
        rows.append(row)
    rows.sort(key=lambda r: (r["job"] if isinstance(r["job"], int) else 1 << 62, r["dir"]))
    return rows, keys


def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@contextlib.contextmanager
def _locked(sweep_dir: Path):
    """Serialise summary writes of jobs that end at the same time (joblib, submitit)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(sweep_dir / LOCK_FILE, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            pass
        yield


def sweep_metric(sweep_dir: Path) -> str:
    """sweep.metric as the sweep was started with it (multirun.yaml); auto when it does not say."""
    return str((_load_yaml(Path(sweep_dir) / "multirun.yaml").get("sweep") or {}).get("metric") or "auto")


def rank_metric(rows: list[dict], metric: str = "auto") -> str:
    """The column cells are ranked by: `metric`, or for auto final_eval_accuracy where every ok job has it,
    else mean_reward."""
    if metric != "auto":
        return metric
    ok = [r for r in rows if r.get("status") == "ok"]
    has_eval = bool(ok) and all(math.isfinite(_number(r.get("final_eval_accuracy"))) for r in ok)
    return "final_eval_accuracy" if has_eval else "mean_reward"


def cells(rows: list[dict], keys: list[str], metric: str = "auto") -> list[dict]:
    """The sweep's cells (jobs that differ only in trainer.seed), best first: sweep_stats.cell_table of the
    CELL_METRICS, ranked by `rank_metric(rows, metric)`; `note` says when the ranking metric has no interval."""
    rank_by = rank_metric(rows, metric)
    metrics = [rank_by, *(m for m in CELL_METRICS if m != rank_by)]
    table = cell_table(rows, keys, metrics, rank_by)
    for cell in table:
        n = cell[f"{rank_by}_n"]
        cell["rank_by"] = rank_by
        cell["note"] = "" if n >= 2 else (
            f"n = {n}: no interval (sweep {SEED_KEY} for one)" if n == 1 else f"no {rank_by}")
    return table


def cell_columns(keys: list[str], table: list[dict]) -> list[str]:
    stats = [k for k in (table[0] if table else {}) if k not in (*cell_keys(keys), *CELL_COLUMNS, *RANK_COLUMNS)]
    return [*cell_keys(keys), *RANK_COLUMNS, *CELL_COLUMNS, *stats]


def _write_table(sweep_dir: Path, csv_name: str, json_name: str, columns: list[str], rows: list[dict]) -> None:
    """One table as CSV (None and NaN empty, lists as JSON) and JSON (NaN as null), each replaced in one step."""
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(row.get(k)) for k in columns})
    replace_text(sweep_dir / csv_name, buf.getvalue())
    replace_text(sweep_dir / json_name, json.dumps([{k: _json_value(row.get(k)) for k in columns} for row in rows],
                                                   indent=2) + "\n")


def write_summary(sweep_dir: Path, metric: str | None = None) -> list[dict]:
    """Write `sweep_summary.csv/json` (one row per job) and `sweep_cells.csv/json` (one row per cell, ranked by
    `metric`, default the sweep's sweep.metric) in `sweep_dir`; return the job rows."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with _locked(sweep_dir):
        rows, keys = collect(sweep_dir)
        _write_table(sweep_dir, SUMMARY_CSV, SUMMARY_JSON,
                     ["job", "overrides", *keys, *METRIC_COLUMNS, "status", "error", "dir"], rows)
        table = cells(rows, keys, sweep_metric(sweep_dir) if metric is None else metric)
        _write_table(sweep_dir, CELLS_CSV, CELLS_JSON, cell_columns(keys, table), table)
    return rows


# ---- a re-run of the same sweep -------------------------------------------------------------------
RUN_CONTROL_KEYS = ("trainer.resume", "trainer.overwrite", "trainer.resume_allow_changes")


def sweep_command(overrides, params) -> dict:
    """What makes two sweeps the same: the command's overrides (less those that only say how to start) and
    the sweeper's search space."""
    return {"overrides": [str(o) for o in overrides or [] if override_key(str(o).partition("=")[0])
                          not in RUN_CONTROL_KEYS],
            "params": {str(k): str(v) for k, v in (params or {}).items()}}


def continues_sweep(sweep_dir: Path, command: dict) -> bool:
    """True when `sweep_dir` holds a sweep of the same command (its jobs are carried on, not started over)."""
    recorded = _read_json(sweep_dir / SWEEP_COMMAND_FILE)
    if not recorded:  # a sweep of an older grpo-cli: its multirun.yaml (basic sweeper) holds the command
        hydra = _load_yaml(sweep_dir / "multirun.yaml").get("hydra") or {}
        recorded = sweep_command((hydra.get("overrides") or {}).get("task"), (hydra.get("sweeper") or {}).get("params"))
    return (sweep_dir / SWEEP_ID_FILE).is_file() and recorded == command


def job_config(config: DictConfig) -> dict:
    """A job's composed config (Hydra's part and the keys that only say how to start left out), resolved, as
    dotted keys: what a finished job is compared by when its sweep runs again."""
    from grpo_cli.rundir import flatten

    flat: dict = {}
    for key in config:
        if key != "hydra":
            flatten(str(key), OmegaConf.to_container(config[key], resolve=True)
                    if OmegaConf.is_config(config[key]) else config[key], flat)
    return {k: v for k, v in flat.items() if k not in RUN_CONTROL_KEYS}


@dataclass
class JobPlan:
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
    command = _read_json(_sweep_dir(config, in_job=True) / SWEEP_COMMAND_FILE)
    swept = set(swept_in_command(command.get("overrides") or [])) | {override_key(k) for k in command.get("params") or {}}
    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    shown = [o for o in overrides if override_key(o.partition("=")[0]) in swept] or overrides
    return f"job {config.hydra.job.num} ({' '.join(shown)})"


def plan_job(cfg: DictConfig, config: DictConfig) -> JobPlan:
    """Decide what a sweep job does with `cfg` (its composed config), given `config` (a config holding its
    `hydra` part), from the record of its previous attempt that `SweepSummary.on_job_start` kept in
    job_status.json (Hydra has rewritten `.hydra/` by then). A job that did not finish is left to
    rundir.decide_resume, the one resume decision; trainer.overwrite=true or a trainer.resume path decide alone."""
    from grpo_cli import rundir
    from grpo_cli.metrics import ADAPTER_DIR

    job_dir = _job_dir(config)
    previous = _read_json(job_dir / JOB_STATUS).get("previous") or {}
    name = job_name(config)
    finished = previous.get("status") == "ok" and "config" in previous and (job_dir / ADAPTER_DIR).is_dir()
    if finished and not rundir.commanded(cfg):
        current = job_config(cfg)
        changes = rundir.changed_keys(previous["config"], current)
        if not changes:
            return JobPlan("skip", f"{name} finished before with the same config; skipped", previous.get("result"))
        return JobPlan("restart", f"{name} finished before with another config "
                                  f"({rundir.describe_changes(changes, previous['config'], current)}); starting it over",
                       decision=rundir.ResumeDecision(overwrite=True))
    decision = rundir.decide_resume(cfg, job_dir, sweep_job=True)
    return JobPlan(decision.action, f"{name} {decision.line}" if decision.line else None, decision=decision)


class JobStopped(Exception):
    """A sweep job stopped by SIGINT/SIGTERM: `SweepSummary` records it, writes the summary and ends the sweep."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


# ---- the callback --------------------------------------------------------------------------------
def _is_multirun(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


def _sweep_dir(config: DictConfig, in_job: bool = False) -> Path:
    """The sweep dir; in a job, the job dir less its subdir (the job's cwd may not be the launch dir)."""
    if in_job:
        job_dir, sub = _job_dir(config), Path(str(config.hydra.sweep.subdir))
        if sub.parts and not sub.is_absolute() and job_dir.parts[-len(sub.parts):] == sub.parts:
            return job_dir.parents[len(sub.parts) - 1]
    base = OmegaConf.select(config, "hydra.runtime.cwd") or os.getcwd()
    return Path(base, str(config.hydra.sweep.dir)).resolve()


def _job_dir(config: DictConfig) -> Path:
    return Path(str(config.hydra.runtime.output_dir))


class SweepSummary(Callback):
    """See the module docstring. Listed first in `hydra.callbacks`: Hydra calls on_job_end and
    on_multirun_end in reverse order, so this one runs last (others see a failed job as failed, and its
    exit on failure skips nobody)."""

    def __init__(self, exit_on_failure: bool = True, gpu_per_job: bool = True) -> None:
        self.exit_on_failure = exit_on_failure
        self.gpu_per_job = gpu_per_job
        # SIGINT/SIGTERM between jobs (a job's own StopRequest takes them while it runs): the sweep stops at
        # the next job boundary instead of dying inside Hydra with a KeyboardInterrupt traceback
        self._between_jobs: StopRequest | None = None
        self._handlers = contextlib.ExitStack()

    def __getstate__(self) -> dict:
        """joblib and submitit pickle the callbacks into their workers: the signal handlers stay in this process."""
        return {**self.__dict__, "_between_jobs": None, "_handlers": contextlib.ExitStack()}

    # -- sweep --
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _sweep_dir(config)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        command = sweep_command(OmegaConf.select(config, "hydra.overrides.task"),
                                OmegaConf.select(config, "hydra.sweeper.params"))
        overwrite = bool(OmegaConf.select(config, "trainer.overwrite"))
        if not overwrite and continues_sweep(sweep_dir, command):
            log.info(f"continuing the sweep in {sweep_dir}: finished jobs are skipped, unfinished ones resumed")
        else:
            if find_job_dirs(sweep_dir) and not overwrite:
                exit_with(ConfigError(
                    f"hydra.sweep.dir={sweep_dir} holds the jobs of another sweep command; re-run that command to "
                    "continue it, add trainer.overwrite=true to start every job over, or pick another hydra.sweep.dir"))
            (sweep_dir / SWEEP_ID_FILE).write_text(uuid.uuid4().hex + "\n")
            for name in (SUMMARY_CSV, SUMMARY_JSON, CELLS_CSV, CELLS_JSON):
                (sweep_dir / name).unlink(missing_ok=True)
        replace_text(sweep_dir / SWEEP_COMMAND_FILE, json.dumps(command) + "\n")
        warning = on_policy_clip_sweep(config)
        if warning:
            warn(warning)
        with contextlib.suppress(ValueError):  # signal handlers can only be set from the main thread
            self._between_jobs = self._handlers.enter_context(
                StopRequest(effect="the sweep stops before its next job").installed())

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._handlers.close()
        sweep_dir = _sweep_dir(config)
        rows = write_summary(sweep_dir)
        bad = [r for r in rows if r["status"] != "ok"]
        log.info(f"Sweep summary: {len(rows)} jobs, {len(rows) - len(bad)} ok: {sweep_dir / SUMMARY_CSV}")
        if bad and self.exit_on_failure:
            lines = [f"{len(bad)} of {len(rows)} sweep jobs failed; summary {sweep_dir / SUMMARY_CSV}"]
            lines += [f"  job {r['job']} ({r['overrides'] or r['dir']}): {r['error'] or r['status']}" for r in bad]
            exit_with(RunError("\n".join(lines)))  # its SystemExit passes Hydra's callback guard: the exit code is 1

    # -- job (runs in the job's process: the main one, a joblib worker or a submitit job) --
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        job_dir = _job_dir(config)
        if self._between_jobs is not None and self._between_jobs():
            self._end_sweep(f"stopped by {self._between_jobs.name} before {job_name(config)} started; the sweep "
                            "stops here; run the same command again to go on from this job", self._between_jobs.signum)
        (job_dir / ERROR_FILE).unlink(missing_ok=True)
        previous = _read_json(job_dir / JOB_STATUS)
        previous.pop("previous", None)
        self._write_status(config, {"status": "running", "previous": previous or None})  # for plan_job
        if self.gpu_per_job:
            self._place_on_gpu(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        failed = job_return.status == JobStatus.FAILED
        if failed and isinstance(job_return._return_value, JobStopped):
            self._stop_sweep(config, job_return._return_value)
        try:
            if failed:
                err = job_return._return_value
                line = error_line(err)
                tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
                (_job_dir(config) / ERROR_FILE).write_text(f"{line}\n\n{tb}")
                log.error(f"job {config.hydra.job.num} failed: {line}")
                self._write_status(config, {"status": "failed", "error": line})
            else:  # what a re-run of the sweep compares and returns for a finished job (plan_job)
                self._write_status(config, {"status": "ok", "result": _json_value(job_return.return_value),
                                            "config": job_config(config)})
        finally:
            if failed and OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER:
                # BasicSweeper would re-raise this after the batch and drop the rest of the sweep
                job_return.status = JobStatus.COMPLETED
                job_return.return_value = math.nan
        try:
            write_summary(_sweep_dir(config, in_job=True))
        except Exception as err:  # a summary problem must not fail the job
            warn(f"could not write the sweep summary: {error_line(err)}")
        if self._between_jobs is not None and self._between_jobs():
            self._end_sweep(f"stopped by {self._between_jobs.name} after {job_name(config)} ended; the sweep stops "
                            "here; run the same command again to go on from the next job", self._between_jobs.signum)

    def _stop_sweep(self, config: DictConfig, stopped: JobStopped) -> NoReturn:
        """A stopped job stops the sweep: its status and the summary are written first."""
        self._write_status(config, {"status": "stopped", "error": str(stopped)})
        with contextlib.suppress(Exception):
            write_summary(_sweep_dir(config, in_job=True))
        self._end_sweep(str(stopped), stopped.signum)

    def _end_sweep(self, line: str, signum: int) -> NoReturn:
        """Exit 128 + signal: a SystemExit passes Hydra's callback guard and its launcher, so no later job starts."""
        self._handlers.close()
        print(f"{program()}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def _write_status(self, config: DictConfig, fields: dict) -> None:
        sweep_file = _sweep_dir(config, in_job=True) / SWEEP_ID_FILE
        sweep_id = sweep_file.read_text().strip() if sweep_file.is_file() else None
        status = {"sweep_id": sweep_id, "job": config.hydra.job.num, "error": None, **fields}
        replace_text(_job_dir(config) / JOB_STATUS, json.dumps(status) + "\n")

    @staticmethod
    def _place_on_gpu(config: DictConfig) -> None:
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
        if "joblib" not in launcher.lower() or str(OmegaConf.select(config, "trainer.device")) != "auto":
            return
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            return
        index = device_for_job(config.hydra.job.num, count)
        torch.cuda.set_device(index)  # `cuda` (what trainer.device=auto resolves to) is now this device
        log.info(f"job {config.hydra.job.num}: trainer.device=auto -> cuda:{index} ({count} devices, joblib)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with one_line("grpo_cli.sweep"):
        if len(argv) != 1 or argv[0].startswith("-"):
            raise UserError(f"usage: python -m grpo_cli.sweep SWEEP_DIR (rewrites sweep_summary.csv/json and sweep_cells.csv/json); got {argv}")
        sweep_dir = Path(argv[0])
        if not sweep_dir.is_dir():
            raise UserError(f"no such directory, {sweep_dir}; pass a multirun sweep dir")
        rows = write_summary(sweep_dir)
    print(f"{sweep_dir / SUMMARY_CSV}: {len(rows)} jobs, {sum(r['status'] == 'ok' for r in rows)} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
