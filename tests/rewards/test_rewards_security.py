"""Every shipped reward must treat model output as inert text.

Reward modules are discovered with pkgutil, so rewards added later (e.g. ``grpo_cli.rewards.arithmetic``)
are covered automatically: each public function whose first two parameters are ``(prompts, completions)``
is fed code-injection payloads in a temporary cwd. A payload that ran would create a sentinel file or
reach a (patched) process-spawning call. The rewards in SANDBOXED run code by design, in the sandbox.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import grpo_cli.rewards

SENTINEL = "SENTINEL"


def _reward_modules() -> list[str]:
    return sorted(
        f"{grpo_cli.rewards.__name__}.{info.name}" for info in pkgutil.iter_modules(grpo_cli.rewards.__path__)
    )


def _is_reward(obj: Any) -> bool:
    if not callable(obj) or inspect.isclass(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return params[:2] == ["prompts", "completions"]


def _rewards() -> list[tuple[str, Callable[..., list[float]]]]:
    found: dict[int, tuple[str, Callable[..., list[float]]]] = {}
    for module_name in _reward_modules():
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if not name.startswith("_") and _is_reward(obj):
                found.setdefault(id(obj), (f"{module_name}.{name}", obj))
    return sorted(found.values(), key=lambda item: item[0])


# Rewards that run the completion as a program on purpose, in grpo_cli.rewards.sandbox:
# tests/rewards/test_code_reward.py gives them hostile programs instead.
SANDBOXED = {"grpo_cli.rewards.code.passes_tests"}
REWARDS = [(name, fn) for name, fn in _rewards() if name not in SANDBOXED]


def _payloads(sentinel_abs: Path) -> list[str]:
    payloads = []
    for target in (SENTINEL, str(sentinel_abs)):
        payloads += [
            f"__import__('os').system('touch {target}')",
            f"#### __import__('os').system('touch {target}')",
            f'The answer is \\boxed{{__import__("os").system("touch {target}")}}',
            f"`touch {target}`",
            f"#### $(touch {target})",
            f"<answer>exec(\"open('{target}', 'w').write('x')\")</answer>",
            f"Final answer: eval(\"__import__('subprocess').call(['touch', '{target}'])\")",
            f"\\boxed{{open('{target}', 'w')}}",
            f"A: Symbol('x').__class__.__mro__[-1].__subclasses__()[0].__init__.__globals__['sys']"
            f".modules['os'].system('touch {target}')",
            f"\\boxed{{\\text{{__import__('os').system('touch {target}')}}}}",
            f"<answer>{{{{ ''.__class__.__mro__[1].__subclasses__() }}}} $(touch {target})</answer>",
        ]
    return payloads + ["{{7*7}}", "#### {{7*7}}", "\\boxed{7*7}", "${7*7}", "#{7*7}", "", "   ", None]


def test_reward_discovery_finds_the_gsm8k_rewards() -> None:
    names = {name for name, _ in REWARDS}
    assert {"grpo_cli.rewards.gsm8k.correctness", "grpo_cli.rewards.gsm8k.format"} <= names


def _call(reward: Callable[..., list[float]], completions: list[Any]) -> list[float]:
    n = len(completions)
    fields: dict[str, Any] = {}
    params = inspect.signature(reward).parameters.values()
    for p in list(params)[2:]:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            fields.update(answer=["4"] * n, target=["4"] * n)
        elif p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL:
            fields[p.name] = ["4"] * n
    return reward(["What is 2 + 2?"] * n, completions, **fields)


@pytest.mark.parametrize(("name", "reward"), REWARDS, ids=[name for name, _ in REWARDS])
def test_payloads_are_never_executed(
    name: str, reward: Callable[..., list[float]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo_cwd = Path.cwd()
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    spawned: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> int:
        spawned.append(args)
        return 0

    for module, attr in [
        (os, "system"),
        (os, "popen"),
        (subprocess, "Popen"),
        (subprocess, "call"),
        (subprocess, "run"),
    ]:
        monkeypatch.setattr(module, attr, record)

    sentinel_abs = tmp_path / f"{SENTINEL}_ABS"
    completions = _payloads(sentinel_abs)
    scores = _call(reward, completions)

    assert not spawned, f"{name} reached a process-spawning call: {spawned}"
    created = [*tmp_path.rglob(f"{SENTINEL}*"), *repo_cwd.glob(f"{SENTINEL}*")]
    assert not created, f"{name} executed model output: {created}"
    assert len(scores) == len(completions)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores


@pytest.mark.parametrize("module_name", _reward_modules())
def test_reward_modules_do_not_import_torch_or_transformers(module_name: str) -> None:
    code = (
        f"import sys, {module_name}\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    src = str(Path(grpo_cli.rewards.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
