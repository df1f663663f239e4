"""Running an untrusted Python program (a model's completion) in a sandbox, with what the system provides.

    box = resolve("auto")                       # the strongest kind that works here (probed once per process)
    done = box.run(source, stdin, Limits())     # Finished: stdout, stderr (capped), return code, timed_out, ...

The kinds, strongest first (`auto` takes the first that works):

    bwrap    bubblewrap: new pid, network, ipc and uts namespaces (and a user namespace, unless run as root); the file
             system is /usr and Python's own prefix read-only, a private /dev and /proc, and a size-capped tmpfs at
             /sandbox, the only writable place; no network at all (the host's loopback included); no capability.
    unshare  the same namespaces through util-linux's `unshare`, and the same file system, which a short sh script
             builds (mount, pivot_root) before it drops every capability (setpriv).
    rlimits  no namespaces: the resource limits only, in a fresh temporary directory, in a session of its own. The
             program can read what its user can, reach the network and start any number of processes; run as
             root it runs as nobody (uid 65534), so it cannot signal the trainer nor write root's files; run as
             another user it is that user, who can signal the trainer and write its files. resolve() names it only
             when nothing stronger works, and the caller says so in a warning (`contained`).

Run as root, the namespaced kinds switch the program to uid and gid 65534 (nobody): mapped to root, it would own
root's files and be exempt from the process limit. Every kind: the program runs as `python -I -S` (the interpreter
of this process, without site-packages), after a preamble that sets its rlimits: address space, CPU seconds, file
size, no core file and, in the namespaced kinds, processes (the user's processes in its user namespace; as root,
nobody's processes). The wall clock limit and the output cap (stdout and stderr together) kill its process group;
in the namespaced kinds the end of the sandbox's first process kills every process left in it. A trainer that ends
without stopping its sandboxes (kill -9) takes them along: bwrap --die-with-parent; unshare and rlimits start behind
`setpriv --pdeathsig KILL`, the kernel's SIGKILL to the sandbox's first process when the trainer ends (unshare then
kills its namespace; under rlimits the program's own children stay, as nothing else contains them there).
"""

from __future__ import annotations

import functools
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, TypedDict, cast

KINDS = ("bwrap", "unshare", "rlimits")
CHOICES = ("auto", *KINDS)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # read-only in the namespaced kinds
WORKDIR = "/sandbox"  # the program's cwd, HOME and TMPDIR in the namespaced kinds
TOOL_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # where the namespaced kinds' tools are looked for
TOOLS = {"bwrap": ("bwrap",), "unshare": ("unshare", "mount", "umount", "pivot_root", "setpriv"), "rlimits": ()}
CHUNK = 65536
PIPE_BUF = getattr(select, "PIPE_BUF", 512)  # what a write to a pipe select() calls writable takes at once


class SandboxError(RuntimeError):
    """The sandbox could not be set up, or failed itself (not the program in it)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0        # wall clock seconds for the whole run (interpreter start included), and CPU seconds
    memory_mb: int = 1024         # address space of the program
    processes: int = 32           # processes and threads at once (namespaced kinds)
    output_bytes: int = 65536     # stdout + stderr; more kills the program
    disk_mb: int = 64             # the writable directory (a tmpfs of this size), and the largest file


@dataclass(frozen=True)
class Finished:
    stdout: bytes
    stderr: bytes
    returncode: int | None        # None: killed by the sandbox (timed_out or overflowed)
    timed_out: bool = False
    overflowed: bool = False


# ---- the command of each kind ----------------------------------------------------------------------
def interpreter() -> tuple[str, list[str]]:
    """The Python programs run with (the venv's base interpreter: a venv's own copy would lie outside the folders
    bound), and the folders it needs besides SYSTEM_DIRS."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    python, prefix = os.path.realpath(base), os.path.realpath(sys.base_prefix)
    covered = any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS)
    return python, [] if covered else [prefix]


