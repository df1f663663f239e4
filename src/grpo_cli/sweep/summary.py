"""A sweep dir's records and the tables made of them: one row per job, one row per cell.

The sweep dir holds `sweep_summary.csv` / `.json` (one row per job: its swept overrides, final/best/mean reward,
final KL and clip fractions, eval accuracy, the held-out accuracy of eval.final from the job's final_eval.json,
steps, status) and `sweep_cells.csv` / `.json` (one row per cell, jobs that differ only in trainer.seed: n, mean,
std and a 95 % t-interval of each metric over its seeds, ranked by `sweep.metric` with Welch's p-value against
the best cell and a label; sweep_stats.py). Both are rebuilt from the job dirs each time, under a lock, so jobs
that end at once (joblib, submitit) and grpo-report never mix two versions.

A record that a finished job should have and that is damaged or missing (a truncated final_eval.json, say) is
never read as "no result" in silence: `Summary.problems` holds one line per such file, and one more when that
makes `sweep.metric=auto` rank by another metric. Whoever writes the summary prints them.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_cli.base.errors import MetricsError
from grpo_cli.base.metrics import FINAL_EVAL, final_mean, read_metrics, replace_text
from grpo_cli.config import override_key
from grpo_cli.sweep.stats import SEED_KEY, cell_keys, cell_table

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_JSON = "sweep_summary.json"
CELLS_CSV = "sweep_cells.csv"
CELLS_JSON = "sweep_cells.json"
SWEEP_ID_FILE = ".grpo_sweep_id"
SWEEP_COMMAND_FILE = ".grpo_sweep_command.json"  # what a re-run into the same dir is compared with
SUMMARY_LOCK_FILE = ".sweep_summary.lock"
JOB_STATUS = "job_status.json"
ERROR_FILE = "error.txt"
# the per-step clip fractions of metrics.jsonl, each summarised as final_* and mean_* columns
CLIP_COLUMNS = ("clip_fraction", "clip_fraction/low", "clip_fraction/high")
# final_reward: mean of the last 10 % of steps; final_*: the last step's value; mean_*: over every step of the run
# (mean_reward ranks how fast runs learn when they all end at the task's ceiling; a run whose groups all agree at
# the end clips nothing then: its advantages are 0, however far the ratio moved)
# final_eval_accuracy: eval.final's greedy accuracy on the held-out prompts, the same prompts for every job
METRIC_COLUMNS = ["final_reward", "mean_reward", "best_reward", "final_kl", *(f"final_{k}" for k in CLIP_COLUMNS),
                  *(f"mean_{k}" for k in CLIP_COLUMNS), "eval_accuracy", "final_eval_accuracy", "steps"]
# what sweep.metric may name: the columns where higher is better
RANK_METRICS = ("final_eval_accuracy", "mean_reward", "final_reward", "best_reward", "eval_accuracy")
# the columns of sweep_cells.csv that get n, mean, std and a 95 % interval over the seeds (and sweep.metric)
CELL_METRICS = ("final_eval_accuracy", "mean_reward", "final_reward", "best_reward", "final_kl", "eval_accuracy")
CELL_COLUMNS = ("jobs", "ok", "failed", "seeds")
RANK_COLUMNS = ("rank", "label", "p_vs_best", "rank_by", "note", "p_paired_vs_best")
REDO_JOB = "delete that job's dir and run the same sweep command again to redo it"


# ---- numbers ----------------------------------------------------------------------------------------
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
        **{f"final_{k}": _number(last.get(k)) for k in CLIP_COLUMNS},
        **{f"mean_{k}": _mean([_number(r.get(k)) for r in rows]) for k in CLIP_COLUMNS},
        "eval_accuracy": evals[-1] if evals else math.nan,
        "steps": len(rows),
    }


# ---- overrides ----------------------------------------------------------------------------------------
def parse_overrides(lines: list[str]) -> dict[str, tuple[str, str, Any]]:
    """`key -> (override line, value text, value)` for a job's task overrides, in their order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: dict[str, tuple[str, str, Any]] = {}
    parser = OverridesParser.create()
    for line in lines:
        key, _, text = line.partition("=")
        key = override_key(key)
        value: Any = text
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


