"""Text that is not text, and files that do not read: each one line naming the file and the line or byte (CSV and
JSON through `datasets` too, which says only "An error occurred while generating the dataset"), a lone surrogate
and a prompt that the tokenizer cannot take named with their row."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_TRAINER, data_config, run_cli

from grpo_cli.base.errors import DataError
from grpo_cli.tasks.prompts import encode_prompts
from grpo_cli.tasks.sources import load_rows


def refused(path) -> str:
    with pytest.raises(DataError) as err:
        load_rows(data_config(path=str(path)))
    message = str(err.value)
    assert "\n" not in message and "DatasetGenerationError" not in message, message
    return message


def test_csv_read_errors_name_the_line(tmp_path):
    fields = tmp_path / "fields.csv"
    fields.write_text('prompt,answer\n"What is 1 + 1?",2\nWhat is 2, 3 or 4?,5\n')
    assert refused(fields) == (f"{fields}:3 has 3 fields where the header has 2 (prompt, answer); quote fields that "
                               "hold commas, or fix that line")
    latin = tmp_path / "latin.csv"
    latin.write_bytes('prompt,answer\n"What is 1 + 1?",2\n"Combien font deux + trois ?",5\n"Déjà vu?",1\n'
                      .encode("latin-1"))
    offset = latin.read_bytes().index(b"\xe9")
    assert refused(latin) == (f"{latin}:4 is not valid UTF-8 (byte 0xe9 at byte offset {offset}); save the file as "
                              "UTF-8")


def test_json_read_errors_name_the_line(tmp_path):
    array = tmp_path / "array.json"
    array.write_text('[{"prompt": "What is 1 + 1?", "answer": "2"},\n {"prompt": "What is 2 + 2?" "answer": "4"}]\n')
    assert refused(array) == (f"{array}:2 is not valid JSON (Expecting ',' delimiter at column 30); fix that line")
    lines = tmp_path / "lines.json"  # JSON lines in a .json file: datasets reads those too
    lines.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "q", "answer": "4"}\n{"prompt": "q",}\n')
    assert refused(lines).startswith(f"{lines}:3 is not valid JSON (Expecting property name enclosed in double quotes")


def test_a_lone_surrogate_is_one_line_naming_its_row(tmp_path):
    """JSON's \\ud800 escape decodes to a string no tokenizer or UTF-8 file takes: the row is named, not a traceback
    from the tokenizer at the first step. Any column: the rewards and samples.jsonl get them all."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n\n'
                    '{"prompt": "What is \\ud800 + 1?", "answer": "2"}\n')
    assert refused(path) == (f'{path}:3: "prompt" holds a lone surrogate (\'\\ud800\' at character 9), which is not '
                             "text; remove it or give the whole character (a surrogate pair)")
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2", "notes": ["ok", {"x": "\\udfff"}]}\n')
    assert refused(path).startswith(f'{path}:1: "notes" holds a lone surrogate (\'\\udfff\' at character 1)')
    path.write_text('{"prompt": "A pair is text: \\ud83d\\ude00", "answer": "2"}\n')  # a surrogate pair: one emoji
    assert load_rows(data_config(path=str(path)))[0]["messages"][-1]["content"].endswith("\U0001F600")


def test_a_prompt_the_tokenizer_cannot_take_names_its_row(tmp_path):
    """A chat message whose content is a list of parts reads (some templates take them) but the tiny model's template
    does not: the row that fails is named, by file and line, not the template's TypeError; content that is no text
    at all (a number) is refused as the rows are read."""
    from grpo_cli.model.loading import load_tokenizer

    path = tmp_path / "rows.jsonl"
    parts = [{"type": "text", "text": "What is 2 + 2?"}]
    path.write_text("\n".join(json.dumps(row) for row in [
        {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"},
        {"messages": [{"role": "user", "content": parts}], "answer": "4"}]) + "\n")
    rows = load_rows(data_config(path=str(path)))
    with pytest.raises(DataError) as err:
        encode_prompts(load_tokenizer("tiny-random", False), rows, 256)
    assert str(err.value) == (f"{path}:2: the tokenizer's chat template cannot take its prompt (TypeError: can only "
                              'concatenate str (not "list") to str); fix or drop that row')
    path.write_text(json.dumps({"messages": [{"role": "user", "content": 5}], "answer": "4"}) + "\n")
    assert refused(path).startswith(f'{path}:1: "messages" is not a list of chat messages like')


@pytest.mark.slow  # a grpo-train subprocess (no model is loaded)
def test_grpo_train_names_the_row_of_a_lone_surrogate_before_the_model_loads(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is \\ud800 + 1?", "answer": "2"}\n')
    proc = run_cli([*TINY_TRAINER, "data=hf", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f'grpo-train: {path}:2: "prompt" holds a lone surrogate (\'\\ud800\' at character 9), which is not text; '
        "remove it or give the whole character (a surrogate pair)"]
    assert "training" not in proc.stdout
