"""Reward functions: `fn(prompts, completions, **row_fields) -> list[float]`, one module per family.

`RewardSet` turns the `reward` config group into the weighted sum the trainer uses. A function entry is
`reward.functions.NAME: {_target_, weight, ...options}`: a function gets its options as keyword arguments;
a class (e.g. `rewards.reward_model.RewardModel`) is built once with them and then called like a function
(rewards/building.py: an entry resolved, its options checked, built before the model loads where it can be).
An environment's `get_reward()` (env._target_) is one more function of weight 1, named after its class, as in TRL;
it may be the only reward (reward.functions=null).

A function is called as TRL calls one: by keyword, `fn(prompts=..., completions=..., **row_fields)`, so TRL's
`fn(completions, **kwargs)` and `fn(environments, **kwargs)` run unchanged, as does `fn(prompts, completions, **kw)`;
one whose first two parameters take them under other names (`lambda p, c, **_`) gets those two by position. Beside
the row's fields it gets what TRL passes that is known here: `completion_ids` (each completion's token ids),
`trainer_state` (transformers' TrainerState, as TRL's: global_step, max_steps, epoch, num_train_epochs,
is_world_process_zero, is_local_process_zero), TRL's `log_metric` and `log_extra` (`Logged`) and, in episodes,
`environments` (each episode's instance), when its signature names them or takes **kwargs; `messages`
(the prompt's chat messages; in episodes the whole conversation) only when it names it. A function may be async.

On prompts the data gave as chat
messages a function of the user's gets TRL's conversational form (`as_conversation`: the prompts' messages, each
completion as [{"role": "assistant", "content": text}]); grpo-cli's own read text.

A function must return
one real number per completion: int, float, bool (True = 1.0: a pass/fail check is a reward), or a numpy /
torch scalar, or None where it does not apply (aggregation.combine leaves it out; a completion that no function
scores stops the run). Anything else (a string, even "1.0", a list per completion, the wrong count; a NaN, below)
is a bug in the function and stops the run with one line, whatever reward.on_error says; on_error=zero is for
functions that raise on some inputs. A function that also says what happened to each completion returns a `Scored`
list: its outcomes go to samples.jsonl (outcome/NAME) and are counted in the metrics (outcomes/NAME/KIND). A
function that scored some completions and could not score the others (a service that refused) raises
`CompletionsFailed` with the scores it has: on_error=zero keeps them without calling it again.

Each call runs behind the user-code boundary (grpo_cli.base.user_code: a daemon thread, waited on while polling the
run's stop request) for at most `reward.timeout_s` seconds (null: no limit); a call that runs over is abandoned.
On a timeout, on_error=raise ends the run in one line; on_error=zero scores that function's completions one at a
time, each under the same deadline, so that only those that time out or raise get 0 (a function that raises on
the batch is retried the same way).

May import: tasks, model, config, base.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any

from grpo_cli.base import user_code
from grpo_cli.base.errors import RewardError
from grpo_cli.base.metrics import OWN_METRIC_PREFIXES, OWN_METRICS
from grpo_cli.base.user_code import shown
from grpo_cli.config.schema import RewardConfig
from grpo_cli.rewards.aggregation import combine
from grpo_cli.rewards.building import (  # noqa: F401  the names users and the other floors import from here
    FREE_OPTIONS,
    ImportRaised,
    build_before_model_load,
    build_reward,
    check_functions,
    check_option_names,
    placed_reward,
    resolve_callable,
    with_free_options,
)

SCORE_TYPES = "a number per completion (int, float, bool, or a numpy/torch scalar)"


def _as_number(value) -> float | None:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars, 0-d arrays
        value = value.item()
    if isinstance(value, numbers.Real):  # includes bool and numpy's registered number types
        return float(value)
    return None


def to_scores(name: str, returned, expected: int, allow_none: bool = False,
              label: str | None = None) -> list[float | None]:
    """The scores a reward function returned, as floats; RewardError for a wrong count or a non-number. With
    `allow_none` a None stays None: the function does not apply to that completion (rewards/aggregation.py).
    `label` is how the message names the function (`reward NAME` by default)."""
    who = label or f"reward {name}"
    values = None
    if not isinstance(returned, (str, bytes, dict)):
        try:
            values = list(returned)
        except TypeError:  # not iterable: None, a bare number, a 0-d tensor
            pass
    if values is None:
        raise RewardError(f"{who} returned {type(returned).__name__} {shown(returned)}, not a list of "
                          f"{expected} scores; it must return {SCORE_TYPES}")
    if len(values) != expected:
        raise RewardError(f"{who} returned {len(values)} scores for {expected} completions; it must return "
                          f"{SCORE_TYPES}")
    scores: list[float | None] = []
    for i, value in enumerate(values):
        if value is None and allow_none:
            scores.append(None)
            continue
        number = _as_number(value)
        if number is None:
            raise RewardError(f"{who} returned {type(value).__name__} {shown(value)} for completion {i}; "
                              f"it must return {SCORE_TYPES}")
        scores.append(number)
    return scores


# ---- how a reward is called ------------------------------------------------------------------------------
EXTRA_FIELDS = ("messages", "environments", "completion_ids", "trainer_state", "log_metric",  # only for one that
                "log_extra")                                                                   # can take them
BY_NAME_ONLY = ("messages",)  # of those, only for one that names it (TRL passes the prompt as `prompts`)


def reward_arguments(fn, prompts, completions, fields: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of a call of `fn` as TRL makes it: by keyword, unless only the positional form binds."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature: TRL's call, every field
        return (), {"prompts": prompts, "completions": completions, **fields}
    params = signature.parameters
    free = any(p.kind is p.VAR_KEYWORD for p in params.values())
    passed = {k: v for k, v in fields.items()
              if k not in EXTRA_FIELDS or k in params or (free and k not in BY_NAME_ONLY)}
    keywords = {"prompts": prompts, "completions": completions, **passed}
    # by position only for a function that does not name `completions`: one that does and lacks another argument
    # (a column the data does not have) would get the prompts as its completions
    forms = [((), keywords)] + ([((prompts, completions), passed)] if "completions" not in params else [])
    for args, kwargs in forms:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            continue
        return args, kwargs
    return (), keywords  # fits neither: the call raises the TypeError that says why


def call_reward(fn, prompts, completions, fields: dict):
    """`fn` called as TRL calls a reward (`reward_arguments`), its coroutine run to its end."""
    args, kwargs = reward_arguments(fn, prompts, completions, fields)
    return user_code.awaited(fn(*args, **kwargs))


def said(err: BaseException) -> str:
    """`: message` of an exception for the end of a line; for one without a message (MemoryError()) what it means,
    never an empty `: `."""
    text = " ".join(str(err).split())
    if text:
        return f": {text}"
    return " (out of memory)" if isinstance(err, MemoryError) else " (with no message)"


class Scored(list):
    """What a reward function returns when it says what happened to each completion: the scores (this list) and
    `outcomes`, one short text per completion ("passed 3/4", "timeout"), whose first word is its kind; `kinds`
    are the kinds the metrics count every step, 0 included (kinds outside it are counted when they occur)."""

    def __init__(self, scores, outcomes, kinds=()):
        super().__init__(scores)
        if len(outcomes) != len(self):
            raise ValueError(f"{len(outcomes)} outcomes for {len(self)} scores")
        self.outcomes, self.kinds = [str(o) for o in outcomes], tuple(kinds)


@dataclass(frozen=True)
class Outcomes:
    """The outcome of each completion under one reward function (None: it gave none for that completion)."""

    texts: list[str | None]
    kinds: tuple[str, ...] = ()

    def select(self, rows: list[int]) -> Outcomes:
        return Outcomes([self.texts[i] for i in rows], self.kinds)

    @classmethod
    def joined(cls, parts: list[Outcomes | None], lengths: list[int]) -> Outcomes:
        """The outcomes of records joined one after another; a record without them (a round whose every call
        failed gave none) counts as None for each of its `lengths` rows."""
        kinds = next(p.kinds for p in parts if p is not None)
        return cls([t for p, n in zip(parts, lengths, strict=True) for t in (p.texts if p is not None else [None] * n)],
                   kinds)

    def counts(self) -> dict[str, int]:
        """How many completions had each kind of outcome (the first word of its text)."""
        counts = dict.fromkeys(self.kinds, 0)
        for text in self.texts:
            if text:
                kind = text.split()[0].rstrip(":")
                counts[kind] = counts.get(kind, 0) + 1
        return counts


@dataclass
class Scoring:
    """What RewardSet.score_all gives: the totals, each function's raw scores, the scores zeroed by
    on_error=zero, and the outcomes of the functions that return `Scored`."""

    totals: list[float]
    per_function: dict[str, list[float | None]]
    errors: int
    outcomes: dict[str, Outcomes]
    failures: list[str | None] = dataclasses.field(default_factory=list)  # per completion: what failed, or None
    logged: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)  # log_metric's: sum, calls
    extra: dict[str, list] = dataclasses.field(default_factory=dict)  # log_extra's columns, a value per completion

    @property
    def first_error(self) -> str | None:
        return next((text for text in self.failures if text), None)


@dataclass
class RewardFunction:
    name: str
    fn: object
    weight: float
    label: str = ""  # how a message names it: `reward NAME` unless set (an environment's `CLASS.get_reward`)
    native: bool = dataclasses.field(init=False)  # grpo-cli's own: it reads text whatever the prompts' form

    def __post_init__(self):
        self.label = self.label or f"reward {self.name}"
        self.native = is_native(self.fn)  # once, not at every scoring


def is_native(fn) -> bool:
    """Whether `fn` (a function, its partial, or an instance of a reward class) is grpo-cli's own."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) if inspect.isroutine(target) or inspect.isclass(target) \
        else type(target).__module__
    return str(module or "").startswith("grpo_cli.")


