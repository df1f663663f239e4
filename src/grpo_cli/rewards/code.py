"""A reward that runs the completion's program against the row's tests, in a sandbox (grpo_cli.rewards.sandbox).

    reward:
      functions:
        tests:
          _target_: grpo_cli.rewards.code.passes_tests
          weight: 1.0
          all_or_nothing: false     # true: 1 when every test passes, else 0; false: the share of tests passed
          timeout_s: 5              # wall clock (interpreter start included) and CPU seconds per program
          memory_mb: 1024           # the program's address space
          max_processes: 32         # processes and threads at once
          max_output_bytes: 65536   # stdout + stderr; more ends the program (crashed)
          sandbox: auto             # auto (the strongest that works here) | bwrap | unshare | rlimits
          workers: null             # programs run at once; null = the CPU count

The row's fields: `tests`, Python source, either `assert` statements (each top-level statement holding an assert is
one test) or HumanEval's `def check(candidate)` with the row's `entry_point` (each statement of check's body holding
an assert is one test, `candidate` being the program's entry point); optionally `preamble`, code run before the
program (HumanEval's prompt: its imports and helper functions). The other statements of the tests are set-up, run
in order; a set-up statement that raises fails the tests after it.

The program is the completion's first fenced block of Python (```python or a bare ```; with an entry point, the
first that defines it), or the whole completion when it has no fence. It runs in a fresh interpreter in the
sandbox, then each test in turn in its namespace. Each completion gets an outcome, in samples.jsonl as
outcome/NAME and counted in the metrics as outcomes/NAME/KIND:

    passed k/k        every test passed                                   score 1
    failed k/n        the program ran; k < n tests passed                 k/n (all_or_nothing: 0)
    timeout           over timeout_s, wall clock or CPU                   0
    crashed: why      the program raised before its tests, was killed (memory, a signal), or printed too much   0
    refused: why      no code to run in the completion                    0

A program and its tests share one interpreter, but not the harness's verdict: the tests run in a process that cannot
write the sandbox's stdout, where a parent process that runs no code of the completion reports them, and a test
that must fail is slipped in among them (a program that rewrites exec, json, os.write, builtins or sys, or prints a
forged verdict, or rewrites the tests it finds in the heap or the harness's frames, scores 0: `crashed: the program
tampered with its tests`). Not caught: a program that reads its tests and fakes each answer (an object equal to
everything, say), nor one that reads the runner's own state (its frame, its pipe) to speak the runner's protocol
itself, spotting the canary: what shares an interpreter with the tests can do all the runner does. HumanEval's own
check_correctness runs the program in its tests' interpreter too. Results are cached per (program, tests, limits),
so a second entry of the same reward (all_or_nothing for reward.accuracy) does not run the program again.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import secrets
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from grpo_cli.base.errors import ConfigError, inform, warn
from grpo_cli.config.rule import is_int, is_number
from grpo_cli.rewards import Scored
from grpo_cli.rewards.sandbox import (
    CHOICES,
    Finished,
    Limits,
    Sandbox,
    SandboxError,
    contained,
    resolve,
    setup_fix,
    weaker_than_wanted,
)

__all__ = ["OUTCOMES", "Outcome", "passes_tests", "program_of", "split_tests"]

OUTCOMES = ("passed", "failed", "timeout", "crashed", "refused")

# ```lang ... ``` (an unclosed fence runs to the end: a completion cut by max_new_tokens)
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PYTHON = ("", "python", "python3", "py")


def program_of(completion: Any, entry_point: str | None = None) -> str:
    """The program in a completion: its first fenced Python block (with `entry_point`, the first one that defines
    it), "" when it fences only other languages, else the whole text."""
    text = completion if isinstance(completion, str) else ""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang.lower() in _PYTHON]
    if entry_point:
        defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(|^\s*{re.escape(entry_point)}\s*=",
                             re.M)
        python = [b for b in python if defines.search(b)] or python
    return python[0] if python else ""


def _holds_assert(statement: ast.stmt) -> bool:
    """Whether a statement is a test: it runs an assert (not `assert True`; a definition runs none)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)
               for node in ast.walk(statement))


