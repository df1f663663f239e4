"""`grpo_cli.calculator.calculator`, the calculator recipe's tool, as earlier configs name it."""
from grpo_cli.tasks.calculator import calculator

__all__ = ["calculator"]
