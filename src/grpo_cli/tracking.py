"""Metric sinks behind one protocol: metrics.jsonl and samples.jsonl (always), the rich console (always), and
the sink of the logger `logger.backend` names (LOGGERS: none, wandb, or a user's own).

    tracker = open_tracker(run_dir, cfg.logger, config, total_steps, start_step, resume)
    tracker.log(row); tracker.samples(step, rows); tracker.warn(text); tracker.close(summary)

`Tracker` fans each call out to its sinks (none on ranks other than 0). metrics.jsonl is the source of truth;
W&B and the console are best effort: a W&B failure (no credentials, a server that cannot be reached or is
slow) is a warning, never the end of a run. While a Tracker is open, errors.warn() shows on its console.

A new logger is one module with a sink factory `(cfg_logger: dict, run: RunInfo) -> MetricSink | None`
registered as `@LOGGERS.register("NAME")`, plus conf/logger/NAME.yaml.
"""

from __future__ import annotations

import atexit
import json
import math
import netrc
import os
import re
import secrets
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grpo_cli.errors import error_line, send_warnings_to, warn, warnings_listener
from grpo_cli.metrics import METRICS, SAMPLES
from grpo_cli.overrides import override_key
from grpo_cli.registry import Registry

SECRET_MARKERS = ("api_key", "apikey", "secret", "password", "passwd")  # anywhere in a key
# ...and keys that end in one of these words: hf_token, access_token, token; not max_new_tokens or tokenizer
SECRET_SUFFIX = re.compile(r"(^|[^a-z0-9])(token|access_?key|private_?key|credentials?)$")
SECRET_ENV = ("WANDB_API_KEY",)
REDACTED = "<redacted>"
WANDB_MODES = ("auto", "online", "offline", "disabled")
DEFAULT_PROJECT = "grpo-cli"
WANDB_ID_FILE = "wandb_run_id"  # in the run dir: a resumed run continues the same W&B run


# ---- secrets -------------------------------------------------------------------------------------
def secret_values() -> list[str]:
    """The credential values of this process's environment (never printed, never written)."""
    return [v for v in (os.environ.get(k, "") for k in SECRET_ENV) if len(v) >= 8]


def redact(text: str, values: list[str] | None = None) -> str:
    for value in secret_values() if values is None else values:
        text = text.replace(value, REDACTED)
    return text


def is_secret_key(key) -> bool:
    key = str(key).lower()
    return any(m in key for m in SECRET_MARKERS) or bool(SECRET_SUFFIX.search(key))


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


# name -> sink factory `(cfg_logger: dict, run: RunInfo) -> MetricSink | None` (None: nothing to add)
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


# ---- W&B -----------------------------------------------------------------------------------------
def _wandb_host() -> tuple[str, str]:
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    return url.hostname or "api.wandb.ai", url.netloc or "api.wandb.ai"


