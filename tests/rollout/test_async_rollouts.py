"""Generation beside training (issue 52): rollout.max_staleness and rollout.placement=worker. The default path is
today's, bitwise; a worker run trains with its staleness and sync-gap metrics; a sync that does not happen, a worker
that dies and SIGTERM each stop in one line (no hang: every wait has a timeout); a K=1 run stopped by SIGTERM or
killed by SIGKILL resumes to the uninterrupted one's adapter, bitwise; placement=server where no vLLM is found."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAINER, VARIED_REWARD, alive, assert_learned, fit, make_trainer, read_jsonl, run_cli

from grpo_cli.base.errors import ConfigError

# 4 steps of 2 prompts x 4 completions of 4 tokens, a learning rate that moves the adapter, a reward that varies
TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
        "algo.num_generations=4", "trainer.max_steps=4", "trainer.log_samples_every=0", "optimizer.lr=1e-2",
        *VARIED_REWARD]
WORKER = ["rollout.placement=worker", "rollout.max_staleness=1"]


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def assert_same_adapter(a: Path, b: Path) -> None:
    import torch

    left, right = adapter_tensors(a), adapter_tensors(b)
    assert left.keys() == right.keys()
    assert all(torch.equal(left[k], right[k]) for k in left), "the adapters differ"


def test_staleness_needs_the_worker_placement_in_one_line(compose):
    from grpo_cli.run.validate import validate

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose([*TINY_TRAINER, *overrides]))
        return str(err.value)

    assert refusal("rollout.max_staleness=2") == (
        "rollout.max_staleness=2 is invalid: needs rollout.placement=worker or server (generation beside training; "
        "in the training process generation and training take turns); add rollout.placement=worker or use "
        "rollout.max_staleness=0")
    assert refusal("rollout.placement=worker", "algo.filter_groups=true") == (
        "rollout.placement=worker is invalid: does not run algo.filter_groups yet; use rollout.placement=local")
    assert validate(compose([*TINY_TRAINER, *WORKER, "algo.sampler_correction=token_truncate"])) == []
    assert refusal("rollout.worker_device=cpu") == (
        "rollout.worker_device=cpu is invalid: is read only with rollout.placement=worker; add it or drop "
        "rollout.worker_device")
    assert validate(compose([*TINY_TRAINER, *WORKER, "rollout.worker_device=cpu"])) == []
    # what only generation beside training reads: refused where generation takes turns with training
    assert refusal("rollout.server_timeout_s=5") == ("rollout.server_timeout_s=5 is invalid: is read only with "
                                                      "rollout.placement=server; add it or drop "
                                                      "rollout.server_timeout_s")
    for option in ("rollout.generator_timeout_s=5", "rollout.worker_threads=1"):
        key = option.split("=")[0]
        assert refusal(option).endswith(f"is invalid: is read only with rollout.placement=worker or server (generation "
                                        f"beside training); add one, or drop {key}"), option
        assert validate(compose([*TINY_TRAINER, *WORKER, option])) == []
    if not torch.cuda.is_available():
        assert "no CUDA device is visible here" in refusal(*WORKER, "rollout.worker_device=cuda:1")


def test_the_cores_split_between_trainer_and_worker():
    from grpo_cli.rollout.worker import thread_split

    assert thread_split(None, 2) == (1, 1) and thread_split(None, 8) == (4, 4) and thread_split(None, 1) == (1, 1)
    assert thread_split(3, 8) == (5, 3) and thread_split(4, 2) == (1, 4)  # (trainer, worker): at least one each


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_max_staleness_0_is_todays_loop_bitwise_here_and_in_a_worker(compose, tmp_path):
    """Two steps with the option left out, with rollout.max_staleness=0 set, and with generation in a worker (K=0:
    its batch of step t by version t, as the local loop) end with the same adapter bytes: the worker samples with
    the same seeds from the same weights. One torch thread throughout: the worker's split of the cores would
    otherwise change the order of the sums."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = []
        for extra in ([], ["rollout.max_staleness=0"], ["rollout.placement=worker"]):
            run = tmp_path / f"run{len(runs)}"
            fit(make_trainer(compose, run, *TINY[3:], "trainer.max_steps=2", "trainer.save_every=0", *extra), run)
            runs.append(run)
    finally:
        torch.set_num_threads(threads)
    assert_learned(runs[0])
    assert_same_adapter(runs[0], runs[1])
    assert_same_adapter(runs[0], runs[2])
    assert read_jsonl(runs[2] / "metrics.jsonl")[1]["rollout/staleness"] == 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_worker_makes_the_reference_pass_beside_a_trainer_on_the_cpu(compose, tmp_path):
    """K=1 with a KL term, trainer and worker on the CPU: the worker's batch carries the frozen base's log-probs,
    equal to the trainer's own reference pass over the same micro-batches (the same weights, code and one thread
    each: the same operations in the same order), and no sampler log-probs where the loss does not read them."""
    from grpo_cli.rollout import sampling_seed
    from grpo_cli.rollout.worker import RolloutWorker, reference_in_the_worker

    trainer = make_trainer(compose, tmp_path, *TINY[3:], *WORKER, "algo.beta=0.04")
    worker = RolloutWorker(trainer.cfg, trainer.lm, trainer.prompts, lambda step: sampling_seed(0, step, 0), start=0,
                           stop=lambda: False, plan=trainer.memory)
    try:
        generation = worker.generation(0)
    finally:
        worker.close()
    assert generation.rollout.sampler_logprobs is None  # algo.sampler_correction=none: nothing reads them
    batch = trainer.make_batch(generation, trainer.score(generation))
    ordered, minis = trainer.mini_batch_layout(batch)
    own = trainer._no_grad_logprobs(ordered, [rows for mini in minis for rows in mini.micro], adapter=False)
    real = ordered.mask.bool()
    assert real.any() and torch.equal(ordered.rollout.ref_logprobs[real], own[real])
    assert generation.stats["rollout/worker_passes_s"] > 0

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = trainer.cfg
    assert reference_in_the_worker(cfg, cpu, cpu) and not reference_in_the_worker(cfg, cpu, cuda)
    for overrides in (["rollout.max_staleness=0"], ["algo.beta=0.0"]):
        other = make_trainer(compose, tmp_path, *TINY[3:], *WORKER, *overrides).cfg
        assert not reference_in_the_worker(other, cpu, cpu), overrides


