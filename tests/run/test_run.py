"""The run object (grpo_cli.run.runner): a stop before the first step leaves the dir unused, a resume after the last
step says so, and the one resume decision is a value that leaves the config as composed."""

from __future__ import annotations

import shlex
import signal
import sys

import pytest
from conftest import TINY_TRAINER
from omegaconf import OmegaConf

from grpo_cli.base.errors import Interrupted
from grpo_cli.config.schema import Config, LoggerConfig
from grpo_cli.run import rundir


@pytest.mark.slow  # the tiny model loads, then one training step
def test_a_stop_while_the_model_loads_leaves_the_dir_as_if_the_run_never_started(compose, tmp_path):
    from grpo_cli.base.stopping import StopRequest
    from grpo_cli.run.runner import train
    from grpo_cli.step.evaluate import Evaluator

    cfg = Config.of(compose([*TINY_TRAINER, "trainer.max_steps=1", "trainer.log_samples_every=0",
                             "eval.num_prompts=2", "eval.max_new_tokens=4"]))
    stop = StopRequest(announce=False)

    def make_evaluator(lm):  # called once the model has loaded, while the run builds its trainer
        stop.request(signal.SIGTERM)
        return Evaluator.for_training(cfg, lm)

    with pytest.raises(Interrupted) as stopped:
        train(cfg, tmp_path, stop=stop, make_evaluator=make_evaluator, final_eval=True)
    assert stopped.value.checkpoint_dir is None and stopped.value.completed == 0
    assert rundir.holds_run(tmp_path) == [] and not (tmp_path / "checkpoints").exists()
    summary = train(cfg, tmp_path)  # the same command again is not refused as a used dir
    assert summary["steps"] == 1


def test_the_stop_line_before_the_first_step_says_to_run_the_same_command(tmp_path, capsys):
    from grpo_cli.commands.cli import _stopped

    with pytest.raises(SystemExit) as exited:
        _stopped("grpo-train", Interrupted(signal.SIGTERM, None, completed=0), tmp_path)
    assert exited.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ("grpo-train: stopped by SIGTERM before the first step; the run dir holds "
                                       "nothing of this run; run the same command again\n")


def test_the_stop_line_gives_the_grpo_train_command_that_resumes_whole(tmp_path, capsys, monkeypatch):
    """`make quickstart` runs `.venv/bin/grpo-train +recipe=quickstart`: the line says which grpo-train command goes
    on (make takes no overrides), with the command's own overrides, never its trainer.overwrite, quoted for the
    shell, on one line."""
    from grpo_cli.commands.cli import _stopped

    run = tmp_path / "my runs" / "2026-12-04" / "10-00-00"
    monkeypatch.setattr(sys, "argv", [".venv/bin/grpo-train", "+recipe=quickstart", "trainer.overwrite=true",
                                      "hydra.run.dir=elsewhere", "algo.beta=0.1"])
    with pytest.raises(SystemExit):
        _stopped("grpo-train", Interrupted(signal.SIGINT, run / "checkpoints" / "step-000003", completed=3), run)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(
        f"; resume with: grpo-train +recipe=quickstart algo.beta=0.1 trainer.resume=auto 'hydra.run.dir={run}'\n")
    assert shlex.split(err.split("resume with: ")[1])[-1] == f"hydra.run.dir={run}"  # pasted, it names the dir


