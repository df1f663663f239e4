"""A run directory belongs to one run, written by one process at a time.

- **One writer**: `RunLock` holds an exclusive `fcntl.flock` on `RUN_DIR/.lock` for the life of the run. The
  kernel drops the lock when its process dies (even by SIGKILL), so a stale lock file is simply taken over;
  the file names the holder (pid, host, start time) for the one line a second process gets.
- **One run**: a fresh run into a dir that holds a run's records is refused (`trainer.resume=auto` goes on,
  `trainer.overwrite=true` deletes the old run's records first, or another `hydra.run.dir`).
- **A pinned config**: every checkpoint's state.json holds `fingerprint(config)`, the keys that decide what a
  step computes. A resume whose config differs is refused in one line listing the keys, before anything is
  written, unless `trainer.resume_allow_changes` names them; a few (the base model, the adapter's shape, the
  optimizer type) can never change, since the saved weights or optimizer state would not fit them.
- **Records that match the checkpoint**: on resume every append-only record is cut back to the checkpoint's
  step, and nothing else of a run's records is ever deleted or truncated by resume.
- **A refused attempt leaves `.hydra/` as it was**: Hydra writes it before the task runs; the files from
  before the attempt (`HydraSnapshot`, read before Hydra starts) are put back when the attempt is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from grpo_cli.base.errors import CheckpointError, UserError
from grpo_cli.base.metrics import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS, SAMPLES, TENSORBOARD_DIR, replace_text
from grpo_cli.base.redaction import is_recorded_secret, is_secret_key, redact
from grpo_cli.config.rules import ranks
from grpo_cli.config.schema import Config, default_of

LOCK_FILE = ".lock"
# append-only, one JSON row per line with its "step"; cut back to the checkpoint's step on resume
RECORDS = (METRICS, SAMPLES)
# what a training run leaves in its dir (all deleted when it starts over); any of the first four means the dir
# holds a run
RUN_OUTPUTS = (*RECORDS, CHECKPOINTS_DIR, ADAPTER_DIR, "wandb_run_id", "wandb", TENSORBOARD_DIR)
RUN_MARKERS = RUN_OUTPUTS[:4]

# the keys (or whole sections) that decide what a step computes
FINGERPRINT_KEYS = (
    "model", "algo", "data", "reward", "optimizer",
    "rollout", "trainer.seed", "trainer.max_steps", "trainer.micro_batch_size", "trainer.max_grad_norm",
)
NOT_FINGERPRINTED = ("algo.check", "reward.timeout_s", "reward.accuracy")  # checks and limits, not the computation
# trainer.micro_batch_tokens, logprob_chunk_size, memory_budget_gb and gradient_checkpointing are not in
# FINGERPRINT_KEYS either: they change rounding at most, not what a step computes (the head's blocks of 256 and of
# 1024 positions train the quickstart bit for bit), and lowering them is how a run that ran out of memory goes on
# the saved adapter, base weights or optimizer state cannot take a change of these: refused even when allowed
NEVER_CHANGED = ("model.name_or_path", "model.lora.r", "model.lora.target_modules", "model.tiny", "optimizer.name")
# what only says how to start (resume, start over), never what a finished job computed
RUN_CONTROL_KEYS = ("trainer.resume", "trainer.overwrite", "trainer.resume_allow_changes")


class RunDirError(UserError):
    """The run dir cannot be used for this attempt (busy, holds another run, config differs)."""


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


# ---- one writer ---------------------------------------------------------------------------------
_Lock = TypeVar("_Lock", bound="RunLock")  # acquire gives the class it is called on: SweepLock.acquire a SweepLock


class RunLock:
    """An exclusive flock on RUN_DIR/.lock, held until `release()` or the end of the process. The kernel drops it
    when its process dies (even by SIGKILL), so a stale file is taken over; the file names the holder for the one
    line a second writer gets. Subclasses change only the file, the words and the option to change."""

    FILE = LOCK_FILE
    OPTION = "hydra.run.dir"
    HOLDER = "grpo-train pid"
    OTHER = "it"

    def __init__(self, file):
        self.file = file

    @classmethod
    def what(cls, folder: Path) -> str:
        return f"run dir {folder}"

    @classmethod
    def acquire(cls: type[_Lock], folder: Path) -> _Lock:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            file = (folder / cls.FILE).open("a+")
        except OSError as err:
            raise RunDirError(f"{cls.what(folder)} cannot be written ({err.strerror or err}); pick a writable "
                              f"{cls.OPTION}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise RunDirError(f"{cls.what(folder)} is in use by {holder}; wait for {cls.OTHER} to end, or pick "
                              f"another {cls.OPTION}") from None
        file.seek(0)
        file.truncate()
        file.write(f"{cls.HOLDER} {os.getpid()} on host {socket.gethostname()} since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        return cls(file)

    def release(self) -> None:
        self.file.close()  # closing drops the flock


# ---- .hydra/ of a refused attempt ---------------------------------------------------------------
@dataclass
class HydraSnapshot:
    """The files of RUN_DIR/.hydra/ before this attempt (None: there was no such folder)."""

    run_dir: Path
    files: dict[str, bytes] | None = field(default=None)

    @classmethod
    def read(cls, run_dir: Path) -> HydraSnapshot:
        folder = run_dir / ".hydra"
        if not folder.is_dir():
            return cls(run_dir)
        return cls(run_dir, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})

    def restore(self) -> None:
        if self.files is None:
            return  # a dir without a run's .hydra/ has nothing to protect
        folder = self.run_dir / ".hydra"
        for stray in folder.glob("*"):
            if stray.is_file() and stray.name not in self.files:
                stray.unlink()
        for name, data in self.files.items():
            (folder / name).write_bytes(data)


@contextlib.contextmanager
def restoring_hydra(run_dir: Path, before: HydraSnapshot | None) -> Iterator[None]:
    """An attempt refused inside this block (any exception) leaves RUN_DIR/.hydra/ as it was before it."""
    try:
        yield
    except BaseException:
        if before is not None and before.run_dir.resolve() == run_dir.resolve():
            before.restore()
        raise


def check_writable(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be created or written (None when it can), without creating anything."""
    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


