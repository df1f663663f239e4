"""rollout.placement=server (issue 52): generation by vLLM's OpenAI-compatible server, the adapter loaded by name at
each policy version. A K=1 run trains against the server grpo-train starts, with its staleness and sync-gap metrics, and
leaves no server process; a sync that does not happen (the test hook loads the previous adapter under the new name)
on a server given by rollout.server_url stops in one line and leaves that server running; SIGTERM stops the run and
its server, kill -9 of grpo-train takes its server down too, and either resumed run ends with the uninterrupted one's
adapter; the refusals.
Skipped where vllm is not importable (the main venv); `make test-vllm` runs them in .venv-vllm.

The tiny model has one attention head (head_dim 64): vLLM's CPU attention has no kernel for head_dim 16."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import pytest
from conftest import (
    TINY_TRAINER,
    VARIED_REWARD,
    alive,
    assert_learned,
    group_members,
    read_jsonl,
    run_cli,
    saved_base,
    vllm_servers,
)
from test_async_rollouts import signal_at, stopped_after

from grpo_cli.base.errors import ConfigError, WorkerError
from grpo_cli.rollout.vllm_server import STARTS, ServerAPI, VLLMServer, wait_until_up

pytest.importorskip("vllm")

# 4 steps of 2 prompts x 4 completions of 4 tokens on the one-head tiny model, a learning rate that moves the
# adapter, a reward that varies (with a signal where SIGNAL_AT_CALL says: tests/varied_reward.py), K=1 on a server
SERVER = ["+recipe=quickstart", "model=tiny", "model.tiny.num_heads=1", "trainer.device=cpu",
          "rollout.max_new_tokens=4", "data.prompts_per_step=2", "algo.num_generations=4", "trainer.max_steps=4",
          "trainer.log_samples_every=0", "optimizer.lr=1e-2", "trainer.save_every=0", "eval.final=false",
          "+reward.functions.varied._target_=varied_reward.by_length_with_a_signal",
          "+reward.functions.varied.weight=1.0", "rollout.placement=server", "rollout.max_staleness=1",
          "rollout.vllm_kv_cache_gib=1", "algo.sampler_correction=token_truncate", "algo.sampler_clip_max=1.05"]
STARTED = re.compile(r"rollout\.placement=server: started vLLM's server \(pid (\d+)\) at (\S+) with (\S+) \((.+?)\)")


def server_pid(stderr: str) -> int:
    found = STARTED.search(stderr)
    assert found, stderr[-3000:]
    return int(found.group(1))


def assert_no_server(pid: int) -> None:
    assert not alive(pid) and not group_members(pid), f"vLLM's server {pid} (or its engine) outlived grpo-train"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The K=1 server run uninterrupted: (its run dir, its CompletedProcess)."""
    folder = tmp_path_factory.mktemp("straight")
    return folder / "run", run_cli([*SERVER, f"hydra.run.dir={folder / 'run'}"], folder, timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_run_trains_with_staleness_1_and_stops_its_server(straight):
    """Step t trains on version max(0, t - 1)'s batch from the server; every sync's probe gap is rounding (vLLM's
    CPU kernels against torch, both fp32); the sampler's log-probs are the generating version's: equal to the
    trainer's at step 0, a lag from step 1; the server is gone when grpo-train exits."""
    run, proc = straight
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = server_pid(proc.stderr)
    assert STARTED.search(proc.stderr).group(4) == "vllm imports in grpo-train's own python"
    assert_no_server(pid)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1, 2]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(0 <= r["sync/logp_gap"] <= 1e-3 for r in rows)
    assert rows[0]["sampler/logp_diff_max"] < 1e-3 < max(r["sampler/logp_diff_max"] for r in rows[1:])
    assert rows[2]["gen_sync_s"] > 0  # version 1 was loaded by name before step 2's batch
    assert_learned(run)
    assert "POST /v1/load_lora_adapter" in (run / "vllm-server.log").read_text()


# a server as a user starts one for rollout.server_url: runtime LoRA loading on
LORA_SERVER_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--enforce-eager"]
LORA_SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """vLLM's OpenAI-compatible server, started here as a user would start one for rollout.server_url: the base of
    SERVER's policy (the tiny model grpo-train builds from trainer.seed, written as vLLM loads it), runtime LoRA
    loading on, a free port of 127.0.0.1; (its base URL, its process)."""
    folder = tmp_path_factory.mktemp("served")
    with vllm_servers(saved_base(folder, SERVER), folder, LORA_SERVER_ARGS, LORA_SERVER_ENV) as [served]:
        yield served


