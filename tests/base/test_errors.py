"""The one route for errors (errors.one_line) and the one channel for warnings (errors.warn)."""

from __future__ import annotations

import pytest

from grpo_cli.base.errors import ConfigError, RewardError, one_line, warn
from grpo_cli.tracking import NullSink, Tracker


@pytest.mark.parametrize("err, code", [(ConfigError("a.b=1 is invalid: needs a > 1"), 2), (RewardError("boom"), 1)])
def test_one_line_is_the_message_and_the_exit_code(capsys, err, code):
    with pytest.raises(SystemExit) as stop, one_line("grpo-x"):
        raise err
    assert stop.value.code == code
    assert capsys.readouterr().err.splitlines() == [f"grpo-x: {err}"]


def test_one_line_in_a_sweep_job_hands_the_line_to_hydra(capsys):
    with pytest.raises(RuntimeError, match=r"^grpo-x: a.b=1 is invalid$"), one_line("grpo-x", in_sweep=True):
        raise ConfigError("a.b=1 is invalid")
    assert capsys.readouterr().err == ""


def test_one_line_leaves_other_exceptions_alone():
    with pytest.raises(KeyError), one_line("grpo-x"):
        raise KeyError("a bug keeps its traceback")


class Shown(NullSink):
    def __init__(self):
        self.texts = []

    def warn(self, text):
        self.texts.append(text)


def test_warnings_go_to_the_open_tracker_else_stderr_each_once(capsys):
    with pytest.raises(SystemExit), one_line("grpo-x"):  # the entry point names the program
        raise ConfigError("x")
    capsys.readouterr()
    warn("before the run")
    warn("before the run")
    sink = Shown()
    tracker = Tracker([sink])
    warn("during the run")
    tracker.warn("during the run")
    tracker.warn("before the run")  # a new audience sees it once too
    tracker.close({})
    warn("after the run")
    assert sink.texts == ["during the run", "before the run"]
    assert capsys.readouterr().err.splitlines() == ["grpo-x: warning: before the run", "grpo-x: warning: after the run"]


def test_a_tracker_without_sinks_drops_everything(capsys):
    tracker = Tracker([])
    tracker.log({"step": 0})
    tracker.samples(0, [{"completion": "x"}])
    warn("only rank 0 shows warnings")
    tracker.close({"steps": 1})
    assert capsys.readouterr() == ("", "")
