"""Bad input gets one line and exit 2; a killed run resumes to the bitwise-same adapter; signals checkpoint,
also in the middle of generation."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import prewarmed
import pytest
import torch
from conftest import TRAINED_TINY, VARIED_REWARD, assert_learned, read_jsonl, resume_command, run_cli, script

from grpo_cli.base.errors import UserError
from grpo_cli.run.validate import validate


def with_pythonpath(folder) -> dict:
    """The environment entry that makes `folder` importable, ahead of (not instead of) the current PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


NO_GPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")

# (override, words the one-line message must contain): values that validate() refuses, checked in-process; the
# route from validate() to one line and exit 2 is the same for all of them, run for real once below
BAD_VALUES = [
    ("algo.num_generations=1", ["algo.num_generations=1", ">= 2"]),
    ("algo.beta=-0.5", ["algo.beta=-0.5", ">= 0"]),
    ("algo.clip_eps=0", ["algo.clip_eps=0", "0 < clip_eps < 1"]),
    ("algo.clip_eps_high=1.5", ["algo.clip_eps_high=1.5"]),
    ("algo.adv_eps=0", ["algo.adv_eps=0"]),
    ("algo.adv_eps=2", ["algo.adv_eps=2"]),
    ("rollout.max_new_tokens=0", ["rollout.max_new_tokens=0"]),
    ("rollout.min_new_tokens=99", ["rollout.min_new_tokens=99", "max_new_tokens"]),
    ("rollout.temperature=0", ["rollout.temperature=0"]),
    ("rollout.top_p=1.5", ["rollout.top_p=1.5"]),
    ("data.prompts_per_step=0", ["data.prompts_per_step=0"]),
    ("trainer.micro_batch_size=5", ["trainer.micro_batch_size=5", "32"]),
    ("algo.loss_type=ppo", ["algo.loss_type=ppo", "grpo, bnpo, dapo, dr_grpo"]),
    ("algo.scale_rewards=median", ["algo.scale_rewards=median", "group"]),
    ("algo.ratio_level=word", ["algo.ratio_level=word", "sequence"]),
    ("trainer.device=tpu", ["trainer.device=tpu", "auto"]),
    pytest.param("trainer.device=cuda", ["trainer.device=cuda", "no CUDA"], marks=NO_GPU_ONLY,
                 id="trainer.device=cuda"),
    ("optimizer.lr=0", ["optimizer.lr=0", "lr > 0"]),
    ("trainer.max_steps=0", ["trainer.max_steps=0"]),
    ("+reward.functions.mine._target_=nowhere.fn", ["reward.functions.mine._target_=nowhere.fn", "cannot be imported"]),
    ("data.path=/no/such/file.jsonl", ["data.path=/no/such/file.jsonl", "no such file"]),
    ("trainer.resume=/no/such/checkpoint", ["trainer.resume=/no/such/checkpoint"]),
    ("reward.on_error=ignore", ["reward.on_error=ignore", "zero"]),
    ("algo.beta=${oops}", ["algo.beta=${oops}", "does not resolve", "'oops' not found"]),
    ("eval.max_new_tokens=${rollout.nope}", ["eval.max_new_tokens=${rollout.nope}", "does not resolve"]),
]


def cases(table):
    return [pytest.param(*b, id=b[0]) if type(b) is tuple else b for b in table]


@pytest.mark.parametrize("override,words", cases(BAD_VALUES))
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_bad_value_is_one_line_naming_key_value_and_what_is_allowed(compose, override, words):
    with pytest.raises(UserError) as err:
        validate(compose(["+recipe=quickstart", "model=tiny", override]))
    line = str(err.value)
    assert "\n" not in line
    for word in words:
        assert word in line, line