# the reward of TINY, and a signal at one step's scoring where SIGNAL_AT_CALL says (tests/varied_reward.py); the
# sampler correction weighs the lag, with a bound that the lag crosses
SIGNALLING = [*TINY[:-2], "+reward.functions.varied._target_=varied_reward.by_length_with_a_signal",
              "+reward.functions.varied.weight=1.0", *WORKER, "trainer.save_every=0",
              "algo.sampler_correction=token_truncate", "algo.sampler_clip_max=1.05"]


def signal_at(step: int, to: str, record: Path) -> dict:
    return {"SIGNAL_AT_CALL": str(step + 1), "SIGNAL_TO": to, "SIGNAL_RECORD": str(record)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The K=1 worker run of SIGNALLING uninterrupted; its metrics are those of a K=1 run."""
    folder = tmp_path_factory.mktemp("straight")
    proc = run_cli([*SIGNALLING, f"hydra.run.dir={folder / 'run'}"], folder, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(folder / "run" / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1, 2]  # step t trains on version max(0, t - 1)'s batch
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(0 <= r["sync/logp_gap"] <= 1e-3 for r in rows)
    assert rows[0]["sampler/logp_diff_max"] < 1e-4 < rows[1]["sampler/logp_diff_max"]  # the lag, seen from step 1
    assert rows[0]["sampler/corrected_frac"] == 0 < max(r["sampler/corrected_frac"] for r in rows[1:])
    assert_learned(folder / "run")
    return folder / "run"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_worker_run_stopped_by_sigterm_resumes_to_the_uninterrupted_adapter(tmp_path, straight):
    """K=1 with a worker trains with its metrics (the fixture); SIGTERM at step 1 stops at a safe point with the
    worker gone and the checkpoint after step 0; trainer.resume=auto then ends with the uninterrupted run's adapter,
    bitwise."""
    stopped, record = tmp_path / "stopped", tmp_path / "worker.pid"
    proc = run_cli([*SIGNALLING, f"hydra.run.dir={stopped}"], tmp_path, timeout=120,
                   env=signal_at(1, "self", record))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("grpo-train: stopped by SIGTERM after 1 complete step(s)")
    worker = int(record.read_text())
    assert not alive(worker), f"the rollout worker {worker} outlived grpo-train"
    assert (stopped / "checkpoints" / "step-000001" / "rollout_versions.safetensors").is_file()

    proc = run_cli([*SIGNALLING, f"hydra.run.dir={stopped}", "trainer.resume=auto"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(stopped / "metrics.jsonl")] == [0, 1, 2, 3]
    assert_same_adapter(straight, stopped)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_worker_run_killed_by_sigkill_resumes_to_the_uninterrupted_adapter(tmp_path, straight):
    """kill -9 of grpo-train during step 2's scoring, a batch of the worker's in flight: no safe point, the worker
    goes with it (the kernel's parent-death signal), the last checkpoint is the periodic one after 2 steps. The
    resume regenerates what was in flight from the adapters that checkpoint kept and ends with the uninterrupted
    run's adapter, bitwise."""
    killed, record = tmp_path / "killed", tmp_path / "worker.pid"
    every_step = ["trainer.save_every=1", f"hydra.run.dir={killed}"]
    proc = run_cli([*SIGNALLING, *every_step], tmp_path, timeout=120, env=signal_at(2, "kill", record))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    worker = int(record.read_text())
    assert gone_within(worker, 10), f"the rollout worker {worker} outlived grpo-train's kill -9"
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == [0, 1]
    assert not (killed / "checkpoints" / "step-000003").exists()

    proc = run_cli([*SIGNALLING, *every_step, "trainer.resume=auto"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == [0, 1, 2, 3]
    assert_same_adapter(straight, killed)


def stopped_after(steps: int, run: Path) -> str:
    """The tail of the line of a run stopped by its rollout worker before the update of step `steps`."""
    return (f"; the run stopped after {steps} complete step(s), checkpoint {run}/checkpoints/step-{steps:06d}; resume "
            f"with the same command plus trainer.resume=auto hydra.run.dir={run}")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_worker_that_dies_is_one_line_not_a_hang(tmp_path):
    """SIGKILL to the worker during step 1: step 2 finds it dead before its update, and the run stops in one line
    with the state after 2 steps checkpointed."""
    record, run = tmp_path / "worker.pid", tmp_path / "run"
    proc = run_cli([*SIGNALLING, f"hydra.run.dir={run}"], tmp_path, timeout=120, env=signal_at(1, "worker", record))
    assert proc.returncode == 1, proc.stderr[-3000:]
    worker = int(record.read_text())
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo-train: the rollout worker (pid {worker}) ended with exit code -9 before it "), last
    assert last.endswith(stopped_after(2, run)), last
    assert (run / "checkpoints" / "step-000002" / "rollout_versions.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_weight_sync_that_does_not_happen_stops_the_run_in_one_line(tmp_path):
    """The worker's test hook acknowledges each sync without loading the adapter: the probe's log-probs differ from
    the trainer's once the first update moved the adapter."""
    from grpo_cli.rollout.worker import SKIP_SYNC_TEST_HOOK

    run = tmp_path / "run"
    proc = run_cli([*SIGNALLING, f"hydra.run.dir={run}"], tmp_path, timeout=120, env={SKIP_SYNC_TEST_HOOK: "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-train: sync check failed at step 2: after the weight sync of policy version 1 the "
                           "rollout worker's log-probs on the probe sequence differ from the trainer's by "), last
    assert "over the tolerance 0.001: the new weights did not reach the worker" in last
    assert last.endswith(stopped_after(2, run)), last


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_cuda_generation_on_its_own_device_beside_the_trainer(tmp_path):
    """scripts/gpu_check.sh's case (pytest -m cuda): the trainer on the CPU, the worker generating on the GPU, K=1,
    both in fp32 (model.dtype given: auto would be bf16 on the GPU). The run trains; every sync is checked."""
    run = tmp_path / "run"
    proc = run_cli([*TINY, *WORKER, "rollout.worker_device=cuda", "model.dtype=float32", f"hydra.run.dir={run}"],
                   tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["sync/logp_gap"] <= 1e-3 for r in rows)


def test_a_server_placement_with_no_vllm_to_start_is_one_line(tmp_path):
    """Where grpo-train's python finds no vLLM (make test's venv before make setup-vllm), placement=server without a
    URL stops before the model loads, in one line naming both ways out."""
    from grpo_cli.rollout.vllm_server import vllm_python

    try:
        vllm_python()
    except ConfigError:
        pass
    else:
        pytest.skip("this python finds a vLLM to start; tests/rollout/test_vllm_server.py runs the server placement")
    proc = run_cli([*TINY, "rollout.placement=server", "rollout.max_staleness=1", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: rollout.placement=server found no vLLM to start its server with (vllm does not import in "
        "grpo-train's python, no .venv-vllm beside its venv, no `vllm` on PATH); run `make setup-vllm`, or start "
        "`vllm serve` yourself and give its URL as rollout.server_url"]
