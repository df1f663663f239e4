"""Why a local data file cannot be read, with the line or byte: `datasets` says only "An error occurred while
generating the dataset" (its cause names a line of a pandas chunk or a position in a pyarrow block, not of the
file), so a file it refuses is read here again, plainly, to find the place."""

from __future__ import annotations

import codecs
import csv
import io
import json
from pathlib import Path

from grpo_cli.base.errors import error_line


def lone_surrogate(value) -> str | None:
    """The first string in `value` (a string, or lists and dicts of them) that is no valid Unicode text (a lone
    surrogate, which JSON's \\ud800 escapes can give), shown as an escape; None when all of it is text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"{value[err.start]!a} at character {err.start + 1}"
        return None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((found for v in value if (found := lone_surrogate(v)) is not None), None)
    return None


def not_utf8(file: Path, data: bytes) -> str | None:
    """`FILE:LINE is not valid UTF-8 (byte ... at byte offset N)` for the first invalid byte, else None."""
    try:
        codecs.decode(data, "utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return (f"{file}:{line} is not valid UTF-8 (byte 0x{data[err.start]:02x} at byte offset {err.start}); save the "
                "file as UTF-8")
    return None


def json_problem(file: Path, text: str) -> str | None:
    """`FILE:LINE is not valid JSON (...)` for a JSON document (or JSON lines) that does not parse, else None."""
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg != "Extra data":
            return f"{file}:{err.lineno} is not valid JSON ({err.msg} at column {err.colno}); fix that line"
    else:
        return None
    for lineno, line in enumerate(text.splitlines(), 1):  # JSON lines, one document a line
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return f"{file}:{lineno} is not valid JSON ({err.msg} at column {err.colno}); fix that line"
    return None


def csv_problem(file: Path, text: str) -> str | None:
    """`FILE:LINE ...` for the first CSV record with more fields than the header, or that does not parse."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return None
        for record in reader:
            if len(record) > len(header):  # fewer are read as missing values
                return (f"{file}:{reader.line_num} has {len(record)} fields where the header has {len(header)} "
                        f"({', '.join(header)[:80]}); quote fields that hold commas, or fix that line")
    except csv.Error as err:
        return f"{file}:{reader.line_num} is not valid CSV ({err}); fix that line"
    return None


def read_problem(files: list[Path], err: BaseException, fix: str) -> str:
    """What makes `files` unreadable, naming the file and the line or byte where a plain read finds it; else the
    first file with the cause `datasets` gives (a binary format names no line) and `fix`."""
    for file in files:
        suffix = file.suffix.lower()
        if suffix not in (".csv", ".json"):
            continue
        data = file.read_bytes()
        problem = not_utf8(file, data)
        if problem is None:
            text = data.decode("utf-8")
            problem = json_problem(file, text) if suffix == ".json" else csv_problem(file, text)
        if problem is not None:
            return problem
    cause = err
    if type(err).__name__ == "DatasetGenerationError":  # "An error occurred while generating the dataset": its cause
        cause = err.__cause__ or err.__context__ or err
    where = str(files[0]) if len(files) == 1 else f"one of {', '.join(str(f) for f in files[:3])}"
    return f"{where} could not be read ({error_line(cause)[:200]}); {fix}"