# the real grpo-train, one case per way a bad invocation is caught: a value validate() refuses, an unknown group
# option and an unknown key (Hydra's compose), a limit that needs the model's context, an unresolvable value
BAD_INVOCATIONS = [
    ("algo.num_generations=1", ["algo.num_generations=1", ">= 2"]),
    ("model=nope", ["model/nope", "smollm2-135m"]),
    ("algo.betta=0.1", ["algo.betta"]),
    # limits: the tiny model's context is 1024 tokens; data.max_prompt_tokens is 256
    ("rollout.max_new_tokens=900", ["rollout.max_new_tokens=900", "1156 tokens", "1024-token context",
                                    "rollout.max_new_tokens<=768"]),
    ("data.max_prompt_tokens=2000", ["rollout.max_new_tokens=8", "lower data.max_prompt_tokens below 1024"]),
    ("algo.beta=${oops}", ["algo.beta=${oops}", "does not resolve", "'oops' not found"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("override,words", cases(BAD_INVOCATIONS))
def test_bad_invocation_is_one_line_exit_2(tmp_path, override, words):
    proc = run_cli(["+recipe=quickstart", "model=tiny", override], tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("grpo-train: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


@pytest.mark.slow  # a grpo-train subprocess
def test_prompts_per_step_over_nproc_is_refused_before_torchrun(tmp_path):
    t0 = time.time()
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.nproc=3", "data.prompts_per_step=4"], tmp_path,
                   timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: data.prompts_per_step=4 is invalid: must divide over the 3 ranks (each takes whole prompt "
        "groups); use a multiple of 3, e.g. data.prompts_per_step=3"]
    assert "torch.distributed" not in proc.stdout + proc.stderr and time.time() - t0 < 60
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow  # a grpo-train subprocess
def test_prompts_per_step_over_world_size_inside_torchrun(tmp_path):
    """What every rank of `torchrun --nproc_per_node=2` sees: WORLD_SIZE=2; refused before the process group."""
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data.prompts_per_step=3"], tmp_path, timeout=120,
                   env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    refused = "grpo-train: data.prompts_per_step=3 is invalid: must divide over the 2 ranks"
    assert len(lines) == 1 and lines[0].startswith(refused), lines


def test_unknown_recipe_exit_2(tmp_path):
    proc = run_cli(["+recipe=nope"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_data_row_missing_field_names_file_line_and_the_accepted_forms(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n\n{"question": "What is 2 + 1?", "answer": "3"}\n')
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=jsonl", f"data.path={data}"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpo-train: {data}:3 lacks a prompt; every row needs "), lines
    assert '"prompt" (text, or a list of chat messages) or "messages" (a list of chat messages)' in lines[0]


@pytest.mark.slow
def test_jsonl_chat_forms_train(tmp_path):
    """The three prompt forms TRL accepts, mixed in one file, train; the chat ones keep their own system turn."""
    data = tmp_path / "chat.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "answer": "2"}\n'
        '{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}\n'
        '{"messages": [{"role": "system", "content": "You add numbers."}, '
        '{"role": "user", "content": "What is 3 + 3?"}], "answer": "6"}\n')
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data.source=jsonl", f"data.path={data}",
                    "data.prompts_per_step=3", "algo.num_generations=2", "rollout.max_new_tokens=3",
                    "trainer.max_steps=1", "trainer.log_samples_every=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prompts = {s["prompt"] for s in read_jsonl(run / "samples.jsonl")}
    assert len(prompts) == 3
    for question in ("What is 1 + 1? Answer with just the number.", "What is 2 + 2? Answer with just the number.",
                     "What is 3 + 3? Answer with just the number."):
        assert sum(question in p for p in prompts) == 1, (question, prompts)
    assert sum("You add numbers." in p for p in prompts) == 1


@pytest.mark.slow
def test_reward_returning_strings_is_refused(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def wordy(prompts, completions, **_):\n    return ['1.0' for _ in completions]\n")
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=3", "data.prompts_per_step=2",
                    "algo.num_generations=2", "reward.on_error=zero",
                    "+reward.functions.wordy._target_=my_rewards.wordy"], tmp_path,
                   env=with_pythonpath(tmp_path))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["grpo-train: reward wordy returned str '1.0' for completion 0; it must return a number per "
                     "completion (int, float, bool, or a numpy/torch scalar)"], lines
    assert not list(tmp_path.rglob("adapter"))


@pytest.mark.slow
def test_reward_that_raises_names_function_and_completion(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def flaky(prompts, completions, **_):\n"
        "    return [1 / 0 if 'What is 3 +' in p else 0.0 for p in prompts]\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(1, 5)))
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=3", "data.source=jsonl",
                    f"data.path={rows}", "+reward.functions.flaky._target_=my_rewards.flaky"], tmp_path,
                   env=with_pythonpath(tmp_path))
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("grpo-train: reward flaky raised ZeroDivisionError on completion ")
    assert "reward.on_error=zero" in line
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("adapter"))


@pytest.mark.slow
def test_reward_on_error_zero_counts_errors(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def broken(prompts, completions, **_):\n    raise RuntimeError('down')\n")
    run = tmp_path / "run"
    proc = run_cli([*TINY_RUN, "trainer.max_steps=1", "trainer.save_every=0", "reward.on_error=zero",
                    "+reward.functions.broken._target_=my_rewards.broken", f"hydra.run.dir={run}"], tmp_path,
                   env=with_pythonpath(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_jsonl(run / "metrics.jsonl")[0]["reward_errors"] == 8


TINY_RUN = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
            "algo.num_generations=4", "trainer.max_steps=6", "trainer.save_every=2", "trainer.log_samples_every=0"]


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_identical(trained_tiny_run, tmp_path):
    """The shared run is the straight one: the same command, killed after its step-2 checkpoint and resumed, ends
    with the same adapter bytes and rewards."""
    straight, crashed = trained_tiny_run, tmp_path / "crashed"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    child = prewarmed.popen([script("grpo-train"), *TRAINED_TINY, f"hydra.run.dir={crashed}"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = crashed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(read_jsonl(metrics)) < 3):
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)  # mid step 4: after the step-2 checkpoint, before step-4's
    child.wait()
    assert (crashed / "checkpoints").is_dir() and not (crashed / "adapter").exists()

    proc = run_cli([*TRAINED_TINY, f"hydra.run.dir={crashed}", "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == list(range(6))
    assert_learned(straight)
    a = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (crashed / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b
    rewards = [r["reward"] for r in read_jsonl(straight / "metrics.jsonl")]
    assert rewards == [r["reward"] for r in read_jsonl(crashed / "metrics.jsonl")]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_143(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    child = prewarmed.popen([script("grpo-train"), *TINY_RUN, "trainer.save_every=0", f"hydra.run.dir={run}"],
                             cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 143, err
    assert "trainer.resume=auto" in err.strip().splitlines()[-1]
    assert list((run / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))


@pytest.mark.slow
def test_crafted_pickle_in_checkpoint_is_refused(trained_tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_tiny_run, run)
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    sentinel = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    import pickle

    from grpo_cli.run.checkpoint import damage, write_manifest

    (ckpt / "trainer_state.pt").write_bytes(pickle.dumps({"optimizer": Payload()}))
    write_manifest(ckpt)  # the file matches its manifest: only the weights-only loader stands in the way
    assert "trainer_state.pt was refused" in damage(ckpt)  # resume=auto skips it, naming why, for an older one
    proc = run_cli([*TRAINED_TINY, "trainer.max_steps=8", f"hydra.run.dir={run}", f"trainer.resume={ckpt}",
                    "trainer.resume_allow_changes=[trainer.max_steps]"], tmp_path)
    assert proc.returncode == 2
    assert "refused" in proc.stderr.strip().splitlines()[-1]
    assert not sentinel.exists()


# ---- stopping in the middle of generation -----------------------------------------------------------------------
def start(args: list[str], cwd) -> subprocess.Popen:
    """grpo-train in the background: stdout to cwd/stdout.txt (to watch), stderr to a pipe."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with open(cwd / "stdout.txt", "w") as out:
        return prewarmed.popen([script("grpo-train"), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE,
                                text=True)


def wait_for(condition, child: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert child.poll() is None, child.stderr.read()[-3000:]
        if time.time() > deadline:
            child.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def stderr_lines_after_signal(child: subprocess.Popen, signum: int) -> tuple[list[tuple[float, str]], float]:
    """Send `signum`; return the stderr lines with their seconds after the signal, and the seconds to exit."""
    t0 = time.time()
    child.send_signal(signum)
    lines = [(time.time() - t0, line.rstrip()) for line in child.stderr]
    child.wait(timeout=120)
    return lines, time.time() - t0


# generation dominates a step here (seconds on a CPU): 96 tokens for 8 completions, no reference pass
GENERATING = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=96", "rollout.min_new_tokens=96",
              "algo.beta=0.0", "data.prompts_per_step=2", "algo.num_generations=4", "trainer.max_steps=2",
              "trainer.save_every=0",
              "trainer.log_samples_every=0", *VARIED_REWARD]


@pytest.mark.slow
def test_sigint_mid_generation_discards_the_step_and_resume_is_exact(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = run_cli([*GENERATING, f"hydra.run.dir={straight}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]

    child = start([*GENERATING, f"hydra.run.dir={stopped}"], tmp_path)
    metrics = stopped / "metrics.jsonl"
    # step 0 done: step 1 starts generating
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") == 1, child)
    # a third into step 1's generation, which is as long as step 0's (a signal right at the end of step 0 stops
    # after it)
    time.sleep(0.3 * read_jsonl(metrics)[0]["gen_time_s"])
    lines, seconds = stderr_lines_after_signal(child, signal.SIGINT)
    assert child.returncode == 130, lines
    notice = [text for _, text in lines if text.startswith("grpo-train: SIGINT received: stopping now")]
    assert len(notice) == 1 and "Ctrl-C again to exit at once" in notice[0], lines
    assert lines[-1][1] == ("grpo-train: stopped by SIGINT after 1 complete step(s); the unfinished step was "
                         f"discarded; checkpoint {stopped}/checkpoints/step-000001; resume with: "
                         f"{resume_command(GENERATING, stopped)}")
    assert lines[-1][0] < 10, lines  # generation stopped at once, not after its 96 tokens (and the update)
    assert [r["step"] for r in read_jsonl(metrics)] == [0]
    assert not (stopped / "adapter").exists()

    proc = run_cli([*GENERATING, f"hydra.run.dir={stopped}", "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(metrics)] == [0, 1]
    assert_learned(straight)
    a = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (stopped / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b
    assert [r["reward"] for r in read_jsonl(straight / "metrics.jsonl")] == [r["reward"] for r in read_jsonl(metrics)]


@pytest.mark.slow
def test_sigterm_stops_a_generation_that_would_run_for_hours(tmp_path):
    """The issue's case: 100000 new tokens (the tiny model's context raised to allow it). SIGTERM ends the run in
    seconds with exit 143 and a checkpoint of the state before the step (none complete: step 0), which resumes."""
    run = tmp_path / "run"
    huge = ["+recipe=quickstart", "model=tiny", "trainer.max_steps=50", "model.tiny.max_position_embeddings=200000",
            "rollout.max_new_tokens=100000", "trainer.log_samples_every=0"]
    child = start([*huge, f"hydra.run.dir={run}"], tmp_path)
    # the model is loaded: step 1 starts
    wait_for(lambda: "training 50 steps" in (tmp_path / "stdout.txt").read_text(), child)
    time.sleep(3)  # generating
    assert child.poll() is None and not (run / "metrics.jsonl").exists()
    lines, seconds = stderr_lines_after_signal(child, signal.SIGTERM)
    assert child.returncode == 143, lines
    assert lines[-1][1] == ("grpo-train: stopped by SIGTERM after 0 complete step(s); the unfinished step was "
                            f"discarded; checkpoint {run}/checkpoints/step-000000; resume with: "
                            f"{resume_command(huge, run)}")
    assert lines[-1][0] < 10 and seconds < 60, (lines, seconds)  # the rest is the interpreter's own teardown
    print(f"SIGTERM -> last line {lines[-1][0]:.2f} s, -> exit {seconds:.2f} s")

    proc = run_cli([*huge, "rollout.max_new_tokens=4", "trainer.max_steps=1", "trainer.resume=auto",
                    "trainer.resume_allow_changes=[rollout.max_new_tokens,trainer.max_steps]", f"hydra.run.dir={run}"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_second_sigint_exits_at_once(tmp_path):
    """The first SIGINT asks for a stop (here during the embedded model's load, which cannot be cut short); a second
    one ends the process at once by SIGINT itself (a shell shows exit 130), and writes nothing."""
    run = tmp_path / "run"
    child = start(["+recipe=quickstart", "trainer.max_steps=1", f"hydra.run.dir={run}"], tmp_path)
    wait_for(lambda: (run / ".hydra" / "config.yaml").exists(), child)
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    for line in child.stderr:
        if line.startswith("grpo-train: SIGINT received: stopping now"):
            break
    t0 = time.time()
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGINT, child.stderr.read()
    assert time.time() - t0 < 5
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


HUGE_EVAL = ["+recipe=quickstart", "model=tiny", "trainer.max_steps=50", "model.tiny.max_position_embeddings=200000",
             "eval.max_new_tokens=100000", "eval.num_prompts=2", "rollout.max_new_tokens=4",
             "trainer.log_samples_every=0"]


@pytest.mark.slow
def test_sigint_during_the_evaluation_inside_training_keeps_the_finished_step(tmp_path):
    run = tmp_path / "run"
    child = start([*HUGE_EVAL, "eval.every=1", f"hydra.run.dir={run}"], tmp_path)
    wait_for(lambda: "evaluating after step 0" in (tmp_path / "stdout.txt").read_text(), child)
    time.sleep(1)  # step 0's evaluation generates for hours
    assert child.poll() is None and not (run / "metrics.jsonl").exists()
    lines, seconds = stderr_lines_after_signal(child, signal.SIGINT)
    assert child.returncode == 130, lines
    assert lines[-1][1] == (f"grpo-train: stopped by SIGINT after 1 complete step(s); checkpoint {run}/checkpoints/"
                            f"step-000001; resume with: {resume_command([*HUGE_EVAL, 'eval.every=1'], run)}")
    assert lines[-1][0] < 10, lines
    assert "evaluation after step 0 was stopped; its metrics are left out" in (tmp_path / "stdout.txt").read_text()
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and not any(k.startswith("eval/") for k in rows[0])


@pytest.mark.slow
def test_grpo_eval_stops_mid_generation(tmp_path):
    out = tmp_path / "eval"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "stdout.txt", "w") as stdout:
        child = prewarmed.popen([script("grpo-eval"), *HUGE_EVAL, f"hydra.run.dir={out}"], cwd=tmp_path, env=env,
                                 stdout=stdout, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "evaluating base on 2 held-out prompts" in (tmp_path / "stdout.txt").read_text(), child)
    time.sleep(1)  # loaded and generating for hours
    assert child.poll() is None
    lines, seconds = stderr_lines_after_signal(child, signal.SIGINT)
    assert child.returncode == 130, lines
    assert lines[-1][1] == ("grpo-eval: stopped by SIGINT before it finished; eval.json was not written; run the "
                            "command again for the result")
    assert seconds < 60 and not (out / "eval.json").exists()
