"""A reward for tests on the tiny random model, imported by the grpo-train processes they start (tests/conftest.py
puts this folder on their PYTHONPATH): it varies with the completion, so groups have spread and the adapter moves.
The quickstart reward alone scores every random completion 0: nothing is learned, and a resume test that compares
adapters compares two untouched ones."""


def by_length(prompts, completions, **_):
    return [len(c) % 5 / 4 for c in completions]


def by_length_with_a_signal(prompts, completions, **_):
    """`by_length`, and at its call number $SIGNAL_AT_CALL (the step's scoring: one call a step) a signal, for the
    rollout-worker and server tests: SIGNAL_TO=worker SIGKILLs the rollout worker (the grpo-train process's child that
    multiprocessing spawned), SIGNAL_TO=stop_worker SIGSTOPs it, SIGNAL_TO=self SIGTERMs grpo-train, SIGNAL_TO=kill
    SIGKILLs it, SIGNAL_TO=server SIGKILLs the first vLLM server grpo-train started (its process group: the server and
    its engine), SIGNAL_TO=servers every one, SIGNAL_TO=server-stop SIGSTOPs the first (a server that hangs); the
    worker's pid (the servers' pids) is written to $SIGNAL_RECORD first. Without SIGNAL_AT_CALL it is `by_length`."""
    import os
    import signal
    from pathlib import Path

    global _calls
    _calls = globals().get("_calls", 0) + 1
    if str(_calls) == os.environ.get("SIGNAL_AT_CALL"):
        to = os.environ["SIGNAL_TO"]
        marker = b"vllm.entrypoints" if to.startswith("server") else b"spawn_main"
        workers = sorted(int(p.name) for p in Path("/proc").iterdir()
                         if p.name.isdigit() and _spawned_by(p, os.getpid(), marker))
        Path(os.environ["SIGNAL_RECORD"]).write_text(" ".join(map(str, workers)))
        if to.startswith("server"):
            signum = signal.SIGSTOP if to == "server-stop" else signal.SIGKILL
            for server in workers if to == "servers" else workers[:1]:
                os.killpg(server, signum)
        elif to == "worker":
            os.kill(workers[0], signal.SIGKILL)
        elif to == "stop_worker":  # a worker that makes no progress any more
            os.kill(workers[0], signal.SIGSTOP)
        elif to == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
    return by_length(prompts, completions)


def _spawned_by(proc, parent: int, marker: bytes) -> bool:
    try:
        stat, cmdline = (proc / "stat").read_text(), (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent and marker in cmdline


def by_length_with_credentials(prompts, completions, api_key=None, hf_token=None, **_):
    """`by_length`, for the secrets test (tests/test_secrets.py): it gets its credentials resolved, as given, and
    fails the run when it does not ($EXPECTED_API_KEY, $EXPECTED_HF_TOKEN)."""
    import os

    if (api_key, hf_token) != (os.environ.get("EXPECTED_API_KEY"), os.environ.get("EXPECTED_HF_TOKEN")):
        raise ValueError("the reward did not get its credentials as given")
    return by_length(prompts, completions)
