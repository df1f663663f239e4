"""The sandboxed code reward (grpo_cli.rewards.code, grpo_cli.rewards.sandbox): programs against tests, and hostile
programs.

Each hostile program is written so that the attack, had it worked, would also define a correct `add`: a sandbox
that let it through would score 1, not 0. The hostile tests run in every namespaced sandbox that works here
(`make setup` installs bubblewrap; unshare is util-linux's); rlimits alone isolates nothing and is not given them.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_cli.base.errors import ConfigError
from grpo_cli.rewards import RewardFunction, RewardSet, sandbox
from grpo_cli.rewards.code import check_options, passes_tests, program_of, split_tests

ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(-1, 1) == 0\n"
SOLUTION = "def add(a, b):\n    return a + b\n"
HUMANEVAL_TESTS = ("METADATA = {'author': 'x'}\n\n\ndef check(candidate):\n    assert True\n"
                   "    assert candidate(1, 2) == 3\n    for x in range(3):\n        assert candidate(x, 0) == x\n")
ISOLATING = [pytest.param(kind, marks=pytest.mark.skipif(sandbox.probe(kind) is not None,
                                                         reason=f"{kind} does not work here: {sandbox.probe(kind)}"))
             for kind in ("bwrap", "unshare")]


def run(completions: list[str], tests: str = ADD_TESTS, **options):
    options.setdefault("timeout_s", 2.0)
    return passes_tests([None] * len(completions), completions, [tests] * len(completions), **options)


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}```\nIt adds."


# ---- what a program scores ---------------------------------------------------------------------------
def test_the_share_of_tests_passed_and_each_outcome():
    scored = run([fenced(SOLUTION), SOLUTION, fenced("def add(a, b):\n    return a + b if a < 2 else 0\n"),
                  fenced("def add(a, b):\n    return a - b\n"), "I cannot write code.", "```java\nint add;\n```",
                  fenced("def add(a, b)\n    return\n"), fenced("raise ValueError('no')\n")])
    assert list(scored) == [1.0, 1.0, 2 / 3, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert scored.outcomes == ["passed 3/3", "passed 3/3", "failed 2/3", "failed 0/3",
                               "crashed: SyntaxError: invalid syntax (line 1)", "refused: no code",
                               "crashed: SyntaxError: expected ':' (line 1)", "crashed: ValueError: no"]
    assert scored.kinds == ("passed", "failed", "timeout", "crashed", "refused")


def test_all_or_nothing_scores_only_a_full_pass():
    scored = run([fenced(SOLUTION), fenced("def add(a, b):\n    return a + b if a < 2 else 0\n")], all_or_nothing=True)
    assert list(scored) == [1.0, 0.0]
    assert scored.outcomes == ["passed 3/3", "failed 2/3"]


def test_humaneval_form_each_assert_of_check_is_a_test_with_the_preamble_run_first():
    tests = HUMANEVAL_TESTS + "    assert helper() == 7\n"
    preamble = "from typing import List\n\ndef helper() -> int:\n    return 7\n"
    right = fenced("def add(a: int, b: int) -> int:\n    x: List[int] = [a, b]\n    return sum(x)\n")
    wrong = fenced("def add(a, b):\n    return a * b\n")
    scored = passes_tests([None, None], [right, wrong], [tests] * 2, entry_point=["add"] * 2, preamble=[preamble] * 2)
    assert scored.outcomes == ["passed 3/3", "failed 1/3"]  # `assert True` alone is no test; helper() always passes


def test_program_of_takes_the_block_that_defines_the_entry_point():
    text = "```python\nprint(add(1, 2))\n```\nand\n```python\ndef add(a, b):\n    return a + b\n```"
    assert program_of(text, "add") == "def add(a, b):\n    return a + b\n"
    assert program_of(text) == "print(add(1, 2))\n"
    assert program_of("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut by max_new_tokens
    assert program_of("x = 1") == "x = 1" and program_of(None) == ""


def test_tests_that_cannot_run_are_the_rows_fault_in_one_line():
    with pytest.raises(ValueError, match="hold no assert statement"):
        split_tests("x = 1\n")
    with pytest.raises(ValueError, match="not valid Python"):
        split_tests("assert (\n")
    with pytest.raises(ValueError, match="give the row an entry_point"):
        split_tests(HUMANEVAL_TESTS)
    assert [kind for kind, _ in split_tests(HUMANEVAL_TESTS, "add")] == ["setup", "setup", "setup", "test", "test"]


def test_programs_run_in_parallel_workers():
    slow = fenced("import time\ntime.sleep(0.5)\n" + SOLUTION)
    start = time.monotonic()
    scored = run([slow + f"\n# {i}" for i in range(4)], workers=4)  # distinct texts: no cached outcome
    assert list(scored) == [1.0] * 4
    assert time.monotonic() - start < 1.9  # four half-second programs one after the other would take 2 s


# ---- hostile programs --------------------------------------------------------------------------------
def processes_named(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def renamed(name: str) -> str:
    """Program text that names its process (and the children it forks) `name` in /proc/PID/comm."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"


