"""grpo-cli's console scripts, started as forks of a process that has already imported torch, transformers, peft
and Hydra, for the tests.

A fresh `grpo-train` spends about 10 s of one core importing those libraries before it reads its first option, and
the suite starts some hundred of them. One server process (`python prewarmed.py SOCKET`) therefore imports them
once and then forks a child per request: under pytest-xdist the controller starts it before the workers
(`start_shared`, from conftest.py) and every worker uses it; without xdist the test process starts its own on first
use. The child is then set up as exec would set up a new process: its own argv, cwd, environment,
stdin/stdout/stderr (the caller's pipe ends, passed over the socket), signal dispositions and session, and it calls
the console script's entry point, so the command runs exactly as installed, in a process of its own, with its own
exit status and signals.

A fork cannot pretend a fresh interpreter where the environment changes what an import has already read (the
hash seed, thread counts, cache folders, CUDA devices, LD_PRELOAD): a request whose environment differs from the
server's in such a variable (IMPORT_TIME_ENV), a run under torchrun (trainer.nproc > 1), a caller's preexec_fn or
a terminal for stdio runs the script with a real exec (subprocess.Popen), as does `fresh=True`, and so does every
request unless the worker runs torch with one thread (OMP_NUM_THREADS=1, as `make test`'s workers do): with more,
torch's import starts threads, and a fork copies only the thread that forks.

The server runs on the C allocator a command gets (grpo_cli/model/allocator.py: it re-executes itself with TCMalloc
preloaded where installed), so its children do; a request that would get another (GRPO_CLI_ALLOCATOR set
otherwise, or a memory budget on its command line) runs with a real exec.

PREWARMED_LOG=FILE appends one line per request to FILE: the test, and whether it forked.

`popen` and `run` take the arguments of subprocess.Popen and subprocess.run that the tests use.
"""

from __future__ import annotations

import atexit
import gc
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from grpo_cli.model import allocator

# the console scripts of pyproject.toml's [project.scripts], as installed: name -> "module:function"
ENTRY_POINTS = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")
                if e.value.startswith("grpo_cli.")}
# environment variables that torch, transformers, huggingface_hub or Python read when imported or started
IMPORT_TIME_ENV = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
                   "CUDA", "LD_", "XDG_", "HOME", "TMPDIR", "LANG", "LC_", "TOKENIZERS", "TQDM", "NCCL", "RANK",
                   "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "GRPO_CLI_ALLOCATOR")
# defaults that grpo_cli.commands.cli and torch put in the environment when imported: the server starts without
# them, so that its imports set them (and its children get them) whether or not this worker has imported those
# modules yet
SET_ON_IMPORT = ("TQDM_DISABLE", "TOKENIZERS_PARALLELISM", "TORCHINDUCTOR_CACHE_DIR")
PRELOADED = ("grpo_cli.commands.cli", "torch", "transformers", "peft", "safetensors.torch", "hydra.core.utils",
             "hydra._internal.utils", "transformers.models.llama.modeling_llama", "grpo_cli.config.compose",
             "grpo_cli.run.validate", "grpo_cli.run.runner", "grpo_cli.step.trainer", "grpo_cli.model.loading",
             "grpo_cli.rewards", "grpo_cli.step.evaluate", "grpo_cli.commands.export", "grpo_cli.rollout.hf",
             "grpo_cli.rollout.compiled", "grpo_cli.step.optim", "grpo_cli.tracking")


# ---- the caller's side (the pytest worker) ----------------------------------------------------------------------
SHARED = "PREWARMED_SERVER"  # the folder of the server that the xdist controller started, for its workers


