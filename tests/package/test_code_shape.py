"""The shape of the source: no function or method over 60 lines (its docstring not counted), and the trainer
only steps (trainer.py and GRPOTrainer within their sizes)."""

from __future__ import annotations

import ast
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
