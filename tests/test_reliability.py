"""Bad input gets one line and exit 2; a killed run resumes to the bitwise-same adapter; signals checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import read_jsonl, run_cli, script

# (override, words the one-line message must contain)
BAD = [
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
    ("trainer.device=cuda", ["trainer.device=cuda", "no CUDA"]),
    ("optimizer.lr=0", ["optimizer.lr=0", "lr > 0"]),
    ("trainer.max_steps=0", ["trainer.max_steps=0"]),
    ("+reward.functions.mine._target_=nowhere.fn", ["reward.functions.mine._target_=nowhere.fn", "cannot be imported"]),
    ("data.path=/no/such/file.jsonl", ["data.path=/no/such/file.jsonl", "no such file"]),
    ("trainer.resume=/no/such/checkpoint", ["trainer.resume=/no/such/checkpoint"]),
    ("model=nope", ["model/nope", "smollm2-135m"]),
    ("algo.betta=0.1", ["algo.betta"]),
    ("reward.on_error=ignore", ["reward.on_error=ignore", "zero"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("override,words", BAD, ids=[b[0] for b in BAD])
def test_bad_invocation_is_one_line_exit_2(tmp_path, override, words):
    proc = run_cli(["+recipe=quickstart", "model=tiny", override], tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("grpo-train: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_unknown_recipe_exit_2(tmp_path):
    proc = run_cli(["+recipe=nope"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_data_row_missing_field_names_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"answer": "3"}\n')
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data.source=jsonl", f"data.path={data}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"grpo-train: {data}:2 lacks field(s) prompt; every row needs prompt"]


@pytest.mark.slow
def test_reward_that_raises_names_function_and_completion(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def flaky(prompts, completions, **_):\n"
        "    return [1 / 0 if 'What is 3 +' in p else 0.0 for p in prompts]\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(1, 5)))
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=3", "data.source=jsonl",
                    f"data.path={rows}", "+reward.functions.flaky._target_=my_rewards.flaky"], tmp_path,
                   env={"PYTHONPATH": str(tmp_path)})
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
                   env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_jsonl(run / "metrics.jsonl")[0]["reward_errors"] == 8


TINY_RUN = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
            "algo.num_generations=4", "trainer.max_steps=6", "trainer.save_every=2", "trainer.log_samples_every=0"]


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_identical(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    proc = run_cli([*TINY_RUN, f"hydra.run.dir={straight}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]

    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([script("grpo-train"), *TINY_RUN, f"hydra.run.dir={crashed}"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = crashed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(read_jsonl(metrics)) < 3):
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)  # mid step 4: after the step-2 checkpoint, before step-4's
    child.wait()
    assert (crashed / "checkpoints").is_dir() and not (crashed / "adapter").exists()

    proc = run_cli([*TINY_RUN, f"hydra.run.dir={crashed}", "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == list(range(6))
    a = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (crashed / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b
    rewards = [r["reward"] for r in read_jsonl(straight / "metrics.jsonl")]
    assert rewards == [r["reward"] for r in read_jsonl(crashed / "metrics.jsonl")]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_143(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([script("grpo-train"), *TINY_RUN, "trainer.save_every=0", f"hydra.run.dir={run}"],
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
def test_crafted_pickle_in_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    proc = run_cli([*TINY_RUN, "trainer.max_steps=2", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    sentinel = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    import pickle

    (ckpt / "trainer_state.pt").write_bytes(pickle.dumps({"optimizer": Payload()}))
    proc = run_cli([*TINY_RUN, "trainer.max_steps=4", f"hydra.run.dir={run}", "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 2
    assert "refused" in proc.stderr.strip().splitlines()[-1]
    assert not sentinel.exists()
