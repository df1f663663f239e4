"""The console: one plain line per step off a terminal, a live progress bar and a summary table on one."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess

import pytest
from conftest import read_jsonl, script
from rich.console import Console

from grpo_cli.tracking import ConsoleView

ROWS = [{"step": s, "reward": 0.25 * s, "kl": 0.001 * s, "clip_fraction": 0.01 * s, "gen_tokens_per_s": 100.0 + s,
         "step_time_s": 0.5} for s in range(3)]
SUMMARY = {"steps": 3, "first_reward": 0.0, "last_reward": 0.5, "final_reward": 0.5, "time_s": 75.25,
           "adapter": "/runs/x/adapter"}


# a capable terminal, whatever TERM and NO_COLOR the suite runs under (TERM=dumb in CI systems and editors' shells)
TERMINAL = {"TERM": "xterm-256color"}


def _view(terminal: bool, environ: dict | None = None) -> tuple[ConsoleView, io.StringIO]:
    out = io.StringIO()
    return ConsoleView(3, 0, Console(file=out, force_terminal=terminal, width=120, _environ=environ or TERMINAL)), out


def test_plain_lines_off_a_terminal():
    view, out = _view(terminal=False)
    assert not view.live
    for row in ROWS:
        view.log(row)
    view.warn("something [odd] happened")
    view.close({**SUMMARY, "W&B": "wandb sync /runs/x/wandb/offline-run-1"})
    text = out.getvalue()
    lines = text.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[:4] for line in steps] == [["step", str(s), "done", f"({s + 1}/3)"] for s in range(3)]
    assert "reward 0.500 kl 0.0020 clip 0.020 102 tok/s" in steps[2] and "eta 0:00" in steps[2]
    assert "warning: something [odd] happened" in text  # markup-looking text is printed as is
    assert "\x1b[" not in text and "\r" not in text
    for expected in ("reward, first 3 steps", "reward, last 3 steps", "1:15", "/runs/x/adapter", "wandb sync"):
        assert expected in text


def test_the_summary_names_the_steps_its_rewards_average():
    """A run of fewer than 10 steps averages all of them: its labels say how many, not 10."""
    assert [ConsoleView.label("first_reward", {"steps": n}) for n in (40, 10, 6, 1)] == [
        "reward, first 10 steps", "reward, first 10 steps", "reward, first 6 steps", "reward, first 1 step"]
    assert ConsoleView.label("last_reward", {"steps": 40}) == "reward, last 10 steps"
    assert ConsoleView.label("final_reward", {"steps": 3}) == "final reward (last 10%)"
    assert ConsoleView.label("W&B", {"steps": 3}) == "W&B"


def test_a_dumb_terminal_gets_plain_lines():
    """TERM=dumb cannot redraw in place: the plain lines of a pipe, not a bar drawn over and over."""
    view, out = _view(terminal=True, environ={"TERM": "dumb"})
    assert not view.live
    view.log(ROWS[0])
    view.close(SUMMARY)
    assert out.getvalue().startswith("step 0 done (1/3)") and "\r" not in out.getvalue()


def test_live_progress_on_a_terminal():
    view, out = _view(terminal=True)
    assert view.live
    for row in ROWS:
        view.log(row)
    view.close(SUMMARY)
    text = out.getvalue()
    assert "\x1b[" in text  # redrawn in place
    assert "3/3 done" in text and "reward 0.500" in text and "tok/s" in text and "eta" in text
    assert "/runs/x/adapter" in text and view.progress is None


@pytest.mark.parametrize("terminal", [True, False])
def test_an_eta_shows_while_steps_take_longer_than_30_s(terminal):
    """Steps of 40 s each: after the first of three, 80 s are left. Rich's own remaining-time column estimates a
    speed from the last 30 s only and showed `-:--:--` the whole run."""
    now = [1000.0]
    out = io.StringIO()
    view = ConsoleView(3, 0, Console(file=out, force_terminal=terminal, width=120, _environ=TERMINAL),
                       clock=lambda: now[0])
    now[0] += 40
    view.log(ROWS[0])
    if terminal:
        view.progress.refresh()
        assert "1/3 done" in out.getvalue() and "eta 1:20" in out.getvalue()
        now[0] += 30  # counting down between steps
        view.progress.refresh()
        assert "eta 0:50" in out.getvalue()
        view.close(SUMMARY)
    else:
        assert out.getvalue().splitlines()[-1].endswith("0.5s  eta 1:20")


def test_a_step_is_named_as_metrics_jsonl_names_it():
    """The console's `step N` is metrics.jsonl's `step`: a run resumed after 2 of 4 steps logs step 2 as `step 2`."""
    out = io.StringIO()
    view = ConsoleView(4, 2, Console(file=out, force_terminal=False, width=120))
    view.log({**ROWS[0], "step": 2})
    assert out.getvalue().startswith("step 2 done (3/4)  reward")


@pytest.mark.slow
def test_live_path_of_the_real_cli_under_a_pty(tmp_path):
    """grpo-train on a (pseudo) terminal with logger=wandb offline: the live bar and W&B get along."""
    if shutil.which("script") is None:
        pytest.skip("util-linux `script` is not installed")
    run_dir = tmp_path / "run"
    cmd = shlex.join([script("grpo-train"), "+recipe=quickstart", "model=tiny", "trainer.max_steps=2",
                      "rollout.max_new_tokens=4", "logger=wandb", "logger.wandb.mode=offline",
                      f"hydra.run.dir={run_dir}"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TERM": "xterm-256color",
                "WANDB_CACHE_DIR": str(tmp_path / "wb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wb_data"),
                "WANDB_CONFIG_DIR": str(tmp_path / "wb_config")})
    proc = subprocess.run(["script", "-qec", cmd, "/dev/null"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert "\x1b[" in out and "2/2 done" in out and "eta" in out
    assert "adapter" in out and "wandb sync" in out
    assert "Traceback" not in out and "wandb:" not in out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
