"""`grpo_cli.calculator.calculator`: the calculator recipe's tool under the name configs give it (rollout.tools)."""
from grpo_cli.tasks.calculator import calculator

__all__ = ["calculator"]
