"""The `wandb` logger (`logger.backend=wandb`): one W&B run per run dir, kept across resumes, its config the
scrubbed resolved config, its history one row per step. Best effort: no credentials, a server that cannot be
reached or is slow, a failing call are warnings, never the end of a run; metrics.jsonl keeps the data."""

from __future__ import annotations

import netrc
import os
import re
import secrets
import string
import sys
from pathlib import Path
from typing import Literal, cast
from urllib.parse import urlparse

from grpo_cli.base.errors import error_line, warn
from grpo_cli.config import override_key
from grpo_cli.config.schema import LoggerConfig, WandbConfig
from grpo_cli.tracking.sinks import LOGGERS, NullSink, RunInfo, redact, scrub_secrets

WANDB_MODES = ("auto", "online", "offline", "disabled")
WandbMode = Literal["online", "offline", "disabled"]  # what `auto` resolves to, and what W&B starts in
WANDB_ID_FILE = "wandb_run_id"  # in the run dir: a resumed run continues the same W&B run


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


def resolve_wandb_mode(mode: str | None) -> tuple[WandbMode, str | None]:
    """(mode to start W&B in, a warning or None). `auto` honours WANDB_MODE when it is set, else goes online
    only with credentials; `online` without credentials would prompt or fail, so it is offline with a warning."""
    mode = str(mode or "auto").lower()  # one of WANDB_MODES: run.validate checked it
    if mode == "auto":
        env = os.environ.get("WANDB_MODE", "").lower()
        env = {"dryrun": "offline", "run": "online"}.get(env, env)
        if env in ("offline", "disabled"):
            return cast(WandbMode, env), None
        return ("online" if has_wandb_credentials() else "offline"), None
    if mode == "online" and not has_wandb_credentials():
        return "offline", ("logger.wandb.mode=online but no W&B credentials were found (set WANDB_API_KEY or run "
                           "`wandb login`); logging offline instead")
    return cast(WandbMode, mode), None  # not auto, and one of WANDB_MODES


def _hydra_names(cfg_wandb: WandbConfig) -> tuple[str | None, str | None]:
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
def wandb_sink(cfg_logger: LoggerConfig, run: RunInfo) -> WandbSink | None:
    """A W&B run in the mode `logger.wandb.mode` resolves to; None (with a warning) when W&B cannot start."""
    cfg_wandb = cfg_logger.wandb or WandbConfig()  # logger.backend=wandb on another logger option: the defaults
    mode, note = resolve_wandb_mode(cfg_wandb.mode)
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

    def __init__(self, cfg_wandb: WandbConfig, run: RunInfo, mode: WandbMode):
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
            project=cfg_wandb.project, entity=cfg_wandb.entity, name=cfg_wandb.name or name,
            group=cfg_wandb.group or group, tags=list(cfg_wandb.tags), dir=str(run_dir),
            config=scrub_secrets(run.config), job_type="train", id=wandb_run_id(run_dir, run.resume), resume="allow",
        )
        self.init_timeout, self.finish_timeout = cfg_wandb.init_timeout, cfg_wandb.finish_timeout
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
            every_segment = str(Path(run_dir) / "wandb" / f"offline-run-*-{self.run.id}")
            target = every_segment if len(segments) > 1 else self.sync_dir()
            self.location = f"wandb sync {target}"
            run.say(f"W&B: logging offline to {self.sync_dir()}; upload it later with `{self.location}`")
        else:
            self.location = str(getattr(self.run, "url", None) or "")
            if self.location:
                run.say(f"W&B: {self.location}")

    def _init(self, mode: WandbMode):
        # reinit=create_new: a sweep's jobs that share the process (hydra/launcher=shared_base) each have their run
        # open at once; W&B would otherwise hand every job the first one's run
        settings = self.wandb.Settings(silent=True, console="off", init_timeout=self.init_timeout,
                                       finish_timeout=self.finish_timeout, reinit="create_new")
        argv = sys.argv
        sys.argv = [redact(arg) for arg in argv]  # W&B records the command line: a key typed there is blanked out
        try:
            return self.wandb.init(mode=mode, settings=settings, **self.kwargs)
        finally:
            sys.argv = argv

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
            # W&B annotates columns as list[str | int], though it only reads them
            self.run.log({"samples": self.wandb.Table(columns=cast("list[str | int]", columns), data=data)},
                         step=int(step))
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
