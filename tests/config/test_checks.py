"""Checks before work: data that would fail only after the model loaded (or never be noticed), an empty file, a key
of another option of its config group, an unwritable cache dir: each one line, exit 2, before the model loads."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import data_config, run_cli

from grpo_cli.base.errors import DataError
from grpo_cli.config.compose import unknown_key_hint
from grpo_cli.tasks.sources import check_held_out_split, load_rows

TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=3", "data.prompts_per_step=2",
        "algo.num_generations=2", "trainer.max_steps=1"]


def empty_parquet(path):
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)


@pytest.mark.parametrize("name,write", [("rows.parquet", empty_parquet), ("rows.jsonl", lambda p: p.write_text("")),
                                        ("rows.csv", lambda p: p.write_text("prompt,answer\n")),
                                        ("rows.json", lambda p: p.write_text(""))])
def test_an_empty_file_holds_no_rows(tmp_path, name, write):
    write(tmp_path / name)
    cfg = data_config(path=str(tmp_path / name), prompt_column="prompt")
    with pytest.raises(DataError, match=r"holds no rows") as err:
        load_rows(cfg)
    assert str(tmp_path / name) in str(err.value) and "could not be read" not in str(err.value)


def test_an_eval_split_of_a_single_file_is_refused_even_when_nothing_evaluates(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    cfg = data_config(path=str(tmp_path / "rows.jsonl"), eval_split="test")
    with pytest.raises(DataError, match=r"data.eval_split=test names a split, but data.path=.* is a file"):
        check_held_out_split(cfg)
    # eval_path: the held-out rows
    check_held_out_split(dataclasses.replace(cfg, eval_path=str(tmp_path / "rows.jsonl")))


def test_a_key_of_another_group_option_names_that_option():
    hint = unknown_key_hint("Could not override 'data.prompt_column'. To append to your config use "
                            "+data.prompt_column=question")
    assert hint.startswith("data.prompt_column is a key of data=hf, jsonl, gsm8k, gsm8k_sample, not of the data "
                           "option in use")
    assert "e.g. data=hf" in hint
    assert unknown_key_hint("Could not override 'algo.betta'. To append ...") is None  # no group: Hydra's words stand
    assert unknown_key_hint("Could not override 'data.nope'. To append ...") is None  # no option has it


@pytest.fixture(scope="module")
def saved_splits(tmp_path_factory):
    import datasets

    folder = tmp_path_factory.mktemp("saved") / "dd"
    row = {"prompt": "What is 1 + 1?", "answer": "2"}
    datasets.DatasetDict({"train": datasets.Dataset.from_list([row] * 4),
                          "test": datasets.Dataset.from_list([row] * 2)}).save_to_disk(str(folder))
    return folder


# (overrides, the line): every one before the model loads (no `training N steps` line, nothing in the run dir)
EARLY = {
    "group-key": (["data.source=hf", "data.prompt_column=question"],
                  "grpo-train: data.prompt_column is a key of data=hf, jsonl, gsm8k, gsm8k_sample, not of the data "
                  "option in use; pick that option, e.g. data=hf (the data group is chosen with data=OPTION, not "
                  "data.source); see `grpo-train --help` for the groups and `grpo-train --cfg job` for the keys"),
    "drop-all": (["data.max_prompt_tokens=5", "data.overlong=drop"],
                 "grpo-train: data.overlong=drop drops every one of the 5000 prompts: each is over "
                 "data.max_prompt_tokens=5 tokens (the shortest has 44); raise data.max_prompt_tokens to at least 44 "
                 "or set data.overlong=truncate"),
    "eval-split": (["data=hf", "data.path={saved}", "data.eval_split=nope"],
                   "grpo-train: {saved} holds the splits train, test, not nope; set data.eval_split=ONE_OF_THEM"),
    "empty-parquet": (["data=hf", "data.path={tmp}/empty.parquet"],
                      "grpo-train: {tmp}/empty.parquet holds no rows; give a non-empty dataset"),
}


@pytest.mark.slow  # grpo-train subprocesses (no model loads)
@pytest.mark.parametrize("case", list(EARLY))
def test_checks_come_before_the_model_loads(tmp_path, saved_splits, case):
    empty_parquet(tmp_path / "empty.parquet")
    overrides, line = EARLY[case]
    fill = {"saved": saved_splits, "tmp": tmp_path}
    run = tmp_path / "run"
    proc = run_cli([*TINY, *(o.format(**fill) for o in overrides), f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line.format(**fill)]
    assert "training" not in proc.stdout
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow  # the embedded model's tokenizer is parsed from its GGUF file (no cache to read it from)
def test_an_unwritable_cache_dir_is_one_line_naming_it_and_the_variable(tmp_path):
    """A quantized embedded base keeps a dequantized copy in the cache; HOME and XDG_CACHE_HOME under a regular file
    cannot be created (a read-only HOME, as root too)."""
    (tmp_path / "a_file").write_text("")
    cache = tmp_path / "a_file" / "cache"
    proc = run_cli(["+recipe=quickstart", "model.quantization=nf4", "trainer.device=cpu", "trainer.max_steps=1",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                   env={"HOME": str(tmp_path / "a_file" / "home"), "XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"grpo-train: the cache dir {cache}/grpo_cli cannot be written (")
    assert "point XDG_CACHE_HOME at a writable dir" in lines[0]
