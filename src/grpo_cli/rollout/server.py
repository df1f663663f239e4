"""`rollout.placement=server`: generation by vLLM's OpenAI-compatible server, up to `rollout.max_staleness` (K) policy
versions ahead of the update that uses its batches (docs/usage.md "Generation on vLLM's server").

    rollouts = ServerRollouts(cfg, lm, trainer.prompts, seed_of, start=0, stop=stop, run_dir=run_dir)
    rollouts.generation(step)
    rollouts.close()                                   # stops the server grpo-train started

The schedule of versions, syncs and batches and the sync check are rollout/ahead.py's, as for placement=worker; the
transport here is a thread of the training process that makes the server's HTTP calls in the order of the requests
(rollout/vllm_server.py), so the trainer trains while the server generates:

- the server: rollout.server_url, or (null) a `vllm serve` grpo-train starts on the base alone (written once to a
  scratch dir as vLLM loads it, rollout/vllm.py) and stops on exit, SIGTERM and errors;
- a sync of version v: peft saves v's adapter to a scratch folder (`_deliver`, in the trainer's thread), the thread
  loads it as LoRA `<run>-v<v>` (POST /v1/load_lora_adapter), reads the server's log-probs of the probe sequence
  under it (prompt_logprobs), and unloads the version before (requests run in order: no later batch needs it);
- a batch: one /v1/completions request per completion, all at once, the prompt as token ids, its own seed (drawn as
  the in-process vllm engine draws them: a run is reproducible on one server), the sampled tokens' log-probs kept
  as the rollout's sampler_logprobs.
"""

from __future__ import annotations

import copy
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpo_cli.base.errors import RunError, UserError, WorkerError, error_line
from grpo_cli.config.schema import Config
from grpo_cli.rollout.ahead import HALF_SYNC_TOLERANCE, SYNC_TOLERANCE, AheadOfTheUpdate, Versions
from grpo_cli.rollout.common import eos_ids, sampling_options
from grpo_cli.rollout.vllm import DTYPES, SEED_RANGE, lora_rank, sampled_rollout, save_checkpoint
from grpo_cli.rollout.vllm_server import ServerAPI, VLLMServer, wait_until_up
from grpo_cli.rollout.worker import thread_split
from grpo_cli.tasks.prompts import EncodedPrompts

# A test hook, read by the client thread: "1" makes each sync after the first load the previous version's adapter
# under the new version's name, a sync that does not happen (tests/rollout/test_vllm_server.py). Nothing else sets it.
SKIP_SYNC_TEST_HOOK = "GRPO_CLI_TEST_SERVER_SKIPS_SYNC"
SERVER_LOG = "vllm-server.log"  # in the run dir: what the server grpo-train started printed
START_DEADLINE_S = 900  # a server of a 7B model on a slow disk takes minutes; one of a running server: 60 s
URL_DEADLINE_S = 60


