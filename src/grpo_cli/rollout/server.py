"""`rollout.placement=server`: generation by vLLM's OpenAI-compatible servers, up to `rollout.max_staleness` (K)
policy versions ahead of the update that uses its batches (docs/usage.md "Generation on vLLM's server").

    rollouts = ServerRollouts(cfg, lm, trainer.prompts, seed_of, start=0, stop=stop, run_dir=run_dir)
    rollouts.generation(step)
    rollouts.close()                                   # stops the servers grpo-train started

The schedule of versions, syncs and batches and the sync check are rollout/ahead.py's, as for placement=worker; the
transport here is a thread of the training process (the client thread) that makes the servers' HTTP calls
(rollout/vllm_server.py), so the trainer trains while the servers generate:

- the servers: rollout.server_url (one URL or a list), or (null) rollout.servers `vllm serve` grpo-train starts on
  the base alone (written once to a scratch dir as vLLM loads it, rollout/vllm.py), each on cores or a GPU of its
  own, and stops on exit, SIGTERM and errors;
- a sync of version v: peft saves v's adapter to a scratch folder (`_deliver`, in the trainer's thread); once no
  batch is in flight (the syncs come between batches of two versions anyway, and vLLM's CPU engine fails a probe
  that shares a batch), the thread unloads the version before and loads v on every server as LoRA `<run>-v<v>`
  (POST /v1/load_lora_adapter), and reads each server's log-probs of the probe sequence under it (prompt_logprobs):
  the trainer checks every one;
- a batch: one /v1/completions request per completion, the prompt as token ids, its own seed (drawn as the
  in-process vllm engine draws them: a run is reproducible, whichever server makes a completion), the sampled
  tokens' log-probs kept as the rollout's sampler_logprobs; a group's requests go to one server (rollout/fleet.py),
  and those of a server that fails to the others.
"""

from __future__ import annotations

import collections
import copy
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpo_cli.base.errors import RunError, UserError, WorkerError, error_line, program, warn
from grpo_cli.config.schema import Config
from grpo_cli.rollout.ahead import HALF_SYNC_TOLERANCE, SYNC_TOLERANCE, AheadOfTheUpdate, Versions
from grpo_cli.rollout.common import SamplingParams, eos_ids
from grpo_cli.rollout.fleet import CALLS_PER_SERVER, Answered, PendingBatch, Replica, none_left, pick, placements
from grpo_cli.rollout.messages import Batch, Close, Failed, Generate, Ready, Sync, Synced
from grpo_cli.rollout.vllm import DTYPES, SEED_RANGE, lora_rank, sampled_rollout, save_checkpoint
from grpo_cli.rollout.vllm_server import START_DEADLINE_S, ServerAPI, Unreachable, VLLMServer, wait_until_up
from grpo_cli.tasks.prompts import EncodedPrompts

# A test hook, read by the client thread: "1" makes each sync after the first load the previous version's adapter
# under the new version's name, a sync that does not happen (tests/rollout/test_vllm_server.py); a server's URL makes
# that server alone do so (tests/rollout/test_vllm_fleet.py). Nothing else sets it.
SKIP_SYNC_TEST_HOOK = "GRPO_CLI_TEST_SERVER_SKIPS_SYNC"
SERVER_LOG = "vllm-server.log"  # in the run dir: what the server grpo-train started printed (-N.log: server N)
URL_DEADLINE_S = 60  # a server given by URL, running already (one grpo-train starts: START_DEADLINE_S)


def server_urls(value) -> list[str]:
    """rollout.server_url as a list: [] (grpo-train starts its servers), the one URL, or the URLs given."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def visible_gpus() -> list[str]:
    """The GPUs the servers grpo-train starts take in turn: CUDA_VISIBLE_DEVICES's, else every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    return [str(i) for i in range(max(1, torch.cuda.device_count()))]


