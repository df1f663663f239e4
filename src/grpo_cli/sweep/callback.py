"""Sweeps (`grpo-train -m ...`): the Hydra callback that records each job, keeps the sweep's summary, and places
jobs on GPUs.

`SweepSummary` is a Hydra callback registered in `conf/config.yaml` (`hydra.callbacks.sweep_summary`), so
it runs under every launcher (basic, joblib, submitit_local, slurm) and every sweeper (basic, Optuna):

* a sweep dir has one writer, as a run dir does (`SweepLock`): a second sweep into it while the first runs is
  refused in one line naming the first one's pid;
* every job of a basic-sweeper grid is composed and validated before the first starts: a bad value is one line
  naming its job, exit 2, and no job runs;
* each job dir gets `job_status.json` (running -> ok | failed) and, for a failed job, `error.txt` (its
  one-line error, then the traceback);
* the sweep dir gets `sweep_summary.csv/json` and `sweep_cells.csv/json` (sweep_summary.py), rewritten after
  every job (so a sweep that dies still leaves them) and once more at the end, when a line names each damaged or
  missing record of a finished job;
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

A sweep survives a crash: the same command run again into the same `hydra.sweep.dir` continues that sweep, each
job skipped, resumed or started over (sweep_rerun.py). Another command into a used sweep dir is refused
(trainer.overwrite=true starts every job over). SIGINT/SIGTERM stops the whole sweep: the running job
checkpoints and is recorded `stopped`, the summary is written, the process exits 128 + signal, and no later job
starts.

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
import json
import logging
import math
import sys
import threading
import traceback
import uuid
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from grpo_cli.base.errors import ConfigError, RunError, UserError, error_line, exit_with, one_line, program, warn
from grpo_cli.base.metrics import replace_text
from grpo_cli.base.redaction import find_secrets, recorded, redact, redact_log_records, remember, remember_overrides
from grpo_cli.base.stopping import StopRequest
from grpo_cli.config import override_key
from grpo_cli.run.rundir import RunLock, job_config
from grpo_cli.sweep.rerun import (
    continues_sweep,
    job_dir_of,
    job_name,
    sweep_command,
    sweep_dir_of,
)
from grpo_cli.sweep.summary import (
    CELLS_CSV,
    CELLS_JSON,
    ERROR_FILE,
    JOB_STATUS,
    SUMMARY_CSV,
    SUMMARY_JSON,
    SWEEP_COMMAND_FILE,
    SWEEP_ID_FILE,
    find_job_dirs,
    json_value,
    read_json,
    swept_keys,
    write_summary,
)

log = logging.getLogger(__name__)

SWEEP_LOCK_FILE = ".grpo_sweep.lock"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


# ---- before the first job --------------------------------------------------------------------------
class SweepLock(RunLock):
    """One writer per sweep dir, as RunLock is for a run dir: a flock on SWEEP_DIR/.grpo_sweep.lock for the life
    of the sweep."""

    FILE = SWEEP_LOCK_FILE
    OPTION = "hydra.sweep.dir"
    HOLDER = "the grpo-train sweep of pid"
    OTHER = "that sweep"

    @classmethod
    def what(cls, folder: Path) -> str:
        return f"hydra.sweep.dir={folder}"


def job_overrides(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, in job order, as the basic sweeper expands them (its params, then the command's)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    lines = [f"{k}={v}" for k, v in params.items()]
    lines += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)
    return batches[0] if batches else []


def _swept(config: DictConfig) -> set[str]:
    """swept_keys of a multirun's config: its command's sweep overrides and its sweeper's params."""
    overrides = OmegaConf.select(config, "hydra.overrides.task")
    return swept_keys(overrides, OmegaConf.select(config, "hydra.sweeper.params"))


def check_jobs(config: DictConfig) -> None:
    """Every job of a basic-sweeper grid composed and validated, as the job itself will be, before the first
    starts: a bad value is one ConfigError naming its job. Other sweepers draw their points as they go."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return
    from hydra.core.global_hydra import GlobalHydra

    from grpo_cli.base.registry import import_plugins
    from grpo_cli.config.compose import composition_checked
    from grpo_cli.run.validate import validate

    loader = GlobalHydra.instance().config_loader()
    swept = _swept(config)
    for num, overrides in enumerate(job_overrides(config)):
        name = " ".join(o for o in overrides if override_key(o) in swept) or " ".join(overrides)
        try:
            with composition_checked():
                job = loader.load_sweep_config(config, overrides)
            with open_dict(job):
                del job["hydra"]
            import_plugins(job.plugins)
            validate(job)
        except UserError as err:
            raise ConfigError(f"job {num} ({name}): {err}; no job was started") from None


def on_policy_clip_sweep(config: DictConfig) -> str | None:
    """The warning for a sweep that varies a clip epsilon while every job is fully on-policy; else None."""
    from grpo_cli.config.rules import CLIPPING_OBJECTIVES, is_on_policy
    from grpo_cli.run.validate import CLIP_EPS_KEYS, on_policy_clip_warning

    swept = _swept(config)
    clip = [k for k in CLIP_EPS_KEYS if k in swept]
    policy_swept = {"algo.mini_batches", "algo.num_iterations", "recipe"} & swept  # jobs may differ: say nothing
    if not clip or policy_swept or OmegaConf.select(config, "algo") is None or not is_on_policy(config.algo) \
            or OmegaConf.select(config, "algo.objective", default="grpo") not in CLIPPING_OBJECTIVES:  # jobs' warnings
        return None
    return on_policy_clip_warning(clip, sweep=True)


# ---- GPU placement ---------------------------------------------------------------------------------
def device_for_job(job_num: int, device_count: int) -> int:
    """The CUDA device index for sweep job `job_num` when `device_count` devices are visible."""
    if device_count < 1:
        raise ValueError(f"device_count={device_count}: needs at least one device")
    return int(job_num) % device_count


def place_on_gpu(config: DictConfig) -> None:
    """Under joblib with trainer.device=auto and several CUDA devices: this job's device, by its number."""
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