class ServerRollouts(AheadOfTheUpdate):
    """The trainer's side of vLLM's server: starts it (or uses rollout.server_url), sends each version's adapter
    by the server's LoRA API, asks for the batches; the sync check compares the server's probe log-probs."""

    who = "vLLM's server"
    cause = ("the adapter it serves under that version's name is not the trainer's (a server that kept an older "
             "adapter under the name, or another run loading its own: give each run its own server)")
    # vLLM's prompt_logprobs are the model's own distribution, before any temperature: the trainer's probe at 1
    probe_temperature = 1.0

    def __init__(self, cfg: Config, lm, prompts_of: Callable[[int], tuple[list[dict], EncodedPrompts]],
                 seed_of: Callable[[int], int], *, start: int, stop: Callable[[], bool], run_dir: Path,
                 history: Versions | None = None):
        super().__init__(cfg, lm, prompts_of, seed_of, start=start, stop=stop, history=history)
        # the dtype of the server grpo-train starts (rollout.vllm_dtype), whose rounding the sync check allows for;
        # a given server's is its own: model.dtype's tolerance
        self.dtype = lm.dtype if cfg.rollout.vllm_dtype == "auto" else DTYPES[cfg.rollout.vllm_dtype]
        if cfg.rollout.server_url is None:
            self.tolerance = max(self.tolerance, SYNC_TOLERANCE.get(self.dtype, HALF_SYNC_TOLERANCE))
        self.scratch = Path(tempfile.mkdtemp(prefix="grpo-server-"))
        self.prefix = f"grpo-{os.getpid()}"  # adapter names of this process: a shared server keeps them apart
        self.server: VLLMServer | None = None
        self.loaded: list[tuple[str, Path]] = []  # (name, folder) of the adapters loaded on the server
        self.closing = threading.Event()
        self.requests, self.results = queue.Queue(), queue.Queue()
        self.tokenizer = copy.deepcopy(lm.tokenizer)  # the thread's own: a fast tokenizer is not for two threads
        self.eos = eos_ids(lm.model, lm.tokenizer)
        self.sync_s = 0.0
        try:
            if cfg.rollout.server_url is None:
                self.server = self._start_server(cfg, lm, run_dir)
            self.api = ServerAPI(cfg.rollout.server_url or self.server.url)
            self.thread = threading.Thread(target=self._serve, name="grpo-rollout-server", daemon=True)
            self.thread.start()
            self.begin("answered")
        except BaseException:
            self.close()
            raise

    def _start_server(self, cfg: Config, lm, run_dir: Path) -> VLLMServer:
        """`vllm serve` of the base (no adapter: the adapters come by name) on the CPU's share of the threads that
        the worker placement would take, or on the accelerator vLLM finds. Two adapters at most are loaded at once:
        the new version's, and the one before until it is unloaded."""
        base = self.scratch / "base"
        save_checkpoint(lm.model, lm.tokenizer, base, self.dtype, with_adapter=False)
        cpu, threads = lm.device.type == "cpu", None
        if cpu:
            trainer_threads, threads = thread_split(cfg.rollout.worker_threads, torch.get_num_threads())
            torch.set_num_threads(trainer_threads)
        roll = cfg.rollout
        return VLLMServer(base, Path(run_dir) / SERVER_LOG, dtype=str(self.dtype).removeprefix("torch."),
                          lora_rank=lora_rank(lm.model), max_loras=2, seed=cfg.trainer.seed,
                          max_model_len=roll.vllm_max_model_len, kv_cache_gib=roll.vllm_kv_cache_gib,
                          gpu_memory_utilization=roll.vllm_gpu_memory_utilization, threads=threads, cpu=cpu)

    def close(self) -> None:
        """Stop the thread (a call in flight ends with the server, or runs out), unload this run's adapters from a
        server given by URL, stop the server grpo-train started, remove the scratch dir."""
        self.closing.set()
        self.requests.put(("close",))
        thread = getattr(self, "thread", None)
        if self.server is not None:
            self.server.stop()
        elif thread is not None:
            thread.join(timeout=5)
            for name, _ in list(self.loaded):
                try:
                    self.api.unload_adapter(name, timeout=5)
                except WorkerError:
                    pass  # the server went away, or keeps it: nothing of this run depends on it
        if thread is not None:
            thread.join(timeout=5)
        shutil.rmtree(self.scratch, ignore_errors=True)

    # ---- the trainer's thread -------------------------------------------------------------------
    def _deliver(self, version: int, adapter: dict[str, torch.Tensor]) -> None:
        """peft's own adapter files of `version` (the kept tensors, whatever the model holds now) for the server."""
        folder = self.scratch / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        self.lm.model.save_pretrained(folder, state_dict=adapter, save_embedding_layers=False)
        self.requests.put(("sync", version, folder))

    def _check_alive(self, what: str) -> None:
        if self.server is not None and self.server.ended() is not None:
            raise WorkerError(f"vLLM's server (pid {self.server.process.pid}) ended with exit code "
                              f"{self.server.ended()} before it {what}; its log: {self.server.log}")
        if not self.thread.is_alive() and self.results.empty():
            raise WorkerError(f"the thread that calls vLLM's server ended before the server {what}")

    # ---- the client thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        """The requests in order, until "close"; every failure goes to the trainer, which says it in one line."""
        try:
            wait_until_up(self.api, self.server, START_DEADLINE_S if self.server else URL_DEADLINE_S,
                          self.closing.is_set)
            self.results.put(("ready",))
            while not self.closing.is_set():
                message = self.requests.get()
                if message[0] == "close":
                    return
                if message[0] == "sync":
                    self.results.put(("synced", message[1], self._load(*message[1:])))
                else:
                    _, step, version, prompt_ids, seed = message
                    self.results.put(("batch", step, version, *self._generate(version, prompt_ids, seed)))
        except Exception as err:  # noqa: BLE001
            if not self.closing.is_set():
                told = isinstance(err, (UserError, RunError))
                self.results.put(("failed", err if told else WorkerError(
                    f"rollout.placement=server failed: {error_line(err)}")))

    def _load(self, version: int, folder: Path) -> torch.Tensor:
        """Load `version`'s adapter under its name, unload the one before; the server's probe log-probs under it."""
        t0, name = time.perf_counter(), self._name(version)
        planted = os.environ.get(SKIP_SYNC_TEST_HOOK) == "1" and self.loaded
        self.api.load_adapter(name, self.loaded[-1][1] if planted else folder)
        for old, old_folder in self.loaded:
            self.api.unload_adapter(old)
            if not planted:
                shutil.rmtree(old_folder, ignore_errors=True)
        self.loaded = [(name, folder)]
        self.sync_s = time.perf_counter() - t0
        prompt, completion = self.probe.prompt_ids[0].tolist(), self.probe.completion_ids[0].tolist()
        choice = self.api.completion({"model": name, "prompt": prompt + completion, "max_tokens": 1,
                                      "temperature": 1.0, "prompt_logprobs": 0})
        ranked = (choice.get("prompt_logprobs") or [])[len(prompt):]
        if len(ranked) != len(completion):
            raise WorkerError(f"vLLM's server gave {len(ranked)} prompt log-probs of the probe's {len(completion)} "
                              "completion tokens (its /v1/completions lacks prompt_logprobs?)")
        return torch.tensor([[float(r[str(t)]["logprob"]) for t, r in zip(completion, ranked, strict=True)]])

    def _name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def _generate(self, version: int, prompt_ids: list[list[int]], seed: int) -> tuple:
        """One step's batch by `version`: G completions per prompt, each its own request and seed."""
        cfg, roll = self.cfg, self.cfg.rollout
        G, options = cfg.algo.num_generations, sampling_options(roll)
        seeds = torch.randint(0, SEED_RANGE, (len(prompt_ids) * G,),
                              generator=torch.Generator().manual_seed(seed)).tolist()
        stop_strings = options["stop_strings"]
        common = {"model": self._name(version), "max_tokens": roll.max_new_tokens, "min_tokens": roll.min_new_tokens,
                  "temperature": options["temperature"], "top_p": options["top_p"], "top_k": options["top_k"],
                  "min_p": options["min_p"], "repetition_penalty": options["repetition_penalty"],
                  "stop": list(stop_strings) or None, "include_stop_str_in_output": True, "stop_token_ids": self.eos,
                  "skip_special_tokens": False, "logprobs": 0, "return_tokens_as_token_ids": True}
        bodies = [{**common, "prompt": list(p), "seed": s}
                  for p, s in zip((p for p in prompt_ids for _ in range(G)), seeds, strict=True)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(64, len(bodies))) as pool:
            choices = list(pool.map(self.api.completion, bodies))
        gen_time = time.perf_counter() - t0
        roll_out = sampled_rollout(self.tokenizer, self.eos, prompt_ids, G, [sampled(c) for c in choices],
                                   stop_strings, False, torch.device("cpu"))
        tokens = int(roll_out.loss_mask().sum())
        return roll_out, {"gen_time_s": gen_time, "gen_tokens_per_s": tokens / max(gen_time, 1e-9),
                          "gen_compile_s": 0.0, "gen_sync_s": self.sync_s}


def sampled(choice: dict) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of one completion choice asked with logprobs and return_tokens_as_token_ids."""
    logprobs = choice.get("logprobs") or {}
    tokens = [int(t.rsplit(":", 1)[1]) for t in logprobs.get("tokens") or []]
    values = [float("nan") if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    if len(tokens) != len(values):
        raise WorkerError(f"vLLM's server gave {len(values)} log-probs for {len(tokens)} tokens of a completion")
    return tokens, values