# ---- the pinned config --------------------------------------------------------------------------
def flatten(prefix: str, value, out: dict) -> None:
    """`value`'s leaves into `out` under dotted keys that start with `prefix`."""
    if isinstance(value, dict):
        for key, sub in value.items():
            flatten(f"{prefix}.{key}", sub, out)
    else:
        out[prefix] = value


def job_config(recorded: Mapping) -> dict:
    """A job's composed config as records keep it (`recorded`: a typed Config's, or `redaction.recorded` of the
    config Hydra holds: resolved, each secret as written or hashed, Hydra's part left out), as dotted keys less those
    that only say how to start: what a finished sweep job is compared by when its sweep runs again."""
    flat: dict = {}
    for key, value in recorded.items():
        flatten(str(key), value, flat)
    # with trainer.epochs the steps follow from it and the data (both compared): the sweep's record holds the
    # max_steps it replaced, the job's typed config the steps it gives
    derived = ("trainer.max_steps",) if flat.get("trainer.epochs") is not None else ()
    return {k: v for k, v in flat.items() if k not in RUN_CONTROL_KEYS and k not in derived}


def _composed_value(composed: dict, key: str):
    """The value at dotted `key` of a composed config (plain values), None where it has none."""
    value: Any = composed
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def fingerprint(config: Config) -> dict:
    """The resolved value of every fingerprinted key of the composed config, flattened to dotted keys, and the
    number of ranks (`world_size`: each rank samples its own share of a step)."""
    out: dict = {"world_size": ranks(config)}
    for key in FINGERPRINT_KEYS:
        flatten(key, _composed_value(dict(config.recorded or config.composed), key), out)  # secrets as written
    return {k: v for k, v in out.items() if fingerprinted(k)}