class ServerRollouts(AheadOfTheUpdate):
    """The trainer's side of vLLM's servers: starts them (or uses rollout.server_url), sends each version's adapter
    to every one by the server's LoRA API, asks for the batches; the sync check compares each server's probe
    log-probs."""

    who = "vLLM's server"
    cause = ("the adapter it serves under that version's name is not the trainer's (a server that kept an older "
             "adapter under the name, or another run loading its own: give each run its own server)")
    # vLLM's prompt_logprobs are the model's own distribution, before any temperature: the trainer's probe at 1
    probe_temperature = 1.0
    requests: queue.Queue  # the client thread reads them, and the servers' answers among them

    def __init__(self, cfg: Config, lm, prompts_of: Callable[[int], tuple[list[dict], EncodedPrompts]],
                 seed_of: Callable[[int], int], *, start: int, stop: Callable[[], bool], run_dir: Path,
                 history: Versions | None = None):
        super().__init__(cfg, lm, prompts_of, seed_of, start=start, stop=stop, history=history)
        # the dtype of the servers grpo-train starts (rollout.vllm_dtype), whose rounding the sync check allows for;
        # a given server's is its own: model.dtype's tolerance
        self.dtype = lm.dtype if cfg.rollout.vllm_dtype == "auto" else DTYPES[cfg.rollout.vllm_dtype]
        urls = server_urls(cfg.rollout.server_url)
        if not urls:
            self.tolerance = max(self.tolerance, SYNC_TOLERANCE.get(self.dtype, HALF_SYNC_TOLERANCE))
        self.scratch = Path(tempfile.mkdtemp(prefix="grpo-server-"))
        self.prefix = f"grpo-{os.getpid()}"  # adapter names of this process: a shared server keeps them apart
        self.started: list[VLLMServer] = []
        self.replicas: list[Replica] = []
        self.batches: dict[int, PendingBatch] = {}  # step -> its batch in flight
        self.folders: dict[int, Path] = {}  # version -> its adapter's files, while a batch or the test hook needs them
        self.closing = threading.Event()
        self.requests, self.results = queue.Queue(), queue.Queue()
        self.tokenizer = copy.deepcopy(lm.tokenizer)  # the thread's own: a fast tokenizer is not for two threads
        self.eos = eos_ids(lm.model, lm.tokenizer)
        self.sync_s = 0.0
        try:
            if not urls:
                self._start_servers(cfg, lm, run_dir)
            urls = urls or [server.url for server in self.started]
            self.replicas = [Replica(i + 1, len(urls), ServerAPI(url, cfg.rollout.server_timeout_s, CALLS_PER_SERVER),
                                     self.started[i] if self.started else None) for i, url in enumerate(urls)]
            self.thread = threading.Thread(target=self._serve, name="grpo-rollout-server", daemon=True)
            self.thread.start()
            self.begin("answered")
        except BaseException:
            self.close()
            raise

    def _start_servers(self, cfg: Config, lm, run_dir: Path) -> None:
        """rollout.servers `vllm serve` of the base (no adapter: the adapters come by name). On the CPU each is pinned
        to rollout.worker_threads cores of its own (null: the half of the trainer's threads that the worker
        placement would take, shared out), unless VLLM_CPU_OMP_THREADS_BIND says how; on CUDA the servers take the
        visible GPUs in turn. Two adapters at most are loaded at once: a sync waits for the batches in flight, so
        the version before is unloaded when the new one comes, whatever rollout.max_staleness."""
        base = self.scratch / "base"
        save_checkpoint(lm.model, lm.tokenizer, base, self.dtype, with_adapter=False)
        roll, count, cpu = cfg.rollout, cfg.rollout.servers, lm.device.type == "cpu"
        threads = None
        if cpu:
            threads = roll.worker_threads or max(1, torch.get_num_threads() // 2 // count)
            torch.set_num_threads(max(1, torch.get_num_threads() - count * threads))
            where = [(None, None)] * count if "VLLM_CPU_OMP_THREADS_BIND" in os.environ else placements(count, threads)
        else:
            where = placements(count, None, gpus=visible_gpus())
        for number, (cores, gpu) in enumerate(where, start=1):
            log = Path(run_dir) / (SERVER_LOG if count == 1 else SERVER_LOG.replace(".log", f"-{number}.log"))
            self.started.append(VLLMServer(
                base, log, dtype=str(self.dtype).removeprefix("torch."), lora_rank=lora_rank(lm.model),
                max_loras=2, seed=cfg.trainer.seed, max_model_len=roll.vllm_max_model_len,
                kv_cache_gib=roll.vllm_kv_cache_gib, gpu_memory_utilization=roll.vllm_gpu_memory_utilization,
                threads=threads, cpu=cpu, cores=cores, gpu=gpu,
                context=getattr(lm.model.config, "max_position_embeddings", None) or 2048))

    def close(self) -> None:
        """Stop the thread (a call in flight ends with its server, or runs out), unload this run's adapters from the
        servers given by URL, stop the servers grpo-train started (all at once), remove the scratch dir."""
        self.closing.set()
        self.requests.put(Close())
        thread = getattr(self, "thread", None)
        stopping = [threading.Thread(target=server.stop) for server in self.started]
        for stopper in stopping:
            stopper.start()
        for stopper in stopping:
            stopper.join()
        if not self.started and thread is not None:
            thread.join(timeout=5)
            for replica in self.replicas:
                for name in list(replica.loaded.values()) if replica.up else []:
                    try:
                        replica.api.unload_adapter(name, timeout=5)
                    except WorkerError:
                        pass  # the server went away, or keeps it: nothing of this run depends on it
        if thread is not None:
            thread.join(timeout=5)
        for replica in self.replicas:
            replica.calls.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.scratch, ignore_errors=True)

    # ---- the trainer's thread -------------------------------------------------------------------
    def _deliver(self, version: int, adapter: dict[str, torch.Tensor]) -> None:
        """peft's own adapter files of `version` (the kept tensors, whatever the model holds now) for the servers."""
        folder = self.scratch / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        self.lm.model.save_pretrained(folder, state_dict=adapter, save_embedding_layers=False)
        self.requests.put(Sync(version, folder))

    def _check_alive(self, what: str) -> None:
        ended = [server for server in self.started if server.ended() is not None]
        if ended and len(ended) == len(self.started):
            first = ended[0]
            others = f" (and the {len(ended) - 1} other(s) it started)" if len(ended) > 1 else ""
            raise WorkerError(f"vLLM's server (pid {first.process.pid}){others} ended with exit code {first.ended()} "
                              f"before it {what}; its log: {first.log}")
        if not self.thread.is_alive() and self.results.empty():
            raise WorkerError(f"the thread that calls vLLM's server ended before the server {what}")

    # ---- the client thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        """The trainer's requests in order, and the servers' answers as they come, until Close; every failure goes
        to the trainer, which says it in one line."""
        try:
            for replica in self.replicas:
                wait_until_up(replica.api, replica.server, START_DEADLINE_S if self.started else URL_DEADLINE_S,
                              self.closing.is_set)
            self.results.put(Ready())
            held: collections.deque = collections.deque()  # the trainer's messages, in order, not yet acted on
            while not self.closing.is_set():
                message = self.requests.get()
                if isinstance(message, Answered):
                    self._answered(message)
                else:
                    held.append(message)
                # a sync waits until no batch is in flight: vLLM's CPU engine fails a probe's prompt_logprobs that
                # shares a batch with other LoRA requests (0.32: an einsum of mismatched shapes ends the engine)
                while held and not (isinstance(held[0], Sync) and self.batches):
                    message = held.popleft()
                    if isinstance(message, Close):
                        return
                    if isinstance(message, Sync):
                        assert message.folder is not None  # this transport's syncs name their folder (_deliver)
                        self._load_everywhere(message.version, message.folder)
                    else:
                        self._dispatch(message)
        except Exception as err:  # noqa: BLE001
            if not self.closing.is_set():
                told = isinstance(err, (UserError, RunError))
                self.results.put(Failed(err if told else WorkerError(
                    f"rollout.placement=server failed: {error_line(err)}")))

    def _take_out(self, replica: Replica, why: str) -> None:
        """`replica` takes no more requests until it loads a later version; one warning when it was up. The one
        server of a run is not taken out: its failure stops the run, in its line."""
        if len(self.replicas) == 1:
            raise WorkerError(f"{replica.who} at {replica.api.url} failed {why}")
        if replica.up:
            replica.up = False
            others = "the other servers" if len(self.replicas) > 2 else "the other server"
            warn(f"{replica.who} is taken out {why}; its requests go to {others}, and it is tried again at the next "
                 "policy version")

    def _load_everywhere(self, version: int, folder: Path) -> None:
        """Load `version`'s adapter on every server (those taken out too: tried again), first unloading the version
        before (no batch is in flight: none needs it); the probe log-probs of each server that loaded it, for the
        trainer's check."""
        t0 = time.perf_counter()
        self.folders[version] = folder
        for replica in self.replicas:
            if not replica.up:
                replica.loaded.clear()  # what a server that failed still holds is not known: it loads anew
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            outcomes = list(pool.map(lambda r: self._load_on(r, version, folder), self.replicas))
        probes = {}
        for replica, outcome in zip(self.replicas, outcomes, strict=True):
            if isinstance(outcome, Unreachable):
                self._take_out(replica, f"at the load of policy version {version}: {outcome}")
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            if not replica.up:
                print(f"{program()}: rollout.placement=server: {replica.who} is back, from policy version {version}",
                      file=sys.stderr, flush=True)
                replica.up = True
            probes[(replica.key, replica.who)] = outcome
        if not probes:
            raise none_left(self.replicas, f"load the adapter of policy version {version}")
        recent = sorted(self.folders)[-2:]  # this version's and the one before (the test hook loads it)
        for old in [v for v in self.folders if v not in recent]:
            shutil.rmtree(self.folders.pop(old), ignore_errors=True)
        self.sync_s = time.perf_counter() - t0
        self.results.put(Synced(version, probes if len(self.replicas) > 1 else next(iter(probes.values()))))

    def _load_on(self, replica: Replica, version: int, folder: Path):
        """On one server: unload the versions it holds, load `version`'s adapter under its name; its probe log-probs
        under it, or the exception (the caller sorts them: this runs in a thread of its own)."""
        try:
            if not replica.up and not replica.api.answers():  # one that hangs costs 5 s a version, not the timeout
                raise Unreachable(f"{replica.api.url} does not answer GET /models within 5 s")
            for old in list(replica.loaded):
                try:
                    replica.api.unload_adapter(replica.loaded.pop(old))
                except Unreachable:
                    raise
                except WorkerError:
                    pass  # not there (a server restarted since): nothing to unload
            hook = os.environ.get(SKIP_SYNC_TEST_HOOK)
            before = [v for v in self.folders if v < version]
            planted = hook in ("1", replica.api.url) and before
            replica.api.load_adapter(self._name(version), self.folders[max(before)] if planted else folder)
            replica.loaded[version] = self._name(version)
            return self._probe(replica.api, self._name(version))
        except Exception as err:  # noqa: BLE001 (sorted by the caller)
            return err

    def _probe(self, api: ServerAPI, name: str) -> torch.Tensor:
        """The server's log-probs of the probe's completion under the adapter `name`."""
        prompt, completion = self.probe.prompt_ids[0].tolist(), self.probe.completion_ids[0].tolist()
        choice = api.completion({"model": name, "prompt": prompt + completion, "max_tokens": 1, "temperature": 1.0,
                                 "prompt_logprobs": 0})
        ranked = (choice.get("prompt_logprobs") or [])[len(prompt):]
        if len(ranked) != len(completion):
            raise WorkerError(f"vLLM's server at {api.url} gave {len(ranked)} prompt log-probs of the probe's "
                              f"{len(completion)} completion tokens (its /v1/completions lacks prompt_logprobs?)")
        return torch.tensor([[float(r[str(t)]["logprob"]) for t, r in zip(completion, ranked, strict=True)]])

    def _name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def _dispatch(self, request: Generate) -> None:
        """Send one step's batch by its version: G completions per prompt, each its own request and seed, a prompt's
        requests to one server (the least busy)."""
        step, version, prompt_ids, seed = request.step, request.version, request.prompt_ids, request.seed
        G = self.cfg.algo.num_generations
        batch = PendingBatch(step, version, prompt_ids, self._bodies(version, prompt_ids, seed), G,
                             time.perf_counter())
        self.batches[step] = batch
        for group in range(len(prompt_ids)):
            replica = pick(self.replicas, version)
            if replica is None:
                raise none_left(self.replicas, f"generate the batch of step {step}")
            batch.group_replica.append(replica)
            for i in range(group * G, (group + 1) * G):
                self._send(batch, i, replica)

    def _bodies(self, version: int, prompt_ids: list[list[int]], seed: int) -> list[dict]:
        roll, G = self.cfg.rollout, self.cfg.algo.num_generations
        sampling = SamplingParams.of(roll)
        seeds = torch.randint(0, SEED_RANGE, (len(prompt_ids) * G,),
                              generator=torch.Generator().manual_seed(seed)).tolist()
        common = {"model": self._name(version), "max_tokens": sampling.max_new_tokens,
                  "min_tokens": sampling.min_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                  "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty,
                  "stop": list(sampling.stop_strings) or None, "include_stop_str_in_output": True,
                  "stop_token_ids": self.eos, "skip_special_tokens": False, "logprobs": 0,
                  "return_tokens_as_token_ids": True}
        return [{**common, "prompt": list(p), "seed": s}
                for p, s in zip((p for p in prompt_ids for _ in range(G)), seeds, strict=True)]

    def _send(self, batch: PendingBatch, i: int, replica: Replica) -> None:
        """Request completion `i` of `batch` from `replica`; its answer comes back to this thread as a message."""
        replica.in_flight += 1
        call = replica.calls.submit(replica.api.completion, batch.bodies[i])
        call.add_done_callback(lambda done: self.requests.put(Answered(batch, i, replica, done)))

    def _answered(self, answer: Answered) -> None:
        """Completion `i` of `batch` came back from `replica`: kept, or (the server failed) asked of another; the
        batch goes to the trainer once it is whole."""
        batch, i, replica, done = answer.batch, answer.i, answer.replica, answer.done
        replica.in_flight -= 1
        try:
            choice = done.result()
        except Unreachable as err:
            self._take_out(replica, f"at step {batch.step}: {err}")
            group = i // batch.group_size
            if not batch.group_replica[group].up:
                replacement = pick(self.replicas, batch.version)
                if replacement is None:
                    raise none_left(self.replicas, f"generate the batch of step {batch.step}") from None
                batch.group_replica[group] = replacement
            self._send(batch, i, batch.group_replica[group])
            return
        batch.choices[i] = choice
        batch.made_by[replica.key] += 1
        if batch.left == 0:
            self._finish(batch)

    def _finish(self, batch: PendingBatch) -> None:
        del self.batches[batch.step]
        gen_time = time.perf_counter() - batch.started
        choices = [c for c in batch.choices if c is not None]
        assert len(choices) == len(batch.choices)  # finished once whole: `left` is 0
        roll_out = sampled_rollout(self.tokenizer, self.eos, batch.prompt_ids, batch.group_size,
                                   [sampled(c) for c in choices],
                                   SamplingParams.of(self.cfg.rollout).stop_strings, False, torch.device("cpu"))
        tokens = int(roll_out.loss_mask().sum())
        stats = {"gen_time_s": gen_time, "gen_tokens_per_s": tokens / max(gen_time, 1e-9), "gen_compile_s": 0.0,
                 "gen_sync_s": self.sync_s}
        if len(self.replicas) > 1:
            stats["rollout/servers_up"] = float(sum(r.up for r in self.replicas))
            stats.update({f"rollout/completions/{r.key}": float(batch.made_by[r.key]) for r in self.replicas})
        self.results.put(Batch(batch.step, batch.version, roll_out, stats))

def sampled(choice: dict) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of one completion choice asked with logprobs and return_tokens_as_token_ids."""
    logprobs = choice.get("logprobs") or {}
    tokens = [int(t.rsplit(":", 1)[1]) for t in logprobs.get("tokens") or []]
    values = [float("nan") if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    if len(tokens) != len(values):
        raise WorkerError(f"vLLM's server gave {len(values)} log-probs for {len(tokens)} tokens of a completion")
    return tokens, values