def swept_keys(overrides, params) -> set[str]:
    """The keys a sweep command varies: its sweep overrides (`a=1,2`, `range(..)`, `choice(..)`, ...) and the keys
    of its sweeper's search space (`hydra.sweeper.params`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = {override_key(str(k)) for k in params or {}}
    parser = OverridesParser.create()
    for line in overrides or []:
        with contextlib.suppress(Exception):
            ov = parser.parse_override(str(line))
            if ov.is_sweep_override():
                keys.add(override_key(ov.get_key_element()))
    return keys


# ---- reading the job dirs ----------------------------------------------------------------------------
def load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read_record(path: Path) -> tuple[dict, str | None]:
    """The JSON object in `path` and None, or {} and what is wrong with the file (missing, not JSON, ...)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, "missing"
    except OSError as err:
        return {}, f"unreadable ({err.strerror or err})"
    except ValueError as err:
        return {}, f"not valid JSON ({err})"
    return (data, None) if isinstance(data, dict) else ({}, f"a JSON {type(data).__name__}, not an object")


def read_json(path: Path) -> dict:
    """The JSON object in `path`; {} for a missing or damaged file."""
    return read_record(path)[0]


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


@dataclass
class Job:
    """What a job dir says of its job: its number, overrides, status record, and the sweeper keys it saw."""

    dir: Path
    num: Any
    overrides: dict[str, tuple[str, str, Any]]
    params: list[str]
    status: dict
    status_problem: str | None
    final_eval_off: bool = False  # eval.final=false: no final_eval.json is due


def _read_job(job_dir: Path) -> Job:
    status, problem = read_record(job_dir / JOB_STATUS)
    hydra_cfg = load_yaml(job_dir / ".hydra" / "hydra.yaml").get("hydra", {}) or {}
    overrides = (hydra_cfg.get("overrides") or {}).get("task")
    if overrides is None:
        loaded = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) \
            if (job_dir / ".hydra" / "overrides.yaml").is_file() else []
        overrides = loaded or []
    num = (hydra_cfg.get("job") or {}).get("num", status.get("job"))
    if num is None and job_dir.name.isdigit():  # Hydra's default subdir is the job's number
        num = int(job_dir.name)
    params = list((hydra_cfg.get("sweeper") or {}).get("params") or {})
    final = (load_yaml(job_dir / ".hydra" / "config.yaml").get("eval") or {}).get("final")
    return Job(job_dir, num, parse_overrides([str(o) for o in overrides]), params, status, problem, final is False)


def _jobs_of_sweep(sweep_dir: Path) -> list[Job]:
    """The jobs of the sweep in `sweep_dir` (jobs of an older sweep in the same dir are left out when the sweep
    recorded its id; a job whose status record is damaged stays in, its status read from its dir)."""
    sweep_id = (sweep_dir / SWEEP_ID_FILE).read_text().strip() if (sweep_dir / SWEEP_ID_FILE).is_file() else None
    jobs = [_read_job(d) for d in find_job_dirs(sweep_dir)]
    return [j for j in jobs if not sweep_id or j.status.get("sweep_id") == sweep_id
            or (j.status_problem not in (None, "missing"))]


def _keys(sweep_dir: Path, jobs: list[Job]) -> list[str]:
    """The swept keys, in override order: what the sweep command varies and anything that differs between jobs."""
    multirun = load_yaml(sweep_dir / "multirun.yaml").get("hydra", {}) or {}
    swept = swept_keys((multirun.get("overrides") or {}).get("task"), (multirun.get("sweeper") or {}).get("params"))
    for job in jobs:
        swept |= swept_keys(None, job.params)
    all_keys: list[str] = []
    for job in jobs:
        all_keys += [k for k in job.overrides if k not in all_keys]
    for key in all_keys:  # anything that differs between jobs was swept, however it was asked for
        if len({job.overrides[key][1] if key in job.overrides else None for job in jobs}) > 1:
            swept.add(key)
    return [k for k in all_keys if k in swept]