# ---- the callback ----------------------------------------------------------------------------------
def _is_multirun(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


class JobStopped(Exception):
    """A sweep job stopped by SIGINT/SIGTERM: `SweepSummary` records it, writes the summary and ends the sweep."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


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
        self._lock: SweepLock | None = None

    def __getstate__(self) -> dict:
        """joblib and submitit pickle the callbacks into their workers: the signal handlers stay in this process."""
        return {**self.__dict__, "_between_jobs": None, "_handlers": contextlib.ExitStack(), "_lock": None}

    # -- sweep --
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = sweep_dir_of(config)
        self._release()  # a callback started twice in one process holds its own lock already
        try:
            check_jobs(config)
            self._lock = SweepLock.acquire(sweep_dir)
        except UserError as err:
            exit_with(err)
        task = OmegaConf.select(config, "hydra.overrides.task")
        written = OmegaConf.to_container(task, resolve=False) if task is not None else []
        remember_overrides(written, list(task or []))
        redact_log_records()  # Hydra's launcher lists each job's overrides
        command = sweep_command(written, OmegaConf.select(config, "hydra.sweeper.params"))
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
        sweep_dir = sweep_dir_of(config)
        summary = write_summary(sweep_dir)
        self._release()
        for line in summary.problems:
            warn(line)
        rows = summary.rows
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
        job_dir = job_dir_of(config)
        if self._between_jobs is not None and (signum := self._between_jobs.signum) is not None:
            self._end_sweep(f"stopped by {self._between_jobs.name} before {job_name(config)} started; the sweep "
                            "stops here; run the same command again to go on from this job", signum)
        (job_dir / ERROR_FILE).unlink(missing_ok=True)
        remember(find_secrets(config).values)
        sweep_record = sweep_dir_of(config, in_job=True) / "multirun.yaml"  # Hydra's, with the command's overrides
        if sweep_record.is_file() and redact(text := sweep_record.read_text()) != text:
            replace_text(sweep_record, redact(text))
        previous = read_json(job_dir / JOB_STATUS)
        previous.pop("previous", None)
        self._write_status(config, {"status": "running", "previous": previous or None})  # for decide_job
        if self.gpu_per_job:
            place_on_gpu(config)

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
                (job_dir_of(config) / ERROR_FILE).write_text(f"{line}\n\n{tb}")
                log.error(f"job {config.hydra.job.num} failed: {line}")
                self._write_status(config, {"status": "failed", "error": line})
            else:  # what a re-run of the sweep compares and returns for a finished job (decide_job)
                self._write_status(config, {"status": "ok", "result": json_value(job_return.return_value),
                                            "config": job_config(recorded(config))})
        finally:
            if failed and OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER:
                # BasicSweeper would re-raise this after the batch and drop the rest of the sweep
                job_return.status = JobStatus.COMPLETED
                job_return.return_value = math.nan
        try:
            write_summary(sweep_dir_of(config, in_job=True))
        except Exception as err:  # a summary problem must not fail the job
            warn(f"could not write the sweep summary: {error_line(err)}")
        if self._between_jobs is not None and (signum := self._between_jobs.signum) is not None:
            self._end_sweep(f"stopped by {self._between_jobs.name} after {job_name(config)} ended; the sweep stops "
                            "here; run the same command again to go on from the next job", signum)

    def _stop_sweep(self, config: DictConfig, stopped: JobStopped) -> NoReturn:
        """A stopped job stops the sweep: its status and the summary are written first."""
        self._write_status(config, {"status": "stopped", "error": str(stopped)})
        with contextlib.suppress(Exception):
            write_summary(sweep_dir_of(config, in_job=True))
        self._end_sweep(str(stopped), stopped.signum)

    def _end_sweep(self, line: str, signum: int) -> NoReturn:
        """Exit 128 + signal: a SystemExit passes Hydra's callback guard and its launcher, so no later job starts.
        In a job's own thread (hydra/launcher=shared_base) the launcher raises it once every job has stopped, and the
        handlers and the sweep's lock stay with the main thread until then."""
        if threading.current_thread() is threading.main_thread():
            self._handlers.close()
            self._release()
        print(f"{program()}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _write_status(self, config: DictConfig, fields: dict) -> None:
        sweep_file = sweep_dir_of(config, in_job=True) / SWEEP_ID_FILE
        sweep_id = sweep_file.read_text().strip() if sweep_file.is_file() else None
        status = {"sweep_id": sweep_id, "job": config.hydra.job.num, "error": None, **fields}
        replace_text(job_dir_of(config) / JOB_STATUS, json.dumps(status) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with one_line("grpo_cli.sweep"):
        if len(argv) != 1 or argv[0].startswith("-"):
            raise UserError("usage: python -m grpo_cli.sweep SWEEP_DIR (rewrites sweep_summary.csv/json and "
                            f"sweep_cells.csv/json); got {argv}")
        sweep_dir = Path(argv[0])
        if not sweep_dir.is_dir():
            raise UserError(f"no such directory, {sweep_dir}; pass a multirun sweep dir")
        summary = write_summary(sweep_dir)
        for line in summary.problems:
            warn(line)
    rows = summary.rows
    print(f"{sweep_dir / SUMMARY_CSV}: {len(rows)} jobs, {sum(r['status'] == 'ok' for r in rows)} ok")
    return 0

