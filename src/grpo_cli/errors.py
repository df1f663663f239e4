"""Errors whose message is a complete one-line explanation for the user: what, the value, the fix.

The CLI prints them without a traceback. Kept free of heavy imports so a bad config fails fast.
"""

import re


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


class RewardError(RunError):
    """A reward function raised or returned a non-finite or misshapen score."""


class InvariantError(RunError):
    """A live invariant check failed; the message names the invariant and the step."""


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; the run stopped at a safe point after `completed` complete steps, with the
    checkpoint of that state (None where nothing is saved, e.g. grpo-eval); `discarded`: an unfinished step
    was thrown away."""

    def __init__(self, signum: int, checkpoint_dir=None, completed: int | None = None, discarded: bool = False):
        super().__init__(f"signal {signum}")
        self.signum, self.checkpoint_dir = signum, checkpoint_dir
        self.completed, self.discarded = completed, discarded


def error_line(err: BaseException) -> str:
    """One line that says what went wrong; `grpo-train: ...` messages from cli._fail are kept as they are."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if re.match(r"grpo-[a-z]+: ", text):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
