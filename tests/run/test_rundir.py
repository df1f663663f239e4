"""A run directory you can trust (grpo_cli/run/rundir.py): one writer, one run, a pinned config, checkpoints that
fall back, records that never go backwards, reward functions under a deadline, and one line for bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import prewarmed
import pytest
from conftest import VARIED_REWARD, assert_learned, finished_run, module_on_path, read_jsonl, run_cli, script

REWARDS = '''
import os, time

def sleepy(prompts, completions, **fields):
    """0 for every completion, after REWARD_SLEEP_S seconds (a slow or hanging reward); touches the file
    REWARD_CALLED names first."""
    if os.environ.get("REWARD_CALLED"):
        open(os.environ["REWARD_CALLED"], "a").close()
    time.sleep(float(os.environ.get("REWARD_SLEEP_S", "0")))
    return [0.0] * len(completions)
'''
# 4 steps, checkpoints at steps 2 and 4, samples of every step; a reward that sleeps when asked to
RUN = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
       "algo.num_generations=4", "trainer.max_steps=4", "trainer.save_every=2", "trainer.log_samples_every=1",
       "+reward.functions.sleepy._target_=rundir_rewards.sleepy", "+reward.functions.sleepy.weight=0.0",
       *VARIED_REWARD]
ADAPTER = "adapter/adapter_model.safetensors"


@pytest.fixture(scope="module")
def rewards_env(tmp_path_factory):
    return module_on_path(tmp_path_factory, "rundir_rewards", REWARDS)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, rewards_env):
    """A finished 4-step run (not to be changed: tests copy it)."""
    return finished_run(tmp_path_factory, "finished", RUN, rewards_env)


@pytest.fixture
def used(tmp_path, finished):
    """A copy of the finished run to try things on."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def train(args: list[str], run, cwd, env) -> subprocess.CompletedProcess:
    return run_cli([*RUN, *args, f"hydra.run.dir={run}"], cwd, env=env)