class Server:
    """A server process started with the environment `env` (`folder=None`), or the one already serving from
    `folder` (its starter owns it: it stops it)."""

    def __init__(self, env: dict | None = None, folder: str | None = None):
        self.process = None
        if folder is not None:
            self.folder = folder
            self.env = json.loads(Path(folder, "env.json").read_text())
        else:
            self.env = {k: v for k, v in env.items() if k not in SET_ON_IMPORT}
            self.folder = tempfile.mkdtemp(prefix="grpo-prewarmed-")
            Path(self.folder, "env.json").write_text(json.dumps(self.env))
            log = open(os.path.join(self.folder, "server.log"), "w")
            self.process = subprocess.Popen([sys.executable, __file__, self.address], env=self.env,
                                            stdin=subprocess.PIPE, stdout=log, stderr=log)
            log.close()
            atexit.register(self.close)

    @property
    def address(self) -> str:
        return os.path.join(self.folder, "socket")

    def connect(self) -> socket.socket:
        deadline = time.monotonic() + 180
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.address)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                ended = self.process is not None and self.process.poll() is not None
                if ended or time.monotonic() > deadline:
                    log = Path(self.folder, "server.log").read_text()[-3000:]
                    raise RuntimeError(f"the prewarmed server did not start: {log}") from None
                time.sleep(0.05)

    def set_by_imports(self) -> dict:
        """What the server's imports added to its environment (grpo_cli.commands.cli and torch set a few defaults)."""
        if not hasattr(self, "_set_by_imports"):
            self._set_by_imports = json.loads(Path(self.folder, "set_by_imports.json").read_text())
        return self._set_by_imports

    def close(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.stdin.close()  # its end of file: the server exits
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: Server | None = None


def start_shared(env: dict) -> Server:
    """Start the server that the xdist workers (started after this, with this process's environment) share: its
    imports run while they collect, and happen once, not once a worker. `env` is the workers' environment."""
    server = Server(env)
    os.environ[SHARED] = server.folder
    return server


def _this_runs_server() -> Server:
    global _server
    if _server is None:
        _server = Server(folder=os.environ[SHARED]) if os.environ.get(SHARED) else Server(os.environ)
    return _server


def _forkable(args: list[str], env: dict, server: Server) -> bool:
    """A grpo-cli script of this venv, in an environment that differs from the server's at most in variables that
    nothing reads on import. A variable that the server's imports set and the request lacks is no difference: the
    child gets it as a fresh process would, from those imports."""
    if Path(args[0]).name not in ENTRY_POINTS or Path(args[0]).parent != Path(sys.executable).parent:
        return False
    if any(str(a).startswith("trainer.nproc=") and str(a) != "trainer.nproc=1" for a in args):
        return False  # grpo-train execs torchrun, whose ranks start as fresh processes anyway
    if allocator.budget_on_command_line([str(a) for a in args]):
        return False  # grpo-train keeps glibc's allocator for it; the server runs on the one a command gets without
    base, imported = server.env, server.set_by_imports()
    changed = {k for k in set(env) | set(base) | set(imported) if env.get(k) != base.get(k, imported.get(k))
               and not (k in imported and k not in env)} - {"PYTHONPATH"}
    return not any(k.startswith(IMPORT_TIME_ENV) for k in changed)


class Forked:
    """The part of subprocess.Popen's interface that the tests use, for a child of the server."""

    def __init__(self, args, sock: socket.socket, stdout, stderr):
        self.args, self._sock, self.stdout, self.stderr = args, sock, stdout, stderr
        self.returncode = None
        self.pid = self._receive()["pid"]

    def _receive(self, timeout: float | None = None) -> dict:
        self._sock.settimeout(timeout)
        data = self._sock.recv(4096)
        if not data:
            raise RuntimeError("the prewarmed server's child monitor ended without an exit status")
        return json.loads(data)

    def poll(self):
        if self.returncode is None:
            try:
                self._set(self._receive(timeout=0))
            except (BlockingIOError, TimeoutError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            try:
                self._set(self._receive(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _set(self, message: dict) -> None:
        self.returncode = os.waitstatus_to_exitcode(message["status"])
        self._sock.close()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None):
        """Both pipes read to their end (by threads, so that neither fills up), then the exit status."""
        results: dict = {}
        readers = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return results.get("out"), results.get("err")


def popen(args: list[str], cwd=None, env: dict | None = None, stdout=None, stderr=None, text: bool = False,
          start_new_session: bool = False, fresh: bool = False, rlimits: dict | None = None, **popen_only):
    """A grpo-cli console script (`args[0]`, its path in this venv) as a forked child of this worker's server, or
    with subprocess.Popen where a fork would not be faithful (see the module's docstring). `rlimits` maps resource
    names (RLIMIT_FSIZE) to (soft, hard) limits of the child."""
    env = dict(os.environ if env is None else env)
    # torch starts its OpenMP threads when imported unless it has one thread (as under `make test`'s workers)
    forks = not fresh and not popen_only and os.environ.get("OMP_NUM_THREADS") == "1"
    server = _this_runs_server() if forks else None
    sock = server.connect() if forks else None  # once it accepts, its imports are done
    if os.environ.get("PREWARMED_LOG"):
        with open(os.environ["PREWARMED_LOG"], "a") as log:
            forked = forks and _forkable(args, env, server)
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST')} forks={forked} {args[0]}\n")
    if not forks or not _forkable(args, env, server):
        if sock is not None:
            sock.close()
        if rlimits:
            popen_only["preexec_fn"] = lambda: _set_rlimits(rlimits)
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **popen_only)
    ends, mine = [], {}
    for name, target in (("stdin", subprocess.DEVNULL), ("stdout", stdout), ("stderr", stderr)):
        if target == subprocess.PIPE:
            read, write = os.pipe()
            mine[name] = open(read, "r" if text else "rb", **({"encoding": None} if text else {}))
            ends.append(write)
        elif target == subprocess.DEVNULL or (target is None and name == "stdin"):
            ends.append(os.open(os.devnull, os.O_RDWR))
        elif target is None:
            ends.append(os.dup(name == "stdout" and 1 or 2))
        else:
            ends.append(os.dup(target if isinstance(target, int) else target.fileno()))
    request = {"script": str(args[0]), "args": [str(a) for a in args[1:]], "cwd": str(cwd or os.getcwd()),
               "env": env, "new_session": start_new_session, "rlimits": rlimits or {}}
    try:
        socket.send_fds(sock, [json.dumps(request).encode()], ends)
    finally:
        for fd in ends:
            os.close(fd)
    return Forked(args, sock, mine.get("stdout"), mine.get("stderr"))


def run(args: list[str], cwd=None, env: dict | None = None, capture_output: bool = False, text: bool = False,
        timeout: float | None = None, fresh: bool = False, rlimits: dict | None = None,
        **popen_only) -> subprocess.CompletedProcess:
    """subprocess.run for a grpo-cli console script, through `popen`."""
    pipes = subprocess.PIPE if capture_output else None
    child = popen(args, cwd=cwd, env=env, stdout=pipes, stderr=pipes, text=text, fresh=fresh, rlimits=rlimits,
                  **popen_only)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def _set_rlimits(rlimits: dict) -> None:
    import resource

    for name, limits in rlimits.items():
        resource.setrlimit(getattr(resource, name), tuple(limits))


# ---- the server's side -------------------------------------------------------------------------------------------
def serve(address: str) -> dict:
    """Import the libraries, then fork a child per request; returns (only in a child) the request to run. The
    server exits when its stdin (its starter's pipe) ends."""
    import importlib
    import select

    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if k not in before}
    _compose_once(Path(address).parent)
    Path(address).with_name("set_by_imports.json").write_text(json.dumps(set_by_imports))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the forking thread: locks that another one held would stay held
        sys.exit(f"the prewarmed server has {threads} threads after its imports; it forks only with one")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    gc.freeze()  # a child's collections then skip the imported objects, whose pages stay shared, not copied
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            sys.exit(0)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        if not message:  # the caller decided on a real exec after all
            conn.close()
            continue
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # the monitor: starts the child, reports its pid and exit status
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                request["fds"], request["set_by_imports"] = fds, set_by_imports
                return request
            for fd in fds:
                os.close(fd)
            _send(conn, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _send(conn, {"status": status})
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _compose_once(folder: Path) -> None:
    """`grpo-train +recipe=quickstart --cfg job` in the server, its output dropped: Hydra finds its plugins and
    builds its override parser's tables on the first compose of a process, which then costs about 0.4 s more than
    a later one; the children start with that done. It writes nothing and leaves no Hydra state behind (Hydra
    clears its global state when a command ends)."""
    import contextlib
    import io

    from grpo_cli.commands.cli import train

    argv = sys.argv
    sys.argv = ["grpo-train", "+recipe=quickstart", "model=tiny", f"hydra.run.dir={folder}/composed", "--cfg", "job"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train()
    except SystemExit as stop:
        if stop.code:
            raise RuntimeError(f"grpo-train --cfg job exited {stop.code} in the prewarmed server") from None
    finally:
        sys.argv = argv


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the caller has gone
        pass


def become(request: dict) -> None:
    """In the forked child: the process state that exec of the console script would give, then its entry point."""
    import importlib

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                   signal.SIGXFSZ: signal.SIG_IGN}.get(signum, signal.SIG_DFL)
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError):
            pass
    _set_rlimits(request["rlimits"])
    os.chdir(request["cwd"])
    env, old = request["env"], os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(env)
    for key, value in request["set_by_imports"].items():
        os.environ.setdefault(key, value)
    # sys.path as the console script would have it: its folder, then PYTHONPATH, then the installation's
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in old.split(os.pathsep)]
    script = request["script"]
    sys.path[:] = [os.path.dirname(script), *added, *rest]
    importlib.invalidate_caches()
    sys.argv = [script, *request["args"]]
    sys.orig_argv = [sys.executable, script, *request["args"]]
    module, function = ENTRY_POINTS[os.path.basename(script)].split(":")
    entry = getattr(importlib.import_module(module), function)
    sys.exit(entry())


if __name__ == "__main__":
    allocator.preload(allocator.libraries_to_preload([]))  # the allocator a grpo-cli command runs on, as it would
    become(serve(sys.argv[1]))
