"""Threads that take turns: under hydra/launcher=shared_base each job of a sweep runs in a thread of its own, and
exactly one of them runs at any time, each until it asks for generation (`Turns.ask`) or ends. Once every job that has
not ended is waiting with a request, the requests run together (in the thread of the last to ask) and the jobs go
on, in job order, each to its next request.

Because one thread runs at a time, what a job sets for the whole process (Hydra's config, the RNG, the working
directory, the active adapter, where warnings go) is its own while it runs: each job's `Context` is saved when it
gives up its turn and restored when it takes it back (a new job starts from the context the sweep started in).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Context(Protocol):
    """What a job keeps of the process's state between its turns (made by Turns' `save`)."""

    def restore(self) -> None: ...


@dataclass
class Job:
    num: int
    run: Callable[[], Any]
    state: str = "new"  # new -> running <-> waiting -> ready -> running ... -> done
    request: Any = None
    context: Context | None = None
    result: Any = None
    error: BaseException | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread = field(init=False)  # Turns.add sets it: the thread needs the job


class Turns:
    """The jobs (`add`) and their turns (`start`); `together(requests)` runs the requests of every waiting job and
    fills in each one's answer (it must not raise: an error belongs to each request it ended); `save()` keeps a
    job's part of the process, to restore at its next turn; `on_end(job)` runs in a job's thread when it ends, still
    on its turn."""

    def __init__(self, together: Callable[[list], None], save: Callable[[], Context],
                 on_end: Callable[[Job], None] = lambda job: None):
        self.together, self.save, self.on_end = together, save, on_end
        self.jobs: list[Job] = []
        self.start_context: Context | None = None

    def add(self, num: int, run: Callable[[], Any]) -> Job:
        job = Job(num, run)
        job.thread = threading.Thread(target=self._body, args=(job,), name=f"sweep-job-{num}", daemon=True)
        self.jobs.append(job)
        return job

    def start(self) -> list[Job]:
        """Run every job to its end, from the calling (main) thread, which waits meanwhile and takes the signals:
        a short join at a time, so that their handlers run."""
        self.start_context = self.save()
        for job in self.jobs:
            job.thread.start()
        self._next()
        while any(job.thread.is_alive() for job in self.jobs):
            for job in self.jobs:
                job.thread.join(0.2)
        self.start_context.restore()
        return self.jobs

    def current(self) -> Job | None:
        """The job whose thread calls (None outside the jobs' threads)."""
        thread = threading.current_thread()
        return next((job for job in self.jobs if job.thread is thread), None)

    def ask(self, request: Any) -> None:
        """From a job's thread: wait until `request` has run with the other jobs' (its answer is in it)."""
        job = self.current()
        assert job is not None, "Turns.ask is called from a job's thread"
        job.request, job.state = request, "waiting"
        job.context = self.save()
        self._next()
        self._take_turn(job)

    # ---- the turns ------------------------------------------------------------------------------
    def _body(self, job: Job) -> None:
        self._take_turn(job)
        try:
            job.result = job.run()
        except BaseException as error:  # a SystemExit too: the sweep's launcher raises it once every job has ended
            job.error = error
        finally:
            try:
                self.on_end(job)
            finally:
                job.state = "done"
                self._next()

    def _take_turn(self, job: Job) -> None:
        job.wake.wait()
        job.wake.clear()
        context = job.context or self.start_context
        assert context is not None  # start() saves start_context before any job's thread starts
        context.restore()

    def _next(self) -> None:
        """Give the turn away (the caller's state is already set): to the first job that has not started or has its
        answer, else, when every other job waits, to the first of them once their requests have run."""
        following = next((job for job in self.jobs if job.state in ("new", "ready")), None)
        if following is None:
            waiting = [job for job in self.jobs if job.state == "waiting"]
            if not waiting:
                return  # every job has ended: the main thread sees it
            self.together([job.request for job in waiting])
            for job in waiting:
                job.state = "ready"
            following = waiting[0]
        following.state = "running"
        following.wake.set()