def one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("grpo-"), proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def untouched(run, finished) -> None:
    """The run's records and recorded config are byte for byte those of the finished run."""
    for name in ("metrics.jsonl", "samples.jsonl", ".hydra/config.yaml", ".hydra/overrides.yaml", ADAPTER):
        assert (run / name).read_bytes() == (finished / name).read_bytes(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


# ---- one writer ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, used, finished,
                                                                                       rewards_env):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from grpo_cli.run.rundir import RunLock; lock = RunLock.acquire(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(300)", str(used)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = train(["trainer.resume=auto", "trainer.seed=7"], used, tmp_path, rewards_env)
        one_line_exit_2(proc, f"run dir {used} is in use by grpo-train pid {holder.pid} on host",
                        "another hydra.run.dir")
        untouched(used, finished)  # .hydra/ of the run is not the refused attempt's
    finally:
        holder.kill()
        holder.wait()
    from grpo_cli.run.rundir import RunLock

    RunLock.acquire(used).release()  # the killed holder's lock died with it


# ---- one run ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_fresh_run_into_a_used_dir_is_refused_and_overwrite_starts_over(tmp_path, used, finished, rewards_env):
    proc = train(["trainer.seed=3"], used, tmp_path, rewards_env)
    one_line_exit_2(proc, f"run dir {used} holds a run already", "trainer.resume=auto", "trainer.overwrite=true",
                    "another hydra.run.dir")
    untouched(used, finished)

    (used / "tensorboard").mkdir()  # logger=tensorboard's events of the old run: its curves would mix with the new
    (used / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"old run")
    proc = train(["trainer.overwrite=true", "trainer.max_steps=1", "trainer.save_every=0"], used, tmp_path, rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (used / "tensorboard").exists()
    assert [r["step"] for r in read_jsonl(used / "metrics.jsonl")] == [0]
    assert {r["step"] for r in read_jsonl(used / "samples.jsonl")} == {0}
    assert not (used / "checkpoints").exists()
    assert "trainer.max_steps=1" in (used / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_resume_with_nothing_to_resume_says_so_and_refuses_a_used_dir(tmp_path, used, rewards_env):
    shutil.rmtree(used / "checkpoints")
    proc = train(["trainer.resume=auto"], used, tmp_path, rewards_env)
    one_line_exit_2(proc, f"trainer.resume=auto: nothing to resume in {used}", "trainer.overwrite=true")
    assert len(read_jsonl(used / "metrics.jsonl")) == 4


@pytest.mark.slow
def test_overwrite_with_resume_and_a_damaged_checkpoint_path_are_refused(tmp_path, used, finished, rewards_env):
    proc = train(["trainer.resume=auto", "trainer.overwrite=true"], used, tmp_path, rewards_env)
    one_line_exit_2(proc, "trainer.overwrite=true starts over and trainer.resume=auto goes on; pick one")
    truncate(used / "checkpoints" / "step-000002" / "trainer_state.pt")
    proc = train([f"trainer.resume={used / 'checkpoints' / 'step-000002'}"], used, tmp_path, rewards_env)
    one_line_exit_2(proc, "step-000002 is damaged (trainer_state.pt has", "trainer.resume=auto")
    untouched(used, finished)


# ---- a pinned config ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("override,shown", [
    ("algo.num_generations=2", "algo.num_generations 4 -> 2"),
    ("data.prompts_per_step=4", "data.prompts_per_step 2 -> 4"),
    ("trainer.seed=1", "trainer.seed 0 -> 1"),
    ("optimizer.lr=0.001", "optimizer.lr 5e-05 -> 0.001"),
    ("rollout.temperature=0.5", "rollout.temperature 0.8 -> 0.5"),
    ("reward.functions.correct.weight=2.0", "reward.functions.correct.weight 1.0 -> 2.0"),
])
def test_a_changed_key_on_resume_is_refused_before_anything_is_written(tmp_path, used, finished, rewards_env,
                                                                        override, shown):
    proc = train(["trainer.resume=auto", override], used, tmp_path, rewards_env)
    key = override.split("=")[0]
    one_line_exit_2(proc, shown, f"trainer.resume_allow_changes=[{key}]")
    untouched(used, finished)


def test_the_sampling_keys_are_pinned_and_a_key_newer_than_the_checkpoint_counts_at_its_default(config):
    from grpo_cli.run import rundir

    current = rundir.fingerprint(config(["+recipe=quickstart", "model=tiny", "rollout.top_k=5", "rollout.stop=[END]"]))
    assert current["rollout.top_k"] == 5 and current["rollout.stop"] == ["END"]
    assert {"rollout.min_p", "rollout.repetition_penalty", "rollout.engine"} <= current.keys()
    # a checkpoint written before these options existed: top_k (now 5) is a change, min_p at its default 0.0 is not
    older = {k: v for k, v in current.items() if k not in ("rollout.top_k", "rollout.min_p")}
    assert rundir.changed_keys(older, current) == ["rollout.top_k"]
    assert rundir.changed_keys(current, older) == ["rollout.min_p", "rollout.top_k"]  # a key gone is a change
    # a checkpoint of a release that still pinned the LM head's block size: no longer a key that decides a step
    assert rundir.changed_keys({**current, "trainer.logprob_chunk_size": 1024}, current) == []


@pytest.mark.slow
def test_the_adapter_shape_cannot_change_even_when_allowed(tmp_path, used, finished, rewards_env):
    proc = train(["trainer.resume=auto", "model.lora.r=4", "trainer.resume_allow_changes=[model.lora.r]"], used,
                 tmp_path, rewards_env)
    one_line_exit_2(proc, "model.lora.r 8 -> 4", "even with trainer.resume_allow_changes")
    untouched(used, finished)


@pytest.mark.slow
def test_an_allowed_change_is_applied(tmp_path, used, rewards_env):
    """More steps and a new learning rate: the optimizer takes the new rate from the first resumed update on."""
    proc = train(["trainer.resume=auto", "trainer.max_steps=6", "optimizer.lr=0.001",
                  "trainer.resume_allow_changes=[trainer.max_steps,optimizer.lr]"], used, tmp_path, rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(used / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["lr"] for r in rows] == [5e-5] * 4 + [1e-3] * 2
    state = json.loads((used / "checkpoints" / "step-000006" / "state.json").read_text())
    assert state["fingerprint"]["optimizer.lr"] == 1e-3 and state["fingerprint"]["trainer.max_steps"] == 6


# ---- checkpoints that fall back -----------------------------------------------------------------------------------
def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated adapter": (lambda c: truncate(c / ADAPTER), "adapter/adapter_model.safetensors has"),
    "flipped byte in the optimizer state": (lambda c: flip_a_byte(c / "trainer_state.pt"),
                                            "trainer_state.pt does not match"),
    "missing metrics copy": (lambda c: (c / "metrics.jsonl").unlink(), "metrics.jsonl is missing"),
    "no manifest": (lambda c: (c / "manifest.json").unlink(), "no readable manifest.json"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, used, finished, rewards_env,
                                                                          damage):
    """Resume goes on from step 2 and ends where the straight run ended, bitwise; an orphaned write is removed."""
    spoil, reason = DAMAGE[damage]
    spoil(used / "checkpoints" / "step-000004")
    orphan = used / "checkpoints" / ".tmp-step-000006-12345"
    orphan.mkdir()
    proc = train(["trainer.resume=auto"], used, tmp_path, rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"checkpoint {used}/checkpoints/step-000004 is damaged ({reason}" in said, said[-3000:]
    assert "resuming at step 2 (2 of 4 done)" in said  # after steps 0 and 1: checkpoint step-000002
    resumed_rows, straight_rows = read_jsonl(used / "metrics.jsonl"), read_jsonl(finished / "metrics.jsonl")
    assert resumed_rows and [r["step"] for r in resumed_rows] == [0, 1, 2, 3]
    assert [r["reward"] for r in resumed_rows] == [r["reward"] for r in straight_rows]
    assert (used / ADAPTER).read_bytes() == (finished / ADAPTER).read_bytes()
    assert_learned(finished)
    assert not orphan.exists()


# ---- records that match the checkpoint ----------------------------------------------------------------------------
@pytest.mark.slow
def test_every_record_is_rolled_back_after_a_kill_and_resume(tmp_path, finished, rewards_env):
    """Killed during step 4 (after step 3's samples, before the step-4 checkpoint), resumed from step 2: every
    step's metrics and samples appear once, as in the run that went straight through."""
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **rewards_env, "REWARD_SLEEP_S": "0.5"}
    child = prewarmed.popen([script("grpo-train"), *RUN, f"hydra.run.dir={run}"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (
            (run / "samples.jsonl").exists() and {r["step"] for r in read_jsonl(run / "samples.jsonl")} == {0, 1, 2}):
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)  # step 4 is scoring (the reward sleeps 0.5 s)
    child.wait()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    proc = train(["trainer.resume=auto"], run, tmp_path, rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("metrics.jsonl", "samples.jsonl"):
        resumed, straight = read_jsonl(run / name), read_jsonl(finished / name)
        assert [r["step"] for r in resumed] == [r["step"] for r in straight], name
        assert [r["reward"] for r in resumed] == [r["reward"] for r in straight], name
    assert (run / ADAPTER).read_bytes() == (finished / ADAPTER).read_bytes()
    assert_learned(finished)


# ---- reward functions under a deadline ----------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_stops_a_reward_that_never_returns_within_10_s(tmp_path, rewards_env):
    run = tmp_path / "run"
    called = tmp_path / "reward-called"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **rewards_env, "REWARD_SLEEP_S": "3600",
           "REWARD_CALLED": str(called)}
    child = prewarmed.popen([script("grpo-train"), *RUN, f"hydra.run.dir={run}"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not called.exists():
        assert child.poll() is None and time.time() < deadline, child.stderr.read()[-3000:]
        time.sleep(0.05)
    time.sleep(1)  # inside the reward, which sleeps for an hour
    assert child.poll() is None and not (run / "metrics.jsonl").exists()
    sent = time.time()
    child.send_signal(signal.SIGTERM)
    try:
        _, err = child.communicate(timeout=10)
    finally:
        child.kill()
    assert time.time() - sent < 10
    assert child.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("grpo-train: stopped by SIGTERM after 0 complete step(s); the "
                                                   "unfinished step was discarded; checkpoint "
                                                   f"{run}/checkpoints/step-000000")


class Hang:
    """A reward that never returns for completions containing "hang" (until released), 1.0 for the rest."""

    def __init__(self):
        self.release = threading.Event()
        self.__name__ = "hang"

    def __call__(self, prompts, completions, **fields):
        if any("hang" in c for c in completions):
            self.release.wait(60)
        return [1.0] * len(completions)


@pytest.fixture
def hang():
    fn = Hang()
    yield fn
    fn.release.set()


def test_a_timed_out_reward_with_on_error_zero_zeroes_only_the_completions_that_time_out(hang):
    from grpo_cli.rewards import RewardFunction, RewardSet

    rewards = RewardSet([RewardFunction("hang", hang, 1.0)], on_error="zero", timeout_s=0.2)
    totals, per_fn, errors = rewards.score(["p"] * 4, ["a", "hang", "b", "c"], {})
    assert totals == [1.0, 0.0, 1.0, 1.0] and errors == 1


def test_a_timed_out_reward_with_on_error_raise_ends_the_run_in_one_line(hang):
    from grpo_cli.base.errors import RewardError
    from grpo_cli.rewards import RewardFunction, RewardSet

    rewards = RewardSet([RewardFunction("hang", hang, 1.0)], on_error="raise", timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"^reward hang did not return within reward.timeout_s=0.2 s for 2 "
                                          r"completions; .*reward.on_error=zero$"):
        rewards.score(["p"] * 2, ["a", "hang"], {})
    assert time.monotonic() - started < 5


def test_a_stop_request_ends_the_wait_for_a_reward(hang):
    from grpo_cli.base.errors import Interrupted
    from grpo_cli.base.stopping import StopRequest
    from grpo_cli.rewards import RewardFunction, RewardSet

    stop = StopRequest(announce=False)
    rewards = RewardSet([RewardFunction("hang", hang, 1.0)], stop=stop)
    threading.Timer(0.3, setattr, args=(stop, "signum", signal.SIGTERM)).start()  # as its handler would
    started = time.monotonic()
    with pytest.raises(Interrupted):
        rewards.score(["p"], ["hang"], {})
    assert time.monotonic() - started < 5


# ---- one line, exit 2 ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_invalid_utf8_in_a_data_file_names_the_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=jsonl", f"data.path={data}",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    one_line_exit_2(proc, f"{data}:2 is not valid UTF-8", "0xe9")


@pytest.mark.slow
def test_grpo_eval_with_an_adapter_of_another_base_is_one_line(tmp_path, finished):
    proc = run_cli(["+recipe=quickstart", "eval.num_prompts=2", f"eval.adapter={finished / 'adapter'}",
                    f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, command="grpo-eval")
    one_line_exit_2(proc, "but base embedded:smollm2-135m has", "it was trained on another base", "model=NAME")


@pytest.mark.slow
def test_grpo_eval_into_a_training_run_or_an_earlier_eval_is_one_line_and_leaves_its_records(tmp_path, used):
    """Hydra would write grpo-eval's .hydra/ over the run's (grpo-report and grpo-export read it), and eval.json over an
    earlier eval's."""
    before = {p.name: p.read_bytes() for p in (used / ".hydra").iterdir()}
    proc = run_cli(["+recipe=quickstart", "model=tiny", "eval.num_prompts=2", f"hydra.run.dir={used}"], tmp_path,
                   command="grpo-eval")
    one_line_exit_2(proc, f"hydra.run.dir={used} holds a training run (metrics.jsonl", "give the eval a dir of its own",
                    f"eval.adapter={used / 'adapter'}")
    assert {p.name: p.read_bytes() for p in (used / ".hydra").iterdir()} == before
    earlier = tmp_path / "eval"
    earlier.mkdir()
    (earlier / "eval.json").write_text('{"accuracy": 0.5}')
    proc = run_cli(["+recipe=quickstart", "model=tiny", "eval.num_prompts=2", f"hydra.run.dir={earlier}"], tmp_path,
                   command="grpo-eval")
    one_line_exit_2(proc, f"hydra.run.dir={earlier} holds an eval already (eval.json)")
    assert (earlier / "eval.json").read_text() == '{"accuracy": 0.5}' and not (earlier / ".hydra").exists()
    # the run's adapter folder itself (or an export of it): .hydra/, the log and eval.json were written among its files
    adapter = used / "adapter"
    files = sorted(p.name for p in adapter.iterdir())
    proc = run_cli(["+recipe=quickstart", "model=tiny", "eval.num_prompts=2", f"eval.adapter={adapter}",
                    f"hydra.run.dir={adapter}"], tmp_path, command="grpo-eval")
    one_line_exit_2(proc, f"hydra.run.dir={adapter} holds an adapter (adapter_config.json)", "a dir of its own")
    assert sorted(p.name for p in adapter.iterdir()) == files


# a file may not grow past 20 kB, and a write past it fails (EFBIG; Python ignores SIGXFSZ) instead of killing the
# process: a full disk as a test can have it
FILES_OF_AT_MOST_20_KB = {"RLIMIT_FSIZE": (20_000, 20_000)}


@pytest.mark.slow
@pytest.mark.parametrize("write, code, words", [
    ("trainer.save_every=1", 2,
     ["checkpoints/step-000001 failed (File too large", "no checkpoint was written before it"]),
    ("trainer.log_samples_every=1", 1, ["a write found no room (File too large)", "trainer.resume=auto"]),
], ids=["checkpoint", "records"])
def test_a_write_that_finds_no_room_is_one_line(tmp_path, write, code, words):
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "trainer.max_steps=3", write,
                    f"hydra.run.dir={run}"], tmp_path, rlimits=FILES_OF_AT_MOST_20_KB)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    assert not list(run.glob("checkpoints/.tmp-*"))  # a half-written checkpoint does not hold on to the space


@pytest.mark.slow
def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    proc = run_cli(["+recipe=quickstart", "model=tiny", f"hydra.run.dir={tmp_path / 'afile' / 'run'}"], tmp_path)
    one_line_exit_2(proc, f"hydra.run.dir={tmp_path / 'afile' / 'run'} cannot be created or written",
                    f"{tmp_path / 'afile'} is a file")


@pytest.mark.slow
@pytest.mark.parametrize("override", ["algo.num_generations=abc", "algo.num_generations=inf", "optimizer.lr=inf",
                                      "algo.beta=nan", "reward.timeout_s=-1", "reward.functions.correct.weight=nan"])
def test_non_numeric_and_non_finite_numbers_are_one_line(tmp_path, override):
    proc = run_cli(["+recipe=quickstart", "model=tiny", override, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    one_line_exit_2(proc, override)
