"""The Python entry point, as small as the command line: for a notebook or a program.

    import grpo_cli

    run_dir, summary = grpo_cli.train("+recipe=quickstart", "algo.beta=0.02")
    run_dir, summary = grpo_cli.train("+recipe=quickstart", rewards=[my_reward])   # TRL's reward_funcs=[my_reward]

`train(*overrides)` takes grpo-train's arguments (recipe, groups, keys) and keeps its promises: every bad value is
a ConfigError before the model loads (raised, not an exit), the run dir (`outputs/DATE/TIME`, or `run_dir=...`) is
claimed, written and resumed as grpo-train does it, and holds the same records (`.hydra/config.yaml` too, so that
grpo-eval, grpo-report and grpo-export read it). `rewards`: Python callables (a list, each named after its function,
or {name: fn}) used in place of the config's reward functions, as `reward.only` does with dotted paths; they may be
defined in the notebook itself (a lambda too). One process: a sweep (-m) and trainer.nproc > 1 are grpo-train's.
Ctrl-C (a notebook's interrupt) stops the run at a safe point with a checkpoint and raises errors.Interrupted; a
second one ends the process, as in a shell.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

from grpo_cli.base.errors import ConfigError, send_warnings_to, warn
from grpo_cli.config import override_key

# The callables given to `train(rewards=...)`, as a module of their own: a reward's `_target_` names them here
# (grpo_cli.commands.api.callables.NAME), so that validation, the reward set and the evaluator find them as any
# dotted path.
CALLABLES = "grpo_cli.commands.api.callables"
callables = sys.modules.setdefault(CALLABLES, types.ModuleType(CALLABLES, "reward functions given to grpo_cli.train"))


class TrainResult(NamedTuple):
    """What `train` returns: the run dir (metrics.jsonl, samples.jsonl, adapter/, ...) and the run's summary (steps,
    first/last/final reward, time_s, adapter; final_eval_accuracy with eval.final)."""

    run_dir: Path
    summary: dict


def train(*overrides: str, rewards: Sequence[Callable] | Mapping[str, Callable] | None = None,
          run_dir: str | Path | None = None) -> TrainResult:
    """One training run, as `grpo-train OVERRIDES...` runs it; returns its run dir and summary. What the run sets for
    itself in this process (Hydra's config, where warnings go) is as before once it returns or raises."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.instance()
    before = hydra.cfg
    try:
        return _train(overrides, rewards, run_dir)
    finally:
        hydra.cfg = before
        send_warnings_to(None)  # a run that raised left its console as the warnings' place


def _train(overrides: tuple[str, ...], rewards, run_dir) -> TrainResult:
    from grpo_cli.base.stopping import StopRequest
    from grpo_cli.commands import cli
    from grpo_cli.config.compose import register_recipes
    from grpo_cli.run.runner import Run
    from grpo_cli.run.validate import before_model_load, validated
    from grpo_cli.step.evaluate import Evaluator
    from grpo_cli.tasks.sources import final_eval_on

    for argument in overrides:
        if not isinstance(argument, str) or argument.startswith("-") or "=" not in argument:
            raise ConfigError(f"{argument!r} is no override; give each as grpo-train takes it, KEY=VALUE, "
                              "GROUP=OPTION or +recipe=NAME (a sweep, -m, is grpo-train's)")
    given = next((a.split("=", 1)[1] for a in overrides if a.startswith("hydra.run.dir=")), None)
    if run_dir is not None and given is not None and Path(given) != Path(run_dir):
        raise ConfigError(f"run_dir={str(run_dir)!r} and hydra.run.dir={given} name two run dirs; give one of them")
    directory = Path(run_dir or given or time.strftime("outputs/%Y-%m-%d/%H-%M-%S"))  # fixed once, as grpo-train's
    arguments = [*(a for a in overrides if not a.startswith("hydra.run.dir=")), *_reward_overrides(rewards, overrides),
                 f"hydra.run.dir={directory}"]
    register_recipes()
    cfg = cli._precheck("grpo_cli.train", arguments)  # one line for a bad recipe, key or type; sets Hydra's config
    config, warnings = validated(cfg)
    if config.trainer.nproc > 1:
        raise ConfigError(f"trainer.nproc={config.trainer.nproc} is invalid here: grpo_cli.train runs in this "
                          "process; run grpo-train trainer.nproc=N for several")
    before_model_load(config)  # user code, data, tools, template fail here, before the model loads
    with Run(config, directory) as run:
        _write_hydra_records(directory, cfg, arguments)
        cli._quiet_libraries()
        for text in [*warnings, *run.warnings]:
            warn(text)
        summary = run.train(stop=StopRequest("grpo_cli.train"), make_evaluator=partial(Evaluator.for_training, config),
                            final_eval=final_eval_on(config, multirun=False))
    return TrainResult(directory, summary)


def _reward_overrides(rewards: Sequence[Callable] | Mapping[str, Callable] | None,
                      overrides: tuple[str, ...] = ()) -> list[str]:
    """`reward.only=[...]` naming the callables, each put in the `callables` module under its name."""
    if rewards is None:
        return []
    if (chosen := next((a for a in overrides if override_key(a) == "reward.only"), None)) is not None:
        raise ConfigError(f"rewards= and {chosen} both choose the reward functions, and rewards= would win; give one "
                          "of them (a dotted path in reward.only, or the callable in rewards=)")
    named = dict(rewards) if isinstance(rewards, Mapping) else {_name_of(fn): fn for fn in rewards}
    if not named or (not isinstance(rewards, Mapping) and len(named) < len(rewards)):
        raise ConfigError("rewards= needs one reward function at least, each of its own name (pass {name: fn} to "
                          "name them)")
    for name, fn in named.items():
        if not callable(fn) or not str(name).isidentifier():
            raise ConfigError(f"rewards={{{name!r}: {fn!r}}} is invalid: give callables under Python names, e.g. "
                              "rewards=[my_reward] or rewards={'mine': lambda completions, **kw: [...]}")
        setattr(callables, name, fn)
    return [f"reward.only=[{','.join(f'{CALLABLES}.{name}' for name in named)}]"]


def _name_of(fn: Callable) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    return "reward" if name == "<lambda>" else name


def _write_hydra_records(directory: Path, cfg, arguments: list[str]) -> None:
    """RUN_DIR/.hydra/config.yaml and overrides.yaml, as grpo-train's Hydra writes them: what grpo-eval, grpo-report
    and grpo-export read of a run."""
    from omegaconf import OmegaConf

    from grpo_cli.base.metrics import replace_text

    folder = directory / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    replace_text(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    replace_text(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(arguments)))
