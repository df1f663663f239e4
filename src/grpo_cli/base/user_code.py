"""User code (reward functions, tools, an environment's constructor, `reset` and `get_reward`) runs behind one
boundary: `call` runs it where it can be abandoned and hands back what it returned or raised, whatever that is.

Each call runs in a daemon thread that the caller waits on in short slices, polling the run's stop request: a
Python thread cannot be killed, but an abandoned daemon thread neither blocks the step loop nor the process's exit,
so a signal stops the run within a poll even while the code hangs without a deadline. (A process could be killed,
but would have to pickle every function, its options and an environment's state, and start slowly.) What the code
raises, any BaseException (SystemExit from `sys.exit(0)` included, a KeyboardInterrupt of its own: a real Ctrl-C
is a stop request, which never raises), is caught in the thread, so no thread traceback is printed, and comes
back as `Raised` for the caller to say in one line.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import signal
import threading
import time
from collections.abc import Callable

from grpo_cli.base.errors import Interrupted

POLL_S = 0.05  # how often a wait for user code looks at the stop request


class TimedOut(Exception):
    """The call ran past its deadline (and was abandoned)."""


class Raised(Exception):
    """The call raised `error`, kept apart from the stop request, which must pass through."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


FAILED = (Raised, TimedOut)


def call(fn: Callable, *args, name: str, timeout_s: float | None = None, stop: Callable[[], bool] | None = None,
         **kwargs):
    """`fn(*args, **kwargs)` in a daemon thread named `name`; its return value. Interrupted when `stop()` turns
    true while it runs, TimedOut past `timeout_s` seconds (None: no limit), Raised for whatever it raised; the
    first two abandon the thread."""
    outcome: dict = {}

    def target():
        try:
            outcome["returned"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the waiting thread, which names it (no thread traceback)
            outcome["error"] = err

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    while worker.is_alive():
        if stop is not None and stop():
            raise Interrupted(getattr(stop, "signum", None) or signal.SIGTERM)
        if time.monotonic() >= deadline:
            raise TimedOut()
        worker.join(min(POLL_S, max(0.0, deadline - time.monotonic())))
    if "error" in outcome:
        raise Raised(outcome["error"])
    return outcome["returned"]


def awaited(value):
    """`value`, or what it gives when it is a coroutine (an async reward, tool or get_reward, as TRL allows), run to
    its end on the process's one event loop for user code (`event_loop`), the calling thread waiting for it."""
    if not inspect.iscoroutine(value):
        return value
    return asyncio.run_coroutine_threadsafe(value, event_loop()).result()


_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process that made it, the loop)
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for all async user code of this process, running in a daemon thread, as TRL runs its async
    rewards: what an async reward or tool binds to the loop of its first call (an asyncio.Semaphore, a client's
    connections) still works at the next. A forked child (a rollout worker) makes its own: the thread is not forked."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="user-code-async", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def shown(value) -> str:
    """A returned value in a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def raised(err: BaseException) -> str:
    """`Type: message` of anything user code raised (SyntaxError with its file and line, SystemExit with its code)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