@pytest.mark.slow  # the tiny model loads, then one training step
def test_a_run_that_stops_gives_the_terminal_back_before_its_last_line(compose, tmp_path, monkeypatch, capsys):
    """On a terminal the live bar takes over stderr (rich redraws what is printed under it, folded at its width): a
    run that ends by a stop ends the bar first, so the stop line that follows is written as it is, one line."""
    from grpo_cli.base.stopping import StopRequest
    from grpo_cli.run.runner import train

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's console takes stdout for a terminal
    monkeypatch.setenv("COLUMNS", "40")
    cfg = compose([*TINY_TRAINER, "trainer.max_steps=3", "trainer.log_samples_every=0", "eval.every=1",
                   "eval.num_prompts=1", "eval.max_new_tokens=2"])
    stop = StopRequest(announce=False)

    def make_evaluator(lm):
        def evaluate(engine, stop):  # the evaluation after step 0 is where the stop request comes
            stop.request(signal.SIGTERM)
            return {"eval/accuracy": 0.0}
        return evaluate

    with pytest.raises(Interrupted):
        train(cfg, tmp_path, stop=stop, make_evaluator=make_evaluator)
    line = "grpo-train: stopped by SIGTERM; resume with: " + "x" * 100
    print(line, file=sys.stderr)
    assert line in capsys.readouterr().err.splitlines()


def test_the_run_dir_is_named_when_training_starts(tmp_path, capsys):
    from grpo_cli.tracking import open_tracker

    tracker = open_tracker(tmp_path, LoggerConfig(backend="none"), {}, total_steps=2)
    assert capsys.readouterr().out.startswith(f"training 2 steps in {tmp_path}; Ctrl-C stops")
    tracker.close({"steps": 2})


def test_resuming_after_the_last_step_names_no_step_beyond_it(tmp_path, capsys):
    """A stop during the final eval of a 2-step run checkpoints after step 2; its resume runs only the eval."""
    from grpo_cli.tracking import open_tracker

    tracker = open_tracker(tmp_path, LoggerConfig(backend="none"), {}, total_steps=2, start_step=2, resume=True)
    tracker.close({"steps": 2})
    out = capsys.readouterr().out
    assert "resuming after the last of 2 steps" in out and "step 3 of 2" not in out


def test_the_resume_decision_is_a_value_and_the_config_stays_as_composed(compose, tmp_path):
    cfg = compose([*TINY_TRAINER, "trainer.resume=auto"])
    before = OmegaConf.to_container(cfg)
    typed = Config.of(cfg)
    decision = rundir.decide_resume(typed, tmp_path)
    assert decision.checkpoint is None and not decision.overwrite and decision.action == "fresh"
    assert decision.warnings == (f"trainer.resume=auto: nothing to resume in {tmp_path}; starting a new run",)
    claim = rundir.claim(typed, tmp_path)
    claim.release()
    assert claim.decision == decision and OmegaConf.to_container(cfg) == before


@pytest.mark.slow  # the tiny model loads, then one training step
def test_a_program_trainer_beside_what_builds_one_is_refused_in_one_line(compose, tmp_path):
    """grpo_cli.run.train(cfg, dir, trainer, rows=...) would run the given trainer on its own rows: each collaborator
    that only a trainer the run builds takes is named in one line, before anything is written; the trainer's own
    stop request given again is no conflict, and the same trainer then trains."""
    from conftest import make_trainer

    from grpo_cli.base.errors import ConfigError
    from grpo_cli.base.metrics import METRICS
    from grpo_cli.run.runner import train

    trainer = make_trainer(compose, tmp_path, "rollout.max_new_tokens=2", "data.prompts_per_step=2",
                           "algo.num_generations=2", "trainer.max_steps=1", "trainer.save_every=0",
                           "trainer.log_samples_every=0", "eval.final=false")
    with pytest.raises(ConfigError) as refused:
        train(trainer.cfg, tmp_path, trainer, rows=[{"prompt": "2+2?", "answer": "4"}], final_eval=True)
    line = str(refused.value)
    assert "\n" not in line and "rows=, final_eval=" in line and "GRPOTrainer(" in line, line
    assert not (tmp_path / METRICS).exists()
    with pytest.raises(ConfigError, match=r"stop="):
        train(trainer.cfg, tmp_path, trainer, stop=type(trainer.stop)())
    assert train(trainer.cfg, tmp_path, trainer, stop=trainer.stop)["steps"] == 1