def has_wandb_credentials() -> bool:
    """WANDB_API_KEY, or a netrc entry for the W&B server (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    home = Path(os.environ.get("HOME") or Path.home())
    files = [Path(os.environ["NETRC"])] if os.environ.get("NETRC") else [home / ".netrc", home / "_netrc"]
    hosts = set(_wandb_host())
    for file in files:
        if not file.is_file():
            continue
        try:
            entries = netrc.netrc(str(file)).hosts
            if any(h in entries and entries[h][2] for h in hosts):
                return True
        except (netrc.NetrcParseError, OSError):
            text = file.read_text(errors="ignore")
            if any(re.search(rf"machine\s+{re.escape(h)}\b", text) for h in hosts):
                return True
    return False


def resolve_wandb_mode(mode: str | None) -> tuple[str, str | None]:
    """(mode to start W&B in, a warning or None). `auto` honours WANDB_MODE when it is set, else goes online
    only with credentials; `online` without credentials would prompt or fail, so it is offline with a warning."""
    mode = str(mode or "auto").lower()  # one of WANDB_MODES: config.validate checked it
    if mode == "auto":
        env = os.environ.get("WANDB_MODE", "").lower()
        env = {"dryrun": "offline", "run": "online"}.get(env, env)
        if env in ("offline", "disabled"):
            return env, None
        return ("online" if has_wandb_credentials() else "offline"), None
    if mode == "online" and not has_wandb_credentials():
        return "offline", ("logger.wandb.mode=online but no W&B credentials were found (set WANDB_API_KEY or run "
                           "`wandb login`); logging offline instead")
    return mode, None


def _hydra_names(cfg_wandb: dict) -> tuple[str | None, str | None]:
    """Default W&B name and group from the Hydra job: name = the job's overrides joined (as Hydra's
    override_dirname, logger.* and the recipe left out), group = the recipe, plus the sweep dir in a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return None, None
        hc = HydraConfig.get()
    except Exception:
        return None, None
    try:
        recipe = (hc.runtime.choices or {}).get("recipe")
    except Exception:
        recipe = None
    overrides = [str(o) for o in (hc.overrides.task or [])]
    if recipe is None:
        for line in overrides:
            key, _, value = line.partition("=")
            if override_key(key) == "recipe":
                recipe = value
    try:
        dirname_cfg = hc.job.config.override_dirname
        kv_sep, item_sep, exclude = dirname_cfg.kv_sep, dirname_cfg.item_sep, set(dirname_cfg.exclude_keys or [])
    except Exception:
        kv_sep, item_sep, exclude = "=", ",", set()
    kept = []
    for line in overrides:
        key = override_key(line)
        if key in exclude or key == "recipe" or key == "logger" or key.startswith("logger."):
            continue
        kept.append(line.lstrip("+"))
    name = re.sub("=", kv_sep, item_sep.join(sorted(kept))) if kept else recipe
    group = recipe
    try:
        if hc.mode == RunMode.MULTIRUN:
            sweep = Path(str(hc.sweep.dir))
            sweep_id = sweep.name
            if re.fullmatch(r"[\d_:.-]+", sweep_id) and sweep.parent.name not in ("", "."):
                sweep_id = f"{sweep.parent.name}_{sweep_id}"  # the default multirun/DATE/TIME
            group = f"{recipe}-{sweep_id}" if recipe else f"sweep-{sweep_id}"
    except Exception:
        pass
    return (name[:128] if name else None), (group[:128] if group else None)


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The W&B run id of this run dir: the one kept there when resuming, else a new one (kept for later)."""
    path = Path(run_dir) / WANDB_ID_FILE
    if resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own form
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def _said(err: Exception) -> str:
    """An exception's first line, credentials blanked out, short enough for one console line."""
    return redact(error_line(err))[:160]


@LOGGERS.register("wandb")
def wandb_sink(cfg_logger: dict, run: RunInfo) -> WandbSink | None:
    """A W&B run in the mode `logger.wandb.mode` resolves to; None (with a warning) when W&B cannot start."""
    cfg_wandb = dict(_plain(cfg_logger.get("wandb")) or {})
    mode, note = resolve_wandb_mode(cfg_wandb.get("mode"))
    if note:
        warn(note)
    if mode == "disabled":
        return None
    try:
        return WandbSink(cfg_wandb, run, mode)
    except Exception as err:
        warn(f"W&B could not start ({_said(err)}); logging to metrics.jsonl and the console only")
        return None


