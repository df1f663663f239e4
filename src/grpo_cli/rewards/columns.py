"""The data columns a reward needs: a parameter of a reward function without a default that neither the trainer
passes (TRAINER_PASSED, TRL's names) nor an option of its entry gives must come from a column of the data. One
the data lacks is refused before the model loads (`check_columns`, called by the trainer as soon as the rows are
read); at the first step it would be the reward's TypeError, or worse, a call by position that binds the prompts as
the completions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from grpo_cli.base.errors import DataError
from grpo_cli.config.schema import RewardConfig
from grpo_cli.rewards import BY_NAME_ONLY, EXTRA_FIELDS, resolve_callable, with_free_options

TRAINER_PASSED = ("prompts", "completions", "completion_ids", "trainer_state", "environments", "messages",  # TRL's
                  "log_metric", "log_extra")
# what each of them holds, for the line that refuses a data column of that name (`messages` is the prompt's form)
PASSED_MEANING = {"prompts": "the prompts", "completions": "the model's completions",
                  "completion_ids": "the completions' token ids", "trainer_state": "the trainer's state",
                  "environments": "the episodes' environments", "log_metric": "TRL's metric logger",
                  "log_extra": "TRL's column logger"}


def _call_target(target, options: dict):
    """What is called for each batch: the function with its options bound, or a class's __call__ (its options go
    to the constructor)."""
    if inspect.isclass(target):
        return functools.partial(target.__call__, None)  # the unbound method, `self` taken
    return functools.partial(target, **options) if options else target


def missing_columns(target, options: dict, columns: list[str], rollout_fields: tuple[str, ...]) -> list[str]:
    """The parameters of a reward entry without a default that its call as TRL makes it (`reward_arguments`: by
    keyword, or its first two parameters by position) leaves unbound when the data rows have `columns` and the
    rollout gives `rollout_fields`: columns the data lacks. The names the trainer passes (TRAINER_PASSED) are never
    columns."""
    fn = _call_target(target, with_free_options(target, dict(options)))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    free = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = {k for k in (*columns, *rollout_fields)
             if k not in EXTRA_FIELDS or k in params or (free and k not in BY_NAME_ONLY)}
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def unbound(names: list[str], passed: set[str]) -> list[str]:
        return [n for n in names if params[n].default is params[n].empty and n not in passed]

    missing = unbound(named, {"prompts", "completions", *given})
    if missing and "completions" not in params:  # `lambda p, c, **_`: by position, the first two take them
        missing = unbound(named[2:], given)
    return [n for n in missing if n not in TRAINER_PASSED]


def check_columns(cfg_reward: RewardConfig, rows: list[dict], rollout_fields: tuple[str, ...] = ("completion_ids",),
                  where: Callable[[dict], str] = repr, held_out: bool = False) -> None:
    """DataError, before the model loads, for a reward function's parameter that no column of the training rows gives
    (a function called without it would raise at the first step), or that some rows lack (`where` names the first).
    `held_out`: `rows` are the held-out ones, which only reward.accuracy scores (at an eval, after steps trained).
    A column named as what the trainer passes (PASSED_MEANING) is refused: every reward would get it instead."""
    every = [k for k in rows[0] if all(k in row for row in rows)] if rows else []
    some = list(dict.fromkeys(k for row in rows for k in row))
    for column in (k for k in some if k in PASSED_MEANING):  # TRL's call raises on it; a silent swap here
        first = next(row for row in rows if column in row)
        raise DataError(f"{where(first)} has a column {column!r}, the name under which every reward gets "
                        f"{PASSED_MEANING[column]}: the column would take their place; rename the column")
    data = "the held-out data (data.eval_split or data.eval_path)" if held_out else "the data"
    for name, spec in (cfg_reward.functions or {}).items():
        if held_out and name != cfg_reward.accuracy:
            continue
        try:
            target = resolve_callable(spec._target_)
        except (ImportError, AttributeError, ValueError):
            continue  # said by the config's check
        for column in missing_columns(target, dict(spec.options), every, rollout_fields):
            who = f"reward.functions.{name} ({spec._target_})"
            if column in some:
                first = next(row for row in rows if column not in row)
                raise DataError(f"{who} needs the column {column!r}, which {where(first)} lacks (and "
                                f"{sum(column not in row for row in rows) - 1} more rows); give every row that column")
            hint = " (data.answer_column=COLUMN names the column that arrives as answer)" if column == "answer" else ""
            raise DataError(f"{who} needs the column {column!r}, which {data} does not have (its columns: "
                            f"{', '.join(k for k in every if k != 'messages') or 'none'}){hint}; add that column, "
                            "or give the parameter a default")
