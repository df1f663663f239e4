"""Validating a composed config before anything loads: every bad value is caught here in one line. What each key
accepts is declared in config/schema.py (checked on the composed config); the rules that relate several keys and
need no component are config/rules.py's. Here each component is asked once what it accepts (the algorithm's
settings, model.dtype on the device, the data files, the reward functions beside the environment, the optimizer's
keys): that is why this module sits on the run's floor, above the step."""

from __future__ import annotations

from omegaconf import DictConfig

from grpo_cli.base.registry import import_plugins
from grpo_cli.config import override_key
from grpo_cli.config.compose import checked
from grpo_cli.config.rules import CLIPPING_OBJECTIVES, check, is_on_policy, ranks
from grpo_cli.config.schema import Config, fail


def validated(cfg: DictConfig) -> tuple[Config, list[str]]:
    """The user's plug-in modules imported (what they register becomes a valid choice), then every value checked;
    returns the typed config, which everything below reads (trainer.epochs made trainer.max_steps), and the warnings
    for legal but doubtful values."""
    import_plugins(cfg.plugins)
    warnings = validate(cfg)
    from grpo_cli.tasks.sources import steps_from_epochs, unread_options  # after the checks: it reads the data

    config = steps_from_epochs(Config.of(cfg))
    return config, warnings + unread_options(config.data)


def before_model_load(config: Config) -> None:
    """What user code and the data would meet only once the model has loaded, met now in one line: every reward's
    module imported and the reward classes that need no device built, the data read, the tools, environment and
    chat template tried (rollout.episodes)."""
    from grpo_cli.rewards import build_before_model_load
    from grpo_cli.rollout import episodes
    from grpo_cli.tasks import sources

    build_before_model_load(config.reward)
    sources.check_before_model_load(config)
    episodes.check_before_model_load(config)


def validate(cfg: DictConfig) -> list[str]:
    """Raise ConfigError on the first bad value; return warnings for legal but doubtful ones. What each key
    accepts is declared in schema.py (checked on the composed config, config.compose.checked); the rules that
    relate several keys, and the optional libraries a choice needs, are config.rules.check's; then each component
    is asked what it accepts, once each, from the top floor down (the optimizer, the environment and the reward
    functions, the data files, the model's precision)."""
    config = checked(cfg)
    n_ranks = ranks(config)
    warnings = check(config, n_ranks)
    # the components are imported here, not at the top: validating a config loads no torch
    from grpo_cli.algorithm import config_problem

    if (problem := config_problem(config.algo, n_ranks)) is not None:
        fail(*problem)
    from grpo_cli.model.precision import check_precision
    from grpo_cli.rewards import check_functions
    from grpo_cli.rollout.tools import reward_owning_environment
    from grpo_cli.step.optim import check_optimizer
    from grpo_cli.tasks.sources import check_files_are_read, final_eval_on

    check_optimizer(config.optimizer)
    environment = reward_owning_environment(config.env._target_, config.env.timeout_s)  # a bad one: its own line
    check_functions(config, environment)
    check_files_are_read(config.data)  # a data file is read or refused, never ignored
    if config.sweep.metric == "final_eval_accuracy" and not final_eval_on(config, multirun=True):
        fail("sweep.metric", "final_eval_accuracy", "needs the final eval, which eval.final=auto runs only where the "
             "data has held-out prompts and reward.accuracy judges them: every cell would have no result; give "
             "held-out prompts (data.eval_path or data.eval_split), or rank by another column, e.g. "
             "sweep.metric=mean_reward")
    return check_precision(config) + warnings


CLIP_EPS_KEYS = ("algo.clip_eps", "algo.clip_eps_high")  # the config keys of the clipped ratio


def on_policy_clip_warning(keys: list[str], sweep: bool = False) -> str:
    what = " and ".join(keys)
    subject = f"sweeping {what} measures nothing" if sweep else f"{what} has no effect"
    return (f"{subject} here: every update is on-policy (algo.mini_batches=1, algo.num_iterations=1), so the "
            "ratio is exactly 1 and nothing is clipped; set algo.mini_batches > 1 (e.g. 4) or "
            "algo.num_iterations > 1 to make clipping act")


def explicit_clip_warning(config: Config, task_overrides: list[str]) -> str | None:
    """The warning for a single run whose command line (Hydra's overrides.task) sets a clip epsilon that
    cannot act; None otherwise. A recipe's own clip_eps is not the user's choice and gets no warning."""
    if not is_on_policy(config.algo) or getattr(config.algo, "objective", "grpo") not in CLIPPING_OBJECTIVES:
        return None  # another objective never reads them: config.rules.inert_algo_options says so
    keys = [k for k in CLIP_EPS_KEYS if any(override_key(line) == k for line in task_overrides)]
    return on_policy_clip_warning(keys) if keys else None
