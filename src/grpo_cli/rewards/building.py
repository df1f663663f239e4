"""From a config entry to a reward callable, and the checks of the reward section that run before the model loads:
the dotted `_target_` resolved (one line for an import that fails), its options checked against the function's named
parameters (the closest name offered; keys for `**kwargs` said under `kwargs`), built where it can be (a class that
takes `device` or `dtype` is built once the policy is placed)."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping

from grpo_cli.base.errors import ConfigError
from grpo_cli.base.user_code import raised
from grpo_cli.config.schema import Config, RewardConfig, RewardFunctionConfig, fail


class ImportRaised(ImportError):
    """Importing a reward's module ran its code, and that raised (the module exists: the fix is in it)."""


def resolve_callable(dotted: str):
    """The callable a `_target_` names (pkg.module.fn or pkg.module.Class). Whatever importing its module raises
    (a SyntaxError, sys.exit at import time) comes out as an ImportRaised that names it."""
    module, _, attr = str(dotted).rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not a dotted path")
    try:
        imported = importlib.import_module(module)
    except ImportError:
        raise
    except BaseException as err:  # user code: anything it raises is a bad _target_, not a crash of the command
        raise ImportRaised(f"importing {module} raised {raised(err)}") from None
    fn = getattr(imported, attr)
    if not callable(fn):
        raise ValueError(f"{dotted} is not callable")
    return fn


FREE_OPTIONS = "kwargs"  # an entry's mapping of options for the function's **kwargs, said as such


