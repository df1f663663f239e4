"""Metric sinks behind one protocol: metrics.jsonl and samples.jsonl (always), the rich console (always), and
the sink of the logger `logger.backend` names (LOGGERS: none, wandb, tensorboard, or a user's own).

    tracker = open_tracker(run_dir, cfg.logger, config, total_steps, start_step, resume)
    tracker.log(row); tracker.samples(step, rows); tracker.warn(text); tracker.close(summary)

`Tracker` fans each call out to its sinks (none on ranks other than 0). metrics.jsonl is the source of truth;
W&B and the console are best effort: a W&B failure (no credentials, a server that cannot be reached or is
slow) is a warning, never the end of a run. While a Tracker is open, errors.warn() shows on its console.

A new logger is one module with a sink factory `(cfg_logger: dict, run: RunInfo) -> MetricSink | None`
registered as `@LOGGERS.register("NAME")`, plus conf/logger/NAME.yaml.

The package: sinks.py holds the protocol, LOGGERS and the record files (what a logger builds on), wandb_sink.py
the W&B logger; here the console view, the fan-out (`Tracker`) and `open_tracker`. Every public name of both is
re-exported here: callers (and users' loggers) import from `grpo_cli.tracking` alone.

May import: config, base.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from grpo_cli.base.errors import send_warnings_to, warn, warnings_listener
from grpo_cli.config.schema import LoggerConfig
from grpo_cli.tracking.sinks import (
    LOGGERS,
    REDACTED,
    JsonlSink,
    MetricSink,
    NullSink,
    RunInfo,
    _plain,
    is_secret_key,
    redact,
    scrub_secrets,
    secret_values,
)
from grpo_cli.tracking.tensorboard_sink import TensorBoardSink  # importing it registers the tensorboard logger
from grpo_cli.tracking.wandb_sink import (  # importing it registers the wandb logger
    WANDB_ID_FILE,
    WANDB_MODES,
    WandbSink,
    _hydra_names,
    has_wandb_credentials,
    resolve_wandb_mode,
    wandb_run_id,
    wandb_sink,
)

__all__ = [
    "LOGGERS", "REDACTED", "REWARD_WINDOW", "WANDB_ID_FILE", "WANDB_MODES", "ConsoleView", "JsonlSink", "MetricSink",
    "NullSink", "RunInfo", "TensorBoardSink", "Tracker", "WandbSink", "_hydra_names", "has_wandb_credentials",
    "console_label", "is_secret_key", "label_console", "loading", "open_tracker", "redact", "resolve_wandb_mode",
    "scrub_secrets", "secret_values",
    "wandb_run_id", "wandb_sink",
]


# ---- console -------------------------------------------------------------------------------------
def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


REWARD_WINDOW = 10  # the summary's first and last reward: the mean over this many steps, or all of a shorter run
SUMMARY_LABELS = {
    "steps": "steps",
    "first_reward": "reward, first {window}",
    "last_reward": "reward, last {window}",
    "final_reward": "final reward (last 10%)",
    "time_s": "time, this attempt",  # the steps count every attempt (metrics.jsonl), the time only this one
    "adapter": "adapter",
}


def _default_console() -> Console:
    """stdout; off a terminal (CI, a scheduler's log) 200 columns unless COLUMNS says otherwise, so that paths and
    the summary table are not folded at 80."""
    console = Console(stderr=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=False, width=200)
    return console


class _EtaColumn(ProgressColumn):
    """`eta M:SS` of the live bar, counting down from the estimate of the last step (ConsoleView.seconds_left). Not
    rich's TimeRemainingColumn: that one estimates a speed from the last 30 s only, so it shows none while a step
    takes longer."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__()
        self.clock = clock

    def render(self, task) -> Text:
        finish = task.fields.get("finish")
        return Text("eta " + ("?" if finish is None else _duration(max(0.0, finish - self.clock()))))


_console_label: str | None = None  # the job a console line is of, while a sweep's jobs share the process


def label_console(label: str | None) -> None:
    """The consoles opened from now on start each line with `label: ` and draw no live bar (several jobs' lines
    interleave: hydra/launcher=shared_base); None: as alone."""
    global _console_label
    _console_label = label


def console_label() -> str | None:
    return _console_label


class ConsoleView(NullSink):
    """The console sink: a live progress bar on a terminal; one plain line per step otherwise (CI, scheduler logs);
    the summary table at the end. `clock` tells the time (seconds; time.time). Labelled (label_console): plain
    lines, each starting with the label."""

    def __init__(self, total_steps: int, start_step: int, console: Console | None = None,
                 clock: Callable[[], float] = time.time):
        self.console = console or _default_console()
        self.job_label = _console_label
        # a dumb terminal (TERM=dumb: editors' shells, some CI) cannot redraw in place: plain lines there too
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal and self.job_label is None
        self.total, self.start_step = total_steps, start_step
        self.clock = clock
        self.start = clock()
        self.progress = None
        if self.live:
            # the text needs ~75 columns; the bar gets what is left (5 to 40), so an 80-column terminal keeps the
            # numbers. It counts the steps done (`1/40 done` after step 0): no step number that could disagree with
            # metrics.jsonl
            bar = max(5, min(40, self.console.width - 100))
            self.progress = Progress(
                TextColumn("{task.completed}/{task.total} done"), BarColumn(bar_width=bar),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), _EtaColumn(clock),
                TextColumn("{task.fields[phase]}"),  # what the step under way is doing: generating, scoring, ...
                console=self.console, refresh_per_second=4, get_time=clock,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="", finish=None,
                                               phase="")
            self.progress.start()
            atexit.register(self.end_live)  # an exception or a signal mid-run still gives the terminal back

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
        """A step's line names the step as metrics.jsonl does (they count from 0), then how many of the run's steps
        are done: `step 0 done (1/40)`."""
        stats = self.stats(row)
        done = int(row["step"]) + 1
        left = self.seconds_left(done)
        if self.progress is not None:
            self.progress.update(self.task, completed=done, stats=stats, finish=self.clock() + left)
            return
        step_time = row.get("step_time_s")
        step_time = f"{step_time:.1f}s" if isinstance(step_time, (int, float)) else "-"
        line = f"step {row['step']} done ({done}/{self.total})  {stats}  {step_time}  eta {_duration(left)}"
        self.say(line)

    def seconds_left(self, done: int) -> float:
        """What the steps left take at the mean pace of this attempt's steps so far."""
        per_step = (self.clock() - self.start) / max(1, done - self.start_step)
        return per_step * max(0, self.total - done)

    def say(self, text: str) -> None:
        text = text if self.job_label is None else f"{self.job_label}: {text}"
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def phase(self, step: int, text: str) -> None:
        """What step `step` is doing now (`step 3: generating`), on the live line; off a terminal nothing (a line per
        phase would bury the steps' lines)."""
        if self.progress is not None:
            self.progress.update(self.task, phase=f"step {step}: {text}")

    def warn(self, text: str) -> None:
        label = "" if self.job_label is None else f"{escape(self.job_label)}: "
        self.console.print(f"{label}[yellow]warning:[/] {escape(redact(text))}", highlight=False, soft_wrap=True)

    def end_live(self) -> None:
        """The live bar stops and gives the terminal back: what is printed after it is not redrawn under the bar (and
        folded at the terminal's width), but written as it is."""
        if self.progress is not None:
            try:
                self.progress.stop()
            finally:
                self.progress = None

    @staticmethod
    def label(key: str, summary: dict) -> str:
        """The summary row's name; a run of fewer than REWARD_WINDOW steps says how many its rewards average."""
        steps = min(REWARD_WINDOW, summary.get("steps", REWARD_WINDOW))
        window = "1 step" if steps == 1 else f"{steps} steps"
        return SUMMARY_LABELS[key].format(window=window) if key in SUMMARY_LABELS else key

    def close(self, summary: dict) -> None:
        self.end_live()
        table = Table(title="grpo-train" if self.job_label is None else f"grpo-train, {self.job_label}",
                      show_header=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in summary.items():
            if key == "time_s" and isinstance(value, (int, float)):
                text = f"{_duration(value)} ({value:.1f} s)"
            elif isinstance(value, float):
                text = f"{value:.4f}"
            else:
                text = str(value)
            table.add_row(self.label(key, summary), escape(redact(text)))
        self.console.print(table)

# ---- the fan-out ---------------------------------------------------------------------------------
class Tracker:
    """Fans each call out to its sinks, in order (the console last); with no sinks (ranks other than 0) it
    drops everything. From its opening to `close` it is where errors.warn() sends warnings."""

    def __init__(self, sinks: list[MetricSink], say: Callable[[str], None] | None = None,
                 end_live: Callable[[], None] | None = None, phase: Callable[[int, str], None] | None = None):
        self.sinks = list(sinks)
        self.say = say or (lambda text: None)  # a line for the user (the console), not a record
        self.phase = phase or (lambda step, text: None)  # what the step under way does, on the live line
        # a run that ends otherwise than by close (a stop, an error) calls it before the line that says why
        self.end_live = end_live or (lambda: None)
        send_warnings_to(self._show_warning, say=say)

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


@contextlib.contextmanager
def loading(what: str, console: Console | None = None) -> Iterator[None]:
    """`loading WHAT` while the block runs (the model loading, the engine built): a spinner with the time so far on a
    terminal, a plain line otherwise; then how long it took."""
    console = console or _default_console()
    start = time.monotonic()
    if console.is_terminal and not console.is_dumb_terminal:  # TERM=dumb cannot redraw a spinner in place
        spinner = Progress(SpinnerColumn(), TextColumn(f"loading {escape(what)}"), TimeElapsedColumn(),
                           console=console, transient=True)
        with spinner:
            spinner.add_task("load", total=None)
            yield
    else:
        console.print(f"loading {what}", markup=False, highlight=False, soft_wrap=True)
        yield
    console.print(f"loaded {what} in {time.monotonic() - start:.1f} s", markup=False, highlight=False, soft_wrap=True)


def open_tracker(run_dir: Path, cfg_logger: LoggerConfig, config: dict, total_steps: int, start_step: int = 0,
                 resume: bool = False) -> Tracker:
    """The run's tracker: metrics.jsonl and samples.jsonl, the sink of `logger.backend` (if it gives one), the
    console; warnings go to it from here on. `config`: the resolved config the logger records."""
    console = ConsoleView(total_steps, start_step)
    files = JsonlSink(run_dir)
    # the tracker takes the warnings already: a logger that cannot start says so here
    tracker = Tracker([files, console], say=console.say, end_live=console.end_live, phase=console.phase)
    run = RunInfo(Path(run_dir), _plain(config), total_steps, start_step, resume, say=console.say)
    logger = LOGGERS.lookup(cfg_logger.backend)(cfg_logger, run)
    if logger is not None:
        tracker.sinks.insert(1, logger)
    where = (f"training {total_steps} steps" if not start_step else
             f"resuming at step {start_step} ({start_step} of {total_steps} done)" if start_step < total_steps else
             f"resuming after the last of {total_steps} steps")
    console.say(f"{where} in {run_dir}; Ctrl-C stops and keeps a checkpoint (twice: exits at once)")
    return tracker
