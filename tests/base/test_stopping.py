"""The stop request with real signals, and the generation stop hook on the real tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_cli.base.stopping import StopRequest

SIGNALS_ASKED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # an ssh drop or a closed terminal sends SIGHUP
SIGNALLED = textwrap.dedent("""
    import os, signal, sys, time
    from grpo_cli.base.stopping import StopRequest

    stop = StopRequest("prog")
    with stop.installed():
        os.kill(os.getpid(), signal.SIG{first})
        time.sleep(0.2)
        print("flag", stop(), stop.name, flush=True)
        os.kill(os.getpid(), signal.SIG{second})
        time.sleep(0.5)
        print("still running", flush=True)
    print("handlers restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
""")


def run_signalled(first: str, second: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGNALLED.format(first=first, second=second)], capture_output=True,
                          text=True, timeout=60)


def test_first_sigint_sets_the_flag_second_ends_the_process_at_once():
    proc = run_signalled("INT", "INT")
    assert proc.stdout.splitlines() == ["flag True SIGINT"]
    assert proc.returncode == -signal.SIGINT  # killed by the signal itself: a shell reports 130
    assert proc.stderr.splitlines() == [
        "prog: SIGINT received: stopping now (an unfinished step is discarded, the last complete one is kept); "
        "Ctrl-C again to exit at once"]


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_sigint_after_sigterm_also_ends_it_but_a_repeated_sigterm_does_not():
    assert run_signalled("TERM", "INT").returncode == -signal.SIGINT
    proc = run_signalled("TERM", "TERM")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["flag True SIGTERM", "still running", "handlers restored True"]
    assert len(proc.stderr.splitlines()) == 1  # announced once


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_sighup_is_a_stop_request_like_sigterm():
    """What an ssh drop or a closed terminal sends: a stop at the next safe point, not the end of the process."""
    proc = run_signalled("HUP", "HUP")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["flag True SIGHUP", "still running", "handlers restored True"]
    assert proc.stderr.splitlines() == [
        "prog: SIGHUP received: stopping now (an unfinished step is discarded, the last complete one is kept); "
        "Ctrl-C again to exit at once"]
    assert run_signalled("HUP", "INT").returncode == -signal.SIGINT


@pytest.mark.parametrize("signum", SIGNALS_ASKED, ids=lambda s: signal.Signals(s).name)
def test_each_stop_signal_sets_the_flag_in_process(signum):
    """The fast check of the three signals a run must stop on (the subprocess tests above and test_signals.py see
    the whole behaviour): each one only sets the flag, and leaving restores the handlers."""
    before = signal.getsignal(signum)
    stop = StopRequest("prog", announce=False)
    with stop.installed():
        os.kill(os.getpid(), signum)  # a signal the run does not handle ends this process: the test fails loudly
        assert stop() and stop.signum == signum
    assert signal.getsignal(signum) == before


def test_announce_only_on_rank_zero(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert StopRequest().announce is False
    monkeypatch.setenv("RANK", "0")
    assert StopRequest().announce is True


def tiny_model():
    from grpo_cli.model.loading import load_base_model, load_tokenizer

    tokenizer = load_tokenizer("tiny-random")
    return load_base_model("tiny-random", tokenizer, torch.float32, seed=0), tokenizer


@pytest.mark.slow
def test_generate_polls_stop_every_decode_step():
    from grpo_cli.rollout import generate

    model, tokenizer = tiny_model()
    prompts = [tokenizer("What is 1 + 1?")["input_ids"], tokenizer("Hi")["input_ids"]]
    polls = []

    def stop_after_three() -> bool:
        polls.append(1)
        return len(polls) >= 3

    torch.manual_seed(0)
    cut = generate(model, tokenizer, prompts, num_generations=2, max_new_tokens=200, min_new_tokens=200,
                   stop=stop_after_three)
    assert cut.interrupted and len(polls) == 3
    assert cut.completion_ids.shape == (4, 3)  # one token per poll, then no more

    torch.manual_seed(0)
    full = generate(model, tokenizer, prompts, num_generations=2, max_new_tokens=20, min_new_tokens=20,
                    stop=lambda: False)
    assert not full.interrupted and full.completion_ids.shape == (4, 20)
    assert torch.equal(full.completion_ids[:, :3], cut.completion_ids)  # polling changes nothing else
    assert not generate(model, tokenizer, prompts, num_generations=2, max_new_tokens=2).interrupted


def test_a_request_installed_in_another_thread_follows_the_main_threads(capfd):
    """A sweep job in a thread of its own (hydra/launcher=shared_base) cannot own the signal handlers: its request
    follows the main thread's, which passes a signal on once (announced once), and one that came before it was
    installed reaches it at once."""
    import threading

    leader = StopRequest("prog", effect="every job stops")
    seen: dict[str, object] = {}

    def job(name: str, ready: threading.Event, go: threading.Event) -> None:
        follower = StopRequest("prog")
        with follower.installed():
            ready.set()
            go.wait(10)
            seen[name] = follower.signum
        seen[name + " after"] = len(leader.followers)

    with leader.installed():
        ready, go = threading.Event(), threading.Event()
        first = threading.Thread(target=job, args=("first", ready, go))
        first.start()
        assert ready.wait(10)
        os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler takes it
        late_ready = threading.Event()
        late = threading.Thread(target=job, args=("late", late_ready, go))
        late.start()
        assert late_ready.wait(10)
        go.set()
        first.join(10)
        late.join(10)
    assert seen["first"] == seen["late"] == signal.SIGTERM
    assert capfd.readouterr().err.count("SIGTERM received") == 1
    assert leader.followers == []
