"""Metric sinks: metrics.jsonl (always), W&B (logger=wandb), and the rich console."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")


def scrub_secrets(obj):
    """Drop any config entry whose key looks like a credential, at any depth."""
    if isinstance(obj, dict):
        return {k: scrub_secrets(v) for k, v in obj.items() if not any(m in str(k).lower() for m in SECRET_MARKERS)}
    if isinstance(obj, list):
        return [scrub_secrets(v) for v in obj]
    return obj


class JsonlSink:
    def __init__(self, path: Path):
        self.path = path

    def log(self, row: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


class WandbSink:
    """W&B with `mode=auto`: online when credentials exist, else offline. A W&B failure never stops training."""

    def __init__(self, cfg_wandb: dict, run_dir: Path, config: dict, console: Console):
        import wandb

        self.wandb, self.console = wandb, console
        mode = cfg_wandb.get("mode", "auto")
        if mode == "auto":
            mode = "online" if _has_wandb_credentials() else "offline"
            if mode == "offline":
                console.print(f"W&B: no credentials, logging offline; sync later with `wandb sync {run_dir}/wandb/offline-run-*`")
        kwargs = dict(
            project=cfg_wandb.get("project") or "grpo-cli", entity=cfg_wandb.get("entity"),
            name=cfg_wandb.get("name"), group=cfg_wandb.get("group"), tags=list(cfg_wandb.get("tags") or []),
            dir=str(run_dir), config=scrub_secrets(config), job_type="train",
        )
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=60, silent=True), **kwargs)
        except Exception as err:  # unreachable or slow server: keep the data locally instead
            if mode != "online":
                raise
            console.print(f"[yellow]W&B online init failed ({str(err).splitlines()[0][:120]}); logging offline instead[/]")
            self.run = wandb.init(mode="offline", settings=wandb.Settings(silent=True), **kwargs)

    def log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def samples(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0].keys())
        table = self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class ConsoleView:
    """A live progress bar on a terminal; one plain line per step otherwise (CI, scheduler logs)."""

    def __init__(self, total_steps: int, start_step: int, console: Console | None = None):
        self.console = console or Console(stderr=False)
        self.live = self.console.is_terminal
        self.start = time.time()
        if self.live:
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self.progress.start()
        self.total = total_steps

    def log(self, row: dict) -> None:
        stats = (f"reward {row['reward']:.3f}  kl {row['kl']:.4f}  clip {row['clip_fraction']:.3f}  "
                 f"{row['gen_tokens_per_s']:.0f} tok/s")
        if self.live:
            self.progress.update(self.task, completed=row["step"] + 1, stats=stats)
        else:
            print(f"step {row['step'] + 1}/{self.total}  {stats}  {row['step_time_s']:.1f}s", flush=True)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {text}")

    def close(self, summary: dict) -> None:
        if self.live:
            self.progress.stop()
        table = Table(title="grpo-train", show_header=False)
        for key, value in summary.items():
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        self.console.print(table)


class Tracker:
    """Fans each step's metrics out to every sink; the jsonl file is the source of truth."""

    def __init__(self, run_dir: Path, cfg_logger, config: dict, total_steps: int, start_step: int = 0):
        self.metrics = JsonlSink(run_dir / "metrics.jsonl")
        self.samples_path = run_dir / "samples.jsonl"
        self.console = ConsoleView(total_steps, start_step)
        self.wandb = None
        if cfg_logger.get("backend") == "wandb":
            self.wandb = WandbSink(dict(cfg_logger.get("wandb") or {}), run_dir, config, self.console.console)

    def log(self, row: dict) -> None:
        self.metrics.log(row)
        if self.wandb:
            try:
                self.wandb.log(row)
            except Exception as err:
                self.console.warn(f"W&B log failed at step {row['step']} ({err}); metrics.jsonl still has it")
        self.console.log(row)

    def samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        if self.wandb:
            try:
                self.wandb.samples(step, rows)
            except Exception as err:
                self.console.warn(f"W&B sample table failed at step {step} ({err})")

    def warn(self, text: str) -> None:
        self.console.warn(text)

    def close(self, summary: dict) -> None:
        if self.wandb:
            self.wandb.close()
        self.console.close(summary)


def print_error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