def fingerprinted(key: str) -> bool:
    """Whether this release counts `key` as deciding a step (FINGERPRINT_KEYS, but NOT_FINGERPRINTED; world_size)."""
    return key == "world_size" or (any(_under(key, k) for k in FINGERPRINT_KEYS)
                                   and not any(_under(key, skip) for skip in NOT_FINGERPRINTED))


def changed_keys(saved: dict, current: dict) -> list[str]:
    """Keys whose value differs. A key that `saved` lacks and that now holds its declared default is not a change:
    grpo-cli gained the option after `saved` was written, and the older version behaved as that default. A key that
    `saved` holds and this release no longer fingerprints (trainer.logprob_chunk_size, found to change rounding at
    most) is not compared."""
    keys = {k for k in saved if fingerprinted(k)} | current.keys()
    return sorted(k for k in keys if saved.get(k, "<unset>") != current.get(k, "<unset>")
                  and not (k not in saved and current[k] == default_of(k)))


def _shown(value) -> str:
    return "unset" if value == "<unset>" else json.dumps(value)


def saved_fingerprint(found: Path) -> dict:
    """The fingerprint a checkpoint was written with (checkpoint.damage checks that it has one)."""
    return json.loads((found / "state.json").read_text())["fingerprint"]


def check_fingerprint(config: Config, found: Path) -> None:
    """Refuse a resume whose config differs from the checkpoint's in a key that is not allowed to change."""
    saved = saved_fingerprint(found)
    allowed = list(config.trainer.resume_allow_changes)
    current = fingerprint(config)
    for key in allowed:
        if not any(_under(k, key) for k in current.keys() | saved.keys()):
            raise RunDirError(f"trainer.resume_allow_changes names {key}, which is not a key that decides a step; "
                              f"name keys under {', '.join(FINGERPRINT_KEYS)}, or world_size")
    changes = changed_keys(saved, current)
    never = [k for k in changes if any(_under(k, n) for n in NEVER_CHANGED)]
    if never:
        described = describe_changes(never, saved, current)
        raise RunDirError(f"resume from {found} with {described}: the saved adapter and optimizer "
                          "state only fit the run's own value, even with trainer.resume_allow_changes; start a new run "
                          "in another hydra.run.dir")
    refused = [k for k in changes if not any(_under(k, a) for a in allowed)]
    if refused:
        listed = ",".join(refused)
        described = describe_changes(refused, saved, current)
        raise RunDirError(f"resume from {found} with a changed config: {described}; resume with "
                          f"the run's values for an exact resume, or allow the change on purpose with "
                          f"trainer.resume_allow_changes=[{listed}]")


def describe_changes(keys: list[str], saved: dict, current: dict) -> str:
    """`key old -> new` for each key; a secret's key alone (`key (a secret: its value is not shown)`)."""
    return ", ".join(f"{k} (a secret: its value is not shown)" if _secret(k, saved, current) else
                     f"{k} {_shown(saved.get(k, '<unset>'))} -> {_shown(current.get(k, '<unset>'))}" for k in keys)


def _secret(key: str, saved: dict, current: dict) -> bool:
    """Whether a fingerprinted key holds a credential (grpo_cli.base.redaction): by its name, or recorded as written
    (an environment interpolation) or hashed."""
    return (any(is_secret_key(part) for part in key.split("."))
            or any(is_recorded_secret(side.get(key)) for side in (saved, current)))


