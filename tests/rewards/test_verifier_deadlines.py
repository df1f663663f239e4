"""A remote reward that is dead or never answers: refused in one line before the model loads; a request that hangs
mid-run neither keeps a SIGTERM'd run alive nor the process after its last line; urllib3's retry lines stay off the
console. Real HTTP servers on 127.0.0.1 (tests/rewards/test_remote_rewards.py's), real grpo-train processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import run_cli
from test_reliability import start, stderr_lines_after_signal, wait_for
from test_remote_rewards import Server, json_reply, refusing_url

from grpo_cli.base.errors import ConfigError
from grpo_cli.rewards.remote import RemoteVerifier

TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
        "data.prompts_per_step=2", "algo.num_generations=2", "trainer.save_every=1",
        "+reward.functions.verified._target_=grpo_cli.rewards.remote.RemoteVerifier",
        "+reward.functions.verified.weight=1.0"]


class Silent:
    """A listener on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent():
    s = Silent()
    yield s
    s.close()


def test_a_dead_or_silent_verifier_is_one_line_when_checked(silent):
    dead = refusing_url()
    with pytest.raises(ConfigError, match=rf"reward.functions.v.url={dead} does not answer \(Connection refused"):
        RemoteVerifier.check_options("reward.functions.v", {"url": dead})
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"does not answer \(timed out within reward.functions.v.timeout_s=1 s"):
        RemoteVerifier.check_options("reward.functions.v", {"url": silent.url, "timeout_s": 1})
    assert time.monotonic() - t0 < 5


RETRIES = """
import logging, sys
logging.basicConfig(level=logging.INFO)  # as Hydra's job logging does in grpo-train: a console handler on the root
from grpo_cli.rewards import RewardFunction, RewardSet
from grpo_cli.rewards.remote import RemoteVerifier
verifier = RemoteVerifier(url=sys.argv[1], retries=2, backoff_s=0.0)
RewardSet([RewardFunction("verified", verifier, 1.0)], on_error="zero").score(["p"], ["x"], {})
"""


def test_urllib3_retry_lines_stay_off_the_console():
    """urllib3 logs every retry ("Retrying (Retry(total=1, ...)) after connection broken by ...") on stderr around
    the one line that says the request failed (a process of its own: pytest's log capture would hide them)."""
    proc = subprocess.run([sys.executable, "-c", RETRIES, refusing_url()], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


@pytest.mark.slow
def test_a_run_whose_verifier_never_answers_is_refused_before_the_model_loads(tmp_path, silent):
    proc = run_cli([*TINY, f"+reward.functions.verified.url={silent.url}", "+reward.functions.verified.timeout_s=2",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"grpo-train: reward.functions.verified.url={silent.url} does not answer (timed out within "
        "reward.functions.verified.timeout_s=2 s, checked before the model loads); start the service or fix the url"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_ends_a_run_whose_verifier_hangs_within_seconds(tmp_path):
    """The verifier answers the check and step 0, then holds every request of step 1: with timeout_s=60 and 2 retries
    each request would take 3 minutes. SIGTERM stops the run with its line and the process ends at once."""
    hanging = threading.Event()

    def answer(path, body):
        if answer.posts >= 4:  # step 0's 2 x 2 completions scored
            hanging.set()
            time.sleep(600)
        answer.posts += 1
        return json_reply({"score": len(body["completion"]) % 3})

    answer.posts = 0
    server = Server(answer)
    try:
        run = tmp_path / "run"
        child = start([*TINY, f"+reward.functions.verified.url={server.url}/score",
                       "+reward.functions.verified.timeout_s=60", "+reward.functions.verified.retries=2",
                       "trainer.max_steps=3", f"hydra.run.dir={run}"], tmp_path)
        try:
            wait_for(hanging.is_set, child)
            time.sleep(1)
            lines, seconds = stderr_lines_after_signal(child, signal.SIGTERM)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 128 + signal.SIGTERM, lines
        assert lines[-1][1].startswith("grpo-train: stopped by SIGTERM after 1 complete step(s)"), lines
        assert seconds < 20, (lines, seconds)
        assert (run / "checkpoints" / "step-000001").is_dir()
    finally:
        server.close()


@pytest.mark.slow
def test_a_failed_run_ends_with_its_line_while_a_request_hangs(tmp_path):
    """reward.timeout_s=3 abandons the hanging call and the run ends in one line; the request itself (timeout_s=60,
    2 retries) must not keep the process alive after that line."""
    def answer(path, body):
        if answer.posts >= 4:
            time.sleep(600)
        answer.posts += 1
        return json_reply({"score": 1.0})

    answer.posts = 0
    server = Server(answer)
    try:
        t0 = time.monotonic()
        proc = run_cli([*TINY, f"+reward.functions.verified.url={server.url}/score",
                        "+reward.functions.verified.timeout_s=60", "+reward.functions.verified.retries=2",
                        "reward.timeout_s=3", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, timeout=170)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "did not return within reward.timeout_s=3" in proc.stderr.strip().splitlines()[-1]
        assert time.monotonic() - t0 < 120
    except subprocess.TimeoutExpired:
        pytest.fail("grpo-train went on after its last line while the request hung")
    finally:
        server.close()
