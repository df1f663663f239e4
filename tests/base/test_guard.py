"""base/guard.py with real processes: a group whose starter is killed with SIGKILL ends too, SIGTERM first and SIGKILL
where SIGTERM is not enough; a group its starter ended releases its watcher without a signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import alive, group_members

from grpo_cli.base.guard import Guard, end_group

# A process group that ignores SIGTERM and SIGINT, leader and child, as a server whose shutdown stalls: only SIGKILL
# ends it. "ready" once both ignore them.
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    IGNORE = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (2, 15)]; print('child', flush=True); " \\
             "time.sleep(600)"
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", IGNORE], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print("ready", child.pid, flush=True)
    time.sleep(600)
""")
# A group that ends on SIGTERM, saying so.
POLITE = textwrap.dedent("""
    import signal, sys, time
    def leave(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    print("ready", flush=True)
    time.sleep(600)
""")
# What grpo-train does with its server: the group in a session of its own, a Guard beside it; then it waits, to be
# killed. Prints the group's pid and the watcher's.
STARTER = textwrap.dedent("""
    import subprocess, sys, time
    from grpo_cli.base.guard import Guard
    log = open(sys.argv[1], "w")
    group = subprocess.Popen([sys.executable, "-c", sys.argv[3]], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    guard = Guard(group.pid, log, float(sys.argv[2]))
    print(group.pid, guard.process.pid, flush=True)
    time.sleep(600)
""")
GUARD_LINE = "ended without stopping it; ending the group"


def until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def started(tmp_path: Path, program: str, term_s: float, ready_lines: int) -> tuple[subprocess.Popen, int, int, Path]:
    """The starter, the group's pid, the watcher's pid, the log; returns once the group is ready."""
    log = tmp_path / "server.log"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(log), str(term_s), program],
                               stdout=subprocess.PIPE, text=True)
    group, watcher = map(int, starter.stdout.readline().split())
    assert until(lambda: log.read_text().count("ready") >= ready_lines, 60), log.read_text()
    return starter, group, watcher, log


def test_kill_9_of_the_starter_ends_a_group_that_ignores_sigterm(tmp_path):
    starter, group, watcher, log = started(tmp_path, STUBBORN, 0.5, 1)
    assert len(group_members(group)) == 2
    starter.kill()
    starter.wait()
    # 0.5 s of SIGTERM, then SIGKILL, which nothing survives; 10 s: the watcher's polls (0.05 s) and a busy machine
    assert until(lambda: not group_members(group), 10), f"still there: {group_members(group)}; {log.read_text()}"
    assert until(lambda: not alive(watcher), 10)
    assert f"pid {starter.pid}, which started process group {group}, {GUARD_LINE} (SIGTERM, SIGKILL 0.5 s later)" \
        in log.read_text()


def test_kill_9_of_the_starter_sends_sigterm_first(tmp_path):
    starter, group, watcher, log = started(tmp_path, POLITE, 30, 1)
    starter.kill()
    starter.wait()
    # 30 s before a SIGKILL: gone well before means SIGTERM ended it
    assert until(lambda: not group_members(group), 20), log.read_text()
    assert "got SIGTERM" in log.read_text()
    assert until(lambda: not alive(watcher), 10)


def test_a_released_watcher_exits_without_a_signal_or_a_line(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        group = subprocess.Popen([sys.executable, "-c", POLITE], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        guard = Guard(group.pid, out, 30)
    assert until(lambda: "ready" in log.read_text(), 60)
    end_group(group.pid, 30, leader=group)
    assert group.returncode == 0 and "got SIGTERM" in log.read_text()
    guard.release()
    assert guard.process.returncode == 0
    assert GUARD_LINE not in log.read_text()


def test_end_group_kills_what_ignores_sigterm_after_term_s(tmp_path):
    log = tmp_path / "group.log"
    with log.open("w") as out:
        group = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    assert until(lambda: "ready" in log.read_text(), 60)
    began = time.monotonic()
    end_group(group.pid, 0.5, leader=group)
    assert time.monotonic() - began >= 0.5  # SIGTERM had its time
    assert group.returncode == -signal.SIGKILL and not group_members(group.pid)
