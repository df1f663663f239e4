"""Several vLLM servers as one generator (`rollout.placement=server`, issue 64): what rollout/server.py's client
thread keeps of each server (`Replica`) and of each batch in flight (`PendingBatch`), where a group's requests go
(`pick`), and which cores or GPU each server grpo-train starts runs on (`placements`).

Every server is given every adapter version and checked on the probe after each load; a prompt's G completions go
to one server (they share its prefix cache), each group to the server with the fewest requests outstanding that
holds the batch's version; a server that fails a call is taken out (one warning), its requests go to the others,
and it is tried again at the next version's load. Each request carries its own seed, so a completion does not
depend on the server that made it, nor on how many there are.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from grpo_cli.base.errors import WorkerError
from grpo_cli.rollout.vllm_server import ServerAPI, VLLMServer

CALLS_PER_SERVER = 64  # a server's calls in flight at once (vLLM batches them); the rest wait in its queue


@dataclass(eq=False)
class Replica:
    """One server of the fleet: number (from 1) of `of`, its API, the process when grpo-train started it; `up` (it
    takes requests), the versions it holds by adapter name, its requests outstanding, the threads that make its
    calls (its own: a server that hangs holds none of the others')."""

    number: int
    of: int
    api: ServerAPI
    server: VLLMServer | None = None
    up: bool = True
    loaded: dict[int, str] = field(default_factory=dict)
    in_flight: int = 0
    calls: ThreadPoolExecutor = field(init=False)

    def __post_init__(self):
        self.calls = ThreadPoolExecutor(max_workers=CALLS_PER_SERVER, thread_name_prefix=f"grpo-server{self.number}")

    @property
    def who(self) -> str:
        return "vLLM's server" if self.of == 1 else f"vLLM's server {self.number} of {self.of} ({self.api.url})"

    @property
    def key(self) -> str:
        """Its name in the metrics (sync/logp_gap/server2, rollout/completions/server2)."""
        return f"server{self.number}"


@dataclass(eq=False)
class PendingBatch:
    """A step's batch in flight: one request body per completion (G per prompt, in order), the server each group
    went to, the answers so far, the completions each server made."""

    step: int
    version: int
    prompt_ids: list[list[int]]
    bodies: list[dict]
    group_size: int
    started: float
    choices: list[dict | None] = field(default_factory=list)
    group_replica: list[Replica] = field(default_factory=list)
    made_by: Counter = field(default_factory=Counter)

    def __post_init__(self):
        self.choices = [None] * len(self.bodies)

    @property
    def left(self) -> int:
        return sum(c is None for c in self.choices)


@dataclass(frozen=True)
class Answered:
    """Completion `i` of `batch` came back from `replica` (`done`: its call's future, a result or an error): the
    message a call's thread sends to the client thread, among the trainer's requests."""

    batch: PendingBatch
    i: int
    replica: Replica
    done: Future


def pick(replicas: list[Replica], version: int) -> Replica | None:
    """The server for a group of `version`'s batch: of those up that hold that version, the one with the fewest
    requests outstanding (the first on a tie); None when there is none."""
    ready = [r for r in replicas if r.up and version in r.loaded]
    return min(ready, key=lambda r: r.in_flight) if ready else None


def none_left(replicas: list[Replica], what: str) -> WorkerError:
    """The line of a fleet with no server left up."""
    return WorkerError(f"no vLLM server is left to {what}: every one of rollout.placement=server's {len(replicas)} "
                       f"server(s) failed (the warnings above say why); start or fix them, then resume")


def placements(servers: int, threads: int | None, cores: list[int] | None = None, gpus: list[str] | None = None,
               ) -> list[tuple[list[int] | None, str | None]]:
    """(cores, GPU) of each of `servers` servers grpo-train starts: on the CPU (`gpus` None) `threads` cores each,
    the allowed cores taken in turn (shared only when there are too few); on CUDA the GPUs in turn."""
    if gpus is not None:
        return [(None, gpus[i % len(gpus)]) for i in range(servers)]
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    each = threads or 1
    return [([allowed[(i * each + j) % len(allowed)] for j in range(min(each, len(allowed)))], None)
            for i in range(servers)]