def served_models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/models", timeout=10) as answer:
        return [m["id"] for m in json.load(answer)["data"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_weight_sync_that_does_not_happen_stops_a_run_on_a_given_server_in_one_line(tmp_path, lora_server):
    """On a server given by rollout.server_url, the hook loads version 0's adapter under version 1's name: steps 0
    and 1 pass the check (the server serves the trainer's base: else version 0 would fail it already), the probe's
    log-probs differ once the first update moved the adapter, and the run stops before step 2's update,
    checkpointed; the server, not grpo-train's, still runs, without this run's adapters."""
    from grpo_cli.rollout.server import SKIP_SYNC_TEST_HOOK

    url, server = lora_server
    run = tmp_path / "run"
    proc = run_cli([*SERVER, f"rollout.server_url={url}", f"hydra.run.dir={run}"], tmp_path, timeout=280,
                   env={SKIP_SYNC_TEST_HOOK: "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert not STARTED.search(proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-train: sync check failed at step 2: after the weight sync of policy version 1 "
                           "vLLM's server's log-probs on the probe sequence differ from the trainer's by "), last
    gap = float(re.search(r"differ from the trainer's by (\S+), over the tolerance 0.001: ", last).group(1))
    assert gap > 1e-3, last
    assert last.endswith(stopped_after(2, run)), last
    assert (run / "checkpoints" / "step-000002" / "rollout_versions.safetensors").is_file()
    assert [r["sync/logp_gap"] <= 1e-3 for r in read_jsonl(run / "metrics.jsonl")] == [True, True]
    assert server.poll() is None
    assert not [name for name in served_models(url) if name.startswith("grpo-")], served_models(url)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_stops_the_run_and_its_server_and_the_resume_is_the_straight_run(tmp_path, straight):
    """SIGTERM during step 1's scoring: the run checkpoints after step 1 (with version 0's adapter, which step 1's
    in-flight batch came from) and exits 143, the server gone; trainer.resume=auto, on a new server, regenerates
    that batch and ends with the uninterrupted run's adapter, bitwise (the same seeds on the same weights)."""
    from test_async_rollouts import assert_same_adapter

    run, record = tmp_path / "run", tmp_path / "record"
    proc = run_cli([*SERVER, f"hydra.run.dir={run}"], tmp_path, timeout=280, env=signal_at(1, "self", record))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("grpo-train: stopped by SIGTERM after 1 complete step(s)")
    assert (run / "checkpoints" / "step-000001" / "rollout_versions.safetensors").is_file()
    assert_no_server(server_pid(proc.stderr))

    proc = run_cli([*SERVER, f"hydra.run.dir={run}", "trainer.resume=auto"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
    assert_same_adapter(straight[0], run)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_9_of_grpo_train_takes_its_server_down_and_the_resume_is_the_straight_run(tmp_path, straight):
    """kill -9 of grpo-train during step 2's scoring, no safe point: the server it started goes too (the kernel's
    parent-death signal asks it to stop, and it stops its engine); trainer.resume=auto from the periodic checkpoint
    after 2 steps regenerates the batch that was in flight and ends with the uninterrupted run's adapter, bitwise."""
    from test_async_rollouts import assert_same_adapter, gone_within

    run, record = tmp_path / "run", tmp_path / "record"
    every_step = ["trainer.save_every=1", f"hydra.run.dir={run}"]
    proc = run_cli([*SERVER, *every_step], tmp_path, timeout=280, env=signal_at(2, "kill", record))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    server = server_pid(proc.stderr)
    assert gone_within(server, 60), f"vLLM's server {server} outlived grpo-train's kill -9"
    deadline = time.monotonic() + 60
    while group_members(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert_no_server(server)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1]

    killed_log = (run / "vllm-server.log").read_text()

    proc = run_cli([*SERVER, *every_step, "trainer.resume=auto"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
    assert_same_adapter(straight[0], run)
    log = (run / "vllm-server.log").read_text()  # the killed attempt's server log, then the resumed one's
    assert log.startswith(killed_log) and killed_log.count(STARTS) == 1 and log.count(STARTS) == 2


@pytest.mark.timeout(300)
def test_a_server_that_ends_before_it_answers_is_named_by_its_own_last_error(tmp_path):
    """A server started into the log of an earlier attempt (a resumed run's) that ends at once (no model in the
    folder): one line with its exit code and its own error, not the earlier attempt's; the earlier lines are kept."""
    log, empty = tmp_path / "vllm-server.log", tmp_path / "no-model"
    empty.mkdir()
    earlier = f"{STARTS} by grpo-train (pid 1) at 2026-12-01 00:00:00\nValueError: an earlier attempt's error\n"
    log.write_text(earlier)
    server = VLLMServer(empty, log, dtype="float32", lora_rank=8, max_loras=2, seed=0, max_model_len=None,
                        kv_cache_gib=1, gpu_memory_utilization=0.5, threads=1, cpu=True)
    try:
        with pytest.raises(WorkerError) as err:
            wait_until_up(ServerAPI(server.url), server, 240, lambda: False)
    finally:
        server.stop()
    line = str(err.value)
    assert re.match(rf"vLLM's server \(pid {server.process.pid}\) ended with exit code [1-9]\d* before it answered: ",
                    line), line
    assert "earlier attempt" not in line and str(empty) in line and "\n" not in line
    assert log.read_text().startswith(earlier) and log.read_text().count(STARTS) == 2


def test_refusals_in_one_line(compose):
    from grpo_cli.run.validate import validate

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose([*TINY_TRAINER, *VARIED_REWARD, *overrides]))
        return str(err.value)

    assert refusal("rollout.placement=server", "rollout.tools=[grpo_cli.calculator.calculator]") == (
        "rollout.placement=server is invalid: does not run tools and environments (rollout.tools, env) yet; use "
        "rollout.placement=local")
    assert refusal("rollout.server_url=http://127.0.0.1:8000/v1") == (
        "rollout.server_url=http://127.0.0.1:8000/v1 is invalid: is read only with rollout.placement=server; add it "
        "or drop rollout.server_url")
    assert "needs an http(s):// base URL" in refusal("rollout.placement=server", "rollout.server_url=localhost:8000")
    assert "does not run algo.filter_groups" in refusal("rollout.placement=server", "algo.filter_groups=true")
    assert validate(compose([*TINY_TRAINER, "rollout.placement=server", "rollout.max_staleness=2",
                             "algo.sampler_correction=token_mask"])) == []
