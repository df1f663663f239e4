"""data.source=hf: the same rows from every format `datasets` reads, column mapping, held-out splits, and one
line naming the file or column for every bad input."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import datasets
import pytest
from conftest import data_config, read_jsonl, run_cli

from grpo_cli.base.errors import DataError
from grpo_cli.rewards import gsm8k
from grpo_cli.tasks.sources import PromptSampler, load_rows

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": f"x{2 * i}", "topic": "sums", "level": i % 3} for i in range(7)]


def hf_cfg(**keys):
    return data_config(**keys)


def write_all_formats(directory, rows) -> dict[str, str]:
    """The same rows as parquet, CSV, JSON, jsonl, arrow and a save_to_disk dir: {format: path}."""
    dataset = datasets.Dataset.from_list(rows)
    paths = {name: str(directory / f"rows.{name}") for name in ("parquet", "csv", "json", "jsonl")}
    dataset.to_parquet(paths["parquet"])
    dataset.to_csv(paths["csv"], index=False)
    dataset.to_json(paths["json"], lines=False)  # a JSON array; .jsonl holds JSON lines
    dataset.to_json(paths["jsonl"])
    dataset.save_to_disk(str(directory / "saved"))
    paths["saved"] = str(directory / "saved")
    (arrow,) = (directory / "saved").glob("*.arrow")  # the arrow file save_to_disk writes
    paths["arrow"] = str(shutil.copy(arrow, directory / "rows.arrow"))
    return paths


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    return write_all_formats(tmp_path_factory.mktemp("formats"), ROWS)


def test_every_format_gives_the_same_rows_and_batches(formats):
    expected = [{"answer": r["answer"], "topic": r["topic"], "level": r["level"],
                 "messages": [{"role": "user", "content": r["prompt"]}]} for r in ROWS]
    for name, path in formats.items():
        rows = load_rows(hf_cfg(path=path))
        assert rows == expected, name
        batches = [PromptSampler(rows, 3, seed=5).batch(step) for step in range(4)]  # steps 2, 3 cross an epoch
        assert batches == [PromptSampler(expected, 3, seed=5).batch(step) for step in range(4)], name


def test_a_glob_reads_every_file_it_matches(tmp_path):
    for part, rows in enumerate((ROWS[:3], ROWS[3:])):
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"part-{part}.parquet"))
    answers = [r["answer"] for r in load_rows(hf_cfg(path=str(tmp_path / "part-*.parquet")))]
    assert answers == [r["answer"] for r in ROWS]


def test_columns_map_to_prompt_and_answer_and_the_rest_pass_through(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"question": "Two plus two?", "solution": "4", "source": "book"}]).to_parquet(str(path))
    [row] = load_rows(hf_cfg(path=str(path), prompt_column="question", answer_column="solution",
                             system_prompt="Be brief.", question_suffix=" Number only."))
    assert row == {"answer": "4", "source": "book", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two? Number only."}]}


def test_a_messages_column_is_the_prompt_by_default(tmp_path):
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 2?"}]
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list([{"messages": chat, "answer": "3"}]).to_parquet(str(path))
    assert load_rows(hf_cfg(path=str(path), prompt_column="prompt")) == [{"answer": "3", "messages": chat}]


def test_held_out_rows_from_eval_path_or_a_saved_split(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                                   "test": datasets.Dataset.from_list(ROWS[4:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    cfg = hf_cfg(path=str(tmp_path / "dict"), split="train", eval_split="test")
    assert [r["answer"] for r in load_rows(cfg)] == [r["answer"] for r in ROWS[:4]]
    assert [r["answer"] for r in load_rows(cfg, split="test")] == [r["answer"] for r in ROWS[4:]]
    splits["test"].to_csv(str(tmp_path / "test.csv"), index=False)
    cfg = hf_cfg(path=str(tmp_path / "dict"), eval_path=str(tmp_path / "test.csv"))
    assert [r["answer"] for r in load_rows(cfg, split="test")] == [r["answer"] for r in ROWS[4:]]


def test_gsm8k_preset_reads_any_format_and_its_reward_reads_the_solution(compose, tmp_path):
    cfg = compose(["+recipe=gsm8k", "model=tiny", "data=gsm8k_sample"])
    assert cfg.data.source == "hf" and (cfg.data.name, cfg.data.config) == ("openai/gsm8k", "main")
    parquet = tmp_path / "test.parquet"
    datasets.Dataset.from_list(read_jsonl(Path(cfg.data.eval_path))).to_parquet(str(parquet))
    from_jsonl = load_rows(cfg.data, split="test")
    cfg.data.eval_path = str(parquet)
    assert load_rows(cfg.data, split="test") == from_jsonl
    first = from_jsonl[0]
    assert first["answer"].endswith("#### 18") and first["messages"][0]["role"] == "system"
    completions = ["So she makes\n#### 18", "#### 17"]
    assert gsm8k.correctness([None] * 2, completions, answer=[first["answer"]] * 2) == [1.0, 0.0]


# ---- bad input: one line, naming the file or column -------------------------------------------------------------
def refused(cfg, split="train") -> str:
    with pytest.raises(DataError) as err:
        load_rows(cfg, split=split)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def parquet_of(tmp_path, rows=None, *, columns=None):
    path = tmp_path / "rows.parquet"
    table = datasets.Dataset.from_dict(columns) if columns is not None else datasets.Dataset.from_list(rows)
    table.to_parquet(str(path))
    return str(path)


def test_a_missing_column_is_named_with_the_columns_there_are(tmp_path):
    path = parquet_of(tmp_path, [{"question": "q", "solution": "1"}])
    message = refused(hf_cfg(path=path))
    assert message.startswith(f'{path} has no column "prompt" (data.prompt_column)') and "question, solution" in message
    message = refused(hf_cfg(path=path, prompt_column="question", answer_column="gold"))
    assert 'no column "gold" (data.answer_column)' in message and "question, solution" in message
    message = refused(hf_cfg(path=parquet_of(tmp_path, [{"question": "q", "solution": "1", "answer": "1"}]),
                             prompt_column="question", answer_column="solution"))
    assert 'a column "answer" besides data.answer_column=solution' in message


def test_a_jsonl_rows_own_answer_beside_the_answer_column_is_refused_not_overwritten(tmp_path):
    """jsonl rows may differ, so each is checked as it is read: its own "answer" would be replaced by the
    data.answer_column's value without a word."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "gold": "4"}) + "\n"
                    + json.dumps({"prompt": "3+3?", "gold": "6", "answer": "six"}) + "\n")
    message = refused(hf_cfg(path=str(path), answer_column="gold"))
    assert message.startswith(f'{path}:2 has a field "answer" besides data.answer_column=gold'), message
    assert 'has a field "answer" besides data.answer_column=gold' in message, message


