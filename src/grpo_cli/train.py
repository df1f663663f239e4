"""`python -m grpo_cli.train ...` (what torchrun launches) is `grpo-train ...`."""
from grpo_cli.commands.cli import train

if __name__ == "__main__":
    train()
