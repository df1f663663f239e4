"""The shape of the source: no function or method over 60 lines (its docstring not counted), the trainer only steps
(trainer.py and GRPOTrainer within their sizes), and generation takes its sampling whole (a SamplingParams, not a
dozen loose keywords)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo_cli"
MAX_FUNCTION_LINES = 60


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the function from its `def` to its end, the docstring not counted."""
    first = node.body[0]
    is_doc = ast.get_docstring(node) is not None
    return node.end_lineno - node.lineno + 1 - (first.end_lineno - first.lineno + 1 if is_doc else 0)


def test_no_function_is_over_60_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({body_lines(node)} lines)")
    assert not long, long


def test_the_trainer_only_steps():
    source = (SRC / "step" / "trainer.py").read_text()
    [trainer] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer"]
    assert len(source.splitlines()) <= 480
    # 300 until the trainer answered the run itself (state_dict, load_state_dict, save_adapter, evaluate, close: what
    # run.py read of its attributes before) and took trainer_state and the phases from the run
    assert trainer.end_lineno - trainer.lineno + 1 <= 310
    assert not any(word in source for word in ("run_dir", "trainer.resume", "checkpoint."))


MAX_GENERATION_PARAMETERS = 6  # self counted


def test_generation_takes_its_sampling_whole():
    """Every engine's generate (the shared-base sweep's too) and the episode loop take a SamplingParams and at most 6
    parameters: a new sampling option is a field of SamplingParams, not a keyword threaded through every engine."""
    from grpo_cli.rollout import Engine
    from grpo_cli.rollout.episodes import EpisodeSetup, run_episodes
    from grpo_cli.rollout.shared import JobEngine

    def subclasses(cls: type) -> set[type]:
        return {cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))}

    engines = {cls for cls in subclasses(Engine) if cls.__module__.startswith("grpo_cli.")}
    assert {"HFEngine", "MergedEngine", "CompiledEngine", "VLLMEngine"} <= {c.__name__ for c in engines}
    assert JobEngine in engines
    functions = {f"{cls.__name__}.generate": cls.generate for cls in engines}
    functions |= {"run_episodes": run_episodes, "EpisodeSetup.run": EpisodeSetup.run}
    for name, function in functions.items():
        parameters = inspect.signature(function).parameters
        assert len(parameters) <= MAX_GENERATION_PARAMETERS, (name, list(parameters))
        assert "sampling" in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()), name