def test_an_empty_split_is_refused(tmp_path):
    path = parquet_of(tmp_path, columns={"prompt": [], "answer": []})
    assert refused(hf_cfg(path=path)) == f"{path} holds no rows; give a non-empty dataset"


def test_a_prompt_column_of_another_type_is_refused(tmp_path):
    message = refused(hf_cfg(path=parquet_of(tmp_path, [{"id": 7, "answer": "1"}]), prompt_column="id"))
    assert message.startswith(f'{tmp_path / "rows.parquet"} row 0: the prompt column "id" holds int 7')
    message = refused(hf_cfg(path=parquet_of(tmp_path, [{"messages": "hi", "answer": "1"}])))
    assert '"messages" is not a list of chat messages' in message


def test_unreadable_and_missing_files_are_named(tmp_path, caplog):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    caplog.set_level(logging.DEBUG)
    assert refused(hf_cfg(path=str(broken))).startswith(f"{broken} could not be read (")
    assert not [r for r in caplog.records if r.name.startswith("datasets")]  # told once, in the one line
    odd = tmp_path / "rows.txt"
    odd.write_text("x")
    assert refused(hf_cfg(path=str(odd))).startswith(f"data.path={odd} names .txt files; give files of one format")
    message = refused(hf_cfg(path=str(tmp_path / "none-*.parquet")))
    assert message.startswith(f"data.path={tmp_path}/none-*.parquet names no file")
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"prompt": "q"}\n{oops\n')
    assert refused(hf_cfg(path=str(bad_line))).startswith(f"{bad_line}:2 is not valid JSON")


def test_splits_that_are_not_there_are_refused(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    message = refused(hf_cfg(path=str(tmp_path / "dict"), eval_split="validation"), split="test")
    assert message == f"{tmp_path / 'dict'} holds the splits train, not validation; set data.eval_split=ONE_OF_THEM"
    message = refused(hf_cfg(path=parquet_of(tmp_path, ROWS)), split="test")
    assert message.startswith("held-out prompts of data.source=hf need data.eval_path")


def test_a_hub_dataset_offline_names_the_local_alternatives(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 does at import (CI)
    message = refused(hf_cfg(name="openai/gsm8k-not-cached-here", config="main", split="train"))
    assert message.startswith("data.name=openai/gsm8k-not-cached-here could not be loaded from the hub (")
    assert "give a local copy with data.path: a .jsonl, .json, .parquet, .csv or .arrow file" in message


def test_a_missing_data_path_is_refused_by_the_schema(compose, tmp_path):
    from grpo_cli.config.compose import ConfigError
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError, match=r"data.path=.*nothing-\*.csv is invalid: no such file, glob match or dir"):
        validate(compose(["+recipe=quickstart", "model=tiny", "data=hf", f"data.path={tmp_path}/nothing-*.csv"]))


@pytest.mark.slow
def test_two_steps_from_a_parquet_file_with_extra_columns_at_the_reward(tmp_path):
    """A real run: the reward asserts that every column besides the prompt reaches it, answer renamed."""
    rows = [{"question": f"What is {i} + 1?", "gold": str(i + 1), "topic": "sums", "level": i} for i in range(4)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "column_rewards.py").write_text(
        "def columns_seen(prompts, completions, answer, topic, level, **rest):\n"
        "    assert not {'question', 'gold'} & set(rest), rest\n"
        "    assert set(topic) == {'sums'} and all(a == str(n + 1) for a, n in zip(answer, level)), (answer, level)\n"
        "    return [1.0] * len(completions)\n")
    run = tmp_path / "run"
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=hf", f"data.path={tmp_path}/train.parquet",
                    "data.prompt_column=question", "data.answer_column=gold", "data.prompts_per_step=2",
                    "algo.num_generations=2", "rollout.max_new_tokens=3", "trainer.max_steps=2",
                    "+reward.functions.columns_seen._target_=column_rewards.columns_seen", f"hydra.run.dir={run}"],
                   tmp_path, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1] and all(m["reward/columns_seen"] == 1.0 for m in metrics), metrics
    assert (run / "adapter").is_dir()


@pytest.mark.slow
def test_a_bad_column_stops_grpo_train_in_one_line(tmp_path):
    datasets.Dataset.from_list([{"question": "q", "answer": "1"}]).to_parquet(str(tmp_path / "rows.parquet"))
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=hf", f"data.path={tmp_path}/rows.parquet"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f'grpo-train: {tmp_path}/rows.parquet has no column "prompt" (data.prompt_column); its columns are question, '
        "answer: set data.prompt_column=ONE_OF_THEM"], proc.stderr
