"""Entry points: grpo-train, grpo-eval, grpo-report. Thin: Hydra lives here, the work elsewhere."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from grpo_cli.config import CONF_DIR, ConfigError, available_recipes, register_recipes, validate

# Errors whose message is a complete one-line explanation for the user (no traceback).
EXIT_BAD_INPUT = 2


def _user_errors() -> tuple[type[Exception], ...]:
    from grpo_cli.checkpoint import CheckpointError
    from grpo_cli.data import DataError
    from grpo_cli.models import ModelLoadError
    from grpo_cli.rewards import RewardError
    from grpo_cli.trainer import InvariantError

    return ConfigError, DataError, ModelLoadError, RewardError, CheckpointError, InvariantError


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _fail(prog: str, err: Exception) -> None:
    """One line on stderr and exit 2 (bad input) or 1 (a failed run); in a sweep, let Hydra record it."""
    from grpo_cli.config import ConfigError as _CE
    from grpo_cli.data import DataError
    from grpo_cli.models import ModelLoadError

    line = f"{prog}: {err}"
    if _is_multirun():
        raise RuntimeError(line) from None
    print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT if isinstance(err, (_CE, DataError, ModelLoadError)) else 1)


def _precheck_recipe(argv: list[str]) -> None:
    """Hydra's own message for an unknown recipe is a page long; say it in one line first."""
    known = available_recipes()
    for arg in argv:
        if arg.lstrip("+~").startswith("recipe="):
            names = arg.split("=", 1)[1]
            for name in names.split(","):
                if name and name not in known:
                    print(f"grpo-train: recipe {name!r} not found; known recipes: {', '.join(sorted(known))} "
                          f"(or put {name}.yaml in ./recipes/)", file=sys.stderr)
                    sys.exit(EXIT_BAD_INPUT)


def _hydra_app(task, prog: str):
    import hydra

    register_recipes()
    _precheck_recipe(sys.argv[1:])
    # `prog` names the app in Hydra's help and in the run dir's .hydra files
    return hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)


def _train_task(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.trainer import GRPOTrainer, Interrupted

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        warnings = validate(cfg)
        trainer = GRPOTrainer(cfg, run_dir)
        trainer.startup_warnings = warnings
        if cfg.eval.every:
            from grpo_cli.evaluate import Evaluator

            trainer.evaluator = Evaluator.for_training(cfg, trainer.lm)
        summary = trainer.fit()
    except Interrupted as stop:
        name = signal.Signals(stop.signum).name
        print(f"grpo-train: stopped by {name}; checkpoint {stop.checkpoint_dir}; resume with the same command plus "
              f"trainer.resume=auto hydra.run.dir={run_dir}", file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    except _user_errors() as err:
        _fail("grpo-train", err)
    return float(summary["final_reward"])


def train() -> None:
    """`grpo-train`: one run, or a sweep with -m."""
    _hydra_app(_train_task, "grpo-train")()


def _eval_task(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.evaluate import run_eval

    try:
        validate(cfg)
        result = run_eval(cfg, Path(HydraConfig.get().runtime.output_dir))
    except _user_errors() as err:
        _fail("grpo-eval", err)
    return float(result["accuracy"])


def evaluate() -> None:
    """`grpo-eval`: greedy pass@1 (and pass@k, majority@k) of the base model or a trained adapter."""
    _hydra_app(_eval_task, "grpo-eval")()


def report() -> None:
    """`grpo-report DIR`: plots and an HTML page for a run dir or a sweep dir."""
    from grpo_cli.report import main

    sys.exit(main())


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