def as_conversation(prompts: list, completions: list[str], chat_prompts: list | None) -> tuple[list, list]:
    """(prompts, completions) as TRL gives them to a reward function: for prompts the data gave as chat messages
    (`chat_prompts`, each prompt's messages) those messages and each completion as [{"role": "assistant",
    "content": text}], TRL's conversational form; else the texts."""
    if chat_prompts is None:
        return prompts, completions
    return list(chat_prompts), [[{"role": "assistant", "content": text}] for text in completions]


class CompletionsFailed(Exception):
    """Raised by a reward that scored some completions and could not score the others (a service that refused,
    timed out or answered garbage): `scores` holds each scored completion's score (None where it does not apply;
    anything at the failed ones), `failed` the indices of the others. reward.on_error=zero keeps the scores and
    zeroes the failed ones without calling the function again; raise names the first failed one and why."""

    def __init__(self, message: str, scores: list, failed: list[int]):
        super().__init__(message)
        self.scores, self.failed = scores, failed



def environment_reward(environment_class) -> RewardFunction | None:
    """The environment's `get_reward()` of each episode as a reward function of weight 1 named after its class
    (TRL's), or None for a class without one. It may be async, as in TRL."""
    if not callable(getattr(environment_class, "get_reward", None)):
        return None

    def get_reward(environments, **_):
        return [user_code.awaited(env.get_reward()) for env in environments]

    name = environment_class.__name__
    return RewardFunction(name, get_reward, 1.0, label=f"environment {name}.get_reward")


