"""The front door for a TRL user (issue 61): your data is read or refused, never ignored; only your rewards when you
say so; messages that say what they are."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from grpo_cli.config import ConfigError, validate
from grpo_cli.data import load_rows

ROWS = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "What is 3 + 4?", "answer": "7"}]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---- your data -----------------------------------------------------------------------------------------------
def test_a_data_file_on_a_generated_source_is_refused_in_one_line_naming_data_jsonl(tmp_path):
    """The quickstart's data option generates its prompts: data.path there was ignored (exit 0, trained on sums)."""
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data.path=train.jsonl", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("grpo-train: data.path=train.jsonl is invalid: data.source=sums generates")
    assert "data=jsonl" in lines[0] and "data=hf" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_eval_file_on_a_generated_source_is_refused_too(compose, tmp_path):
    cfg = compose(["+recipe=quickstart", f"data.eval_path={write_jsonl(tmp_path / 'test.jsonl', ROWS)}"])
    with pytest.raises(ConfigError, match=r"^data.eval_path=.* is invalid: data.source=sums generates its prompts"):
        validate(cfg)


def test_data_jsonl_reads_the_file_on_top_of_a_recipe(config, compose, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    overrides = ["+recipe=quickstart", "data=jsonl", f"data.path={path}"]
    validate(compose(overrides))
    cfg = config(overrides)
    rows = load_rows(cfg.data)
    assert [r["messages"][-1]["content"] for r in rows] == ["What is 2 + 2?", "What is 3 + 4?"]
    assert [r["answer"] for r in rows] == ["4", "7"]
    assert cfg.data.prompts_per_step == 4  # the recipe's


def test_data_jsonl_without_a_path_is_one_line(compose):
    with pytest.raises(ConfigError, match=r"^data.path=null is invalid: data.source=jsonl reads its rows from a file"):
        validate(compose(["+recipe=quickstart", "data=jsonl"]))


def test_the_question_suffix_is_added_once(config, tmp_path):
    """Rows written with the quickstart's suffix, read with the quickstart's data config (data.source=jsonl on top of
    it): the suffix was appended a second time."""
    suffix = " Answer with just the number."
    rows = [{"prompt": "What is 2 + 2?" + suffix, "answer": "4"},
            {"messages": [{"role": "user", "content": "What is 3 + 4?" + suffix}], "answer": "7"},
            {"prompt": "What is 5 + 1?", "answer": "6"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config(["+recipe=quickstart", "data.source=jsonl", f"data.path={path}"])
    assert cfg.data.question_suffix == suffix
    assert [r["messages"][-1]["content"] for r in load_rows(cfg.data)] == [
        "What is 2 + 2?" + suffix, "What is 3 + 4?" + suffix, "What is 5 + 1?" + suffix]
