"""Errors whose message is a complete one-line explanation for the user: what, the value, the fix; the one
route they take out of a command, and the one channel for warnings.

    with one_line("grpo-report"):    # every entry point: a UserError is `grpo-report: message` on stderr, exit 2
        ...
    warn("text")                      # the console of the run being logged, else `PROG: warning: text` on stderr

Kept free of heavy imports so a bad config fails fast.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from grpo_cli.base.redaction import redact


class UserError(Exception):
    """Base: bad input from the user (exit code 2)."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A bad configuration value."""


class DataError(UserError, ValueError):
    """Bad data or data config."""


class ModelLoadError(UserError, RuntimeError):
    """A model or tokenizer could not be loaded."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written or read."""


class ReportError(UserError, ValueError):
    """grpo-report got a directory it cannot report on."""


class ExportError(UserError, ValueError):
    """grpo-export got a run, base or output directory it cannot export."""


class MetricsError(UserError, ValueError):
    """A metrics.jsonl line other than the last is not JSON (the file was edited or damaged)."""


class RunError(Exception):
    """The run itself failed (exit code 1): a reward that raised, a broken invariant, non-finite updates."""

    exit_code = 1


class UserCodeError(RunError):
    """User code (a reward, a tool, an environment) raised, exited or returned what it must not during the run; the
    message names the function or the class and method."""


class RewardError(UserCodeError):
    """A reward function raised or returned a non-finite or misshapen score."""


class WorkerError(RunError):
    """The rollout worker (rollout.placement=worker) ended, or its policy is not the trainer's after a weight sync;
    found before a step's update, so the run adds the checkpoint of the state after the last complete step."""


class InvariantError(RunError):
    """A live invariant check failed; the message names the invariant and the step."""


class OutOfMemory(RunError):
    """An allocation of a step's update failed; the message says how much was asked for and what to lower. Nothing
    of the step is saved (an update may have begun): the run adds the newest checkpoint on disk."""


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; the run stopped at a safe point after `completed` complete steps, with the
    checkpoint of that state (None where nothing is saved, e.g. grpo-eval); `discarded`: an unfinished step
    was thrown away."""

    def __init__(self, signum: int, checkpoint_dir=None, completed: int | None = None, discarded: bool = False):
        super().__init__(f"signal {signum}")
        self.signum, self.checkpoint_dir = signum, checkpoint_dir
        self.completed, self.discarded = completed, discarded


def error_line(err: BaseException) -> str:
    """The first line of an exception, with its type; `grpo-train: ...` lines from `one_line` are kept as they are."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if re.match(r"grpo-[a-z]+: ", text):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# a write that found no room, as libraries word it (safetensors: "File too large (os error 27)"; torch.save loses
# the errno and says only "file write failed")
_NO_ROOM_TEXT = re.compile(r"(No space left on device|Disk quota exceeded|File too large)( \(os error \d+\))?"
                           r"|file write failed")
_NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(err: BaseException | None) -> str | None:
    """Why `err`, or an exception it was raised from, is a write that found no room (a full disk, a quota, a
    file size limit); None when it is something else."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _NO_ROOM_ERRNOS:
            return os.strerror(err.errno)
        found = _NO_ROOM_TEXT.search(str(err))
        if found:
            return found.group(0)
        err = err.__cause__ or err.__context__
    return None


# ---- the one route out ---------------------------------------------------------------------------
_program: str | None = None


def program() -> str:
    """The command's name that prefixes its messages: the one its entry point gave `one_line`, else argv[0]'s."""
    return _program or (Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "grpo-cli")


def exit_with(err: UserError | RunError) -> NoReturn:
    """`PROG: message` on stderr, then exit 2 (bad input) or 1 (a failed run); never a traceback."""
    print(f"{program()}: {redact(str(err))}", file=sys.stderr, flush=True)  # a refusal names a secret's key only
    raise SystemExit(err.exit_code)


@contextmanager
def one_line(prog: str, *, in_sweep: bool = False) -> Iterator[None]:
    """The body of an entry point: a UserError or RunError raised inside ends the command through `exit_with`.
    In a sweep job (`in_sweep`) it is re-raised as that one line instead, for Hydra to record (the sweep goes on).
    When the body ends, warnings go to stderr again."""
    global _program
    _program = prog
    try:
        yield
    except Exception as err:
        if not isinstance(err, (UserError, RunError)):
            reason = no_room(err)
            if reason is None:
                raise
            err = RunError(f"a write found no room ({reason}); free disk space (or raise the quota or file size limit) "
                           "and run the same command again" + (", with trainer.resume=auto to go on from the newest "
                                                               "checkpoint" if prog == "grpo-train" else ""))
        if in_sweep:
            raise RuntimeError(redact(f"{prog}: {err}")) from None
        exit_with(err)
    finally:
        send_warnings_to(None)  # a run that raised left its Tracker open: the next job's warnings are not its


# ---- the one warnings channel --------------------------------------------------------------------
_listener: Callable[[str], None] | None = None
_shown: set[str] = set()


def warn(text: str) -> None:
    """Every warning of the package goes here, and each text is shown once: to the sinks of the run being logged
    (its console shows it among the steps) while a tracking.Tracker is open, else `PROG: warning: text` on stderr."""
    _once(redact(text), _listener, "warning: ")


def inform(text: str) -> None:
    """A line of information, not a warning (what a setting chose, which sandbox the programs run in), each text shown
    once: on the console of the run being logged while a tracking.Tracker is open, else `PROG: text` on stderr."""
    _once(text, _say, "")


def _once(text: str, route: Callable[[str], None] | None, label: str) -> None:
    """`text` to `route` (the open run's), else to stderr after the program's name and `label`; a text shown before
    is not shown again."""
    if text in _shown:
        return
    _shown.add(text)
    if route is not None:
        route(text)
    else:
        print(f"{program()}: {label}{text}", file=sys.stderr, flush=True)


_say: Callable[[str], None] | None = None


def send_warnings_to(listener: Callable[[str], None] | None, say: Callable[[str], None] | None = None) -> None:
    """The open run's Tracker takes the warnings (and with `say` the lines of information) from now on (None: stderr
    again); it sees each text once."""
    global _listener, _say
    _listener, _say = listener, say
    _shown.clear()


def warnings_listener() -> Callable[[str], None] | None:
    return _listener


def warnings_route() -> tuple:
    """Where warnings and lines of information go now, to put back with `route_warnings` (a sweep's jobs that share
    the process each keep their own: sweep.shared_base)."""
    return _listener, _say


def route_warnings(route: tuple) -> None:
    global _listener, _say
    _listener, _say = route
