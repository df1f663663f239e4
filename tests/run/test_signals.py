"""Each signal at each entry point keeps what the table in docs/usage.md says it keeps: SIGHUP (an ssh drop, a
closed terminal) as SIGTERM does in grpo-train, grpo-eval and a sweep; SIGINT/SIGTERM/SIGHUP in grpo-export, from
its first instruction; SIGTERM while a tool hangs with no deadline. The SIGINT and SIGTERM rows of grpo-train and
grpo-eval are in test_reliability.py, the sweep's SIGTERM row in test_sweep_resume.py."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import prewarmed
import pytest
from conftest import module_on_path, read_jsonl, resume_command, run_cli, script
from test_episodes import call
from test_episodes import script as scripted_row
from test_reliability import HUGE_EVAL, TINY_RUN, start, stderr_lines_after_signal, wait_for

ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_sighup_stops_grpo_train_at_a_safe_point_with_the_resume_line(tmp_path):
    run = tmp_path / "run"
    child = start([*TINY_RUN, "trainer.save_every=0", f"hydra.run.dir={run}"], tmp_path)
    wait_for(lambda: (run / "metrics.jsonl").exists(), child)
    lines, _ = stderr_lines_after_signal(child, signal.SIGHUP)
    assert child.returncode == 128 + signal.SIGHUP, lines
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert lines[-1][1].startswith(f"grpo-train: stopped by SIGHUP after {done} complete step(s)")
    assert lines[-1][1].endswith(f"checkpoint {run}/checkpoints/step-{done:06d}; resume with: "
                                 f"{resume_command([*TINY_RUN, 'trainer.save_every=0'], run)}")
    assert (run / "checkpoints" / f"step-{done:06d}" / "adapter" / "adapter_model.safetensors").is_file()


def hang_up_when(args: list[str], ready, cwd: Path) -> int:
    """Run `args` with a pseudo-terminal as its controlling terminal and its stdin/stdout/stderr, as an ssh session
    does; once `ready()` close the terminal's other end (the kernel hangs it up: SIGHUP, and every write to it fails
    from then on). Returns the exit status."""
    master, slave = pty.openpty()
    name = os.ttyname(slave)

    def own_terminal():
        os.setsid()
        os.close(os.open(name, os.O_RDWR))  # a session leader's first tty becomes its controlling terminal

    child = subprocess.Popen(args, cwd=cwd, env=ENV, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal)
    os.close(slave)
    deadline = time.time() + 300
    while not ready() and time.time() < deadline and child.poll() is None:
        if select.select([master], [], [], 0.05)[0]:
            try:
                os.read(master, 65536)  # keep the terminal drained
            except OSError:
                break
    os.close(master)
    return child.wait(timeout=300)


@pytest.mark.slow
def test_a_terminal_that_hangs_up_leaves_a_checkpoint_that_resumes(tmp_path):
    """The issue's case: the terminal goes away mid-run. The run checkpoints (the output it can no longer write
    goes nowhere instead of ending it), exits 129, and the same command with trainer.resume=auto finishes it."""
    run = tmp_path / "run"
    command = [script("grpo-train"), *TINY_RUN, "trainer.save_every=0", f"hydra.run.dir={run}"]
    assert hang_up_when(command, lambda: (run / "metrics.jsonl").exists(), tmp_path) == 128 + signal.SIGHUP
    checkpoints = sorted((run / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
    assert checkpoints and not (run / "adapter").exists()
    proc = run_cli([*TINY_RUN, "trainer.save_every=0", f"hydra.run.dir={run}", "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(6))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_grpo_eval_stops_on_sigterm_and_sighup_without_a_partial_result(tmp_path, signum):
    out = tmp_path / "eval"
    with open(tmp_path / "stdout.txt", "w") as stdout:
        child = prewarmed.popen([script("grpo-eval"), *HUGE_EVAL, f"hydra.run.dir={out}"], cwd=tmp_path, env=ENV,
                                 stdout=stdout, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "evaluating base on 2 held-out prompts" in (tmp_path / "stdout.txt").read_text(), child)
    time.sleep(1)  # generating for hours
    lines, _ = stderr_lines_after_signal(child, signum)
    assert child.returncode == 128 + signum, lines
    assert lines[-1][1] == (f"grpo-eval: stopped by {signal.Signals(signum).name} before it finished; eval.json was "
                            "not written; run the command again for the result")
    assert not (out / "eval.json").exists()


@pytest.fixture(scope="module")
def export_run(tmp_path_factory) -> Path:
    """A run dir with an adapter on a tiny base wide enough (512, 8 layers) that loading and merging it take a while."""
    from hydra import compose, initialize_config_dir
    from test_export import make_run

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=quickstart", "model=tiny", "trainer.device=cpu",
                                           "model.tiny.hidden_size=512", "model.tiny.num_layers=8"])
    return make_run(tmp_path_factory.mktemp("export") / "run", cfg)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_grpo_export_stops_in_one_line_and_leaves_nothing_partial(export_run, tmp_path, signum):
    out = tmp_path / "merged"
    child = prewarmed.popen([script("grpo-export"), str(export_run), str(out)], cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        if "[2/5]" in line:  # loading the base: the merge and the write are still to come
            child.send_signal(signum)
            break
    rest, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signum, err
    assert err.splitlines() == [f"grpo-export: stopped by {signal.Signals(signum).name}; {out} was not written "
                                "(nothing partial is left); run the same command again to export"]
    assert "done:" not in rest
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT_DIR nor its temporary sibling


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [0.5, 3.0])  # in the imports (the entry point's handler); in the export
def test_grpo_export_stops_in_one_line_from_its_first_seconds(export_run, tmp_path, seconds):
    """A fresh process (no prewarmed imports): in its first seconds grpo-export imports torch and transformers, then
    the model; SIGINT there gave a 25-75 line traceback. Now one line, whichever handler is in place: the entry
    point's (stopping.exits_at_once) or the export's own."""
    child = prewarmed.popen([script("grpo-export"), str(export_run), str(tmp_path / "out")], cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, fresh=True)
    time.sleep(seconds)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGINT, err
    [line] = err.splitlines()
    assert line in ("grpo-export: stopped by SIGINT while no work was under way: nothing is left half-written; run "
                    "the same command again", f"grpo-export: stopped by SIGINT; {tmp_path / 'out'} was not written "
                    "(nothing partial is left); run the same command again to export"), line
    assert not (tmp_path / "out").exists()


NAPS = '''
import pathlib
import time

CALLS = 0


def naps(x: int) -> int:
    """Answers at once for the first step's four calls, then hangs.

    Args:
        x: Anything.
    """
    global CALLS
    CALLS += 1
    if CALLS > 4:
        pathlib.Path("hanging").write_text("")
        time.sleep(60)
    return x
'''


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_tool_hangs_without_a_deadline(tmp_path_factory, tmp_path):
    """rollout.tool_timeout_s=null and a tool that hangs at step 1: SIGTERM printed its stopping line and the run went
    on waiting for the tool. Now the tool is abandoned, step 1 discarded and the state after step 0 checkpointed."""
    env = {**ENV, **module_on_path(tmp_path_factory, "napping", NAPS)}
    data, run = tmp_path / "rows.jsonl", tmp_path / "run"
    data.write_text(json.dumps({**scripted_row(call("naps", x=1), "Done."), "answer": "1"}) + "\n")
    args = ["+recipe=quickstart", "model=tiny", "plugins=[scripted_engine]", "rollout.engine=scripted",
            "rollout.tools=[napping.naps]", "rollout.tool_timeout_s=null", "rollout.max_new_tokens=48", "data=hf",
            f"data.path={data}", "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=3",
            "trainer.save_every=0", "trainer.device=cpu", f"hydra.run.dir={run}"]
    child = prewarmed.popen([script("grpo-train"), *args], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "hanging").exists(), child)
    lines, seconds = stderr_lines_after_signal(child, signal.SIGTERM)
    assert child.returncode == 128 + signal.SIGTERM, lines
    assert lines[-1][1] == (f"grpo-train: stopped by SIGTERM after 1 complete step(s); the unfinished step was "
                            f"discarded; checkpoint {run}/checkpoints/step-000001; resume with: "
                            f"{resume_command(args, run)}")
    assert seconds < 20, (lines, seconds)  # the tool would have slept 60 s
    assert not any("Traceback" in text for _, text in lines)


@pytest.mark.slow
def test_sighup_stops_a_sweep_like_sigterm(tmp_path):
    sweep_dir = tmp_path / "sweep"
    command = [script("grpo-train"), "-m", "+recipe=quickstart", "model=tiny", "trainer.max_steps=3",
               "rollout.max_new_tokens=4", "algo.num_generations=2", "data.prompts_per_step=2", "trainer.device=cpu",
               "trainer.seed=0,1", f"hydra.sweep.dir={sweep_dir}"]
    child = prewarmed.popen(command, cwd=tmp_path, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (sweep_dir / "0" / "metrics.jsonl").exists(), child)
    os.killpg(child.pid, signal.SIGHUP)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert "stopped by SIGHUP in job 0 (trainer.seed=0)" in err and "the sweep stops here" in err
    assert not (sweep_dir / "1").exists()
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"]) for r in rows] == [(0, "stopped")]
    assert list((sweep_dir / "0" / "checkpoints").iterdir())
