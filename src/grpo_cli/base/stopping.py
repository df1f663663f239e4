"""The stop request of a run: what SIGINT / SIGTERM / SIGHUP ask for, polled by the step loop and every decode step.

The first SIGINT, SIGTERM or SIGHUP (what an ssh drop or a closed terminal sends) only sets a flag: generation
stops at its next decode step, the unfinished step is discarded and the last complete state is checkpointed.
After that first signal SIGINT has its default action again, so a second Ctrl-C ends the process at once, even
inside a long native call (a shell reports 130); the last complete checkpoint on disk is kept. Repeated SIGTERMs
and SIGHUPs are ignored. A terminal that hung up fails every write to it (EIO): stdout and stderr that cannot be
written any more are pointed at /dev/null then, so that the run still reaches its checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from grpo_cli.base.ranks import is_rank_zero

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# the requests installed by the main thread, innermost last: a request installed in another thread (a sweep job of
# hydra/launcher=shared_base) follows the innermost one, which passes its signal on
_installed: list[StopRequest] = []


class StopRequest:
    """Callable: True once a stop was asked for. `installed()` owns the signal handlers for the run."""

    def __init__(self, prog: str = "grpo-train", announce: bool | None = None,
                 effect: str = "an unfinished step is discarded, the last complete one is kept"):
        self.prog, self.effect = prog, effect
        self.signum: int | None = None
        self.installed_now = False
        self.followers: list[StopRequest] = []  # requests of other threads that this one's signal reaches
        # under torchrun every rank gets the signal; one line from rank 0 is enough
        self.announce = is_rank_zero() if announce is None else announce

    def __call__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def request(self, signum: int) -> None:
        if self.signum is not None:
            return  # already stopping (a repeated SIGTERM); a second SIGINT never gets here
        self.signum = signum
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if signum == signal.SIGHUP:
                discard_dead_outputs()
        if self.announce:
            # os.write, not print: the main thread may be inside a write to stderr right now
            with contextlib.suppress(OSError):
                os.write(2, f"{self.prog}: {signal.Signals(signum).name} received: stopping now ({self.effect}); "
                            "Ctrl-C again to exit at once\n".encode())
        for follower in list(self.followers):
            follower.request(signum)

    def _on_signal(self, signum, _frame) -> None:
        self.request(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """The signal handlers for the block. Outside the main thread (signals reach only that one) the request
        follows the main thread's innermost installed one instead: its signal, one that came already included."""
        if threading.current_thread() is not threading.main_thread():
            with self._following():
                yield self
            return
        previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        self.installed_now = True
        _installed.append(self)
        try:
            yield self
        finally:
            self.installed_now = False
            _installed.remove(self)
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextlib.contextmanager
    def _following(self) -> Iterator[None]:
        leader = _installed[-1] if _installed else None
        self.installed_now = True
        if leader is not None:
            self.announce = False  # the leader said it once for every thread
            leader.followers.append(self)
            if leader.signum is not None:
                self.request(leader.signum)
        try:
            yield
        finally:
            self.installed_now = False
            if leader is not None:
                leader.followers.remove(self)


@contextlib.contextmanager
def exits_at_once(prog: str, state: str = "no work was under way: nothing is left half-written") -> Iterator[None]:
    """The handlers of an entry point from its first instruction on (imports, reading the options, composing the
    config) and wherever its own (a StopRequest, grpo-export's) is not installed: SIGINT, SIGTERM or SIGHUP ends
    the process at once, with one line saying `state` (no traceback, even inside an import), exit 128 + signal."""
    def stop_now(signum, _frame) -> None:
        with contextlib.suppress(OSError):  # os.write: the main thread may be inside a write to stderr
            os.write(2, f"{prog}: stopped by {signal.Signals(signum).name} while {state}; run the same command "
                        "again\n".encode())
        os._exit(128 + signum)

    previous = {s: signal.signal(s, stop_now) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def discard_dead_outputs() -> None:
    """stdout / stderr on a terminal that hung up: every write fails (EIO, even an empty one), and the first print
    would end the run before its checkpoint. Such a stream is pointed at /dev/null; a live one is left alone."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