def preamble(limits: Limits, count_processes: bool) -> str:
    """Python that sets the program's rlimits, to run before it (soft CPU limit: SIGXCPU; one second later SIGKILL)."""
    mb, cpu = 1 << 20, max(1, math.ceil(limits.timeout_s))
    pairs = [("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb), ("RLIMIT_CPU", cpu, cpu + 1),
             ("RLIMIT_FSIZE", limits.disk_mb * mb, limits.disk_mb * mb), ("RLIMIT_CORE", 0, 0)]
    if count_processes:
        pairs.append(("RLIMIT_NPROC", limits.processes, limits.processes))
    lines = [f"resource.setrlimit(resource.{name}, ({soft}, {hard}))" for name, soft, hard in pairs]
    return "\n".join(["import resource", *lines, "del resource", ""])


NOBODY = 65534  # the uid and gid programs run as when this process is root


def _root() -> bool:
    """Run as root, a sandbox needs no user namespace to build its mounts, and its program is switched to NOBODY
    (setpriv): a program mapped to root would be exempt from the process limit and own root's files."""
    return os.geteuid() == 0


def _as_nobody() -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--bounding-set=-all",
            "--inh-caps=-all", "--no-new-privs", "--"]


def _bwrap(python: str, dirs: list[str], limits: Limits, code: str) -> list[str]:
    args = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv"]
    if _root():  # setpriv needs these three to switch to NOBODY and clear the bounding set; it leaves none
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    for d in (*SYSTEM_DIRS, *dirs):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--dev", "/dev", "--proc", "/proc", "--perms", "0777", "--size", str(limits.disk_mb << 20),
             "--tmpfs", WORKDIR, "--remount-ro", "/", "--chdir", WORKDIR]
    for key, value in _environment(WORKDIR).items():
        args += ["--setenv", key, value]
    return [*args, "--", *(_as_nobody() if _root() else []), python, "-I", "-S", "-c", code]


# Run as the first process of fresh mount, pid, network, ipc and uts namespaces (`unshare`; and a user namespace
# unless run as root): build the new root on $1 (a tmpfs: the system dirs and the interpreter's prefix
# read-only, /dev's harmless nodes, the tmpfs WORKDIR), pivot into it, drop the old root, make / read-only,
# then run the program without any capability ($5: as NOBODY when run as root). /proc is mounted only for
# umount's sake and unmounted again: nothing of the host's stays visible.
_UNSHARE_SCRIPT = r"""set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
root=$1 python=$2 size=$3 code=$4 ids=$5; shift 5
mount -t tmpfs -o size=1m,mode=0755 sandbox-root "$root"
for d in /usr /bin /sbin /lib /lib32 /lib64 /libx32 "$@"; do
  if [ -L "$d" ]; then ln -s "$(readlink "$d")" "$root$d"
  elif [ -d "$d" ]; then mkdir -p "$root$d"; mount --rbind "$d" "$root$d"; mount -o remount,bind,ro "$root$d"
  fi
done
mkdir "$root/dev" "$root/proc" "$root/old" "$root/sandbox"
for n in null zero full random urandom; do touch "$root/dev/$n"; mount --bind "/dev/$n" "$root/dev/$n"; done
mount -t tmpfs -o "size=${size},mode=0777" sandbox "$root/sandbox"
cd "$root"
pivot_root . old
mount -t proc proc /proc
umount -l /old
umount /proc
rmdir /old /proc
mount -o remount,ro,bind /
cd /sandbox
setpriv $ids --bounding-set=-all --inh-caps=-all --no-new-privs -- \
  env -i HOME=/sandbox TMPDIR=/sandbox PATH=/usr/bin:/bin LANG=C.UTF-8 "$python" -I -S -c "$code"
"""


