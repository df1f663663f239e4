"""The tests' launcher (tests/prewarmed.py) runs a console script in a fork of a process that has already imported
the libraries: what it gives must be what an exec of the installed script gives."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import prewarmed
import pytest
from conftest import TRAINED_TINY, read_jsonl, script

FORKS = os.environ.get("OMP_NUM_THREADS") == "1"
SHORT = [*TRAINED_TINY, "trainer.max_steps=2", "trainer.save_every=0"]


def untimed(run) -> list[dict]:
    """The run's metrics without its clock readings (seconds, tokens per second)."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.skipif(not FORKS, reason="the launcher forks only where torch runs one thread (make test's workers)")
def test_a_forked_run_equals_an_executed_one(tmp_path):
    runs = {}
    for how, fresh in (("forked", False), ("executed", True)):
        run = tmp_path / how
        child = prewarmed.popen([script("grpo-train"), *SHORT, f"hydra.run.dir={run}"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, fresh=fresh)
        assert isinstance(child, prewarmed.Forked) is (not fresh)
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        runs[how] = (run, out)
    (forked, forked_out), (executed, executed_out) = runs["forked"], runs["executed"]
    adapter = "adapter/adapter_model.safetensors"
    assert (forked / adapter).read_bytes() == (executed / adapter).read_bytes()
    assert untimed(forked) == untimed(executed)
    assert forked_out.count("step 1 done (2/2)") == executed_out.count("step 1 done (2/2)") == 1


@pytest.mark.skipif(not FORKS, reason="the launcher forks only where torch runs one thread (make test's workers)")
def test_a_forked_child_has_its_own_pid_and_a_signal_ends_it_as_it_would_a_process(tmp_path):
    child = prewarmed.popen([script("grpo-train"), *TRAINED_TINY, "trainer.max_steps=500",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert isinstance(child, prewarmed.Forked) and child.pid != os.getpid()
    time.sleep(0.5)
    assert os.readlink(f"/proc/{child.pid}/cwd") == str(tmp_path)
    assert child.poll() is None
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_an_environment_that_an_import_reads_gets_a_real_exec(tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    child = prewarmed.popen([script("grpo-train"), "--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert isinstance(child, subprocess.Popen)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and "grpo-train" in out