@functools.lru_cache(maxsize=1024)
def split_tests(tests: str, entry_point: str | None = None) -> tuple[tuple[str, str], ...]:
    """The row's tests as steps in order: ("test", source) for each statement holding an assert (`assert True`
    alone is not a test), ("setup", source) for the others. ValueError for tests that cannot be run."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as err:
        raise ValueError(f"the row's tests are not valid Python ({err.msg}, line {err.lineno})") from None
    body = tree.body
    steps = []
    check = next((s for s in body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    if check is not None and entry_point:
        if not entry_point.isidentifier():
            raise ValueError(f"the row's entry_point {entry_point!r} is not a Python name")
        steps = [("setup", ast.unparse(s)) for s in body if s is not check]
        argument = check.args.args[0].arg if check.args.args else "candidate"
        steps.append(("setup", f"{argument} = {entry_point}"))
        body = check.body
    steps += [("test" if _holds_assert(s) else "setup", ast.unparse(s)) for s in body]
    if not any(kind == "test" for kind, _ in steps):
        raise ValueError("the row's tests hold no assert statement" + (
            "" if check is None or entry_point else " outside check(); give the row an entry_point"))
    return tuple(steps)


# Runs in the sandbox, as two processes. The judge (this script's process) reads the job, hides its /proc entry
# (not dumpable), writes "started", slips a canary (a test that must fail) in among the tests, and forks the runner,
# which never sees the sandbox's stdout: its stdout and stderr both go to stderr, and it holds the steps as a tuple,
# neither the job as sent nor the canary's place. The runner binds the harness's own
# functions before any code of the job runs (a program that replaces exec, json, os.write or builtins changes what
# the tests see, not what the harness reports), runs the preamble and the program, then each step, and writes one
# byte per step to a pipe of its own (P/F a test passed/failed, S/X a set-up ran/raised), or C and why the program
# raised, then E. The judge alone writes the verdict, after the nonce, on stdout; a canary that "passed", bytes out
# of order or a count that does not match the steps is a program that tampered with its tests.
_HARNESS = r"""
import json, os, random, sys
def _runner(sources, steps, result):
    _exec, _compile, _write, _exit, _str, _type, _Base = exec, compile, os.write, os._exit, str, type, BaseException
    def why(err):
        try:
            text = " ".join(_str(err).split())
            return (_type(err).__name__ + (": " + text if text else ""))[:120]
        except _Base:
            return "an exception that cannot be shown"
    space = {"__name__": "solution", "__builtins__": __builtins__}
    for name, source in sources:
        try:
            _exec(_compile(source, name + ".py", "exec"), space)
        except _Base as err:
            _write(result, b"C" + why(err).encode("utf-8", "replace") + b"\n")
            _exit(0)
    for kind, code in steps:
        try:
            _exec(_compile(code, "tests.py", "exec"), space)
        except _Base:
            if kind == "setup":
                _write(result, b"X")
                break
            _write(result, b"F")
        else:
            _write(result, b"S" if kind == "setup" else b"P")
    _write(result, b"E")
    _exit(0)
def _verdict(data, steps, canary):
    if data[:1] == b"C":
        return {"crashed": data[1:].split(b"\n")[0].decode("utf-8", "replace")}
    if not data.endswith(b"E") or len(data) - 1 > len(steps):
        return None
    passed = 0
    for i, mark in enumerate(data[:-1]):
        kind = steps[i][0]
        if chr(mark) not in ("PF" if kind == "test" else "SX") or (mark == ord("X") and i != len(data) - 2):
            return {"tampered": "its verdicts do not match its tests"}
        if i == canary and mark == ord("P"):
            return {"tampered": "a test that must fail passed"}
        passed += mark == ord("P") and i != canary
    if len(data) - 1 < len(steps) and data[-2:-1] != b"X":
        return {"tampered": "its verdicts do not match its tests"}
    return {"passed": passed}