def _unshare(python: str, dirs: list[str], limits: Limits, code: str, root: str) -> list[str]:
    user = [] if _root() else ["--user", "--map-root-user"]
    ids = " ".join(_as_nobody()[1:4]) if _root() else ""
    return ["unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--", "/bin/sh", "-c", _UNSHARE_SCRIPT, "sandbox", root, python,
            str(limits.disk_mb << 20), code, ids, *dirs]


def _environment(home: str) -> dict[str, str]:
    return {"HOME": home, "TMPDIR": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


# ---- running ---------------------------------------------------------------------------------------
class _RunAs(TypedDict, total=False):
    """Popen's arguments for the user the program runs as (unset: this process's)."""

    user: int
    group: int
    extra_groups: list[int]


@dataclass(frozen=True)
class Sandbox:
    kind: str
    as_nobody: bool = False  # rlimits run by root: the program as NOBODY (`rlimits_as_nobody`)

    def run(self, source: str, stdin: bytes, limits: Limits) -> Finished:
        """`source` run by a fresh interpreter in the sandbox, `stdin` its input; OSError when the sandbox's own
        program cannot start."""
        python, dirs = interpreter()
        code = preamble(limits, count_processes=self.kind != "rlimits") + source
        with tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as scratch:
            cwd, env = None, _environment(WORKDIR)
            if self.kind == "bwrap":
                argv = _bwrap(python, dirs, limits, code)
            elif self.kind == "unshare":
                argv = _unshare(python, dirs, limits, code, scratch)  # the mount point of the new root
            else:
                argv, cwd, env = [python, "-I", "-S", "-c", code], scratch, _environment(scratch)
            argv[0] = shutil.which(argv[0], path=TOOL_PATH) or argv[0]
            if self.kind != "bwrap" and (setpriv := shutil.which("setpriv", path=TOOL_PATH)):
                argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]  # set after a switch to NOBODY, which clears it
            as_nobody: _RunAs = {}
            if self.kind == "rlimits" and self.as_nobody:  # another uid: it cannot signal the trainer
                os.chmod(scratch, 0o777)
                as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, env=env, start_new_session=True, **as_nobody)
            try:
                return _communicate(proc, stdin, limits)
            finally:
                _kill_group(proc)


