"""The code reward's verdict cannot be forged from inside the program (grpo_cli.rewards.code's harness): each program
below is a WRONG `add` (it subtracts) plus a known trick that made the harness that shared its interpreter with
the program report `passed 3/3`: rewriting builtins (exec, compile), json, os.write, tracing the harness's frame
through sys, or printing a verdict with the nonce it found in the harness's frame or in the heap. Each scores 0, in
every sandbox that works here, rlimits included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_code_reward import fenced, run

from grpo_cli.rewards import sandbox

WRONG = "def add(a, b):\n    return a - b\n"

TRICKS = {
    "builtins.exec": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\n",
    "builtins.compile": ("import builtins\n_compile = builtins.compile\n"
                         "builtins.compile = lambda source, name, mode, *a, **k: _compile('pass', name, mode)\n"),
    "json.dumps": ("import json\n_dumps = json.dumps\n"
                   "json.dumps = lambda value, *a, **k: _dumps({'passed': 3} if 'passed' in value else value)\n"),
    "os.write": ("import os\n_write = os.write\n"
                 "os.write = lambda fd, data: _write(fd, data.replace(b'\"passed\": 0', b'\"passed\": 3'))\n"),
    "sys.settrace": (
        "import sys\n"
        "def _trace(frame, event, arg):\n"
        "    if 'passed' in frame.f_locals and isinstance(frame.f_locals['passed'], int):\n"
        "        frame.f_locals['passed'] = 3\n"
        "    return _trace\n"
        "sys.settrace(_trace)\n"
        "_f = sys._getframe(1)\n"
        "while _f is not None:\n"
        "    _f.f_trace = _trace\n"
        "    _f = _f.f_back\n"),
    "a verdict printed with the nonce": (
        "import gc, json, os, sys\n"
        "def _nonces():\n"
        "    f = sys._getframe(1)\n"
        "    while f is not None:\n"
        "        for value in list(f.f_locals.values()):\n"
        "            if isinstance(value, dict) and 'nonce' in value:\n"
        "                yield value['nonce']\n"
        "            if isinstance(value, str) and len(value) == 32:\n"
        "                yield value\n"
        "        f = f.f_back\n"
        "    for obj in gc.get_objects():\n"
        "        if isinstance(obj, dict) and isinstance(obj.get('nonce'), str):\n"
        "            yield obj['nonce']\n"
        "for nonce in set(_nonces()):\n"
        "    line = '\\n' + nonce + ' ' + json.dumps({'passed': 3}) + '\\n'\n"
        "    for fd in (1, 2):\n"
        "        os.write(fd, line.encode())\n"
        "    for pid in (os.getpid(), os.getppid()):\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/fd/1', 'w') as out:\n"
        "                out.write(line)\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"),
    "the runner's steps rewritten in place, found in the heap": (
        "import gc, re\n"
        "for found in gc.get_objects():\n"
        "    if isinstance(found, list) and found and all(isinstance(step, (tuple, list)) and len(step) == 2\n"
        "                                              and step[0] in ('test', 'setup') for step in found):\n"
        "        for i, (kind, code) in enumerate(found):\n"
        "            if kind == 'test' and not re.fullmatch(r\"assert '[0-9a-f]{8}' == '[0-9a-f]{8}'\", code):\n"
        "                found[i] = ('test', 'pass')\n"),
    "the tests as sent, read in the harness's frames, and the others rewritten": (
        "import sys\n"
        "f = sys._getframe(1)\n"
        "while f is not None:\n"
        "    sent, steps = f.f_locals.get('job'), f.f_locals.get('steps')\n"
        "    if isinstance(sent, dict) and isinstance(steps, list):\n"
        "        canary = next(i for i, step in enumerate(steps) if i >= len(sent['steps'])\n"
        "                      or list(step) != list(sent['steps'][i]))\n"
        "        for i, (kind, code) in enumerate(steps):\n"
        "            if kind == 'test' and i != canary:\n"
        "                steps[i] = ('test', 'pass')\n"
        "    f = f.f_back\n"),
    "every pipe told it passed": (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'P' * 3 + b'E')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"),
}

KINDS = [pytest.param(kind, marks=pytest.mark.skipif(sandbox.probe(kind) is not None,
                                                     reason=f"{kind} does not work here: {sandbox.probe(kind)}"))
         for kind in sandbox.KINDS]


@pytest.mark.parametrize("kind", KINDS)
def test_known_tricks_to_fake_a_pass_score_0(kind):
    completions = [fenced(WRONG + trick) for trick in TRICKS.values()]
    scored = run(completions, sandbox=kind, workers=2)
    assert dict(zip(TRICKS, scored, strict=True)) == dict.fromkeys(TRICKS, 0.0), scored.outcomes
    assert not any(outcome.startswith("passed") for outcome in scored.outcomes), scored.outcomes


@pytest.mark.parametrize("kind", KINDS)
def test_honest_programs_still_score_as_before(kind):
    """The canary slipped among the tests changes no honest verdict: a right, a wrong and a half-right program."""
    half = "def add(a, b):\n    return a + b if a >= 0 else 5\n"
    scored = run([fenced(WRONG.replace("-", "+")), fenced(WRONG), fenced(half)], sandbox=kind)
    assert scored.outcomes == ["passed 3/3", "failed 0/3", "failed 2/3"]


@pytest.mark.skipif(sandbox.rlimits_as_nobody() is not None,
                    reason=f"rlimits cannot run programs as nobody here: {sandbox.rlimits_as_nobody()}")
def test_at_the_rlimits_level_a_program_run_by_root_cannot_signal_the_trainer():
    """No namespace: a program that kills the trainer (this process's group and a process of root's). Run as
    nobody, each kill is refused, and it scores 0 (its solution would pass)."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kills = (f"import os\nos.kill({victim.pid}, 9)\nos.killpg({os.getpgid(0)}, 9)\nos.kill({os.getpid()}, 9)\n"
                 "def add(a, b):\n    return a + b\n")
        scored = run([fenced(kills)], sandbox="rlimits")
        assert scored.outcomes == ["crashed: PermissionError: [Errno 1] Operation not permitted"]
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    assert "cannot signal the trainer" in sandbox.contained()