@pytest.mark.parametrize("kind", ISOLATING)
def test_a_fork_bomb_scores_0_and_leaves_no_process(kind):
    name = f"bomb{secrets.token_hex(5)}"
    start = time.monotonic()
    scored = run([fenced(renamed(name) + "import os\nwhile True:\n    os.fork()\n" + SOLUTION)], sandbox=kind)
    assert list(scored) == [0.0], scored.outcomes
    assert time.monotonic() - start < 5
    assert processes_named(name) == []


@pytest.mark.parametrize("kind", ISOLATING)
def test_children_are_killed_with_the_program(kind):
    name = f"kid{secrets.token_hex(5)}"
    orphan = (renamed(name) + "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
              "    os._exit(0)\n")
    scored = run([fenced(orphan + SOLUTION)], sandbox=kind)
    assert scored.outcomes == ["passed 3/3"]
    time.sleep(0.2)
    assert processes_named(name) == []


# A trainer scoring one completion with the code reward in sandbox argv[1], for 100 s at most
TRAINER = ("import sys\nfrom grpo_cli.rewards.code import passes_tests\n"
           "passes_tests([None], [sys.argv[2]], ['assert add(1, 2) == 3'], sandbox=sys.argv[1], timeout_s=100)\n")


@pytest.mark.parametrize("kind", [*ISOLATING, "rlimits"])
def test_a_program_running_when_its_trainer_is_killed_ends_with_it(kind):
    """kill -9 of the trainer while its program sleeps: no process of the sandbox is left (the program's own
    children under rlimits aside: nothing contains them there)."""
    name = f"late{secrets.token_hex(5)}"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, kind,
                                fenced(renamed(name) + "import time\ntime.sleep(100)\n" + SOLUTION)])
    try:
        deadline = time.monotonic() + 60
        while not processes_named(name) and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.1)
        assert processes_named(name), f"the program never ran (trainer exit code {trainer.poll()})"
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10  # the kernel's SIGKILL is at once; 10 s for a busy machine's reaping
    while processes_named(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_named(name) == []


@pytest.mark.parametrize("kind", ISOLATING)
def test_a_memory_bomb_scores_0(kind):
    scored = run([fenced("blocks = [bytearray(1 << 28) for _ in range(64)]\n" + SOLUTION)], sandbox=kind, memory_mb=512)
    assert list(scored) == [0.0]
    assert scored.outcomes == ["crashed: MemoryError"]


@pytest.mark.parametrize("kind", ISOLATING)
def test_an_endless_loop_scores_0_within_the_time_limit(kind):
    start = time.monotonic()
    scored = run([fenced("while True:\n    pass\n" + SOLUTION)], sandbox=kind, timeout_s=1.0)
    assert scored.outcomes == ["timeout"] and list(scored) == [0.0]
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("kind", ISOLATING)
def test_writes_to_home_and_to_the_run_dir_score_0_and_write_nothing(kind, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token = secrets.token_hex(6)
    targets = [Path.home() / f"grpo-sandbox-{token}", run_dir / "pwned", Path(os.getcwd()) / f"grpo-sandbox-{token}"]
    try:
        scored = run([fenced(f"open({str(t)!r}, 'w').write('x')\n" + SOLUTION) for t in targets]
                     + [fenced(f"import os\nos.remove({str(run_dir / 'keep')!r})\n" + SOLUTION)], sandbox=kind)
        (run_dir / "keep").write_text("kept")
        assert list(scored) == [0.0] * 4, scored.outcomes
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ISOLATING)
def test_a_read_outside_the_sandbox_scores_0(kind, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    scored = run([fenced(f"text = open({str(secret)!r}).read()\n" + SOLUTION),
                  fenced("text = open('/etc/passwd').read()\n" + SOLUTION),
                  fenced(f"import os\nnames = os.listdir({str(Path(__file__).parent)!r})\n" + SOLUTION)], sandbox=kind)
    assert list(scored) == [0.0] * 3, scored.outcomes
    assert all(o.startswith("crashed: FileNotFoundError") for o in scored.outcomes), scored.outcomes


@pytest.fixture
def listener():
    """A TCP server on this host (all interfaces) that records each connection it accepts."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    accepted, done = [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    done.set()
    thread.join()
    server.close()


@pytest.mark.parametrize("kind", ISOLATING)
def test_no_network_not_even_the_hosts_loopback(kind, listener):
    port, accepted = listener
    addresses = ["127.0.0.1"]
    try:
        addresses.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    with socket.create_connection(("127.0.0.1", port), timeout=2):  # the server does take connections
        pass
    time.sleep(0.3)
    assert len(accepted) == 1
    scored = run([fenced(f"import socket\nsocket.create_connection(({a!r}, {port}), timeout=1).sendall(b'hi')\n"
                         + SOLUTION) for a in addresses], sandbox=kind)
    time.sleep(0.3)
    assert list(scored) == [0.0] * len(addresses), scored.outcomes
    assert len(accepted) == 1


@pytest.mark.parametrize("kind", ISOLATING)
def test_killing_the_parent_or_another_process_scores_0_and_kills_nothing(kind):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kills = f"import os\nos.kill(os.getppid(), 9)\nos.kill({victim.pid}, 9)\nos.kill({os.getpid()}, 9)\n"
        scored = run([fenced(kills + SOLUTION)], sandbox=kind)
        assert list(scored) == [0.0], scored.outcomes
        # its parent is the harness's judge, in the sandbox with it: killing it leaves no verdict (crashed)
        assert scored.outcomes[0].startswith("crashed: "), scored.outcomes
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("kind", ISOLATING)
def test_100_mb_of_output_is_cut_off_and_scores_0(kind):
    start = time.monotonic()
    scored = run([fenced("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n" + SOLUTION)],
                 sandbox=kind)
    assert scored.outcomes == ["crashed: output over max_output_bytes"]
    assert time.monotonic() - start < 3


def test_rlimits_alone_still_bounds_time_memory_and_output():
    scored = run([fenced("while True:\n    pass\n"), fenced("x = bytearray(1 << 31)\n"),
                  fenced("print('x' * 10_000_000)\n"), fenced(SOLUTION)], sandbox="rlimits", timeout_s=1.0,
                 memory_mb=512)
    assert scored.outcomes == ["timeout", "crashed: MemoryError", "crashed: output over max_output_bytes",
                               "passed 3/3"]


# ---- options and the sandbox set up before the model loads -------------------------------------------------
def test_bad_options_are_one_line():
    for options, message in [({"timeout": 3}, "takes no option timeout"), ({"memory_mb": 10}, "an integer >= 64"),
                             ({"sandbox": "docker"}, "one of auto, bwrap, unshare, rlimits"),
                             ({"all_or_nothing": "yes"}, "true or false"), ({"workers": 0}, "an integer >= 1")]:
        with pytest.raises(ConfigError, match=message):
            check_options("reward.functions.tests", options)
    check_options("reward.functions.tests", {"timeout_s": 2, "workers": None, "sandbox": "rlimits"})


WITHOUT_USER_NAMESPACES = ["bwrap", "--dev-bind", "/", "/", "--unshare-user", "--disable-userns", "--"]


@pytest.mark.skipif(sandbox.probe("bwrap") is not None, reason="needs bubblewrap to forbid user namespaces")
def test_where_no_namespace_works_auto_warns_in_one_line_and_a_named_sandbox_is_refused():
    """A process that may not create user namespaces (inside bwrap --disable-userns): auto falls back to rlimits
    alone with one warning line; sandbox=bwrap is a ConfigError that says why and what to do."""
    code = ("from grpo_cli.rewards.code import check_options\n"
            "from grpo_cli.base.errors import ConfigError\n"
            "check_options('reward.functions.tests', {})\n"
            "try:\n    check_options('reward.functions.tests', {'sandbox': 'bwrap'})\n"
            "except ConfigError as err:\n    print(err)\n")
    proc = subprocess.run([*WITHOUT_USER_NAMESPACES, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    if "--disable-userns" in proc.stderr:
        pytest.skip("this bubblewrap has no --disable-userns")
    warning = proc.stderr.strip().splitlines()
    if os.geteuid() == 0 and "could signal the trainer" in proc.stderr:  # root that cannot switch to nobody there
        assert warning[-1].startswith("grpo_cli.base.errors.ConfigError: reward.functions.tests.sandbox=auto cannot "
                                      "be set up: no sandbox works here ("), proc.stderr
        assert "rlimits: run as root, its programs could signal the trainer" in warning[-1]
        assert "name sandbox=rlimits to accept that" in warning[-1]
        return
    no_namespaces = "warning: reward.functions.tests: neither bubblewrap nor unshare namespaces work here"
    assert len(warning) == 1 and no_namespaces in warning[0] and "rlimits alone" in warning[0], proc.stderr
    assert "(the trainer included)" in warning[0] or "cannot signal the trainer" in warning[0]
    assert proc.stdout.startswith("reward.functions.tests.sandbox=bwrap cannot be set up: the bwrap sandbox does not "
                                  "work here ("), proc.stdout
    assert "allow user namespaces" in proc.stdout and proc.stdout.count("\n") == 1


# ---- outcomes through the reward set -------------------------------------------------------------------
def test_the_reward_set_keeps_the_outcomes_and_on_error_zero_marks_the_failures():
    def tests_or_raise(prompts, completions, tests, **_):
        if any("boom" in c for c in completions):
            raise RuntimeError("boom")
        return passes_tests(prompts, completions, tests, timeout_s=2.0)

    rewards = RewardSet([RewardFunction("code", tests_or_raise, 1.0)], on_error="zero")
    scoring = rewards.score_all(["p"] * 3, [fenced(SOLUTION), "boom", fenced("x = 1\n")], {"tests": [ADD_TESTS] * 3})
    assert scoring.totals == [1.0, 0.0, 0.0] and scoring.errors == 1
    assert scoring.outcomes["code"].texts == ["passed 3/3", "error", "failed 0/3"]
    assert scoring.outcomes["code"].counts() == {"passed": 1, "failed": 1, "timeout": 0, "crashed": 0,
                                                 "refused": 0, "error": 1}