def _communicate(proc: subprocess.Popen[bytes], stdin: bytes, limits: Limits) -> Finished:
    """Feed stdin and read stdout and stderr until the program ends, the wall clock runs out or the output
    passes its cap. A process the program left behind holding the pipes does not keep it waiting."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # Sandbox.run pipes all 3
    deadline = time.monotonic() + limits.timeout_s
    out: dict[IO[bytes], bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    pending, total = memoryview(stdin), 0
    with selectors.DefaultSelector() as selector:
        for pipe in out:
            selector.register(pipe, selectors.EVENT_READ)
        if pending:
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        exited = False
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return Finished(bytes(out[proc.stdout]), bytes(out[proc.stderr]), None, timed_out=True)
            ready = selector.select(0 if exited else min(left, 0.05))
            if exited and not ready:
                break  # the program is gone and its pipes hold nothing more
            for key, _ in ready:
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[:PIPE_BUF]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                pipe = cast(IO[bytes], key.fileobj)  # the selector holds only the pipes registered above
                chunk = os.read(pipe.fileno(), CHUNK)
                if not chunk:
                    selector.unregister(pipe)
                    continue
                out[pipe] += chunk
                total += len(chunk)
                if total > limits.output_bytes:
                    return Finished(bytes(out[proc.stdout]), bytes(out[proc.stderr]), None, overflowed=True)
            exited = exited or proc.poll() is not None
    try:
        code = proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # its pipes closed, but it runs on
        return Finished(bytes(out[proc.stdout]), bytes(out[proc.stderr]), None, timed_out=True)
    return Finished(bytes(out[proc.stdout]), bytes(out[proc.stderr]), code)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the program's process group (it leads its own session), then reap it; pipes closed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


# ---- which kind works here -------------------------------------------------------------------------
PROBE = "import sys\nsys.stdout.write('sandbox ok')\n"


@functools.cache
def probe(kind: str) -> str | None:
    """None when `kind` runs a program here, else why not (a few words); tried once per process."""
    try:
        import resource  # noqa: F401  every kind sets rlimits
    except ImportError:
        return "no rlimits on this system (Python's resource module is missing)"
    tools = (*TOOLS[kind], *(("setpriv",) if kind == "bwrap" and _root() else ()))
    missing = [tool for tool in tools if shutil.which(tool, path=TOOL_PATH) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    try:
        done = Sandbox(kind).run(PROBE, b"", Limits(timeout_s=30))
    except OSError as err:
        return str(err)
    if done.stdout == b"sandbox ok" and done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return "timed out" if done.timed_out else f"exit code {done.returncode}"
    return lines[-1].removeprefix(f"{kind}: ")[:160]  # bwrap's and unshare's own messages name them


@functools.cache
def rlimits_as_nobody() -> str | None:
    """Run as root, whether the rlimits kind can run its programs as NOBODY (None), else why not: then a program
    there runs as root and could signal the trainer, and auto does not pick that kind (it must be named)."""
    if not _root():
        return "not run as root"
    try:
        done = Sandbox("rlimits", as_nobody=True).run(PROBE, b"", Limits(timeout_s=30))
    except (OSError, subprocess.SubprocessError) as err:
        return " ".join(str(err).split())[:160]
    if done.stdout == b"sandbox ok" and done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else f"exit code {done.returncode}"


def resolve(choice: str = "auto") -> Sandbox:
    """The sandbox `choice` names (one of CHOICES), or for auto the strongest kind that works here; SandboxError
    (one line, with why) when the kind named, or for auto every kind, does not work. Run as root, rlimits runs its
    programs as NOBODY where it can; where it cannot, only a sandbox named rlimits runs them (as root)."""
    if choice not in CHOICES:
        raise SandboxError(f"no sandbox {choice!r}: use one of {', '.join(CHOICES)}")
    if choice != "auto":
        why = probe(choice)
        if why is not None:
            raise SandboxError(f"the {choice} sandbox does not work here ({why})")
        return Sandbox(choice, as_nobody=choice == "rlimits" and _root() and rlimits_as_nobody() is None)
    reasons = []
    for kind in KINDS:
        why = probe(kind)
        if why is None and kind == "rlimits" and _root() and rlimits_as_nobody() is not None:
            why = (f"run as root, its programs could signal the trainer: they cannot run as nobody here "
                   f"({rlimits_as_nobody()}); name sandbox=rlimits to accept that")
        if why is None:
            return Sandbox(kind, as_nobody=kind == "rlimits" and _root())
        reasons.append(f"{kind}: {why}")
    raise SandboxError(f"no sandbox works here ({'; '.join(reasons)})")


def setup_fix() -> str:
    """What to do when no namespaced sandbox works here."""
    if shutil.which("bwrap", path=TOOL_PATH) is None:
        return "install bubblewrap (apt-get install bubblewrap)"
    return "allow user namespaces here (sysctl user.max_user_namespaces > 0; a container may forbid them)"


def contained() -> str:
    """What the rlimits kind contains and what not, for the warning that auto fell back to it (or that it was named)."""
    limits = "time, memory, file size and output are bounded"
    if _root() and rlimits_as_nobody() is None:
        return (f"{limits}, and programs run as nobody (they cannot signal the trainer nor write root's files), but "
                "they can read what nobody may read, reach the network and start any number of processes")
    user = "root" if _root() else "your user"
    return (f"{limits}, but programs run as {user}: they can read and write your files, signal your processes "
            "(the trainer included), reach the network and start any number of processes")


def weaker_than_wanted() -> str:
    """Why neither namespaced kind works here (for the warning that auto fell back to rlimits alone)."""
    return "; ".join(f"{kind}: {probe(kind)}" for kind in KINDS[:2])
