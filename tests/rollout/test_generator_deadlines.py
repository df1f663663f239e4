"""A rollout worker that makes no progress (SIGSTOP): with rollout.generator_timeout_s the run stops in one line with
its checkpoint, the worker gone; without one, SIGTERM still ends grpo-train within seconds."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import run_cli
from test_async_rollouts import SIGNALLING, gone_within, signal_at, stopped_after
from test_reliability import start, stderr_lines_after_signal, wait_for


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_stopped_worker_is_one_line_and_a_stop_with_the_checkpoint(tmp_path):
    """SIGSTOP to the worker during step 1's scoring: step 2 waits for its batch; 30 s without a message and the run
    stops in one line with the state after 2 steps checkpointed, the worker gone."""
    record, run = tmp_path / "worker.pid", tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli([*SIGNALLING, "rollout.generator_timeout_s=30", f"hydra.run.dir={run}"], tmp_path, timeout=360,
                   env=signal_at(1, "stop_worker", record))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert record.exists(), proc.stderr[-3000:]
    worker = int(record.read_text())
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-train: the rollout worker sent nothing for 30 s (rollout.generator_timeout_s=30) "
                           "before it "), last
    assert last.endswith(stopped_after(2, run)), last
    assert (run / "checkpoints" / "step-000002" / "rollout_versions.safetensors").is_file()
    assert gone_within(worker, 10), f"the stopped rollout worker {worker} outlived grpo-train"
    assert time.monotonic() - t0 < 300


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_ends_a_run_whose_worker_is_stopped_within_seconds(tmp_path):
    record, run = tmp_path / "worker.pid", tmp_path / "run"
    import os

    os.environ.update(signal_at(1, "stop_worker", record))
    try:
        child = start([*SIGNALLING, "rollout.generator_timeout_s=null", f"hydra.run.dir={run}"], tmp_path)
    finally:
        for key in signal_at(1, "stop_worker", record):
            del os.environ[key]
    try:
        wait_for(lambda: record.exists() and record.read_text().strip(), child)
        time.sleep(3)  # the trainer is waiting for the stopped worker's next batch
        lines, seconds = stderr_lines_after_signal(child, signal.SIGTERM)
    finally:
        if child.poll() is None:
            child.kill()
    worker = int(record.read_text())
    assert child.returncode == 128 + signal.SIGTERM, lines
    assert lines[-1][1].startswith("grpo-train: stopped by SIGTERM after "), lines
    assert seconds < 20, (lines, seconds)
    assert gone_within(worker, 10), f"the stopped rollout worker {worker} outlived grpo-train"
