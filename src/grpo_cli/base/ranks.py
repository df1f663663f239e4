"""Which process of a torchrun job this is, read from the environment alone: no torch import, so the CLI
can ask before anything heavy loads."""

from __future__ import annotations

import os


def is_rank_zero() -> bool:
    """True outside torchrun and on its rank 0: the process that speaks for the job (console, logs, W&B)."""
    return int(os.environ.get("RANK", "0") or 0) == 0