def _state(job: Job) -> tuple[str, str | None]:
    """The job's status and error: as its status record says, else as its dir shows."""
    error, state, error_file = job.status.get("error"), job.status.get("status"), job.dir / ERROR_FILE
    if state is None or (state == "running" and error_file.is_file()):
        if error_file.is_file():
            return "failed", error or error_file.read_text(errors="replace").partition("\n")[0]
        return ("ok" if (job.dir / "adapter").is_dir() else "incomplete"), error
    return state, error


def _row(sweep_dir: Path, job: Job, keys: list[str], problems: list[str]) -> dict:
    state, error = _state(job)
    where = job.dir.relative_to(sweep_dir).as_posix()
    if job.status_problem not in (None, "missing"):
        which = " (nor can it say which sweep it ran in: an earlier one in this dir, maybe)" \
            if (sweep_dir / SWEEP_ID_FILE).is_file() else ""
        problems.append(f"{where}/{JOB_STATUS} is {job.status_problem}; its job is read as {state} from its dir{which}")
    row: dict[str, Any] = {"job": int(job.num) if isinstance(job.num, int) or str(job.num).isdigit() else job.num,
           "overrides": " ".join(job.overrides[k][0] for k in keys if k in job.overrides)}
    for key in keys:
        row[key] = job.overrides[key][2] if key in job.overrides else None
    try:
        row.update(metric_summary(read_metrics(job.dir / "metrics.jsonl")))
    except MetricsError as err:  # one damaged job must not hide the others
        row.update(metric_summary([]))
        error = error or str(err)
        problems.append(f"{err}; job {where} has no reward columns; {REDO_JOB}")
    if state == "ok" and not (job.dir / "metrics.jsonl").is_file():
        problems.append(f"{where}/metrics.jsonl is missing, though job {where} finished; it has no reward columns; "
                        f"{REDO_JOB}")
    row["final_eval_accuracy"] = math.nan  # an unfinished job has none: one in its dir is an earlier attempt's
    if state == "ok":
        final_eval, damage = read_record(job.dir / FINAL_EVAL)
        row["final_eval_accuracy"] = _number(final_eval.get("eval/accuracy"))
        if damage not in (None, "missing") or (damage is None and math.isnan(row["final_eval_accuracy"])):
            damage = damage or "without a numeric eval/accuracy"
            error = error or f"{FINAL_EVAL} is {damage}"
            problems.append(f"{where}/{FINAL_EVAL} is {damage}; job {where} has no final_eval_accuracy; {REDO_JOB}")
    row.update({"status": state, "error": error or "", "dir": where})
    return row


def _missing_final_evals(rows: list[dict], due: list[bool], problems: list[str]) -> None:
    """A finished job without final_eval.json, where other finished jobs have one and its eval.final is not off,
    is named too (`due`: per row, whether its config asks for one)."""
    if not any(r["status"] == "ok" and math.isfinite(r["final_eval_accuracy"]) for r in rows):
        return
    for row, wanted in zip(rows, due, strict=True):
        if row["status"] == "ok" and wanted and not math.isfinite(row["final_eval_accuracy"]) and not row["error"]:
            row["error"] = f"{FINAL_EVAL} is missing"
            problems.append(f"{row['dir']}/{FINAL_EVAL} is missing, though other finished jobs have one; job "
                            f"{row['dir']} has no final_eval_accuracy; {REDO_JOB}")