def check_option_names(prefix: str, target, options: dict) -> None:
    """Each option of a reward entry must be a parameter the target names (a function's keyword, a class's
    constructor argument), the closest one offered; options meant for the target's **kwargs go under
    `PREFIX.kwargs`, which only a target that takes **kwargs accepts: a typo is never passed on silently."""
    import difflib

    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    free = any(p.kind is p.VAR_KEYWORD for p in params.values())
    reserved = ("prompts", "completions", "messages", *(("name", "device", "dtype") if inspect.isclass(target) else ()))
    takes = [n for n in named if n not in reserved]
    who = f"{target.__module__}.{target.__qualname__}"
    for key, value in options.items():
        if key == FREE_OPTIONS and free and FREE_OPTIONS not in named and isinstance(value, Mapping):
            continue
        if key in reserved or key not in named:
            close = difflib.get_close_matches(str(key), takes, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; its options: {', '.join(takes) or 'none'}"
            extra = (f" (it takes **kwargs: give what is meant for them under {prefix}.{FREE_OPTIONS}.{key})"
                     if free and key not in reserved else "")
            raise ConfigError(f"{prefix}.{key}={value} is invalid: {who} takes no option {key}{extra}{hint}")


def with_free_options(target, options: dict) -> dict:
    """The options as keyword arguments: those under `kwargs` (for the target's **kwargs) among the others."""
    free = options.pop(FREE_OPTIONS, None) if isinstance(options.get(FREE_OPTIONS), Mapping) else None
    named = inspect.signature(target).parameters.get(FREE_OPTIONS)
    if free is not None and (named is None or named.kind is named.VAR_KEYWORD):  # not a parameter named kwargs
        options.update(free)
    elif free is not None:
        options[FREE_OPTIONS] = free
    return options


def build_reward(name: str, spec: RewardFunctionConfig, **context):
    """The callable for one entry: the function with its options bound, or the class built with its options
    (plus `name`, `device`, `dtype` when its constructor takes them)."""
    target = resolve_callable(spec._target_)
    options = with_free_options(target, dict(spec.options))
    if not inspect.isclass(target):
        return functools.partial(target, **options) if options else target
    accepted = inspect.signature(target).parameters
    try:
        return target(**options, **{k: v for k, v in {"name": name, **context}.items() if k in accepted})
    except BaseException as err:  # user code: one line, exit 2, whatever it raised
        raise ConfigError(f"reward.functions.{name}: building {spec._target_} raised {raised(err)}; fix its "
                          "constructor or the entry's options") from None


# ---- built before the model loads ----------------------------------------------------------------
CONTEXT_ARGS = ("device", "dtype")  # known only once the policy is placed: a class that takes them is built then
_prebuilt: dict[tuple[str, str], object] = {}


def _spec_key(name: str, spec: RewardFunctionConfig) -> tuple[str, str]:
    import json

    return name, json.dumps(dict(spec.options) | {"_target_": spec._target_}, sort_keys=True, default=str)


def placed_reward(name: str, spec: RewardFunctionConfig, device, dtype):
    """The entry's callable: the one `build_before_model_load` made, else built now."""
    key = _spec_key(name, spec)
    if key in _prebuilt:
        return _prebuilt.pop(key)
    return build_reward(name, spec, device=device, dtype=dtype)


def build_before_model_load(cfg_reward: RewardConfig) -> None:
    """Import every reward's module and build every reward class that needs no device, so that user code that fails
    does so in one line (exit 2) before minutes of model loading; `RewardSet.from_config` then takes these objects
    (each is still built once). A class taking `device` or `dtype` (a reward model) is built beside the policy."""
    _prebuilt.clear()
    for name, spec in (cfg_reward.functions or {}).items():
        try:
            target = resolve_callable(spec._target_)
        except (ImportError, AttributeError, ValueError) as err:
            fix = "fix the module" if isinstance(err, ImportRaised) else "check the dotted path"
            raise ConfigError(f"reward.functions.{name}._target_={spec._target_} cannot be imported ({err}); "
                              f"{fix}") from None
        if inspect.isclass(target) and any(k in inspect.signature(target).parameters for k in CONTEXT_ARGS):
            continue
        _prebuilt[_spec_key(name, spec)] = build_reward(name, spec)


def check_functions(config: Config, environment: type | None = None) -> None:
    """Each reward entry's _target_ imports and takes the entry's options; reward.accuracy names an entry,
    which eval.every > 0 and eval.final=true need. No entry at all is a run whose environment's get_reward() is
    the reward (TRL's environment-owned reward): `environment`, the class of env._target_ when it has one."""
    functions = config.reward.functions or {}
    if not functions and environment is None:
        fail("reward.functions", functions or None, "list at least one reward function with _target_ and weight, or "
             "set env._target_ to an environment with a get_reward() method (its reward alone)")
    if environment is not None and environment.__name__ in functions:
        fail(f"reward.functions.{environment.__name__}", functions[environment.__name__]._target_, "has the name "
             f"under which the environment's get_reward() is logged (reward/{environment.__name__}); rename the entry")
    for name, spec in functions.items():
        key = f"reward.functions.{name}._target_"
        try:
            target = resolve_callable(spec._target_)
        except (ImportError, AttributeError, ValueError) as err:
            fail(key, spec._target_, f"cannot be imported ({err}); "
                                     + ("fix the module" if isinstance(err, ImportRaised) else "check the dotted path"))
        _check_options(f"reward.functions.{name}", target, spec)
    accuracy, named = config.reward.accuracy, ", ".join(functions)
    if accuracy is not None and accuracy not in functions:
        fail("reward.accuracy", accuracy, f"name one of reward.functions ({named})" if functions else
             "reward.functions is empty (the environment's get_reward() is the reward); set reward.accuracy=null")
    if accuracy is None and config.eval.every:
        fail("reward.accuracy", None, "eval.every > 0 needs the 0/1 reward function that judges correctness; name one "
                                      f"of reward.functions ({named})")
    if accuracy is None and config.eval.final is True:
        fail("reward.accuracy", None, "eval.final=true needs the 0/1 reward function that judges correctness; name one "
                                      f"of reward.functions ({named}), or set eval.final=auto")


def _check_options(prefix: str, target, spec: RewardFunctionConfig) -> None:
    """Keys of a reward entry besides _target_ and weight are the target's own options (a function's keyword
    arguments, a class's constructor arguments): each must be one it takes, and pass its own check_options."""
    check_option_names(prefix, target, dict(spec.options))  # the closest name offered; **kwargs' under .kwargs
    check = getattr(target, "check_options", None)
    if callable(check):
        check(prefix, dict(spec.options))
