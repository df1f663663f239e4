"""A process group that ends with the process that started it, whatever ended that one, kill -9 included.

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) sends one signal, once; a server whose shutdown then stalls
outlives its starter: vLLM's API server takes the first SIGTERM or SIGINT as "shut down" and ignores any further
one (its launcher's signal_handler), and one has outlived a kill -9 of grpo-train by more than a minute.
`Guard` starts a watcher process for the group, in a session of its own (a Ctrl-C in the terminal or a signal to
grpo-train's process group does not reach it), blocked on a pipe that only the starter holds open. End of file
means the starter ended, or released it after ending the group itself; the watcher then does what `end_group`
does: SIGTERM, SIGKILL once the group had `term_s` to go, and exits once the group is gone (or did not go within
KILL_WAIT_S of the SIGKILL, a zombie nobody reaps).

Run as `python -m grpo_cli.base.guard PGID STARTER TERM_S`, its stdin the pipe's read end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

KILL_WAIT_S = 10.0
RELEASED = b"released"  # what the starter writes before it closes the pipe on purpose


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a process (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(pgid: int, term_s: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM to process group `pgid`; SIGKILL if it is still there `term_s` later; back once it is gone, or
    KILL_WAIT_S after the SIGKILL. `leader`, when it is this process's child, is reaped as it ends, so that its zombie
    does not count as the group."""
    for signum, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            if not group_alive(pgid):
                return
            time.sleep(0.05)


class Guard:
    """The watcher of process group `pgid` (see the module's text); its lines go to `out`. `release()` once the
    group was ended here: the watcher then only ends what is left of it, and exits."""

    def __init__(self, pgid: int, out: IO | int | None, term_s: float):
        read_end, self.write_end = os.pipe()  # neither end is inherited by what this process runs next (O_CLOEXEC)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "grpo_cli.base.guard", str(pgid), str(os.getpid()), str(term_s)],
                stdin=read_end, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            os.close(self.write_end)
            raise
        finally:
            os.close(read_end)

    def release(self, timeout: float = KILL_WAIT_S) -> None:
        if self.write_end < 0:
            return
        try:
            os.write(self.write_end, RELEASED)
        finally:
            os.close(self.write_end)
            self.write_end = -1
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _watch(pgid: int, starter: int, term_s: float) -> None:
    heard = b""
    while chunk := os.read(0, 64):
        heard += chunk
    if heard != RELEASED and group_alive(pgid):
        print(f"grpo-cli guard: pid {starter}, which started process group {pgid}, ended without stopping it; ending "
              f"the group (SIGTERM, SIGKILL {term_s:g} s later)", flush=True)
    end_group(pgid, term_s)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