# what a sample row holds already: a column logged under one of these names would replace it
SAMPLE_KEYS = ("step", "prompt", "completion", "reward", "advantage")


class Logged:
    """TRL's `log_metric(name, value)` and `log_extra(column, values)` for the reward functions of one scoring:
    the metrics' values (their mean goes to the step's row under the name given) and the extra columns (one value
    per completion; to samples.jsonl). A column logged with another count than the completions' is left out."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value) -> None:
        number = _as_number(value)
        if not isinstance(name, str) or number is None or not math.isfinite(number):
            raise RewardError(f"log_metric({name!r}, {shown(value)}): give a name and a finite number")
        if name in OWN_METRICS or name.startswith(OWN_METRIC_PREFIXES):
            raise RewardError(f"log_metric({name!r}, ...): {name} is a name of grpo-cli's own metrics "
                              "(docs/algorithm.md), which it would replace; pick another name")
        self.metrics.setdefault(name, []).append(number)

    def log_extra(self, column: str, values) -> None:
        if not isinstance(column, str) or column in SAMPLE_KEYS or column.startswith(("reward/", "outcome/")):
            raise RewardError(f"log_extra({column!r}, ...): the column name is one samples.jsonl holds already "
                              f"({', '.join(SAMPLE_KEYS)}, reward/..., outcome/...); pick another")
        self.columns.setdefault(column, []).extend(list(values))

    def totals(self) -> dict[str, tuple[float, int]]:
        """Each name's sum and number of values: what TRL adds up over the ranks before it divides."""
        return {name: (sum(values), len(values)) for name, values in self.metrics.items()}


