"""Where generation runs when it runs ahead of the update (rollout.placement): a worker process of its own
(worker.py) or vLLM's OpenAI-compatible server (server.py); `rollout.placement=local` generates in the trainer."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from grpo_cli.config.schema import Config
from grpo_cli.rollout.ahead import AheadOfTheUpdate, Versions
from grpo_cli.rollout.common import sampling_seed
from grpo_cli.rollout.server import ServerRollouts
from grpo_cli.rollout.worker import ReferencePlan, RolloutWorker


def generating_ahead(cfg: Config, lm, prompts_of: Callable, rank: int, *, start: int, stop: Callable[[], bool],
                     history: Versions | None, plan: ReferencePlan, log_dir: Path | None) -> AheadOfTheUpdate:
    """The generator of rollout.placement, started at step `start` from the policy after `start` steps and the
    earlier `history` versions its in-flight batches need; a server started here logs into `log_dir`."""
    args = (cfg, lm, prompts_of, lambda step: sampling_seed(cfg.trainer.seed, step, rank))
    if cfg.rollout.placement == "server":
        logs = log_dir or Path(tempfile.mkdtemp(prefix="grpo-cli-vllm-"))  # a trainer built without a run dir
        return ServerRollouts(*args, start=start, stop=stop, history=history, run_dir=logs)
    return RolloutWorker(*args, start=start, stop=stop, history=history, plan=plan)