# ---- records ------------------------------------------------------------------------------------
def redact_hydra_records(run_dir: Path) -> None:
    """Hydra wrote the command line's overrides and the config as given into RUN_DIR/.hydra/: a credential typed
    there in clear (grpo_cli.base.redaction) is blanked out of them."""
    for path in sorted((run_dir / ".hydra").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if redact(text) != text:
            replace_text(path, redact(text))


def _rows_before(lines: list[str], step: int) -> list[str]:
    """The lines of steps before `step`; an unreadable line (a write cut by a kill) ends the file."""
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            break
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
            kept.append(line)
    return kept


def roll_back_records(run_dir: Path, step: int, found: Path) -> None:
    """Cut every append-only record back to the steps before `step` (the checkpoint's). A record the run
    dir lacks is taken from the checkpoint's copy (resuming another dir's checkpoint)."""
    for name in RECORDS:
        source = run_dir / name if (run_dir / name).is_file() else found / name
        if not source.is_file():
            continue
        lines = source.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        kept = _rows_before(lines, step)
        if source.parent == run_dir and kept == lines:
            continue
        replace_text(run_dir / name, "".join(line if line.endswith("\n") else line + "\n" for line in kept))


# ---- the resume decision -------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeDecision:
    """What an attempt does with its run dir: resume from `checkpoint` (None: start at step 0), `overwrite` the
    old run's records first, the lines to show at startup (`warnings`), and for a sweep job the line that says
    which it does (`line`, without the job's name); a sweep job that `finished` before with the same config is
    skipped (nothing claimed)."""

    checkpoint: Path | None = None
    overwrite: bool = False
    warnings: tuple[str, ...] = ()
    line: str = ""
    finished: bool = False

    @property
    def action(self) -> str:
        if self.finished:
            return "skip"
        return "resume" if self.checkpoint is not None else "restart" if self.overwrite else "fresh"


def commanded(config: Config) -> bool:
    """trainer.overwrite=true or a trainer.resume path decides alone, in a sweep job too; trainer.resume=auto is
    what a sweep job does anyway."""
    return config.trainer.overwrite or config.trainer.resume not in (None, "auto")


def decide_resume(config: Config, run_dir: Path, *, sweep_job: bool = False,
                  previous: dict | None = None) -> ResumeDecision:
    """The one decision of what to resume (raises RunDirError or CheckpointError, nothing written, when the dir
    cannot take this attempt). A sweep job run again (`previous`: the record of its earlier attempt, kept by the
    sweep) is skipped when it finished with the same config, resumes its newest intact checkpoint when it did not
    finish and that was written with the same config, and else starts over; trainer.overwrite=true or a
    trainer.resume path decide alone, in a sweep job too; a single run does what those two say."""
    if sweep_job and not commanded(config):
        return _sweep_job_decision(config, run_dir, previous or {})
    resume, overwrite = config.trainer.resume, config.trainer.overwrite
    records = holds_run(run_dir)
    if resume and overwrite:
        raise RunDirError(f"trainer.overwrite=true starts over and trainer.resume={resume} goes on; pick one")
    if resume is None:
        if records and not overwrite:
            raise RunDirError(f"run dir {run_dir} holds a run already ({', '.join(records)}); go on with "
                              "trainer.resume=auto, start over with trainer.overwrite=true (deletes its records and "
                              "checkpoints), or pick another hydra.run.dir")
        return ResumeDecision(overwrite=overwrite)
    found, warnings = (_newest_to_resume(run_dir, records) if str(resume) == "auto"
                       else (_named_checkpoint(run_dir, str(resume), records), ()))
    if found is not None:
        check_fingerprint(config, found)
    return ResumeDecision(found, warnings=warnings)


def _newest_to_resume(run_dir: Path, records: list[str]) -> tuple[Path | None, tuple[str, ...]]:
    """trainer.resume=auto: the newest intact checkpoint, and a line per damaged one skipped."""
    from grpo_cli.run import checkpoint  # torch: only once the config is known good

    found, skipped = checkpoint.newest_intact(run_dir)
    warnings = tuple(f"checkpoint {path} is damaged ({why}); skipped" for path, why in skipped)
    if found is not None:
        return found, warnings
    nothing = f"trainer.resume=auto: nothing to resume in {run_dir}" + (
        f" (no intact checkpoint: {'; '.join(f'{p.name}: {why}' for p, why in skipped)})" if skipped else "")
    if records:
        raise RunDirError(f"{nothing}, and it holds a run already ({', '.join(records)}); start over with "
                          "trainer.overwrite=true instead of trainer.resume, or pick another hydra.run.dir")
    return None, (*warnings, f"{nothing}; starting a new run")


def _named_checkpoint(run_dir: Path, resume: str, records: list[str]) -> Path:
    """trainer.resume=PATH: that checkpoint (or a run dir's newest), intact, and the dir's own when it holds a run."""
    from grpo_cli.run import checkpoint

    found = checkpoint.find(run_dir, resume)
    assert found is not None  # None only for resume=auto, which _newest_to_resume takes
    why = checkpoint.damage(found)
    if why is not None:
        raise CheckpointError(f"trainer.resume={resume}: checkpoint {found} is damaged ({why}); resume from an "
                              "intact one, e.g. trainer.resume=auto for the newest")
    if records and found.resolve().parent != checkpoint.checkpoint_root(run_dir).resolve():
        raise RunDirError(f"run dir {run_dir} holds a run already ({', '.join(records)}), and trainer.resume={resume} "
                          "is another run's checkpoint; resume it into a new hydra.run.dir")
    return found


def _sweep_job_decision(config: Config, job_dir: Path, previous: dict) -> ResumeDecision:
    """A sweep job that finished before (`previous`, with its adapter saved): skipped when its composed config is the
    same, else started over. One whose dir holds an unfinished attempt: resumed when its newest intact checkpoint
    has this config's fingerprint, else started over."""
    if previous.get("status") == "ok" and "config" in previous and (job_dir / ADAPTER_DIR).is_dir():
        current = job_config(config.recorded)
        changes = changed_keys(previous["config"], current)
        if not changes:
            return ResumeDecision(finished=True, line="finished before with the same config; skipped")
        return ResumeDecision(overwrite=True, line=f"finished before with another config "
                                                   f"({describe_changes(changes, previous['config'], current)}); "
                                                   "starting it over")
    if not holds_run(job_dir):
        return ResumeDecision()
    from grpo_cli.run import checkpoint

    found, skipped = checkpoint.newest_intact(job_dir)
    warnings = tuple(f"checkpoint {path} is damaged ({why}); skipped" for path, why in skipped)
    if found is None:
        return ResumeDecision(overwrite=True, line="did not finish and has no intact checkpoint; starting it over")
    saved, current = saved_fingerprint(found), fingerprint(config)
    changes = changed_keys(saved, current)
    if changes:
        return ResumeDecision(overwrite=True, line=f"did not finish, and its checkpoint {found} was written with "
                                                   f"another config ({describe_changes(changes, saved, current)}); "
                                                   "starting it over")
    return ResumeDecision(found, warnings=warnings, line=f"did not finish; resuming it from {found}")


# ---- the claim ----------------------------------------------------------------------------------
@dataclass
class Claim:
    """An attempt's hold on its run dir: what it resumes (`decision`) and the lock (rank 0 only)."""

    decision: ResumeDecision
    lock: RunLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def holds_run(run_dir: Path) -> list[str]:
    """The records of a run found in `run_dir` (empty: it holds none)."""
    return [name for name in RUN_MARKERS if (run_dir / name).exists()]


def claim(config: Config, run_dir: Path, main: bool = True, decision: ResumeDecision | None = None) -> Claim:
    """Take `run_dir` for this attempt and act on `decision` (decide_resume's, made here when not given): raise
    RunDirError (nothing written) when the dir cannot take it. Rank 0 (`main`) takes the lock first, and alone
    writes: removes orphaned checkpoint writes, and when the decision starts over, the old run's records. The
    other ranks only read the same decision."""
    from grpo_cli.run import checkpoint  # torch: only once the config is known good

    lock = RunLock.acquire(run_dir) if main else None
    try:
        decision = decide_resume(config, run_dir) if decision is None else decision
        if main:
            checkpoint.remove_orphans(run_dir)
            if decision.overwrite and holds_run(run_dir):
                remove_run(run_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Claim(decision, lock)


def remove_run(run_dir: Path) -> None:
    """Delete what a training run left in `run_dir` (its records, checkpoints, adapter, logger state)."""
    for path in (run_dir / name for name in RUN_OUTPUTS):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