def _judge():
    job = json.loads(sys.stdin.read())
    nonce, out = job["nonce"], os.dup(1)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: /proc/<judge>/fd is closed to the runner
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: what the runner leaves is the judge's
    except Exception:
        pass
    os.write(out, ("\n" + nonce + " started\n").encode())
    steps = [tuple(step) for step in job["steps"]]
    canary = random.randrange(len(steps) + 1)
    steps.insert(canary, ("test", "assert %r == %r" % (os.urandom(4).hex(), os.urandom(4).hex())))
    steps = tuple(steps)
    sources = (("preamble", job["preamble"]), ("program", job["program"]))
    read_end, write_end = os.pipe()
    judge, pid = os.getpid(), os.fork()
    if pid == 0:
        try:
            ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: the runner ends with the judge
        except Exception:
            pass
        if os.getppid() != judge:
            os._exit(0)
        os.close(read_end)
        os.close(out)
        os.dup2(2, 1)
        del job, canary, nonce  # the program can read this frame: the tests as sent and the canary's place leave it
        _runner(sources, steps, write_end)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    if job["isolated"]:  # alone in its pid namespace: every process the runner left is ended and reaped first
        try:
            os.kill(-1, 9)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    os.set_blocking(read_end, False)
    data = b""
    while True:
        try:
            chunk = os.read(read_end, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    result = _verdict(data, steps, canary)
    if result is None:
        result = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                  else {"exit": os.WEXITSTATUS(status)})
    os.write(out, ("\n" + nonce + " " + json.dumps(result) + "\n").encode())
    os._exit(0)
