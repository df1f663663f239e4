"""`rollout.placement=worker`: generation in a process of its own, up to `rollout.max_staleness` (K) policy versions
ahead of the update that uses its batches (docs/usage.md "Generation in a worker process").

    worker = RolloutWorker(cfg, lm, trainer.prompts, seed_of, start=0, stop=stop)   # spawns it (GRPOTrainer.generation)
    trainer.generation(step) -> worker.generation(step)   # each step's batch; a step's first call syncs its version
    worker.versions_to_keep(done)                   # for the checkpoint after `done` steps
    worker.close()

The schedule of versions and batches and the sync check are rollout/ahead.py's (shared with placement=server).
The protocol, in order on two torch.multiprocessing queues (spawn context), the records of rollout/messages.py:

    trainer -> worker   Sync(version)                          the adapter of `version` is in the shared buffers
                        Generate(step, version, prompt_ids, seed)
                        Close()
    worker -> trainer   Ready(pid)  Synced(version, probe log-probs)  Batch(step, version, rollout, stats)
                        Failed(exception)

Weights: only the LoRA adapter's tensors move, through buffers in shared memory (torch.multiprocessing's own
mechanism) that the worker copies into its model on each Sync; the trainer writes them again only after the
worker acknowledged the previous sync, so the worker never copies a half-written version. A collective
(torch.distributed broadcast) is a rendezvous that both sides must enter: the trainer would wait at every sync for
the batch the worker is generating, or keep an asynchronous send and a staging copy, which is what these buffers
are, without a port or a second process group beside torchrun's.

The sync check: after each sync the worker's log-probs of a fixed probe sequence must equal the trainer's at that
version within ahead.SYNC_TOLERANCE, else the run stops in one line naming the step and the gap (`sync/logp_gap`).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.multiprocessing as mp

from grpo_cli.algorithm import needs_reference
from grpo_cli.base.errors import RunError, UserError, WorkerError, error_line
from grpo_cli.config.schema import Config
from grpo_cli.rollout.ahead import (
    AheadOfTheUpdate,
    Versions,
    moved,
    rollout_logprobs,
    trainable,
)
from grpo_cli.rollout.common import Rollout, SamplingParams
from grpo_cli.rollout.logprobs import completion_logprobs
from grpo_cli.rollout.messages import Batch, Close, Failed, Ready, Sync, Synced
from grpo_cli.tasks.prompts import EncodedPrompts

if TYPE_CHECKING:
    from multiprocessing.queues import Queue as ProcessQueue

# A test hook, read by the worker: "1" makes it acknowledge every weight sync without loading the new adapter, to
# show that the sync check stops the run (tests/rollout/test_async_rollouts.py). Nothing else sets it.
SKIP_SYNC_TEST_HOOK = "GRPO_CLI_TEST_WORKER_SKIPS_SYNC"


class ReferencePlan(Protocol):
    """What the worker's reference pass takes of the trainer's memory plan (step/memory.py's MemoryPlan, given to
    the worker): its micro-batches and LM-head blocks, so that the pass is the trainer's own, bit for bit."""

    @property
    def head_chunk(self) -> int | None: ...  # read only: the plan is a frozen record

    def micro_batches(self, rollout: Rollout, rows: slice, max_rows: int | None) -> list[slice]: ...