def collect(sweep_dir: Path, problems: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """(rows, swept keys) for the jobs of the sweep in `sweep_dir`; a line for each damaged or missing record of a
    finished job goes to `problems`."""
    sweep_dir, problems = Path(sweep_dir), [] if problems is None else problems
    jobs = _jobs_of_sweep(sweep_dir)
    keys = _keys(sweep_dir, jobs)
    rows = [_row(sweep_dir, job, keys, problems) for job in jobs]
    _missing_final_evals(rows, [not job.final_eval_off for job in jobs], problems)
    rows.sort(key=lambda r: (r["job"] if isinstance(r["job"], int) else 1 << 62, r["dir"]))
    return rows, keys


# ---- cells ---------------------------------------------------------------------------------------------
def sweep_metric(sweep_dir: Path) -> str:
    """sweep.metric as the sweep was started with it (multirun.yaml); auto when it does not say."""
    return str((load_yaml(Path(sweep_dir) / "multirun.yaml").get("sweep") or {}).get("metric") or "auto")


def rank_metric(rows: list[dict], metric: str = "auto") -> tuple[str, str | None]:
    """The column cells are ranked by, and a line when that is not the metric the jobs were meant to be ranked by:
    `metric`, or for auto final_eval_accuracy where every ok job has it, else mean_reward (said when some have it)."""
    if metric != "auto":
        return metric, None
    ok = [r for r in rows if r.get("status") == "ok"]
    scored = [r for r in ok if math.isfinite(_number(r.get("final_eval_accuracy")))]
    if ok and len(scored) == len(ok):
        return "final_eval_accuracy", None
    if not scored:
        return "mean_reward", None
    without = ", ".join(str(r.get("dir", r.get("job"))) for r in ok if r not in scored)
    return "mean_reward", (f"sweep.metric=auto ranks the cells by mean_reward, not final_eval_accuracy: finished "
                           f"job(s) {without} have no intact {FINAL_EVAL}; mend them, or name sweep.metric")


def cells(rows: list[dict], keys: list[str], rank_by: str) -> list[dict]:
    """The sweep's cells (jobs that differ only in trainer.seed), best first: sweep_stats.cell_table of the
    CELL_METRICS, ranked by `rank_by`; `note` says when the ranking metric has no interval."""
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


# ---- writing the tables ----------------------------------------------------------------------------
def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@contextlib.contextmanager
def _locked(sweep_dir: Path):
    """Serialise summary writes of jobs that end at the same time (joblib, submitit) and of grpo-report."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(sweep_dir / SUMMARY_LOCK_FILE, "a") as fh:
        with contextlib.suppress(OSError):  # a file system without locks
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _write_table(sweep_dir: Path, csv_name: str, json_name: str, columns: list[str], rows: list[dict]) -> None:
    """One table as CSV (None and NaN empty, lists as JSON) and JSON (NaN as null), each replaced in one step."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(row.get(k)) for k in columns})
    replace_text(sweep_dir / csv_name, buf.getvalue())
    replace_text(sweep_dir / json_name, json.dumps([{k: json_value(row.get(k)) for k in columns} for row in rows],
                                                   indent=2) + "\n")


@dataclass
class Summary:
    """What write_summary wrote: the job rows, the swept keys, the ranked cells, and one line per problem
    (a damaged or missing record of a finished job, a ranking metric other than the one asked for)."""

    rows: list[dict]
    keys: list[str]
    cells: list[dict]
    rank_by: str
    problems: list[str] = field(default_factory=list)


def summarise(sweep_dir: Path, metric: str | None = None) -> Summary:
    """The summary of the sweep in `sweep_dir`, from its job dirs, its cells ranked by `metric` (default the
    sweep's sweep.metric); nothing written."""
    problems: list[str] = []
    rows, keys = collect(sweep_dir, problems)
    rank_by, changed = rank_metric(rows, sweep_metric(sweep_dir) if metric is None else metric)
    return Summary(rows, keys, cells(rows, keys, rank_by), rank_by, problems + ([changed] if changed else []))


def write_summary(sweep_dir: Path, metric: str | None = None) -> Summary:
    """Write `sweep_summary.csv/json` (one row per job) and `sweep_cells.csv/json` (one row per cell) in
    `sweep_dir`, as `summarise` makes them; return what was written."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with _locked(sweep_dir):
        summary = summarise(sweep_dir, metric)
        _write_table(sweep_dir, SUMMARY_CSV, SUMMARY_JSON,
                     ["job", "overrides", *summary.keys, *METRIC_COLUMNS, "status", "error", "dir"], summary.rows)
        _write_table(sweep_dir, CELLS_CSV, CELLS_JSON, cell_columns(summary.keys, summary.cells), summary.cells)
    return summary