_judge()
"""


@dataclass(frozen=True)
class Outcome:
    kind: str                  # one of OUTCOMES
    passed: int = 0
    total: int = 0
    why: str = ""

    def score(self, all_or_nothing: bool) -> float:
        if self.kind not in ("passed", "failed"):
            return 0.0
        if all_or_nothing:
            return float(self.passed == self.total)
        return self.passed / self.total

    def __str__(self) -> str:
        if self.kind in ("passed", "failed"):
            return f"{self.kind} {self.passed}/{self.total}"
        return f"{self.kind}: {self.why}" if self.why else self.kind


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:120] if lines else ""


def outcome_of(done: Finished, nonce: str, tests: int) -> Outcome:
    """What a finished run says: its result line, or how it ended. SandboxError when the harness never started."""
    if done.timed_out:
        return Outcome("timeout")
    if done.overflowed:
        return Outcome("crashed", why="output over max_output_bytes")
    lines = [line[len(nonce) + 1:] for line in done.stdout.decode(errors="replace").splitlines()
             if line.startswith(nonce + " ")]
    if "started" not in lines:
        raise SandboxError(f"the sandboxed interpreter did not start (exit code {done.returncode}: "
                           f"{_last_line(done.stderr) or 'no message'}); check memory_mb and the sandbox")
    results = [json.loads(line) for line in lines if line != "started"]
    result = results[-1] if results else {}
    if "crashed" in result:
        return Outcome("crashed", why=result["crashed"])
    if "tampered" in result:
        return Outcome("crashed", why=f"the program tampered with its tests ({result['tampered']})")
    if "passed" in result:
        return Outcome("passed" if result["passed"] == tests else "failed", result["passed"], tests)
    code = done.returncode  # killed by signal S: -S run directly, 128 + S through bwrap's or sh's exit status
    if "signal" in result or "exit" in result:  # the judge saw the runner end before its tests did
        code = -result["signal"] if "signal" in result else result["exit"]
    assert code is not None  # None only for a run that timed out or overflowed, answered above
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum == signal.SIGXCPU:  # over the CPU seconds
        return Outcome("timeout")
    return Outcome("crashed", why=_last_line(done.stderr) or (f"killed by signal {signum}" if signum
                                                               else f"exit code {code}"))


@functools.lru_cache(maxsize=4096)
def run_tests(program: str, tests: str, entry_point: str | None, preamble: str, limits: Limits,
              box: Sandbox) -> Outcome:
    """The outcome of `program` against `tests` in the sandbox `box` (cached: the same inputs give the same outcome)."""
    steps = split_tests(tests, entry_point)
    if not program.strip():
        return Outcome("refused", why="no code")
    try:
        ast.parse(program)  # parsing runs nothing: a program that does not parse needs no sandbox
    except SyntaxError as err:
        return Outcome("crashed", why=f"SyntaxError: {err.msg} (line {err.lineno})")
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, nesting too deep for the parser
        return Outcome("crashed", why=f"{type(err).__name__}: cannot be parsed")
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "preamble": preamble, "program": program, "steps": steps,
                      "isolated": box.kind != "rlimits"}).encode()
    done = box.run(_HARNESS, job, limits)
    return outcome_of(done, nonce, sum(kind == "test" for kind, _ in steps))


def _limits(timeout_s, memory_mb, max_processes, max_output_bytes) -> Limits:
    return Limits(timeout_s=float(timeout_s), memory_mb=int(memory_mb), processes=int(max_processes),
                          output_bytes=int(max_output_bytes))


def passes_tests(prompts: Sequence[Any], completions: Sequence[Any], tests: Sequence[str],
                 entry_point: Sequence[str | None] | None = None, preamble: Sequence[str | None] | None = None, *,
                 all_or_nothing: bool = False, timeout_s: float = 5.0, memory_mb: int = 1024, max_processes: int = 32,
                 max_output_bytes: int = 65536, sandbox: str = "auto", workers: int | None = None,
                 **_: Any) -> Scored:
    """The share of the row's tests each completion's program passes (all_or_nothing: 1 or 0), with its outcome;
    see the module docstring. ValueError for a row whose tests cannot be run; SandboxError when the sandbox fails."""
    n = len(completions)
    entry_point = list(entry_point) if entry_point is not None else [None] * n
    preamble = list(preamble) if preamble is not None else [None] * n
    box = resolve(sandbox)
    limits = _limits(timeout_s, memory_mb, max_processes, max_output_bytes)

    def one(i: int) -> Outcome:
        entry = entry_point[i] or None
        return run_tests(program_of(completions[i], entry), str(tests[i]), entry, preamble[i] or "", limits, box)

    with ThreadPoolExecutor(max_workers=max(1, workers or os.cpu_count() or 1)) as pool:
        outcomes = list(pool.map(one, range(n)))
    return Scored([o.score(all_or_nothing) for o in outcomes], [str(o) for o in outcomes], OUTCOMES)


# ---- options, checked before the model loads ------------------------------------------------------
_RULES = {  # option: (what it needs, the test)
    "all_or_nothing": ("true or false", lambda v: isinstance(v, bool)),
    "timeout_s": ("a number > 0", lambda v: is_number(v) and v > 0),
    "memory_mb": ("an integer >= 64 (the interpreter needs some)", lambda v: is_int(v) and v >= 64),
    "max_processes": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
    "max_output_bytes": ("an integer >= 1024", lambda v: is_int(v) and v >= 1024),
    "workers": ("an integer >= 1, or null for the CPU count", lambda v: v is None or (is_int(v) and v >= 1)),
    "sandbox": (f"one of {', '.join(CHOICES)}", lambda v: v in CHOICES),
}


def check_options(prefix: str, options: dict[str, Any]) -> None:
    """ConfigError for a bad option; then the sandbox is set up once, here, before the model loads: a sandbox
    named that does not work is one line; auto falling back to rlimits alone is a warning."""
    for key, value in options.items():
        if key not in _RULES:
            raise ConfigError(f"{prefix}.{key}={value} is invalid: passes_tests takes no option {key}; its options: "
                              f"{', '.join(_RULES)}")
        needs, test = _RULES[key]
        if not test(value):
            raise ConfigError(f"{prefix}.{key}={value} is invalid: needs {needs}")
    choice = options.get("sandbox", "auto")
    try:
        box = resolve(choice)
    except SandboxError as err:
        raise ConfigError(f"{prefix}.sandbox={choice} cannot be set up: {err}; {setup_fix()}"
                          + (", or use sandbox=auto" if choice != "auto" else "")) from None
    if box.kind == "rlimits" and choice == "auto":
        warn(f"{prefix}: neither bubblewrap nor unshare namespaces work here ({weaker_than_wanted()}), so programs "
             f"run under rlimits alone: {contained()}; {setup_fix()}")
    elif box.kind == "rlimits":
        warn(f"{prefix}.sandbox=rlimits: {contained()}")
    else:  # said once for every entry of the reward (and every job of a sweep): the level in use, at start-up
        inform(f"the code reward's programs run in the {box.kind} sandbox (sandbox={choice}): {CONTAINED[box.kind]}")


CONTAINED = {  # what each namespaced level holds the program to (rewards/sandbox.py says how; rlimits: contained())
    "bwrap": "bubblewrap namespaces, no network, a read-only system and one small writable dir, limits on memory, "
             "CPU time and processes",
    "unshare": "unshare namespaces, no network, a read-only system and one small writable dir, limits on memory, "
               "CPU time and processes",
}


class _ChecksOptions(Protocol):
    """A reward function with its own `check_options` (rewards/building.py calls it on the entry's options)."""

    check_options: Callable[[str, dict[str, Any]], None]


cast(_ChecksOptions, passes_tests).check_options = check_options