class RewardSet:
    """The weighted sum of the configured reward functions, with per-function means for the metrics."""

    def __init__(self, functions: list[RewardFunction], on_error: str = "raise", timeout_s: float | None = None,
                 stop=None, aggregation: str = "sum"):
        self.functions = functions
        self.aggregation = aggregation
        self.on_error = on_error
        self.timeout_s, self.stop = timeout_s, stop
        self.trainer_state: Any = None  # the step's transformers.TrainerState, set by the trainer before it scores
        self.logged = Logged()  # what the functions log with log_metric / log_extra while one scoring runs

    @classmethod
    def from_config(cls, cfg_reward: RewardConfig, device=None, dtype=None, stop=None, environment=None) -> RewardSet:
        """Reward models among the functions load here, once, on `device` in `dtype` (the policy's). `environment`:
        the environment class (env._target_), whose get_reward() joins the functions."""
        functions = [RewardFunction(name, placed_reward(name, spec, device, dtype), spec.weight)
                     for name, spec in (cfg_reward.functions or {}).items()]
        owned = environment_reward(environment) if environment is not None else None
        return cls([*functions, *([owned] if owned else [])], cfg_reward.on_error, cfg_reward.timeout_s, stop,
                   cfg_reward.aggregation)

    def _call(self, rf: RewardFunction, prompts, completions, fields):
        """The function's return value; Interrupted on a stop request, user_code.FAILED when it raised or timed out."""
        state = {} if self.trainer_state is None else {"trainer_state": self.trainer_state}
        if not rf.native:  # grpo-cli's own log nothing; the verifier and the judge send every other field on
            state |= {"log_metric": self.logged.log_metric, "log_extra": self.logged.log_extra}
        return user_code.call(functools.partial(call_reward, rf.fn, prompts, completions, fields | state),
                              name=f"reward-{rf.name}", timeout_s=self.timeout_s, stop=self.stop)

    def _call_one(self, rf: RewardFunction, prompts, completions, fields, i: int):
        return self._call(rf, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in fields.items()})

    def _one_at_a_time(self, rf: RewardFunction, prompts, completions,
                       fields) -> tuple[list[float | None], int, Outcomes | None, list[str | None]]:
        """Scores of each completion on its own; those that time out or raise get 0 (on_error=zero), and the
        outcome "error" when the function gives outcomes; and what failed, per completion (None: nothing)."""
        scores: list[float | None] = []
        texts: list[str | None] = []
        failures: list[str | None] = []
        kinds: tuple[str, ...] | None = None
        errors = 0
        for i in range(len(completions)):
            try:
                returned = self._call_one(rf, prompts, completions, fields, i)
            except user_code.FAILED as failure:
                scores, errors, texts = [*scores, 0.0], errors + 1, [*texts, "error"]
                failures.append(self._failed(rf, failure, i))
            else:
                scores += to_scores(rf.name, returned, 1, allow_none=True, label=rf.label)
                texts.append(returned.outcomes[0] if isinstance(returned, Scored) else None)
                failures.append(None)
                kinds = returned.kinds if isinstance(returned, Scored) else kinds
        return scores, errors, None if kinds is None else Outcomes(texts, (*kinds, "error")), failures

    def _failed(self, rf: RewardFunction, failure: user_code.Raised | user_code.TimedOut, i: int) -> str:
        """What went wrong with completion `i` (on_error=zero says it in the step's line)."""
        if isinstance(failure, user_code.TimedOut):
            return f"{rf.label} did not return within reward.timeout_s={self.timeout_s} s on completion {i}"
        return f"{rf.label} raised {type(failure.error).__name__} on completion {i}{said(failure.error)}"

    def score(self, prompts: list, completions: list[str], fields: dict[str, list],
              group_size: int | None = None, chat_prompts: list | None = None,
              ) -> tuple[list[float], dict[str, list[float | None]], int]:
        """Return (totals per reward.aggregation, raw scores per function (None: not applicable), number of scores
        zeroed by on_error=zero). `group_size` is G, which normalize_then_sum needs. `chat_prompts`: each prompt's
        chat messages where the data gave them so: a function of the user's then gets TRL's conversational form
        (as_conversation), grpo-cli's own the texts."""
        scoring = self.score_all(prompts, completions, fields, group_size, chat_prompts)
        return scoring.totals, scoring.per_function, scoring.errors

    def score_all(self, texts_of_prompts: list, texts: list[str], fields: dict[str, list],
                  group_size: int | None = None, chat_prompts: list | None = None) -> Scoring:
        """`score`, with the outcomes of the functions that give them."""
        per_fn: dict[str, list[float | None]] = {}
        outcomes: dict[str, Outcomes] = {}
        failures: list[str | None] = [None] * len(texts)
        errors = 0
        conversation = as_conversation(texts_of_prompts, texts, chat_prompts)
        self.logged = Logged()
        for rf in self.functions:
            prompts, completions = (texts_of_prompts, texts) if rf.native else conversation
            try:
                returned = self._call(rf, prompts, completions, fields)
            except user_code.FAILED as failure:
                partial = getattr(failure, "error", None)
                if self.on_error != "zero":
                    raise self._one_line(rf, failure, prompts, completions, fields) from None
                if isinstance(partial, CompletionsFailed):
                    zeroed = [0.0 if i in partial.failed else s for i, s in enumerate(partial.scores)]
                    scores = to_scores(rf.name, zeroed, len(completions), allow_none=True)
                    failed, given = len(partial.failed), None
                    # the exception's message is that of the first it names
                    why: list[str | None] = [None] * len(completions)
                    for i in partial.failed:
                        why[i] = f"{rf.label} could not score completion {i}" + (
                            said(partial) if i == partial.failed[0] else "")
                else:
                    scores, failed, given, why = self._one_at_a_time(rf, prompts, completions, fields)
                errors, failures = errors + failed, [old or new for old, new in zip(failures, why, strict=True)]
            else:
                scores = to_scores(rf.name, returned, len(completions), allow_none=True, label=rf.label)
                given = Outcomes(returned.outcomes, returned.kinds) if isinstance(returned, Scored) else None
            if given is not None:
                outcomes[rf.name] = given
            for i, s in enumerate(scores):
                if s is not None and not math.isfinite(s):
                    if self.on_error != "zero":
                        raise RewardError(f"{rf.label} gave {s} for completion {i}; rewards must be finite (or set "
                                          "reward.on_error=zero)")
                    scores[i], errors = 0.0, errors + 1
                    failures[i] = failures[i] or f"{rf.label} gave {s} for completion {i}"
            per_fn[rf.name] = scores
        weights = {rf.name: rf.weight for rf in self.functions}
        totals = combine(weights, per_fn, self.aggregation, group_size)
        bad = next((i for i, total in enumerate(totals) if not math.isfinite(total)), None)
        if bad is not None:  # finite scores whose weighted sum overflows: the advantages would be NaN
            terms = ", ".join(f"{rf.name} {per_fn[rf.name][bad]} x weight {rf.weight:g}" for rf in self.functions)
            raise RewardError(f"the total reward of completion {bad} is {totals[bad]} ({terms}, reward.aggregation="
                              f"{self.aggregation}); rewards must sum to a finite number: lower the weights")
        extra = {column: values for column, values in self.logged.columns.items() if len(values) == len(texts)}
        return Scoring(totals, per_fn, errors, outcomes, failures, self.logged.totals(), extra)

    def _one_line(self, rf: RewardFunction, failure: user_code.Raised | user_code.TimedOut, prompts, completions,
                  fields) -> RewardError:
        if isinstance(failure, user_code.TimedOut):
            return RewardError(f"{rf.label} did not return within reward.timeout_s={self.timeout_s} s for "
                               f"{len(completions)} completions; fix it, raise reward.timeout_s or set "
                               "reward.on_error=zero")
        err = failure.error
        if isinstance(err, CompletionsFailed):
            return RewardError(f"{rf.label} could not score completion {err.failed[0]} ({len(err.failed)} of "
                               f"{len(completions)} failed){said(err)}; fix it or set reward.on_error=zero")
        index = self._first_failing(rf, prompts, completions, fields)
        where = f" on completion {index}" if index is not None else ""
        return RewardError(f"{rf.label} raised {type(err).__name__}{where}{said(err)}; fix it or set "
                           "reward.on_error=zero")

    def _first_failing(self, rf: RewardFunction, prompts, completions, fields) -> int | None:
        """Re-run one completion at a time to name the one that makes the function raise."""
        for i in range(len(completions)):
            try:
                self._call_one(rf, prompts, completions, fields, i)
            except user_code.FAILED:
                return i
        return None