def thread_split(worker_threads: int | None, threads: int) -> tuple[int, int]:
    """(trainer, worker) torch threads on the CPU out of the trainer's `threads`: rollout.worker_threads for the
    worker and the rest for the trainer, or (null) half each; at least one each."""
    worker = worker_threads or max(1, threads // 2)
    return max(1, threads - worker), worker


def reads_sampler_logprobs(cfg: Config) -> bool:
    """Whether the loss reads the generator's own log-probs of its samples: the sampler correction and the
    off-policy mask do (and the sampler/* metrics come with them); else the worker does not spend a pass on them."""
    return cfg.algo.sampler_correction != "none" or cfg.algo.off_policy_mask_threshold is not None


def reference_in_the_worker(cfg: Config, trainer_device: torch.device, worker_device: torch.device) -> bool:
    """Whether the worker makes the reference pass (the frozen base's log-probs, for the KL term) of each batch it
    generates: with a staleness bound (K >= 1) and a KL term, where trainer and worker split the CPU's cores. It
    moves about a quarter of the update's work to the side that waits (docs/results/rollout-worker.md).
    Not at K=0 (the trainer waits for each batch: nothing to balance, and the update stays bitwise the local
    loop's), nor across devices (the reference would come in the worker's numerics)."""
    return (cfg.rollout.max_staleness >= 1 and needs_reference(cfg.algo)
            and trainer_device.type == "cpu" and worker_device.type == "cpu")


class RolloutWorker(AheadOfTheUpdate):
    """The trainer's side of the worker process (AheadOfTheUpdate: the schedule and the sync check): spawns it, moves
    each version's adapter through buffers in shared memory, shuts it down."""

    who = "the rollout worker"
    cause = "the new weights did not reach the worker (a bug: please report it)"
    requests: ProcessQueue  # the worker process reads them

    def __init__(self, cfg: Config, lm, prompts_of: Callable[[int], tuple[list[dict], EncodedPrompts]],
                 seed_of: Callable[[int], int], *, start: int, stop: Callable[[], bool],
                 plan: ReferencePlan, history: Versions | None = None):
        super().__init__(cfg, lm, prompts_of, seed_of, start=start, stop=stop, history=history)
        self.buffers = {name: t.detach().to("cpu", copy=True).share_memory_()
                        for name, t in trainable(lm.model).items()}
        device = lm.device if cfg.rollout.worker_device == "auto" else torch.device(cfg.rollout.worker_device)
        trainer_threads, worker_threads = thread_split(cfg.rollout.worker_threads, torch.get_num_threads())
        if lm.device.type == "cpu" and device.type == "cpu":  # the cores are shared: split them
            torch.set_num_threads(trainer_threads)
        # the trainer's memory plan (its micro-batches and LM-head blocks) for the reference pass, where the worker
        # makes it
        reference = plan if reference_in_the_worker(cfg, lm.device, device) else None
        context = mp.get_context("spawn")
        self.requests, from_worker = context.Queue(), context.Queue()
        self.process = context.Process(target=serve, name="grpo-rollout-worker", daemon=True,
                                       args=(dict(cfg.composed), str(device), self.buffers, self.probe,
                                             self.requests, from_worker, worker_threads, os.getpid(),
                                             reference))
        self.process.start()
        self.results = queue.Queue()
        threading.Thread(target=relay, args=(from_worker, self.results), name="grpo-rollout-relay",
                         daemon=True).start()
        self.begin("loaded its policy")

    def close(self) -> None:
        """Shut the worker down: asked (it answers once the batches it was asked for are done), then terminated
        (it holds nothing to save), then killed; its process is gone (and reaped) afterwards."""
        self.requests.cancel_join_thread()  # requests the worker will never read must not hold up this process's exit
        if self.process.exitcode is None:
            self.requests.put(Close())
            self.process.join(timeout=1)
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is None:
                end()
                self.process.join(timeout=5)

    def _deliver(self, version: int, adapter: dict[str, torch.Tensor]) -> None:
        """The adapter into the shared buffers: the worker copied the previous version out of them already."""
        for name, buffer in self.buffers.items():
            buffer.copy_(adapter[name])
        self.requests.put(Sync(version))

    def _settle(self) -> None:
        self.process.join(timeout=5)

    def _check_alive(self, what: str) -> None:
        if not self.process.is_alive():
            raise WorkerError(f"the rollout worker (pid {self.process.pid}) ended with exit code "
                              f"{self.process.exitcode} before it {what}") from None


def relay(source, sink: queue.Queue) -> None:
    """Move the worker's messages from its multiprocessing queue to `sink`, in a thread of their own: taking one may
    block without a deadline (a message half written, or a tensor whose file descriptor torch fetches from the sending
    process, which blocks while that process is stopped), and the trainer's waits must keep theirs
    (rollout.generator_timeout_s, the stop request). A failure to take one (the worker died with it) goes to `sink`
    as the exception, and the relay ends."""
    while True:
        try:
            message = source.get()
        except (OSError, EOFError) as err:
            sink.put(err)
            return
        sink.put(message)


# ---- the worker's side ----------------------------------------------------------------------------------
def serve(composed: dict, device: str, buffers: dict[str, torch.Tensor], probe: Rollout, requests, results,
          threads: int, parent: int, reference: ReferencePlan | None = None) -> None:
    """The worker process, given the trainer's composed config: load the policy as the trainer does, build the engine
    rollout.engine names, and answer the requests in order until Close or until the trainer's process is gone.
    `reference`: the trainer's memory plan where the worker makes the reference pass (`reference_in_the_worker`),
    else None.
    A terminal's SIGINT and SIGHUP reach the whole process group: they are the trainer's to handle (it shuts the
    worker down)."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    end_with_the_trainer()
    try:
        from omegaconf import OmegaConf

        from grpo_cli.model.loading import load_policy, quiet_libraries
        from grpo_cli.rollout import make_engine

        quiet_libraries()  # as in the trainer: no library's deprecation lines among the run's
        cfg = Config.of(OmegaConf.create(composed))  # the trainer's config (its typed form does not pickle)
        torch.set_num_threads(threads)
        lm = load_policy(cfg.model, device, seed=cfg.trainer.seed,
                         chat_template_kwargs=cfg.rollout.chat_template_kwargs)
        engine = make_engine(cfg.rollout, lm, max_prompt_tokens=cfg.data.max_prompt_tokens)
        params = trainable(lm.model)
        results.put(Ready(os.getpid()))
        while True:
            try:
                message = requests.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer died (kill -9): nobody will ask for more
                    return
                continue
            if isinstance(message, Close):
                return
            if isinstance(message, Sync):
                if os.environ.get(SKIP_SYNC_TEST_HOOK) != "1":
                    with torch.no_grad():
                        for name, p in params.items():
                            p.copy_(buffers[name])
                    engine.policy_changed()
                logp = rollout_logprobs(lm.model, probe, cfg.rollout.temperature, cfg.trainer.logprob_chunk_size)
                results.put(Synced(message.version, logp))
            else:
                roll, stats = generate(cfg, lm, engine, message.prompt_ids, message.seed, reference)
                results.put(Batch(message.step, message.version, roll, stats))
    except Exception as err:  # noqa: BLE001  every failure goes back to the trainer, which says it in one line
        told = isinstance(err, (UserError, RunError)) and _picklable(err)  # a line for the user already
        results.put(Failed(err if told else WorkerError(f"the rollout worker failed: {error_line(err)}")))


def end_with_the_trainer() -> None:
    """On Linux the kernel kills this process when the trainer's ends, even by SIGKILL (prctl PR_SET_PDEATHSIG);
    elsewhere the request loop notices a new parent between requests."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def generate(cfg: Config, lm, engine, prompt_ids: list[list[int]], seed: int,
             reference: ReferencePlan | None = None) -> tuple[Rollout, dict]:
    """One step's batch, sampled as GRPOTrainer.generate samples it (the same seed), with the generating policy's
    log-probs of its tokens as the rollout's sampler_logprobs where the loss reads them (algo.sampler_correction
    weighs the lag), and the reference pass's log-probs where `reference` asks for them."""
    roll_cfg = cfg.rollout
    torch.manual_seed(seed)
    t0, compile_before = time.perf_counter(), engine.compile_s
    roll = engine.generate(prompt_ids, cfg.algo.num_generations, SamplingParams.of(roll_cfg))
    compile_s = engine.compile_s - compile_before
    gen_time = time.perf_counter() - t0 - compile_s
    t1 = time.perf_counter()
    if reads_sampler_logprobs(cfg):
        roll.sampler_logprobs = rollout_logprobs(lm.model, roll, roll_cfg.temperature, cfg.trainer.logprob_chunk_size)
    if reference is not None:
        roll.ref_logprobs = reference_logprobs(cfg, lm.model, roll, reference)
    passes_s = time.perf_counter() - t1
    roll = moved(roll, torch.device("cpu"))  # through the queue's shared memory; the trainer moves it to its device
    tokens = int(roll.loss_mask().sum())
    return roll, {"gen_time_s": gen_time, "gen_tokens_per_s": tokens / max(gen_time, 1e-9),
                  "gen_compile_s": compile_s, "gen_sync_s": engine.sync_s, "rollout/worker_passes_s": passes_s}


@torch.no_grad()
def reference_logprobs(cfg: Config, model, roll: Rollout, plan: ReferencePlan) -> torch.Tensor:
    """The frozen base's log-probs of every completion token of `roll` (the adapter disabled), in the trainer's
    micro-batches and LM-head blocks: the trainer's own reference pass (GRPOTrainer.update), made here."""
    parts = plan.micro_batches(roll, slice(0, roll.completion_ids.shape[0]), cfg.trainer.micro_batch_size)
    chunk = plan.head_chunk or cfg.trainer.logprob_chunk_size
    with model.disable_adapter():
        return torch.cat([completion_logprobs(model, roll, part, cfg.rollout.temperature, chunk)[0] for part in parts])


def _picklable(err: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001
        return False
    return True
