"""Tables of rows: what `datasets` reads (a hub id, local .jsonl/.json/.parquet/.csv/.arrow files, a glob of them,
a save_to_disk dir), each row's prompt in one of the forms TRL accepts and its place (FILE:LINE, FILE row N) kept for
the messages that name it. tasks/sources.py's `hf` and `jsonl` sources read through here."""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_cli.base.errors import DataError, error_line
from grpo_cli.tasks.prompts import Row, chat_messages, with_suffix
from grpo_cli.tasks.unreadable import lone_surrogate, read_problem

if TYPE_CHECKING:
    from grpo_cli.config.schema import DataConfig

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
        if names is None:  # rows may differ (jsonl): each row is checked as it is read
            return
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
        if key is None or key not in row:
            raise DataError(f"{where} lacks a prompt; every row needs " + (
                f'a "{key}" field (data.prompt_column)' if key else PROMPT_FORMS))
        if self.answer and self.answer not in row:
            raise DataError(f'{where} lacks "{self.answer}" (data.answer_column); every row needs it')
        if self.answer not in (None, "answer") and "answer" in row:  # a table's columns were checked whole (check)
            raise DataError(f'{where} has a field "answer" besides data.answer_column={self.answer}, which reaches the '
                            "rewards as answer; rename one of them, or set data.answer_column=null")
        value = row[key]
        chat = not (isinstance(value, str) and key != "messages")  # given as chat messages: TRL's conversational form
        if not chat:
            messages = chat_messages(value, system_prompt, suffix)
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
        return Row({**fields, "messages": messages}, where, chat=chat)


def read_table(label: str, load: Callable, files: list[Path] | None = None) -> Table:
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


def saved_split(directory: Path, split: str, split_key: str):
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
    return BUILDERS[files[0].suffix.lower()], files  # the one builder of them all


def _local_table(key: str, path: str, split: str, split_key: str) -> Table:
    """Rows of data.path or data.eval_path (`key`): a saved dir (its split `split` if it is a DatasetDict), or files."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        with datasets_quiet():
            return read_table(str(directory), lambda: saved_split(directory, split, split_key))
    builder, files = _files(key, path)
    if files[0].suffix.lower() == ".jsonl":  # read here, not by datasets, whose errors name no line
        return Table(path, [(f"{file}:{lineno}", row) for file in files for lineno, row in numbered_jsonl(file)])
    import datasets

    label = str(files[0]) if len(files) == 1 else f"data.{key}={path}"
    if all(_holds_no_rows(f) for f in files):  # datasets calls such files unreadable
        return Table(label, [], [])
    paths = [str(f) for f in files]
    with datasets_quiet():
        return read_table(label, lambda: datasets.load_dataset(builder, data_files=paths, split="train"), files)


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
def datasets_quiet():
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

    return read_table(f"{name}{f' ({config})' if config else ''} split {split}", load)


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


def table_rows(cfg_data: DataConfig, split: str) -> list[dict]:
    table, columns = _table(cfg_data, split), Columns.of(cfg_data)
    if not table.rows:
        raise DataError(f"{table.label} holds no rows; give a non-empty dataset")
    if table.columns is not None:
        columns.check(table)
    return [columns.row(where, row, cfg_data.system_prompt, cfg_data.question_suffix) for where, row in table.rows]