class WandbSink(NullSink):
    """One W&B run: its config is the resolved (scrubbed) Hydra config, its history one row per step. Best
    effort: a failing call is a warning, metrics.jsonl keeps the data."""

    def __init__(self, cfg_wandb: dict, run: RunInfo, mode: str):
        # Before W&B starts its service (which inherits the environment): its own banner lines stay off, and so
        # does its crash reporting to Sentry, which off the network holds the process ~20 s at exit after a
        # failed online init. Either can be turned back on by setting the variable.
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        run_dir = run.run_dir
        self.wandb, self.run_dir = wandb, run_dir
        name, group = _hydra_names(cfg_wandb)
        self.kwargs = dict(
            project=cfg_wandb.get("project") or DEFAULT_PROJECT, entity=cfg_wandb.get("entity") or None,
            name=cfg_wandb.get("name") or name, group=cfg_wandb.get("group") or group,
            tags=[str(t) for t in (cfg_wandb.get("tags") or [])], dir=str(run_dir),
            config=scrub_secrets(run.config), job_type="train",
            id=wandb_run_id(run_dir, run.resume), resume="allow",
        )
        self.init_timeout = float(cfg_wandb.get("init_timeout") or 60)
        self.finish_timeout = float(cfg_wandb.get("finish_timeout") or 300)
        try:
            self.run = self._init(mode)
        except Exception as err:  # unreachable or slow server, bad key: keep the data locally instead
            if mode != "online":
                raise
            warn(f"W&B online init failed ({_said(err)}); logging offline instead")
            mode = "offline"
            self.wandb.teardown()  # its service still holds the run id of the failed attempt
            self.run = self._init(mode)
        self.mode = mode
        if mode == "offline":
            segments = sorted(Path(run_dir).glob(f"wandb/offline-run-*-{self.run.id}"))
            # a resumed run logs each segment to its own folder, all under one run id: upload them together
            target = str(Path(run_dir) / "wandb" / f"offline-run-*-{self.run.id}") if len(segments) > 1 else self.sync_dir()
            self.location = f"wandb sync {target}"
            run.say(f"W&B: logging offline to {self.sync_dir()}; upload it later with `{self.location}`")
        else:
            self.location = str(getattr(self.run, "url", None) or "")
            if self.location:
                run.say(f"W&B: {self.location}")

    def _init(self, mode: str):
        settings = self.wandb.Settings(silent=True, console="off", init_timeout=self.init_timeout,
                                       finish_timeout=self.finish_timeout)
        return self.wandb.init(mode=mode, settings=settings, **self.kwargs)

    def sync_dir(self) -> str:
        sync_dir = getattr(self.run.settings, "sync_dir", None)
        return str(sync_dir or Path(self.run_dir) / "wandb")

    def log(self, row: dict) -> None:
        data = {k: v for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        try:
            self.run.log(data, step=int(row["step"]))
        except Exception as err:
            warn(f"W&B log failed at step {row['step']} ({_said(err)}); metrics.jsonl still has it")

    def samples(self, step: int, rows: list[dict]) -> None:
        if not rows:
            return
        columns: list[str] = []
        for r in rows:
            columns += [c for c in r if c not in columns]
        data = [[redact(v) if isinstance(v, str) else v for v in (r.get(c) for c in columns)] for r in rows]
        try:
            self.run.log({"samples": self.wandb.Table(columns=columns, data=data)}, step=int(step))
        except Exception as err:
            warn(f"W&B sample table failed at step {step} ({_said(err)})")

    def close(self, summary: dict) -> dict | None:
        try:
            for key, value in summary.items():
                if isinstance(value, (int, float, str)) and key != "steps":
                    self.run.summary[key] = value
            self.run.finish()
        except Exception as err:
            warn(f"W&B finish failed ({_said(err)}); the run is on disk under {self.sync_dir()}")
            return None
        return {"W&B": self.location}


# ---- console -------------------------------------------------------------------------------------
def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


SUMMARY_LABELS = {
    "steps": "steps",
    "first_reward": "reward, first 10 steps",
    "last_reward": "reward, last 10 steps",
    "final_reward": "final reward (last 10%)",
    "time_s": "total time",
    "adapter": "adapter",
}


def _default_console() -> Console:
    """stdout; off a terminal (CI, a scheduler's log) 200 columns unless COLUMNS says otherwise, so that paths and
    the summary table are not folded at 80."""
    console = Console(stderr=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=False, width=200)
    return console


class ConsoleView(NullSink):
    """The console sink: a live progress bar on a terminal; one plain line per step otherwise (CI, scheduler logs);
    the summary table at the end."""

    def __init__(self, total_steps: int, start_step: int, console: Console | None = None):
        self.console = console or _default_console()
        self.live = self.console.is_terminal
        self.total, self.start_step = total_steps, start_step
        self.start = time.time()
        self.progress = None
        if self.live:
            # the text needs ~75 columns; the bar gets what is left (5 to 40), so an 80-column terminal keeps the numbers
            bar = max(5, min(40, self.console.width - 75))
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=bar),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console, refresh_per_second=4,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self.progress.start()
            atexit.register(self._stop)  # an exception or a signal mid-run still gives the terminal back

    @staticmethod
    def stats(row: dict) -> str:
        def num(key, fmt):
            value = row.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) else "-"

        text = (f"reward {num('reward', '.3f')} kl {num('kl', '.4f')} clip {num('clip_fraction', '.3f')} "
                f"{num('gen_tokens_per_s', '.0f')} tok/s")
        if "eval/accuracy" in row:
            text += f" eval {num('eval/accuracy', '.3f')}"
        return text

    def log(self, row: dict) -> None:
        stats = self.stats(row)
        done = int(row["step"]) + 1
        if self.progress is not None:
            self.progress.update(self.task, completed=done, stats=stats)
            return
        elapsed = time.time() - self.start
        per_step = elapsed / max(1, done - self.start_step)
        eta = _duration(per_step * max(0, self.total - done))
        step_time = row.get("step_time_s")
        step_time = f"{step_time:.1f}s" if isinstance(step_time, (int, float)) else "-"
        self.console.print(f"step {done}/{self.total}  {stats}  {step_time}  eta {eta}", markup=False, highlight=False,
                           soft_wrap=True)

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {escape(redact(text))}", highlight=False, soft_wrap=True)

    def _stop(self) -> None:
        if self.progress is not None:
            try:
                self.progress.stop()
            finally:
                self.progress = None

    def close(self, summary: dict) -> None:
        self._stop()
        table = Table(title="grpo-train", show_header=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in summary.items():
            if key == "time_s" and isinstance(value, (int, float)):
                text = f"{_duration(value)} ({value:.1f} s)"
            elif isinstance(value, float):
                text = f"{value:.4f}"
            else:
                text = str(value)
            table.add_row(SUMMARY_LABELS.get(key, key), escape(redact(text)))
        self.console.print(table)


# ---- the fan-out ---------------------------------------------------------------------------------
class Tracker:
    """Fans each call out to its sinks, in order (the console last); with no sinks (ranks other than 0) it
    drops everything. From its opening to `close` it is where errors.warn() sends warnings."""

    def __init__(self, sinks: list[MetricSink], say: Callable[[str], None] | None = None):
        self.sinks = list(sinks)
        self.say = say or (lambda text: None)  # a line for the user (the console), not a record
        send_warnings_to(self._show_warning)

    def log(self, row: dict) -> None:
        for sink in self.sinks:
            sink.log(row)

    def samples(self, step: int, rows: list[dict]) -> None:
        for sink in self.sinks:
            sink.samples(step, rows)

    def warn(self, text: str) -> None:
        warn(text)

    def _show_warning(self, text: str) -> None:
        for sink in self.sinks:
            sink.warn(text)

    def close(self, summary: dict) -> None:
        """Each sink closes in turn and sees the summary with what the sinks before it added; then warnings go
        to stderr again."""
        try:
            for sink in self.sinks:
                summary = {**summary, **(sink.close(summary) or {})}
        finally:
            if warnings_listener() == self._show_warning:
                send_warnings_to(None)


def open_tracker(run_dir: Path, cfg_logger, config: dict, total_steps: int, start_step: int = 0,
                 resume: bool = False) -> Tracker:
    """The run's tracker: metrics.jsonl and samples.jsonl, the sink of `logger.backend` (if it gives one), the
    console; warnings go to it from here on."""
    console = ConsoleView(total_steps, start_step)
    files = JsonlSink(run_dir)
    tracker = Tracker([files, console], say=console.say)  # takes the warnings already: a logger that cannot start says so here
    cfg_logger = _plain(cfg_logger) or {}
    run = RunInfo(Path(run_dir), _plain(config), total_steps, start_step, resume, say=console.say)
    logger = LOGGERS.lookup(str(cfg_logger.get("backend") or "none"))(cfg_logger, run)
    if logger is not None:
        tracker.sinks.insert(1, logger)
    where = (f"training {total_steps} steps" if not start_step else
             f"resuming at step {start_step + 1} of {total_steps}" if start_step < total_steps else
             f"resuming after the last of {total_steps} steps")
    console.say(f"{where}; Ctrl-C stops and keeps a checkpoint (twice: exits at once)")
    return tracker
